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
            parts = []
            while True:
                kind, payload = await job.events.get()
                if kind == "delta":
                    parts.append(payload)
                elif kind == "done":
                    break
                else:
                    raise AssertionError(f"{kind}: {payload}")
            texts.append("".join(parts))
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
