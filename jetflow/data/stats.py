"""What a set of regenerated data holds: sequences and answer tokens per prompt source, how many
answers run long, and how fast each directory was produced (from its manifest).

A prompt id is ``source/index`` (e.g. ``sharegpt/123``), so the source of every sequence is known
without the prompts themselves. Given drafters, it also counts how much of each source's answer
text their draft vocabulary covers: a reduced-vocabulary head never proposes the other tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from jetflow.data.shards import REGENERATED, check_distinct, list_shards, read_shard
from jetflow.errors import JetFlowError
from jetflow.utils.fs import read_manifest


def draft_vocabulary(drafter: Path) -> np.ndarray | None:
    """Target ids a drafter checkpoint can propose, or None for a full-vocabulary head."""
    from jetflow.models.checkpoint import load_drafter

    if not (Path(drafter) / "model.safetensors").is_file():
        raise JetFlowError(f"{drafter} is not a drafter checkpoint (no model.safetensors)")
    ids = load_drafter(drafter).draft_ids  # the head's own d2t reading
    return None if ids is None else ids.numpy()


def data_stats(dirs: list[Path], long_answer: int = 500, drafters: list[Path] = ()) -> dict:
    """Totals, per-source counts and shares, and per-directory production stats of ``dirs``; with
    ``drafters``, the share of each source's answer tokens inside each one's draft vocabulary."""
    sequences, answer_tokens, long_answers = Counter(), Counter(), Counter()
    vocabs = {str(d): draft_vocabulary(d) for d in drafters}
    covered = {name: Counter() for name in vocabs}
    per_dir = {}
    check_distinct(dirs)
    for d in dirs:
        if not d.is_dir():
            raise JetFlowError(f"--data {d}: " + ("is a file, not a data directory" if d.exists() else "not found"))
        shards = list_shards(d)
        if not shards:
            raise JetFlowError(f"{d} holds no token shards (shard-NNNNN.npz): not a `jetflow regenerate` output")
        manifest = read_manifest(d, REGENERATED) or {}
        records = manifest.get("shards", {})
        seconds = sum(r.get("seconds", 0.0) for r in records.values())
        tokens = sum(r.get("answer_tokens", 0) for r in records.values())
        n = 0
        for path in shards:
            for s in read_shard(path):
                source = s.prompt_id.split("/", 1)[0]
                sequences[source] += 1
                answer_tokens[source] += s.answer_len
                long_answers[source] += s.answer_len >= long_answer
                answer = np.asarray(s.token_ids[s.prompt_len:])
                for name, vocab in vocabs.items():
                    covered[name][source] += s.answer_len if vocab is None else int(np.isin(answer, vocab).sum())
                n += 1
        per_dir[str(d)] = {"shards": len(shards), "sequences": n,
                           "backends": sorted({r["backend"] for r in records.values() if "backend" in r}),
                           "answer_tokens_per_s": tokens / seconds if seconds else None}
    total = sum(answer_tokens.values())
    return {"sequences": sum(sequences.values()), "answer_tokens": total, "long_answer": long_answer,
            f"answers_of_{long_answer}_tokens_or_more": sum(long_answers.values()),
            "sources": {src: {"sequences": sequences[src], "answer_tokens": answer_tokens[src],
                              "share": answer_tokens[src] / total if total else 0.0,
                              f"answers_of_{long_answer}_or_more": long_answers[src]}
                        for src in sorted(answer_tokens, key=answer_tokens.get, reverse=True)},
            "directories": per_dir,
            **({"draft_vocabulary_coverage": {
                name: {"all": sum(c.values()) / total if total else 0.0,
                       "sources": {src: c[src] / answer_tokens[src] if answer_tokens[src] else 0.0
                                   for src in sorted(answer_tokens, key=answer_tokens.get, reverse=True)}}
                for name, c in covered.items()}} if vocabs else {})}


def format_stats(stats: dict) -> str:
    n = stats["long_answer"]
    lines = [f"{stats['sequences']} sequences, {stats['answer_tokens']:,} answer tokens, "
             f"{stats[f'answers_of_{n}_tokens_or_more']} answers of {n}+ tokens", "",
             f"| source | sequences | answer tokens | share | answers of {n}+ tokens |", "|---|---|---|---|---|"]
    for src, row in stats["sources"].items():
        lines.append(f"| {src} | {row['sequences']} | {row['answer_tokens']:,} | {row['share']:.1%} "
                     f"| {row[f'answers_of_{n}_or_more']} |")
    lines.append("")
    for d, row in stats["directories"].items():
        rate = row["answer_tokens_per_s"]
        lines.append(f"{d}: {row['shards']} shards, {row['sequences']} sequences, backend "
                     f"{','.join(row['backends']) or '?'}, " + (f"{rate:.1f} answer tokens/s" if rate else "no timing"))
    for name, row in stats.get("draft_vocabulary_coverage", {}).items():
        per_source = ", ".join(f"{src} {share:.1%}" for src, share in row["sources"].items())
        lines.append(f"draft vocabulary of {name}: {row['all']:.1%} of the answer tokens ({per_source})")
    return "\n".join(lines)
