import json

import pytest
import torch

import jetflow
from jetflow.data.shards import Sequence, write_shard
from jetflow.errors import JetFlowError
from jetflow.models.target import TargetModel
from jetflow.training.trainer import TrainConfig, Trainer, load_sequences
from tiny import tiny_model


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
    lengths = []
    for seq in trainer.train_set:
        prompt = seq.token_ids[: seq.prompt_len]
        spec = jf.generate(prompt, max_new_tokens=30)
        assert spec.token_ids == jetflow.generate(target, prompt, max_new_tokens=30).token_ids
        lengths += spec.stats["accept_lengths"]
    assert sum(lengths) / len(lengths) > 3.0  # block size 5: at most 5 per round
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
