"""Offline teacher cache and the two teachers (online / cached) against brute-force references."""

import json

import pytest
import torch

from jetflow.data.shards import Sequence
from jetflow.errors import JetFlowError
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.target import TargetModel
from jetflow.training import teacher_cache as cache_mod
from jetflow.training.teacher import CachedTeacher, OnlineTeacher, dense_from_topk
from jetflow.training.teacher_cache import TeacherCache, build_teacher_cache
from tiny import tiny_model


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def target(request, tokenizer):
    return TargetModel(tiny_model(request.param), tokenizer, name="tiny", tapped_layers=[0, 2])


def sequences(n=7):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        length = int(torch.randint(8, 30, (1,), generator=g))
        ids = torch.randint(0, 256, (length,), generator=g).tolist()
        out.append(Sequence(f"s{i}", ids, int(torch.randint(2, length - 3, (1,), generator=g))))
    return out


def test_batched_features_equal_single_sequence_forwards(target):
    seqs = sequences(3)
    width = max(len(s.token_ids) for s in seqs)
    ids = torch.zeros(3, width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, :len(s.token_ids)] = torch.tensor(s.token_ids)
    taps, hidden = target.features_and_hidden(ids)  # right padding
    for r, s in enumerate(seqs):
        n = len(s.token_ids)
        out = target.model(input_ids=torch.tensor([s.token_ids]), output_hidden_states=True)
        want = torch.cat([out.hidden_states[t + 1][0] for t in target.tapped_layers], -1)
        torch.testing.assert_close(taps[r, :n], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(target.logits(hidden[r, :n]), out.logits[0].float(), atol=1e-4, rtol=1e-4)


def test_dense_from_topk_matches_its_definition():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 10, generator=g).log_softmax(-1)
    lp, ids = logp.topk(3, -1)
    draft_ids = torch.tensor([0, 2, 3, 5, 7, 8])
    index = torch.full((10,), -1)
    index[draft_ids] = torch.arange(6)
    got = dense_from_topk(ids, lp, index, 6).exp()
    for n in range(4):
        p = logp[n].exp()
        kept = {int(t): float(p[t]) for t in ids[n] if int(index[t]) >= 0}
        rest = 1 - float(p[ids[n]].sum())
        filler = rest / (6 - len(kept))
        want = torch.tensor([kept.get(int(t), filler) for t in draft_ids])
        torch.testing.assert_close(got[n], want / want.sum())
    # full top-k over the full vocabulary is the exact distribution
    lp, ids = logp.topk(10, -1)
    torch.testing.assert_close(dense_from_topk(ids, lp, None, 10), logp, atol=1e-5, rtol=0)


def test_cache_equals_online_teacher_and_resumes(target, tmp_path, monkeypatch):
    seqs = sequences()
    out = tmp_path / "cache"
    calls = {"n": 0}
    real = cache_mod._teacher_for_batch

    def dies_after_first_part(*a, **k):
        calls["n"] += 1
        if calls["n"] > 1:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(cache_mod, "_teacher_for_batch", dies_after_first_part)
    with pytest.raises(KeyboardInterrupt):
        build_teacher_cache(target, seqs, out, top_k=target.vocab_size, sequences_per_part=3, batch_tokens=10_000,
                            progress=False)
    assert sorted(p.name for p in out.glob("part-*")) == ["part-00000.safetensors"]
    resumed = []  # the sequences the resume runs the target on: only those of the parts not written
    monkeypatch.setattr(cache_mod, "_teacher_for_batch", lambda t, batch, *a: resumed.extend(batch) or real(t, batch, *a))
    manifest = build_teacher_cache(target, seqs, out, top_k=target.vocab_size, sequences_per_part=3,
                                   batch_tokens=40, progress=False)
    monkeypatch.setattr(cache_mod, "_teacher_for_batch", real)
    assert sorted(s.token_ids for s in resumed) == sorted(s.token_ids for s in seqs[3:])
    assert manifest["complete"] and len(manifest["parts"]) == 3
    assert {p["dtype"] for p in manifest["parts"].values()} == {"float32"}  # which precision computed each part

    cached = CachedTeacher(TeacherCache(out, seqs, target, [0, 2]), None, target.vocab_size)
    online = OnlineTeacher(target, None)
    for i, s in enumerate(seqs):
        positions = torch.arange(s.prompt_len, len(s.token_ids) - 1)
        f_c, t_c = cached.fetch(i, s, positions)
        f_o, t_o = online.fetch(i, s, positions)
        torch.testing.assert_close(f_c, f_o, atol=0.05, rtol=1e-2)  # bf16 storage
        torch.testing.assert_close(t_c, t_o, atol=2e-2, rtol=1e-2)  # fp16 log-probs
        with pytest.raises(IndexError):
            cached.fetch(i, s, torch.tensor([s.prompt_len - 1]))
        # inside the trainer's mixed precision (--amp bfloat16) the online teacher still runs the
        # target in its own precision, as decoding and a teacher cache do
        with torch.autocast("cpu", dtype=torch.bfloat16):
            f_a, t_a = online.fetch(i, s, positions)
        assert torch.equal(f_a, f_o) and torch.equal(t_a, t_o)


def test_cache_refuses_other_data_and_other_layers(target, tmp_path):
    seqs = sequences(4)
    build_teacher_cache(target, seqs, tmp_path, top_k=4, sequences_per_part=2, progress=False)
    with pytest.raises(JetFlowError, match="tapped|layers"):
        TeacherCache(tmp_path, seqs, target, [1, 2])
    changed = [Sequence(s.prompt_id, s.token_ids[:-1] + [7], s.prompt_len) for s in seqs]
    with pytest.raises(JetFlowError, match="does not cover"):
        TeacherCache(tmp_path, changed, target, [0, 2])
    with pytest.raises(JetFlowError, match="other settings"):
        build_teacher_cache(target, seqs, tmp_path, top_k=8, sequences_per_part=2, progress=False)
    # other data into the same directory is refused, the cache kept; more data extends it
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(JetFlowError, match=r"holds a teacher cache for other sequences .*2 part\(s\) differ"):
        build_teacher_cache(target, changed, tmp_path, top_k=4, sequences_per_part=2, progress=False)
    assert before == {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    more = seqs + [Sequence("extra", seqs[0].token_ids[::-1], seqs[0].prompt_len)]
    assert build_teacher_cache(target, more, tmp_path, top_k=4, sequences_per_part=2, progress=False)["complete"]
    with pytest.raises(JetFlowError, match="manifest"):
        TeacherCache(tmp_path / "nothing", seqs, target, [0, 2])


def test_fusion_tolerates_massive_activations_in_bf16(target):
    """One position carries a ~3e4 dimension (as SmolLM2's first token does): stored in bf16 and fused,
    every position stays finite and close to the fp32 fusion."""
    head = DraftHead(DraftHeadConfig.for_target(target, num_hidden_layers=1))
    feats = torch.randn(6, 2 * target.hidden_size)
    feats[0, 5] = 3.0e4
    feats[0, 70] = -2.0e3
    ref = head.fuse(feats)
    got = head.fuse(feats.to(torch.bfloat16).float())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.02)
