import json

import pytest
import torch

import jetflow
from jetflow.data.shards import Sequence, write_shard
from jetflow.errors import JetFlowError
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
    interrupted.fit(max_steps=3, log=lambda r: None)  # "killed" after the step-3 checkpoint
    resumed = Trainer(target, seqs, tmp_path / "b", cfg)
    assert resumed.resume() and resumed.step == 3
    resumed.fit(log=lambda r: None)
    assert resumed.step == straight.step
    for (name, a), b in zip(straight.head.state_dict().items(), resumed.head.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(JetFlowError, match="other settings"):
        Trainer(target, seqs, tmp_path / "b", config(epochs=5)).resume()


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


def test_a_head_that_shifts_tokens_learns_from_revealed_paths(target, data, tmp_path):
    """--shift-tokens --reveal (revealed slots supervised too): the run fits, and the saved head
    shifts, runs its second pass, decodes losslessly and accepts much on the overfitted set."""
    seqs = load_sequences(data, target)
    trainer = Trainer(target, seqs, tmp_path / "run", config(lr=1e-2, epochs=150, reveal=0.5, shift_tokens=True,
                                                             feed_last_feature=True, depth_embedding=True))
    first = trainer.evaluate()["eval_loss"]
    trainer.fit(log=lambda r: None)
    assert trainer.evaluate()["eval_loss"] < first / 5
    head = jetflow.DraftHead.from_pretrained(tmp_path / "run" / "drafter", target=target)
    assert head.config.shift_tokens and head.config.path_refine
    jf = jetflow.JetFlow(target, head, budget=16, width=3, lookup=False)
    assert lossless_tau(jf, seqs, trainer.train_set) > 3.0


@pytest.mark.parametrize("kw", [dict(shift_tokens=True, attention="bidirectional"),
                                dict(shift_tokens=True, head="eagle3")])
def test_shift_tokens_is_refused_where_it_means_nothing(kw):
    with pytest.raises(JetFlowError, match="shift-tokens"):
        config(**kw)


@pytest.mark.parametrize("kw", [dict(reveal=1.5), dict(reveal=0.5, attention="bidirectional"),
                                dict(reveal=0.5, block_size=2), dict(reveal=0.5, head="eagle3")])
def test_reveal_is_refused_where_it_means_nothing(kw):
    with pytest.raises(JetFlowError, match="reveal"):
        config(**kw)
