"""Tiny randomly initialised targets (several architectures) and a byte-level tokenizer for fast tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens + 3 specials, no merges: every string round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


ARCHS = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    # Gemma 3 with a 4-token sliding window on alternating layers, so local attention is exercised.
    "gemma3": dict(model_type="gemma3_text", head_dim=16, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"] * 2),
    # Mistral: a window and no layer types, so every layer is local (here 4 tokens).
    "mistral": dict(model_type="mistral", sliding_window=4),
}


def tiny_model(arch: str = "llama", vocab_size: int = 272, seed: int = 0):
    from transformers import AutoConfig

    spec = dict(ARCHS[arch])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=257 if vocab_size > 257 else None, bos_token_id=256 if vocab_size > 256 else None,
        pad_token_id=257 if vocab_size > 257 else None, tie_word_embeddings=True, **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    # Larger random weights than the init default so logits are far from uniform and argmax is stable.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    return model.eval()


class OracleDrafter:
    """A test drafter that knows the target: depth d gets the target's own logits along its greedy
    continuation of the committed tokens (teacher forcing), so whole rounds get accepted. Up to
    ``good_depth``; deeper depths get random logits. Same interface as BlockDrafter."""

    def __init__(self, target, block_size: int = 8, good_depth: int = 99, seed: int = 0, sharpen: float = 1.0):
        self.target, self.block_size, self.good_depth, self.sharpen = target, block_size, good_depth, sharpen
        self.gen = torch.Generator().manual_seed(seed)
        self.known = {}  # committed tokens -> the target's next-token logits (the statistical tests ask often)

    def reset(self):
        pass

    def extend(self, features):
        pass

    @torch.no_grad()
    def observe(self, tree, path):
        pass

    def propose(self, anchor, position, room, width, max_nodes=None):
        from jetflow.decoding.block_drafter import BlockProposal

        return BlockProposal(self.depth_logprobs(anchor, position)[:room], anchor, width)

    def depth_logprobs(self, anchor, position):
        assert position == len(self.target.token_ids)
        seq = list(self.target.token_ids) + [anchor]
        rows = []
        for d in range(self.block_size - 1):
            if d >= self.good_depth:  # random, so no target forward
                logits = torch.randn(self.target.model.config.vocab_size, generator=self.gen) * 3
            else:
                if (key := tuple(seq)) not in self.known:
                    self.known[key] = self.target.model(torch.tensor([seq])).logits[0, -1].float()
                logits = self.known[key]
            rows.append((logits * self.sharpen).log_softmax(-1))
            seq.append(int(rows[-1].argmax()))
        return torch.stack(rows)


def peaked_tiny_target(tokenizer, tapped_layers=(1, 2)):
    """A tiny Llama target with no EOS and a sharpened final norm (confident next-token
    distributions, so drafts and agreement are not all near-ties)."""
    import torch

    from jetflow.models.target import TargetModel

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.model.norm.weight.mul_(4)
    return TargetModel(model, tokenizer, name="tiny", tapped_layers=list(tapped_layers))


def lossless_tau(jf, seqs, indices, max_new_tokens: int = 30) -> float:
    """Greedy speculative decoding of the prompts of ``seqs[i]`` for i in ``indices``: every output
    must equal autoregressive decoding; returns the mean accepted tokens per round."""
    import jetflow

    lengths = []
    for index in indices:
        prompt = seqs[index].token_ids[: seqs[index].prompt_len]
        spec = jf.generate(prompt, max_new_tokens=max_new_tokens)
        assert spec.token_ids == jetflow.generate(jf.target, prompt, max_new_tokens=max_new_tokens).token_ids
        lengths += spec.stats["accept_lengths"]
    return sum(lengths) / len(lengths)


def walk_prefix_cache(batch, converse, prompts, new_token, check_next_turn) -> None:
    """The batching prefix cache's choices, the same on both backends (a cache of two entries):
    conversations go in as they finish, a next turn that starts with a cached conversation prefills
    only its new tokens (``check_next_turn(tokens, out)`` compares its rows with a fresh prefill's)
    and replaces the entry it extends, the least recently used entry goes when the cache is full,
    and a prompt too short ever to be offered evicts nothing. ``converse(prompt, steps)`` joins,
    commits ``steps`` rounds, remembers and leaves, returning the tokens; ``new_token()`` draws one."""
    from jetflow.models.prefix_cache import MIN_SHARED

    def held():
        return [e.token_ids for e in batch._cached.entries]

    first = converse(prompts[0], 4)  # the system block is cached with it: the next ones reuse it
    second = converse(prompts[1], 3)
    assert held() == [first, second]  # the second extended nothing
    assert batch.prefix_tokens_reused > MIN_SHARED  # the second prompt's system block
    reused = batch.prefix_tokens_reused
    follow_up = first + [new_token() for _ in range(MIN_SHARED)]
    sid, out = batch.join(follow_up)  # the first conversation's next turn: only the new tokens are prefilled
    assert batch.prefix_tokens_reused - reused == len(first) == batch.cached_prompt_tokens(sid)
    check_next_turn(follow_up, out)
    batch.remember(sid)  # it extends the first conversation's entry, which makes room
    batch.leave(sid)
    assert held() == [second, follow_up]
    third = converse(prompts[2], 2)  # the cache is full: the least recently used (second) goes
    assert held() == [follow_up, third]
    short = converse([new_token() for _ in range(MIN_SHARED - 3)], 1)  # could never be offered:
    assert len(short) <= MIN_SHARED and held() == [follow_up, third]  # evicts none
