"""Whole greedy requests on llama-cpp-python and on JetFlow's llama.cpp backend, and how much the
order in which the two engines take turns moves the comparison.

Four ways to answer the same prompts, all greedy, all on the same GGUF and threads:

* ``llama-ar``: the `jetflow bench` method (llama-cpp-python's ``Llama.generate`` through the
  method runner);
* ``llama-direct``: the very same function on the very same ``Llama`` object, called directly;
* ``ar``: the `jetflow bench` method (JetFlow's autoregressive loop, streaming detokenization);
* ``bare``: a minimal loop on JetFlow's backend (prefill, then ``extend`` one token at a time).

``llama-ar`` and ``llama-direct`` run identical code, so any difference between them is what the
position in the turn order does. ``--order rotate`` rotates the order from prompt to prompt (as
`jetflow bench` does by default); ``--order fixed`` runs llama-ar, llama-direct, ar, bare for every
prompt, so each engine's second method follows the same engine.

    python benchmarks/llamacpp_request_order.py --order fixed --out order.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from jetflow.decoding.prompt import encode_prompt
from jetflow.eval.datasets import load_eval_set
from jetflow.eval.llama_reference import llama_greedy
from jetflow.eval.methods import METHODS, MethodRunner
from jetflow.models.loading import load_target
from jetflow.utils.fs import write_json_atomic

WAYS = ["llama-ar", "llama-direct", "ar", "bare"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--order", choices=["rotate", "fixed"], default="fixed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(None, backend="llamacpp", n_threads=args.threads)
    runner = MethodRunner(target, {})
    stop = target.stop_token_ids()
    n_max = args.max_new_tokens

    def bare(ids):
        t0 = time.perf_counter()
        logits = target.prefill(ids, return_hidden=False).logits[-1]
        tokens = []
        while True:
            token = int(logits.numpy().argmax())
            tokens.append(token)
            if token in stop or len(tokens) >= n_max:
                return tokens, time.perf_counter() - t0
            logits = target.extend([token]).logits[-1]

    def run(way, prompt, ids):
        if way in ("llama-ar", "ar"):
            r = runner.run(METHODS[way], prompt.as_chat(), budget=None, max_new_tokens=n_max, chat=prompt.chat)
            return r.token_ids, r.seconds
        if way == "llama-direct":
            tokens, seconds, _ = llama_greedy(runner._llama, ids, n_max, stop)
            return tokens, seconds
        return bare(ids)

    totals = {w: {"tokens": 0, "seconds": 0.0} for w in WAYS}
    mismatches = 0
    prompts = load_eval_set(args.dataset, args.limit)
    # llama-ar first on the first prompt: it opens the Llama object that llama-direct reuses.
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, prompt.as_chat(), prompt.chat)
        order = WAYS if args.order == "fixed" or i == 0 else WAYS[i % 4:] + WAYS[:i % 4]
        outs = {}
        for way in order:
            tokens, seconds = run(way, prompt, ids)
            outs[way] = tokens
            totals[way]["tokens"] += len(tokens)
            totals[way]["seconds"] += seconds
        mismatches += len({tuple(t) for t in outs.values()}) > 1
        print(f"{prompt.id}: " + "  ".join(f"{w} {len(outs[w])}" for w in order), file=sys.stderr, flush=True)
    for w, t in totals.items():
        t["tokens_per_s"] = t["tokens"] / t["seconds"]
        print(f"{w:14s} {t['tokens_per_s']:.2f} tok/s ({t['tokens']} tokens, {t['seconds']:.2f} s)")
    print(f"prompts whose four outputs differ: {mismatches}")
    if args.out:
        write_json_atomic(args.out, {"command": ["benchmarks/llamacpp_request_order.py", *sys.argv[1:]],
                                     "order": args.order, "totals": totals, "mismatches": mismatches})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
