"""One request per process, as a user of `jetflow generate` runs it: plain decoding against the
default decoder (`--budget auto`) starting from nothing in every process, and keeping what it learned
from one process to the next (`--auto-state DIR`).

For each prompt (first turns) every variant runs in its own fresh `jetflow generate --json` process,
in rotating order, and its generation speed is read from the JSON (`tokens_per_s`: the request
alone, model loading excluded); every output must equal the plain one. The kept state starts empty
in a temporary directory, so the first prompt of that variant starts from nothing too.

    python benchmarks/cli_processes.py --backend llamacpp --datasets gsm8k --limit 20 \
        --out docs/results/cli_processes/llamacpp_gsm8k.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from jetflow.eval.bootstrap import speedup_interval
from jetflow.eval.datasets import load_eval_set
from jetflow.eval.machine import machine
from jetflow.utils.fs import write_json_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="llamacpp")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--datasets", default="gsm8k")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    state_dir = tempfile.mkdtemp(prefix="jetflow-auto-state-")
    variants = {"plain": ["--drafter", "none"],
                "auto, fresh": ["--budget", "auto", "--auto-state", "none"],
                "auto, kept": ["--budget", "auto", "--auto-state", state_dir]}
    names = list(variants)
    report = {"machine": machine(), "settings": vars(args), "datasets": {}}
    for dataset in args.datasets.split(","):
        rows = {name: [] for name in names}
        mismatches = []
        for i, prompt in enumerate(load_eval_set(dataset, args.limit)):
            texts = {}
            for name in names[i % len(names):] + names[:i % len(names)]:
                cmd = [sys.executable, "-m", "jetflow.cli", "generate", prompt.turns[0], "--json",
                       "--backend", args.backend, "--threads", str(args.threads),
                       "--max-new-tokens", str(args.max_new_tokens), *variants[name]]
                if not prompt.chat:
                    cmd.append("--no-chat")
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                out = json.loads(done.stdout)
                texts[name] = out["token_ids"]
                rows[name].append({"id": prompt.id, "turn": 0, "new_tokens": out["new_tokens"],
                                   "seconds": out["seconds"], "tokens_per_s": out["tokens_per_s"], "tau": out.get("tau")})
            mismatches += [f"{prompt.id}:{n}" for n in names[1:] if texts[n] != texts["plain"]]
            print(f"{dataset} {prompt.id}: " + "  ".join(f"{n} {rows[n][-1]['tokens_per_s']:.1f}" for n in names),
                  flush=True)
        summary = {}
        for name in names:
            tokens, seconds = (sum(r[k] for r in rows[name]) for k in ("new_tokens", "seconds"))
            summary[name] = {"tokens_per_s": tokens / seconds}
            line = f"{dataset:8s} {name:12s} {tokens / seconds:6.1f} tok/s"
            if name != "plain":
                ratio = summary[name]["speedup"] = summary[name]["tokens_per_s"] / summary["plain"]["tokens_per_s"]
                ci = summary[name]["ci95"] = speedup_interval(rows[name], rows["plain"])
                line += f"  {ratio:.3f}x of plain" + (f" [{ci[0]:.3f}-{ci[1]:.3f}]" if ci else "")
            print(line, flush=True)
        report["datasets"][dataset] = {"summary": summary, "mismatches": mismatches, "requests": rows}
        print(f"{dataset}: outputs differing from plain: {len(mismatches)}", flush=True)
        write_json_atomic(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
