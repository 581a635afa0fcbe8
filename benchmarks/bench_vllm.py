"""JetFlow chain mode against vLLM serving the same exported head (DFlash method) on this machine.

    make vllm-venv     # once: vLLM in its own venv (.venv-vllm), it pins an older transformers
    python benchmarks/bench_vllm.py --drafter DIR --limit 10 --max-tokens 128 --out docs/results/vllm.json

Steps: export DIR with `jetflow export-vllm`; chat-template the first --limit GSM8K test questions
with the target's tokenizer (both engines get the same token ids); decode them greedily with
JetFlow (autoregressive, chain of block_size-1 drafts, chain of 1 draft) and, in the vLLM venv, with
vLLM (no speculation, dflash with block_size-1 and with 1 speculative token). Checks:

* vLLM with the head gives the same tokens as vLLM without it (lossless inside vLLM);
* vLLM's mean acceptance length is > 1 and close to JetFlow's chain tau;
* with one speculative token, vLLM accepts the first draft token exactly as often as JetFlow does --
  equal counts mean both engines draft the same first token on the same contexts (catches layer-offset,
  RoPE and mask-token mistakes).
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jetflow
from jetflow.decoding.prompt import encode_prompt
from jetflow.eval.datasets import load_eval_set
from jetflow.eval.machine import machine
from jetflow.export.vllm import export_vllm
from jetflow.models.draft_head import DraftHead
from jetflow.models.resolve import resolve_model
from jetflow.models.target import TargetModel

ROOT = Path(__file__).resolve().parents[1]


def jetflow_side(target, head, prompts, max_tokens) -> dict:
    jf = jetflow.JetFlow(target, head.to(dtype=target.dtype), lookup=False)  # the head alone, as vLLM runs it
    b = head.config.block_size
    out = {}
    for name, kw in (("ar", None), (f"chain_{b - 1}", dict(budget=b - 1, width=1)), ("chain_1", dict(budget=1, width=1))):
        runs = [jetflow.generate(target, p, max_new_tokens=max_tokens) if kw is None else
                jf.generate(p, max_new_tokens=max_tokens, **kw) for p in prompts]
        row = {"outputs": [r.token_ids for r in runs], "tokens": sum(r.new_tokens for r in runs),
               "seconds": sum(r.seconds for r in runs)}
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        if kw is not None:
            lengths = [a for r in runs for a in r.stats["accept_lengths"]]
            row.update(rounds=len(lengths), tau=sum(lengths) / len(lengths), accepted=sum(a - 1 for a in lengths))
        out[name] = row
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", required=True, help="a DFlash-compatible JetFlow block head")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    target = TargetModel.load(args.target)
    head = DraftHead.from_pretrained(args.drafter, target=target)
    b = head.config.block_size
    prompts = [encode_prompt(target.tokenizer, p.request([])) for p in load_eval_set("gsm8k", args.limit)]
    with tempfile.TemporaryDirectory() as tmp:
        export = export_vllm(args.drafter, Path(tmp) / "export")
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        cmd = [args.vllm_python, str(ROOT / "benchmarks" / "vllm_check.py"), "--target",
               str(resolve_model(args.target).path), "--drafter", str(export), "--prompts", str(Path(tmp) / "prompts.json"),
               "--max-tokens", str(args.max_tokens), "--spec-tokens", str(b - 1), "1", "--out", str(Path(tmp) / "v.json")]
        subprocess.run(cmd, check=True, env=env)
        vllm = json.loads((Path(tmp) / "v.json").read_text())
    ours = jetflow_side(target, head, prompts, args.max_tokens)
    chain, spec = ours[f"chain_{b - 1}"], vllm[f"dflash_{b - 1}"]
    v_tau = spec["acceptance"].get("mean_acceptance_length")
    one_ours, one_vllm = ours["chain_1"]["accepted"], vllm["dflash_1"]["acceptance"].get("accepted_tokens")
    checks = {
        "vllm_spec_equals_plain": spec["outputs"] == vllm["plain"]["outputs"],
        "vllm_tau_above_1": bool(v_tau and v_tau > 1),
        "tau_close": bool(v_tau and abs(v_tau - chain["tau"]) <= 0.1 * chain["tau"]),
        "first_draft_token_agrees": one_vllm is not None and abs(one_vllm - one_ours) <= max(1, 0.02 * one_ours),
    }
    report = {
        "machine": machine(), "vllm_version": vllm.get("vllm_version"), "drafter": args.drafter,
        "prompts": len(prompts), "max_tokens": args.max_tokens, "checks": checks,
        "jetflow": {k: {kk: v for kk, v in r.items() if kk != "outputs"} for k, r in ours.items()},
        "vllm": {k: {kk: v for kk, v in r.items() if kk != "outputs"} for k, r in vllm.items() if isinstance(r, dict)},
        "same_outputs_vllm_plain_vs_jetflow_ar": sum(a == c for a, c in zip(vllm["plain"]["outputs"], ours["ar"]["outputs"])),
    }
    print(json.dumps({"checks": checks, "jetflow_chain_tau": chain["tau"], "vllm_tau": v_tau,
                      "first_token_accepted": [one_ours, one_vllm],
                      "vllm_tok_s": {"plain": vllm["plain"]["tokens_per_s"], "dflash": spec["tokens_per_s"]}}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
