"""The generate stage: the target's own answers to a prompt set, batched, resumable, multi-process.

    python -m distill.generate model=tiny data=mt_bench data.limit=4 generate.max_new_tokens=16 run_name=try  # CPU, seconds
    python -m distill.generate experiment=smoke                       # embedded SmolLM2, 24 prompts, CPU
    accelerate launch --multi_gpu --num_processes 2 -m distill.generate experiment=smoke   # 2 processes (CPU too)

Writes runs/<run>/generate/shard-r<rank>-<n>.parquet (one record per prompt and sample) and
manifest.json; read them back with `load_generated(run_dir)`. A record holds id (the prompt id, plus
"#<sample>" when generate.num_samples > 1), source, category, prompt (text), prompt_ids,
response_ids, response (text without special tokens), finish_reason (eos | stop | length), temperature,
top_p, top_k, max_new_tokens and seed (the row's own seed). response_ids *include* the EOS token when
finish_reason is eos, so a draft trained on them learns to stop; padding never appears. finish_reason
stop: the answer's text ended with one of generate.stop_strings (a base model's answers, which have no
EOS to end them); the tokens that spelled it are kept. With
generate.store_topk=k a record also holds topk_ids [T, k] (int32) and topk_logits [T, k] (float16):
the target's k largest raw logits at each response position, 6*k bytes per token before parquet
compression (k=64: 384 B/token, ~48 KB for a 128-token answer).

How it stays correct:
- Prompts are decoded longest first in left-padded batches; a finished row leaves the batch and, once
  half of it is free, the next prompts are prefilled and join it (continuous batching). Greedy
  records equal `model.generate` run one prompt at a time (fp32, checked on the tiny model in tests
  and on SmolLM2 by scripts/bench_generate.py; a true float tie could in principle differ).
- Every row samples from its own generator, seeded from (seed, id), so a record's random draws do
  not depend on which rows share its batch. A shard holds shard_size finished records and is written
  to a temp name and renamed; a crash loses only the rows in flight and the unwritten records, which a
  resumed run redoes: the result equals an uninterrupted run.
- Done ids come from the shards themselves; each shard carries the settings that made it, and data
  made with another model, tokenizer or sampling setting is refused (generate.overwrite=true clears it).
- Under `accelerate launch` each process takes the prompts whose id hashes to its rank. (On a
  CPU-only machine `--multi_gpu` is what starts N processes; `--cpu` with accelerate 1.x starts one.)

Why one module of this size: the two backends (HF continuous batching, vLLM), self-instruct and in-domain
prompts are the stage's own steps and share its item and identity types; the record format is apart
(distill/records.py).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm
from transformers import AutoConfig

from distill.config import ConfigError
from distill.data import PromptTooLong, encode_prompt, load_prompts, prompt_token_limit, render_prompt
from distill.templates import stop_strings
from distill.models import (
    check_tokenizers, load_target, load_tokenizer, resolve_device, resolve_model_path, shared_vocab_size,
)
from distill.records import (
    SELF_INSTRUCT_MAX_TOKENS, Item, Output, differences, identity, record_ids, shard_identity, shard_paths, totals,
    write_shard,
)
from distill.cli import cli, stage_main, start_stage
from distill.utils import atomic_write_json, read_json
from specdec.decoder import left_pad
from specdec.kv import KVModel
from specdec.sampling import SamplingParams, logits_to_probs, sample

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- settings, seeds, items


def row_seed(seed: int, record_id: str) -> int:
    """A 63-bit seed for one record, a pure function of the run seed and the record id."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{record_id}".encode()).digest()[:8], "little") >> 1


def rank_of(prompt_id: str, num_processes: int) -> int:
    """Which process generates a prompt (all its samples): a stable hash, not the row order."""
    return int.from_bytes(hashlib.sha1(prompt_id.encode()).digest()[:8], "little") % num_processes


def build_items(cfg: DictConfig, tok: Any, model_config: Any, rank: int = 0, world: int = 1,
                extra: Optional[list[dict]] = None) -> tuple[list[Item], dict]:
    """This rank's records, longest prompt first; and {prompts (in the whole set), skipped (ids), truncated}.
    extra: more prompt rows (self-instruct, in-domain) after data's own; a repeat of a row is dropped."""
    g = cfg.generate
    prompts = list(load_prompts(cfg.data))  # ConfigError for an unknown source or an empty set
    seen = {row["id"]: row["messages"] for row in prompts}
    for row in extra or []:
        if row["id"] in seen and seen[row["id"]] != row["messages"]:
            raise ConfigError(f"two different prompts have the id {row['id']!r} (data and data.in_domain's eval_data "
                              "set?); give one of them its own ids with data.id_column or eval_data.<name>.id_column")
        if row["id"] not in seen:
            seen[row["id"]] = row["messages"]
            prompts.append(row)
    limit = prompt_token_limit(g.max_prompt_tokens, model_config, g.max_new_tokens)
    template = cfg.data.get("template")  # every training prompt, in-domain ones too, as data.template says
    items: list[Item] = []
    skipped: list[str] = []
    truncated = 0
    for row in prompts:
        if rank_of(row["id"], world) != rank:
            continue
        try:
            ids = encode_prompt(tok, row["messages"], limit, template)
            text = render_prompt(tok, row["messages"], template)
        except PromptTooLong as e:
            if g.overlong == "skip":
                skipped.append(row["id"])
                continue
            ids, truncated = e.ids[-limit:], truncated + 1  # keep the end: the question and the assistant header
            text = tok.decode(ids)
        for s in range(g.num_samples):
            rid = f"{row['id']}#{s}" if g.num_samples > 1 else row["id"]
            items.append(Item(rid, row["source"], row["category"] or "", text, ids, row_seed(cfg.seed, rid)))
    items.sort(key=lambda it: (-len(it.prompt_ids), it.id))
    return items, {"prompts": len(prompts), "skipped": skipped, "truncated": truncated}


# ---------------------------------------------------------------- decoding (transformers)


class HFBackend:
    """Continuously batched KV-cached decoding with the target in this process, on specdec's KVModel.

    Like specdec.decoder.autoregressive_generate, plus what records need: a generator per row
    (seeded per record: its random draws do not depend on the rows sharing its batch) and the top-k
    logits. Finished rows leave the batch; once half of it is free, the next prompts are prefilled
    and join it (KVModel.absorb), so the batch stays full while answers of different lengths end.
    """

    def __init__(self, cfg: DictConfig, model: torch.nn.Module, tok: Any):
        g = cfg.generate
        self.g, self.tok, self.model = g, tok, model
        self.vocab = shared_vocab_size(tok, model)
        self.params = SamplingParams(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
        gen_eos = model.generation_config.eos_token_id
        gen_eos = gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
        self.eos = {int(t) for t in [tok.eos_token_id, *gen_eos] if t is not None}
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.stops = stop_strings(g.get("stop_strings"))
        # Tokens decoded to look for a stop string: the longest one's characters, each up to 4 bytes (a
        # byte-level token holds at least one byte), plus slack; a character cut at the front is never in it.
        self.stop_window = 4 * max((len(x) for x in self.stops), default=0) + 4
        self.continuous = True  # cleared when the model's cache cannot absorb new rows
        self.device_type = next(model.parameters()).device.type
        self.bf16 = g.get("mixed_precision", "no") == "bf16"

    def _forward(self):
        """The context every target forward pass runs in: bf16 autocast with generate.mixed_precision=bf16."""
        return torch.autocast(self.device_type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def _admit(self, items: list[Item]) -> tuple[KVModel, torch.Tensor]:
        """Prefill new prompts in a batch of their own -> (its KVModel, next-token logits [b, V])."""
        kv = KVModel(self.model, vocab_size=self.vocab)
        ids, mask = left_pad([it.prompt_ids for it in items], None, self.pad, kv.device)  # [b, S]: last column real
        with self._forward():
            kv.prefill(ids[:, :-1], mask[:, :-1])
            return kv, kv.step(ids[:, -1:])[:, -1].float()

    def _stopped(self, response_ids: list[int]) -> bool:
        """Whether the answer's text now contains a stop string. Checked after every token, so a match
        in the decoded tail is one the newest token completed (an earlier one would have ended it)."""
        tail = self.tok.decode(response_ids[-self.stop_window:], skip_special_tokens=True)
        return any(x in tail for x in self.stops)

    @torch.no_grad()
    def stream(self, items: list[Item]) -> Iterator[tuple[Item, Output]]:
        """Decode every item; yields (item, output) as each answer ends (not in input order)."""
        g, B, queue = self.g, self.g.batch_size, list(reversed(items))
        kv, logits, rows = None, None, []  # rows: [item, output, generator] in the batch's row order
        while queue or rows:
            if queue and (not rows or (self.continuous and B - len(rows) >= max(1, B // 2))):
                new = [queue.pop() for _ in range(min(B - len(rows), len(queue)))]
                new_kv, new_logits = self._admit(new)
                try:
                    if rows:
                        kv.absorb(new_kv)
                        logits = torch.cat([logits, new_logits])
                    else:
                        kv, logits = new_kv, new_logits
                except NotImplementedError:  # caches KVModel cannot merge: static batches instead
                    self.continuous = False
                    queue += reversed(new)
                    continue
                rows += [[it, Output([], "length", [] if g.store_topk else None, [] if g.store_topk else None),
                          None if self.params.greedy else torch.Generator(kv.device).manual_seed(it.seed)] for it in new]
            if g.store_topk:
                top = logits.float().topk(min(g.store_topk, logits.shape[-1]), dim=-1)  # [b, k]
                top_ids, top_vals = top.indices.int().cpu().numpy(), top.values.half().cpu().numpy()
            if self.params.greedy:
                nxt = logits.argmax(-1)  # [b]
            else:
                probs = logits_to_probs(logits, self.params)  # [b, V]
                nxt = torch.stack([sample(probs[j], r[2]) for j, r in enumerate(rows)])
            keep = []
            for j, (r, t) in enumerate(zip(rows, nxt.tolist())):
                o = r[1]
                o.response_ids.append(t)
                if g.store_topk:
                    o.topk_ids.append(top_ids[j])
                    o.topk_logits.append(top_vals[j])
                if t in self.eos:
                    o.finish_reason = "eos"
                elif self.stops and self._stopped(o.response_ids):
                    o.finish_reason = "stop"
                elif len(o.response_ids) < g.max_new_tokens:
                    keep.append(j)
                    continue
                if g.store_topk:
                    o.topk_ids, o.topk_logits = np.stack(o.topk_ids), np.stack(o.topk_logits)
                yield r[0], o
            if len(keep) < len(rows):  # finished rows leave the batch
                rows = [rows[j] for j in keep]
                if not rows:
                    continue
                idx = torch.tensor(keep, device=kv.device)
                kv.select_rows(idx)
                nxt = nxt[idx]
            with self._forward():
                logits = kv.step(nxt[:, None])[:, -1].float()


class VLLMBackend:
    """vLLM on a GPU: same records (per-record seeds, EOS kept in response_ids). Optional."""

    def __init__(self, cfg: DictConfig, tok: Any):
        try:
            import vllm  # noqa: F401
        except ImportError:
            vllm = None
        if vllm is None or not torch.cuda.is_available():
            raise ConfigError("generate.backend=vllm needs the vllm package and a CUDA GPU; "
                              "install vllm on a GPU machine or set generate.backend=transformers")
        if cfg.generate.store_topk:
            raise ConfigError("generate.store_topk needs raw logits, which vLLM does not return; "
                              "set generate.backend=transformers")
        from vllm import LLM

        m = cfg.model
        self.g, self.tok = cfg.generate, tok
        self.llm = LLM(model=resolve_model_path(m.target, m.cache_dir), revision=m.revision,
                       dtype="auto" if m.dtype == "auto" else m.dtype, seed=int(cfg.seed),
                       trust_remote_code=m.trust_remote_code)

    def stream(self, items: list[Item]) -> Iterator[tuple[Item, Output]]:
        """(item, output) pairs, in chunks of max(shard_size, batch_size) handed to vLLM at once."""
        n = max(self.g.shard_size, self.g.batch_size)
        for start in range(0, len(items), n):
            yield from zip(items[start : start + n], self.generate(items[start : start + n]))

    def generate(self, batch: list[Item]) -> list[Output]:
        from vllm import SamplingParams

        g = self.g
        stops = stop_strings(g.get("stop_strings")) or None  # the text that spelled a stop string stays, as with HF
        params = [SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k or -1,
                                 max_tokens=g.max_new_tokens, seed=it.seed, stop=stops,
                                 include_stop_str_in_output=True) for it in batch]
        res = self.llm.generate([{"prompt_token_ids": it.prompt_ids} for it in batch], params, use_tqdm=False)
        outs = []
        for r in res:
            c = r.outputs[0]
            ids = list(c.token_ids)
            if c.finish_reason == "stop" and isinstance(c.stop_reason, str):  # a generate.stop_strings entry
                outs.append(Output(ids, "stop"))
                continue
            eos = c.finish_reason == "stop"
            if eos and (not ids or ids[-1] != self.tok.eos_token_id):
                ids.append(c.stop_reason if isinstance(c.stop_reason, int) else self.tok.eos_token_id)
            outs.append(Output(ids, "eos" if eos else "length"))
        return outs


# ---------------------------------------------------------------- shards


# ---------------------------------------------------------------- self-instruct prompts

SELF_INSTRUCT_FILE = "self_instruct.jsonl"
# How the target writes its own prompts: sampled (diverse but mostly coherent at 0.8 / 0.95); the length
# limit is data.self_instruct_max_tokens.
SELF_INSTRUCT_SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 0, "num_samples": 1, "store_topk": 0,
                          "stop_strings": []}  # a written prompt ends at EOS
_MARKER = "\u2063SELF-INSTRUCT\u2063"


def user_turn_prefix(tok: Any, system_prompt: Optional[str] = None, shown: Sequence[str] = ()) -> list[int]:
    """Token ids of the chat template up to where a user message's text begins, after `shown` as
    earlier user turns."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError("data.self_instruct needs a tokenizer with a chat template (the target writes a user turn)")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": text} for text in (*shown, _MARKER)]
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as e:  # e.g. a template that insists user and assistant turns alternate
        if not shown:
            raise
        raise ConfigError(f"data.self_instruct_seeds: the chat template refuses {len(shown)} user turns in a row "
                          f"({e}); set data.self_instruct_seeds=null") from e
    if _MARKER not in text:
        raise ConfigError("data.self_instruct: the chat template does not show the user's text verbatim")
    return tok(text[: text.index(_MARKER)], add_special_tokens=False)["input_ids"]


def keep_self_instruct(samples: list[dict], n: int) -> list[dict]:
    """The usable prompts among the first n samples: ended by the model (not cut by the length
    limit), not empty, not a repeat of an earlier one."""
    seen, keep = set(), []
    for r in sorted(samples, key=lambda r: r["id"])[:n]:
        text = r["text"].strip()
        if r["finish_reason"] == "eos" and text and text.lower() not in seen:
            seen.add(text.lower())
            keep.append({**r, "text": text})
    return keep


def self_instruct_examples(cfg: DictConfig) -> dict[str, str]:
    """{prompt id: user text} the target may be shown before it writes a prompt (data.self_instruct_seeds):
    the prompts of that eval_data set that it does not evaluate; {} when off."""
    name = cfg.data.get("self_instruct_seeds")
    if not name:
        return {}
    pool = {row["id"]: [m["content"] for m in row["messages"] if m["role"] == "user"][-1]
            for row in trainable_prompts(cfg.eval_data[name])}
    if len(pool) < cfg.data.self_instruct_shots:
        raise ConfigError(f"data.self_instruct_shots={cfg.data.self_instruct_shots} but eval_data.{name} leaves "
                          f"only {len(pool)} prompts out of its evaluation; lower the shots or the eval limit")
    return pool


def self_instruct_rows(cfg: DictConfig, out: Path, tok: Any, state: Any) -> list[dict]:
    """data.self_instruct prompt rows, sampled once by the main process into out/self_instruct.jsonl
    (a larger count samples only the new ones); every process reads the same file."""
    n = int(cfg.data.self_instruct or 0)
    if n == 0:
        return []
    path = out / SELF_INSTRUCT_FILE
    pool = self_instruct_examples(cfg)
    limit = int(cfg.data.get("self_instruct_max_tokens", SELF_INSTRUCT_MAX_TOKENS))
    if state.is_main_process:
        have = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        # Each sample records the example prompts it was shown and its length limit; others mean other settings.
        def as_now(r: dict) -> bool:
            if r.get("max_new_tokens", SELF_INSTRUCT_MAX_TOKENS) != limit:
                return False
            if not pool:
                return "shown" not in r
            return len(r.get("shown", ())) == cfg.data.self_instruct_shots and set(r["shown"]) <= pool.keys()

        stale = [r["id"] for r in have if not as_now(r)]
        if stale and not cfg.generate.overwrite:
            raise ConfigError(f"{path} holds prompts written after other examples than data.self_instruct_seeds="
                              f"{cfg.data.get('self_instruct_seeds')} gives now, or with another "
                              f"data.self_instruct_max_tokens than {limit} ({stale[0]}, ...); set "
                              "generate.overwrite=true to sample them again, or choose another run_name")
        have = [] if stale else have
        if len(have) < n:
            ids = [f"self_instruct-{i:05d}" for i in range(len(have), n)]
            k = cfg.data.self_instruct_shots
            shown = {i: random.Random(row_seed(cfg.seed, i)).sample(sorted(pool), k) if pool else [] for i in ids}
            items = [Item(i, "self_instruct", "", "", user_turn_prefix(
                tok, cfg.data.system_prompt, [pool[j] for j in shown[i]]), row_seed(cfg.seed, i)) for i in ids]
            model, _ = load_target(cfg.model)
            sampling = {**SELF_INSTRUCT_SAMPLING, "max_new_tokens": limit}
            backend = HFBackend(OmegaConf.merge(cfg, {"generate": sampling}), model, tok)
            for item, o in tqdm(backend.stream(items), total=len(items), desc="self-instruct prompts", unit="prompt"):
                have.append({"id": item.id, "text": tok.decode(o.response_ids, skip_special_tokens=True),
                             "finish_reason": o.finish_reason, "max_new_tokens": limit,
                             **({"shown": shown[item.id]} if pool else {})})
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in sorted(have, key=lambda r: r["id"])))
            os.replace(tmp, path)
    state.wait_for_everyone()
    samples = [json.loads(line) for line in path.read_text().splitlines()]
    kept = keep_self_instruct(samples, n)
    log.info("self-instruct: %d of %d sampled prompts kept (ended, non-empty, distinct)", len(kept), n)
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
    return [{"id": r["id"], "source": "self_instruct", "category": "",
             "messages": system + [{"role": "user", "content": r["text"]}]} for r in kept]


def in_domain_spec(cfg: DictConfig) -> Optional[dict]:
    """What decides data.in_domain's rows (the eval_data sets), or None when it is off."""
    return OmegaConf.to_container(cfg.eval_data, resolve=True) if cfg.data.get("in_domain") else None


def trainable_prompts(ecfg: DictConfig) -> list[dict]:
    """An eval_data set's prompts that it does not evaluate (its shuffle, seed, skip and limit pick those)."""
    held_out = {row["id"] for row in load_prompts(ecfg)}
    every = load_prompts(OmegaConf.merge(ecfg, {"skip": 0, "limit": None}))
    return [row for row in every if row["id"] not in held_out]


def in_domain_rows(cfg: DictConfig) -> list[dict]:
    """data.in_domain prompt rows: every prompt of each eval_data source except those the set evaluates,
    so training never sees an evaluated prompt."""
    if not cfg.data.get("in_domain"):
        return []
    rows = []
    for name, ecfg in cfg.eval_data.items():
        if ecfg.get("turn", 1) != 1:  # second turns need the model's own first answers: evaluation only
            continue
        mine = trainable_prompts(ecfg)
        log.info("in-domain: %d eval_data.%s prompts trained on (the others are held out)", len(mine), name)
        rows += mine
    return rows


# ---------------------------------------------------------------- the stage


def run(cfg: DictConfig) -> dict:
    """Generate (or finish generating) runs/<run>/generate; returns the manifest's summary."""
    out = start_stage(cfg, "generate")
    g = cfg.generate
    if g.max_prompt_tokens < 1:
        raise ConfigError(f"generate.max_prompt_tokens={g.max_prompt_tokens} must be >= 1")
    # cpu=True lets a CPU-only `accelerate launch --multi_gpu` (torchrun) group form over gloo.
    state = PartialState(cpu=resolve_device(cfg.model.device).type == "cpu")
    rank, world = state.process_index, state.num_processes
    if world != int(os.environ.get("WORLD_SIZE", world)):  # every process would think it is rank 0
        raise ConfigError(f"launched as {os.environ['WORLD_SIZE']} processes but accelerate formed a group of "
                          f"{world}; on CPU use `accelerate launch --multi_gpu --num_processes N` (see the docstring)")
    tok = load_tokenizer(cfg.model.target, cfg.model.revision, cfg.model.cache_dir,
                         trust_remote_code=cfg.model.trust_remote_code)
    if cfg.model.draft_init == "pretrained":  # a draft that cannot share the target's tokenizer stops the run now
        check_tokenizers(tok, load_tokenizer(cfg.model.draft, cache_dir=cfg.model.cache_dir, what="model.draft"),
                         cfg.model.target, cfg.model.draft)
    ident = identity(cfg, tok)
    manifest_path = out / "manifest.json"

    # Finished with these settings and this prompt set: return the summary (the pipeline relies on it).
    if manifest_path.exists():
        man = read_json(manifest_path)
        if (man.get("complete") and man.get("identity") == ident and man.get("data_limit") == cfg.data.limit
                and man.get("data_self_instruct", 0) == cfg.data.self_instruct
                and man.get("data_in_domain") == in_domain_spec(cfg)
                and all((out / s).exists() for s in man.get("shards", []))):
            return man["summary"]

    # Data made with other settings: refuse, or clear it with overwrite=true.
    files = shard_paths(out)
    stale = [f for f in files if shard_identity(f) != ident]
    if stale and not g.overwrite:
        diffs = differences(ident, shard_identity(stale[0]))
        raise ConfigError(
            f"{out} holds {len(stale)} shard(s) made with other settings ({'; '.join(diffs[:4])}); "
            "set generate.overwrite=true to replace them, or choose another run_name")
    state.wait_for_everyone()
    if state.is_main_process:
        for p in out.glob(".shard-*.tmp-*"):  # a crash inside a shard leaves at most a temp file
            p.unlink(missing_ok=True)
        if stale:
            log.warning("generate.overwrite=true: removing %d shards made with other settings", len(files))
            for p in files:
                p.unlink()
            manifest_path.unlink(missing_ok=True)
            (out / SELF_INSTRUCT_FILE).unlink(missing_ok=True)  # written by the old model too
    state.wait_for_everyone()

    model_config = AutoConfig.from_pretrained(  # the context length, without loading weights
        resolve_model_path(cfg.model.target, cfg.model.cache_dir), revision=cfg.model.revision,
        trust_remote_code=cfg.model.trust_remote_code)
    extra = self_instruct_rows(cfg, out, tok, state) + in_domain_rows(cfg)
    items, counts = build_items(cfg, tok, model_config, rank, world, extra)
    done = record_ids(out)
    todo = [it for it in items if it.id not in done]
    expected = [it.id for it in items]

    new_tokens, seconds = _generate(cfg, out, todo, tok, ident, rank, state) if todo else (0, 0.0)

    per_rank = gather_object([{"expected": expected, "skipped": counts["skipped"], "truncated": counts["truncated"],
                               "new_tokens": new_tokens, "seconds": seconds}])
    if not any(r["expected"] for r in per_rank):  # every prompt skipped as too long: nothing to train on
        limit = prompt_token_limit(g.max_prompt_tokens, model_config, g.max_new_tokens)
        raise ConfigError(
            f"all {counts['prompts']} prompts are longer than the prompt limit of {limit} tokens "
            f"(generate.max_prompt_tokens={g.max_prompt_tokens}, within the target's context less "
            f"generate.max_new_tokens={g.max_new_tokens}), so there is nothing to answer; raise "
            "generate.max_prompt_tokens, or set generate.overlong=truncate to keep each prompt's last tokens")
    summary: dict = {}
    if state.is_main_process:
        summary = _write_manifest(cfg, out, ident, counts["prompts"], per_rank, world)
    state.wait_for_everyone()
    if not state.is_main_process:
        summary = read_json(manifest_path)["summary"]
    return summary


def _generate(cfg: DictConfig, out: Path, todo: list[Item], tok: Any, ident: dict, rank: int, state: Any) -> tuple[int, float]:
    """Decode `todo` (longest prompts first), writing a shard per shard_size finished records -> (new tokens, seconds)."""
    g = cfg.generate
    if g.backend == "vllm":
        backend = VLLMBackend(cfg, tok)
    else:
        mcfg = cfg.model
        if mcfg.device == "auto" and state.num_processes > 1:  # one device per process
            mcfg = OmegaConf.merge(mcfg, {"device": str(state.device)})
        model, _ = load_target(mcfg)
        backend = HFBackend(cfg, model, tok)
    n_next = 1 + max([int(p.stem.split("-")[-1]) for p in out.glob(f"shard-r{rank}-*.parquet")] or [-1])
    buf_items: list[Item] = []
    buf_out: list[Output] = []
    tokens, n_done, t0 = 0, 0, time.perf_counter()
    bar = tqdm(total=len(todo), unit="rec", desc=f"generate[r{rank}]", disable=not state.is_main_process)
    for item, output in backend.stream(todo):
        buf_items.append(item)
        buf_out.append(output)
        tokens, n_done = tokens + len(output.response_ids), n_done + 1
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.1f}", refresh=False)
        if len(buf_items) >= g.shard_size or n_done == len(todo):
            write_shard(out, f"shard-r{rank}-{n_next:05d}.parquet", buf_items, buf_out, g, ident, tok)
            n_next, buf_items, buf_out = n_next + 1, [], []
    bar.close()
    return tokens, time.perf_counter() - t0


def _write_manifest(cfg: DictConfig, out: Path, ident: dict, n_prompts: int, per_rank: list[dict], world: int) -> dict:
    files = shard_paths(out)
    tot = totals(files)
    expected = {i for r in per_rank for i in r["expected"]}
    missing = expected - set(tot["ids"])
    skipped = sorted(i for r in per_rank for i in r["skipped"])
    new_tokens = sum(r["new_tokens"] for r in per_rank)
    seconds = max(r["seconds"] for r in per_rank)
    summary = {
        "stage": "generate", "dir": str(out), "complete": not missing, "prompts": n_prompts,
        "skipped": len(skipped), "truncated": sum(r["truncated"] for r in per_rank), "records": tot["records"],
        "prompt_tokens": tot["prompt_tokens"], "response_tokens": tot["response_tokens"],
        "finish_reasons": tot["finish_reasons"], "new_tokens": new_tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(new_tokens / seconds, 2) if seconds > 0 else 0.0,
    }
    atomic_write_json(out / "manifest.json", {
        "model": cfg.model.target, "tokenizer_fingerprint": ident["tokenizer_fingerprint"],
        "sampling": ident["sampling"], "complete": not missing, "identity": ident, "data_limit": cfg.data.limit,
        "data_self_instruct": cfg.data.self_instruct, "data_in_domain": in_domain_spec(cfg),
        "num_processes": world, "backend": cfg.generate.backend, "summary": summary,
        "shards": [f.name for f in files], "skipped_ids": skipped, "missing_ids": sorted(missing), "ids_done": tot["ids"],
    })
    log.info("generate: %d prompts (%d skipped, %d truncated) -> %d records, %d new tokens in %.1f s = %.1f tokens/s -> %s",
             n_prompts, len(skipped), summary["truncated"], tot["records"], new_tokens, seconds,
             summary["tokens_per_s"], out)
    return summary


@stage_main("generate")
def main(cfg: DictConfig) -> None:
    cli(run, cfg)


if __name__ == "__main__":
    main()
