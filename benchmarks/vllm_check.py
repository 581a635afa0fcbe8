"""Run a target in vLLM with and without an exported JetFlow head (DFlash chain mode) and report the
outputs, vLLM's acceptance and its speed. Runs inside the vLLM venv (`make vllm-venv`); it imports
only vLLM and the standard library, so JetFlow's own pins never meet vLLM's.

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python benchmarks/vllm_check.py \
        --target ~/.cache/jetflow/models/smollm2-135m-instruct-<hash> --drafter runs/vllm-export \
        --prompts prompts.json --max-tokens 128 --spec-tokens 15 --out vllm.json

``--prompts``: a JSON list of token-id lists (already chat-templated, so both sides see the same ids).
"""

from __future__ import annotations

import argparse
import json
import time


def acceptance(metrics) -> dict:
    """Drafts, draft tokens, accepted tokens and accepted per position from ``LLM.get_metrics()``."""
    out = {}
    for m in metrics:
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] = m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] = m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted_tokens"] = m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_position"] = list(m.values)
    if out.get("drafts"):
        out["mean_acceptance_length"] = 1 + out["accepted_tokens"] / out["drafts"]  # bonus token included
    return out


def run(target: str, prompts: list[list[int]], max_tokens: int, speculative: dict | None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              speculative_config=speculative, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(temperature=0.0, max_tokens=4))
    outputs, seconds, tokens = [], 0.0, 0
    for ids in prompts:  # one request at a time: single-stream latency, like JetFlow's loop
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
        outputs.append(list(out.token_ids))
    result = {"outputs": outputs, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    if speculative:
        result["acceptance"] = acceptance(llm.get_metrics())
    del llm
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec-tokens", type=int, nargs="+", default=[15])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prompts = json.load(open(args.prompts))
    report = {"plain": run(args.target, prompts, args.max_tokens, None)}
    for k in args.spec_tokens:
        spec = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": k}
        report[f"dflash_{k}"] = run(args.target, prompts, args.max_tokens, spec)
    import vllm

    report["vllm_version"] = vllm.__version__
    json.dump(report, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
