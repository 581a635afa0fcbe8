"""Server metrics in the Prometheus text exposition format (no client library needed)."""

from __future__ import annotations

import threading
from collections import defaultdict

TAU_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
NODES_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
SECONDS_PER_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum}", f"{name}_count {self.total}"]


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = defaultdict(int)  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0
        self.completion_tokens = 0
        self.cancelled = 0
        self.tau = Histogram(TAU_BUCKETS)
        self.seconds_per_token = Histogram(SECONDS_PER_TOKEN_BUCKETS)
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.tokens_per_forward = Histogram(TOKENS_BUCKETS)
        self.nodes_per_request = Histogram(NODES_BUCKETS)

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def generation(self, prompt_tokens: int, completion_tokens: int, seconds: float, tau: float | None) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            if completion_tokens:
                self.seconds_per_token.observe(seconds / completion_tokens)
            if tau is not None:
                self.tau.observe(tau)

    def step(self, batch: int, tokens: int, nodes: int) -> None:
        """One batched decoding step: requests in it, tokens its forward verified, draft nodes."""
        with self._lock:
            self.batch_size.observe(batch)
            self.tokens_per_forward.observe(tokens)
            self.nodes_per_request.observe(nodes / max(1, batch))

    def cached_prompt(self, tokens: int) -> None:
        """Prompt tokens taken from the prompt prefix cache instead of being prefilled."""
        with self._lock:
            self.prompt_tokens_cached += tokens

    def cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def render(self, queue_depth: int, in_flight: int) -> str:
        with self._lock:
            lines = ["# HELP jetflow_requests_total Requests by endpoint and HTTP status.",
                     "# TYPE jetflow_requests_total counter"]
            lines += [f'jetflow_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            lines += ["# HELP jetflow_prompt_tokens_total Prompt tokens processed.",
                      "# TYPE jetflow_prompt_tokens_total counter", f"jetflow_prompt_tokens_total {self.prompt_tokens}",
                      "# HELP jetflow_prompt_tokens_cached_total Prompt tokens copied from the prompt prefix cache.",
                      "# TYPE jetflow_prompt_tokens_cached_total counter",
                      f"jetflow_prompt_tokens_cached_total {self.prompt_tokens_cached}",
                      "# HELP jetflow_generated_tokens_total Tokens generated.",
                      "# TYPE jetflow_generated_tokens_total counter",
                      f"jetflow_generated_tokens_total {self.completion_tokens}",
                      "# HELP jetflow_cancelled_total Generations cancelled because their client went away (HTTP 499).",
                      "# TYPE jetflow_cancelled_total counter", f"jetflow_cancelled_total {self.cancelled}",
                      "# HELP jetflow_queue_depth Requests waiting for the generation worker.",
                      "# TYPE jetflow_queue_depth gauge", f"jetflow_queue_depth {queue_depth}",
                      "# HELP jetflow_requests_in_flight Requests being served.",
                      "# TYPE jetflow_requests_in_flight gauge", f"jetflow_requests_in_flight {in_flight}",
                      "# HELP jetflow_tau Accepted tokens per decoding round, per request (bonus token included).",
                      "# TYPE jetflow_tau histogram", *self.tau.lines("jetflow_tau"),
                      "# HELP jetflow_seconds_per_token Generation time per generated token, per request.",
                      "# TYPE jetflow_seconds_per_token histogram",
                      *self.seconds_per_token.lines("jetflow_seconds_per_token"),
                      "# HELP jetflow_batch_size Requests per batched decoding step.",
                      "# TYPE jetflow_batch_size histogram", *self.batch_size.lines("jetflow_batch_size"),
                      "# HELP jetflow_tokens_per_forward Tokens one batched verify forward processed (padding included).",
                      "# TYPE jetflow_tokens_per_forward histogram",
                      *self.tokens_per_forward.lines("jetflow_tokens_per_forward"),
                      "# HELP jetflow_nodes_per_request Draft nodes verified per request per step (mean over the batch).",
                      "# TYPE jetflow_nodes_per_request histogram",
                      *self.nodes_per_request.lines("jetflow_nodes_per_request")]
        return "\n".join(lines) + "\n"
