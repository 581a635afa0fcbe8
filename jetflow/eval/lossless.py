"""Greedy JetFlow on llama.cpp against llama.cpp's own autoregressive output (llama-cpp-python's
``Llama`` API), prompt by prompt, with the logit margin of every difference.

Why differences can exist at all: llama.cpp keeps K/V in f16 and sums attention over KV *cells*.
A verified tree puts the accepted tokens' cells at other slots than one-token decoding does, so an
attention sum may round differently in its last bits. Where the target's top two logits are that
close, greedy decoding can pick the other token. The margin (top-1 minus the chosen token's logit
in the autoregressive reference, at the first differing position) tells whether a difference is
such a near-tie or a real bug (a bug shows margins of whole logits).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from jetflow.decoding.prompt import encode_prompt
from jetflow.eval.datasets import EvalPrompt
from jetflow.eval.llama_reference import llama_greedy


@dataclass
class LosslessRecord:
    dataset: str
    id: str
    new_tokens: int
    identical: bool
    first_diff: int | None = None  # index into the generated tokens
    reference_token: int | None = None
    jetflow_token: int | None = None
    margin: float | None = None  # reference logit(top-1) - logit(JetFlow's token) at first_diff
    tau: float | None = None


def reference_margin(target, prompt_ids: list[int], reference: list[int], index: int, other: int) -> float:
    """Logit gap between the reference token and ``other`` after prompt + reference[:index], decoded
    one token at a time on ``target`` (the kernels the reference used)."""
    logits = target.prefill(prompt_ids, return_hidden=False).logits[-1]
    for token in reference[:index]:
        logits = target.extend([token]).logits[-1]
    return float(logits[reference[index]] - logits[other])


def check_prompt(jf, llm, prompt: EvalPrompt, max_new_tokens: int, budget) -> LosslessRecord:
    target = jf.target
    request = prompt.request([])
    ids = encode_prompt(target.tokenizer, request) if prompt.chat else list(target.tokenizer(request)["input_ids"])
    ours = jf.generate(ids, max_new_tokens=max_new_tokens, budget=budget)
    ref, _, _ = llama_greedy(llm, ids, max_new_tokens, target.stop_token_ids())
    rec = LosslessRecord(prompt.dataset, prompt.id, len(ref), ours.token_ids == ref, tau=ours.stats.get("tau"))
    if not rec.identical:
        n = min(len(ref), len(ours.token_ids))
        first = next((i for i in range(n) if ref[i] != ours.token_ids[i]), n)
        rec.first_diff = first
        if first < n:
            rec.reference_token, rec.jetflow_token = ref[first], ours.token_ids[first]
            with torch.inference_mode():
                rec.margin = reference_margin(target, ids, ref, first, ours.token_ids[first])
    return rec


def summarize(records: list[LosslessRecord]) -> dict:
    diffs = [r for r in records if not r.identical]
    return {"prompts": len(records), "identical": len(records) - len(diffs),
            "differences": [asdict(r) for r in diffs],
            "max_margin": max((abs(r.margin) for r in diffs if r.margin is not None), default=None)}
