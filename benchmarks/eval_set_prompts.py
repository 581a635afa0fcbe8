"""Evaluation prompts as a JSONL file for `jetflow regenerate`, so that offline replay (`jetflow
eval-offline`) can score drafters on an evaluation set: the target answers once, greedily, and every
head and budget is then replayed against those answers without running the target again.

    python benchmarks/eval_set_prompts.py --dataset gsm8k --limit 50 --out runs/evalset/gsm8k.jsonl
    jetflow regenerate --prompts runs/evalset/gsm8k.jsonl --max-new-tokens 256 --backend torch \
        --out runs/evalset/gsm8k
    # a later turn of multi-turn sets (MT-Bench) is asked after the target's own earlier answers:
    python benchmarks/eval_set_prompts.py --dataset mtbench --limit 80 --turn 2 \
        --answers runs/evalset/mtbench-t1 --out runs/evalset/mtbench-t2.jsonl

Each line holds the chat messages of one prompt's turn exactly as `jetflow bench` asks it
(`EvalPrompt.request`), the earlier answers turned into text by the decoder's own output stream
(`OutputStream`, the text `jetflow bench` passes on to the next turn). Line i is the i-th prompt;
regenerated ids name a line's messages (`<file>/<digest>`), rebuilt here to map answers back.
Completion-style sets (HumanEval) are refused: they are not chats.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jetflow.data.prompts import content_digest, record_messages
from jetflow.data.shards import list_shards, read_shard
from jetflow.decoding.output import OutputStream
from jetflow.eval.datasets import load_eval_set


def earlier_answers(dirs: list[Path], prompts, tokenizer, stop_ids) -> list[list[str]]:
    """Per prompt, the text of its answers in ``dirs`` (one regeneration per earlier turn). A
    regenerated answer's id names its prompt's messages (``<file>/<digest>``), which are rebuilt here
    from the answers of the turns before; data regenerated before that holds ``<file>/<line>``."""
    answers: list[list[str]] = [[] for _ in prompts]
    for turn, d in enumerate(dirs, 1):
        by_key = {s.prompt_id.rsplit("/", 1)[1]: s.token_ids[s.prompt_len:]
                  for path in list_shards(d) for s in read_shard(path)}
        keys = [content_digest(record_messages({"messages": p.request(earlier)}))
                for p, earlier in zip(prompts, answers)]
        keys = [k if k in by_key else str(line) for line, k in enumerate(keys, 1)]
        missing = [line for line, k in enumerate(keys, 1) if k not in by_key]
        if missing:
            sys.exit(f"--answers {d} lacks turn-{turn} answers for prompts {missing[:5]} (line numbers)")
        for i, key in enumerate(keys):
            ids = by_key[key]
            stream = OutputStream(tokenizer, max_new_tokens=len(ids) + 1, stop_token_ids=stop_ids)
            stream.add_many(ids)
            answers[i].append(stream.text)
    return answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--turn", type=int, default=1, help="1-based turn to write")
    ap.add_argument("--answers", action="append", default=[], type=Path, metavar="DIR",
                    help="regenerated answers of each earlier turn, in order (turn - 1 of them)")
    ap.add_argument("--target", default=None, help="the target whose tokenizer decodes earlier answers")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    prompts = load_eval_set(args.dataset, args.limit)
    if not all(p.chat for p in prompts):
        ap.error(f"{args.dataset} is completion-style, not a chat")
    if len(args.answers) != args.turn - 1:
        ap.error(f"--turn {args.turn} needs {args.turn - 1} --answers directories, got {len(args.answers)}")
    prompts = [p for p in prompts if len(p.turns) >= args.turn]
    answers = [[] for _ in prompts]
    if args.answers:
        from jetflow.models.loading import load_target

        target = load_target(args.target, backend="torch")
        answers = earlier_answers(args.answers, prompts, target.tokenizer, target.stop_token_ids())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for prompt, earlier in zip(prompts, answers):
            f.write(json.dumps({"messages": prompt.request(earlier), "eval_id": prompt.id}) + "\n")
    print(json.dumps({"out": str(args.out), "prompts": len(prompts), "turn": args.turn}))


if __name__ == "__main__":
    main()
