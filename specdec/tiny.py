"""Tiny random models and an offline byte-level tokenizer, for tests and CI-sized runs.

Nothing here downloads. The tokenizer is byte-level (every string round-trips) with ChatML special
tokens and a chat template, so the same code paths as SmolLM2 (a Llama model with ChatML) run on it.

    from specdec.tiny import tiny_tokenizer, tiny_model
    tok = tiny_tokenizer(); target = tiny_model(seed=0); draft = tiny_draft(target, noise=0.5)
    gemma = tiny_zoo_model("gemma2", num_layers=4)   # other families (ZOO), windows of 16 tokens
"""
from __future__ import annotations

import copy

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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


# Families a user would plausibly distill, by transformers model_type -> what their tiny config sets beyond
# the shared shape. Windows are 16 tokens, so a test sequence of 64+ tokens slides through them 4 times.
WINDOW = 16
ZOO: dict[str, dict] = {
    "llama": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 0 full, rest windowed
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, head_dim=16),
    # Gemma scales input embeddings by sqrt(hidden): with a tied head a random model echoes its input token.
    "gemma2": dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=16,
                   tie_word_embeddings=False),  # alternating windowed/full
    "gemma3_text": dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=16, tie_word_embeddings=False,
                        layer_types=None),  # set per layer count below: windowed, full, windowed, ...
    "mistral": dict(sliding_window=WINDOW, head_dim=16),  # every layer windowed
    "phi3": dict(sliding_window=WINDOW),  # every layer windowed
    "gpt_neox": dict(num_key_value_heads=None),  # no grouped KV heads in this family
}


def tiny_zoo_config(family: str, num_layers: int = 2, vocab_size: int = 259, hidden: int = 64, **overrides):
    """A test-size config of one architecture family (a key of ZOO), with the tiny tokenizer's ids."""
    if family not in ZOO:
        raise ValueError(f"unknown family {family!r}; pick one of {sorted(ZOO)}")
    kw = tiny_config(vocab_size, num_layers, hidden).to_dict()
    kw = {k: kw[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                             "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id",
                             "pad_token_id")}
    kw.update(ZOO[family])
    if family == "gemma3_text":
        kw["layer_types"] = ["full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)]
    kw.update(overrides)
    kw = {k: v for k, v in kw.items() if v is not None}
    return AutoConfig.for_model(family, **kw)


def tiny_zoo_model(family: str, seed: int = 0, num_layers: int = 2, **config_overrides) -> torch.nn.Module:
    """A deterministic random tiny causal LM of ``family`` (see ZOO) in eval mode."""
    cfg = tiny_zoo_config(family, num_layers, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
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
