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
