"""Export to vLLM's DFlash format: layout, folded feature scale, refusals, CLI. (The run through vLLM
itself is tests/test_vllm_integration.py, skipped where vLLM is not installed.)"""

import json

import pytest
import torch
from safetensors.torch import load_file

from jetflow.cli import main
from jetflow.errors import JetFlowError
from jetflow.export.vllm import export_vllm
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.layers import RMSNorm
from jetflow.models.target import TargetModel


def head_for(tiny_dir, **kw):
    target = TargetModel.load(str(tiny_dir))
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6, **kw))
    head.set_feature_scale(torch.rand(64, 4 * 64) * 3 + 0.5)  # a non-trivial scale to fold
    return head


@pytest.mark.parametrize("reduced", [False, True])
def test_export_layout_and_folded_scale(tiny_dir, tmp_path, reduced):
    head = head_for(tiny_dir, draft_vocab_size=40 if reduced else None)
    if reduced:
        head.set_draft_vocab(torch.arange(0, 80, 2))
    src = head.save_pretrained(tmp_path / "head")
    target = TargetModel.load(str(tiny_dir))
    out = export_vllm(src, tmp_path / "vllm", dtype=torch.float32, target=target)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": head.config.mask_token_id,
                                    "target_layer_ids": head.config.target_layer_ids, "causal": True}
    assert cfg["rope_parameters"]["rope_theta"] == head.config.rope_theta and cfg["block_size"] == 6
    state = load_file(out / "model.safetensors")
    assert "feature_scale" not in state and "t2d" not in state and not any("embed" in k for k in state)
    assert ("d2t" in state) == reduced and cfg.get("draft_vocab_size") == (40 if reduced else None)
    if reduced:
        assert torch.equal(torch.arange(40) + state["d2t"], torch.arange(0, 80, 2))  # target = draft + d2t
        lm = target.model.get_output_embeddings().weight  # vLLM would otherwise share the full LM head
        assert torch.equal(state["lm_head.weight"], lm[torch.arange(0, 80, 2)])
    else:
        assert "lm_head.weight" not in state
    x = torch.randn(7, 4 * 64) * 20
    norm = RMSNorm(64, head.config.rms_norm_eps)
    norm.weight.data = state["hidden_norm.weight"]
    torch.testing.assert_close(norm(x @ state["fc.weight"].T), head.fuse(x), atol=1e-5, rtol=1e-5)
    for name, value in head.state_dict().items():
        if name.startswith("layers.") or name == "norm.weight":
            assert torch.equal(state[name], value)


@pytest.mark.parametrize("kw, reason", [
    (dict(feed_last_feature=True), "--feed-last-feature"),
    (dict(depth_embedding=True), "--depth-embedding"),
    (dict(embed_norm=True), "--embed-norm"),
    (dict(slot_token_gain=8.0), "--slot-token-gain"),
    (dict(shift_tokens=True), "--shift-tokens"),
    (dict(kind="eagle3"), "not a block head"),
])
def test_heads_vllm_cannot_represent_are_refused(tiny_dir, tmp_path, kw, reason):
    if kw.get("kind") == "eagle3":
        from jetflow.models.eagle_head import EagleHead

        target = TargetModel.load(str(tiny_dir))
        src = EagleHead(DraftHeadConfig.for_target(target, num_hidden_layers=1, kind="eagle3")).save_pretrained(
            tmp_path / "head")
    else:
        src = head_for(tiny_dir, **kw).save_pretrained(tmp_path / "head")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "keep.txt").write_text("earlier export")
    with pytest.raises(JetFlowError, match=reason):
        export_vllm(src, tmp_path / "vllm")
    assert (tmp_path / "vllm" / "keep.txt").read_text() == "earlier export"  # nothing lost


def test_export_cli(tiny_dir, tmp_path, capsys):
    src = head_for(tiny_dir, attention="bidirectional").save_pretrained(tmp_path / "head")
    assert main(["export-vllm", "--drafter", str(src), "--out", str(tmp_path / "v")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["speculative_config"] == {"method": "dflash", "model": str(tmp_path / "v"), "num_speculative_tokens": 5}
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["dflash_config"]["causal"] is False and cfg["torch_dtype"] == "bfloat16"
    assert load_file(tmp_path / "v" / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    assert main(["export-vllm", "--drafter", str(tmp_path / "nope"), "--out", str(tmp_path / "w")]) == 2
    assert "not found" in capsys.readouterr().err
    # an earlier export is replaced with --overwrite only; a directory holding anything else, or a
    # file, is refused untouched even then
    capsys.readouterr()
    assert main(["export-vllm", "--drafter", str(src), "--out", str(tmp_path / "v")]) == 2
    assert "already holds a checkpoint; --overwrite replaces it" in capsys.readouterr().err
    assert main(["export-vllm", "--drafter", str(src), "--out", str(tmp_path / "v"), "--overwrite"]) == 0
    assert main(["export-vllm", "--drafter", str(src), "--out", str(src), "--overwrite"]) == 2  # not over the head
    assert "is the --drafter itself" in capsys.readouterr().err
    (tmp_path / "runs" / "old-run").mkdir(parents=True)
    (tmp_path / "runs" / "notes.txt").write_text("precious")
    for out, message in ((tmp_path / "runs", "holds other files (notes.txt, old-run)"),
                         (tmp_path / "runs" / "notes.txt", "is a file, not a directory")):
        capsys.readouterr()
        for flags in ([], ["--overwrite"]):  # said at once: --overwrite would not help
            assert main(["export-vllm", "--drafter", str(src), "--out", str(out), *flags]) == 2
            assert message in capsys.readouterr().err
    assert (tmp_path / "runs" / "notes.txt").read_text() == "precious" and (tmp_path / "runs" / "old-run").is_dir()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["notes.txt", "old-run"]
