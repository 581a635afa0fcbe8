"""Whole requests on the llama.cpp backend: how much of each method's time is llama.cpp's decoding,
and how much is the Python around it.

Three methods on the same GGUF, timed prompt by prompt in a rotating order (so that drift in the
machine's speed falls on all alike), with every ``llama_decode`` call timed as well:

* ``llama-ar``: llama-cpp-python's own greedy loop (``Llama.generate``), the reference;
* ``ar``: JetFlow's plain loop;
* ``auto``: the default decoder (head + lookup) at ``--budget auto``.

Greedy, first turns only; outputs are checked against ``llama-ar``'s. Each method is timed from the
prompt's messages to its text: ``llama-ar`` encodes the prompt and turns its tokens into text inside
its timing, as JetFlow's loops do. On a 2-core CPU a one-token
decode is ~10-15 ms and the three loops run the same decodes, so the Python time per token is what
separates them. Each set is also summed over the prompts whose ``auto`` request ran without the
head's features (the head settled as losing), which isolates the plain and lookup rounds from the
requests that tap features and explore drafts.

    python benchmarks/llamacpp_loop_overhead.py --datasets mtbench,gsm8k --limit 20 --out loop.json
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import jetflow
from jetflow.decoding.api import prepare_request
from jetflow.decoding.prompt import encode_prompt
from jetflow.eval.datasets import load_eval_set
from jetflow.eval.llama_reference import llama_greedy, open_llama
from jetflow.utils.fs import write_json_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--datasets", default="mtbench,gsm8k")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    decoder = jetflow.JetFlow.from_pretrained(backend="llamacpp", n_threads=args.threads, drafter="auto")
    target = decoder.target
    target.prefix_cache = False  # every method prefills in full, as in jetflow bench
    llm = open_llama(target.gguf, n_ctx=target.max_context, n_threads=args.threads, flash_attn=target.flash_attn)
    stop = target.stop_token_ids()

    # Both loops call llama_decode through the same binding module: time it there.
    import llama_cpp._internals as internals

    decode = {"s": 0.0, "calls": 0}
    raw_decode = internals.llama_cpp.llama_decode

    def timed_decode(*a):
        t = time.perf_counter()
        rc = raw_decode(*a)
        decode["s"] += time.perf_counter() - t
        decode["calls"] += 1
        return rc

    internals.llama_cpp.llama_decode = timed_decode

    def llama_ar(prompt, ids, chat):  # the same work as the others: the prompt encoded, the tokens turned into text
        ids, _, output = prepare_request(target, prompt, max_new_tokens=args.max_new_tokens, chat=chat)
        tokens, _, _ = llama_greedy(llm, ids, args.max_new_tokens, stop, output)
        return tokens

    kinds = Counter()  # auto's rounds by kind (plain / lookup / drafted), for the set being run
    features = []  # whether auto's latest request collected the head's features

    def auto(prompt, ids, chat):
        result = decoder.generate(prompt, budget="auto", max_new_tokens=args.max_new_tokens, chat=chat)
        kinds.update(result.stats["round_kinds"])
        features[:] = [result.stats["features"]]
        return result.token_ids

    methods = {"llama-ar": llama_ar,
               "ar": lambda p, ids, chat: jetflow.generate(target, p, max_new_tokens=args.max_new_tokens,
                                                           chat=chat).token_ids,
               "auto": auto}
    names = list(methods)
    report = {"command": ["benchmarks/llamacpp_loop_overhead.py", *__import__("sys").argv[1:]],
              "threads": args.threads, "max_new_tokens": args.max_new_tokens, "sets": {}}
    for dataset in args.datasets.split(","):
        prompts = load_eval_set(dataset, args.limit)
        # all prompts, and the prompts whose auto request ran without features (once the head has
        # settled as losing: no taps, no head, only plain and lookup rounds)
        total, featureless = ({n: dict.fromkeys(("tokens", "seconds", "decode_s", "decode_calls"), 0) for n in names}
                              for _ in range(2))
        mismatches, n_featureless = [], 0
        kinds.clear()
        for i, prompt in enumerate(prompts):
            request = prompt.as_chat()
            ids = encode_prompt(target.tokenizer, request, prompt.chat)
            outputs, rows = {}, {}
            for name in names[i % 3:] + names[:i % 3]:  # rotating order
                decode["s"], decode["calls"] = 0.0, 0
                t = time.perf_counter()
                outputs[name] = methods[name](request, ids, prompt.chat)
                rows[name] = {"tokens": len(outputs[name]), "seconds": time.perf_counter() - t,
                              "decode_s": decode["s"], "decode_calls": decode["calls"]}
            n_featureless += not features[0]
            for sums in (total, featureless) if not features[0] else (total,):
                for name, row in rows.items():
                    for key, value in row.items():
                        sums[name][key] += value
            mismatches += [f"{prompt.id}:{n}" for n in names[1:] if outputs[n] != outputs["llama-ar"]]
        set_report = {"prompts": len(prompts), "mismatches": mismatches, "auto_round_kinds": dict(kinds),
                      "featureless_prompt_count": n_featureless}
        for label, sums in (("methods", total), ("featureless_prompts", featureless)):
            for row in sums.values():
                row["tokens_per_s"] = row["tokens"] / max(row["seconds"], 1e-9)
                row["python_ms_per_token"] = 1e3 * (row["seconds"] - row["decode_s"]) / max(1, row["tokens"])
                row["decode_ms_per_call"] = 1e3 * row["decode_s"] / max(1, row["decode_calls"])
            ref = sums["llama-ar"]["tokens_per_s"]
            set_report[label] = sums
            set_report["vs_llama_ar" if label == "methods" else "featureless_vs_llama_ar"] = {
                n: sums[n]["tokens_per_s"] / max(ref, 1e-9) for n in names}
            for n in names if label == "methods" or n_featureless else ():
                r = sums[n]
                print(f"{dataset:10s} {n:9s} {r['tokens_per_s']:6.1f} tok/s ({r['tokens_per_s'] / max(ref, 1e-9):.3f}x)  "
                      f"decode {r['decode_ms_per_call']:.2f} ms/call  python {r['python_ms_per_token']:.3f} ms/token"
                      + ("" if label == "methods" else f"  ({n_featureless} prompts where auto ran without features)"),
                      flush=True)
        report["sets"][dataset] = set_report
        print(f"{dataset:10s} outputs differing from llama-ar: {len(mismatches)}; auto's rounds: {dict(kinds)}",
              flush=True)
    if args.out:
        write_json_atomic(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
