"""Draft cost of a JetFlow head run inside llama.cpp (its DFlash graph) next to the llama.cpp target.

    python benchmarks/bench_native_draft.py [--drafter jetflow/drafters/smollm2-135m-instruct-dflash]

Exports the head with `jetflow export-gguf` (float16 and float32), injects 300 random context
features, then times one block decode of n slots (median of 30) and the injection of 3 committed
tokens' features.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from jetflow.decoding.costs import median_ms
from jetflow.export.gguf import export_gguf
from jetflow.models.llamacpp_draft import LlamaCppDFlashDraft
from jetflow.models.loading import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="jetflow/drafters/smollm2-135m-instruct-dflash")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    target = load_target("smollm2-135m-instruct", backend="llamacpp", n_threads=args.threads)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float16", "float32"):
            gguf = export_gguf(args.drafter, Path(tmp) / f"{dtype}.gguf", target.gguf, dtype=dtype, target=target)
            draft = LlamaCppDFlashDraft(gguf, target)
            features = torch.randn(300, 5 * target.hidden_size)
            draft.inject(features, 0)
            row = {f"block_{n}_ms": median_ms(lambda n=n: draft.block_logits(5, 300, 0, n), 30) for n in (4, 8, 16)}

            def inject3():
                draft.inject(features[:3], 300)
                draft.truncate(300)

            row["inject_3_ms"] = median_ms(inject3, 30)
            out[dtype] = row
            draft.close()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
