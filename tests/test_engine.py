"""The batched generation worker (jetflow/serve/engine.py) driven directly, without HTTP: how a crowd
of jobs arriving together is admitted, and that each job's output stays the solo output."""

import asyncio
import threading

import pytest
import torch

from tiny import byte_tokenizer, tiny_model


@pytest.fixture(scope="module")
def jf(tmp_path_factory):
    import jetflow
    from jetflow.models.draft_head import DraftHead, DraftHeadConfig
    from jetflow.models.target import TargetModel

    path = tmp_path_factory.mktemp("engine")
    tok = byte_tokenizer()
    tok.eos_token = None  # every job runs to max_tokens
    model = tiny_model("llama")
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(path / "target")
    tok.save_pretrained(path / "target")
    target = TargetModel.load(str(path / "target"))
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6))
    return jetflow.JetFlow(target, head, budget=4, width=3)


class StepLog:
    """Stands in for the server's metrics: records what each step verified, and holds the worker
    after its first step until the test lets it go (so the crowd is queued at one step boundary)."""

    def __init__(self):
        self.batches = []
        self.first_step, self.go_on = threading.Event(), threading.Event()

    def step(self, batch, tokens, nodes):
        self.batches.append(batch)
        self.first_step.set()
        self.go_on.wait(30)

    def cached_prompt(self, n):
        pass


async def outcome(job) -> tuple[str, object]:
    """("done", the job's text) once it is done, else (kind, payload) of the event that ended it."""
    parts = []
    while True:
        kind, payload = await job.events.get()
        if kind == "delta":
            parts.append(payload)
        elif kind == "done":
            return "done", "".join(parts)
        else:
            return kind, payload

def run_crowd(jf, prompts, max_tokens, **engine_kw):
    from jetflow.serve.engine import Engine

    log = StepLog()
    engine = Engine(jf, max_queue=16, metrics=log, max_batch=8, **engine_kw)

    async def main():
        lead = engine.submit(jf.target.tokenizer.encode("Lead"), {"max_new_tokens": 3 * max_tokens})
        await asyncio.get_running_loop().run_in_executor(None, log.first_step.wait, 30)
        jobs = [engine.submit(jf.target.tokenizer.encode(p), {"max_new_tokens": max_tokens}) for p in prompts]
        log.go_on.set()  # the worker takes the whole crowd from the queue before its next step
        jobs.append(lead)
        texts = []
        for job in jobs:
            kind, text = await outcome(job)
            assert kind == "done", f"{kind}: {text}"
            texts.append(text)
        return texts[:-1]

    try:
        return asyncio.run(main()), log.batches
    finally:
        engine.shutdown()


def test_a_crowd_is_admitted_over_several_steps_and_outputs_stay_solo(jf):
    prompts = ["The sea", "Once upon a time", "Why is", "A list of three things"]
    alone = [jf.generate(jf.target.tokenizer.encode(p), max_new_tokens=12).text for p in prompts]
    texts, batches = run_crowd(jf, prompts, 12, max_prefill_tokens=1)  # one prompt per step
    assert texts == alone
    assert batches[:5] == [1, 2, 3, 4, 5]  # each step took one more job: the first ones were decoding already
    texts, batches = run_crowd(jf, prompts, 12, max_prefill_tokens=10_000)
    assert texts == alone
    assert batches[:2] == [1, 5]  # all four prefilled before the next step


def test_prefill_budget_must_be_positive(jf):
    from jetflow.serve.engine import Engine

    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Engine(jf, max_batch=4, max_prefill_tokens=0)


def test_serve_loads_and_runs_the_model_in_one_thread_that_is_not_the_main_one(jf):
    """jetflow serve's engine thread loads, warms up and decodes: the main thread (HTTP) never runs
    the model, so only one thread has OpenMP workers (jetflow/serve/server.py)."""
    from jetflow.serve.server import start_engine

    seen = {}

    def load():
        seen["load"] = threading.current_thread()
        return jf

    stream = jf.stream

    def recording_stream(*args, **kw):
        seen["decode"] = threading.current_thread()
        yield from stream(*args, **kw)

    jf.stream = recording_stream
    try:
        loaded, engine = start_engine(load, max_batch=1)

        async def one():
            job = engine.submit(jf.target.tokenizer.encode("Hi"), {"max_new_tokens": 3})
            while (await job.events.get())[0] != "done":
                pass

        asyncio.run(one())
        engine.shutdown()
    finally:
        del jf.stream
    assert loaded is jf
    assert seen["load"] is seen["decode"] and seen["load"] is not threading.main_thread()
    assert engine._stopped.is_set()  # shutdown returned after the worker did


def test_serve_reports_a_failed_load_from_the_engine_thread():
    from jetflow.errors import JetFlowError
    from jetflow.serve.server import start_engine

    def load():
        raise JetFlowError("drafter checkpoint directory not found: nowhere")

    with pytest.raises(JetFlowError, match="nowhere"):
        start_engine(load)


def run_worker(engine) -> threading.Thread:
    def work():
        try:
            engine.run()
        except BaseException:  # a worker that dies re-raises; what it left behind is under test
            pass

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_a_request_that_fails_to_join_leaves_the_others_joining_with_it_as_they_were(jf):
    """Several jobs admitted together, one of which fails its setup: the others are added again on
    their own, each with exactly its solo output (no first token twice), also one that finishes at
    once (max_tokens 1), and the failing one gets its error."""
    from jetflow.serve.engine import Engine

    enc = jf.target.tokenizer.encode
    specs = [("The sea", 1), ("Why is", 6), ("Once upon", 6)]
    alone = [jf.generate(enc(p), max_new_tokens=n).text for p, n in specs]
    engine = Engine(jf, max_batch=4, start=False)
    make, calls = engine._decoder._new_drafter, []

    def flaky(view):  # the second request's setup fails, in the batch and again on its own
        calls.append(view)
        if len(calls) in (2, 4):
            raise RuntimeError("drafter setup failed")
        return make(view)

    engine._decoder._new_drafter = flaky

    async def main():
        jobs = [engine.submit(enc(p), {"max_new_tokens": n}) for p, n in specs]  # queued before the worker runs
        run_worker(engine)
        return [await outcome(job) for job in jobs]

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert results[0] == ("done", alone[0]) and results[2] == ("done", alone[2])
    assert results[1][0] == "error" and "drafter setup failed" in str(results[1][1])
    assert engine._decoder.active == []


def test_a_failed_batch_step_is_a_server_error_and_a_dead_worker_fails_every_job(jf):
    from jetflow.serve.engine import Engine, EngineStopped, StepFailed

    enc = jf.target.tokenizer.encode
    alone = jf.generate(enc("The sea"), max_new_tokens=5).text
    engine = Engine(jf, max_batch=4, start=False)
    old, closed = engine._decoder, []

    def broken_step():
        raise RuntimeError("kernel fault")

    old.step, old.close = broken_step, lambda: closed.append(True)

    async def first():
        job = engine.submit(enc("The sea"), {"max_new_tokens": 5})
        run_worker(engine)
        failed = await outcome(job)
        served = await outcome(engine.submit(enc("The sea"), {"max_new_tokens": 5}))
        return failed, served

    try:
        (kind, error), (done, text) = asyncio.run(first())
    finally:
        engine.shutdown()
    assert kind == "error" and isinstance(error, StepFailed) and "kernel fault" in str(error)
    assert closed and engine._decoder is not old  # the old batch freed, the new one kept
    assert (done, text) == ("done", alone)  # and the worker went on serving

    # A worker that dies (here before its first step) answers what was queued, and nothing is queued after.
    engine = Engine(jf, max_batch=4, start=False)

    def dead():
        raise MemoryError("no room for a new batch")

    engine._work_batched = dead

    async def second():
        jobs = [engine.submit(enc(p), {"max_new_tokens": 5}) for p in ("a b", "c d")]
        run_worker(engine).join(10)
        return [await outcome(job) for job in jobs]

    results = asyncio.run(second())
    assert all(kind == "error" and isinstance(e, EngineStopped) and "MemoryError" in str(e) for kind, e in results)
    assert "no room" in engine.failure

    async def third():
        engine.submit(enc("e f"), {"max_new_tokens": 5})

    with pytest.raises(EngineStopped, match="worker stopped"):
        asyncio.run(third())


def test_queued_jobs_whose_clients_left_give_up_their_places(jf):
    """A full queue whose jobs' clients have gone (timed out, retried) does not turn live clients
    away with 429: the abandoned jobs are answered and dropped, and the depth counts live ones."""
    import asyncio

    from jetflow.serve.engine import Engine, EngineStopped, QueueFull

    engine = Engine(jf, max_queue=2, start=False)  # no worker: the queue only fills

    async def main():
        first, second = engine.submit([1, 2], {}), engine.submit([3, 4], {})
        with pytest.raises(QueueFull):
            engine.submit([5, 6], {})
        first.cancel("client gone")
        assert engine.queue_depth == 1
        third = engine.submit([5, 6], {})  # takes the abandoned job's place
        kind, error = await asyncio.wait_for(first.events.get(), 5)
        assert kind == "error" and isinstance(error, EngineStopped)
        assert engine.queue_depth == 2 and list(engine._queue.queue) == [second, third]
        with pytest.raises(QueueFull):
            engine.submit([7, 8], {})

    asyncio.run(main())
