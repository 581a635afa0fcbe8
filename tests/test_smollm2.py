"""Real-model checks on the default target, SmolLM2-135M-Instruct (converted once into the cache)."""

import json
import random
import subprocess
import sys
import time

import pytest
import torch

import jetflow
from jetflow.models.resolve import resolve_model
from jetflow.tree.mask import path_to_root

pytestmark = pytest.mark.real
PROMPTS = ["What is 12 * 7? Explain briefly.", "Write a haiku about the sea."]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_transformers_generate(smollm2, prompt):
    ours = jetflow.generate(smollm2, prompt, max_new_tokens=48)
    ids = jetflow.decoding.prompt.encode_prompt(smollm2.tokenizer, prompt)
    with torch.no_grad():
        ref = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
    assert ours.token_ids == ref
    assert ours.text == smollm2.tokenizer.decode(ref, skip_special_tokens=True)


def test_verify_and_commit_on_real_model(smollm2):
    rng = random.Random(0)
    prefix = jetflow.decoding.prompt.encode_prompt(smollm2.tokenizer, PROMPTS[0])
    parents = [-1] + [rng.randrange(0, i) for i in range(1, 12)]
    tokens = [rng.randrange(smollm2.vocab_size) for _ in parents]
    smollm2.prefill(prefix)
    out = smollm2.verify(tokens, parents)
    for node in (0, 5, 11):
        path = prefix + [tokens[j] for j in path_to_root(parents, node)]
        with torch.no_grad():
            ref = smollm2.model(torch.tensor([path])).logits[0, -1]
        torch.testing.assert_close(out.logits[node], ref, atol=2e-3, rtol=1e-4)
    accepted = path_to_root(parents, 11)
    smollm2.commit(accepted)
    cont = smollm2.extend([42, 43])
    seq = prefix + [tokens[j] for j in accepted] + [42, 43]
    with torch.no_grad():
        ref = smollm2.model(torch.tensor([seq])).logits[0, -2:]
    torch.testing.assert_close(cont.logits, ref, atol=2e-3, rtol=1e-4)


def test_cache_reuse_is_fast(smollm2):
    t = time.perf_counter()
    resolved = resolve_model("smollm2-135m-instruct")
    assert time.perf_counter() - t < 5  # a digest of the GGUF, no conversion
    assert (resolved.path / "model.safetensors").is_file()
    assert "<|im_start|>" in (resolved.path / "chat_template.jinja").read_text()


def test_cli_generate_json_on_default_model():
    proc = subprocess.run([sys.executable, "-m", "jetflow.cli", "generate", "What is 2+2?", "--json",
                           "--max-new-tokens", "16"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["target"] == "smollm2-135m-instruct" and out["new_tokens"] > 0 and out["tokens_per_s"] > 0


@pytest.fixture(scope="module")
def smollm2_random_jetflow(smollm2):
    from jetflow.models.draft_head import DraftHead, DraftHeadConfig

    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(smollm2, num_hidden_layers=1))
    return jetflow.JetFlow(smollm2, head)


@pytest.mark.parametrize("budget, width", [(1, 7), (8, 7), (64, 7), (256, 7), (16, 1)])
def test_speculative_greedy_equals_autoregressive(smollm2_random_jetflow, budget, width):
    ar = jetflow.generate(smollm2_random_jetflow.target, PROMPTS[0], max_new_tokens=16)
    spec = smollm2_random_jetflow.generate(PROMPTS[0], max_new_tokens=16, budget=budget, width=width)
    assert spec.token_ids == ar.token_ids


def test_speculative_long_rounds_hit_eos_mid_round(smollm2):
    """An oracle drafter (the target itself) gets long runs accepted; EOS lands inside a round."""
    from jetflow.decoding.api import prepare_request
    from jetflow.decoding.autoregressive import autoregressive_stream
    from jetflow.decoding.speculative import speculative_stream
    from tiny import OracleDrafter

    request = dict(max_new_tokens=64)
    ids, params, out = prepare_request(smollm2, "What is 2+2? Answer with one number.", **request)
    *_, ar = autoregressive_stream(smollm2, ids, params, out)
    assert ar.finish_reason == "stop"
    ids, params, out = prepare_request(smollm2, "What is 2+2? Answer with one number.", **request)
    *_, spec = speculative_stream(smollm2, OracleDrafter(smollm2, block_size=8), ids, params, out, 32, 3)
    assert spec.token_ids == ar.token_ids and spec.finish_reason == "stop"
    assert spec.stats["tau"] > 3


def test_shipped_drafter_is_the_default_lossless_and_accepts_several_tokens(smollm2):
    from jetflow.eval.datasets import load_eval_set
    from jetflow.models.shipped import shipped_drafter

    path = shipped_drafter("smollm2-135m-instruct")
    assert path is not None, "the SmolLM2 drafter must ship in jetflow/drafters/"
    jf = jetflow.JetFlow.from_pretrained(smollm2, "auto")
    assert jf.drafter_path == str(path) and jf.drafter.head.config.attention == "causal"
    accepted = rounds = 0
    for prompt in load_eval_set("gsm8k-test", 2):
        ar = jetflow.generate(smollm2, prompt.as_chat(), max_new_tokens=64)
        spec = jf.generate(prompt.as_chat(), max_new_tokens=64, budget=64)
        assert spec.token_ids == ar.token_ids
        accepted += sum(spec.stats["accept_lengths"])
        rounds += spec.stats["rounds"]
    assert accepted / rounds > 1.5  # a trained head; an untrained one gives ~1.0
