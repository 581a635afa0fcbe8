"""Which part of a verified draft tree the target accepts.

One rule serves greedy and sampling: at the current node, take the target's next token exactly as
autoregressive decoding would (argmax, or one sample from the temperature/top-k/top-p distribution);
if a child of the node carries that token, move there and repeat; otherwise that token is the bonus
token. Every emitted token is then a token the target itself chose from its own distribution given
the same prefix, so the output distribution is the target's (lossless), and with a seed each
emitted token consumes one random draw, exactly like the autoregressive loop.
"""

from __future__ import annotations

import torch

from jetflow.decoding.sampling import SamplingParams, next_token
from jetflow.tree.build import DraftTree


def accept_path(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """Returns (accepted nodes from the root, root included; bonus token)."""
    path, node = [0], 0
    while True:
        token = next_token(logits[node], params, generator)
        child = tree.children[node].get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child
