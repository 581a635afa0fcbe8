"""`jetflow export-gguf`: a block head as a DFlash GGUF that llama.cpp runs.

The export is checked three ways: its tensors and metadata against the head (tiny model), its logits
when llama.cpp itself runs it next to the SmolLM2 target against the torch head on the same features,
and, where `make llama-tools` has built llama.cpp's speculative driver, a full greedy generation by
that driver against llama.cpp's own autoregressive output (skipped elsewhere, with the reason)."""

import json

import numpy as np
import pytest
import torch

from jetflow.cli import main
from jetflow.errors import JetFlowError
from jetflow.export.gguf import export_gguf, gguf_tensor_name, gguf_tensors
from jetflow.export.vllm import vllm_state_dict
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.loading import llamacpp_available
from jetflow.models.target import TargetModel

DFLASH_HEAD = "jetflow/drafters/smollm2-135m-instruct-dflash"
needs_llamacpp = pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed")


def tiny_head(tiny_dir, **kw):
    target = TargetModel.load(str(tiny_dir))
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6, **kw))
    head.set_feature_scale(torch.rand(64, 4 * 64) * 3 + 0.5)
    return head, target


@pytest.mark.parametrize("reduced", [False, True])
def test_tensors_are_the_dflash_weights_under_llamacpp_names(tiny_dir, reduced):
    head, target = tiny_head(tiny_dir, draft_vocab_size=40 if reduced else None)
    if reduced:
        head.set_draft_vocab(torch.arange(0, 80, 2))
    lm = target.lm_head_weight()
    hf = vllm_state_dict(head, torch.float32, lm)
    out = gguf_tensors(head, torch.float32, lm)
    assert set(out) == {gguf_tensor_name(k) for k in hf}
    assert {"fc.weight", "enc.output_norm.weight", "output_norm.weight", "blk.1.attn_k_norm.weight"} <= set(out)
    for name, value in hf.items():
        if name != "d2t":
            np.testing.assert_array_equal(out[gguf_tensor_name(name)], value.numpy())
    if reduced:  # llama.cpp wants absolute target ids, the HF layout stores offsets
        assert out["d2t"].dtype == np.int64 and out["d2t"].tolist() == list(range(0, 80, 2))
    bf16 = gguf_tensors(head, torch.bfloat16, lm)["blk.0.attn_q.weight"]
    assert bf16.dtype == np.int16  # raw bfloat16 bits
    assert torch.equal(torch.from_numpy(bf16).view(torch.bfloat16), hf["layers.0.self_attn.q_proj.weight"].bfloat16())
    with pytest.raises(JetFlowError, match="no llama.cpp name"):
        gguf_tensor_name("layers.0.self_attn.rotary.inv_freq")


@needs_llamacpp
def test_refusals_keep_what_is_saved(tiny_dir, tmp_path):
    from jetflow.models.resolve import locate_gguf

    smol_gguf = locate_gguf("smollm2-135m-instruct")[0]
    out = tmp_path / "d.gguf"
    out.write_bytes(b"earlier export")
    head, _ = tiny_head(tiny_dir)
    src = head.save_pretrained(tmp_path / "head")
    with pytest.raises(JetFlowError, match="not the head's target.*hidden_size: head expects 64"):
        export_gguf(src, out, smol_gguf)
    odd = tiny_head(tiny_dir, depth_embedding=True)[0].save_pretrained(tmp_path / "odd")
    with pytest.raises(JetFlowError, match="depth embedding"):
        export_gguf(odd, out, smol_gguf)
    with pytest.raises(JetFlowError, match="must be a .gguf file"):
        export_gguf(src, tmp_path / "d.bin", smol_gguf)
    with pytest.raises(JetFlowError, match="target GGUF not found"):
        export_gguf(src, out, tmp_path / "missing.gguf")
    assert out.read_bytes() == b"earlier export"
    from jetflow.export.gguf import _check_target_gguf
    from jetflow.models.checkpoint import load_drafter

    last = load_drafter(DFLASH_HEAD).config  # SmolLM2's head, made to read the last of its 30 layers
    last.target_layer_ids = [1, 29]
    with pytest.raises(JetFlowError, match=r"target layer\(s\) \[29\], the target's last"):
        _check_target_gguf(last, smol_gguf)
    last.target_layer_ids = [1, 28]
    _check_target_gguf(last, smol_gguf)
    assert main(["export-gguf", "--drafter", str(src), "--target", str(tiny_dir), "--out", str(out)]) == 2
    assert out.read_bytes() == b"earlier export"
    fake, cut = tmp_path / "fake.gguf", tmp_path / "cut.gguf"
    fake.write_text("junk")
    with open(smol_gguf, "rb") as f:
        cut.write_bytes(f.read(5_000_000))
    for bad in (fake, cut):  # one line naming the file, not the gguf reader's traceback
        with pytest.raises(JetFlowError, match=f"{bad.name} is not a readable GGUF file"):
            export_gguf(src, out, bad)
    assert out.read_bytes() == b"earlier export"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    if not llamacpp_available():
        pytest.skip("llama-cpp-python is not installed")
    out = tmp_path_factory.mktemp("gguf") / "draft.gguf"
    assert main(["export-gguf", "--drafter", DFLASH_HEAD, "--out", str(out), "--dtype", "float32"]) == 0
    return out


def test_an_existing_file_is_replaced_only_with_overwrite(exported, tmp_path, capsys):
    before = exported.read_bytes()
    model = tmp_path / "mymodel.gguf"
    model.write_bytes(b"a user's model")
    for out in (model, exported):
        assert main(["export-gguf", "--drafter", DFLASH_HEAD, "--out", str(out)]) == 2
        assert f"--out {out} already exists; --overwrite replaces it" in capsys.readouterr().err
    assert model.read_bytes() == b"a user's model" and exported.read_bytes() == before
    assert main(["export-gguf", "--drafter", DFLASH_HEAD, "--out", str(exported), "--dtype", "float32",
                 "--overwrite"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["out"] == str(exported.absolute()) and printed["run"].endswith("--temp 0 -fa off")
    assert exported.read_bytes() == before  # the same export again
    assert main(["export-gguf", "--drafter", DFLASH_HEAD, "--out", str(model / "x.gguf")]) == 2
    assert "cannot be written" in capsys.readouterr().err


def test_export_metadata(exported):
    import gguf

    reader = gguf.GGUFReader(exported)
    f = {k: v.contents() for k, v in reader.fields.items()}
    cfg = json.loads(open(f"{DFLASH_HEAD}/config.json").read())
    assert f["general.architecture"] == "dflash" and f["dflash.attention.causal"] is True
    assert f["dflash.block_size"] == 16 and f["dflash.block_count"] == cfg["num_hidden_layers"]
    assert f["dflash.target_layers"] == [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
    assert f["tokenizer.ggml.mask_token_id"] == cfg["dflash_config"]["mask_token_id"]
    assert len(f["tokenizer.ggml.tokens"]) == cfg["vocab_size"]
    names = {t.name for t in reader.tensors}
    assert "token_embd.weight" not in names and {"output.weight", "d2t", "fc.weight"} <= names


@needs_llamacpp
def test_llamacpp_runs_the_export_like_the_torch_head(exported):
    """Same target features in, the draft's logits of all 16 depths out: llama.cpp's DFlash graph on
    the export against the torch head. Weights are float32 on both sides; llama.cpp keeps the draft's
    K/V cache in float16, which moves logits (span ~30) by up to 0.003 here: tolerance 0.01."""
    from jetflow.models.checkpoint import load_drafter
    from jetflow.models.llamacpp_draft import LlamaCppDFlashDraft
    from jetflow.models.loading import load_target

    head = load_drafter(DFLASH_HEAD, dtype=torch.float32)
    target = load_target("smollm2-135m-instruct", backend="llamacpp")
    target.set_tapped_layers(head.config.target_layer_ids)
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 times 7? Explain."}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    features = target.prefill(ids[:-1]).hidden.float()
    draft = LlamaCppDFlashDraft(exported, target)
    assert draft.causal and draft.block_size == 16
    p, c = features.shape[0], head.config
    draft.inject(features, 0)
    native = draft.block_logits(ids[-1], p, c.mask_token_id)
    block = torch.tensor([ids[-1]] + [c.mask_token_id] * 15)
    with torch.no_grad():
        h = head(target.embed(block), torch.arange(p, p + 16), head.context_kv(head.fuse(features), torch.arange(p)),
                 head.block_mask(p))
        ref = h @ head.output_weight(target.lm_head_weight().float()).T
    drafted = native[:, head.draft_ids]
    assert torch.isinf(native).sum() == 16 * (c.vocab_size - c.draft_vocab_size)  # outside the draft vocabulary
    torch.testing.assert_close(drafted, ref, atol=1e-2, rtol=0)
    assert torch.equal(drafted.argmax(-1), ref.argmax(-1))
    again = draft.block_logits(ids[-1], p, c.mask_token_id)  # the block left no trace in the cache
    assert torch.equal(again, native)
    # Read bidirectionally, the same weights give other logits at the early depths (the late ones see
    # nearly the same slots either way).
    draft._lib.llama_set_causal_attn(draft._ctx, False)
    both = draft.block_logits(ids[-1], p, c.mask_token_id)[:, head.draft_ids]
    assert (both - drafted)[:8].abs().amax(-1).min() > 1e-1  # 0.2-1.0 against the 0.003 of the cache
    draft.close()


@pytest.mark.skipif(__import__("jetflow.eval.llama_tools", fromlist=["x"]).find_llama_tools() is None,
                    reason="llama.cpp's speculative driver is not built (make llama-tools / JETFLOW_LLAMA_TOOLS)")
def test_llamacpp_speculative_driver_runs_the_export_losslessly(exported):
    """llama.cpp's own draft-dflash driver with the exported head: greedy output equals llama.cpp's
    autoregressive output, and it accepts as many drafted tokens as JetFlow's chain of the same
    length with the torch copy of the head on the same backend (a wrong export accepts ~nothing)."""
    import jetflow
    from jetflow.eval.llama_reference import llama_greedy, open_llama
    from jetflow.eval.llama_tools import run_speculative
    from jetflow.models.checkpoint import load_drafter
    from jetflow.models.loading import load_target

    target = load_target("smollm2-135m-instruct", backend="llamacpp", n_threads=2)
    question = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in total?"
    messages = [{"role": "user", "content": question}]
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    run = run_speculative(target.gguf, exported, target.tokenizer.decode(ids), max_new_tokens=64, threads=2, n_draft=3)
    tokens, _, _ = llama_greedy(open_llama(target.gguf, n_threads=2), ids, 64, target.stop_token_ids())
    reference = target.tokenizer.decode(tokens, skip_special_tokens=True)
    assert run.n_predict >= 64 and run.text.startswith(reference)
    chain = jetflow.JetFlow(target, load_drafter(DFLASH_HEAD), lookup=False).generate(
        messages, budget=3, width=1, max_new_tokens=64)
    assert chain.text == reference
    accepted = sum(n - 1 for n in chain.stats["accept_lengths"])
    assert accepted > 5 and abs(run.n_accept - accepted) <= max(3, 0.2 * accepted)
