"""The generation worker: one thread owns the model, so the event loop never blocks on a forward pass
and memory stays bounded by the queue length. With ``max_batch`` > 1 it runs up to that many jobs
together, continuously batched (jetflow/decoding/batch.py): jobs join and leave between two decoding
steps, and each step verifies every job's draft in one forward. Between two steps at most
``max_prefill_tokens`` prompt tokens are prefilled (always at least one job): a crowd of jobs
arriving together is admitted over several steps, so the first of them stream their first tokens
while the rest wait, running jobs keep decoding, and jobs finish (and closed-loop clients come back)
spread out instead of in waves. With ``max_batch`` = 1 it runs one job at a time.

A job's events (text deltas, then the result or an error) are handed to the event loop with
``call_soon_threadsafe``. Cancelling a job (client gone, shutdown) stops it between two decoding
rounds.

The worker normally gets a thread of its own. ``start=False`` leaves it to the caller to :meth:`run`
it in a thread of its choosing: ``jetflow serve`` runs the model's loading, warm-up and every forward
in one thread (jetflow/serve/server.py says why).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from jetflow.decoding.result import GenerationResult
from jetflow.pipeline import JetFlow


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    pass


class StepFailed(Exception):
    """A decoding step of the whole batch failed: every job in it gets this (a server error, not the
    fault of any one request)."""


@dataclass(eq=False)  # hashed and compared by identity
class Job:
    prompt_ids: list[int]
    request: dict  # keyword arguments of JetFlow.stream: max_new_tokens, temperature, top_p, seed, stop
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: int = 0
    reason: str = "generation cancelled"  # what the client is told (the first cancel's reason)

    def cancel(self, reason: str | None = None) -> None:
        if reason is not None and not self.cancelled.is_set():
            self.reason = reason
        self.cancelled.set()

    def _emit(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class Engine:
    def __init__(self, jetflow: JetFlow, max_queue: int = 16, metrics=None, max_batch: int = 1,
                 max_prefill_tokens: int = 256, prefix_slots: int | None = None, start: bool = True):
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.jetflow = jetflow
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_slots = prefix_slots  # the batch's prefix cache entries (None: the default)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._ids = itertools.count(1)
        self._accepting = True
        self._cancelling = False  # shutdown(cancel_running=True): jobs the worker takes now are cancelled too
        # submit's check-and-put and shutdown's close-and-drain, one at a time: a job put after the
        # worker's stop sentinel would never be answered
        self._admission = threading.Lock()
        self._running: set[Job] = set()  # jobs taken from the queue and not yet answered
        self.failure: str | None = None  # why the worker stopped, if it died (the server then answers 503)
        self.job_seconds = 1.0  # running mean of a job's duration (for Retry-After)
        self._load_budget = None  # the batch's budget under load: one for the server's lifetime, so what it learned stays
        if self.max_batch > 1:
            if jetflow.budget == "auto" and jetflow.drafter is not None:
                from jetflow.decoding.load_budget import LoadBudget

                self._load_budget = LoadBudget(jetflow.adaptive_budget().costs)  # the batch's context and drafter are made and warmed before the first client
            self._decoder = self._new_decoder()
            self._warm_up(self._decoder)
        self._stopped = threading.Event()  # set when the worker has returned
        if start:
            threading.Thread(target=self.run, name="jetflow-engine", daemon=True).start()

    def run(self) -> None:
        """The worker loop, in the calling thread, until :meth:`shutdown` (``start=False`` engines)."""
        try:
            (self._work_batched if self.max_batch > 1 else self._work)()
        except BaseException as e:  # the worker died: nobody would answer what is queued or comes next
            self.failure = f"the generation worker stopped: {type(e).__name__}: {e}"
            self._accepting = False
            self._fail_all(EngineStopped(self.failure))
            raise
        finally:
            self._stopped.set()

    def _fail_all(self, error: Exception) -> None:
        """Answer every job taken from the queue and every queued one with ``error``."""
        for job in list(self._running):
            job._emit("error", error)
        self._running.clear()
        self._answer_queued(error)

    def _answer_queued(self, error: Exception) -> None:
        """Take every queued job out of the queue, cancelled, and answer it with ``error``."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.cancel()
                job._emit("error", error)

    @property
    def queue_depth(self) -> int:
        """Queued jobs whose clients still wait."""
        with self._queue.mutex:
            return sum(1 for job in self._queue.queue if job is not None and not job.cancelled.is_set())

    def _drop_cancelled(self) -> int:
        """Take queued jobs whose clients left out of the queue (answered as cancelled): else they
        hold its places until the worker reaches them, and live clients get 429 meanwhile."""
        with self._queue.mutex:
            gone = [job for job in self._queue.queue if job is not None and job.cancelled.is_set()]
            for job in gone:
                self._queue.queue.remove(job)
            if gone:
                self._queue.not_full.notify(len(gone))
        for job in gone:
            job._emit("error", EngineStopped("cancelled before it started"))
        return len(gone)

    def submit(self, prompt_ids: list[int], request: dict) -> Job:
        job = Job(prompt_ids, request, asyncio.get_running_loop(), id=next(self._ids))
        with self._admission:
            if not self._accepting:
                raise EngineStopped(self.failure or "the server is shutting down")
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                if not self._drop_cancelled():
                    raise QueueFull from None
                self._queue.put_nowait(job)  # (nobody else puts while the lock is held)
        return job

    def _take(self, job: Job) -> None:
        """The worker holds ``job`` now (answered by it from here on)."""
        self._running.add(job)
        if self._cancelling:  # taken while shutdown cancelled the running ones
            job.cancel("the server is shutting down")

    @property
    def running(self) -> int:
        return len(self._running)

    def retry_after(self) -> int:
        waves = (self.queue_depth + self.max_batch) // self.max_batch  # batches of jobs ahead of a new one
        return max(1, min(60, round(self.job_seconds * waves)))

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                job._emit("error", EngineStopped("cancelled before it started"))
                continue
            self._take(job)
            t0 = time.perf_counter()
            try:
                # An event every round, text or not: a cancelled job stops between two rounds, as in
                # a batch, also while its text is held back (a stop string's prefix, a partial character).
                events = self.jetflow.stream(job.prompt_ids, every_round=True, **job.request)
                for event in events:
                    if job.cancelled.is_set():
                        events.close()
                        job._emit("cancelled", job.reason)
                        break
                    if isinstance(event, GenerationResult):
                        job._emit("done", event)
                    elif event:
                        job._emit("delta", event)
            except Exception as e:  # reported to the client as a 500; the worker keeps serving
                job._emit("error", e)
            finally:
                self._running.discard(job)
                self.job_seconds += (time.perf_counter() - t0 - self.job_seconds) * 0.2

    def _new_decoder(self):
        from jetflow.decoding.batch import BatchDecoder

        jf = self.jetflow
        return BatchDecoder(jf.target, jf.drafter.head if jf.drafter is not None else None, lookup=jf.lookup,
                            int8=jf.int8_draft, load_budget=self._load_budget, max_batch=self.max_batch,
                            prefix_slots=self.prefix_slots)

    def _batch_request(self, prompt, **request):
        from jetflow.decoding.api import prepare_request
        from jetflow.decoding.batch import BatchRequest

        jf = self.jetflow
        ids, params, output = prepare_request(jf.target, prompt, **request)
        budget = (None if jf.budget == "auto" else jf.budget) if jf.drafter is not None else 0
        return BatchRequest(ids, params, output, budget=budget, width=jf.width)

    def _warm_up(self, decoder) -> None:
        """A short request through the batch path: llama.cpp's first decodes in a new context and the
        drafter's preparation are paid here, not by the first client."""
        decoder.add(self._batch_request("warm-up", max_new_tokens=4))
        while decoder.active:
            decoder.step()

    def _work_batched(self) -> None:
        decoder = self._decoder
        jobs: dict[int, tuple[object, Job, float]] = {}  # id(request) -> (request, job, start time)
        waiting: deque = deque()  # (request, job): taken from the queue, not yet prefilled
        stopping = False

        def settle(key: int) -> None:  # hand out new text; a finished request leaves
            req, job, t0 = jobs[key]
            if delta := req.output.drain():
                job._emit("delta", delta)
            if req.finished:
                job._emit("done", req.result)
                del jobs[key]
                self._running.discard(job)
                self.job_seconds += (time.perf_counter() - t0 - self.job_seconds) * 0.2

        def admit(batch: list) -> None:
            try:
                decoder.add_many([req for req, _ in batch])
            except Exception as e:
                if len(batch) > 1:  # find the bad request: the others still run
                    for one in batch:
                        admit([one])
                    return
                batch[0][1]._emit("error", e)
                self._running.discard(batch[0][1])
                return
            for req, job in batch:
                jobs[id(req)] = (req, job, time.perf_counter())
                settle(id(req))

        while True:
            while not stopping and len(jobs) + len(waiting) < self.max_batch:  # take jobs between two steps
                try:
                    job = self._queue.get(block=not jobs and not waiting)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                if job.cancelled.is_set():
                    job._emit("error", EngineStopped("cancelled before it started"))
                    continue
                try:
                    req = self._batch_request(job.prompt_ids, **job.request)
                except Exception as e:  # a bad request fails alone
                    job._emit("error", e)
                    continue
                self._take(job)
                waiting.append((req, job))
            joining, tokens = [], 0  # this step's prefills: up to max_prefill_tokens, at least one job
            while waiting and (not joining or tokens + len(waiting[0][0].prompt_ids) <= self.max_prefill_tokens):
                req, job = waiting.popleft()
                if job.cancelled.is_set():
                    job._emit("cancelled", job.reason)
                    self._running.discard(job)
                    continue
                joining.append((req, job))
                tokens += len(req.prompt_ids)
            if joining:
                admit(joining)
            for key, (req, job, _) in list(jobs.items()):
                if job.cancelled.is_set():
                    decoder.cancel(req)
                    job._emit("cancelled", job.reason)
                    del jobs[key]
                    self._running.discard(job)
            if not jobs:
                if stopping and not waiting:
                    return
                continue
            try:
                decoder.step()
            except Exception as e:  # reported to every job in the batch; the worker keeps serving
                error = StepFailed(f"a decoding step of the batch failed: {type(e).__name__}: {e}")
                for req, job, _ in jobs.values():
                    job._emit("error", error)
                    self._running.discard(job)
                jobs.clear()
                # The failed step may have left the batch half-committed: a new one, the old one's
                # context freed first (two would hold the memory twice).
                decoder.close()
                decoder = self._decoder = self._new_decoder()
                continue
            if self.metrics is not None and decoder.last_step["batch"]:  # (a step may only finish full contexts)
                self.metrics.step(**decoder.last_step)
            for key in list(jobs):
                settle(key)

    def shutdown(self, cancel_running: bool = False, timeout: float | None = None) -> None:
        """Stop accepting; cancel queued jobs; finish (or cancel) the running one; stop the thread."""
        with self._admission:
            self._accepting = False
            self._answer_queued(EngineStopped("the server is shutting down"))
            if cancel_running:
                self._cancelling = True
                for job in list(self._running):
                    job.cancel("the server is shutting down")
            self._queue.put(None)  # (the queue was just drained, and nothing is put while the lock is held)
        self._stopped.wait(timeout)
