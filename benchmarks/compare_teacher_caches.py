"""How far a teacher cache computed in one precision is from one computed in another, over the same
sequences (e.g. `jetflow cache-teacher --dtype bfloat16` against the fp32 default):

    python benchmarks/compare_teacher_caches.py runs/tc-f32 runs/tc-bf16 --out result.json

Prints the per-token relative L2 error of the tapped features (per tapped layer and overall), how
often the teacher's top-1 token is the same, and the mean absolute difference of its top-1 probability.
"""
import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

ap = argparse.ArgumentParser()
ap.add_argument("reference")
ap.add_argument("other")
ap.add_argument("--out", default=None)
args = ap.parse_args()

ref_m, oth_m = (json.loads((Path(d) / "manifest.json").read_text()) for d in (args.reference, args.other))
if [p["digest"] for p in ref_m["parts"].values()] != [p["digest"] for p in oth_m["parts"].values()]:
    raise SystemExit("the two caches were built from different sequences")
taps = ref_m["tapped_layers"]
rel, rel_tap, same_top1, dp = [], [[] for _ in taps], [], []
for name in sorted(ref_m["parts"]):
    a, b = load_file(Path(args.reference) / name), load_file(Path(args.other) / name)
    fa, fb = a["features"].float(), b["features"].float()
    rel.append((fa - fb).norm(dim=-1) / fa.norm(dim=-1))
    for i, chunk in enumerate(zip(fa.chunk(len(taps), -1), fb.chunk(len(taps), -1))):
        rel_tap[i].append((chunk[0] - chunk[1]).norm(dim=-1) / chunk[0].norm(dim=-1))
    same_top1.append(a["topk_ids"][:, 0] == b["topk_ids"][:, 0])
    dp.append((a["topk_logprobs"][:, 0].float().exp() - b["topk_logprobs"][:, 0].float().exp()).abs())
rel, same_top1, dp = torch.cat(rel), torch.cat(same_top1), torch.cat(dp)
report = {
    "reference": args.reference, "other": args.other,
    "sequences": sum(p["sequences"] for p in ref_m["parts"].values()), "tokens": rel.numel(),
    "teacher_rows": same_top1.numel(),
    "seconds": {"reference": round(ref_m["wall_seconds"], 1), "other": round(oth_m["wall_seconds"], 1)},
    "feature_relative_error": {"median": round(rel.median().item(), 5), "p90": round(rel.quantile(0.9).item(), 5)},
    "feature_relative_error_median_per_layer": {
        str(layer): round(torch.cat(r).median().item(), 5) for layer, r in zip(taps, rel_tap)},
    "top1_agreement": round(same_top1.float().mean().item(), 5),
    "top1_probability_abs_diff_mean": round(dp.mean().item(), 5),
}
print(json.dumps(report, indent=1))
if args.out:
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
