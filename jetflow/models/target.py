"""The frozen target LLM as the speculative decoder drives it: prefill, tree verify, commit.

Built on transformers model classes (Llama, Qwen2/Qwen3, Gemma 3 text, ...) with a KV cache that appends in
place (``PreallocatedCache``, a ``DynamicCache`` without the per-step copy): transformers accepts a ready 4D additive mask plus explicit ``position_ids``, which is all a tree
verification needs, and the cache's per-layer key/value tensors can be compacted in place to keep
only the accepted path. Hidden states of the tapped layers are read with forward hooks on the
decoder layers, so the model never materialises all of its hidden states.

State: ``past_len`` tokens are committed in the cache. ``verify`` appends a tree of pending nodes
after them; ``commit`` keeps one root-to-node path of those nodes and drops the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from jetflow.decoding.prompt import stop_token_ids
from jetflow.decoding.sampling import MIN_TEMPERATURE
from jetflow.errors import InvalidRequestError, ModelResolutionError, check_max_new_tokens, first_line
from jetflow.models.backend import TargetOutput, TargetShape, chain_parents, check_path
from jetflow.models.few_row_linear import use_few_row_linear
from jetflow.models.gqa_attention import use_packed_gqa
from jetflow.models.identity import weights_fingerprint
from jetflow.models.kv_cache import PreallocatedCache
from jetflow.models.prefix_cache import CommittedFeatures, shared_prefix_length
from jetflow.models.resolve import ResolvedModel, resolve_model
from jetflow.tree.mask import check_parents, is_chain, tree_attention_mask, tree_depths


def default_tapped_layers(num_layers: int, count: int = 5) -> list[int]:
    """``count`` decoder layers spread evenly from layer 1 to layer num_layers-3 (DFlash's choice).

    The last layers are skipped: their states are nearly the next-token logits already, while the
    draft head profits from low/mid-level features too.
    """
    if num_layers <= 3 or count >= num_layers:
        return list(range(min(count, num_layers)))
    start, end = 1, num_layers - 3
    if count == 1:
        return [(start + end) // 2]
    return [round(start + i * (end - start) / (count - 1)) for i in range(count)]


class TargetModel:
    """The transformers implementation of :class:`jetflow.models.backend.TargetBackend`."""

    backend = "torch"

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        name: str = "target",
        tapped_layers: Sequence[int] | None = None,
        prefill_chunk: int = 1024,
    ):
        self.model = model.eval().requires_grad_(False)
        self.weights: str | None = None  # names the weights when loaded from a path (models/identity.py)
        use_packed_gqa(self.model)  # tree and batched verifies without copying the cache per layer
        self.linear_form = use_few_row_linear(self.model)  # few-row products as W @ x^T where faster
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config.get_text_config(decoder=True)
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        self.max_context = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)
        self.prefill_chunk = prefill_chunk
        # A prefill keeps the cache of the prefix it shares with the committed tokens (jetflow bench
        # turns it off: every method prefills every prompt in full).
        self.prefix_cache = True
        self.features = CommittedFeatures()  # of the committed tokens, for such a prefill that wants features
        self._captured: dict[int, torch.Tensor] = {}
        self._capture = False
        self._hook_handles: list = []
        self.set_tapped_layers(default_tapped_layers(self.num_layers) if tapped_layers is None else tapped_layers)
        # Local-attention layers (Gemma 3, Qwen2 with sliding windows) need their own mask; a model
        # with a window and no layer types (Mistral, Mixtral, Phi-3, Starcoder2) applies it to every
        # layer (``_mask_kinds`` empty: one windowed mask for all). A tree verified without the window
        # would see keys its one-token steps do not: not lossless past the window.
        layer_types = getattr(self.config, "layer_types", None) or []
        window = getattr(self.config, "sliding_window", None)
        if layer_types:
            self._sliding_window = window if window and "sliding_attention" in layer_types else None
        else:
            self._sliding_window = window if window and getattr(self.config, "use_sliding_window", True) else None
        self._mask_kinds = sorted(set(layer_types)) if self._sliding_window else []
        self.reset()

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(
        cls,
        spec: str | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        tapped_layers: Sequence[int] | None = None,
        attn_implementation: str = "sdpa",
    ) -> "TargetModel":
        """Load a target from any spec :func:`resolve_model` accepts."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        resolved = spec if isinstance(spec, ResolvedModel) else resolve_model(spec)
        try:
            tokenizer = AutoTokenizer.from_pretrained(resolved.path)
        except (OSError, ValueError, TypeError) as e:  # no tokenizer files, an unknown tokenizer class
            raise ModelResolutionError(f"{resolved.name}: no usable tokenizer in {resolved.path} "
                                       f"({type(e).__name__}: {first_line(e)})") from None
        try:
            model = AutoModelForCausalLM.from_pretrained(
                resolved.path, dtype=dtype, attn_implementation=attn_implementation
            ).to(device)
        except Exception as e:  # not a causal LM, weights missing or cut short (safetensors, shape, ... errors)
            weights = sorted(p.name for p in Path(resolved.path).glob("*.safetensors"))
            hint = "" if weights or resolved.source != "hub" else \
                " (the hub repository has no *.safetensors weights, the only format JetFlow downloads)"
            raise ModelResolutionError(f"{resolved.name}: transformers could not load a causal language model "
                                       f"from {resolved.path}{hint} ({type(e).__name__}: {first_line(e)})") from None
        try:
            target = cls(model, tokenizer, name=resolved.name, tapped_layers=tapped_layers)
        except AttributeError as e:  # e.g. BERT's causal-LM head: no decoder layers to tap, no KV cache of ours
            raise ModelResolutionError(f"{resolved.name}: {model.config.model_type} models are not supported; JetFlow "
                                       f"needs a decoder-only model with decoder layers (Llama, Qwen, Mistral, ...) "
                                       f"({first_line(e)})") from None
        target.weights = weights_fingerprint(resolved.path)
        return target

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def identity(self) -> dict:
        """What a drafter checkpoint records to refuse loading against a different target."""
        return {
            "name": self.name,
            "model_type": self.config.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "backend": self.backend,
            "dtype": str(self.dtype).removeprefix("torch."),
            **({"weights": self.weights} if self.weights else {}),
        }

    def shape(self) -> TargetShape:
        c = self.config
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        return TargetShape(
            model_type=c.model_type, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab_size=c.vocab_size,
            num_hidden_layers=self.num_layers, rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))))

    def stop_token_ids(self) -> set[int]:
        return stop_token_ids(self.tokenizer, self.model.generation_config)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids.to(self.device))

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        self.cache = PreallocatedCache()
        self.past_len = 0  # committed tokens in the cache
        self.token_ids: list[int] = []  # the committed tokens themselves
        self.reused_tokens = 0  # prompt tokens the latest prefill took from the cache
        self.features.clear()
        self._reusable = True  # whether the committed tokens' cache may serve the next prefill
        self._pending_tokens: list[int] = []
        self._pending_parents: list[int] = []  # tree appended by the last verify, not yet committed
        self._pending_hidden: torch.Tensor | None = None  # its features, the accepted path's kept at commit

    @torch.inference_mode()
    def start_from(self, token_ids: Sequence[int], kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   features: torch.Tensor | None = None) -> None:
        """Hold ``token_ids`` as committed, with each layer's keys and values ``kv`` [heads, n, head_dim]
        (kept from an earlier sequence: the batching server's prefix cache) and their ``features``
        (None: none kept), so that the next prefill can start from them."""
        self.reset()
        for i, (k, v) in enumerate(kv):
            self.cache.update(k[None], v[None], i)
        self.past_len, self.token_ids = len(token_ids), [int(t) for t in token_ids]
        self.features.add(0, features)

    def set_tapped_layers(self, layer_ids: Sequence[int]) -> None:
        """Choose the decoder layers (0-based) whose outputs ``prefill``/``verify`` return (several
        heads may share one target: each sets its own layers before it drafts)."""
        taps = [int(t) for t in layer_ids]
        if getattr(self, "tapped_layers", None) == tuple(taps):
            return
        if not taps or any(not 0 <= t < self.num_layers for t in taps):
            raise ValueError(f"tapped layers {taps} must be non-empty ids in [0, {self.num_layers})")
        for handle in self._hook_handles:
            handle.remove()
        layers = self.model.get_decoder().layers
        self._hook_handles = [layers[t].register_forward_hook(self._make_hook(t)) for t in sorted(set(taps))]
        self.tapped_layers = tuple(taps)
        self.features.clear()  # other layers' features

    def _make_hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            if self._capture:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    # ------------------------------------------------------------------ forwards
    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int] | torch.Tensor, return_hidden: bool = True) -> TargetOutput:
        """Start a new sequence with ``prompt_ids``: the last position's logits ([1, V]) and the tapped
        hidden states of every prompt position ([T, taps*H]). With ``prefix_cache`` on, the cache of
        the longest prefix it shares with the committed tokens is kept (a chat's next turn, a shared
        system prompt) and only the rest is computed (``reused_tokens``); with ``return_hidden``, only
        as much of it as the features kept of the committed tokens cover (``features``), which are
        handed back for it. Those keys, values and features came from the forwards that committed
        the tokens (verifies of trees), so the logits equal a fresh prefill's up to float rounding,
        as a verify's rows equal one-token steps'."""
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().to(self.device)
        if ids.numel() == 0:
            raise InvalidRequestError("empty prompt: nothing to prefill")
        if ids.numel() >= self.max_context:
            raise InvalidRequestError(
                f"prompt has {ids.numel()} tokens; the model's context is {self.max_context} tokens"
            )
        keep = 0
        if self.prefix_cache and self._reusable:
            self._drop_pending()
            keep = shared_prefix_length(self.token_ids, ids.cpu().numpy(), min(self.past_len, ids.numel() - 1))
            if return_hidden:
                keep = min(keep, self.features.length)
        if keep:
            for layer in self.cache.layers:  # (a slice of the preallocated buffer: no copy)
                layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]
            self.past_len, self.token_ids = keep, self.token_ids[:keep]
            self.features.truncate(keep)
        else:
            self.reset()
        self._reusable = self.prefix_cache  # a request made with the cache off leaves nothing to reuse
        self.reused_tokens = keep
        hidden, logits = [self.features.rows(keep)] if return_hidden and keep else [], None
        try:
            for start in range(keep, ids.numel(), self.prefill_chunk):
                chunk = ids[start : start + self.prefill_chunk]
                out = self._forward(chunk, parents=None, last_logits_only=True, return_hidden=return_hidden)
                if self.prefix_cache:  # (kept only for the cache: on a big GPU model they are a fifth of the KV)
                    self.features.add(self.past_len, out.hidden)
                self._pending_tokens = chunk.tolist()
                self._commit_chain(chunk.numel())
                logits = out.logits
                if out.hidden is not None:
                    hidden.append(out.hidden)
        except BaseException:  # (an interrupt too) the cache and the bookkeeping could disagree: start clean
            self.reset()
            raise
        return TargetOutput(logits, torch.cat(hidden) if hidden else None)

    @torch.inference_mode()
    def verify(
        self,
        tokens: Sequence[int] | torch.Tensor,
        parents: Sequence[int],
        return_hidden: bool = True,
    ) -> TargetOutput:
        """One forward over a token tree appended to the committed prefix.

        ``parents[i]`` is the parent node of node i (-1: child of the prefix). Node i attends to the
        prefix, its ancestors and itself, at position past_len + depth(i). Returns logits [N, V] and
        tapped hidden states [N, taps*H] for every node. The nodes stay pending until ``commit``.
        """
        ids = torch.as_tensor(tokens, dtype=torch.long).flatten().to(self.device)
        parents = [int(p) for p in parents]
        if ids.numel() == 0 or ids.numel() != len(parents):
            raise ValueError(f"need one parent per token and at least one token (got {ids.numel()} and {len(parents)})")
        check_parents(parents)
        self._drop_pending()
        if self.past_len + max(tree_depths(parents)) + 1 > self.max_context:
            raise InvalidRequestError(f"tree would extend past the model's context of {self.max_context} tokens")
        try:
            out = self._forward(ids, parents, last_logits_only=False, return_hidden=return_hidden)
        except BaseException:  # (out of memory at some layer): keys/values appended by the layers before go
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.shape[-2] > self.past_len:
                    layer.keys = layer.keys[..., :self.past_len, :]
                    layer.values = layer.values[..., :self.past_len, :]
            raise
        self._pending_parents = parents
        self._pending_tokens = ids.tolist()
        self._pending_hidden = out.hidden
        return out

    @torch.inference_mode()
    def features_and_hidden(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training-time forward without the cache over a batch ``ids`` [B, T] (right-padded rows are
        fine: attention is causal, so real positions never see the padding). Returns the tapped
        hidden states [B, T, taps*H] and the final (normed) hidden states [B, T, H]; apply
        :meth:`logits` to the positions that need them (the LM head is the costly part)."""
        self._capture = True
        self._captured.clear()
        try:
            out = self.model.get_decoder()(input_ids=ids.to(self.device), use_cache=False)
        finally:
            self._capture = False
        taps = torch.cat([self._captured[t] for t in self.tapped_layers], dim=-1)
        self._captured.clear()
        return taps, out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head as float32, with what the model's own forward applies after it: a
        division by ``logits_scaling`` (Granite), a factor ``logit_scale`` (Cohere), soft-capping
        (Gemma 2). Teachers read their distributions here: without it a Granite teacher's would be
        those of logits 8x too large."""
        head = self.model.get_output_embeddings()
        logits = head(hidden.to(head.weight.dtype)).float()
        if divide := getattr(self.config, "logits_scaling", None):
            logits = logits / divide
        if factor := getattr(self.config, "logit_scale", None):
            logits = logits * factor
        cap = getattr(self.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.inference_mode()
    def features_and_logits(self, ids: Sequence[int] | torch.Tensor, logit_positions: torch.Tensor):
        """One sequence: tapped hidden states of every position [T, taps*H] and the logits at
        ``logit_positions`` only [P, V]."""
        features, logits = self.features_and_logits_many([ids], [logit_positions])
        return features[0], logits

    @torch.inference_mode()
    def features_and_logits_many(self, ids: list[Sequence[int] | torch.Tensor], logit_positions: list[torch.Tensor]):
        """Several sequences in one right-padded forward (one pass over the weights instead of one
        per sequence: on a GPU a 135M target's per-sequence forward is bound by kernel launches):
        the tapped hidden states of each [T_i, taps*H] and the logits at each one's
        ``logit_positions``, concatenated in order [sum P_i, V]."""
        rows = [torch.as_tensor(x, dtype=torch.long).flatten() for x in ids]
        batch = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
        for i, r in enumerate(rows):
            batch[i, :len(r)] = r
        taps, hidden = self.features_and_hidden(batch)
        which = torch.cat([torch.full((len(p),), i) for i, p in enumerate(logit_positions)]).to(self.device)
        where = torch.cat([p.flatten().long().cpu() for p in logit_positions]).to(self.device)
        return [taps[i, :len(r)] for i, r in enumerate(rows)], self.logits(hidden[which, where])

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                       generator: torch.Generator | None = None) -> list[list[int]]:
        """Answers (token ids, the stop token included when produced) for a batch of prompt ids,
        without the decoder's cache (regeneration of training data). Prompts are left-padded; rows
        that finish are dropped from the batch and its cache, so the batch only pays for live rows."""
        check_max_new_tokens(max_new_tokens)
        if not prompts:
            return []
        model, device = self.model, self.device
        eos = sorted(self.stop_token_ids())
        pad = eos[0] if eos else 0
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = PreallocatedCache(capacity=width + max_new_tokens)
        rows = list(range(len(prompts)))  # original index of each live batch row
        answers: list[list[int]] = [[] for _ in prompts]
        eos_t = torch.tensor(eos, device=device)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                       logits_to_keep=1).logits[:, -1]
        for step in range(max_new_tokens):
            if temperature >= MIN_TEMPERATURE:  # below it greedy, as every decoder (dividing by it overflows)
                nxt = torch.multinomial((logits.float() / temperature).softmax(-1), 1, generator=generator)[:, 0]
            else:
                nxt = logits.argmax(-1)
            done = torch.isin(nxt, eos_t) | (step + 1 == max_new_tokens)
            for r, t in zip(rows, nxt.tolist()):
                answers[r].append(t)
            if bool(done.all()):
                break
            keep = (~done).nonzero().flatten()
            if keep.numel() < len(rows):  # drop finished rows from the batch and the cache
                rows = [rows[i] for i in keep.tolist()]
                nxt, mask, positions = nxt[keep], mask[keep], positions[keep]
                cache.select_rows(keep)
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            positions = positions[:, -1:] + 1
            logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions,
                           cache=cache).logits[:, -1]
        return answers

    def _forward(self, ids: torch.Tensor, parents: list[int] | None, last_logits_only: bool, return_hidden: bool):
        n = ids.numel()
        if parents is None or is_chain(parents):
            # A plain continuation: transformers builds the causal mask itself (cheaper).
            positions = torch.arange(self.past_len, self.past_len + n, device=self.device)
            mask = None
        else:
            positions = self.past_len + torch.tensor(tree_depths(parents), device=self.device)
            mask = self._tree_mask(parents)
        self._capture = return_hidden
        self._captured.clear()
        try:
            out = self.model(
                input_ids=ids[None],
                position_ids=positions[None],
                attention_mask=mask,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=1 if last_logits_only else 0,
            )
        finally:
            self._capture = False
        hidden = None
        if return_hidden:
            hidden = torch.cat([self._captured[t][0] for t in self.tapped_layers], dim=-1)
            self._captured.clear()
        return TargetOutput(out.logits[0].float(), hidden)

    def _tree_mask(self, parents: list[int]):
        if not self._sliding_window:
            return tree_attention_mask(parents, self.past_len, self.dtype, self.device)
        local = tree_attention_mask(parents, self.past_len, self.dtype, self.device, sliding_window=self._sliding_window)
        if not self._mask_kinds:  # every layer local
            return local
        masks = {"full_attention": tree_attention_mask(parents, self.past_len, self.dtype, self.device),
                 "sliding_attention": local}
        return {kind: masks[kind] for kind in self._mask_kinds}

    # ------------------------------------------------------------------ cache bookkeeping
    @torch.inference_mode()
    def commit(self, nodes: Sequence[int]) -> None:
        """Keep the pending nodes ``nodes`` (a root-to-node path, in order) and drop the rest.

        Afterwards the cache is exactly what a plain causal forward over the accepted tokens gives.
        """
        parents = self._pending_parents
        nodes = check_path(nodes, parents)
        keep = len(nodes)
        self._pending_tokens = [self._pending_tokens[i] for i in nodes]
        if self._pending_hidden is not None and keep and self.prefix_cache and self.features.follows(self.past_len):
            self.features.add(self.past_len, self._pending_hidden[nodes])
        if nodes != list(range(keep)):
            index = torch.tensor(nodes, device=self.device) + self.past_len
            for layer in self.cache.layers:
                # Move the accepted entries right behind the prefix; the tail is cut off below.
                layer.keys[..., self.past_len : self.past_len + keep, :] = layer.keys.index_select(-2, index)
                layer.values[..., self.past_len : self.past_len + keep, :] = layer.values.index_select(-2, index)
        self._commit_chain(keep, total_appended=len(parents))

    def _commit_chain(self, keep: int, total_appended: int | None = None) -> None:
        """Accept the first ``keep`` appended entries; cut the remaining appended ones."""
        new_len = self.past_len + keep
        self.token_ids += self._pending_tokens[:keep]
        self._pending_tokens = []
        if total_appended is not None and total_appended != keep:
            for layer in self.cache.layers:
                layer.keys = layer.keys[..., :new_len, :]
                layer.values = layer.values[..., :new_len, :]
        self.past_len = new_len
        self._pending_parents, self._pending_hidden = [], None

    def _drop_pending(self) -> None:
        if self._pending_parents:
            self._commit_chain(0, total_appended=len(self._pending_parents))

    def extend(self, tokens: Sequence[int] | torch.Tensor, return_hidden: bool = False) -> TargetOutput:
        """Append committed tokens (a chain) and return the logits of each."""
        ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
        out = self.verify(ids, chain_parents(ids.numel()), return_hidden=return_hidden)
        self.commit(range(ids.numel()))
        return out

    def tree_room(self) -> None:
        return None  # the cache grows; only the deepest node's position must fit (checked in verify)

    def greedy_step(self, token: int) -> int:
        """Commit ``token`` and return the target's greedy next token (the first maximum, as
        ``decoding.sampling.next_token``)."""
        return int(self.extend([token]).logits[-1].argmax())
