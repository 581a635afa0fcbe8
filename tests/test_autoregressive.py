import pytest
import torch

import jetflow
from jetflow.decoding.prompt import encode_prompt
from jetflow.errors import InvalidRequestError
from jetflow.models.target import TargetModel
from tiny import tiny_model


@pytest.fixture(scope="module")
def tiny_target(tokenizer):
    return TargetModel(tiny_model("llama"), tokenizer, name="tiny", tapped_layers=[1])


def hf_greedy(model, prompt_ids, n):
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("prompt", [[1, 2, 3], list(range(40, 75))])
def test_greedy_equals_transformers_generate(tiny_target, prompt):
    ours = jetflow.generate(tiny_target, prompt, max_new_tokens=30)
    ref = hf_greedy(tiny_target.model, prompt, 30)
    n = len(ours.token_ids)  # may stop early on EOS
    assert ours.token_ids == ref[:n]
    assert n == 30 or ours.token_ids[-1] == tiny_target.tokenizer.eos_token_id


def test_stream_deltas_concatenate_to_text(tiny_target):
    events = list(jetflow.stream(tiny_target, "hello", max_new_tokens=25, temperature=0.9, seed=3))
    result = events[-1]
    assert isinstance(result, jetflow.GenerationResult)
    assert "".join(events[:-1]) == result.text
    again = jetflow.generate(tiny_target, "hello", max_new_tokens=25, temperature=0.9, seed=3)
    assert again.token_ids == result.token_ids  # same seed, same sample
    assert result.prompt_tokens == len(encode_prompt(tiny_target.tokenizer, "hello"))
    assert result.finish_reason in ("stop", "length") and result.seconds > 0


def test_context_end_finishes_with_length(tokenizer):
    target = TargetModel(tiny_model("llama"), tokenizer, tapped_layers=[0])
    target.max_context = 12
    result = jetflow.generate(target, list(range(60, 70)), max_new_tokens=50)
    assert result.finish_reason == "length" or result.token_ids[-1] == tokenizer.eos_token_id
    assert len(result.token_ids) <= 2  # prompt and answer within the context, as the server counts


def test_chat_template_and_raw_prompts(tokenizer):
    chat = encode_prompt(tokenizer, "hi")
    assert tokenizer.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(encode_prompt(tokenizer, "hi", chat=False)) == "hi"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tokenizer.decode(encode_prompt(tokenizer, msgs)).startswith("<|im_start|>system\ns")


@pytest.mark.parametrize("prompt, kwargs, message", [
    ("", {}, "empty prompt"), ("   ", {}, "empty prompt"), ([], {}, "empty"),
    ("x", dict(temperature=-1), "temperature"), ("x", dict(top_p=2), "top_p"),
    ("x", dict(max_new_tokens=0), "max_new_tokens"), ([99999], {}, "token ids"),
    ("x" * 600, dict(chat=False), "context"), ([{"role": "user"}], {}, "content"),
    ("x", dict(stop=5), "stop must be a string, a list of strings or None, got 5"),
    ("x", dict(stop=["a", 1]), "stop must be"), ("x", dict(chat="no"), "chat must be True, False or None"),
])
def test_bad_requests(tiny_target, prompt, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        jetflow.generate(tiny_target, prompt, **kwargs)
