import json

import pytest

from jetflow.cli import main


def test_generate_json(tiny_dir, capsys):
    rc = main(["generate", "hello", "--target", str(tiny_dir), "--json", "--max-new-tokens", "8"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {"text", "new_tokens", "seconds", "tokens_per_s", "finish_reason"} <= out.keys()
    assert 1 <= out["new_tokens"] <= 8


def test_generate_streams_text(tiny_dir, capsys):
    rc = main(["generate", "hello", "--target", str(tiny_dir), "--max-new-tokens", "8", "--no-chat",
               "--temperature", "0.8", "--seed", "1", "--top-k", "20", "--top-p", "0.9"])
    captured = capsys.readouterr()
    assert rc == 0 and "tok/s" in captured.err


@pytest.mark.parametrize("args, message", [
    (["generate", "x", "--temperature", "-1"], "temperature"),
    (["generate", "  "], "empty prompt"),
    (["generate", "x", "--target", "no/such-model-here"], "Hub"),
    (["generate", "x", "--target", "/missing.gguf"], "GGUF file not found"),
    (["generate", "x", "--top-p", "0"], "top_p"),
])
def test_bad_input_exits_2_with_message(args, message, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_argparse_rejects_bad_numbers(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "x", "--max-new-tokens", "0"])
    assert e.value.code == 2
