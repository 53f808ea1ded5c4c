"""The generated-record format: parquet shards of the target's answers under runs/<run>/generate.

    from distill.records import load_generated, record_ids, check_records_owner, run_draft_vocab
    ds = load_generated("runs/smoke")            # every record as one datasets.Dataset, sorted by id

A shard holds whole batches of records (docs/architecture.md, "The generated record") and carries, in
its parquet metadata, the identity of the settings that made it: the target, tokenizer, sampling and
data settings. The generate stage writes shards (distill/generate.py); the distill, evaluate and
publish stages read them and check whose they are.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from omegaconf import DictConfig, OmegaConf

from distill.config import ConfigError, DataConfig, stage_path
from distill.models import resolve_device, resolve_dtype, tokenizer_fingerprint
from distill.utils import writing
from specdec.drafters import frequent_tokens

SELF_INSTRUCT_MAX_TOKENS = DataConfig.self_instruct_max_tokens  # what samples written before the field had

SHARD_GLOB = "shard-r*.parquet"
META_KEY = b"specdistill.generate"  # parquet metadata: the settings that made a shard


@dataclass
class Item:
    """One record to generate: a prompt (and sample index) with its own seed."""

    id: str
    source: str
    category: str
    prompt: str
    prompt_ids: list[int]
    seed: int


@dataclass
class Output:
    response_ids: list[int]
    finish_reason: str  # eos | stop (a generate.stop_strings entry) | length
    topk_ids: Optional[np.ndarray] = None  # [T, k] int32
    topk_logits: Optional[np.ndarray] = None  # [T, k] float16


def sampling_identity(cfg: DictConfig) -> dict:
    """The sampling settings a record was answered with (part of its identity)."""
    g = cfg.generate
    sampling = {"temperature": float(g.temperature), "top_p": float(g.top_p), "top_k": int(g.top_k),
                "max_new_tokens": int(g.max_new_tokens), "num_samples": int(g.num_samples), "seed": int(cfg.seed)}
    if g.get("stop_strings"):  # only when set: identities written before the field existed still match
        sampling["stop_strings"] = list(g.stop_strings)
    return sampling


def identity(cfg: DictConfig, tok: Any) -> dict:
    """Everything that decides what a record holds; shards made with another identity are refused."""
    g, m = cfg.generate, cfg.model
    data = OmegaConf.to_container(cfg.data, resolve=True)
    data.pop("limit", None)  # a larger limit extends the same set
    data.pop("self_instruct", None)  # so does a larger self-instruct count
    data.pop("in_domain", None)  # and the evaluation sets' other prompts (the manifest records which)
    if not data.get("self_instruct_seeds"):  # the default: identities written before the fields existed still match
        data.pop("self_instruct_seeds", None)
        data.pop("self_instruct_shots", None)
    if data.get("self_instruct_max_tokens", SELF_INSTRUCT_MAX_TOKENS) == SELF_INSTRUCT_MAX_TOKENS:
        data.pop("self_instruct_max_tokens", None)  # the default: identities written before the field still match
    if not data.get("skip"):
        data.pop("skip", None)  # the default: identities written before the field existed still match
    if data.get("template") in (None, "chat"):
        data.pop("template", None)  # the default: identities written before the field existed still match
    sampling = sampling_identity(cfg)
    model = {"target": m.target, "revision": m.revision,
             "dtype": str(resolve_dtype(m.dtype, resolve_device(m.device))).replace("torch.", "")}
    if g.get("mixed_precision", "no") != "no":  # the default: identities written before the field still match
        model["autocast"] = g.mixed_precision
    return {
        "model": model,
        "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "sampling": sampling,
        "prompts": {"max_prompt_tokens": int(g.max_prompt_tokens), "overlong": g.overlong},
        "store_topk": int(g.store_topk),
        "data": data,
    }


def _gen_dir(path: str | Path) -> Path:
    path = Path(path)
    return path / "generate" if (path / "generate").is_dir() else path


def shard_paths(out: Path) -> list[Path]:
    return sorted(out.glob(SHARD_GLOB))


def shard_identity(path: Path) -> dict:
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta.get(META_KEY, b"{}"))


def differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    diffs = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            diffs += differences(x, y, f"{prefix}{k}.")
        elif x != y:
            diffs.append(f"{prefix}{k}: {y!r} here, {x!r} requested")
    return diffs


def _owner(ident: dict, with_tokenizer: bool) -> dict:
    """The part of a records identity that says whose answers they are: the target (and revision), its
    tokenizer, the sampling settings (the seed only when sampling: greedy answers do not depend on it)."""
    sampling = dict(ident.get("sampling") or {})
    if not sampling.get("temperature"):
        sampling.pop("seed", None)
    m = ident.get("model") or {}
    owner = {"model": {"target": m.get("target"), "revision": m.get("revision")}, "sampling": sampling}
    if with_tokenizer:
        owner["tokenizer_fingerprint"] = ident.get("tokenizer_fingerprint")
    return owner


def check_records_owner(cfg: DictConfig, tok: Any = None) -> None:
    """Refuse, before any work, records in runs/<run>/generate that another target, revision, tokenizer
    (when `tok` is given) or sampling setting made than cfg's: one ConfigError naming both and the fix.
    Shards that carry no settings (written by hand) pass."""
    out = stage_path(cfg, "generate")
    want = _owner(identity(cfg, tok) if tok is not None else {
        "model": {"target": cfg.model.target, "revision": cfg.model.revision},
        "sampling": sampling_identity(cfg)}, tok is not None)
    for f in shard_paths(out) if out.is_dir() else []:
        have = shard_identity(f)
        if not have:
            continue
        diffs = differences(want, _owner(have, tok is not None))
        if diffs:
            raise ConfigError(
                f"{out} holds records made by {have.get('model', {}).get('target')!r} with other settings than "
                f"model.target={cfg.model.target!r} and this run's ({'; '.join(diffs[:4])}); use another run_name "
                "for this target, or regenerate them here with generate.overwrite=true")


def write_shard(out: Path, name: str, items: list[Item], outputs: list[Output], g: Any, ident: dict, tok: Any) -> None:
    """One parquet file holding whole batches; written to a temp name, fsynced, renamed."""
    cols: dict[str, Any] = {
        "id": [it.id for it in items], "source": [it.source for it in items],
        "category": [it.category for it in items], "prompt": [it.prompt for it in items],
        "prompt_ids": pa.array([it.prompt_ids for it in items], pa.list_(pa.int32())),
        "response_ids": pa.array([o.response_ids for o in outputs], pa.list_(pa.int32())),
        "response": tok.batch_decode([o.response_ids for o in outputs], skip_special_tokens=True),
        "finish_reason": [o.finish_reason for o in outputs],
        "temperature": pa.array([float(g.temperature)] * len(items), pa.float64()),
        "top_p": pa.array([float(g.top_p)] * len(items), pa.float64()),
        "top_k": pa.array([int(g.top_k)] * len(items), pa.int32()),
        "max_new_tokens": pa.array([int(g.max_new_tokens)] * len(items), pa.int32()),
        "seed": pa.array([it.seed for it in items], pa.int64()),
    }
    if g.store_topk:
        offsets = pa.array(np.concatenate([[0], np.cumsum([len(o.response_ids) for o in outputs])]), pa.int32())
        for col, typ in (("topk_ids", pa.int32()), ("topk_logits", pa.float16())):
            flat = pa.array(np.concatenate([getattr(o, col) for o in outputs]).reshape(-1), typ)
            k = getattr(outputs[0], col).shape[1]
            cols[col] = pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(flat, k))
    table = pa.table(cols).replace_schema_metadata({META_KEY: json.dumps(ident).encode()})
    tmp = out / f".{name}.tmp-{os.getpid()}"
    with writing(out / name, lambda: tmp.unlink(missing_ok=True)):  # a full disk: no half shard, one message
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, out / name)


def load_generated(path: str | Path) -> datasets.Dataset:
    """All records of a run (runs/<run> or runs/<run>/generate) as one Dataset, sorted by id."""
    out = _gen_dir(path)
    files = shard_paths(out)
    if not files:
        raise ConfigError(f"no generated data in {out}; run `python -m distill.generate run_name=<run>` first")
    table = pa.concat_tables([pq.read_table(f) for f in files]).replace_schema_metadata(None)
    table = table.sort_by("id")
    n_unique = len(pc.unique(table["id"]))
    if n_unique != table.num_rows:
        raise ConfigError(f"{out} holds {table.num_rows - n_unique} duplicate ids; regenerate with generate.overwrite=true")
    return datasets.Dataset(table)


def data_key(path: str | Path) -> Optional[str]:
    """A short hash of which records a run's generate/ holds (their ids), or None when it holds none:
    the distill stage compares it to tell whether a draft was trained on these records."""
    ids = sorted(record_ids(path))
    return hashlib.sha1("\n".join(ids).encode()).hexdigest()[:16] if ids else None


def record_ids(path: str | Path) -> set[str]:
    """The ids of the records in a run's generate/ (empty when it has none)."""
    return {i for f in shard_paths(_gen_dir(path)) for i in pq.read_table(f, columns=["id"])["id"].to_pylist()}


def totals(files: list[Path]) -> dict:
    """Counts over every shard: records, tokens, finish reasons."""
    n, prompt_tok, resp_tok, reasons, ids = 0, 0, 0, {}, []
    for f in files:
        t = pq.read_table(f, columns=["id", "prompt_ids", "response_ids", "finish_reason"])
        n += t.num_rows
        ids += t["id"].to_pylist()
        prompt_tok += pc.sum(pc.list_value_length(t["prompt_ids"])).as_py() or 0
        resp_tok += pc.sum(pc.list_value_length(t["response_ids"])).as_py() or 0
        for r in t["finish_reason"].to_pylist():
            reasons[r] = reasons.get(r, 0) + 1
    return {"records": n, "prompt_tokens": prompt_tok, "response_tokens": resp_tok,
            "finish_reasons": reasons, "ids": sorted(ids)}


def run_draft_vocab(cfg: Any, vocab_size: int, tokenizer: Any = None) -> Optional[torch.Tensor]:
    """The run's draft vocabulary: the model.draft_vocab token ids its generated answers use most
    (sorted [N] long), or None when model.draft_vocab is 0. Deterministic in the records and the
    tokenizer (the target's), whose single-character tokens fill the slots the answers leave free
    (specdec.drafters.frequent_tokens); every stage must pass the same one."""
    n = int(cfg.model.draft_vocab or 0)
    if n == 0:
        return None
    try:
        answers = load_generated(stage_path(cfg, "generate"))["response_ids"]
    except ConfigError as err:
        raise ConfigError(f"model.draft_vocab={n} ranks tokens by this run's generated answers: {err} "
                          "(or set model.draft_vocab=0 for the whole vocabulary)") from None
    return frequent_tokens(answers, min(n, vocab_size), vocab_size, tokenizer)
