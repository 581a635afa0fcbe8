"""One llama.cpp verify shape decoded over and over, for a profiler to attach to: where a verify's time
goes, by kernel.

    python benchmarks/llamacpp_verify_loop.py --tokens 8 --seconds 14 &
    # once it prints "ready": perf record -F 4000 -p <its pid> -o verify8.data -- sleep 6
    perf report -i verify8.data --no-children --sort dso,symbol

Each iteration is what a verify of ``--tokens`` - 1 chained draft nodes costs: one decode of that
many tokens after ``--context`` random tokens, the drafted tokens then dropped again (as
benchmarks/llamacpp_cost_curve.py times it). Prints the mean milliseconds per iteration at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=8, help="tokens per decode (a verify of tokens - 1 nodes)")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    if args.tokens < 1 or args.context < 1 or args.seconds <= 0:
        ap.error("--tokens and --context must be >= 1 and --seconds > 0")

    import torch

    from jetflow.models.gguf_meta import gguf_tokenizer
    from jetflow.models.llamacpp_target import LlamaCppTarget
    from jetflow.models.resolve import locate_gguf

    gguf, _ = locate_gguf(args.target)
    target = LlamaCppTarget(gguf, gguf_tokenizer(gguf), n_threads=args.threads)
    g = torch.Generator().manual_seed(0)
    target.prefill(torch.randint(100, target.vocab_size, (args.context,), generator=g).tolist(), return_hidden=False)
    tokens = torch.randint(100, target.vocab_size, (args.tokens,), generator=g).tolist()
    parents = list(range(-1, args.tokens - 1))
    print("ready", flush=True)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds:
        target.verify(tokens, parents, return_hidden=False)
        target.commit([])
        n += 1
    print(f"{args.tokens} tokens after {args.context}: {(time.perf_counter() - t0) / n * 1e3:.2f} ms per decode "
          f"({n} decodes)", flush=True)
    target.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
