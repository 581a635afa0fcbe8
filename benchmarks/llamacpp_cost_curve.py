"""llama.cpp's verify cost curve c(n)/c(1) for the target's GGUF as shipped and, for comparison,
requantized copies (llama.cpp's own quantizer; written to the JetFlow cache, never into the repo).

    python benchmarks/llamacpp_cost_curve.py --threads 2 --requantize Q4_0,Q8_0 \
        --out docs/results/llamacpp/cost_curve.json

c(n) is one llama_decode of n chained tokens after ``--context`` tokens (median of ``--reps``),
the drafted tokens then dropped again: exactly what a verify of n - 1 draft nodes costs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 64)


def requantized(gguf: Path, ftype: str) -> Path:
    from llama_cpp import llama_cpp as lib

    from jetflow.utils.fs import cache_root

    out = cache_root() / "gguf-requantized" / f"{gguf.stem}.{ftype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    tmp = out.with_suffix(".tmp")
    if lib.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not requantize {gguf} to {ftype}")
    tmp.rename(out)
    return out


def curve(gguf: Path, tokenizer, threads: int, context: int, reps: int, sizes=SIZES) -> dict:
    import torch

    from jetflow.decoding.costs import median_ms
    from jetflow.models.llamacpp_target import LlamaCppTarget

    target = LlamaCppTarget(gguf, tokenizer, n_threads=threads)
    g = torch.Generator().manual_seed(0)
    target.prefill(torch.randint(100, target.vocab_size, (context,), generator=g).tolist(), return_hidden=False)
    ms = {}
    for n in sizes:
        tokens = torch.randint(100, target.vocab_size, (n,), generator=g).tolist()
        ms[n] = median_ms(lambda: (target.verify(tokens, list(range(-1, n - 1)), return_hidden=False),
                                   target.commit([])), reps)
    target.close()
    out = {"c_ms": ms, "ratio": {n: v / ms[1] for n, v in ms.items()}}
    if 8 in ms and 16 in ms:
        out["marginal_ms_per_token_8_to_16"] = (ms[16] - ms[8]) / 8
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--requantize", default="", help="comma list of llama.cpp file types, e.g. Q4_0,Q8_0")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from jetflow.models.gguf_meta import gguf_file_type, gguf_tokenizer
    from jetflow.models.resolve import locate_gguf

    gguf, _ = locate_gguf(args.target)
    tokenizer = gguf_tokenizer(gguf)
    files = {f"{gguf_file_type(gguf)} (as shipped)": gguf}
    for ftype in filter(None, args.requantize.split(",")):
        files[f"{ftype} (requantized)"] = requantized(gguf, ftype.strip())
    report = {"threads": args.threads, "context": args.context, "curves": {}}
    for name, path in files.items():
        report["curves"][name] = c = curve(path, tokenizer, args.threads, args.context, args.reps)
        print(f"{name:22s} c(1) = {c['c_ms'][1]:5.1f} ms  c(n)/c(1): "
              + "  ".join(f"{n}:{r:.2f}" for n, r in c["ratio"].items()), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
