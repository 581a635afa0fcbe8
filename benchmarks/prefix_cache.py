"""A chat's next turn with and without the prompt prefix cache, on either backend.

Multi-turn conversations (MT-Bench: every question, then its second turn after the first answer)
decoded greedily in order, each arm in a context of its own so that its cache holds its own
previous request, like one chat client of a single-stream server or the Python API:

* ``ar, cache`` / ``ar, no cache``: JetFlow's plain loop with ``prefix_cache`` on (the default) / off;
* ``auto, cache`` / ``auto, no cache``: JetFlow's default decoder (shipped drafter, ``--budget
  auto``, prompt lookup), the same way; with the cache, a request that reads the target's features
  takes those kept for the cached prefix;
* ``auto, cache, own tokens`` / ``auto, no cache, own tokens`` / ``ar, no cache, own tokens``: the
  same with prompts from a :class:`jetflow.Conversation`, which keeps the answers' own tokens instead
  of encoding their text again (what ``jetflow chat`` sends); their outputs are compared with the
  plain loop's on those prompts, since their tokens may differ from the messages' encoding;
* llama.cpp only, ``llama-cpp-python, reuse`` / ``llama-cpp-python, reset``: ``Llama.generate``
  keeping the prefix it shares with its previous call (its default) / the cache cleared first (what
  ``jetflow bench``'s ``llama-ar`` does, so that every method prefills every prompt in full).

Arms run conversation by conversation, in an order that rotates. Prints seconds, prefill seconds
and prompt tokens taken from the cache per turn, and whether all outputs are identical.

    python benchmarks/prefix_cache.py --limit 10 --out docs/results/prefix_cache/llamacpp_mtbench10.json
    python benchmarks/prefix_cache.py --backend torch --limit 10 --out docs/results/prefix_cache/torch_mtbench10.json
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import jetflow
from jetflow.decoding.api import prepare_request
from jetflow.eval.datasets import load_eval_set
from jetflow.eval.llama_reference import llama_greedy, open_llama
from jetflow.eval.machine import machine
from jetflow.models.loading import load_target
from jetflow.utils.fs import write_json_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", choices=["llamacpp", "torch"], default="llamacpp")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def jetflow_arm(cache: bool, drafter: str, own_tokens: bool = False):
        target = load_target(None, backend=args.backend, n_threads=args.threads)
        target.prefix_cache = cache
        decoder = jetflow.JetFlow.from_pretrained(target, drafter, budget="auto") if drafter != "none" else None
        conversation = jetflow.Conversation(target.tokenizer)

        def run(messages, max_new_tokens=args.max_new_tokens):
            if own_tokens:  # the conversation's turns so far are this arm's own (a new one starts at turn 1)
                if len(messages) == 1:
                    conversation.reset()
                ids = conversation.prompt(messages[-1]["content"])
                result = (jetflow.generate(target, ids, max_new_tokens=max_new_tokens) if decoder is None
                          else decoder.generate(ids, max_new_tokens=max_new_tokens))
                conversation.add_answer(result)
                return result
            if decoder is None:
                return jetflow.generate(target, messages, max_new_tokens=max_new_tokens)
            return decoder.generate(messages, max_new_tokens=max_new_tokens)
        # Untimed: the first `auto` request on a machine measures its cost curve, and the first
        # forwards warm the runtime.
        run([{"role": "user", "content": "Say hello."}], max_new_tokens=8)
        target.reset()
        return target, run

    arms = {"ar, cache": jetflow_arm(True, "none"), "ar, no cache": jetflow_arm(False, "none"),
            "auto, cache": jetflow_arm(True, "auto"), "auto, no cache": jetflow_arm(False, "auto"),
            "auto, cache, own tokens": jetflow_arm(True, "auto", own_tokens=True),
            "auto, no cache, own tokens": jetflow_arm(False, "auto", own_tokens=True),
            "ar, no cache, own tokens": jetflow_arm(False, "none", own_tokens=True)}
    reference = arms["ar, cache"][0]
    for reuse in (True, False) if args.backend == "llamacpp" else ():
        llm = open_llama(reference.gguf, n_ctx=reference.max_context, n_threads=args.threads)

        def run(messages, llm=llm, reuse=reuse):
            ids, _, output = prepare_request(reference, messages, max_new_tokens=args.max_new_tokens)
            _, seconds, _ = llama_greedy(llm, ids, output.max_new_tokens, output.stop_token_ids, output, reuse_prefix=reuse)
            return jetflow.GenerationResult.from_output(output, len(ids), seconds, 0.0, method="llama-ar")
        arms[f"llama-cpp-python, {'reuse' if reuse else 'reset'}"] = (None, run)

    names = list(arms)
    totals = {name: collections.defaultdict(float) for name in names}
    outputs = {name: [] for name in names}
    conversations = load_eval_set(args.dataset, args.limit)
    if any(c.history or not c.chat for c in conversations):  # (the own-tokens arms start each from its first turn)
        raise SystemExit(f"{args.dataset}: prompts with a fixed history, or not chat, are not supported here")
    for c, prompt in enumerate(conversations):
        order = names[c % len(names):] + names[:c % len(names)]
        for name in order:
            _, run = arms[name]
            answers: list[str] = []
            for turn in range(len(prompt.turns)):
                t = time.perf_counter()
                result = run(prompt.request(answers))
                seconds = time.perf_counter() - t
                answers.append(result.text)
                outputs[name].append(result.token_ids)
                row = totals[name]
                row[f"turn{turn + 1}_s"] += seconds
                row[f"turn{turn + 1}_prefill_s"] += result.prefill_seconds
                row[f"turn{turn + 1}_prompt_tokens"] += result.prompt_tokens
                row[f"turn{turn + 1}_cached_tokens"] += result.cached_prompt_tokens
                row["tokens"] += result.new_tokens
                row["seconds"] += seconds
        print(f"{c + 1}/{len(conversations)} conversations", flush=True)
    same = {name: outputs[name] == outputs["ar, no cache, own tokens" if "own tokens" in name else "ar, no cache"]
            for name in names}
    out = {"command": ["benchmarks/prefix_cache.py", *__import__("sys").argv[1:]], "machine": machine(),
           "backend": args.backend, "dataset": args.dataset,
           "conversations": len(conversations), "max_new_tokens": args.max_new_tokens,
           "arms": {name: dict(row) for name, row in totals.items()},
           "identical": same, "identical_to": {name: "ar, no cache, own tokens" if "own tokens" in name
                                               else "ar, no cache" for name in names}}
    for name, row in totals.items():
        print(f"{name:28s} turn 1 {row['turn1_s']:6.2f} s, turn 2 {row['turn2_s']:6.2f} s "
              f"(prefill {row['turn2_prefill_s']:.2f} s, {int(row['turn2_cached_tokens'])} of "
              f"{int(row['turn2_prompt_tokens'])} prompt tokens cached), {row['tokens'] / row['seconds']:.1f} tok/s, "
              f"identical: {same[name]}")
    write_json_atomic(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
