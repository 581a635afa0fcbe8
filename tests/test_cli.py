import json
import shutil
from pathlib import Path

import pytest

from jetflow.cli import main


def test_generate_json(tiny_dir, capsys):
    rc = main(["generate", "hello", "--target", str(tiny_dir), "--json", "--max-new-tokens", "8"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {"text", "new_tokens", "seconds", "tokens_per_s", "finish_reason"} <= out.keys()
    assert 1 <= out["new_tokens"] <= 8
    if out["new_tokens"] > 1:  # the rate after the prefill, which gave the first token
        decode_s = out["seconds"] - out["prefill_seconds"]
        assert out["decode_tokens_per_s"] == pytest.approx((out["new_tokens"] - 1) / decode_s)


def test_generate_reads_the_prompt_from_stdin_for_a_dash(tiny_dir, capsys, monkeypatch):
    import io

    args = ["--target", str(tiny_dir), "--json", "--max-new-tokens", "8"]
    assert main(["generate", "hello there\nsecond line", *args]) == 0
    direct = json.loads(capsys.readouterr().out)
    for text in ("hello there\nsecond line", "\ufeffhello there\r\nsecond line\r\n"):  # as a Windows editor saves it
        monkeypatch.setattr("sys.stdin", io.StringIO(text))
        assert main(["generate", "-", *args]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["token_ids"] == direct["token_ids"] and out["prompt_tokens"] == direct["prompt_tokens"]
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    assert main(["generate", "-", *args]) == 2 and "empty prompt" in capsys.readouterr().err


def test_stop_strings_take_backslash_escapes():
    from jetflow.cli import _unescape

    assert _unescape("\\n\\n") == "\n\n" and _unescape("a\\tb\\r") == "a\tb\r"
    assert _unescape("\\\\n") == "\\n" and _unescape("C:\\dir\\x") == "C:\\dir\\x"  # an escaped backslash; others stay


def test_serve_prefix_cache_flag_reaches_the_target(tiny_dir, monkeypatch):
    loaded = {}
    monkeypatch.setattr("jetflow.serve.server.serve", lambda load, **kw: loaded.setdefault("jf", load()))
    for value, want in (("off", False), ("on", True)):
        loaded.clear()
        assert main(["serve", "--target", str(tiny_dir), "--drafter", "none", "--prefix-cache", value]) == 0
        assert loaded["jf"].target.prefix_cache is want


def test_serve_prefix_cache_slots_reach_the_batch(tiny_dir, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr("jetflow.serve.server.serve", lambda load, **kw: seen.update(kw))
    assert main(["serve", "--target", str(tiny_dir), "--drafter", "none", "--prefix-cache-slots", "0"]) == 0
    assert seen["prefix_slots"] == 0
    with pytest.raises(SystemExit):
        main(["serve", "--target", str(tiny_dir), "--prefix-cache-slots", "-1"])
    assert "--prefix-cache-slots" in capsys.readouterr().err
    seen.clear()  # past llama.cpp's 256 sequences: refused before anything loads
    assert main(["serve", "--target", "no/such-model", "--max-batch", "254", "--prefix-cache-slots", "4"]) == 2
    assert "--max-batch 254 + --prefix-cache-slots 4 is 258; lower one" in capsys.readouterr().err and not seen


def test_generate_streams_text(tiny_dir, capsys):
    rc = main(["generate", "hello", "--target", str(tiny_dir), "--max-new-tokens", "8", "--no-chat",
               "--temperature", "0.8", "--seed", "1", "--top-k", "20", "--top-p", "0.9"])
    captured = capsys.readouterr()
    assert rc == 0 and "tok/s; prefill" in captured.err and "prompt tokens), then" in captured.err


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


@pytest.fixture(scope="module")
def tiny_drafter(tiny_dir, tmp_path_factory):
    import torch

    from jetflow.models.draft_head import DraftHead, DraftHeadConfig
    from jetflow.models.target import TargetModel

    target = TargetModel.load(str(tiny_dir))
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=8))
    return head.save_pretrained(tmp_path_factory.mktemp("drafter") / "head")


def test_generate_with_drafter_reports_tau_and_checks_lossless(tiny_dir, tiny_drafter, capsys):
    rc = main(["generate", "hello", "--target", str(tiny_dir), "--drafter", str(tiny_drafter), "--json",
               "--max-new-tokens", "12", "--budget", "16", "--width", "3", "--check-lossless"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lossless"] is True and out["rounds"] >= 1 and out["tau"] >= 1
    assert len(out["accept_lengths"]) == out["rounds"]


def test_check_lossless_fails_when_the_speculative_output_differs(tiny_dir, tiny_drafter, capsys, monkeypatch):
    """The check compares against a separate autoregressive run: a decoder that emits one wrong token
    is caught, with exit status 1, "lossless": false and the message."""
    from jetflow.decoding import speculative

    accept, calls = speculative.accept_path, []

    def one_wrong_bonus(tree, logits, *args):
        path, bonus = accept(tree, logits, *args)
        calls.append(bonus)
        return path, (bonus + 1) % logits.shape[-1] if len(calls) == 2 else bonus

    monkeypatch.setattr(speculative, "accept_path", one_wrong_bonus)
    rc = main(["generate", "hello", "--target", str(tiny_dir), "--drafter", str(tiny_drafter), "--json",
               "--max-new-tokens", "12", "--budget", "16", "--width", "3", "--check-lossless"])
    captured = capsys.readouterr()
    assert rc == 1 and json.loads(captured.out)["lossless"] is False
    assert "speculative output differs from autoregressive output" in captured.err


@pytest.mark.parametrize("weights,int8", [("auto", True), ("float", False), ("int8", True)])
def test_draft_weights_int8_on_the_cpu_unless_asked_for_float(tiny_dir, tiny_drafter, weights, int8, capsys,
                                                              monkeypatch):
    """The CPU default drafts with int8 weights; --draft-weights float keeps the float head. Either
    way the output is the target's own."""
    from jetflow.cli import build_parser
    from jetflow.pipeline import JetFlow

    built = []
    real = JetFlow.__init__
    monkeypatch.setattr(JetFlow, "__init__", lambda self, *a, **k: built.append(self) or real(self, *a, **k))
    assert main(["generate", "hello", "--target", str(tiny_dir), "--drafter", str(tiny_drafter), "--json",
                 "--max-new-tokens", "12", "--budget", "8", "--draft-weights", weights, "--check-lossless"]) == 0
    assert json.loads(capsys.readouterr().out)["lossless"] is True
    assert built[0].int8_draft is int8 and built[0].drafter.int8 is int8
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--draft-weights", "int4"])


def test_generate_with_auto_budget(tiny_dir, tiny_drafter, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path))
    rc = main(["generate", "hello", "--target", str(tiny_dir), "--drafter", str(tiny_drafter), "--json",
               "--max-new-tokens", "12", "--budget", "auto", "--check-lossless"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lossless"] is True and out["budget"] == "auto"
    assert len(list((tmp_path / "costs").glob("costs-*.json"))) == 1
    assert len(list((tmp_path / "auto_state").glob("auto-state-*.json"))) == 1  # kept for the next run
    rc = main(["generate", "hello", "--target", str(tiny_dir), "--drafter", str(tiny_drafter), "--json",
               "--max-new-tokens", "12", "--budget", "auto", "--auto-state", "none", "--check-lossless"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["lossless"] is True
    with pytest.raises(SystemExit):
        main(["generate", "x", "--budget", "fast"])


def test_compare_and_the_shipped_drafter_by_default(tiny_dir, tiny_drafter, tmp_path, capsys, monkeypatch):
    import shutil

    from jetflow.models import shipped
    from jetflow.models.resolve import resolve_model

    args = ["generate", "hello", "--target", str(tiny_dir), "--max-new-tokens", "12", "--budget", "16", "--compare"]
    monkeypatch.setattr(shipped, "DRAFTERS_DIR", tmp_path)  # no drafter shipped for this target: plain decoding
    assert main(args + ["--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["drafter"] is None and out["tau"] is None and out["lossless"] is True
    assert "no drafter ships for" in captured.err  # said, not silently plain
    shutil.copytree(tiny_drafter, tmp_path / resolve_model(str(tiny_dir)).name)  # now one is shipped
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "autoregressive" in err and "JetFlow" in err and "speed-up" in err and "text: identical" in err
    assert str(tmp_path) in err


def test_the_shipped_drafter_is_found_by_any_name_of_its_target():
    """A user who loads SmolLM2 by its hub id, a local copy's directory or the packaged GGUF's file
    gets the drafter shipped for it, as with the short name."""
    from jetflow.models.shipped import shipped_drafter

    path = shipped_drafter("smollm2-135m-instruct")
    assert path is not None and path.name == "smollm2-135m-instruct"
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1"):
        assert shipped_drafter(name) == path, name
        assert shipped_drafter(name, "dflash") == path.with_name("smollm2-135m-instruct-dflash")
    assert shipped_drafter("SmolLM2-360M-Instruct") is None and shipped_drafter("other/SmolLM2-135M-Instruct") is None


def test_drafter_errors(tiny_dir, tiny_drafter, tmp_path, capsys):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    assert main(["generate", "x", "--target", str(tiny_dir), "--drafter", str(tmp_path / "nope")]) == 2
    assert "drafter checkpoint directory not found" in capsys.readouterr().err
    assert main(["generate", "x", "--target", str(tiny_dir), "--drafter", str(tmp_path)]) == 2
    assert "not a drafter checkpoint" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("x")
    assert main(["generate", "x", "--target", str(tiny_dir), "--drafter", str(tmp_path / "a-file")]) == 2
    assert f"drafter checkpoint must be a directory (config.json + model.safetensors), got a file: {tmp_path / 'a-file'}" \
        in capsys.readouterr().err
    for value in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            main(["serve", "--shutdown-timeout", value])
        assert "--shutdown-timeout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "x", "--budget", "-1"])
    # weights that do not fit their config, a truncated weights file, a config missing a field
    for name in ("shape", "cut", "empty"):
        shutil.copytree(tiny_drafter, tmp_path / name)
    weights = load_file(tiny_drafter / "model.safetensors")
    weights["fc.weight"] = torch.zeros(3, 3)
    save_file(weights, tmp_path / "shape" / "model.safetensors")
    whole = (tiny_drafter / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "empty" / "config.json").write_text("{}")
    for name, message in (("shape", "does not match its config: fc.weight has shape [3, 3], its config needs"),
                          ("cut", "is not a readable safetensors file"),
                          ("empty", "is not a valid drafter config: missing field")):
        assert main(["generate", "x", "--target", str(tiny_dir), "--drafter", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_generate_argument_errors_come_before_loading_and_name_the_problem(tiny_dir, tiny_drafter, tmp_path,
                                                                           capsys):
    kept = tmp_path / "a-file"
    kept.write_text("keep me")
    base = ["generate", "x", "--target", str(tiny_dir), "--drafter", str(tiny_drafter), "--budget", "auto"]
    for value, message in ((str(kept), f"--auto-state {kept} is a file, not a directory"),
                           ("", "--auto-state must name a directory, got an empty string"),
                           (str(kept / "sub"), f"cannot be written: {kept} is a file")):
        assert main(base + ["--auto-state", value]) == 2
        assert message in capsys.readouterr().err
    assert kept.read_text() == "keep me"
    assert main(["generate", "x", "--target", str(tmp_path / "no-model"), "--stop", ""]) == 2  # before loading
    assert "--stop strings must be non-empty" in capsys.readouterr().err
    for flag, value, message in (("--budget", "300", "must be 'auto' or a node count in [0, 256], got 300"),
                                 ("--budget", "abc", "expected 'auto' or a node count in [0, 256], got 'abc'"),
                                 ("--budget", "-1", "must be 'auto' or a node count in [0, 256], got -1"),
                                 ("--max-new-tokens", "1.5", "expected an integer, got '1.5'")):
        with pytest.raises(SystemExit):
            main(["generate", "x", flag, value])
        assert message in capsys.readouterr().err


def test_an_auto_state_that_cannot_be_saved_loses_no_output(tiny_dir, tiny_drafter, tmp_path, capsys):
    import jetflow
    from jetflow.models.target import TargetModel

    jf = jetflow.JetFlow.from_pretrained(str(tiny_dir), str(tiny_drafter), budget="auto", cost_cache=tmp_path,
                                         auto_state=tmp_path / "state")
    jf.adaptive_budget()
    (tmp_path / "state").write_text("a file where the directory should be")  # saving fails after the request
    result = jf.generate("hello", max_new_tokens=8)
    assert result.new_tokens == 8 and "could not save the 'auto' state" in capsys.readouterr().err
    assert result.token_ids == jetflow.generate(TargetModel.load(str(tiny_dir)), "hello", max_new_tokens=8).token_ids


def test_checking_a_sampled_generation_seeds_both_runs_alike(tiny_dir, tiny_drafter, capsys):
    for extra in (["--check-lossless"], ["--compare"]):
        assert main(["generate", "hello", "--target", str(tiny_dir), "--drafter", str(tiny_drafter), "--json",
                     "--max-new-tokens", "12", "--budget", "8", "--temperature", "0.9", *extra]) == 0
        captured = capsys.readouterr()
        out = json.loads(captured.out)
        assert out["lossless"] is True and isinstance(out["seed"], int)
        assert f"sampling with seed {out['seed']} in both runs" in captured.err


def test_train_cli_end_to_end(tiny_dir, tmp_path, capsys):
    """regenerate -> train -> resume refusal, through the command line on a tiny target."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(5)))
    assert main(["regenerate", "--target", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "12",
                 "--out", str(tmp_path / "data")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["complete"] and summary["sequences"] == 5
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(8)))
    assert main(["regenerate", "--target", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "4",
                 "--exclude", str(tmp_path / "data"), "--out", str(tmp_path / "more")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["sequences"] == 3  # the 3 new ones
    with pytest.raises(SystemExit):
        main(["regenerate", "--prompts", str(prompts), "--exclude", str(tmp_path), "--out", str(tmp_path / "x")])
    assert "not a regenerated data directory" in capsys.readouterr().err
    args = ["train", "--target", str(tiny_dir), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"),
            "--block-size", "4", "--layers", "1", "--batch", "2", "--epochs", "2", "--warmup", "1"]
    assert main(args) == 0
    assert (tmp_path / "run" / "drafter" / "config.json").is_file()
    assert main(args) == 2 and "--resume" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0
    capsys.readouterr()
    # --target-layers: a new head's taps; a resumed run keeps them (a head on the target's default
    # layers would not take the run's weights), and layers the target lacks are named.
    taps = args[:6] + [str(tmp_path / "taps")] + args[7:]
    assert main(taps + ["--target-layers", "2,1"]) == 0
    layers = lambda: json.loads((tmp_path / "taps" / "drafter" / "config.json").read_text())["dflash_config"]
    assert layers()["target_layer_ids"] == [1, 2]
    assert main(taps + ["--resume"]) == 0 and layers()["target_layer_ids"] == [1, 2]
    capsys.readouterr()
    assert main(args[:6] + [str(tmp_path / "taps4")] + args[7:] + ["--target-layers", "1,4"]) == 2
    assert "--target-layers: tapped layers [1, 4] must be non-empty ids in [0, 4)" in capsys.readouterr().err
    subset = args[:6] + [str(tmp_path / "sub")] + args[7:] + ["--max-sequences", "3"]
    assert main(subset) == 0  # 3 sequences, none held out: 1 step per epoch
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary.pop("seconds") >= 0 and summary == {"step": 2, "total_steps": 2, "train_sequences": 3}
    assert main(subset + ["--max-seconds", "-1"]) == 2 and "max_seconds" in capsys.readouterr().err
    more = args[:6] + [str(tmp_path / "sub9")] + args[7:] + ["--max-sequences", "9"]
    assert main(more) == 2 and "holds only 5" in capsys.readouterr().err
    eagle = args[:6] + [str(tmp_path / "eagle")] + args[7:] + ["--head", "eagle3", "--ttt-steps", "2"]
    assert main(eagle) == 0
    cfg = json.loads((tmp_path / "eagle" / "drafter" / "config.json").read_text())
    assert cfg["kind"] == "eagle3" and cfg["architectures"] == ["JetFlowEagle3Model"]
    assert main(["train", "--target", str(tiny_dir), "--data", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "manifest.json" in capsys.readouterr().err


def test_cache_and_train_on_several_data_directories(tiny_dir, tmp_path, capsys):
    """A cache over one regeneration is extended to a second one given after it: the full parts
    already built are kept (not recomputed), and training reads both directories in order;
    data-stats counts their answer tokens by prompt source."""
    from jetflow.data.shards import list_shards, read_shard

    for name, n in (("a", 6), ("b", 3)):
        prompts = tmp_path / f"{name}.jsonl"
        prompts.write_text("\n".join(json.dumps({"id": f"{name}{i}", "prompt": f"{name} question {i}"}) for i in range(n)))
        assert main(["regenerate", "--target", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "10",
                     "--out", str(tmp_path / name)]) == 0
    cache = ["cache-teacher", "--target", str(tiny_dir), "--out", str(tmp_path / "cache"), "--top-k", "8",
             "--part-size", "4", "--data", str(tmp_path / "a")]
    assert main(cache) == 0
    first = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert main(cache + ["--data", str(tmp_path / "b")]) == 0
    both = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert both["num_sequences"] == 9 and both["source"] == f"{tmp_path / 'a'},{tmp_path / 'b'}"
    assert both["parts"]["part-00000.safetensors"] == first["parts"]["part-00000.safetensors"]  # kept as built
    assert both["parts"]["part-00001.safetensors"] != first["parts"]["part-00001.safetensors"]  # 2 -> 4 sequences
    capsys.readouterr()
    train = ["train", "--target", str(tiny_dir), "--data", str(tmp_path / "a"), "--data", str(tmp_path / "b"),
             "--out", str(tmp_path / "run"), "--block-size", "4", "--layers", "1", "--batch", "1", "--epochs", "1",
             "--warmup", "1", "--teacher-cache", str(tmp_path / "cache")]
    assert main(train) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["train_sequences"] == 8  # 9, 1 held out
    swapped = train[:4] + [str(tmp_path / "b"), "--data", str(tmp_path / "a")] + train[7:]
    assert main(swapped[:-2] + ["--resume"]) == 2 and "other sequences" in capsys.readouterr().err
    assert main(train[:7] + ["--data", str(tmp_path / "a")] + train[7:] + ["--resume"]) == 2
    assert "given twice" in capsys.readouterr().err
    assert main(["data-stats", "--data", str(tmp_path / "a"), "--data", str(tmp_path / "b"), "--json",
                 "--long-answer", "10"]) == 0
    stats = json.loads(capsys.readouterr().out)
    answers = {f"{d}.jsonl": sum(s.answer_len for p in list_shards(tmp_path / d) for s in read_shard(p)) for d in "ab"}
    assert stats["sequences"] == 9 and stats["answer_tokens"] == sum(answers.values()) > 0
    assert {k: v["answer_tokens"] for k, v in stats["sources"].items()} == answers
    assert stats["answers_of_10_tokens_or_more"] == sum(v["answers_of_10_or_more"] for v in stats["sources"].values())
    assert [v["shards"] for v in stats["directories"].values()] == [1, 1]
    assert main(["data-stats", "--data", str(tmp_path / "cache")]) == 2 and "no token shards" in capsys.readouterr().err


def test_cache_teacher_and_reduced_vocab_training_cli(tiny_dir, tmp_path, capsys, monkeypatch):
    """regenerate -> cache-teacher (killed and resumed) -> train with the cache, a reduced vocabulary
    and snapshots; bad options are refused with a message."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(6)))
    assert main(["regenerate", "--target", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "12",
                 "--out", str(tmp_path / "data")]) == 0
    cache = ["cache-teacher", "--target", str(tiny_dir), "--data", str(tmp_path / "data"), "--out",
             str(tmp_path / "cache"), "--layers", "2,1", "--top-k", "8", "--part-size", "4"]
    assert main(cache) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["complete"] and summary["sequences"] == 6
    train = ["train", "--target", str(tiny_dir), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"),
             "--block-size", "4", "--layers", "1", "--batch", "1", "--epochs", "2", "--warmup", "1",
             "--draft-vocab", "40", "--snapshot-at", "0.5", "--teacher-cache", str(tmp_path / "cache")]
    taps = train[:6] + [str(tmp_path / "taps")] + train[7:]
    assert main(taps) == 0  # a new head reads the cache's layers (given as 2,1: sorted), not the target's default
    assert json.loads((tmp_path / "taps" / "drafter" / "config.json").read_text())["dflash_config"][
        "target_layer_ids"] == [1, 2]
    parts = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert main(cache[:-6] + ["--top-k", "8"]) == 2  # other layers into the same dir: refused, nothing lost
    assert "other settings" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == parts
    assert main(["cache-teacher", "--target", str(tiny_dir), "--data", str(tmp_path / "data"), "--out",
                 str(tmp_path / "cache2"), "--top-k", "8"]) == 0
    train[-1] = str(tmp_path / "cache2")
    assert main(train) == 0
    cfg = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 40
    # data-stats: the share of answer tokens the reduced vocabulary covers, counted one by one here
    from jetflow.data.shards import list_shards, read_shard
    from jetflow.models.checkpoint import load_drafter

    capsys.readouterr()
    drafter = str(tmp_path / "run" / "drafter")
    assert main(["data-stats", "--data", str(tmp_path / "data"), "--drafter", drafter, "--json"]) == 0
    cover = json.loads(capsys.readouterr().out)["draft_vocabulary_coverage"][drafter]
    ids = set(load_drafter(drafter).draft_ids.tolist())
    answers = [t for p in list_shards(tmp_path / "data") for s in read_shard(p) for t in s.token_ids[s.prompt_len:]]
    assert cover["all"] == pytest.approx(sum(t in ids for t in answers) / len(answers))
    assert main(["data-stats", "--data", str(tmp_path / "data"), "--drafter", str(tmp_path)]) == 2
    assert "not a drafter checkpoint" in capsys.readouterr().err
    assert len(list((tmp_path / "run" / "snapshots").iterdir())) == 1
    capsys.readouterr()
    assert main(["cache-teacher", "--target", str(tiny_dir), "--data", str(tmp_path / "data"), "--out",
                 str(tmp_path / "cache3"), "--top-k", "8", "--part-size", "2"]) == 0
    subset = train[:6] + [str(tmp_path / "sub")] + train[7:-1] + [str(tmp_path / "cache3"), "--max-sequences", "3"]
    assert main(subset) == 2 and "multiple of 2" in capsys.readouterr().err
    assert main(subset[:-1] + ["4"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["train_sequences"] == 4
    warm = train + ["--init-from", str(tmp_path / "run" / "drafter"), "--out", str(tmp_path / "warm")]
    assert main(warm) == 0
    assert main(warm[:-2] + ["--draft-vocab", "30", "--out", str(tmp_path / "w2")]) == 2
    assert "--draft-vocab 30 (checkpoint: 40)" in capsys.readouterr().err
    assert main(train[:-2] + ["--snapshot-at", "1.5", "--out", str(tmp_path / "r2")]) == 2
    assert "snapshot-at" in capsys.readouterr().err
    assert main(cache[:-2] + ["--layers", "1,x"]) == 2 and "--layers" in capsys.readouterr().err
    # A cache of only the first sequences (what `train --max-sequences` reads), then offline acceptance.
    assert main(["cache-teacher", "--target", str(tiny_dir), "--data", str(tmp_path / "data"), "--out",
                 str(tmp_path / "cache4"), "--top-k", "8", "--part-size", "2", "--max-sequences", "4"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["sequences"] == 4
    assert main(subset[:-3] + [str(tmp_path / "cache4"), "--max-sequences", "4", "--out", str(tmp_path / "sub4")]) == 0
    capsys.readouterr()
    offline = ["eval-offline", "--target", str(tiny_dir), "--drafter", str(tmp_path / "run" / "drafter"),
               "--drafter", str(tmp_path / "sub4" / "drafter"), "--data", str(tmp_path / "data"),
               "--teacher-cache", str(tmp_path / "cache2"), "--sequences", "4:6", "--budgets", "1,8",
               "--out", str(tmp_path / "offline.json")]
    assert main(offline) == 0
    report = json.loads((tmp_path / "offline.json").read_text())
    assert report["sequences"] == [4, 6] and len(report["drafters"]) == 2
    for row in report["drafters"].values():
        assert row["mode"] == "decode" and row["rounds"]["1"] > 0 and 1 <= row["tau"]["1"] <= 9
    assert not (tmp_path / "offline.json.partial.jsonl").exists()  # the journal goes once the report is written
    # A journal left by an interrupted replay with other settings: refused by name, and kept.
    (tmp_path / "offline.json.partial.jsonl").write_text('{"settings": {"width": 3}}\n')
    assert main(offline) == 2 and "other settings (anchors_per_seq" in capsys.readouterr().err
    assert (tmp_path / "offline.json.partial.jsonl").read_text() == '{"settings": {"width": 3}}\n'
    (tmp_path / "offline.json.partial.jsonl").unlink()
    assert main(offline[:-2] + ["--teacher-cache", str(tmp_path / "cache4")]) == 2  # cache stops at 4
    assert "does not cover" in capsys.readouterr().err
    assert main(offline[:-6] + ["--sequences", "5:99"]) == 2 and "outside" in capsys.readouterr().err
    assert main(offline[:-4] + ["--budgets", "0"]) == 2 and "--budgets" in capsys.readouterr().err
    import jetflow.eval.offline_acceptance as replay
    from jetflow.decoding.mixed_drafter import MATCH_ROW_STARTS, REQUEST_PRIOR
    from jetflow.eval.replay_journal import ReplayJournal

    journals = []
    monkeypatch.setattr(replay, "ReplayJournal", lambda path, settings: journals.append(settings)
                        or ReplayJournal(path, settings))
    assert main(offline + ["--lookup"]) == 0  # head and lookup chain in one tree, as decoding builds them
    # the journal records how chains are priced: one of an older pricing is refused, as other settings are
    assert journals[-1]["lookup_pricing"] == {"rows": list(MATCH_ROW_STARTS), "request_prior": REQUEST_PRIOR}
    assert all(row["lookup"] for row in json.loads((tmp_path / "offline.json").read_text())["drafters"].values())
    assert main(offline + ["--lookup", "--anchors-per-seq", "4"]) == 2 and "lookup" in capsys.readouterr().err
    assert main(offline + ["--lookup-session"]) == 0  # the lookup counts carried across the sequences
    rows = json.loads((tmp_path / "offline.json").read_text())["drafters"].values()
    assert all(row["lookup"] and row["lookup_session"] for row in rows)
    # Per-depth agreement at every answer anchor, the same held-out sequences, online and cached.
    agree = ["eval-agreement", "--target", str(tiny_dir), "--drafter", str(tmp_path / "run" / "drafter"),
             "--data", str(tmp_path / "data"), "--sequences", "4:6", "--max-depth", "3",
             "--out", str(tmp_path / "agree.json")]
    assert main(agree) == 0
    online = json.loads((tmp_path / "agree.json").read_text())["drafters"]
    assert main(agree + ["--teacher-cache", str(tmp_path / "cache2")]) == 0
    cached = json.loads((tmp_path / "agree.json").read_text())["drafters"]
    for row in (online, cached):
        (stats,) = row.values()
        assert stats["kind"] == "block" and len(stats["agreement"]) == 3 and stats["counts"][0] > stats["counts"][2]
    assert [r["counts"] for r in online.values()] == [r["counts"] for r in cached.values()]
    assert main(agree[:-4] + ["--max-depth", "99"]) == 2 and "beyond" in capsys.readouterr().err
    # Tree calibration: fitted on sequences the head did not train on (here all of them, for records),
    # written next to untouched weights; refused without saying which sequences, or on too few.
    calibrate = ["calibrate", "--target", str(tiny_dir), "--drafter", drafter, "--data", str(tmp_path / "data"),
                 "--teacher-cache", str(tmp_path / "cache2")]
    assert main(calibrate) == 2 and "--held-out" in capsys.readouterr().err
    assert main(calibrate + ["--held-out", "--sequences", "0:6"]) == 2 and "not both" in capsys.readouterr().err
    assert main(calibrate + ["--sequences", "0:6", "--max-sequences", "3"]) == 2
    assert "goes with --held-out" in capsys.readouterr().err
    assert main(calibrate + ["--sequences", "4:6", "--out", str(tmp_path / "cal")]) == 2
    assert "too few calibration records" in capsys.readouterr().err and not (tmp_path / "cal").exists()
    assert main(calibrate + ["--sequences", "0:6", "--out", str(tmp_path / "cal"), "--report",
                             str(tmp_path / "cal.json")]) == 0
    fitted = json.loads((tmp_path / "cal" / "config.json").read_text())["tree_calibration"]
    report = json.loads((tmp_path / "cal.json").read_text())
    assert len(fitted["main"]) == 3 and fitted == report["calibration"] and report["reliability"][0]["depth"] == 1
    assert (tmp_path / "cal" / "model.safetensors").read_bytes() == (Path(drafter) / "model.safetensors").read_bytes()
    assert "tree_calibration" not in json.loads((Path(drafter) / "config.json").read_text())
    assert main(offline[:3] + ["--drafter", str(tmp_path / "cal")] + offline[7:]) == 0
    assert all(r["calibrated"] for r in json.loads((tmp_path / "offline.json").read_text())["drafters"].values())
    assert main(offline[:3] + ["--drafter", str(tmp_path / "cal")] + offline[7:] + ["--no-calibration"]) == 0
    assert not any(r["calibrated"] for r in json.loads((tmp_path / "offline.json").read_text())["drafters"].values())
    # In place (no --out): the same directory gets the calibration, its weights unchanged.
    # Its subdirectories (a clone's .git) stay, and so do a user's backups named like it.
    shutil.copytree(drafter, tmp_path / "inplace")
    (tmp_path / "inplace" / ".git").mkdir()
    (tmp_path / "inplace" / ".git" / "HEAD").write_text("ref: refs/heads/main")
    shutil.copytree(drafter, tmp_path / "inplace.old")
    shutil.copytree(drafter, tmp_path / "inplace.new")
    assert main(calibrate[:4] + [str(tmp_path / "inplace")] + calibrate[5:] + ["--sequences", "0:6"]) == 0
    assert json.loads((tmp_path / "inplace" / "config.json").read_text())["tree_calibration"] == fitted
    assert (tmp_path / "inplace" / ".git" / "HEAD").read_text() == "ref: refs/heads/main"
    # A hub snapshot's files are relative links into its blobs: the calibrated copy holds the files
    linked = tmp_path / "snapshot" / "rev"
    linked.mkdir(parents=True)
    shutil.copy(Path(drafter) / "model.safetensors", tmp_path / "snapshot" / "blob")
    (linked / "model.safetensors").symlink_to("../blob")
    shutil.copy(Path(drafter) / "config.json", linked / "config.json")
    assert main(calibrate[:4] + [str(linked)] + calibrate[5:] + ["--sequences", "0:6", "--out",
                                                                 str(tmp_path / "cal-linked")]) == 0
    copied = tmp_path / "cal-linked" / "model.safetensors"
    assert not copied.is_symlink() and copied.read_bytes() == (Path(drafter) / "model.safetensors").read_bytes()
    for backup in ("inplace.old", "inplace.new"):
        assert (tmp_path / backup / "config.json").read_text() == (Path(drafter) / "config.json").read_text()
    # A wider draft vocabulary: the same weights, every old id kept, the calibration dropped (its
    # log-probs change); refused in place and for a smaller size.
    widen = ["draft-vocab", "--target", str(tiny_dir), "--drafter", str(tmp_path / "cal"), "--data",
             str(tmp_path / "data"), "--size", "60", "--out", str(tmp_path / "wide")]
    assert main(widen) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["draft_vocab"] == [40, 60]
    from safetensors.torch import load_file

    from jetflow.models.checkpoint import load_drafter

    config = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert config["draft_vocab_size"] == 60 and "tree_calibration" not in config
    old, new = load_drafter(tmp_path / "cal"), load_drafter(tmp_path / "wide")
    assert set(old.draft_ids.tolist()) < set(new.draft_ids.tolist())
    before, after = load_file(tmp_path / "cal" / "model.safetensors"), load_file(tmp_path / "wide" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(before[k].equal(after[k]) for k in before if k not in ("d2t", "t2d"))
    assert main(widen[:-1] + [str(tmp_path / "cal")]) == 2 and "new directory" in capsys.readouterr().err
    # A run trained on its first --max-sequences: only that run's training split is counted.
    from jetflow.models.draft_vocab import token_counts
    from jetflow.models.loading import load_target
    from jetflow.training.trainer import EVAL_SEQUENCES, held_out_split, load_sequences

    assert main(widen[:-1] + [str(tmp_path / "wide5"), "--max-sequences", "5"]) == 0
    covered = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["training_answer_tokens_covered"]
    tiny = load_target(str(tiny_dir), backend="torch")
    for n, share in ((5, covered[0]), (6, None)):
        seqs = load_sequences(tmp_path / "data", tiny, n)
        counts = token_counts((seqs[i] for i in held_out_split(n, 0, EVAL_SEQUENCES)[1]), tiny.vocab_size)
        brute = float(counts[old.draft_ids.numpy()].sum() / counts.sum())
        if share is not None:
            assert share == pytest.approx(brute)
        else:
            assert covered[0] != pytest.approx(brute)  # (the whole data's split counts other answers)
    assert main(widen[:-3] + ["30", "--out", str(tmp_path / "narrow")]) == 2
    assert "only grows" in capsys.readouterr().err and not (tmp_path / "narrow").exists()


def test_flash_attention_is_off_unless_asked_for(tiny_dir, monkeypatch, capsys):
    import jetflow.pipeline as pipeline

    seen = []
    real = pipeline.load_target
    monkeypatch.setattr(pipeline, "load_target", lambda *a, **k: seen.append(k["flash_attn"]) or real(*a, **k))
    for extra in ([], ["--flash-attn", "on"], ["--flash-attn", "off"]):
        assert main(["generate", "x", "--target", str(tiny_dir), "--drafter", "none", "--max-new-tokens", "2",
                     "--json", *extra]) == 0
    assert seen == [False, True, False]
    assert capsys.readouterr().err.count("--flash-attn on: llama.cpp's fused attention") == 1  # said when on
    with pytest.raises(SystemExit):
        main(["generate", "x", "--flash-attn", "yes"])


def test_pipeline_commands_refuse_a_bad_out_before_loading(tiny_dir, tiny_drafter, tmp_path, capsys):
    kept = tmp_path / "a-file"
    kept.write_text("keep me")
    (tmp_path / "run" / "drafter").mkdir(parents=True)
    (tmp_path / "run" / "drafter" / "mine.txt").write_text("mine")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    for args, message in (
            (["regenerate", "--prompts", str(prompts), "--out", str(kept)], "is a file, not a directory"),
            (["cache-teacher", "--data", str(tmp_path), "--out", str(kept)], "is a file, not a directory"),
            (["train", "--data", str(tmp_path), "--out", str(kept)], "is a file, not a directory"),
            (["train", "--data", str(tmp_path), "--out", str(tmp_path / "run")], "holds other files (mine.txt)")):
        assert main([args[0], "--target", "/no/such/model", *args[1:]]) == 2, args  # refused before loading
        assert message in capsys.readouterr().err
    assert kept.read_text() == "keep me" and (tmp_path / "run" / "drafter" / "mine.txt").read_text() == "mine"
    assert main(["data-stats", "--data", str(tmp_path), "--data", str(tmp_path)]) == 2
    assert "a data directory is given twice" in capsys.readouterr().err
    assert main(["draft-vocab", "--target", str(tiny_dir), "--drafter", str(tiny_drafter), "--data", str(tmp_path),
                 "--size", "100000", "--out", str(tmp_path / "wide")]) == 2
    assert "--size must be at most the target's vocabulary" in capsys.readouterr().err


def test_eval_and_checkpoint_commands_refuse_a_bad_out_before_loading(tiny_drafter, tmp_path, capsys):
    """A report path that is a directory, a budget beyond 256, and an --out that already holds
    another checkpoint are refused before the model loads (--target does not exist), and nothing
    there is touched; --overwrite lets a checkpoint be replaced."""
    taken = tmp_path / "another-head"
    taken.mkdir()
    (taken / "config.json").write_text("{}")
    a_dir = tmp_path / "a-dir"
    a_dir.mkdir()
    seq = ["--sequences", "0:1"]
    from jetflow.models.checkpoint import load_drafter

    config = load_drafter(tiny_drafter).config  # an EAGLE head's checkpoint of the same shape
    config.kind = "eagle3"
    eagle = tmp_path / "eagle"
    shutil.copytree(tiny_drafter, eagle)
    (eagle / "config.json").write_text(json.dumps(config.to_json()))
    config.kind, config.draft_vocab_size = "block", 50  # a reduced-vocabulary head's config (its weights unread)
    reduced = tmp_path / "reduced"
    shutil.copytree(tiny_drafter, reduced)
    (reduced / "config.json").write_text(json.dumps(config.to_json()))
    for args, message in (
            (["eval-offline", "--drafter", str(tiny_drafter), "--out", str(a_dir)], "is a directory, not a file"),
            (["eval-offline", "--drafter", str(tiny_drafter), "--budgets", "16,999"], "--budgets must be in [1, 256]"),
            (["eval-agreement", "--drafter", str(tiny_drafter), "--out", str(a_dir)], "is a directory, not a file"),
            (["calibrate", "--drafter", str(tiny_drafter), *seq, "--report", str(a_dir)], "is a directory, not a file"),
            (["calibrate", "--drafter", str(tiny_drafter), *seq, "--out", str(taken)], "--overwrite replaces it"),
            (["draft-vocab", "--drafter", str(tiny_drafter), "--size", "10", "--out", str(taken)],
             "--overwrite replaces it"),
            # what the head's config.json says already decides these: no model or data loads for them
            (["draft-vocab", "--drafter", str(tiny_drafter), "--size", "10", "--out", str(tmp_path / "w")],
             "the head already predicts the whole vocabulary"),
            (["draft-vocab", "--drafter", str(reduced), "--size", "30", "--out", str(tmp_path / "w")],
             "a draft vocabulary only grows: the head has 50 ids, asked for 30"),
            (["draft-vocab", "--drafter", str(reduced), "--size", "300", "--out", str(tmp_path / "w")],
             "--size must be at most the target's vocabulary, 272"),
            (["calibrate", "--drafter", str(eagle), *seq], "tree calibration is for block heads")):
        assert main([args[0], "--target", "/no/such/model", "--data", str(tmp_path), *args[1:]]) == 2, args
        assert message in capsys.readouterr().err, args
    for command in ("eval-offline", "eval-agreement", "calibrate"):  # a malformed range: before any model loads
        with pytest.raises(SystemExit):
            main([command, "--target", "/no/such/model", "--data", str(tmp_path), "--drafter", str(tiny_drafter),
                  "--sequences", "10:x"])
        assert "sequence range must look like START:END" in capsys.readouterr().err, command
    # with --overwrite the checkpoint check passes and the missing model is what fails
    assert main(["calibrate", "--target", "/no/such/model", "--data", str(tmp_path), "--drafter", str(tiny_drafter),
                 *seq, "--out", str(taken), "--overwrite"]) == 2
    assert "--overwrite" not in capsys.readouterr().err
    assert (taken / "config.json").read_text() == "{}" and not any(a_dir.iterdir())


def test_train_target_layers_are_checked_and_conflicts_refused_before_the_model_loads(tiny_drafter, tmp_path,
                                                                                      capsys):
    """Malformed --target-layers, and layers that a trained head (--init-from, the run --resume
    continues) or the teacher cache does not read, are refused from files alone: --target does not exist."""
    from jetflow.training.teacher_cache import FORMAT

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({"format": FORMAT, "tapped_layers": [1, 2]}))
    run = tmp_path / "run"  # a run to resume, its head reading the tiny target's default layers 0..3
    (run / "trainer_state").mkdir(parents=True)
    shutil.copytree(tiny_drafter, run / "drafter")
    train = ["train", "--target", "/no/such/model", "--data", str(tmp_path), "--out", str(tmp_path / "new")]
    for extra, message in (
            (["--target-layers", "1,x"], "--target-layers must be comma-separated integers, got '1,x'"),
            (["--target-layers", "1,-2"], "--target-layers are 0-based layer ids"),
            (["--target-layers", "2,1,2"], "--target-layers names a layer twice"),
            (["--target-layers", "2,0", "--teacher-cache", str(cache)],
             f"--target-layers asks for target layers [0, 2] but --teacher-cache {cache} holds [1, 2]: build a "
             "teacher cache of those layers (`jetflow cache-teacher --layers 0,2`), or drop --target-layers"),
            (["--target-layers", "1,2", "--init-from", str(tiny_drafter)],
             "reads target layers [0, 1, 2, 3] but --target-layers asks for [1, 2]: a trained head keeps the layers "
             "it was trained on; drop --target-layers"),
            (["--init-from", str(tiny_drafter), "--teacher-cache", str(cache)], "cache-teacher --layers 0,1,2,3"),
            (["--out", str(run), "--resume", "--target-layers", "1"],
             f"the run in {run} (--resume) reads target layers [0, 1, 2, 3] but --target-layers asks for [1]")):
        assert main(train + extra) == 2, extra
        assert message in capsys.readouterr().err, extra
    # layers that agree pass, and the missing model is what fails
    for extra in (["--target-layers", "2,1", "--teacher-cache", str(cache)],
                  ["--out", str(run), "--resume", "--target-layers", "0,1,2,3"]):
        assert main(train + extra) == 2
        assert "cannot resolve model '/no/such/model'" in capsys.readouterr().err, extra
    assert sorted(p.name for p in (run / "drafter").iterdir()) == sorted(p.name for p in tiny_drafter.iterdir())



def test_layers_of_a_cache_begun_unsorted_keep_its_order(tmp_path):
    """A teacher cache written before layer ids were sorted holds its features in the order it was
    asked for: the same layers given sorted agree with it, and a new head, or the completed cache,
    takes the cache's order (its features' order), not the sorted one."""
    from jetflow.cli import _stored_layer_order
    from jetflow.training.run import head_target_layers
    from jetflow.training.teacher_cache import FORMAT

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({"format": FORMAT, "tapped_layers": [2, 0, 1]}))
    assert head_target_layers(tmp_path / "new", target_layers=[0, 1, 2], teacher_cache=cache)[1] == [2, 0, 1]
    assert head_target_layers(tmp_path / "new", teacher_cache=cache)[1] == [2, 0, 1]
    assert _stored_layer_order(cache, [0, 1, 2]) == [2, 0, 1]
    assert _stored_layer_order(cache, [0, 1]) == [0, 1]  # other layers: refused later as other settings
    assert _stored_layer_order(tmp_path / "empty", [0, 1, 2]) == [0, 1, 2]


def test_data_stats_reports_long_answers_and_names_a_bad_directory(tmp_path, capsys):
    from jetflow.data.shards import Sequence, write_shard

    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "shard-00000.npz", [Sequence("gsm8k/0", list(range(30)), 10),
                                          Sequence("sharegpt/1", list(range(8)), 4)], vocab_size=100)
    assert main(["data-stats", "--data", str(data), "--long-answer", "10"]) == 0
    out = capsys.readouterr().out
    assert "1 answers of 10+ tokens" in out and "| gsm8k | 1 | 20 | 83.3% | 1 |" in out
    for path, message in ((tmp_path / "missing", "not found"), (data / "shard-00000.npz", "is a file")):
        assert main(["data-stats", "--data", str(path)]) == 2
        assert message in capsys.readouterr().err
    (data / "manifest.json").write_text("[1, 2]")
    assert main(["data-stats", "--data", str(data)]) == 2
    assert "manifest.json is not a `jetflow regenerate` manifest (a JSON list" in capsys.readouterr().err
    (data / "manifest.json").write_text("{cut")
    assert main(["data-stats", "--data", str(data)]) == 2
    assert "manifest.json is not readable JSON" in capsys.readouterr().err
    (data / "manifest.json").unlink()
    shard = (data / "shard-00000.npz").read_bytes()
    for damaged in (shard[:len(shard) // 2], b""):  # cut, and empty
        (data / "shard-00000.npz").write_bytes(damaged)
        assert main(["data-stats", "--data", str(data)]) == 2
        assert "shard-00000.npz is not a readable token shard" in capsys.readouterr().err


def test_the_cli_and_the_python_api_pick_the_same_device_and_dtype(monkeypatch):
    import torch

    from jetflow.errors import JetFlowError
    from jetflow.models.loading import default_device_and_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device_and_dtype() == ("cuda", torch.bfloat16)
    assert default_device_and_dtype(backend="llamacpp") == ("cpu", torch.float32)  # llama.cpp runs on the CPU
    assert default_device_and_dtype("cpu") == ("cpu", torch.float32)
    assert default_device_and_dtype(None, torch.float16) == ("cuda", torch.float16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device_and_dtype() == ("cpu", torch.float32)
    for device in ("gpu", "cuda:99" if torch.backends.cuda.is_built() else "cuda"):
        with pytest.raises(JetFlowError, match=f"device '{device}' is not usable here"):
            default_device_and_dtype(device)  # what from_pretrained(device=...) and the CLI both hit
    import inspect

    from jetflow.pipeline import JetFlow
    params = inspect.signature(JetFlow.from_pretrained).parameters
    assert params["device"].default is None and params["dtype"].default is None  # (resolved as above)


def test_json_reports_are_staged_in_files_of_their_own(tmp_path):
    """A report written atomically leaves a user's NAME.tmp alone, and one that cannot be written
    (a directory in its place) raises OSError and leaves no staging file behind."""
    from jetflow.utils.fs import write_json_atomic

    (tmp_path / "rep.tmp").write_text("my notes")
    write_json_atomic(tmp_path / "rep.json", {"a": 1})
    assert (tmp_path / "rep.tmp").read_text() == "my notes" and json.loads((tmp_path / "rep.json").read_text()) == {"a": 1}
    (tmp_path / "d.json").mkdir()
    with pytest.raises(OSError):
        write_json_atomic(tmp_path / "d.json", {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.json", "rep.json", "rep.tmp"]


def test_chat_keeps_the_conversation_and_takes_it_from_the_cache(tiny_dir, capsys, monkeypatch):
    """Each line is a turn answered with the conversation so far; the next turn's prompt comes from the
    cache but for its new part; /reset starts again, /exit ends (what follows is not read)."""
    import io
    import re

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\n  \nand then?\r\n/reset\nhello\n/exit\nnever read\n"))
    args = ["--target", str(tiny_dir), "--max-new-tokens", "6", "--system", "Be brief."]
    assert main(["chat", *args]) == 0
    out, err = capsys.readouterr()
    turns = [tuple(map(int, m)) for m in re.findall(r"\[(\d+) tokens?, .*; (\d+) prompt tokens, (\d+) from the cache", err)]
    assert len(turns) == 3 and len(out.splitlines()) == 3 and "[a new conversation]" in err
    (n1, p1, c1), (_, p2, c2), (_, p3, c3) = turns
    # turn 2 repeats turn 1 from the cache, its answer in the model's own tokens: all the target committed
    # (the last token it generated is never committed)
    assert c1 == 0 and p2 > p1 and c2 == p1 + n1 - 1
    assert p3 == p1 and c3 == p1 - 1  # after /reset the first prompt again: all but its last token cached
    first = out.splitlines()[0]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", *args]) == 0
    assert capsys.readouterr().out.splitlines()[0] == first  # greedy: the same first answer
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", *args, "--temperature", "-1"]) == 2 and "temperature" in capsys.readouterr().err


def test_chat_skips_a_turn_that_does_not_fit_and_goes_on(tiny_dir, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("x" * 600 + "\nhello\n"))  # the tiny model holds 512 positions
    assert main(["chat", "--target", str(tiny_dir), "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert "turn not answered" in err and "context" in err and err.count("from the cache") == 1
    import re

    prompt_tokens = int(re.search(r"; (\d+) prompt tokens", err).group(1))
    assert out.strip() and prompt_tokens < 100  # the next line was answered, without the skipped turn


def test_chat_commands_are_not_sent_as_turns(tiny_dir, tmp_path, capsys, monkeypatch):
    import io

    from jetflow.models.draft_head import DraftHead, DraftHeadConfig
    from jetflow.models.target import TargetModel

    head = tmp_path / "head"
    DraftHead(DraftHeadConfig.for_target(TargetModel.load(str(tiny_dir)), block_size=4)).save_pretrained(head)
    args = ["chat", "--target", str(tiny_dir), "--drafter", str(head), "--budget", "4"]
    monkeypatch.setattr("sys.stdin", io.StringIO("/help\n/RESET\n/nonsense\n//slash at the start\n/EXIT\nnot read\n"))
    assert main([*args, "--max-new-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert err.count("start a line with //") == 2 and "[a new conversation]" in err  # /help and /nonsense
    assert err.count("prompt tokens") == 1 and "[1 token, " in err and "tau" not in err  # one turn, no draft round
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main([*args, "--max-new-tokens", "5"]) == 0
    assert ", tau " in capsys.readouterr().err  # with rounds


def test_chat_goes_on_after_an_interrupted_answer_and_bytes_that_are_not_text(tiny_dir, capsys, monkeypatch):
    import io

    from jetflow.pipeline import JetFlow

    stream, calls = JetFlow.stream, []

    def interrupted_once(self, *a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return stream(self, *a, **kw)

    monkeypatch.setattr(JetFlow, "stream", interrupted_once)
    stdin = io.TextIOWrapper(io.BytesIO(b"first\n\xff\xfe bytes\nsecond\n"), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["chat", "--target", str(tiny_dir), "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "[turn interrupted" in err and err.count("prompt tokens") == 2  # the two turns after it
    # the interrupted turn left nothing in the cache and is not in the conversation; the next turns are
    import re

    (p1, c1), (p2, c2) = [tuple(map(int, m)) for m in re.findall(r"; (\d+) prompt tokens, (\d+) from the cache", err)]
    assert c1 == 0 and c2 > 0 and p1 < 40 < p2


@pytest.mark.parametrize("argv", [["bench", "--temperature", "nan", "--out", "x"], ["regenerate", "--temperature", "inf"],
                                  ["train", "--lr", "nan", "--data", "d", "--out", "o"]])
def test_number_options_must_be_finite(argv, capsys):
    """argparse's float takes nan and inf: a regeneration labelled NaN, or a run that can never
    resume (NaN != NaN in the settings check). Every number option refuses them by name."""
    from jetflow.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "is not a finite number" in capsys.readouterr().err


def test_a_leading_tilde_in_path_options_is_the_home_directory(tmp_path, monkeypatch):
    """`--out=~/x` reaches the program unexpanded (the shell expands ~ only at a word's start): it
    means the home directory, never a directory named "~"; a prompt's text is left as written."""
    from jetflow.cli import _expand_home, build_parser

    monkeypatch.setenv("HOME", str(tmp_path))
    args = build_parser().parse_args(["train", "--target", "t", "--data=~/data", "--out=~/runs/x",
                                      "--init-from", "~/old"])
    _expand_home(args)
    assert args.out == tmp_path / "runs" / "x" and args.data == [tmp_path / "data"]
    assert args.init_from == str(tmp_path / "old")
    args = build_parser().parse_args(["generate", "~/not a path", "--drafter", "~/head"])
    _expand_home(args)
    assert args.prompt == "~/not a path" and args.drafter == str(tmp_path / "head")
    args = build_parser().parse_args(["generate", "x", "--drafter", "auto"])
    _expand_home(args)
    assert args.drafter == "auto"
    args = build_parser().parse_args(["bench", "--out", "o", "--eagle-drafter=~/e3", "--baseline-drafter=~/bi"])
    _expand_home(args)
    assert (args.eagle_drafter, args.baseline_drafter) == (str(tmp_path / "e3"), str(tmp_path / "bi"))


def test_cache_teacher_layers_are_checked_before_the_model_loads_and_named(tiny_dir, tmp_path, capsys, monkeypatch):
    import jetflow.cli as cli

    assert main(["cache-teacher", "--target", str(tiny_dir), "--data", str(tmp_path), "--out", str(tmp_path / "c"),
                 "--layers", "1,x"]) == 2
    assert "--layers" in capsys.readouterr().err
    assert main(["cache-teacher", "--target", str(tiny_dir), "--data", str(tmp_path), "--out", str(tmp_path / "c"),
                 "--layers", "1,99"]) == 2  # a layer the target has not: an error naming it, not a traceback
    assert "--layers: tapped layers [1, 99]" in capsys.readouterr().err
    assert main(["cache-teacher", "--target", "/no/such/model", "--data", str(tmp_path), "--out",
                 str(tmp_path / "c"), "--layers", "2,1,2"]) == 2
    assert "--layers names a layer twice" in capsys.readouterr().err
