"""A feature-conditioned draft head (EAGLE-3 style): a draft that reads the target's own hidden states.

    from specdec.heads import FeatureHead, load_head
    head = FeatureHead.from_target(target, vocab_ids=ids)   # layers: one low, one middle, one high
    head.save_pretrained("out/head")                         # EAGLE-3 checkpoint (vLLM, SGLang load it)
    head = load_head("out/head", target)                     # embeddings come from the target

What it computes, for a pair at position t (target features f_t of the tokens up to t, and token x_{t+1}):

    h   = fc(f_t)                                   # [n·H_t] -> [H]: the target's layers fused
    x   = [input_layernorm(embed(x_{t+1})), hidden_norm(h)]          # [2H]: q/k/v take 2H inputs
    r   = h + o_proj(attention(x))                  # residual from the fused feature
    g   = r + mlp(post_attention_layernorm(r))      # (further layers: plain Llama decoder layers)
    logits = lm_head(norm(g))                       # over the draft vocabulary -> token x_{t+2}

g (before the final norm) stands in for f at the next draft step, whose token is the head's own
proposal. `f_t` concatenates, in ascending layer order, the residual stream *entering* each feature
layer j of the target (the output of layer j-1): vLLM's convention for `eagle_aux_hidden_state_layer_ids`.

Checkpoint format (what vLLM's `Eagle3LlamaForCausalLM` / SGLang's `LlamaForCausalLMEagle3` load):
config.json with architectures ["LlamaForCausalLMEagle3"], draft_vocab_size, target_hidden_size,
`eagle_aux_hidden_state_layer_ids` (top level, vLLM's convention: input of layer j) and
`eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang's convention: output of layer j, i.e. j - 1);
model.safetensors with fc.weight, midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight,
lm_head.weight [draft vocab, H], d2t (int64 [draft vocab]: target id − draft id) and t2d (bool [vocab]).
No embed_tokens: both servers share the target's. Extra layers (num_layers > 1) are written as
layers.<i>.* (vLLM's names; SGLang's loader reads single-layer heads only).

Why one module of this size: the head's layers, its unroll (the training-time test) and its EAGLE-3
checkpoint format read and write the same weights.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .files import replace_dir

WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"

# attend(q [B, heads, q, D], k [B, kv heads, q, D], v) -> [B, heads, q, D]: how a layer's new keys and
# values meet the ones before them (a KV cache when decoding, the TTT pattern when training).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice (inputs of layers 2, L//2, L-3), kept inside [1, L-1] and made distinct: on a
    shallow target the missing ids are filled from the top (L=6 -> 2, 3, 5; L=2 -> just 1)."""
    if num_layers < 2:
        raise ValueError(f"a feature head needs a target with at least 2 layers (got {num_layers})")
    ids = {min(max(j, 1), num_layers - 1) for j in (2, num_layers // 2, num_layers - 3)}
    for j in range(num_layers - 1, 0, -1):
        if len(ids) >= min(3, num_layers - 1):
            break
        ids.add(j)
    return tuple(sorted(ids))


def _text_config(target: nn.Module):
    cfg = target.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _rope(cfg) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) of a transformers config (4.x or 5.x fields)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(params.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    scaling = params or getattr(cfg, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, (dict(scaling) if scaling else None)


class _Attention(nn.Module):
    def __init__(self, d_in: int, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(d_in, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _HeadLayer(nn.Module):
    """One decoder layer; the first reads [embedding, fused feature] (2H), the others a plain H."""

    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, eps: float, first: bool):
        super().__init__()
        self.first = first
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        if first:
            self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.self_attn = _Attention(2 * hidden if first else hidden, hidden, heads, kv_heads, head_dim)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.mlp = _MLP(hidden, inter)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import rotate_half

        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1) if self.first else self.input_layernorm(h)
        B, q, _ = x.shape
        a = self.self_attn
        qs = a.q_proj(x).view(B, q, a.heads, a.head_dim).transpose(1, 2)  # [B, heads, q, D]
        ks = a.k_proj(x).view(B, q, a.kv_heads, a.head_dim).transpose(1, 2)  # [B, kv heads, q, D]
        vs = a.v_proj(x).view(B, q, a.kv_heads, a.head_dim).transpose(1, 2)
        qs, ks = qs * cos + rotate_half(qs) * sin, ks * cos + rotate_half(ks) * sin
        o = attend(qs, ks, vs)  # [B, heads, q, D]
        h = h + a.o_proj(o.transpose(1, 2).reshape(B, q, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class FeatureHead(nn.Module):
    """The head (see the module docstring). spec: its shape and the target it reads (a plain dict,
    written to config.json); embed: the target's input embedding (shared and frozen, never saved)."""

    def __init__(self, spec: dict, embed: nn.Module | None = None):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.spec = dict(spec)
        s = self.spec
        H, n = s["hidden_size"], len(s["feature_layers"])
        args = (H, s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"],
                s["rms_norm_eps"])
        self.fc = nn.Linear(n * s["target_hidden_size"], H, bias=False)
        self.midlayer = _HeadLayer(*args, first=True)
        # named layers.<i> (i >= 1), as vLLM's loader names a head's further layers
        self.layers = nn.ModuleDict({str(i): _HeadLayer(*args, first=False) for i in range(1, s["num_layers"])})
        self.norm = nn.RMSNorm(H, eps=s["rms_norm_eps"])
        self.lm_head = nn.Linear(H, len(s["vocab_ids"]), bias=False)
        self.register_buffer("vocab_ids", torch.tensor(s["vocab_ids"], dtype=torch.long), persistent=False)
        rope_cfg = LlamaConfig(hidden_size=H, num_attention_heads=s["num_attention_heads"], head_dim=s["head_dim"],
                               max_position_embeddings=s["max_position_embeddings"], rope_theta=s["rope_theta"],
                               rope_scaling=s["rope_scaling"])
        self.rotary = LlamaRotaryEmbedding(rope_cfg)
        self._embed = [embed]  # a list: not a submodule, so never trained, saved or moved with the head

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_target(cls, target: nn.Module, layers: Sequence[int] | None = None, num_layers: int = 1,
                    vocab_ids: torch.Tensor | Sequence[int] | None = None) -> "FeatureHead":
        """A head for a Llama-style HF causal LM: its decoder layers from the target's last layer (q/k/v
        read the fused half; the embedding half starts at 0), fc picking the highest feature layer,
        norm and LM head rows (vocab_ids; None = every token) from the target's."""
        cfg = _text_config(target)
        L, H = int(cfg.num_hidden_layers), int(cfg.hidden_size)
        layers = default_feature_layers(L) if layers is None else tuple(sorted(int(j) for j in layers))
        bad = [j for j in layers if not 1 <= j <= L - 1]
        if bad or not layers or len(set(layers)) != len(layers):
            raise ValueError(f"feature layers {list(layers)} must be distinct ids in [1, {L - 1}] (id j reads the "
                             f"hidden state entering target layer j); the target has {L} layers")
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers} must be >= 1")
        vocab = int(target.get_input_embeddings().weight.shape[0])
        ids = torch.arange(vocab) if vocab_ids is None else torch.as_tensor(vocab_ids, dtype=torch.long).flatten().unique()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"vocab_ids must be distinct token ids in [0, {vocab})")
        theta, scaling = _rope(cfg)
        heads = int(cfg.num_attention_heads)
        spec = {
            "hidden_size": H, "target_hidden_size": H, "intermediate_size": int(cfg.intermediate_size),
            "num_attention_heads": heads, "num_key_value_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(cfg, "head_dim", None) or H // heads), "rms_norm_eps": float(cfg.rms_norm_eps),
            "max_position_embeddings": int(cfg.max_position_embeddings), "rope_theta": theta, "rope_scaling": scaling,
            "num_layers": int(num_layers), "feature_layers": list(layers), "target_num_hidden_layers": L,
            "vocab_size": vocab, "vocab_ids": ids.tolist(),
            "bos_token_id": getattr(cfg, "bos_token_id", None), "eos_token_id": getattr(cfg, "eos_token_id", None),
        }
        w = next(target.parameters())
        head = cls(spec, target.get_input_embeddings()).to(device=w.device, dtype=w.dtype)
        last = target.get_decoder().layers[-1]
        for layer in [head.midlayer, *head.layers.values()]:
            for name in ("q_proj", "k_proj", "v_proj"):
                src = getattr(last.self_attn, name).weight
                dst = getattr(layer.self_attn, name).weight
                dst.zero_()
                dst[:, -H:] = src  # the first layer: the fused half; the others: all of it
            layer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
            layer.input_layernorm.weight.copy_(last.input_layernorm.weight)
            layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
            if layer.first:
                layer.hidden_norm.weight.copy_(last.input_layernorm.weight)
        head.fc.weight.zero_()
        head.fc.weight[:, -H:] = torch.eye(H, device=w.device, dtype=w.dtype)  # start from the highest feature layer alone
        head.norm.weight.copy_(target.get_decoder().norm.weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[ids.to(w.device)])
        return head

    def attach(self, target: nn.Module) -> "FeatureHead":
        """Use the target's input embedding; ValueError if the target is not the one the head reads."""
        check_target(self.spec, target)
        self._embed = [target.get_input_embeddings()]
        return self

    # -- properties --------------------------------------------------------------------------------
    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.spec["feature_layers"])

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size (token ids the head's proposals index into)."""
        return int(self.spec["vocab_size"])

    @property
    def embed(self) -> nn.Module:
        if self._embed[0] is None:
            raise ValueError("this head has no embeddings yet: load it with load_head(dir, target) or call "
                             "head.attach(target)")
        return self._embed[0]

    # -- computation -------------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., n·H_t] -> the head's input hidden state [..., H]."""
        return self.fc(features)

    def step(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             attends: Sequence[Attend]) -> torch.Tensor:
        """h [B, q, H] (fused features or the head's own g), tokens [B, q], positions [B, q] ->
        g [B, q, H] (before the final norm). attends: one per layer (midlayer first)."""
        emb = self.embed(tokens).to(h.dtype)
        cos, sin = self.rotary(h, positions)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, q, D]
        for layer, attend in zip([self.midlayer, *self.layers.values()], attends):
            h = layer(h, emb, cos, sin, attend)
        return h

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """g [..., H] -> logits over the draft vocabulary [..., S] (column i is token vocab_ids[i])."""
        return self.lm_head(self.norm(g))

    @property
    def num_layers(self) -> int:
        return int(self.spec["num_layers"])

    def unroll(self, features: torch.Tensor, tokens: torch.Tensor, steps: int,
               next_tokens: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
               valid: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training-time test: `steps` draft steps for every pair at once, with the attention pattern of
        decoding. features [B, T, n·H_t] and tokens [B, T] are the pairs (f_t, x_{t+1}) at positions t
        (right-padded; valid [B, T] marks real pairs). Step j >= 2 of row t is the j-th proposal of a
        round whose first pair is t: it reads g of step j-1 at t, the token next_tokens(j, g of step j-1)
        [B, T], position t + j - 1, and attends to the real pairs 0..t (step 1's keys) and to steps 2..j
        of its own row. Returns g [B, T, H] per step (logits(g): its proposal's logits)."""
        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device).expand(B, T)
        keep = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()[None, None]  # [1, 1, T, T]
        if valid is not None:
            keep = keep & valid[:, None, None, :]
        caches = [([], []) for _ in range(self.num_layers)]
        attends = [_ttt_attend(ks, vs, keep) for ks, vs in caches]
        out, h = [], self.fuse(features)
        for j in range(1, steps + 1):
            if j > 1:
                tokens = next_tokens(j, h)
            h = self.step(h, tokens, pos + (j - 1), attends)
            out.append(h)
        return out

    # -- saving ---------------------------------------------------------------------------------------
    def export_config(self) -> dict:
        """config.json: a Llama config that vLLM and SGLang read as an EAGLE-3 draft."""
        s = self.spec
        layers = list(s["feature_layers"])
        cfg = {
            "architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
            "num_attention_heads": s["num_attention_heads"], "num_key_value_heads": s["num_key_value_heads"],
            "head_dim": s["head_dim"], "num_hidden_layers": s["num_layers"], "hidden_act": "silu",
            "rms_norm_eps": s["rms_norm_eps"], "max_position_embeddings": s["max_position_embeddings"],
            "rope_theta": s["rope_theta"], "rope_scaling": s["rope_scaling"],
            "vocab_size": s["vocab_size"], "draft_vocab_size": len(s["vocab_ids"]),
            "target_hidden_size": s["target_hidden_size"], "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "norm_before_residual": False,
            "bos_token_id": s.get("bos_token_id"), "eos_token_id": s.get("eos_token_id"),
            "torch_dtype": str(self.lm_head.weight.dtype).removeprefix("torch."),
            # vLLM: id j = the hidden state entering layer j. SGLang: id j = the output of layer j (it adds 1).
            "eagle_aux_hidden_state_layer_ids": layers,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [j - 1 for j in layers], "use_aux_hidden_state": True},
            "specdistill": {"target_num_hidden_layers": s["target_num_hidden_layers"], "feature_layers": layers},
        }
        return cfg

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The safetensors content: the head's weights plus d2t / t2d (see the module docstring)."""
        out = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        ids = self.vocab_ids.cpu()
        out["d2t"] = ids - torch.arange(ids.numel())
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
        return out

    def save_pretrained(self, path: str | Path) -> Path:
        """Write config.json + model.safetensors to path (a temp dir renamed into place)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            (tmp / "config.json").write_text(json.dumps(self.export_config(), indent=2) + "\n")
            save_file(self.export_tensors(), str(tmp / WEIGHTS), metadata={"format": "pt"})
            os.chmod(tmp, 0o755)
            replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path


def _ttt_attend(ks: list, vs: list, keep: torch.Tensor) -> Attend:
    """The TTT attention of one layer: step 1's keys causally (keep [B|1, 1, T, T]), each later step's
    keys only on the diagonal (a row sees its own earlier draft steps). ks/vs collect the steps' keys."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ks.append(k)
        vs.append(v)
        rep = q.shape[1] // k.shape[1]
        scale = q.shape[-1] ** -0.5
        k1, v1 = ks[0].repeat_interleave(rep, 1), vs[0].repeat_interleave(rep, 1)  # [B, heads, T, D]
        s1 = (q @ k1.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))  # [B, heads, T, T]
        diag = [(q * kk.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale for kk in ks[1:]]  # [B, heads, T, 1]
        p = torch.softmax(torch.cat([s1, *diag], -1), -1)
        T = s1.shape[-1]
        o = p[..., :T] @ v1
        for i, vv in enumerate(vs[1:]):
            o = o + p[..., T + i : T + i + 1] * vv.repeat_interleave(rep, 1)
        return o

    return attend


def check_target(spec: dict, target: nn.Module) -> None:
    """ValueError naming the mismatch if `target` is not a model this head can read."""
    cfg = _text_config(target)
    L, H = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    vocab = int(target.get_input_embeddings().weight.shape[0])
    problems = []
    if H != spec["target_hidden_size"]:
        problems.append(f"hidden size {H} (the head reads {spec['target_hidden_size']})")
    if L != spec["target_num_hidden_layers"]:
        problems.append(f"{L} layers (the head was made for {spec['target_num_hidden_layers']}, feature layers "
                        f"{spec['feature_layers']})")
    if vocab != spec["vocab_size"]:
        problems.append(f"a vocabulary of {vocab} (the head's is {spec['vocab_size']})")
    if problems:
        raise ValueError("this head belongs to another target: the given one has " + ", ".join(problems)
                         + "; pass the target the head was trained on, or train a head for this one")


def is_head_dir(path: str | Path) -> bool:
    """Whether path holds a feature head checkpoint (an EAGLE-3 config.json)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and ARCHITECTURE in (cfg.get("architectures") or [])


def load_head(path: str | Path, target: nn.Module | None = None) -> FeatureHead:
    """A head saved by save_pretrained (or any single-config EAGLE-3 checkpoint of this layout). With a
    target: its embeddings are attached and its shape checked; without: call head.attach(target) later."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / WEIGHTS).is_file():
        raise ValueError(f"{path} is not a feature head directory (needs config.json and {WEIGHTS})")
    cfg = json.loads((path / "config.json").read_text())
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise ValueError(f"{path}/config.json is not an EAGLE-3 head (architectures {cfg.get('architectures')}, "
                         f"expected {ARCHITECTURE})")
    tensors = load_file(str(path / WEIGHTS))
    d2t = tensors.pop("d2t")
    tensors.pop("t2d", None)
    extra = cfg.get("specdistill", {})
    layers = extra.get("feature_layers") or cfg.get("eagle_aux_hidden_state_layer_ids")
    if not layers:
        raise ValueError(f"{path}/config.json names no feature layers (eagle_aux_hidden_state_layer_ids)")
    spec = {
        "hidden_size": cfg["hidden_size"], "target_hidden_size": cfg.get("target_hidden_size", cfg["hidden_size"]),
        "intermediate_size": cfg["intermediate_size"], "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        "rms_norm_eps": cfg["rms_norm_eps"], "max_position_embeddings": cfg["max_position_embeddings"],
        "rope_theta": cfg.get("rope_theta", 10000.0), "rope_scaling": cfg.get("rope_scaling"),
        "num_layers": cfg["num_hidden_layers"], "feature_layers": list(layers),
        "target_num_hidden_layers": extra.get("target_num_hidden_layers"), "vocab_size": cfg["vocab_size"],
        "vocab_ids": (torch.arange(d2t.numel()) + d2t).tolist(),
        "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
    }
    if spec["target_num_hidden_layers"] is None:  # a foreign checkpoint: only a target can tell
        spec["target_num_hidden_layers"] = _text_config(target).num_hidden_layers if target is not None else max(layers) + 1
    head = FeatureHead(spec)
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(f"{path}/{WEIGHTS} does not fit its config.json: missing {missing}, unexpected {unexpected}")
    head = head.to(tensors["lm_head.weight"].dtype)
    if target is not None:
        head.attach(target)
        head.to(next(target.parameters()).device)
    return head.eval()
