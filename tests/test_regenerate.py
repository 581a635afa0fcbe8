import dataclasses
import json

import numpy as np
import pytest

import jetflow
from jetflow.data.prompts import Prompt, load_prompts
from jetflow.data.regenerate import regenerate
from jetflow.data.shards import list_shards, read_shard
from jetflow.decoding.prompt import encode_prompt
from jetflow.errors import InvalidRequestError, JetFlowError
from jetflow.models.identity import model_identity
from jetflow.models.target import TargetModel
from tiny import tiny_model


@pytest.fixture(scope="module")
def target(tokenizer):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    return TargetModel(model, tokenizer, name="tiny", tapped_layers=[1])


def prompts(n):
    return [Prompt("toy", f"toy/{i}", (("user", "q" * (1 + i % 5) + str(i)),)) for i in range(n)]


def test_batched_generation_equals_single_greedy(target):
    ps = [encode_prompt(target.tokenizer, p.as_chat()) for p in prompts(5)]
    target.model.generation_config.eos_token_id = 65  # 'A' in the byte tokenizer: some rows stop early
    try:
        answers = target.generate_batch(ps, 20)
        for ids, ans in zip(ps, answers):
            assert ans == jetflow.generate(target, ids, max_new_tokens=20).token_ids
    finally:
        target.model.generation_config.eos_token_id = None
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        target.generate_batch(ps, 0)
    assert target.generate_batch([], 4) == []


def test_a_prompt_the_chat_template_refuses_is_named_and_the_shards_before_it_kept(target, tmp_path):
    import copy

    strict = copy.copy(target)
    strict.tokenizer = copy.deepcopy(target.tokenizer)
    strict.tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                                      "supported') }}{% endif %}" + target.tokenizer.chat_template)
    bad = Prompt("toy", "toy/sys", (("system", "be brief"), ("user", "q")))
    with pytest.raises(JetFlowError, match="prompt toy/sys: .*System role not supported"):
        regenerate(strict, prompts(3) + [bad], tmp_path / "a", max_new_tokens=4, batch_size=3, shard_size=3,
                   sources="toy", progress=False)
    assert [p.name for p in list_shards(tmp_path / "a")] == ["shard-00000.npz"]


def test_regenerate_shards_manifest_and_resume(target, tmp_path, monkeypatch):
    full = regenerate(target, prompts(7), tmp_path / "a", max_new_tokens=6, batch_size=3, shard_size=3,
                      sources="toy", progress=False)
    assert full["complete"] and full["totals"]["sequences"] == 7
    shards = list_shards(tmp_path / "a")
    assert [p.name for p in shards] == ["shard-00000.npz", "shard-00001.npz", "shard-00002.npz"]
    seqs = [s for p in shards for s in read_shard(p)]
    assert sorted(s.prompt_id for s in seqs) == sorted(p.id for p in prompts(7))
    assert all(1 <= s.answer_len <= 6 for s in seqs)
    assert full["totals"]["answer_tokens"] == sum(s.answer_len for s in seqs)
    assert np.load(shards[0])["tokens"].dtype == np.uint16

    # Kill during the second shard, then resume: same shards as the uninterrupted run.
    calls = {"n": 0}
    real = target.generate_batch

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(target, "generate_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        regenerate(target, prompts(7), tmp_path / "b", max_new_tokens=6, batch_size=3, shard_size=3,
                   sources="toy", progress=False)
    assert [p.name for p in list_shards(tmp_path / "b")] == ["shard-00000.npz"]
    monkeypatch.undo()
    asked = []  # the prompts the resume generates for: only those of the shards not written
    monkeypatch.setattr(target, "generate_batch", lambda batch, *a: asked.extend(batch) or real(batch, *a))
    resumed = regenerate(target, prompts(7), tmp_path / "b", max_new_tokens=6, batch_size=3, shard_size=3,
                         sources="toy", progress=False)
    monkeypatch.undo()
    assert len(asked) == 4  # shards 1 and 2: prompts 3..6
    assert resumed["complete"] and resumed["totals"] == full["totals"]
    for a, b in zip(shards, list_shards(tmp_path / "b")):
        assert [s.token_ids for s in read_shard(a)] == [s.token_ids for s in read_shard(b)]

    with pytest.raises(JetFlowError, match="other settings"):
        regenerate(target, prompts(9), tmp_path / "b", max_new_tokens=6, batch_size=3, shard_size=3,
                   sources="toy", progress=False)
    reordered = prompts(7)[::-1]  # as many prompts, other ones or in another order (another --exclude)
    with pytest.raises(JetFlowError, match="prompts_digest"):
        regenerate(target, reordered, tmp_path / "b", max_new_tokens=6, batch_size=3, shard_size=3,
                   sources="toy", progress=False)
    with pytest.raises(JetFlowError, match="leaves no room for a prompt"):
        regenerate(target, prompts(7), tmp_path / "c", max_new_tokens=target.max_context, progress=False)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["num_prompts"] == 7
    # The model's identity without runtime keys: data serves every runtime, older manifests still resume.
    assert "backend" in target.identity() and manifest["target"] == model_identity(target)


def write_prompt_file(path, word, n):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": f"{word} {i}"}) + "\n" for i in range(n)))
    return str(path)


def test_a_same_named_prompt_file_elsewhere_is_neither_excluded_nor_resumed_as_done(target, tmp_path):
    """a/prompts.jsonl and b/prompts.jsonl (run from their own directories: one --prompts string)."""
    a = write_prompt_file(tmp_path / "a" / "prompts.jsonl", "alpha", 4)
    b = write_prompt_file(tmp_path / "b" / "prompts.jsonl", "beta", 4)
    out = tmp_path / "held-out"
    regenerate(target, load_prompts(a), out, max_new_tokens=2, sources="prompts.jsonl", progress=False)
    exclude = {s.prompt_id for shard in list_shards(out) for s in read_shard(shard)}  # (as --exclude reads it)
    assert load_prompts(a, exclude=exclude) == [] and len(load_prompts(b, exclude=exclude)) == 4
    with pytest.raises(JetFlowError, match="prompts_digest"):  # not taken for a's finished regeneration
        regenerate(target, load_prompts(b), out, max_new_tokens=2, sources="prompts.jsonl", progress=False)


def test_a_data_dir_of_line_number_ids_resumes_with_them(target, tmp_path, monkeypatch):
    """A directory regenerated before .jsonl ids named their content (ids "<file>/<line>", no
    prompt_id_version in its manifest) resumes: its shards are kept, the rest get ids of its kind."""
    path = write_prompt_file(tmp_path / "prompts.jsonl", "question", 7)
    settings = dict(max_new_tokens=4, batch_size=3, shard_size=3, sources=path, progress=False)
    out = tmp_path / "old"
    # what a run of before, killed after its first shard, left
    regenerate(target, [dataclasses.replace(p, id=p.legacy_id) for p in load_prompts(path)], out, **settings)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.pop("prompt_id_version", None)
    for name in ("shard-00001.npz", "shard-00002.npz"):
        del manifest["shards"][name]
        (out / name).unlink()
    (out / "manifest.json").write_text(json.dumps(manifest))

    asked = []
    real = target.generate_batch
    monkeypatch.setattr(target, "generate_batch", lambda batch, *a: asked.extend(batch) or real(batch, *a))
    resumed = regenerate(target, load_prompts(path), out, **settings)
    assert resumed["complete"] and len(asked) == 4  # shard 0 kept, shards 1 and 2 written
    ids = [s.prompt_id for shard in list_shards(out) for s in read_shard(shard)]
    assert sorted(ids) == sorted(p.legacy_id for p in load_prompts(path))  # no mixed kinds, no repeats
    assert "prompt_id_version" not in json.loads((out / "manifest.json").read_text())
    fresh = regenerate(target, load_prompts(path), tmp_path / "new", **settings)
    assert fresh["prompt_id_version"] == 2
    assert {s.prompt_id for shard in list_shards(tmp_path / "new") for s in read_shard(shard)} == \
        {p.id for p in load_prompts(path)}


def test_dataset_answers_arm(target, tmp_path):
    """answers="dataset": the reference answer + EOS, cut at max_new_tokens; no reference, no sequence."""
    target.model.generation_config.eos_token_id = 65
    try:
        ps = [Prompt("toy", "toy/0", (("user", "q0"),), "short"), Prompt("toy", "toy/1", (("user", "q1"),)),
              Prompt("toy", "toy/2", (("user", "q2"),), "a rather long reference answer")]
        m = regenerate(target, ps, tmp_path / "raw", max_new_tokens=8, shard_size=8, answers="dataset",
                       progress=False)
        seqs = {s.prompt_id: s for s in read_shard(list_shards(tmp_path / "raw")[0])}
        assert set(seqs) == {"toy/0", "toy/2"} and m["shards"]["shard-00000.npz"]["skipped_no_answer"] == 1
        tok = target.tokenizer
        s0 = seqs["toy/0"]
        assert s0.token_ids[:s0.prompt_len] == encode_prompt(tok, ps[0].as_chat())
        assert s0.token_ids[s0.prompt_len:] == tok("short", add_special_tokens=False)["input_ids"] + [65]
        assert seqs["toy/2"].answer_len == 8  # cut at max_new_tokens
        assert json.loads((tmp_path / "raw" / "manifest.json").read_text())["answers"] == "dataset"
        with pytest.raises(JetFlowError, match="other settings"):  # a target-answer run cannot resume it
            regenerate(target, ps, tmp_path / "raw", max_new_tokens=8, shard_size=8, progress=False)
    finally:
        target.model.generation_config.eos_token_id = None


def test_training_sources_carry_their_reference_answers():
    from jetflow.data.prompts import load_gsm8k_train, load_math_train

    g = load_gsm8k_train()[0]
    assert "####" in g.reference  # GSM8K's own answer format
    assert load_math_train()[0].reference.strip()
    assert g == Prompt(g.source, g.id, g.messages)  # the reference plays no part in identity/dedup
