"""Load test for `jetflow serve`: N concurrent streaming clients for a bounded time.

    jetflow serve --max-queue 64 &            # in another shell
    python benchmarks/load_server.py --url http://127.0.0.1:8000 --clients 1,8,32 --seconds 120 --out result.json

With several client counts (comma list) the windows run one after another against the same server.
Each client loops: send a streaming chat request (a GSM8K test question, greedy, --max-tokens), read
the stream to [DONE], repeat, until the time is up (requests in flight then finish). Prints requests/s,
tokens/s, latency and time-to-first-token percentiles, and counts of every non-200 status and
transport error; 429s (queue full) are counted apart from errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter

import httpx

from jetflow.eval.datasets import load_eval_set


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def client(i: int, args, questions: list[str], deadline: float, results: list, statuses: Counter):
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(600.0), headers=headers) as http:
        k = i
        while time.perf_counter() < deadline:
            body = {"model": args.model, "messages": [{"role": "user", "content": questions[k % len(questions)]}],
                    "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            k += args.clients
            t0 = time.perf_counter()
            first, tokens, tau = None, 0, None
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        statuses[r.status_code] += 1
                        await r.aread()
                        await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            statuses["stream-error"] += 1
                            break
                        if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            first = time.perf_counter() - t0
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        if chunk["choices"] and chunk.get("jetflow"):
                            tau = chunk["jetflow"]["tau"]
                statuses[200] += 1
                results.append({"latency": time.perf_counter() - t0, "ttft": first, "tokens": tokens, "tau": tau,
                                "end": time.perf_counter()})
            except httpx.HTTPError as e:
                statuses[f"transport:{type(e).__name__}"] += 1


async def main_async(args):
    questions = [p.turns[0] for p in load_eval_set("gsm8k", 200)]
    results, statuses = [], Counter()
    start = time.perf_counter()
    deadline = start + args.seconds
    await asyncio.gather(*[client(i, args, questions, deadline, results, statuses) for i in range(args.clients)])
    batch_before = args.batch_counts
    wall = time.perf_counter() - start
    async with httpx.AsyncClient(base_url=args.url) as http:
        metrics = (await http.get("/metrics")).text
    args.batch_counts = histogram_sums(metrics, ("jetflow_batch_size", "jetflow_tokens_per_forward"))
    steps = {k: args.batch_counts[k] - batch_before.get(k, 0.0) for k in args.batch_counts}
    lat = [r["latency"] for r in results]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    taus = [r["tau"] for r in results if r["tau"] is not None]
    server_errors = sum(n for s, n in statuses.items() if isinstance(s, int) and s >= 500)
    return {
        "clients": args.clients, "seconds": wall, "max_tokens": args.max_tokens, "completed": len(results),
        "requests_per_s": len(results) / wall, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "latency_s": {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "mean": statistics.mean(lat) if lat else None},
        "ttft_s": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99)},
        "mean_tau": statistics.mean(taus) if taus else None,
        # the server's batched steps in this window (absent when it serves one request at a time)
        "mean_batch_size": (steps["jetflow_batch_size_sum"] / steps["jetflow_batch_size_count"]
                            if steps.get("jetflow_batch_size_count") else None),
        "mean_tokens_per_forward": (steps["jetflow_tokens_per_forward_sum"] / steps["jetflow_tokens_per_forward_count"]
                                    if steps.get("jetflow_tokens_per_forward_count") else None),
        "statuses": {str(k): v for k, v in statuses.items()}, "server_errors_5xx": server_errors,
        "server_metrics_tail": [line for line in metrics.splitlines() if line.startswith("jetflow_requests_total")],
    }


def histogram_sums(metrics: str, names: tuple[str, ...]) -> dict[str, float]:
    """The _sum and _count lines of the named histograms in a /metrics page."""
    out = {}
    for line in metrics.splitlines():
        key, _, value = line.partition(" ")
        if any(key in (f"{n}_sum", f"{n}_count") for n in names):
            out[key] = float(value)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", default="32", help="client count, or a comma list run one window after another")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    args.batch_counts = {}
    windows = []
    for n in counts:
        args.clients = n
        windows.append(asyncio.run(main_async(args)))
        print(json.dumps({k: windows[-1][k] for k in ("clients", "tokens_per_s", "latency_s", "ttft_s", "mean_batch_size",
                                                      "server_errors_5xx")}), flush=True)
    result = windows[0] if len(windows) == 1 else {"windows": windows}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
