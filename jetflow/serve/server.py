"""``jetflow serve``: a loaded JetFlow behind the OpenAI-compatible app, until SIGTERM/SIGINT."""

from __future__ import annotations

import sys

import uvicorn

from jetflow.pipeline import JetFlow
from jetflow.serve.app import CleanExitServer, create_app
from jetflow.serve.engine import Engine
from jetflow.serve.metrics import Metrics


def serve(jf: JetFlow, *, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 16, api_key: str | None = None,
          model_name: str | None = None, max_body_bytes: int = 1 << 20, shutdown_timeout: float = 30.0,
          log_level: str = "warning", max_batch: int = 32, max_prefill_tokens: int = 256) -> None:
    """Serve ``jf`` on http://host:port/v1. One-time costs (the cost curve of an adaptive budget,
    first-call allocations) are paid before the first client, not by it."""
    if jf.budget == "auto" and jf.drafter is not None:
        print("measuring this machine's cost curve for --budget auto (cached after the first time) ...",
              file=sys.stderr)
        jf.adaptive_budget()
    jf.generate("warm-up", max_new_tokens=4)
    metrics = Metrics()
    engine = Engine(jf, max_queue=max_queue, metrics=metrics, max_batch=max_batch,
                    max_prefill_tokens=max_prefill_tokens)
    name = model_name or jf.target.name
    app = create_app(engine, name, aliases=(jf.target.name,), api_key=api_key, max_body_bytes=max_body_bytes,
                     metrics=metrics)
    print(f"jetflow: serving {name!r} (drafter: {jf.drafter_path or 'none'}, budget: {jf.budget}, "
          f"batch: up to {engine.max_batch}) on "
          f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout)
    CleanExitServer(config).run()  # SIGTERM/SIGINT: stop accepting, drain, then the app's shutdown
