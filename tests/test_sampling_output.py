import pytest
import torch

from jetflow.decoding.output import OutputStream
from jetflow.decoding.sampling import SamplingParams, next_token, target_probs
from jetflow.errors import InvalidRequestError


def brute_force_probs(logits, temperature, top_k, top_p):
    """Per-token loops: the textbook definition of temperature / top-k / top-p."""
    logits = logits.double() / temperature
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    keep = set(order[:top_k]) if top_k else set(order)
    probs = torch.softmax(torch.tensor([float(logits[i]) if i in keep else float("-inf") for i in range(len(logits))]), 0)
    nucleus, mass = set(), 0.0
    for i in order:  # most likely first, until the mass before this token reaches top_p
        if i in keep and mass < top_p:
            nucleus.add(i)
            mass += float(probs[i])
    out = torch.tensor([float(logits[i]) if i in nucleus else float("-inf") for i in range(len(logits))])
    return torch.softmax(out, 0)


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5), (1.0, 1, 1.0)])
def test_target_probs_match_brute_force(t, k, p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 3
    got = target_probs(logits, SamplingParams(t, k, p))
    torch.testing.assert_close(got, brute_force_probs(logits, t, k, p).float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 5e-324])
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(top_p):
    """Such a top_p rounds to 0 in float32: every token used to be dropped, and sampling fell back to the
    last vocabulary id. The nucleus is never empty: it holds the most likely token, as brute force says."""
    logits = torch.tensor([0.5, 3.0, 1.0, -2.0])
    got = target_probs(logits, SamplingParams(1.0, 0, top_p))
    assert got.tolist() == [0, 1, 0, 0] == brute_force_probs(logits, 1.0, 0, top_p).tolist()
    assert next_token(logits, SamplingParams(1.0, 0, top_p, seed=3), torch.Generator().manual_seed(3)) == 1


def test_greedy_is_argmax_and_sampling_is_seeded():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert next_token(logits, SamplingParams(), None) == 1
    assert target_probs(logits, SamplingParams()).tolist() == [0, 1, 0, 0]
    params = SamplingParams(temperature=1.0, seed=7)
    draws = lambda: [next_token(logits, params, g) for g in [params.make_generator()] for _ in range(20)]  # noqa: E731
    assert draws() == draws()
    assert len(set(draws())) > 1


def test_greedy_takes_the_first_maximum_as_torch_argmax_does():
    """The CPU fast path (numpy) picks what torch.argmax picks: ties, -inf, NaN, rows of a batch, other dtypes."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.tensor([1.0, 3.0, 3.0, 0.0]), torch.full((5,), float("-inf")),
            torch.tensor([0.0, float("nan"), 9.0, float("nan")]), torch.randint(0, 3, (49152,), generator=g).float(),
            torch.randn(3, 7, generator=g)[1], torch.tensor([0.5, 2.0, 2.0], dtype=torch.bfloat16)]
    for row in rows:
        assert next_token(row, SamplingParams(), None) == int(row.argmax()), row


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"), (dict(seed="x"), "seed"), (dict(seed=2 ** 64), "seed"),
    (dict(seed=-2 ** 63 - 1), "seed"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_seeds_span_torchs_range_and_tiny_temperatures_decode_greedily():
    for seed in (-2 ** 63, 2 ** 64 - 1):
        SamplingParams(temperature=1.0, seed=seed).make_generator()
    logits = torch.tensor([20.0, 19.0, -5.0])
    # float32 logits / 1e-40 overflow to inf and the softmax to NaN: such temperatures are greedy
    for t in (1e-40, 1e-46, 9e-6):
        params = SamplingParams(temperature=t)
        assert params.greedy and torch.equal(target_probs(logits, params), torch.tensor([1.0, 0.0, 0.0]))
        assert next_token(logits, params, params.make_generator()) == 0
    assert not SamplingParams(temperature=1e-5).greedy and not target_probs(logits, SamplingParams(1e-5)).isnan().any()


def test_unpaired_surrogates_are_refused_with_a_clear_error(tokenizer):
    from jetflow.decoding.prompt import encode_prompt

    with pytest.raises(InvalidRequestError, match="the prompt is not valid Unicode: an unpaired surrogate"):
        encode_prompt(tokenizer, "hi \ud83d", chat=False)
    with pytest.raises(InvalidRequestError, match="message 1's content is not valid Unicode"):
        encode_prompt(tokenizer, [{"role": "system", "content": "x"}, {"role": "user", "content": "hi \ud83d"}])
    with pytest.raises(InvalidRequestError, match="chat messages need chat=True .got chat=False."):
        encode_prompt(tokenizer, [{"role": "user", "content": "hi"}], chat=False)
    assert encode_prompt(tokenizer, "hi \U0001F600", chat=False)  # the pair itself is fine


def test_a_chat_template_that_refuses_the_messages_is_a_clear_error(tokenizer):
    """Templates raise on what their model has no place for (Gemma: a system message): the request
    is refused in the template's words, in a prompt and in a conversation alike."""
    import copy

    from jetflow.decoding.conversation import Conversation
    from jetflow.decoding.prompt import encode_prompt

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                            "supported') }}{% endif %}" + tokenizer.chat_template)
    assert encode_prompt(strict, "hi") == encode_prompt(tokenizer, "hi")
    with pytest.raises(InvalidRequestError, match="chat template refused these messages: System role not supported"):
        encode_prompt(strict, [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="System role not supported"):
        Conversation(strict, system="be brief").prompt("hi")


def stream_for(tokenizer, **kw):
    kw.setdefault("max_new_tokens", 100)
    return OutputStream(tokenizer, stop_token_ids=[tokenizer.eos_token_id], **kw)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_stream_text_eos_and_length(tokenizer):
    out = stream_for(tokenizer)
    for t in ids(tokenizer, "héllo wörld"):  # multi-byte characters arrive as several byte tokens
        out.add(t)
        assert "\ufffd" not in out.drain()
    assert out.text == "héllo wörld" and not out.finished
    assert out.add(tokenizer.eos_token_id) and out.finish_reason == "stop"
    assert out.text == "héllo wörld"
    short = stream_for(tokenizer, max_new_tokens=3)
    assert short.add_many(ids(tokenizer, "abcdef")) == 3
    assert short.finish_reason == "length" and short.text == "abc"


def test_stop_strings_are_cut_and_never_streamed(tokenizer):
    out = stream_for(tokenizer, stop_strings=["STOP", "\n\n"])
    streamed = ""
    consumed = 0
    for t in ids(tokenizer, "one two ST three STOP four"):
        consumed += 1
        done = out.add(t)
        streamed += out.drain()
        if done:
            break
    assert out.finish_reason == "stop"
    assert out.text == "one two ST three " and streamed == out.text
    assert consumed == len(ids(tokenizer, "one two ST three STOP"))


def test_bad_output_options(tokenizer):
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        stream_for(tokenizer, max_new_tokens=0)
    with pytest.raises(InvalidRequestError, match="stop strings"):
        stream_for(tokenizer, stop_strings=[""])


def test_fast_decode_equals_the_tokenizers_decode(tokenizer):
    from jetflow.decoding.output import _fast_decode

    fast = _fast_decode(tokenizer)
    assert fast != tokenizer.decode  # this fast tokenizer cleans up no spaces: the Rust decode is used
    rng = torch.Generator().manual_seed(0)
    for n in range(0, 12):
        ids = torch.randint(0, len(tokenizer), (n,), generator=rng).tolist()  # specials and partial UTF-8 too
        assert fast(ids) == tokenizer.decode(ids), ids
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert _fast_decode(tokenizer) == tokenizer.decode  # it would change the text: the wrapper decides
    finally:
        tokenizer.clean_up_tokenization_spaces = False
