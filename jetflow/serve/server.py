"""``jetflow serve``: a loaded JetFlow behind the OpenAI-compatible app, until SIGTERM/SIGINT.

The HTTP side (uvicorn) runs in the main thread; everything that runs the model (loading it,
measuring the cost curve, the warm-up, every forward) runs in ONE other thread, the engine's. Why
one: torch's CPU kernels run on OpenMP, which keeps a team of worker threads for every thread that
has run a parallel op. Once two threads have teams, there are more OpenMP threads than cores and
libgomp cuts its spin-waiting, so every small op waits for sleeping workers: 1.6x slower on 2 cores
(benchmarks/bench_second_thread.py), and 135.9 instead of 200.7 tok/s at 32 clients
(benchmarks/serve_matrix.py; docs/results.md, "One compute thread").
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
from collections.abc import Callable

import uvicorn

from jetflow.errors import JetFlowError
from jetflow.pipeline import JetFlow
from jetflow.serve.app import CleanExitServer, create_app
from jetflow.serve.engine import Engine
from jetflow.serve.metrics import Metrics


def _prepare(jf: JetFlow) -> None:
    """One-time costs (the cost curve of an adaptive budget, first-call allocations), paid before
    the first client instead of by it."""
    if jf.budget == "auto" and jf.drafter is not None:
        print("measuring this machine's cost curve for --budget auto (cached after the first time) ...",
              file=sys.stderr)
        jf.adaptive_budget()
    jf.generate("warm-up", max_new_tokens=4)
    jf.target.reset()  # the first client's prompt takes nothing from the warm-up's cache


def start_engine(load: Callable[[], JetFlow], **engine_kw) -> tuple[JetFlow, Engine]:
    """Load, prepare and run the engine in a thread of its own; returns once it is ready to serve
    (or re-raises what went wrong while loading)."""
    ready: queue.Queue = queue.Queue(maxsize=1)

    def compute() -> None:
        try:
            jf = load()
            _prepare(jf)
            engine = Engine(jf, start=False, **engine_kw)
        except BaseException as e:  # handed to the main thread, which reports it
            ready.put(e)
            return
        ready.put((jf, engine))
        engine.run()

    threading.Thread(target=compute, name="jetflow-engine", daemon=True).start()
    got = ready.get()
    if isinstance(got, BaseException):
        raise got
    return got


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use or out of range fails in a
    second with a clear error, not after the load, and no client can take it in between."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, OverflowError) as e:
        raise JetFlowError(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise JetFlowError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(jf: JetFlow | Callable[[], JetFlow], *, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 16,
          api_key: str | None = None, model_name: str | None = None, max_body_bytes: int = 1 << 20,
          shutdown_timeout: float = 30.0, log_level: str = "warning", max_batch: int = 32,
          max_prefill_tokens: int = 256, prefix_slots: int | None = None) -> None:
    """Serve on http://host:port/v1. ``jf``: a JetFlow, or (better) a function that loads one, so
    that the loading happens in the engine's thread too."""
    sock = listening_socket(host, port)
    port = sock.getsockname()[1]  # the port the OS gave for --port 0
    metrics = Metrics()
    jf, engine = start_engine(jf if callable(jf) else (lambda: jf), max_queue=max_queue, metrics=metrics,
                              max_batch=max_batch, max_prefill_tokens=max_prefill_tokens, prefix_slots=prefix_slots)
    name = model_name or jf.target.name
    app = create_app(engine, name, aliases=(jf.target.name,), api_key=api_key, max_body_bytes=max_body_bytes,
                     metrics=metrics)
    print(f"jetflow: serving {name!r} (drafter: {jf.drafter_path or 'none'}, budget: {jf.budget}, "
          f"batch: up to {engine.max_batch}) on "
          f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout)
    CleanExitServer(config, before_deadline=lambda: engine.shutdown(True, 5.0)).run(sockets=[sock])  # SIGTERM/SIGINT: stop accepting, drain, then the app's shutdown
