"""The generation worker: one thread owns the model and runs queued jobs one at a time, so the event
loop never blocks on a forward pass and memory stays bounded by the queue length.

A job's events (text deltas, then the result or an error) are handed to the event loop with
``call_soon_threadsafe``. Cancelling a job (client gone, shutdown) stops it between two decoding
rounds.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

from jetflow.decoding.result import GenerationResult
from jetflow.pipeline import JetFlow


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    pass


@dataclass
class Job:
    prompt_ids: list[int]
    request: dict  # keyword arguments of JetFlow.stream: max_new_tokens, temperature, top_p, seed, stop
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: int = 0

    def cancel(self) -> None:
        self.cancelled.set()

    def _emit(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class Engine:
    def __init__(self, jetflow: JetFlow, max_queue: int = 16, metrics=None):
        self.jetflow = jetflow
        self.metrics = metrics
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._ids = itertools.count(1)
        self._accepting = True
        self._current: Job | None = None
        self.job_seconds = 1.0  # running mean of a job's duration (for Retry-After)
        self._thread = threading.Thread(target=self._work, name="jetflow-engine", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def submit(self, prompt_ids: list[int], request: dict) -> Job:
        if not self._accepting:
            raise EngineStopped("the server is shutting down")
        job = Job(prompt_ids, request, asyncio.get_running_loop(), id=next(self._ids))
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None
        return job

    def retry_after(self) -> int:
        return max(1, min(60, round(self.job_seconds * (self.queue_depth + 1))))

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                job._emit("error", EngineStopped("cancelled before it started"))
                continue
            self._current = job
            t0 = time.perf_counter()
            try:
                events = self.jetflow.stream(job.prompt_ids, **job.request)
                for event in events:
                    if job.cancelled.is_set():
                        events.close()
                        job._emit("cancelled", None)
                        break
                    if isinstance(event, GenerationResult):
                        job._emit("done", event)
                    else:
                        job._emit("delta", event)
            except Exception as e:  # reported to the client as a 500; the worker keeps serving
                job._emit("error", e)
            finally:
                self._current = None
                self.job_seconds += (time.perf_counter() - t0 - self.job_seconds) * 0.2

    def shutdown(self, cancel_running: bool = False, timeout: float | None = None) -> None:
        """Stop accepting; cancel queued jobs; finish (or cancel) the running one; stop the thread."""
        self._accepting = False
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job._emit("error", EngineStopped("the server is shutting down"))
        if cancel_running and (job := self._current) is not None:
            job.cancel()
        self._queue.put(None)
        self._thread.join(timeout)
