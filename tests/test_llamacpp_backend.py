"""The llama.cpp target backend: tree verify in one decode, commit, features, errors.

Built with GGML_LLAMAFILE=OFF, a multi-token decode gives the same numbers as one-token decodes, and
the tree's main chain (root -> first child -> ...) is placed in the KV cells a plain decode would
use: those nodes must match decoding their path alone bit for bit. Other nodes sit in cells with
masked gaps between their ancestors; llama.cpp sums attention over cells in fixed groups of 8/32,
so their sums round differently: up to 1.08 logits on random tokens (logits span ~40). The tolerance
for them is 2 logits; a broken mask (a node seeing a non-ancestor) moves logits by 6-18 (negative
control below), so the test still notices one.
"""

import random
import time

import numpy as np
import pytest
import torch

from jetflow.models.loading import llamacpp_available
from jetflow.tree.mask import ancestor_matrix, path_to_root

LOGIT_TOL = 2.0
HIDDEN_REL_TOL = 0.05  # of the feature vector's norm (0.019 the largest seen)

needs_llamacpp = pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed")


def random_tree(rng, n):
    return [-1] + [rng.randrange(0, i) for i in range(1, n)]


@pytest.mark.parametrize("seed", range(5))
def test_path_sequence_ids_give_the_tree_mask(seed):
    """llama.cpp masks node i against cells holding i's FIRST sequence id at positions <= its own:
    with one id per root-to-leaf path that must be exactly 'ancestors and itself'."""
    pytest.importorskip("llama_cpp")
    from jetflow.models.llamacpp_target import _Batch, path_membership
    from jetflow.tree.mask import tree_depths

    rng = random.Random(seed)
    parents = random_tree(rng, rng.randrange(1, 40))
    member = path_membership(parents)
    from llama_cpp import llama_cpp as lib

    batch = _Batch(lib, 64, 64)
    depths = np.asarray(tree_depths(parents))
    batch.tree(np.arange(len(parents), dtype=np.int32), depths, member)
    n = len(parents)
    first = batch.seq_ids[:n, 0]
    for i in range(n):  # ids written are exactly the node's paths, ascending
        assert batch.seq_ids[i, :batch.n_seq_id[i]].tolist() == np.flatnonzero(member[i]).tolist()
    sees = np.array([[member[j, first[i]] and depths[j] <= depths[i] for j in range(n)] for i in range(n)])
    assert (sees == ancestor_matrix(parents).numpy()).all()


def test_lookup_match_equals_brute_force():
    """The latest earlier occurrence of the longest suffix n-gram, its continuation, and how far back
    the text before it agrees with the suffix (at most MAX_MATCH): compared window by window."""
    from jetflow.decoding.lookup_drafter import MAX_MATCH, lookup_continuation, lookup_match

    rng = np.random.default_rng(0)
    for _ in range(2000):
        hist = rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(1, 40)))
        max_ngram, max_draft = int(rng.integers(1, 5)), int(rng.integers(1, 8))
        want = (0, [])
        for n in range(min(max_ngram, hist.size - 1), 0, -1):
            suffix = hist[hist.size - n:].tolist()
            starts = [i for i in range(hist.size - n) if hist[i:i + n].tolist() == suffix]
            if starts:
                s = starts[-1]
                length = max(k for k in range(n, min(s + n, MAX_MATCH) + 1)
                             if hist[s + n - k:s + n].tolist() == hist[hist.size - k:].tolist())
                want = (length, hist[s + n:s + n + max_draft].tolist())
                break
        assert lookup_match(hist, max_ngram, max_draft) == want, (hist.tolist(), max_ngram, max_draft)
        assert lookup_continuation(hist, max_ngram, max_draft) == want[1]


@pytest.fixture(scope="module")
def llama_target():
    if not llamacpp_available():
        pytest.skip("llama-cpp-python is not installed")
    from jetflow.models.loading import load_target

    return load_target("smollm2-135m-instruct", backend="llamacpp", n_threads=2)


@pytest.fixture(scope="module")
def prompt_ids(llama_target):
    from jetflow.decoding.prompt import encode_prompt

    return encode_prompt(llama_target.tokenizer, "Write a short poem about the sea.")


def _path_alone(target, prefix, tokens, parents, node):
    target.prefill(prefix)
    return target.extend([tokens[j] for j in path_to_root(parents, node)], return_hidden=True)


@pytest.mark.real
@pytest.mark.parametrize("seed", [0, 1])
def test_verify_nodes_match_their_paths(llama_target, prompt_ids, seed):
    rng = random.Random(seed)
    parents = random_tree(rng, 24)
    tokens = [rng.randrange(100, 40000) for _ in parents]
    llama_target.prefill(prompt_ids)
    out = llama_target.verify(tokens, parents)
    assert out.logits.shape == (24, llama_target.vocab_size)
    assert out.hidden.shape == (24, len(llama_target.tapped_layers) * llama_target.hidden_size)
    from jetflow.models.llamacpp_target import main_chain_first

    order = main_chain_first(parents)
    chain = set(order[: next(i for i in range(1, len(order) + 1) if i == len(order) or parents[order[i]] != order[i - 1])])
    for node in range(len(parents)):
        ref = _path_alone(llama_target, prompt_ids, tokens, parents, node)
        diff = (ref.logits[-1] - out.logits[node]).abs().max().item()
        if node in chain:
            assert diff == 0.0, (node, diff)
            assert torch.equal(ref.hidden[-1], out.hidden[node])
        assert diff < LOGIT_TOL, (node, diff)
        hid = (ref.hidden[-1] - out.hidden[node]).norm() / ref.hidden[-1].norm()
        assert hid < HIDDEN_REL_TOL, (node, hid.item())
    assert len(chain) >= 2


@pytest.mark.real
@pytest.mark.parametrize("count", [2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 18, 33])
def test_a_batched_decode_equals_one_token_decodes_bit_for_bit(llama_target, prompt_ids, count):
    """Tokens decoded in one call give exactly the logits and features of the same tokens decoded one
    at a time: what lossless verification on llama.cpp rests on. Every path of third_party/llama-cpp-python's
    tiles: 2-3 tokens (the register kernel), 4 and more (the scratch tile; groups of four and a rest of
    1-3), past 16 (a second tile, or a lone token through ggml's one-row kernel)."""
    rng = random.Random(count)
    tokens = [rng.randrange(100, 40000) for _ in range(count)]
    llama_target.prefill(prompt_ids)
    singles = [llama_target.extend([t], return_hidden=True) for t in tokens]
    llama_target.prefill(prompt_ids)
    batched = llama_target.extend(tokens, return_hidden=True)
    assert torch.equal(batched.logits, torch.cat([o.logits for o in singles]))
    assert torch.equal(batched.hidden, torch.cat([o.hidden for o in singles]))


@pytest.mark.real
def test_the_build_is_named_and_has_the_multi_token_tiles(llama_target):
    """`make setup` builds llama-cpp-python with JetFlow's patch: on an AVX2 x86 CPU its quantized dot
    products take up to 16 tokens per tile. Costs are cached per CPU library (another build, other costs)."""
    import platform

    from jetflow.eval.machine import cpu_flags, machine
    from jetflow.models.llamacpp_target import llama_build

    build = llama_build()
    assert len(build["cpu_library"]) == 16 and int(build["cpu_library"], 16) >= 0
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= set(cpu_flags()):
        assert build["quant_dot_columns"] == 16, "llama-cpp-python was built without third_party/llama-cpp-python's patch"
    else:
        assert build["quant_dot_columns"] in (1, 16)
    assert machine()["llama_cpp"] == build


@pytest.mark.real
def test_wrong_mask_is_noticed(llama_target, prompt_ids):
    """Negative control: verifying the same tokens as a chain (each node then also sees its
    non-ancestors) moves a tree node's logits far beyond the tolerance."""
    parents = [-1, 0, 0, 0, 3]
    rng = random.Random(0)
    tokens = [rng.randrange(100, 40000) for _ in parents]
    llama_target.prefill(prompt_ids)
    wrong = llama_target.verify(tokens, list(range(-1, 4)))
    ref = _path_alone(llama_target, prompt_ids, tokens, parents, 4)
    assert (ref.logits[-1] - wrong.logits[4]).abs().max().item() > 2 * LOGIT_TOL


@pytest.mark.real
def test_cache_after_rounds_matches_fresh_prefill(llama_target, prompt_ids):
    rng = random.Random(3)
    llama_target.prefill(prompt_ids)
    for _ in range(5):
        parents = random_tree(rng, rng.randrange(1, 20))
        tokens = [rng.randrange(100, 40000) for _ in parents]
        llama_target.verify(tokens, parents)
        leaf = rng.randrange(len(parents))
        llama_target.commit(path_to_root(parents, leaf)[: rng.randrange(0, 4) + 1])
    committed = list(llama_target.token_ids)
    assert llama_target.past_len == len(committed)
    nxt = llama_target.extend([1234], return_hidden=True)
    fresh = llama_target.prefill(committed + [1234], return_hidden=True)
    assert (nxt.logits[-1] - fresh.logits[-1]).abs().max().item() < LOGIT_TOL
    assert ((nxt.hidden[-1] - fresh.hidden[-1]).norm() / fresh.hidden[-1].norm()).item() < HIDDEN_REL_TOL


@pytest.mark.real
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_step_equals_extend_then_argmax(llama_target, prompt_ids, seed):
    """The plain greedy step (no logits copied out) commits and predicts exactly what extend() and
    the first maximum of its logits do, after tree rounds too (a side branch accepted leaves tokens
    to be written again: the step then takes the general path)."""
    rng = random.Random(seed)

    def run(step):
        llama_target.prefill(prompt_ids, return_hidden=bool(seed % 2))
        tokens_out, token = [], 4321
        for i in range(12):
            if i % 4 == 3:  # a tree round, with a random path kept
                parents = random_tree(rng_tree, rng_tree.randrange(2, 10))
                nodes = [token] + [rng_tree.randrange(100, 40000) for _ in parents[1:]]
                llama_target.verify(nodes, parents)
                path = path_to_root(parents, rng_tree.randrange(len(parents)))
                llama_target.commit(path)
                token = rng_tree.randrange(100, 40000)
            token = step(token)
            tokens_out.append(token)
        return tokens_out, list(llama_target.token_ids), llama_target.past_len

    rng_tree = random.Random(rng.random())
    state = rng_tree.getstate()
    fast = run(llama_target.greedy_step)
    rng_tree.setstate(state)
    general = run(lambda t: int(llama_target.extend([t]).logits[-1].numpy().argmax()))
    assert fast == general


@pytest.mark.real
def test_feature_taps_switch_off_without_changing_logits(llama_target, prompt_ids):
    """Decoding that reads no features runs without the layer-input taps: its logits are the same
    bits, and the next forward that asks for features gets them again."""
    extra = [1234, 567, 8901]

    def run(hidden):
        outs = [llama_target.prefill(prompt_ids, return_hidden=hidden)]
        outs += [llama_target.extend([t], return_hidden=hidden) for t in extra]
        return outs

    with_taps = run(True)
    without = run(False)
    assert not llama_target._taps_on and all(o.hidden is None for o in without)
    for a, b in zip(with_taps, without):
        assert torch.equal(a.logits, b.logits)
    again = run(True)
    assert llama_target._taps_on
    for a, b in zip(with_taps, again):
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.logits, b.logits)


@pytest.mark.real
def test_features_match_torch_backend(llama_target, prompt_ids, smollm2):
    """Layer-input taps are the torch backend's tapped layer outputs (up to Q4_1 arithmetic)."""
    smollm2.set_tapped_layers(llama_target.tapped_layers)
    ours = llama_target.prefill(prompt_ids).hidden
    theirs = smollm2.prefill(prompt_ids).hidden
    cos = torch.nn.functional.cosine_similarity(ours[1:], theirs[1:], dim=-1)
    assert cos.min().item() > 0.95


@pytest.mark.real
def test_errors_are_clear(llama_target, prompt_ids, monkeypatch):
    from jetflow.errors import InvalidRequestError
    from jetflow.models import llamacpp_target as mod

    with pytest.raises(InvalidRequestError, match="context"):
        llama_target.prefill([100] * llama_target.max_context)
    llama_target.prefill(prompt_ids)
    with pytest.raises(InvalidRequestError, match="batch"):
        llama_target.verify([5] * (llama_target.n_batch + 1), list(range(-1, llama_target.n_batch)))
    with pytest.raises(InvalidRequestError, match="token ids"):
        llama_target.verify([llama_target.vocab_size], [-1])
    llama_target.extend([100])  # still usable after refused requests
    monkeypatch.setitem(mod._EXT_SYMBOLS, "get_layer_inp", ("_Z_no_such_symbol", None, []))
    with pytest.raises(mod.LlamaCppError, match="_Z_no_such_symbol"):
        mod._bind_ext(mod._import_binding())


@pytest.mark.real
def test_prefill_takes_a_shared_prefix_from_the_cache_bit_for_bit(llama_target, prompt_ids):
    """A prompt that extends what the cache holds (the next turn of a chat) computes only its new
    tokens, and its logits equal a fresh prefill's exactly. The cells come from a speculative request
    that ended on an accepted side branch (committed tokens whose cells were dropped, ``_redo``, which
    must not count); with features, as far as the features kept for the committed tokens reach."""
    import jetflow

    target = llama_target
    jf = jetflow.JetFlow.from_pretrained(target, "auto", budget=8)

    def speculative_run() -> list[int]:
        # Which round ends on a side branch depends on the machine's int8 draft numerics: the first
        # answer length (from 30 tokens on) whose last round does.
        for n in range(30, 80):
            result = jf.generate(prompt_ids, max_new_tokens=n)
            if target._redo:
                break
        assert result.stats["tau"] > 1.2 and target._redo  # trees committed, the last on a side branch
        return list(target.token_ids)

    held = speculative_run()
    in_cells = len(held) - len(target._redo)
    follows = {shared: held[:shared] + [198, 8538, 314, 216] for shared in (len(held), len(held) - 7, len(prompt_ids) - 3)}
    target.prefix_cache = False
    fresh = {shared: target.prefill(follow, return_hidden=False).logits for shared, follow in follows.items()}
    assert target.reused_tokens == 0
    target.prefix_cache = True
    target.prefill(list(follows.values())[-1] + [13], return_hidden=False)
    assert target.reused_tokens == 0  # what a request made with the cache off committed is not reused
    for shared, follow in follows.items():
        assert speculative_run() == held
        reused = target.prefill(follow, return_hidden=False).logits
        assert target.reused_tokens == min(shared, in_cells) and target.token_ids == follow
        assert target.past_len == len(follow) and not target._redo
        assert torch.equal(reused, fresh[shared]), shared
    # With features: as far as the features kept of the committed tokens reach (the speculative
    # request read them for every token it committed), handed back for the cached part.
    target.prefix_cache = False
    fresh = {shared: target.prefill(follow, return_hidden=True) for shared, follow in follows.items()}
    target.prefix_cache = True
    for shared, follow in follows.items():
        assert speculative_run() == held and target.features.length == len(held)
        out = target.prefill(follow, return_hidden=True)
        assert target.reused_tokens == min(shared, in_cells)
        assert torch.equal(out.logits, fresh[shared].logits), shared
        assert out.hidden.shape == fresh[shared].hidden.shape
        # The kept features, handed back for the cached part: bit for bit a fresh prefill's, those
        # of tokens committed from a side branch of a tree included (kept from the next decode,
        # which wrote them again where one-token decoding puts them, not from the tree's layout).
        assert torch.equal(out.hidden, fresh[shared].hidden), shared
    target.greedy_step(5)  # a plain step reads no features: they end before it
    target.prefill(follow + [5, 6], return_hidden=True)
    assert target.reused_tokens == len(follow)
    target.prefill(follow, return_hidden=False)
    assert target.reused_tokens == len(follow) - 1  # the whole prompt held: its last token runs again, for its logits
    target.flash_attn = True  # (the context's kernel is set at load; only the cache's decision is checked here)
    try:
        target.prefill(follow, return_hidden=False)
        assert target.reused_tokens == 0  # flash attention's rows depend on how many run together
    finally:
        target.flash_attn = False


@pytest.mark.real
def test_a_chats_next_turn_reuses_the_cache_and_decodes_the_same(llama_target):
    import jetflow

    target = llama_target
    turn1 = [{"role": "user", "content": "Name three rivers in Europe."}]
    answer = jetflow.generate(target, turn1, max_new_tokens=24)
    turn2 = turn1 + [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "Which is longest?"}]
    cached = jetflow.generate(target, turn2, max_new_tokens=24)
    target.prefix_cache = False
    try:
        fresh = jetflow.generate(target, turn2, max_new_tokens=24)
    finally:
        target.prefix_cache = True
    assert cached.token_ids == fresh.token_ids and fresh.cached_prompt_tokens == 0
    assert cached.cached_prompt_tokens > len(jetflow.decoding.prompt.encode_prompt(target.tokenizer, turn1))
    # --compare / --check-lossless: the reference prefills in full, not from the run just before it
    from jetflow.decoding.reference import generate_with_reference

    run, reference = generate_with_reference(jetflow.JetFlow.from_pretrained(target, "none"), turn2,
                                             reference=True, max_new_tokens=8)
    assert reference.cached_prompt_tokens == 0 and reference.token_ids == run.token_ids


@pytest.mark.real
def test_trees_near_the_end_of_the_context_finish_like_plain_decoding():
    """On llama.cpp every tree node takes a KV cell until commit, so near the context's end a tree
    whose depth fits may still not: the loop trims it to the free cells, and the request ends with
    "length" and the tokens plain decoding gives, instead of failing."""
    import jetflow
    from jetflow.errors import InvalidRequestError
    from jetflow.models.gguf_meta import gguf_tokenizer
    from jetflow.models.llamacpp_target import LlamaCppError, LlamaCppTarget
    from jetflow.models.resolve import locate_gguf

    gguf, name = locate_gguf("smollm2-135m-instruct")
    with pytest.raises(LlamaCppError, match="needs a context and a batch of at least 256 tokens"):
        LlamaCppTarget(gguf, gguf_tokenizer(gguf), name=name, n_ctx=128)  # (llama.cpp itself aborts)
    small = LlamaCppTarget(gguf, gguf_tokenizer(gguf), name=name, n_ctx=256, n_threads=2)
    prompt = "Repeat after me: " + "one two three four five six seven eight nine ten " * 19
    ids = jetflow.decoding.prompt.encode_prompt(small.tokenizer, prompt)
    assert 200 < len(ids) < 240
    plain = jetflow.generate(small, prompt, max_new_tokens=100)
    assert plain.finish_reason == "length" and len(ids) + len(plain.token_ids) == small.max_context  # as the server counts
    for budget in (16, 64):
        spec = jetflow.JetFlow.from_pretrained(small, "auto", budget=budget).generate(prompt, max_new_tokens=100)
        assert spec.token_ids == plain.token_ids and spec.finish_reason == "length", budget
    narrow = LlamaCppTarget(gguf, gguf_tokenizer(gguf), name=name, n_ctx=1024, n_batch=256, n_threads=2)
    wide = jetflow.JetFlow.from_pretrained(narrow, "auto", budget=256).generate("Count to five.", max_new_tokens=12)
    assert wide.token_ids == jetflow.generate(narrow, "Count to five.", max_new_tokens=12).token_ids  # 257 > 256
    small.prefill(ids)
    room = small.tree_room()
    assert room == small.max_context - len(ids)
    with pytest.raises(InvalidRequestError, match=f"a tree of {room + 1} tokens needs as many free KV cells"):
        small.verify([5] * (room + 1), [-1] + [0] * room)  # depth 1: fits the positions, not the cells


@pytest.mark.real
@pytest.mark.parametrize("prompt", ["Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                                    "clips in May. How many clips did Natalia sell altogether?",
                                    "Write a Python function that reverses a string."])
def test_greedy_jetflow_equals_llama_api(llama_target, prompt):
    """Token for token what llama-cpp-python's Llama API decodes greedily (same kernels)."""
    import jetflow
    from jetflow.eval.llama_reference import llama_greedy, open_llama

    jf = jetflow.JetFlow.from_pretrained(llama_target, "auto", budget=8)
    ours = jf.generate(prompt, max_new_tokens=64)
    llm = open_llama(llama_target.gguf, n_threads=2)
    ids = jetflow.decoding.prompt.encode_prompt(llama_target.tokenizer, prompt)
    ref, _, _ = llama_greedy(llm, ids, 64, llama_target.stop_token_ids())
    assert ours.token_ids == ref
    assert ours.stats["tau"] > 1.5
    # the reference as the bench times it: its tokens turned into text as they come, as ours are
    _, _, output = jetflow.decoding.api.prepare_request(llama_target, prompt, max_new_tokens=64)
    streamed, _, reason = llama_greedy(llm, ids, 64, llama_target.stop_token_ids(), output)
    assert streamed == ref == output.token_ids and output.text == ours.text and reason == ours.finish_reason


@pytest.mark.real
def test_the_bench_reference_does_the_same_work_as_jetflows_loops(llama_target, monkeypatch):
    """`jetflow bench`'s llama-ar turns its tokens into text inside its timing, one at a time as
    they come (as JetFlow's loops stream text), and gives ar's tokens and text."""
    from jetflow.decoding.output import OutputStream
    from jetflow.eval.methods import METHODS, MethodRunner

    runner = MethodRunner(llama_target, {})
    prompt = [{"role": "user", "content": "Name three colors."}]
    ar = runner.run(METHODS["ar"], prompt, budget=None, max_new_tokens=8)
    added, add = [], OutputStream.add
    monkeypatch.setattr(OutputStream, "add", lambda self, t: added.append(t) or time.sleep(0.2) or add(self, t))
    ref = runner.run(METHODS["llama-ar"], prompt, budget=None, max_new_tokens=8)
    assert ref.token_ids == ar.token_ids == added and ref.text == ar.text and ref.finish_reason == ar.finish_reason
    assert ref.seconds >= 0.2 * len(added)  # the text was made inside the timing (8 decodes take far less)


@pytest.mark.real
@needs_llamacpp
def test_a_sampled_bench_on_llamacpp_compares_with_jetflows_plain_loop(tmp_path, capsys):
    """llama-cpp-python's loop is greedy only: a sampled `jetflow bench` on llama.cpp measures
    against `ar` (which samples), and naming llama-ar there is refused before anything loads."""
    import json

    from jetflow.cli import main
    from jetflow.eval.methods import reference_method

    base = ["bench", "--backend", "llamacpp", "--datasets", "gsm8k", "--limit", "1", "--max-new-tokens", "6",
            "--temperature", "0.7", "--seed", "3", "--no-cost-model", "--out", str(tmp_path / "b")]
    assert main(base + ["--methods", "lookup"]) == 0
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    ran = {(r["dataset"], r["method"]): r["summary"] for r in summary["runs"]}
    assert ran.keys() == {("gsm8k", "ar"), ("gsm8k", "lookup")}
    lookup, ar = ran[("gsm8k", "lookup")], ran[("gsm8k", "ar")]
    assert lookup["speedup"] == pytest.approx(lookup["tokens_per_s"] / ar["tokens_per_s"])  # measured against ar
    capsys.readouterr()
    assert main(base + ["--methods", "llama-ar,lookup"]) == 2
    assert "llama-ar decodes greedily only" in capsys.readouterr().err

    class OnLlama:
        backend = "llamacpp"
    assert reference_method(OnLlama()) == "llama-ar" and reference_method(OnLlama(), greedy=False) == "ar"


@needs_llamacpp
def test_generate_batch_equals_llama_greedy_per_prompt():
    """Regeneration on llama.cpp: several sequences per decode, finished slots refilled, answers in
    prompt order and equal to each prompt decoded alone by llama-cpp-python's Llama."""
    from jetflow.eval.llama_reference import llama_greedy, open_llama
    from jetflow.models.loading import load_target

    target = load_target("smollm2-135m-instruct", backend="llamacpp", n_threads=2)
    questions = ["What is 7 times 8?", "Name a color.", "Write one sentence about the sea.", "Say hi.",
                 "What is the capital of France?"]
    prompts = [target.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False) for q in questions]
    answers = target.generate_batch(prompts, 24, slots=3)  # 5 prompts through 3 slots: refills happen
    llm = open_llama(target.gguf, n_threads=2)
    stops = target.stop_token_ids()
    for ids, answer in zip(prompts, answers):
        assert answer == llama_greedy(llm, ids, 24, stops)[0]
    assert all(a[-1] in stops for a in answers if len(a) < 24)  # a short answer ends on its stop token
    from jetflow.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        target.generate_batch([[]], 4)
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):  # not one token for a limit of 0
        target.generate_batch(prompts[:1], 0)


def test_amx_build_refused_with_a_clear_error(monkeypatch):
    """A llama.cpp build with AMX would die in ggml_backend_amx_mul_mat: refused unless overridden."""
    from jetflow.models.llamacpp_target import LlamaCppError, check_no_amx

    amx = "CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 |"
    monkeypatch.delenv("JETFLOW_ALLOW_LLAMA_AMX", raising=False)
    with pytest.raises(LlamaCppError, match="AMX.*20824"):
        check_no_amx(amx)
    check_no_amx(amx.replace("AMX_INT8 = 1", "AMX_INT8 = 0"))
    check_no_amx("CPU : AVX2 = 1 | OPENMP = 1 |")
    monkeypatch.setenv("JETFLOW_ALLOW_LLAMA_AMX", "1")
    check_no_amx(amx)



def test_the_default_thread_count_is_the_cpus_this_process_may_use(monkeypatch):
    """Under taskset or a container's cpuset, not the host's count: llama.cpp's threads beyond the
    CPUs given spin-wait on each other."""
    import os

    from jetflow.utils.cpus import usable_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cpus() == 2
    monkeypatch.delattr(os, "sched_getaffinity")
    assert usable_cpus() == 64
