import json
import math

import pytest
import torch

import jetflow
from jetflow.data.shards import Sequence, write_shard
from jetflow.errors import JetFlowError
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.target import TargetModel
from jetflow.training.trainer import TrainConfig, Trainer, load_sequences
from tiny import lossless_tau, tiny_model


@pytest.fixture(scope="module")
def target(tokenizer):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.model.norm.weight.mul_(4)  # peaked next-token distributions, like a real LM's
    return TargetModel(model, tokenizer, name="tiny", tapped_layers=[1, 2])


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    """A tiny regenerated set: 6 prompts answered greedily by the tiny target."""
    from jetflow.data.prompts import Prompt
    from jetflow.data.regenerate import regenerate

    out = tmp_path_factory.mktemp("regen")
    prompts = [Prompt("toy", f"toy/{i}", (("user", "abc"[i % 3] * (i + 1)),)) for i in range(6)]
    regenerate(target, prompts, out, max_new_tokens=40, batch_size=6, shard_size=6, progress=False)
    return out


def config(**kw):
    base = dict(block_size=5, anchors_per_seq=8, layers=1, lr=3e-3, warmup_steps=5, epochs=60, batch_size=2,
                eval_every=1000, save_every=1000, eval_sequences=1)
    base.update(kw)
    return TrainConfig(**base)


def test_overfits_tiny_set_and_decodes_losslessly_with_high_tau(target, data, tmp_path):
    seqs = load_sequences(data, target)
    trainer = Trainer(target, seqs, tmp_path / "run", config(lr=1e-2, epochs=150))
    first = trainer.evaluate()["eval_loss"]
    trainer.fit(log=lambda r: None)
    after = trainer.evaluate()
    assert after["eval_loss"] < first / 5, (first, after)
    head = jetflow.DraftHead.from_pretrained(tmp_path / "run" / "drafter", target=target)
    jf = jetflow.JetFlow(target, head, budget=16, width=3)
    assert lossless_tau(jf, seqs, trainer.train_set) > 3.0  # block size 5: at most 5 per round
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == trainer.total_steps and "top1_agreement" in log[-1]


def test_kill_and_resume_reproduces_the_uninterrupted_run(target, data, tmp_path):
    seqs = load_sequences(data, target)
    cfg = config(epochs=4, save_every=3)
    straight = Trainer(target, seqs, tmp_path / "a", cfg)
    straight.fit(log=lambda r: None)
    interrupted = Trainer(target, seqs, tmp_path / "b", cfg)
    interrupted.fit(max_steps=3, log=lambda r: None)  # "killed" after the step-3 checkpoint ...
    with open(tmp_path / "b" / "train_log.jsonl", "a") as f:  # ... and one logged step later
        f.write(json.dumps({"step": 4, "loss": 1.0}) + "\n")
    resumed = Trainer(target, seqs, tmp_path / "b", cfg)
    assert resumed.resume() and resumed.step == 3
    resumed.fit(log=lambda r: None)
    assert resumed.step == straight.step
    logged = [json.loads(line)["step"] for line in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert logged == list(range(1, straight.step + 1))  # step 4, trained twice, logged once
    for (name, a), b in zip(straight.head.state_dict().items(), resumed.head.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(JetFlowError, match="other settings"):
        Trainer(target, seqs, tmp_path / "b", config(epochs=5)).resume()
    with pytest.raises(JetFlowError, match="other sequences"):  # e.g. a data directory that has grown
        Trainer(target, seqs + seqs[:1], tmp_path / "b", cfg).resume()
    two = Trainer(target, seqs, tmp_path / "b", cfg)
    two.world = 2  # as under torchrun with two processes
    with pytest.raises(JetFlowError, match="trained by 1 processes; resume it with as many"):
        two.resume()
    assert resumed.step == straight.step  # the refused runs left the saved one as it was
    assert Trainer(target, seqs, tmp_path / "b", cfg).resume()


def test_a_kill_between_or_inside_the_two_saves_resumes_from_one_consistent_save(target, data, tmp_path):
    """A checkpoint is two directory swaps (drafter, then trainer state): a kill after the drafter's
    leaves it one save ahead of the optimizer and step, and a kill inside a swap leaves its staged or
    replaced copy behind. A resume must continue from one save, as the uninterrupted run did."""
    import shutil

    seqs = load_sequences(data, target)
    cfg = config(epochs=4, save_every=3)
    straight = Trainer(target, seqs, tmp_path / "a", cfg)
    straight.fit(log=lambda r: None)
    run = tmp_path / "b"
    Trainer(target, seqs, run, cfg).fit(max_steps=3, log=lambda r: None)
    state_at_3 = tmp_path / "state-3"
    shutil.copytree(run / "trainer_state", state_at_3)
    on = Trainer(target, seqs, run, cfg)
    assert on.resume()
    on.fit(max_steps=6, log=lambda r: None)  # saved at step 6
    # Killed after the drafter of step 6 was in place, before its state: the state is still step 3's,
    # with a torn log line and a leftover staging copy of an interrupted swap.
    shutil.rmtree(run / "trainer_state")
    shutil.copytree(state_at_3, run / "trainer_state")
    with open(run / "train_log.jsonl", "a") as f:
        f.write('{"step": 7, "lo')
    (run / ".drafter.jetflow-replaced").mkdir()
    (run / ".drafter.jetflow-replaced" / "config.json").write_text("{}")
    (run / "drafter.old").mkdir()  # a user's own backup: not JetFlow's to remove
    resumed = Trainer(target, seqs, run, cfg)
    assert resumed.resume() and resumed.step == 3 and not (run / ".drafter.jetflow-replaced").exists()
    assert (run / "drafter.old").is_dir()
    resumed.fit(log=lambda r: None)
    for (name, a), b in zip(straight.head.state_dict().items(), resumed.head.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
    logged = [json.loads(line)["step"] for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert logged == list(range(1, straight.step + 1))
    # Killed inside the state's swap, after the old copy was moved aside and before the new one was
    # put in place: the complete staged copy is the newer save, and the resume takes it.
    (run / "trainer_state").rename(run / ".trainer_state.jetflow-staged")
    again = Trainer(target, seqs, run, cfg)
    assert again.resume() and again.step == straight.step and (run / "trainer_state" / "state.pt").is_file()


def test_a_warm_started_head_trains_on_its_own_layers_and_a_run_is_refused_before_any_work(target, data, tmp_path,
                                                                                           monkeypatch):
    """--init-from a head that reads other layers than the target's default taps: the online
    teacher gives it its own layers' features (as decoding will); an --out that holds a run is
    refused without --resume before the data loads or the target runs."""
    from jetflow.training import run as run_mod

    seqs = load_sequences(data, target)
    target.set_tapped_layers([0, 3])
    other = DraftHead(DraftHeadConfig.for_target(target, num_hidden_layers=1, block_size=5))
    target.set_tapped_layers([1, 2])
    try:
        Trainer(target, seqs, tmp_path / "w", config(), head=other)
        assert target.tapped_layers == (0, 3)
    finally:
        target.set_tapped_layers([1, 2])
    (tmp_path / "run" / "trainer_state").mkdir(parents=True)
    monkeypatch.setattr(run_mod, "load_sequences", lambda *a, **k: pytest.fail("the data loaded first"))
    with pytest.raises(JetFlowError, match="already holds a training run; pass --resume"):
        run_mod.train_drafter(target, data, tmp_path / "run", config())


def test_an_out_holding_a_drafter_but_no_run_is_not_overwritten(target, data, tmp_path):
    from jetflow.training.run import train_drafter

    seqs_dir, run = data, tmp_path / "run"
    Trainer(target, load_sequences(seqs_dir, target), run, config(epochs=1, save_every=1)).fit(max_steps=1, log=lambda r: None)
    import shutil

    shutil.rmtree(run / "trainer_state")  # e.g. a head copied there, or a first save cut short
    before = (run / "drafter" / "model.safetensors").read_bytes()
    for resume in (False, True):
        with pytest.raises(JetFlowError, match="no training state to resume from"):
            train_drafter(target, seqs_dir, run, config(epochs=1), resume=resume, max_steps=1)
    assert (run / "drafter" / "model.safetensors").read_bytes() == before


def test_several_data_directories_are_read_in_the_order_given(target, data, tmp_path):
    from jetflow.training.trainer import data_label

    one = load_sequences(data, target)
    more = tmp_path / "more"
    more.mkdir()
    (more / "manifest.json").write_text((data / "manifest.json").read_text())
    extra = [Sequence("extra/0", one[0].token_ids[:5] + [7, 8, 9], 5), Sequence("extra/1", [3, 4, 5, 6], 2)]
    write_shard(more / "shard-00000.npz", extra, target.vocab_size)
    both = load_sequences([data, more], target)
    assert [s.prompt_id for s in both] == [s.prompt_id for s in one] + ["extra/0", "extra/1"]
    assert [s.token_ids for s in load_sequences([more, data], target)][:2] == [s.token_ids for s in extra]
    assert [s.prompt_id for s in load_sequences([data, more], target, max_sequences=len(one) + 1)][-1] == "extra/0"
    assert data_label([data, more]) == f"{data},{more}"
    with pytest.raises(JetFlowError, match="given twice"):
        load_sequences([data, more, data], target)
    (more / "manifest.json").write_text(json.dumps({"target": {**target.identity(), "vocab_size": 7}}))
    with pytest.raises(JetFlowError, match="more was regenerated by .*vocab_size 7"):
        load_sequences([data, more], target)
    with pytest.raises(JetFlowError, match="holds only"):
        load_sequences([data], target, max_sequences=len(one) + 1)


def test_bad_data_is_rejected(target, tokenizer, tmp_path):
    with pytest.raises(JetFlowError, match="no manifest.json"):
        load_sequences(tmp_path, target)
    (tmp_path / "manifest.json").write_text(json.dumps({"target": {"name": "other", "vocab_size": 5,
                                                                   "hidden_size": 64, "num_hidden_layers": 4}}))
    with pytest.raises(JetFlowError, match="vocab_size"):
        load_sequences(tmp_path, target)
    (tmp_path / "manifest.json").write_text(json.dumps({"target": target.identity()}))
    with pytest.raises(JetFlowError, match="no sequences"):
        load_sequences(tmp_path, target)
    write_shard(tmp_path / "shard-00000.npz", [Sequence("x", [1] * 600, 3)], target.vocab_size)
    with pytest.raises(JetFlowError, match="context"):
        load_sequences(tmp_path, target)
    with pytest.raises(JetFlowError, match="loss"):
        TrainConfig(loss="mse")
    with pytest.raises(JetFlowError, match="--ttt-steps"):  # a block head has no unroll to set
        TrainConfig(ttt_steps=2)
    assert TrainConfig(head="eagle3", ttt_steps=2).ttt_steps == 2


def test_cached_teacher_gives_the_online_loss_and_trains_a_reduced_vocab_head(target, data, tmp_path):
    from jetflow.models.draft_vocab import token_counts
    from jetflow.training.teacher_cache import build_teacher_cache

    seqs = load_sequences(data, target)
    build_teacher_cache(target, seqs, tmp_path / "cache", top_k=target.vocab_size, progress=False)
    online = Trainer(target, seqs, tmp_path / "online", config())
    cached = Trainer(target, seqs, tmp_path / "cached", config(), teacher_cache=tmp_path / "cache")
    assert online.train_step() == pytest.approx(cached.train_step(), rel=2e-2)

    small = tmp_path / "small-cache"
    build_teacher_cache(target, seqs, small, top_k=8, progress=False)
    trainer = Trainer(target, seqs, tmp_path / "reduced", config(lr=1e-2, epochs=150, draft_vocab=48),
                      teacher_cache=small)
    assert trainer.head.config.draft_vocab_size == 48
    expected = trainer.sample_features().pow(2).mean(0).sqrt().clamp(min=1e-2)  # RMS of training features
    torch.testing.assert_close(trainer.head.feature_scale, expected)
    counts = token_counts((seqs[i] for i in trainer.train_set), target.vocab_size)
    cutoff = sorted(counts.tolist(), reverse=True)[47]
    kept = set(trainer.head.draft_ids.tolist())
    assert {t for t in range(len(counts)) if counts[t] > cutoff} <= kept
    assert all(counts[t] >= cutoff for t in kept if t != 257)  # 257: the stop token, always kept
    first = trainer.evaluate()["eval_loss"]
    trainer.fit(log=lambda r: None)
    assert trainer.evaluate()["eval_loss"] < first / 4
    head = jetflow.DraftHead.from_pretrained(tmp_path / "reduced" / "drafter", target=target)
    assert head.draft_ids.tolist() == trainer.head.draft_ids.tolist()
    jf = jetflow.JetFlow(target, head, budget=16, width=3)
    assert lossless_tau(jf, seqs, trainer.train_set) > 2.5
    assert (tmp_path / "reduced" / "loss_curve.png").stat().st_size > 1000

    # A warm start on other data keeps the learned weights and takes the new data's vocabulary.
    from jetflow.training.run import warm_start_head
    other = [Sequence(f"other/{i}", list(range(100, 110)) + list(range(120, 160)) * 2, 10) for i in range(6)]
    warm = Trainer(target, other, tmp_path / "warm", config(draft_vocab=48),
                   head=warm_start_head(tmp_path / "reduced" / "drafter", target, config(draft_vocab=48)))
    assert set(range(120, 160)) <= set(warm.head.draft_ids.tolist())  # every answer token of the new data
    assert warm.head.draft_ids.tolist() != head.draft_ids.tolist()
    torch.testing.assert_close(warm.head.fc.weight, head.fc.weight.float())


def test_two_process_data_parallel_matches_one_process(tiny_dir, tmp_path):
    """torchrun with 2 gloo processes x 1 sequence gives the first-step loss of 1 process x 2."""
    import os
    import subprocess
    import sys

    from jetflow.data.prompts import Prompt
    from jetflow.data.regenerate import regenerate

    tgt = TargetModel.load(str(tiny_dir))
    prompts = [Prompt("toy", f"toy/{i}", (("user", "xyz"[i % 3] * (i + 2)),)) for i in range(8)]
    regenerate(tgt, prompts, tmp_path / "data", max_new_tokens=24, batch_size=8, shard_size=8, progress=False)
    common = ["train", "--target", str(tiny_dir), "--data", str(tmp_path / "data"), "--layers", "1",
              "--block-size", "4", "--anchors-per-seq", "4", "--max-steps", "2", "--eval-every", "1000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "jetflow.cli", *common, "--batch", "2", "--out", str(tmp_path / "one")],
                   check=True, env=env, capture_output=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
                    "-m", "jetflow.cli", *common, "--batch", "1", "--out", str(tmp_path / "two")],
                   check=True, env=env, capture_output=True)
    one = [json.loads(x) for x in (tmp_path / "one" / "train_log.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    assert len(one) == len(two) == 2
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-5)
    assert two[1]["loss"] == pytest.approx(one[1]["loss"], rel=1e-4)  # same update on both sides


def test_revealed_blocks_train_a_head_that_runs_its_second_pass(target, data, tmp_path):
    """--reveal: the saved head says it can run the path-conditioned pass, decoding runs it by
    default, output stays lossless, and acceptance is high on the overfitted set."""
    seqs = load_sequences(data, target)
    trainer = Trainer(target, seqs, tmp_path / "run", config(lr=1e-2, epochs=150, reveal=0.5,
                                                             feed_last_feature=True, depth_embedding=True))
    first = trainer.evaluate()["eval_loss"]
    trainer.fit(log=lambda r: None)
    assert trainer.evaluate()["eval_loss"] < first / 5
    head = jetflow.DraftHead.from_pretrained(tmp_path / "run" / "drafter", target=target)
    assert head.config.path_refine
    jf = jetflow.JetFlow(target, head, budget=16, width=3, lookup=False)
    assert jf.drafter.refine
    assert lossless_tau(jf, seqs, trainer.train_set) > 3.0


@pytest.mark.parametrize("projection", [False, True])
def test_a_head_that_shifts_tokens_learns_from_revealed_paths(target, data, tmp_path, projection):
    """--shift-tokens --reveal (revealed slots supervised too), with or without --path-projection: the
    run fits, and the saved head shifts, runs its second pass, decodes losslessly and accepts much on
    the overfitted set."""
    seqs = load_sequences(data, target)
    trainer = Trainer(target, seqs, tmp_path / "run", config(lr=1e-2, epochs=150, reveal=0.5, shift_tokens=True,
                                                             path_projection=projection,
                                                             feed_last_feature=True, depth_embedding=True))
    first = trainer.evaluate()["eval_loss"]
    trainer.fit(log=lambda r: None)
    assert trainer.evaluate()["eval_loss"] < first / 5
    head = jetflow.DraftHead.from_pretrained(tmp_path / "run" / "drafter", target=target)
    assert head.config.shift_tokens and head.config.path_refine and head.config.path_projection == projection
    jf = jetflow.JetFlow(target, head, budget=16, width=3, lookup=False)
    assert lossless_tau(jf, seqs, trainer.train_set) > 3.0


@pytest.mark.parametrize("kw", [dict(shift_tokens=True, attention="bidirectional"),
                                dict(shift_tokens=True, head="eagle3"), dict(path_projection=True)])
def test_shift_tokens_is_refused_where_it_means_nothing(kw):
    with pytest.raises(JetFlowError, match="shift-tokens"):
        config(**kw)


@pytest.mark.parametrize("kw", [dict(reveal=1.5), dict(reveal=0.5, attention="bidirectional"),
                                dict(reveal=0.5, block_size=2), dict(reveal=0.5, head="eagle3")])
def test_reveal_is_refused_where_it_means_nothing(kw):
    with pytest.raises(JetFlowError, match="reveal"):
        config(**kw)


def test_bfloat16_autocast_trains_with_the_fp32_loss_and_keeps_fp32_weights(target, data, tmp_path):
    seqs = load_sequences(data, target)
    plain = Trainer(target, seqs, tmp_path / "fp32", config(epochs=2))
    mixed = Trainer(target, seqs, tmp_path / "amp", config(epochs=2, amp="bfloat16"))
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    want, got = (float(t.sequence_loss(0, g())[0].detach()) for t in (plain, mixed))
    assert got == pytest.approx(want, rel=0.05) and got != want  # bf16 matmuls: close, not bit-equal
    first = mixed.evaluate()["eval_loss"]
    mixed.fit(log=lambda r: None)
    assert mixed.evaluate()["eval_loss"] < first
    assert all(p.dtype == torch.float32 for p in mixed.head.parameters())


def test_unknown_amp_dtype_is_refused():
    with pytest.raises(JetFlowError, match="amp must be one of"):
        config(amp="int8")


def test_a_time_budget_stops_training_and_decays_the_rate_over_it(target, data, tmp_path):
    seqs = load_sequences(data, target)
    cfg = config(epochs=50, warmup_steps=0, max_seconds=4.5)
    trainer = Trainer(target, seqs, tmp_path / "run", cfg)
    ticks = iter(range(10_000))
    trainer.clock = lambda: float(next(ticks))  # every step "takes" one second
    records = []
    result = trainer.fit(log=records.append)
    assert trainer.step == 5 and result["seconds"] == 5.0 < trainer.total_steps  # out of time, not of steps
    rates = [r["lr"] for r in records]
    assert rates == sorted(rates, reverse=True) and rates[0] == cfg.lr
    # by steps alone the last rate would be ~cfg.lr; the budget brings it near the end of the cosine
    assert rates[-1] == pytest.approx(cfg.lr * 0.5 * (1 + math.cos(math.pi * 4 / 4.5)))
    resumed = Trainer(target, seqs, tmp_path / "run", cfg)  # the spent budget is saved with the run
    assert resumed.resume() and resumed.elapsed == 5.0
    resumed.fit(log=lambda r: None)
    assert resumed.step == 5
    with pytest.raises(JetFlowError, match="max_seconds"):
        config(max_seconds=-1)


@pytest.mark.parametrize("kw", [
    dict(dense_depth1=0.5, feed_last_feature=True, depth_embedding=True),
    dict(dense_depth1=1.0, dense_depth1_anchors=3, reveal=0.5, shift_tokens=True, path_projection=True,
         feed_last_feature=True, gamma=2.0),
    dict(loss="sft", draft_vocab=40, reveal=0.5),
    dict(attention="bidirectional", loss="rkl"),
    dict(head="eagle3", block_size=4, gamma=4.48),
])
def test_a_packed_micro_batch_gives_each_sequence_the_loss_it_has_alone(target, data, tmp_path, kw):
    """The sequences of a micro-batch go through the target and the head together, packed end to end;
    each sequence's loss and agreement must equal what it gets alone (the reference: one sequence per
    call), in training mode (revealed blocks, dense depth-1 term) and in held-out evaluation."""
    seqs = load_sequences(data, target)
    trainer = Trainer(target, seqs, tmp_path / "run", config(**kw))
    indices = [0, 3, 1, 5]
    g = lambda i: torch.Generator().manual_seed(100 + i)  # noqa: E731
    for training in (True, False):
        trainer.head.train(training)
        packed, info = trainer.batch_loss([(i, g(i)) for i in indices])
        alone = [trainer.batch_loss([(i, g(i))]) for i in indices]
        torch.testing.assert_close(packed, torch.cat([a for a, _ in alone]), atol=1e-5, rtol=1e-5)
        for key in ("depth", "agree"):
            assert info[key].tolist() == torch.cat([a[key] for _, a in alone]).tolist()
        assert info["sequence"].tolist() == [k for k, (_, a) in enumerate(alone) for _ in a["depth"]]
    trainer.head.train()
    packed, _ = trainer.batch_loss([(i, g(i)) for i in indices])
    packed.sum().backward()  # gradients flow through the packed forward
    assert all(p.grad is not None for p in trainer.head.parameters() if p.requires_grad)


def test_online_teacher_batches_sequences_into_one_target_forward(target, data):
    """fetch_many runs one right-padded forward: the same features and teacher rows as one forward
    per sequence (the brute-force reference), in request order."""
    from jetflow.training.teacher import OnlineTeacher

    seqs = load_sequences(data, target)
    teacher = OnlineTeacher(target, torch.tensor([3, 1, 4, 15, 9, 26]))
    requests = [(i, seqs[i], torch.arange(seqs[i].prompt_len, len(seqs[i].token_ids) - 1 - i % 2)) for i in (2, 0, 5)]
    features, rows, top1 = teacher.fetch_many(requests)
    alone = [teacher.fetch(*r) for r in requests]
    for f, (want, _) in zip(features, alone):  # fp32 matmuls of other shapes: equal up to rounding
        torch.testing.assert_close(f, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rows, torch.cat([t for _, t in alone]), atol=1e-4, rtol=1e-4)
    assert rows.shape == (sum(len(p) for _, _, p in requests), 6)
    full = OnlineTeacher(target, None)  # the top-1 is over the full vocabulary, not the six draft ids
    assert top1.tolist() == torch.cat([full.fetch(*r)[1] for r in requests]).argmax(-1).tolist()


@pytest.mark.parametrize("head, cached", [("block", False), ("block", True), ("eagle3", False)])
def test_held_out_agreement_of_a_reduced_vocab_head_is_scored_over_the_full_vocabulary(target, tmp_path, head,
                                                                                       cached):
    """A one-token draft vocabulary: the draft's top-1 is always that token, and so is the best
    in-vocabulary teacher token, so scoring against the restricted teacher counted every slot a hit.
    Scored against the target's top-1 over its full vocabulary (online, or the cache's sorted top-k),
    a token the target never puts first agrees nowhere, and its most frequent first token somewhere."""
    from jetflow.training.teacher import OnlineTeacher
    from jetflow.training.teacher_cache import build_teacher_cache

    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(f"random/{i}", torch.randint(0, 256, (30,), generator=g).tolist(), 6) for i in range(10)]
    cache = tmp_path / "cache" if cached else None
    if cached:
        build_teacher_cache(target, seqs, cache, top_k=4, progress=False)
    trainer = Trainer(target, seqs, tmp_path / "run", config(head=head, block_size=4, draft_vocab=1,
                                                            eval_sequences=2), teacher_cache=cache)
    full = OnlineTeacher(target, None)
    top1 = [t for i in trainer.eval_set
            for t in full.fetch(i, seqs[i], torch.arange(6, 29))[1].argmax(-1).tolist()]
    never, most = next(t for t in range(target.vocab_size) if t not in top1), max(set(top1), key=top1.count)
    for token in (never, most):
        trainer.head.set_draft_vocab(torch.tensor([token]))
        trainer._bind_vocab()
        restricted = trainer.teacher.fetch(trainer.eval_set[0], seqs[trainer.eval_set[0]], torch.arange(6, 29))[1]
        assert restricted.shape == (23, 1)  # its argmax is always the draft's pick: a hit for the old metric
        agreement = trainer.evaluate()["top1_agreement"]
        assert len(agreement) == 3
        if token == never:
            assert agreement == [0.0, 0.0, 0.0]
        else:
            assert 0 < sum(agreement) / 3 < 1


@pytest.mark.parametrize("head", ["block", "eagle3"])
def test_held_out_sft_agreement_counts_slots_whose_data_token_the_reduced_vocab_lacks(target, tmp_path, head):
    """With --loss sft a slot whose data token is outside the draft vocabulary has no label to learn,
    but the head still drafts there: its agreement counts (the head can never propose that token),
    so the held-out agreement is the one the KL losses score, over the same slots."""
    from jetflow.training.teacher import OnlineTeacher

    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(f"random/{i}", torch.randint(0, 256, (30,), generator=g).tolist(), 6) for i in range(10)]
    trainer = Trainer(target, seqs, tmp_path / "run", config(head=head, block_size=4, draft_vocab=1, loss="sft",
                                                            eval_sequences=2))
    full = OnlineTeacher(target, None)
    top1 = [t for i in trainer.eval_set
            for t in full.fetch(i, seqs[i], torch.arange(6, 29))[1].argmax(-1).tolist()]
    trainer.head.set_draft_vocab(torch.tensor([max(set(top1), key=top1.count)]))  # random data: mostly other tokens
    trainer._bind_vocab()
    sft = trainer.evaluate()["top1_agreement"]
    trainer.config.loss = "fkl"
    assert len(sft) == 3 and 0 < sum(sft) / 3 < 1
    assert sft == trainer.evaluate()["top1_agreement"]


def test_packing_changes_no_training_step(target, data, tmp_path):
    """--pack-sequences only groups the work: a step with the micro-batch in one forward leaves the
    head where one forward per sequence does; on the CPU the default is one per forward."""
    seqs = load_sequences(data, target)
    heads = []
    for pack in (1, 4):
        trainer = Trainer(target, seqs, tmp_path / f"p{pack}", config(batch_size=4, dense_depth1=0.5,
                                                                      pack_sequences=pack))
        assert [len(p) for p in trainer.packs(list(range(6)))] == ([1] * 6 if pack == 1 else [4, 2])
        for _ in range(2):
            trainer.train_step()
        heads.append(trainer.head.state_dict())
    # Adam divides by sqrt(v), so where a gradient is tiny, last-bit differences between the two
    # groupings become a visible share of a step (seen: 1.3e-5 on one of 8,192 weights, AVX-512
    # EPYC); wrong masks or positions in a pack would move weights by whole steps (lr 3e-3 / warmup).
    for name, value in heads[0].items():
        torch.testing.assert_close(heads[1][name], value, atol=5e-5, rtol=1e-4, msg=name)
    assert len(Trainer(target, seqs, tmp_path / "d", config()).packs(list(range(3)))) == 3  # CPU: one each
    with pytest.raises(JetFlowError, match="pack_sequences"):
        config(pack_sequences=-1)
