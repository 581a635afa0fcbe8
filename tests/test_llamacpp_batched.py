"""Many requests in one llama.cpp context (continuous batching on the llama.cpp backend).

Each request has a KV stream of its own, so its rows are computed exactly as if it ran alone: every
verify row, prefill row and feature must equal the solo target's bit for bit (GGML_LLAMAFILE=OFF
makes multi-token rows equal one-token decodes), through joins, leaves (a stream copy) and commits.
"""

import random

import pytest
import torch

import jetflow
from jetflow.errors import InvalidRequestError, JetFlowError
from jetflow.models.loading import llamacpp_available
from tiny import walk_prefix_cache

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def llama_target():
    if not llamacpp_available():
        pytest.skip("llama-cpp-python is not installed")
    from jetflow.models.loading import load_target

    return load_target("smollm2-135m-instruct", backend="llamacpp", n_threads=2)


def chain(rng, k):
    return [rng.randrange(100, 20000) for _ in range(k)], list(range(-1, k - 1))


def test_rows_equal_each_sequence_alone(llama_target):
    from jetflow.models.llamacpp_batched import LlamaCppBatchedTarget

    t = llama_target
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(n)] for n in (30, 71, 12, 5)]
    batch = LlamaCppBatchedTarget(t, max_seqs=4, context_per_seq=512)
    joined = batch.join_many(prompts[:3])  # three prefills share each decode
    for (sid, out), p in zip(joined, prompts):
        ref = t.prefill(p)
        assert torch.equal(out.logits, ref.logits[-1:]) and torch.equal(out.hidden, ref.hidden)
    ids = [sid for sid, _ in joined]
    for step in range(6):
        if step == 2:
            ids.append(batch.join(prompts[3])[0])
        if step == 4:  # a sequence in the middle leaves: the last one's stream moves into its place
            batch.leave(ids.pop(1))
        k = rng.randrange(1, 5)  # every sequence the same chain length (one graph), or on odd steps each its own
        trees = {i: chain(rng, rng.randrange(1, 5) if step % 2 else k) for i in ids}
        outs = batch.verify(trees)
        paths = {}
        for i in ids:
            t.prefill(batch.token_ids(i))
            ref = t.verify(*trees[i])
            assert torch.equal(outs[i].logits, ref.logits), (step, i)
            assert torch.equal(outs[i].hidden, ref.hidden), (step, i)
            paths[i] = list(range(rng.randrange(1, len(trees[i][0]) + 1)))
        batch.commit(paths)
    for i in ids:  # the committed cache equals a fresh prefill: the next token's logits agree
        nxt = chain(rng, 1)
        out = batch.verify({j: (nxt if j == i else chain(rng, 1)) for j in ids})[i]
        batch.commit({j: [] for j in ids})
        assert torch.equal(out.logits, t.prefill(batch.token_ids(i) + nxt[0]).logits[-1:])
        assert batch.length(i) == len(batch.token_ids(i))


def test_unequal_chains_and_bad_input(llama_target):
    from jetflow.models.llamacpp_batched import LlamaCppBatchedTarget

    t = llama_target
    rng = random.Random(1)
    batch = LlamaCppBatchedTarget(t, max_seqs=2, context_per_seq=256)
    (a, _), (b, _) = batch.join_many([[5, 6, 7], [8, 9]])
    outs = batch.verify({a: chain(rng, 3), b: chain(rng, 1)})  # llama.cpp splits it into two graphs
    assert outs[a].logits.shape[0] == 3 and outs[b].logits.shape[0] == 1
    with pytest.raises(RuntimeError, match="before the last verify was committed"):  # its cells would collide
        batch.verify({a: chain(rng, 1), b: chain(rng, 1)})
    batch.commit({a: [0, 1], b: [0]})
    with pytest.raises(ValueError, match="verifies chains"):
        batch.verify({a: ([1, 2, 3], [-1, 0, 0]), b: chain(rng, 1)})
    with pytest.raises(ValueError, match="a chain for every sequence"):
        batch.verify({a: chain(rng, 1)})
    with pytest.raises(InvalidRequestError, match="at most 2 sequences"):
        batch.join([1, 2])
    with pytest.raises(InvalidRequestError, match="256 tokens of context"):
        LlamaCppBatchedTarget(t, max_seqs=1, context_per_seq=256).join(list(range(300)))
    with pytest.raises(RuntimeError, match="without a verify"):
        batch.commit({a: [0], b: [0]})
    with pytest.raises(InvalidRequestError, match="context of 256"):
        batch.verify({a: chain(rng, 1), b: chain(rng, 300)})
    assert batch.length(a) == 5 and batch.length(b) == 3  # nothing was lost by the refusals
    taps = t.tapped_layers
    t.set_tapped_layers([1, 2])  # another drafter's layers: the batch's context computes none of them
    try:
        with pytest.raises(JetFlowError, match="make a new batch"):
            batch.verify({a: chain(rng, 1), b: chain(rng, 1)})
        with pytest.raises(JetFlowError, match="make a new batch"):
            batch.join([10, 11])
    finally:
        t.set_tapped_layers(taps)
    batch.verify({a: chain(rng, 1), b: chain(rng, 1)})  # with its own layers again, as before


def _request(target, question, budget, **kw):
    from jetflow.decoding.api import prepare_request
    from jetflow.decoding.batch import BatchRequest

    ids, params, output = prepare_request(target, [{"role": "user", "content": question}], **kw)
    return BatchRequest(ids, params, output, budget=budget, width=7)


QUESTIONS = ["What is 12 times 7?", "Natalia sold 48 clips in April and half as many in May. How many in all?",
             "Name three colors.", "Write a haiku about rain."]


def test_batched_decoding_equals_solo(llama_target):
    """The shipped drafter: requests of different lengths and budgets (one on the load budget),
    joining at different steps, greedy and seeded sampling. Greedy output equals llama.cpp's plain
    decoding; a seeded sampled request gives the same text in a busy batch as alone in one."""
    from jetflow.decoding.batch import BatchDecoder
    from jetflow.decoding.load_budget import LoadBudget
    from jetflow.models.checkpoint import load_drafter

    t = llama_target
    head = load_drafter("jetflow/drafters/smollm2-135m-instruct", target=t)
    jf = jetflow.JetFlow(t, head)
    decoder = BatchDecoder(t, head, load_budget=LoadBudget(jf.adaptive_budget().costs), max_batch=4)
    specs = [(QUESTIONS[0], 4, dict(max_new_tokens=40)), (QUESTIONS[1], None, dict(max_new_tokens=24)),
             (QUESTIONS[2], 0, dict(max_new_tokens=20)), (QUESTIONS[3], 3, dict(max_new_tokens=30, temperature=0.8,
                                                                                 seed=5))]
    reqs = decoder.add_many([_request(t, q, b, **kw) for q, b, kw in specs[:2]])
    decoder.step()
    reqs += [decoder.add(_request(t, q, b, **kw)) for q, b, kw in specs[2:]]
    while decoder.active:
        decoder.step()
    for r, (q, budget, kw) in zip(reqs[:3], specs[:3]):
        alone = jetflow.generate(t, [{"role": "user", "content": q}], **kw)
        assert r.result.token_ids == alone.token_ids, q
    assert reqs[0].result.stats["tau"] > 1.0
    solo = BatchDecoder(t, head, max_batch=1)
    r = solo.add(_request(t, specs[3][0], 3, **specs[3][2]))
    while solo.active:
        solo.step()
    assert r.result.token_ids == reqs[3].result.token_ids
    assert decoder.batch.seqs == []


def test_prompt_prefix_cache_gives_the_same_rows(llama_target):
    """Prompts sharing a chat template's system block reuse its cells from the cache stream; their
    prefill logits, features and later rows still equal the prompt run alone, bit for bit."""
    from jetflow.decoding.prompt import encode_prompt
    from jetflow.models.llamacpp_batched import LlamaCppBatchedTarget

    t = llama_target
    rng = random.Random(2)
    prompts = [encode_prompt(t.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    batch = LlamaCppBatchedTarget(t, max_seqs=3, context_per_seq=256)
    first = batch.join(prompts[0])[0]
    assert batch.prefix_tokens_reused == 0
    joined = batch.join_many(prompts[1:3])
    assert batch.prefix_tokens_reused >= 2 * 20  # the system block of both
    batch.leave(first)
    joined.append(batch.join(prompts[3]))
    for (sid, out), p in zip(joined, prompts[1:]):
        ref = t.prefill(p)
        assert torch.equal(out.logits, ref.logits[-1:]) and torch.equal(out.hidden, ref.hidden)
    ids = [sid for sid, _ in joined]
    for _ in range(3):
        trees = {i: chain(rng, 2) for i in ids}
        outs = batch.verify(trees)
        for i in ids:
            t.prefill(batch.token_ids(i))
            assert torch.equal(outs[i].logits, t.verify(*trees[i]).logits)
        batch.commit({i: [0, 1] for i in ids})



def test_prefix_cache_keeps_finished_conversations(llama_target):
    """Finished sequences (prompt and answer) go into the prefix cache, least recently used out:
    every entry's cells and features equal a fresh prefill of its tokens, and a next turn that
    starts with a cached conversation prefills only its new tokens, with the same rows as alone."""
    from jetflow.decoding.prompt import encode_prompt
    from jetflow.models.llamacpp_batched import LlamaCppBatchedTarget

    t = llama_target
    rng = random.Random(3)
    prompts = [encode_prompt(t.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    batch = LlamaCppBatchedTarget(t, max_seqs=2, context_per_seq=256, prefix_slots=2)

    def converse(prompt, steps):  # join, verify and commit chains of random length, remember, leave
        sid, _ = batch.join(prompt)
        for _ in range(steps):
            k = rng.randrange(1, 4)
            batch.verify({sid: chain(rng, k)})
            batch.commit({sid: list(range(rng.randrange(1, k + 1)))})
        tokens = list(batch.token_ids(sid))
        batch.remember(sid)
        batch.leave(sid)
        return tokens

    def check_next_turn(follow_up, out):  # bit for bit
        ref = t.prefill(follow_up)
        assert torch.equal(out.logits, ref.logits[-1:]) and torch.equal(out.hidden, ref.hidden)

    walk_prefix_cache(batch, converse, prompts, lambda: rng.randrange(100, 20000), check_next_turn)
    for entry in list(batch._cached.entries):  # brute force: each stream holds a fresh prefill's cells and features
        assert torch.equal(entry.hidden, t.prefill(entry.token_ids).hidden)
        sid, out = batch.join(entry.token_ids + [7])
        assert torch.equal(out.logits, t.prefill(entry.token_ids + [7]).logits[-1:])
        batch.leave(sid)


def test_without_a_cache_nothing_is_kept_and_prompts_join_together(llama_target):
    """No cache (no slots, or the target's cache off): no stream, no features kept per sequence,
    and chat prompts admitted together share one prefill decode (they are not split to fill a
    cache); too many sequences for llama.cpp name the flags."""
    from jetflow.decoding.prompt import encode_prompt
    from jetflow.errors import JetFlowError
    from jetflow.models.llamacpp_batched import LlamaCppBatchedTarget

    t = llama_target
    prompts = [encode_prompt(t.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    t.prefix_cache = False
    try:
        off = LlamaCppBatchedTarget(t, max_seqs=3, context_per_seq=256)
    finally:
        t.prefix_cache = True
    for batch in (LlamaCppBatchedTarget(t, max_seqs=3, context_per_seq=256, prefix_slots=0), off):
        decodes = []
        real = batch._decode
        batch._decode = lambda what, n: (decodes.append(n), real(what, n))[1]
        joined = batch.join_many(prompts)
        assert len(decodes) == 1 and batch.prefix_tokens_reused == 0 and batch._cache_slots == []
        for (sid, out), p in zip(joined, prompts):
            assert torch.equal(out.logits, t.prefill(p).logits[-1:])
            batch.remember(sid)
        assert batch._cached.entries == [] and all(s.hidden == [] for s in batch.seqs)
    with pytest.raises(JetFlowError, match="--max-batch 253 \\+ --prefix-cache-slots 4 is 257; lower one"):
        LlamaCppBatchedTarget(t, max_seqs=253, context_per_seq=256, prefix_slots=4)


def test_next_turn_through_the_batch_decoder(llama_target):
    """A greedy chat's second turn, after the first finished in a batch, reuses the first turn's
    cells (prompt and answer) and still equals plain decoding token for token."""
    from jetflow.decoding.batch import BatchDecoder, BatchRequest
    from jetflow.decoding.api import prepare_request
    from jetflow.models.checkpoint import load_drafter

    t = llama_target
    head = load_drafter("jetflow/drafters/smollm2-135m-instruct", target=t)
    decoder = BatchDecoder(t, head, max_batch=2)
    turns = [{"role": "user", "content": QUESTIONS[1]}]
    for follow_up in ["And in June she sold 10 more. How many now?", None]:
        ids, params, output = prepare_request(t, turns, max_new_tokens=32)
        reused = decoder.batch.prefix_tokens_reused
        r = decoder.add(BatchRequest(ids, params, output, budget=4))
        while decoder.active:
            decoder.step()
        alone = jetflow.generate(t, turns, max_new_tokens=32)
        assert r.result.token_ids == alone.token_ids
        assert r.result.cached_prompt_tokens == decoder.batch.prefix_tokens_reused - reused
        if follow_up is None:  # the second turn's prompt started with the first turn's prompt and answer
            assert decoder.batch.prefix_tokens_reused - reused > len(first_prompt) + 16
            break
        first_prompt = ids
        turns += [{"role": "assistant", "content": r.result.text}, {"role": "user", "content": follow_up}]


def test_batched_llamacpp_server_equals_solo(tmp_path):
    """`jetflow serve --backend llamacpp --max-batch 3`: five concurrent requests of different
    lengths (streamed and not) each get llama.cpp's own greedy output."""
    import asyncio

    import httpx

    if not llamacpp_available():
        pytest.skip("llama-cpp-python is not installed")
    from test_serve import start_server, stop

    from jetflow.models.loading import load_target

    proc, base = start_server("smollm2-135m-instruct", "auto", "--backend", "llamacpp", "--max-batch", "3", "--budget", "4",
                              "--threads", "2")
    asks = [(QUESTIONS[0], 30), (QUESTIONS[1], 48), (QUESTIONS[2], 12), (QUESTIONS[3], 24), ("Say hi.", 8)]

    usages = []

    async def ask(c, text, n):
        body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0}
        answer = (await c.post(base + "/v1/chat/completions", json=body)).json()
        usages.append(answer["usage"])
        return answer["choices"][0]["message"]["content"]

    async def main():
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*[ask(c, *a) for a in asks])

    try:
        texts = asyncio.run(main())
        metrics = httpx.get(base + "/metrics").text
    finally:
        assert stop(proc) == 0
    t = load_target("smollm2-135m-instruct", backend="llamacpp", n_threads=2)
    for (q, n), got in zip(asks, texts):
        assert got == jetflow.generate(t, [{"role": "user", "content": q}], max_new_tokens=n).text, q
    sizes = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
             if line.startswith("jetflow_batch_size_")}
    assert sizes['jetflow_batch_size_bucket{le="1"}'] < sizes["jetflow_batch_size_count"]  # steps with >1 request
    cached = next(float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("jetflow_prompt_tokens_cached_total"))
    assert cached >= 20 * (len(asks) - 1)  # every prompt after the first reused the system block
    assert cached == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)  # each answer says its own
