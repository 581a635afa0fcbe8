"""What the decoder, the drafters, training and evaluation need from a target model.

Two runtimes implement it: :class:`jetflow.models.target.TargetModel` (transformers, any device)
and :class:`jetflow.models.llamacpp_target.LlamaCppTarget` (a GGUF file run by llama.cpp). Code
outside ``jetflow/models`` talks to a target only through this protocol, never to ``target.model``.

State: ``past_len`` tokens are committed. ``verify`` appends a tree of pending nodes after them;
``commit`` keeps one root-to-node path of those nodes and drops the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

BACKENDS = ("auto", "torch", "llamacpp")


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [N, vocab] float32
    hidden: torch.Tensor | None  # [N, len(tapped_layers) * hidden_size], tapped layers concatenated


@dataclass(frozen=True)
class TargetShape:
    """The architecture numbers a draft head is shaped after (see DraftHeadConfig.for_target)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    rope_theta: float


@runtime_checkable
class TargetBackend(Protocol):
    backend: str  # "torch" or "llamacpp"
    name: str
    tokenizer: object  # a transformers tokenizer (chat template, decode)
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_context: int
    tapped_layers: tuple[int, ...]
    past_len: int
    token_ids: list[int]
    reused_tokens: int  # prompt tokens the latest prefill took from the cache instead of computing

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def shape(self) -> TargetShape: ...

    def identity(self) -> dict: ...

    def stop_token_ids(self) -> set[int]: ...

    def set_tapped_layers(self, layer_ids: Sequence[int]) -> None: ...

    def reset(self) -> None: ...

    def prefill(self, prompt_ids, return_hidden: bool = True) -> TargetOutput: ...

    def verify(self, tokens, parents: Sequence[int], return_hidden: bool = True) -> TargetOutput: ...

    def commit(self, nodes: Sequence[int]) -> None: ...

    def extend(self, tokens, return_hidden: bool = False) -> TargetOutput: ...

    def tree_room(self) -> int | None:
        """How many tokens (root included) the next verify may hold: the free KV cells on a runtime
        where every tree node takes one until commit (llama.cpp), None where a tree only needs its
        depth to fit the context (torch)."""
        ...

    def greedy_step(self, token: int) -> int:
        """``extend([token])`` and the argmax of its logits (first maximum), no features: the plain
        greedy step, which a runtime may run without materializing the logits."""
        ...

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                       generator: torch.Generator | None = None) -> list[list[int]]:
        """Answers to a batch of prompts, outside the decoding state (regeneration)."""
        ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings of token ids [...] -> [..., H] (with any model-specific scaling)."""

    def lm_head_weight(self) -> torch.Tensor:
        """The output projection [V, H] the drafters share (frozen)."""


def chain_parents(n: int) -> list[int]:
    """Parents of a plain chain of n tokens: each node is the child of the one before it."""
    return list(range(-1, n - 1))


def check_path(nodes: Sequence[int], parents: Sequence[int]) -> list[int]:
    """Validate that ``nodes`` is a root-to-node path of the pending tree ``parents``."""
    nodes = [int(i) for i in nodes]
    for k, node in enumerate(nodes):
        if not 0 <= node < len(parents):
            raise ValueError(f"node {node} is not a pending tree node (tree has {len(parents)} nodes)")
        expected = nodes[k - 1] if k else -1
        if parents[node] != expected:
            raise ValueError(f"nodes {nodes} are not a root-to-node path: parent of {node} is {parents[node]}")
    return nodes


def check_same_taps(made_for: Sequence[int], target) -> None:
    """A batch of a target keeps features of the layers tapped when it was made (and a llama.cpp
    batch's context computes only those): JetFlowError if another drafter has tapped other layers
    of the target since, rather than features of the wrong layers, or none."""
    from jetflow.errors import JetFlowError

    now = tuple(target.tapped_layers)
    if now != tuple(made_for):
        raise JetFlowError(f"the target now taps layers {list(now)} (a drafter set them), but this batch was made "
                           f"for layers {list(made_for)}: make a new batch for that drafter")
