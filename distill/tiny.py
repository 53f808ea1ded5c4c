"""Tiny random models and an offline byte-level tokenizer, for tests and CI-sized runs.

Nothing here downloads. The tokenizer is byte-level (every string round-trips) with ChatML special
tokens and a chat template, so the same code paths as SmolLM2 (a Llama model with ChatML) run on it.

    from distill.tiny import tiny_tokenizer, tiny_model
    tok = tiny_tokenizer(); target = tiny_model(seed=0); draft = tiny_draft(target, noise=0.5)
"""
from __future__ import annotations

import copy

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0..2 are the special tokens, 3..258 the 256 bytes. No merges."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 printable stand-ins for bytes
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(byte_chars)})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
    )
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 512
    return tok


def tiny_config(vocab_size: int = 259, num_layers: int = 2, hidden: int = 64, **overrides) -> LlamaConfig:
    """A SmolLM2-shaped (Llama, tied embeddings) config at test size."""
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        # Larger than the usual 0.02 so a random model has peaked next-token distributions
        # (greedy and sampled outputs then differ between target and a perturbed draft in a
        # controlled way instead of all being near-uniform).
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_model(seed: int = 0, **config_overrides) -> LlamaForCausalLM:
    """A deterministic random tiny Llama in eval mode (same weights for the same seed, any process)."""
    cfg = tiny_config(**config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = cfg.pad_token_id
    return model.eval()


@torch.no_grad()
def tiny_draft(target: torch.nn.Module, noise: float = 0.5, seed: int = 1) -> torch.nn.Module:
    """A copy of ``target`` with Gaussian noise (relative scale ``noise``) added to every weight.

    noise=0 gives a draft equal to the target (α = 1); larger noise lowers acceptance smoothly,
    which is how tests force partial acceptance.
    """
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    for p in draft.parameters():
        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * p.detach().std() * noise)
    return draft.eval()
