import json

import pytest
import torch

from jetflow.decoding.block_drafter import BlockDrafter
from jetflow.models.draft_head import DraftHead, DraftHeadConfig, DrafterMismatchError
from jetflow.models.target import TargetModel
from tiny import tiny_model


@pytest.fixture(scope="module")
def target(tokenizer):
    return TargetModel(tiny_model("llama"), tokenizer, name="tiny", tapped_layers=[0, 2])


def make_head(target, attention="causal", seed=0, **kw):
    torch.manual_seed(seed)
    return DraftHead(DraftHeadConfig.for_target(target, attention=attention, block_size=6, **kw))


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
def test_block_attention_mask_semantics(target, attention):
    """Causal: slot j's output must not change when slots > j change. Bidirectional: it must."""
    head = make_head(target, attention).eval()
    torch.manual_seed(1)
    ctx = head.context_kv(head.fuse(torch.randn(5, 2 * 64)), torch.arange(5))
    block = torch.randn(6, 64)
    positions = torch.arange(5, 11)
    mask = head.block_mask(5)
    assert mask.shape == (6, 11) and mask[:, :5].all()
    base = head(block, positions, ctx, mask)
    for j in range(5):
        changed = block.clone()
        changed[j + 1:] = torch.randn(5 - j, 64)
        out = head(changed, positions, ctx, mask)
        same = torch.allclose(out[: j + 1], base[: j + 1], atol=1e-6)
        assert same == (attention == "causal")


def brute_force_block_attention(head, block, positions, fused_ctx, ctx_positions, attention):
    """The head's forward recomputed per query slot with explicit key lists: every slot attends to
    the whole context and to the block slots it is allowed to see."""
    outs = []
    for j in range(block.shape[0]):
        visible = list(range(j + 1)) if attention == "causal" else list(range(block.shape[0]))
        # Run the full head on [visible slots] and read slot j: attention of slot j only depends on
        # the keys it may see, so dropping the others must not change it.
        ctx = head.context_kv(fused_ctx, ctx_positions)
        sub = block[visible]
        mask = torch.ones(len(visible), fused_ctx.shape[0] + len(visible), dtype=torch.bool)
        out = head(sub, positions[visible], ctx, mask)
        outs.append(out[visible.index(j)])
    return torch.stack(outs)


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
def test_head_matches_brute_force(target, attention):
    head = make_head(target, attention, num_hidden_layers=1).eval()
    torch.manual_seed(2)
    fused = head.fuse(torch.randn(4, 2 * 64))
    block, positions = torch.randn(6, 64), torch.arange(4, 10)
    got = head(block, positions, head.context_kv(fused, torch.arange(4)), head.block_mask(4))
    ref = brute_force_block_attention(head, block, positions, fused, torch.arange(4), attention)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_incremental_context_equals_full_context(target):
    head = make_head(target).eval()
    torch.manual_seed(3)
    feats = torch.randn(9, 2 * 64)
    one, inc = BlockDrafter(head, target), BlockDrafter(head, target)
    one.extend(feats)
    for piece in (feats[:4], feats[4:5], feats[5:]):
        inc.extend(piece)
    torch.testing.assert_close(one.depth_logprobs(7, 9), inc.depth_logprobs(7, 9), atol=1e-5, rtol=0)
    assert one.depth_logprobs(7, 9).shape == (5, target.vocab_size)
    with pytest.raises(RuntimeError, match="anchor"):
        one.depth_logprobs(7, 8)


@pytest.mark.parametrize("int8", [False, True])
def test_context_grows_in_place_and_rounds_project_with_the_drafters_weights(target, int8):
    """A prompt then rounds of 1-3 committed rows, each followed by a draft, past the first buffer's
    256 rows: the context keys/values equal one projection of every row (float: up to rounding). An
    int8 drafter projects a prompt with the float head (its first row, an attention sink, would set
    the int8 activation scale) and a round's few rows with its int8 linears."""
    head = make_head(target).eval()
    torch.manual_seed(4)
    feats = torch.randn(300, 2 * 64)
    drafter = BlockDrafter(head, target, int8=int8)
    cuts = [0, 40]
    while cuts[-1] < len(feats):
        cuts.append(min(len(feats), cuts[-1] + 1 + len(cuts) % 3))
    for a, b in zip(cuts, cuts[1:]):
        drafter.extend(feats[a:b])
        drafter.depth_logprobs(7, b)
    with torch.no_grad():
        float_kv = head.context_kv(head.fuse(feats), torch.arange(len(feats)))
        few_kv = drafter.run_head.context_kv(drafter.run_head.fuse(feats[40:43]), torch.arange(40, 43))
    assert drafter.context_len == len(feats) and drafter._kv_room[0][0].shape[-2] == 2 * (40 + 256)  # grown once
    for (k, v), (fk, fv), (qk, qv) in zip(drafter.context_kv, float_kv, few_kv):
        assert k.shape == fk.shape
        torch.testing.assert_close(k[..., :40, :], fk[..., :40, :], atol=1e-5, rtol=0)
        torch.testing.assert_close(v[..., :40, :], fv[..., :40, :], atol=1e-5, rtol=0)
        if int8:  # the round of rows 40..42 came from the int8 linears: their outputs, near the float ones
            torch.testing.assert_close(k[..., 40:43, :], qk, atol=1e-5, rtol=0)
            assert not torch.allclose(k[..., 40:43, :], fk[..., 40:43, :], atol=1e-5)
            cos = torch.nn.functional.cosine_similarity(v.flatten(-2), fv.flatten(-2), dim=-1)
            assert cos.min() > 0.99
        else:
            torch.testing.assert_close(k, fk, atol=1e-5, rtol=0)
            torch.testing.assert_close(v, fv, atol=1e-5, rtol=0)


def test_an_int8_drafter_projects_only_few_moderate_rows_with_its_int8_linears(target):
    """After the prompt: 64 rows go through the int8 linears, 65 do not, nor a round with a feature far
    above the usual scale; float drafters always project with the float head."""
    head = make_head(target).eval()
    torch.manual_seed(5)
    feats = torch.randn(40 + 64 + 65 + 2, 2 * 64)
    feats[-1, 3] = 40.0  # a massive activation (the head's feature scale is 1 here)
    drafter = BlockDrafter(head, target, int8=True)
    calls = []
    for name, h in (("int8", drafter.run_head), ("float", drafter.head)):
        h.fuse = (lambda real, n: lambda x: calls.append(n) or real(x))(h.fuse, name)
    ends = [40, 104, 169, 171]
    for a, b in zip([0] + ends, ends):
        drafter.extend(feats[a:b])
        drafter.depth_logprobs(7, b)
    assert calls == ["float", "int8", "float", "float"]
    calls.clear()
    plain = BlockDrafter(head, target)
    plain.extend(feats[:40])
    plain.depth_logprobs(7, 40)
    plain.extend(feats[40:42])
    plain.depth_logprobs(7, 42)
    assert plain.run_head is plain.head


def test_checkpoint_roundtrip_and_format(target, tmp_path):
    head = make_head(target, "bidirectional")
    path = head.save_pretrained(tmp_path / "drafter")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dflash_config"] == {"mask_token_id": head.config.mask_token_id, "target_layer_ids": [0, 2],
                                    "causal": False}
    assert cfg["target"]["vocab_size"] == 272 and cfg["block_size"] == 6
    names = set(head.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.q_norm.weight", "layers.1.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    loaded = DraftHead.from_pretrained(path, target=target)
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    bf16 = DraftHead.from_pretrained(head.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16))
    assert bf16.fc.weight.dtype == torch.bfloat16
    # A bf16 checkpoint loaded as bf16, then made float (as decoding loads the shipped heads): its
    # rotary frequencies stay the float32 ones it was trained with, not rounded to bf16's 8 bits.
    positions = torch.arange(0, 600, 37)
    exact = head.rotary.cos_sin(positions, torch.float32)
    again = bf16.float().rotary.cos_sin(positions, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(exact, again))
    # Saving over an existing checkpoint replaces it whole.
    make_head(target, seed=5).save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["attention"] == "causal"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16", "drafter"]


def test_heads_load_on_any_runtime_of_their_target(target, tmp_path):
    """A checkpoint records the target's backend and dtype but is checked on sizes only: a head
    trained on torch features loads on another runtime, and checkpoints from before those keys load."""
    path = make_head(target).save_pretrained(tmp_path / "d")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["target"]["backend"] == "torch" and cfg["target"]["dtype"] == "float32"
    sizes = {k: v for k, v in cfg["target"].items() if k not in ("backend", "dtype")}
    for runtime in ({"backend": "llamacpp", "dtype": "bfloat16"}, {}):
        (path / "config.json").write_text(json.dumps({**cfg, "target": {**sizes, **runtime}}))
        assert DraftHead.from_pretrained(path, target=target).config.target == {**sizes, **runtime}


def test_mismatched_target_is_refused_with_the_reason(target, tokenizer, tmp_path):
    path = make_head(target).save_pretrained(tmp_path / "d")
    other = TargetModel(tiny_model("llama", vocab_size=300), tokenizer, tapped_layers=[0])
    with pytest.raises(DrafterMismatchError, match="vocab_size: drafter was built for 272, target has 300"):
        DraftHead.from_pretrained(path, target=other)
    with pytest.raises(DrafterMismatchError, match="not a drafter checkpoint"):
        DraftHead.from_pretrained(tmp_path)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"")
    with pytest.raises(DrafterMismatchError, match="not a valid drafter config"):
        DraftHead.from_pretrained(tmp_path / "bad")


def test_config_validation(target):
    with pytest.raises(ValueError, match="attention"):
        DraftHeadConfig.for_target(target, attention="sideways")
    with pytest.raises(ValueError, match="block_size"):
        DraftHeadConfig.for_target(target, block_size=1)


def test_a_drafter_for_another_vocabulary_of_the_same_size_is_refused(target, tmp_path):
    """Sizes alone do not tell Llama-2 from Mistral (32,000 ids, 4,096 wide, 32 layers each): a head
    records its target's vocabulary digest and is refused by a target whose tokens differ; a head
    from before the digest (none recorded) still loads."""
    import json

    from jetflow.models.checkpoint import load_drafter
    from jetflow.models.draft_head import DrafterMismatchError
    from jetflow.models.identity import tokenizer_digest

    path = make_head(target).save_pretrained(tmp_path / "d")
    config = json.loads((path / "config.json").read_text())
    assert config["target"]["tokenizer"] == tokenizer_digest(target.tokenizer)
    load_drafter(path, target=target)
    (path / "config.json").write_text(json.dumps(config | {"target": config["target"] | {"tokenizer": "0" * 16}}))
    with pytest.raises(DrafterMismatchError, match="tokenizer: the drafter was built for another vocabulary"):
        load_drafter(path, target=target)
    del config["target"]["tokenizer"]
    (path / "config.json").write_text(json.dumps(config))
    load_drafter(path, target=target)


def test_config_json_layouts_and_bad_types(target, tmp_path):
    """A top-level rope_theta (older layouts, configs written elsewhere) is read as the theta; a
    wrong type for rope_parameters or target is refused by name, as a checkpoint that does not load."""
    import json

    from jetflow.models.checkpoint import load_drafter
    from jetflow.models.draft_head import DrafterMismatchError

    path = make_head(target).save_pretrained(tmp_path / "d")
    saved = json.loads((path / "config.json").read_text())
    old = {k: v for k, v in saved.items() if k != "rope_parameters"} | {"rope_theta": 5000.0}
    assert DraftHeadConfig.from_json(old).rope_theta == 5000.0
    both = saved | {"rope_theta": 5000.0}  # rope_parameters wins, as transformers 5 reads it
    assert DraftHeadConfig.from_json(both).rope_theta == saved["rope_parameters"]["rope_theta"]
    for bad, message in (({"rope_parameters": []}, "'rope_parameters' must be an object"),
                         ({"target": "smollm2"}, "'target' must be an object")):
        (path / "config.json").write_text(json.dumps(saved | bad))
        with pytest.raises(DrafterMismatchError, match=message):
            load_drafter(path)


def test_feature_scale_evens_out_massive_dimensions_and_is_saved(target, tmp_path):
    from safetensors.torch import load_file, save_file

    head = make_head(target)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(50, 2 * target.hidden_size, generator=g)
    feats[:, 3] += 400.0  # a massive, nearly constant dimension
    head.set_feature_scale(feats)
    scaled = feats / head.feature_scale
    torch.testing.assert_close(scaled.pow(2).mean(0), torch.ones(feats.shape[1]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(head.fuse(feats), head.hidden_norm(head.fc(scaled)))
    path = head.save_pretrained(tmp_path / "d")
    assert torch.equal(DraftHead.from_pretrained(path).feature_scale, head.feature_scale)
    state = load_file(path / "model.safetensors")  # a checkpoint from before the scale existed
    del state["feature_scale"]
    save_file(state, path / "model.safetensors")
    assert torch.equal(DraftHead.from_pretrained(path).feature_scale, torch.ones(feats.shape[1]))


def test_a_smaller_block_from_a_causal_head_drafts_its_first_depths_unchanged(target, tmp_path):
    """--init-from a block-16 head for a block-8 run: causal slots never see later ones, so the
    shrunk head's depth distributions are the big head's first ones; a bigger block is refused."""
    from jetflow.errors import JetFlowError
    from jetflow.training.run import shrink_block, warm_start_head
    from jetflow.training.trainer import TrainConfig

    head = make_head(target, depth_embedding=True, feed_last_feature=True).eval()
    small = shrink_block(head, 4).eval()
    assert small.config.block_size == 4 and small.depth_embed.weight.shape[0] == 4
    torch.manual_seed(4)
    feats = torch.randn(9, 2 * 64)
    big_drafter, small_drafter = BlockDrafter(head, target), BlockDrafter(small, target)
    big_drafter.extend(feats)
    small_drafter.extend(feats)
    torch.testing.assert_close(small_drafter.depth_logprobs(7, 9), big_drafter.depth_logprobs(7, 9)[:3],
                               atol=1e-5, rtol=0)

    head.save_pretrained(tmp_path / "big")
    shape = dict(layers=2, draft_vocab=0, feed_last_feature=True, depth_embedding=True)
    assert warm_start_head(tmp_path / "big", target, TrainConfig(block_size=4, **shape)).config.block_size == 4
    with pytest.raises(JetFlowError, match="block-size 8"):
        warm_start_head(tmp_path / "big", target, TrainConfig(block_size=8, **shape))


def test_a_warm_start_of_the_same_shape_drops_what_described_the_old_weights(target, tmp_path):
    from jetflow.training.run import warm_start_head
    from jetflow.training.trainer import TrainConfig

    head = make_head(target, depth_embedding=True, feed_last_feature=True)
    curves = [[[-5.0, 0.0], [-5.0, 0.0]]] * (head.config.block_size - 1)  # (only its removal is checked)
    head.config.tree_calibration, head.config.path_refine = {"main": curves, "off_main": curves}, True
    head.save_pretrained(tmp_path / "calibrated")
    shape = dict(layers=2, draft_vocab=0, feed_last_feature=True, depth_embedding=True, block_size=head.config.block_size)
    new = warm_start_head(tmp_path / "calibrated", target, TrainConfig(**shape))
    assert new.config.tree_calibration is None and not new.config.path_refine
    assert warm_start_head(tmp_path / "calibrated", target, TrainConfig(reveal=0.5, **shape)).config.path_refine


def test_the_dflash_layouts_causal_flag_is_read(target, tmp_path):
    """A config in DFlash's layout carries only dflash_config.causal (no "attention"): a bidirectional
    head must not load as causal; the two disagreeing is refused."""
    head = make_head(target, "bidirectional")
    path = head.save_pretrained(tmp_path / "d")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["attention"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert DraftHead.from_pretrained(path, target=target).config.attention == "bidirectional"
    cfg["attention"] = "causal"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterMismatchError, match="dflash_config.causal is False"):
        DraftHead.from_pretrained(path, target=target)


def test_a_plain_head_warm_starts_a_path_projection_run(target, tmp_path):
    """--init-from a head without --shift-tokens/--path-projection for a run with both: every weight
    is kept and the new projection starts at zero, so the head drafts as the old one would with the
    MASK embedding in the later slots set to zero; the stale tree calibration is dropped."""
    from jetflow.training.run import warm_start_head
    from jetflow.training.trainer import TrainConfig

    head = make_head(target, depth_embedding=True, feed_last_feature=True).eval()
    head.save_pretrained(tmp_path / "plain")
    shape = dict(layers=2, draft_vocab=0, feed_last_feature=True, depth_embedding=True,
                 block_size=head.config.block_size)
    new = warm_start_head(tmp_path / "plain", target, TrainConfig(shift_tokens=True, path_projection=True,
                                                                  **shape)).eval()
    assert new.config.shift_tokens and new.config.path_projection and new.config.tree_calibration is None
    for name, value in head.state_dict().items():
        assert torch.equal(new.state_dict()[name], value), name
    torch.manual_seed(4)
    fused = head.fuse(torch.randn(9, 2 * 64))
    ctx = head.context_kv(fused, torch.arange(9))
    b = head.config.block_size
    embeds = target.model.get_input_embeddings()(torch.tensor([7] + [head.config.mask_token_id] * (b - 1)))
    with torch.no_grad():
        got = new(embeds, torch.arange(9, 9 + b), ctx, head.block_mask(9), fused[-1])
        want = head(torch.cat([embeds[:1], torch.zeros_like(embeds[1:])]), torch.arange(9, 9 + b), ctx,
                    head.block_mask(9), fused[-1])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
