"""Model loading: embedded GGUF conversion, draft initialisation, tokenizer compatibility."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill.config import ConfigError, ModelConfig
from distill.models import (
    TokenizerMismatch,
    check_tokenizers,
    convert_gguf,
    draft_from_target,
    embedded_gguf_path,
    load_draft,
    load_target,
    mask_padded_vocab,
    shared_vocab_size,
    tokenizer_fingerprint,
)
from specdec.tiny import tiny_model, tiny_tokenizer


@pytest.fixture
def tiny_cfg(tmp_path):
    return ModelConfig(target="tiny", cache_dir=str(tmp_path / "cache"), draft_layers=[1])


def test_tiny_target_materialises_and_reloads(tiny_cfg):
    target, tok = load_target(tiny_cfg)
    again, _ = load_target(tiny_cfg)
    ids = torch.tensor([tok.encode("hello world")])
    assert torch.equal(target(ids).logits, again(ids).logits)
    assert target.config.num_hidden_layers == 2 and len(tok) == 259


def test_draft_from_target_copies_chosen_layers(tiny_cfg):
    target, tok = load_target(tiny_cfg)
    draft = load_draft(tiny_cfg, target, tok)
    assert draft.config.num_hidden_layers == 1
    t_layer = target.model.layers[1].state_dict()
    for k, v in draft.model.layers[0].state_dict().items():
        assert torch.equal(v, t_layer[k]), k
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    # copied, not tied to the target object: training the draft must not move the target
    with torch.no_grad():
        draft.model.embed_tokens.weight.add_(1.0)
    assert not torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)


def test_draft_with_all_layers_equals_target(tiny_cfg):
    target, tok = load_target(tiny_cfg)
    draft = draft_from_target(target, [0, 1])
    ids = torch.tensor([tok.encode("same model")])
    torch.testing.assert_close(draft(ids).logits, target(ids).logits)


def test_draft_layers_out_of_range(tiny_cfg):
    target, tok = load_target(tiny_cfg)
    with pytest.raises(ConfigError, match="out of range: the target has 2 layers"):
        draft_from_target(target, [0, 5])


def test_draft_from_config_and_pretrained(tiny_cfg, tmp_path):
    target, tok = load_target(tiny_cfg)
    cfg = ModelConfig(target="tiny", cache_dir=tiny_cfg.cache_dir, draft_init="config",
                      draft_config={"num_hidden_layers": 1, "intermediate_size": 32})
    fresh = load_draft(cfg, target, tok)
    assert fresh.config.num_hidden_layers == 1 and fresh.config.intermediate_size == 32
    bad = ModelConfig(target="tiny", cache_dir=tiny_cfg.cache_dir, draft_init="config", draft_config={"nope": 1})
    with pytest.raises(ConfigError, match="draft_config.nope"):
        load_draft(bad, target, tok)
    d = tmp_path / "draft"
    fresh.save_pretrained(d)
    tok.save_pretrained(d)
    pre = ModelConfig(target="tiny", cache_dir=tiny_cfg.cache_dir, draft_init="pretrained", draft=str(d))
    loaded = load_draft(pre, target, tok)
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(loaded(ids).logits, fresh(ids).logits)


def test_tokenizer_check_passes_on_same_tokenizer():
    check_tokenizers(tiny_tokenizer(), tiny_tokenizer())
    assert tokenizer_fingerprint(tiny_tokenizer()) == tokenizer_fingerprint(tiny_tokenizer())


def test_tokenizer_check_names_first_differing_token():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    b.add_tokens(["<extra>"])
    with pytest.raises(TokenizerMismatch, match=r"token '<extra>' has id None in big and 259 in small"):
        check_tokenizers(a, b, "big", "small")


def test_tokenizer_check_special_tokens():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    b.eos_token = "<|endoftext|>"
    with pytest.raises(TokenizerMismatch, match="eos_token"):
        check_tokenizers(a, b)


def test_padded_embedding_rows_are_masked():
    tok = tiny_tokenizer()
    small, padded = tiny_model(seed=0), tiny_model(seed=0, vocab_size=320)  # Qwen-style padding
    assert shared_vocab_size(tok, small, padded) == 259
    logits = padded(torch.tensor([[3, 4, 5]])).logits
    assert mask_padded_vocab(logits, 259).shape[-1] == 259
    with pytest.raises(TokenizerMismatch):
        shared_vocab_size(tok, tiny_model(seed=0, vocab_size=200))


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_target(ModelConfig(target=str(tmp_path / "nope" / "model")))


def test_gguf_conversion_matches_gguf_model(tmp_path):
    """The converted safetensors dir gives the same logits as loading the GGUF file directly."""
    gguf = embedded_gguf_path("smollm2-135m-instruct")
    out = convert_gguf(gguf, tmp_path / "smollm2")
    assert json.loads((out / "source.json").read_text())["gguf"] == gguf.name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = torch.tensor([tok.encode("def add(a, b):\n    return")])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, direct(ids).logits, rtol=0, atol=1e-5)
    check_tokenizers(tok, AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))


def test_conversion_crash_leaves_no_half_cache(tmp_path, monkeypatch):
    from distill import models

    def boom(*a, **k):
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", boom)
    with pytest.raises(RuntimeError):
        convert_gguf(embedded_gguf_path("smollm2-135m-instruct"), tmp_path / "smollm2")
    assert list(tmp_path.iterdir()) == []


def test_logit_scale_multiplies_the_logits_exactly_or_says_it_cannot(tiny_cfg):
    from distill.batches import LogitScale

    target, _ = load_target(tiny_cfg)
    ids = torch.tensor([[3, 7, 11, 5]])
    with torch.no_grad():
        ref = target(input_ids=ids).logits
        scale = LogitScale(target)
        assert scale.ok
        scale.set(1.3)
        torch.testing.assert_close(target(input_ids=ids).logits, 1.3 * ref, rtol=1e-5, atol=1e-5)
        scale.set(1.0)
        torch.testing.assert_close(target(input_ids=ids).logits, ref, atol=0, rtol=0)
        target.model.norm = torch.nn.Identity()  # no final norm to carry a scale
        assert not LogitScale(target).ok
