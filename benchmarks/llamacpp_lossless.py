"""Greedy JetFlow on llama.cpp vs llama-cpp-python's own ``Llama`` greedy decoding, on N prompts
from each of five datasets; every difference is listed with its logit margin.

    python benchmarks/llamacpp_lossless.py --per-dataset 20 --max-new-tokens 128 \
        --out docs/results/llamacpp/lossless.json
    python benchmarks/llamacpp_lossless.py --datasets gsm8k --per-dataset 50 --only gsm8k/6 --only gsm8k/10 ...

Resumable: each prompt's record is appended to OUT.jsonl as it finishes; a rerun skips those.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jetflow.eval.datasets import load_eval_set  # noqa: E402
from jetflow.eval.lossless import LosslessRecord, check_prompt, summarize  # noqa: E402

DATASETS = ("gsm8k", "mtbench", "humaneval", "math500", "aime")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--budget", default="8")
    ap.add_argument("--per-dataset", type=int, default=20)
    ap.add_argument("--datasets", default=",".join(DATASETS), help="comma list (default: all five)")
    ap.add_argument("--only", action="append", default=[], metavar="ID",
                    help="check only these prompt ids (e.g. gsm8k/6, from a bench's mismatch list; repeat)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flash-attn", choices=["on", "off"], default="off", help="llama.cpp's attention kernel (default off)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch

    import jetflow
    from jetflow.eval.llama_reference import open_llama
    from jetflow.models.llamacpp_target import LlamaCppTarget
    from jetflow.models.gguf_meta import gguf_tokenizer
    from jetflow.models.resolve import locate_gguf

    torch.set_num_threads(args.threads)
    gguf, name = locate_gguf(args.target)
    target = LlamaCppTarget(gguf, gguf_tokenizer(gguf), name=name, n_threads=args.threads,
                            flash_attn=args.flash_attn == "on")
    jf = jetflow.JetFlow.from_pretrained(target, args.drafter)
    llm = open_llama(gguf, n_threads=args.threads, flash_attn=args.flash_attn == "on")
    budget = args.budget if args.budget == "auto" else int(args.budget)

    partial = args.out.with_suffix(".jsonl")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if partial.is_file():
        for line in partial.read_text().splitlines():
            rec = LosslessRecord(**json.loads(line))
            done[rec.id] = rec
    with partial.open("a") as log:
        for dataset in args.datasets.split(","):
            for prompt in load_eval_set(dataset, limit=args.per_dataset):
                if prompt.id in done or (args.only and prompt.id not in args.only):
                    continue
                rec = check_prompt(jf, llm, prompt, args.max_new_tokens, budget)
                done[rec.id] = rec
                log.write(json.dumps(asdict(rec)) + "\n")
                log.flush()
                mark = "same" if rec.identical else f"DIFF at {rec.first_diff} (margin {rec.margin})"
                print(f"{len(done):4d} {prompt.id:16s} {rec.new_tokens:4d} tok tau {rec.tau or 0:.2f} {mark}",
                      file=sys.stderr, flush=True)
    summary = summarize(list(done.values()))
    summary["settings"] = {k: str(v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "differences"}))
    for d in summary["differences"]:
        print(f"  {d['id']}: token {d['first_diff']} reference {d['reference_token']} vs {d['jetflow_token']}, "
              f"margin {d['margin']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
