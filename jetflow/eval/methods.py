"""The decoding methods the benchmark compares, all on the same target runtime and prompts.

    ar             JetFlow's own autoregressive loop (the speed-up denominator)
    hf             plain transformers ``generate`` (what a user gets without JetFlow)
    pld            transformers prompt-lookup decoding (no drafter)
    dflash         bidirectional head, chain (width 1, one path of block_size - 1 drafts)
    ddtree         bidirectional head, best-first tree
    jetflow        causal head, best-first tree
    jetflow-chain  causal head, chain
    eagle3         EAGLE-3-style autoregressive head, dynamic tree (one head forward per depth)

Every method returns a :class:`GenerationResult` whose ``stats`` hold ``rounds`` (target forwards
after the prefill) and, for the drafters, ``accept_lengths`` per round (bonus token included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

import jetflow
from jetflow.decoding.api import prepare_request
from jetflow.decoding.result import GenerationResult
from jetflow.errors import JetFlowError
from jetflow.models.draft_head import DraftHead
from jetflow.models.target import TargetModel

PLD_TOKENS = 10  # prompt-lookup candidates per step (transformers' usual setting)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    head: str | None  # the head it needs: "causal" / "bidirectional" block head, "eagle3", or None
    tree: bool  # True: the --budgets sweep applies; False: one run


METHODS = {m.name: m for m in [
    MethodSpec("ar", None, False), MethodSpec("hf", None, False), MethodSpec("pld", None, False),
    MethodSpec("dflash", "bidirectional", False), MethodSpec("ddtree", "bidirectional", True),
    MethodSpec("jetflow", "causal", True), MethodSpec("jetflow-chain", "causal", False),
    MethodSpec("eagle3", "eagle3", True),
]}
HEAD_FLAGS = {"causal": "--drafter", "bidirectional": "--baseline-drafter", "eagle3": "--eagle-drafter"}


def parse_methods(text: str) -> list[MethodSpec]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise JetFlowError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(METHODS)}")
    if "ar" not in names:  # every speed-up and every equality check is against ar
        names.insert(0, "ar")
    return [METHODS[n] for n in dict.fromkeys(names)]


class MethodRunner:
    """Runs one method on one prompt. Heads are given per attention kind; a method whose head kind
    is missing, or has the wrong attention, is refused up front with the reason."""

    def __init__(self, target: TargetModel, heads: dict[str, DraftHead], width: int = 7):
        self.target, self.width = target, width
        self.decoders = {}
        for kind, head in heads.items():
            have = "eagle3" if head.config.kind == "eagle3" else head.config.attention
            if have != kind:
                raise JetFlowError(f"the {kind} methods need a {kind} head; the given one ({HEAD_FLAGS[kind]}) "
                                   f"is {have}")
            self.decoders[kind] = jetflow.JetFlow(target, head.to(device=target.device, dtype=target.dtype))

    def check(self, spec: MethodSpec) -> None:
        if spec.head is not None and spec.head not in self.decoders:
            raise JetFlowError(f"method {spec.name!r} needs a {spec.head} draft head: pass {HEAD_FLAGS[spec.head]}")

    def run(self, spec: MethodSpec, prompt, *, budget: int | None, max_new_tokens: int,
            temperature: float = 0.0, seed: int | None = None, chat: bool = True) -> GenerationResult:
        request = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, chat=chat)
        if spec.name == "ar":
            result = jetflow.generate(self.target, prompt, **request)
            result.stats = {"rounds": max(0, result.new_tokens - 1)}
            return result
        if spec.name in ("hf", "pld"):
            return self._hf_generate(prompt, spec.name, request)
        decoder = self.decoders[spec.head]
        self.target.set_tapped_layers(decoder.drafter.head.config.target_layer_ids)  # heads may read other layers
        if spec.tree:
            return decoder.generate(prompt, budget=budget, width=self.width, **request)
        return decoder.generate(prompt, budget=decoder.drafter.block_size - 1, width=1, **request)

    @torch.inference_mode()
    def _hf_generate(self, prompt, name: str, request: dict) -> GenerationResult:
        """transformers' own ``generate`` on the same model object and prompt ids; the target
        forwards are counted with a hook so prompt lookup gets a tau too."""
        prompt_ids, params, output = prepare_request(self.target, prompt, **request)
        model = self.target.model
        forwards = [0]
        handle = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        sample = params.temperature > 0
        stops = sorted(output.stop_token_ids)
        # A complete config, so none of the checkpoint's generation defaults (e.g. top_k=50) leak in.
        config = GenerationConfig(do_sample=sample, max_new_tokens=output.max_new_tokens, eos_token_id=stops or None,
                                  pad_token_id=stops[0] if stops else None, top_k=params.top_k if sample else None,
                                  top_p=params.top_p if sample else None,
                                  temperature=params.temperature if sample else None,
                                  prompt_lookup_num_tokens=PLD_TOKENS if name == "pld" else None)
        ids = torch.tensor([prompt_ids], device=self.target.device)
        if sample and params.seed is not None:
            torch.manual_seed(params.seed)
        t0 = time.perf_counter()
        try:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        finally:
            handle.remove()
        seconds = time.perf_counter() - t0
        output.add_many(out[0, ids.shape[1]:].tolist())
        result = GenerationResult.from_output(output, len(prompt_ids), seconds, 0.0, method=name)
        result.stats = {"rounds": max(0, forwards[0] - 1)}
        return result
