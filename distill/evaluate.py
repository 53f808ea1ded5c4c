"""Evaluate drafts inside the lossless speculative decoder: α, τ, c, speedup, a report and plots.

    python -m distill.evaluate model=tiny experiment=smoke evaluate.drafts=[]      # seconds on CPU
    python -m distill.evaluate experiment=smoke                    # SmolLM2: best + references, minutes on CPU
    python -m distill.evaluate experiment=smoke evaluate.drafts=[checkpoints] evaluate.gammas=[1,2,4]
    python -m distill.evaluate evaluate.drafts=[path/to/draft,'runs/x/distill/checkpoint-*'] \
        evaluate.references=[target] evaluate.temperatures=[0,0.7] evaluate.batch_sizes=[1,4]

Drafts (evaluate.drafts): paths, globs, a hub id, or the names "best" (runs/<run>/distill/best) and
"checkpoints" (every runs/<run>/distill/checkpoint-*). References (evaluate.references): target
(alone: the speed baseline), init (the undistilled draft from model.draft_init), prompt_lookup,
hf_assisted (transformers assisted generation with the first draft and a constant γ; batch 1, greedy).

Writes runs/<run>/evaluate/report.json (every number with its settings, plus definitions), report.md
and plots/ (rendered by distill/report.py). Exit codes: 0 ok; 2 bad input (one message); 1 a
speculative greedy output differed from the target's own where no float tie explains it (a decoder
bug; the report is written first).

How it measures: every row decodes the same prompts in the same batches (formed within one
category, so per-category α comes from the decoder's own counters) with the same max_new_tokens and
seeds. For each (set, batch size, temperature) the target alone and every speculative decoder
(all drafts and γ) are timed `repeats` times after `warmup` untimed runs of the first batch,
interleaved (repeat r runs each decoder in turn), so a shared machine's drift hits all alike;
speedup = median target-alone wall ÷ median speculative wall, and c uses that run's target step.
α_TF scores the target-alone answers of the same setting (greedy, or sampled at that temperature),
so it sees contexts distributed as the ones the speculative decoder visits and estimates the same α.
"""
from __future__ import annotations

import copy
import glob
import json
import logging
import os
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from distill import report as report_mod
from distill.config import ConfigError, run_dir
from distill.data import encode_prompt, load_prompts, prompt_token_limit
from distill.templates import CHAT, effective_template
from distill.doctor import diagnose
from distill.generate import record_ids
from distill.models import (
    check_tokenizers,
    load_draft,
    load_model,
    load_target,
    load_tokenizer,
    run_draft_vocab,
    shared_vocab_size,
)
from distill.utils import atomic_write_json, cli, start_stage
from specdec.decoder import DecodeResult, SpeculativeDecoder, autoregressive_generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.kv import KVModel
from specdec.metrics import SpecMetrics, teacher_forced_acceptance
from specdec.sampling import SamplingParams, logits_to_probs

log = logging.getLogger(__name__)
FLOAT_TIE_GAP = 1e-4  # ARCHITECTURE.md "Lossless means lossless"
EXIT_GREEDY_MISMATCH = 1


class GreedyMismatch(RuntimeError):
    """Speculative greedy tokens differed from the target's own greedy tokens (not a float tie)."""


@dataclass
class Prompt:
    id: str
    category: str
    ids: list[int]


@dataclass
class EvalSet:
    name: str
    prompts: list[Prompt]
    skipped: int  # prompts longer than the prompt limit
    template: str = "chat"  # how its prompts were rendered (distill.templates.effective_template)

    def batches(self, size: int) -> list[list[int]]:
        """Prompt indices in batches of `size`, never mixing categories (first-appearance order)."""
        cats = list(dict.fromkeys(p.category for p in self.prompts))
        out = []
        for c in cats:
            idx = [i for i, p in enumerate(self.prompts) if p.category == c]
            out += [idx[i : i + size] for i in range(0, len(idx), size)]
        return out


@dataclass
class Timed:
    walls: list[float]  # seconds per timed repeat
    results: list[DecodeResult]  # per batch, from the last repeat
    batches: list[list[int]]

    def tokens(self, n: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(n)]
        for b, res in zip(self.batches, self.results):
            for i, toks in zip(b, res.tokens):
                out[i] = toks
        return out


# -- inputs ---------------------------------------------------------------------------------------
def _step(p: str) -> tuple[int, str]:
    m = re.search(r"checkpoint-(\d+)$", str(p).rstrip("/"))
    return (int(m.group(1)) if m else -1, str(p))


def resolve_drafts(cfg: DictConfig) -> list[tuple[str, str]]:
    """(name, path or model id) of every draft in evaluate.drafts, de-duplicated; ConfigError when a
    name or glob matches nothing."""
    ddir = Path(run_dir(cfg)) / "distill"
    found: list[tuple[str, str]] = []
    for spec in cfg.evaluate.drafts:
        spec = str(spec)
        if spec == "best":
            if not (ddir / "best").is_dir():
                raise ConfigError(f"evaluate.drafts has 'best' but {ddir / 'best'} does not exist: run the distill "
                                  "stage first, or name drafts: evaluate.drafts=[<dir>] (or [] for references only)")
            paths = [str(ddir / "best")]
        elif spec == "checkpoints" or glob.has_magic(spec):
            pattern = str(ddir / "checkpoint-*") if spec == "checkpoints" else spec
            paths = sorted((p for p in glob.glob(pattern) if os.path.isdir(p)), key=_step)
            if not paths:
                raise ConfigError(f"evaluate.drafts: {pattern!r} matches no directory; check the path or run the "
                                  "distill stage first (it writes runs/<run>/distill/checkpoint-<step>)")
        elif os.path.exists(spec) or os.sep not in spec:
            paths = [spec]  # a directory, or a model id
        else:
            raise ConfigError(f"evaluate.drafts: {spec!r} does not exist; pass a model dir, a glob or a hub id")
        found += [(os.path.basename(p.rstrip("/")) or p, p) for p in paths]
    unique, seen = [], set()
    for name, path in found:
        key = os.path.realpath(path) if os.path.exists(path) else path
        if key not in seen:
            seen.add(key)
            unique.append((name, path))
    # A taken name grows by parent dirs until it tells the same-named drafts apart: S6/distill/best.
    parts = [Path(path.rstrip("/")).parts for _, path in unique]
    out, names = [], {"target", "init", "prompt_lookup", "hf_assisted"}
    for i, (name, path) in enumerate(unique):
        k = 1
        while name in names and k < len(parts[i]):
            k += 1
            suffix = parts[i][-k:]
            if all(p[-k:] != suffix for j, p in enumerate(parts) if j != i):
                name = "/".join(suffix)
        if name in names:  # nothing in the path tells it apart (a model id spelled "target")
            name = f"{name}#{i + 1}"
        names.add(name)
        out.append((name, path))
    return out


def _load_target(cfg: DictConfig):
    try:
        return load_target(cfg.model)
    except ConfigError:
        raise
    except Exception as e:  # a missing dir without '/', an unreachable hub id, a broken model
        raise ConfigError(f"model.target={cfg.model.target!r} could not be loaded ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); pass an existing model dir, a reachable "
                          "hub id, or model=smollm2 (embedded)") from e


def load_eval_sets(cfg: DictConfig, tok, target) -> list[EvalSet]:
    """Each eval_data set encoded for the target; prompts_per_set picks round-robin over categories."""
    e = cfg.evaluate
    limit = prompt_token_limit(e.max_prompt_tokens, target.config, e.max_new_tokens)
    sets = []
    for name, dcfg in cfg.eval_data.items():
        ds = load_prompts(dcfg)
        template = dcfg.get("template") or cfg.data.get("template")  # null: the template the draft trained with
        prompts, skipped = [], 0
        for row in ds:
            ids = encode_prompt(tok, row["messages"], template=template)
            if len(ids) > limit:
                skipped += 1
                continue
            prompts.append(Prompt(row["id"], row["category"] or name, ids))
        if not prompts:
            raise ConfigError(f"eval_data.{name}: all {len(ds)} prompts are longer than {limit} tokens; raise "
                              "evaluate.max_prompt_tokens or lower evaluate.max_new_tokens")
        n = e.prompts_per_set
        if n is not None and n < len(prompts):
            by_cat: dict[str, list[Prompt]] = {}
            for p in prompts:
                by_cat.setdefault(p.category, []).append(p)
            picked = []
            while len(picked) < n:
                for c in by_cat:
                    if by_cat[c] and len(picked) < n:
                        picked.append(by_cat[c].pop(0))
            prompts = picked
        if skipped:
            log.warning("eval_data.%s: skipped %d prompts longer than %d tokens", name, skipped, limit)
        sets.append(EvalSet(name, prompts, skipped, effective_template(tok, template)))
    return sets


# -- measurement ----------------------------------------------------------------------------------
def merge_metrics(parts: list[SpecMetrics], batch_size: int) -> SpecMetrics:
    """Sum the decoder's counters over batches (the definitions then apply to the sums)."""
    return SpecMetrics.merge(parts, batch_size)


def _timed(decoders: list[Callable[[list[list[int]], int], DecodeResult]], es: EvalSet, bs: int, warmup: int,
           repeats: int, seed: int) -> list[Timed]:
    """Warm each decoder up on the first batch (untimed), then time `repeats` passes over every batch,
    interleaved (repeat r runs every decoder in turn) so drift on a shared machine hits all alike."""
    batches = es.batches(bs)
    for decode in decoders:
        for _ in range(warmup):
            decode([es.prompts[i].ids for i in batches[0]], seed)
    out = [Timed([], [], batches) for _ in decoders]
    for _ in range(repeats):
        for decode, t in zip(decoders, out):
            t0 = time.perf_counter()
            t.results = [decode([es.prompts[i].ids for i in b], seed + j) for j, b in enumerate(batches)]
            t.walls.append(time.perf_counter() - t0)
    return out


def _first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return j if j is not None or len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def greedy_check(target, es: EvalSet, reference: list[list[int]], got: list[list[int]], vocab: int):
    """(mismatches, float ties): per prompt, the first position where speculative greedy tokens
    differ from the target's, with the target's top-2 logit gap there (tie if < FLOAT_TIE_GAP)."""
    bad, ties = [], []
    dev = next(target.parameters()).device
    for p, ref, out in zip(es.prompts, reference, got):
        j = _first_divergence(ref, out)
        if j is None:
            continue
        logits = target(torch.tensor([p.ids + ref[:j]], device=dev)).logits[0, -1, :vocab].float()  # [V]
        top = logits.topk(2).values
        gap = float(top[0] - top[1])
        item = {"prompt_id": p.id, "position": j, "gap": gap,
                "expected": ref[j] if j < len(ref) else None, "got": out[j] if j < len(out) else None}
        (ties if gap < FLOAT_TIE_GAP else bad).append(item)
    return bad, ties


@torch.inference_mode()
def teacher_forced(target, draft, es: EvalSet, reference: list[list[int]], temps, top_p: float, vocab: int,
                   draft_vocab: Optional[torch.Tensor] = None):
    """α_TF per temperature: Σ_x min(p, q) averaged over every target-generated position. With a
    draft vocabulary, q is the draft's distribution over those ids (zero elsewhere), as decoded."""
    dev = next(target.parameters()).device
    sums, n = {t: 0.0 for t in temps}, 0
    for p, resp in zip(es.prompts, reference):
        if not resp:
            continue
        ids = torch.tensor([p.ids + resp], device=dev)
        span = slice(len(p.ids) - 1, len(p.ids) - 1 + len(resp))  # positions that predict the response
        tl, dl = target(ids).logits[0, span, :vocab], draft(ids).logits[0, span, :vocab]  # [n, V]
        for t in temps:
            params = SamplingParams(t, 0, top_p)
            if draft_vocab is None:
                q = logits_to_probs(dl, params)
            else:
                sub = draft_vocab.to(dl.device)
                q = torch.zeros_like(dl).index_copy_(1, sub, logits_to_probs(dl[:, sub], params))  # [n, V]
            sums[t] += teacher_forced_acceptance(logits_to_probs(tl, params), q) * len(resp)
        n += len(resp)
    return {t: (s / n if n else None) for t, s in sums.items()}


def _median_spread(base: list[float], walls: list[float]) -> tuple[float, list[float]]:
    mb = statistics.median(base)
    return mb / statistics.median(walls), [mb / max(walls), mb / min(walls)]


def metrics_row(m: SpecMetrics, timed: Timed, base: Timed, es: EvalSet, **info) -> dict[str, Any]:
    """One report row from the merged counters of the last repeat and the median wall times."""
    d = m.to_dict()
    speedup, spread = _median_spread(base.walls, timed.walls)
    wall = statistics.median(timed.walls)
    by_cat: dict[str, list[SpecMetrics]] = {}
    for b, res in zip(timed.batches, timed.results):
        by_cat.setdefault(es.prompts[b[0]].category, []).append(res.metrics)
    cats = {}
    for c, parts in by_cat.items():
        cm = merge_metrics(parts, m.batch_size)
        cats[c] = {"acceptance_rate": cm.acceptance_rate, "tokens_per_target_call": cm.tokens_per_target_call,
                   "prompts": sum(x.batch_size for x in parts)}
    return {
        **info, "eval_set": es.name, "temperature": m.temperature, "top_p": m.top_p, "gamma": m.gamma,
        "gamma_policy": m.gamma_policy, "mean_gamma": d["mean_gamma"], "batch_size": m.batch_size,
        "draft_sampled": m.draft_sampled, "prompts": len(es.prompts),
        **{k: d[k] for k in ("acceptance_rate", "draft_acceptance_ratio", "tokens_per_target_call",
                             "per_position_acceptance", "cost_ratio", "predicted_speedup",
                             "expected_tokens_per_call", "draft_step_s", "target_step_s")},
        "teacher_forced_acceptance": None, "tokens_per_s": m.emitted / wall if wall else None,
        "speedup": speedup, "speedup_spread": spread, "wall_time_s": wall, "wall_times_s": timed.walls,
        "draft_time_s": m.draft_time_s, "target_time_s": m.target_time_s, "prefill_time_s": m.prefill_time_s,
        "verify_call_s": m.target_time_s / m.target_calls if m.target_calls else None,
        "greedy_identical": None, "float_ties": [], "greedy_mismatches": [],
        "by_category": cats, "accepted_length_histogram": d["accepted_length_histogram"],
        "counters": {k: d[k] for k in ("target_calls", "row_rounds", "draft_calls", "proposed", "accepted",
                                       "rejections", "emitted", "tried_at", "accepted_at")},
        "error": None,
    }


def _hf_generate(target, ids: list[int], max_new: int, eos: int, pad: int, assistant=None) -> list[int]:
    x = torch.tensor([ids], device=next(target.parameters()).device)
    out = target.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                          temperature=None, top_p=None, top_k=None, assistant_model=assistant,
                          eos_token_id=eos, pad_token_id=pad)
    return out[0, x.shape[1]:].tolist()


@torch.inference_mode()
def hf_assisted_rows(target, draft, name: str, path: Optional[str], es: EvalSet, e, eos: int, pad: int,
                     bar) -> list[dict]:
    """transformers assisted generation (batch 1, greedy, constant γ) vs transformers' plain generate."""
    def timed(assistant):
        def dec(batch, seed):
            toks = _hf_generate(target, batch[0], e.max_new_tokens, eos, pad, assistant)
            return DecodeResult([toks], ["eos" if eos in toks else "length"])
        return dec

    gc = copy.deepcopy(draft.generation_config)
    rows = []
    for gamma in e.gammas:
        bar.set_postfix_str(f"hf_assisted {es.name} γ={gamma}")
        draft.generation_config.num_assistant_tokens = gamma
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0  # never stop a draft block early
        plain, run = _timed([timed(None), timed(draft)], es, 1, e.warmup, e.repeats, e.seed)
        speedup, spread = _median_spread(plain.walls, run.walls)
        emitted, plain_emitted = (sum(len(r.tokens[0]) for r in x.results) for x in (run, plain))
        wall = statistics.median(run.walls)
        rows.append({"name": "hf_assisted", "kind": "hf_assisted", "draft": path, "assistant": name,
                     "eval_set": es.name, "temperature": 0.0, "top_p": 1.0, "gamma": gamma,
                     "gamma_policy": "constant", "batch_size": 1, "draft_sampled": False, "prompts": len(es.prompts),
                     "tokens_per_s": emitted / wall, "speedup": speedup, "speedup_spread": spread,
                     "speedup_baseline": "transformers generate() without an assistant",
                     "baseline_tokens_per_s": plain_emitted / statistics.median(plain.walls),
                     "wall_time_s": wall, "wall_times_s": run.walls, "greedy_identical": None, "error": None})
        bar.update(1)
    draft.generation_config = gc
    return rows


# -- the stage ------------------------------------------------------------------------------------
def _candidates(cfg: DictConfig, tok) -> list[dict]:
    """Model drafts to evaluate, tokenizers checked up front (a mismatch stops the run before work)."""
    out = []
    for name, path in resolve_drafts(cfg):
        c = {"name": name, "kind": "model", "draft": path, "error": None}
        try:
            dtok = load_tokenizer(path, cache_dir=cfg.model.cache_dir)
        except Exception as e:
            c["error"] = f"no loadable tokenizer ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        else:
            check_tokenizers(tok, dtok, f"target {cfg.model.target}", f"draft {name} ({path})")
        out.append(c)
    refs = cfg.evaluate.references
    if "init" in refs:
        out.append({"name": "init", "kind": "model", "draft": None, "error": None})
    if "prompt_lookup" in refs:
        out.append({"name": "prompt_lookup", "kind": "prompt_lookup", "draft": None, "error": None})
    return out


def _load_candidate(cfg: DictConfig, c: dict, target, tok):
    m = cfg.model
    if c["name"] == "init" and c["draft"] is None:
        return load_draft(m, target, tok)
    return load_model(c["draft"], m.dtype, m.device, None, m.trust_remote_code, m.cache_dir)


def _dir_stamp(path: Optional[str]) -> Any:
    """Names, sizes and mtimes of a draft dir's files: changes when a checkpoint is rewritten."""
    if not path or not os.path.isdir(path):
        return path
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(path).iterdir() if f.is_file())


def fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """Everything a report depends on; an equal fingerprint means the report on disk is current."""
    eval_data = OmegaConf.to_container(cfg.eval_data, resolve=True)
    for d in eval_data.values():
        if d.get("template") is None:
            d.pop("template", None)  # the default: reports made before the field existed stay current
    fp = {"model": OmegaConf.to_container(cfg.model, resolve=True),
          "evaluate": OmegaConf.to_container(cfg.evaluate, resolve=True),
          "eval_data": eval_data,
          "drafts": [(name, path, _dir_stamp(path)) for name, path in resolve_drafts(cfg)]}
    if cfg.data.get("template") not in (None, CHAT):  # the eval sets' prompts follow it
        fp["template"] = cfg.data.template
    return fp


def _current_report(out: Path, fp: dict[str, Any]) -> Optional[dict]:
    path = out / "report.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    return report if report.get("fingerprint") == json.loads(json.dumps(fp)) else None


def run(cfg: DictConfig) -> dict:
    out = start_stage(cfg, "evaluate")
    e = cfg.evaluate
    fp = fingerprint(cfg)
    done = _current_report(out, fp)
    if done is not None:  # resumable: the same drafts and settings were measured already
        log.info("evaluate: %s is current (same drafts and settings); delete it to measure again",
                 out / "report.json")
        if not done["greedy_identical"]:
            raise GreedyMismatch(f"the report in {out / 'report.json'} records a greedy mismatch: a decoder bug")
        return {"report": str(out / "report.json"), "best": done["best"], "greedy_identical": True,
                "rows": len(done["rows"]), "skipped": True}
    target, tok = _load_target(cfg)
    cands = _candidates(cfg, tok)
    sets = load_eval_sets(cfg, tok, target)
    eos, pad, vocab = tok.eos_token_id, tok.pad_token_id, shared_vocab_size(tok, target)
    draft_vocab = run_draft_vocab(cfg, vocab, tok)  # None: the drafts' whole vocabulary
    temps, grid = list(e.temperatures), [(bs, t) for bs in e.batch_sizes for t in e.temperatures]
    rows: list[dict] = []
    models: dict[str, Any] = {}  # candidate name -> loaded draft (None: prompt lookup)
    for c in cands:  # all loaded up front: every setting times all decoders side by side
        if c["kind"] == "model" and not c["error"]:
            try:
                model = _load_candidate(cfg, c, target, tok)
                c["vocab"] = shared_vocab_size(tok, target, model)
                models[c["name"]] = model
            except ConfigError:
                raise
            except Exception as err:
                c["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                log.warning("draft %s (%s) could not be loaded: %s", c["name"], c["draft"], c["error"])
        elif c["kind"] == "prompt_lookup":
            models[c["name"]] = None
        if c["error"]:
            rows.append({"name": c["name"], "kind": c["kind"], "draft": c["draft"], "error": c["error"],
                         "eval_set": None, "greedy_identical": None})
    ok = [c for c in cands if not c["error"]]
    if draft_vocab is not None:  # checked before any timing: a draft that cannot use it stops the run now
        bad = [c["name"] for c in ok if models.get(c["name"]) is not None
               and not KVModel(models[c["name"]], c["vocab"]).lazy_head_ok]
        if bad:
            raise ConfigError(f"model.draft_vocab={cfg.model.draft_vocab} needs drafts whose logits are their LM head "
                              f"applied to the last hidden state; {bad} are not (logit scaling or soft-capping): "
                              "set model.draft_vocab=0")
    hf_draft = next((c for c in ok if c["kind"] == "model"), None) if "hf_assisted" in e.references else None
    per_set = len(grid) * (("target" in e.references) + len(ok) * len(e.gammas)) + len(e.gammas) * bool(hf_draft)
    total = len(sets) * per_set
    bar = tqdm(total=total, desc="evaluate", unit="setting", file=sys.stderr)

    def target_decode(temp):
        return lambda batch, seed: autoregressive_generate(
            target, batch, max_new_tokens=e.max_new_tokens, temperature=temp, top_p=e.top_p, seed=seed,
            eos_token_id=eos, pad_token_id=pad, vocab_size=vocab)

    def spec_decode(c: dict, gamma: int, temp: float):
        model = models[c["name"]]
        drafter = ModelDrafter(model, vocab=draft_vocab) if model is not None else PromptLookupDrafter()
        dec = SpeculativeDecoder(target, drafter, gamma=gamma, gamma_policy=e.gamma_policy,
                                 eos_token_id=eos, pad_token_id=pad, vocab_size=vocab)
        return lambda batch, seed: dec.generate(batch, max_new_tokens=e.max_new_tokens, temperature=temp,
                                                top_p=e.top_p, seed=seed)

    hf_rows: list[dict] = []  # appended after the decoder's rows
    for es in sets:
        # The target's own answers per temperature (greedy, or sampled at that temperature): α_TF is
        # scored on them, i.e. on contexts distributed as the ones speculative decoding visits.
        reference: dict[float, list[list[int]]] = {}
        set_rows: list[dict] = []
        for bs, t in grid:
            # One interleaved timing of the target alone and every speculative decoder on the same batches.
            specs = [(c, g) for c in ok for g in e.gammas]
            bar.set_postfix_str(f"{es.name} batch={bs} T={t:g}: target + {len(specs)} speculative")
            timed = _timed([target_decode(t)] + [spec_decode(c, g, t) for c, g in specs], es, bs, e.warmup,
                           e.repeats, e.seed)
            b = timed[0]
            bm = merge_metrics([r.metrics for r in b.results], bs)
            reference.setdefault(t, b.tokens(len(es.prompts)))
            if "target" in e.references:
                rows.append({**metrics_row(bm, b, b, es, name="target", kind="target", draft=None),
                             "gamma": 0, "acceptance_rate": None, "per_position_acceptance": [], "by_category": {}})
                bar.update(1)
            for (c, gamma), run_ in zip(specs, timed[1:]):
                m = merge_metrics([r.metrics for r in run_.results], bs)
                m.baseline_target_step_s = bm.target_step_s
                row = metrics_row(m, run_, b, es, name=c["name"], kind=c["kind"], draft=c["draft"])
                if t == 0:
                    n = len(es.prompts)
                    bad, ties = greedy_check(target, es, b.tokens(n), run_.tokens(n), vocab)
                    row.update(greedy_identical=not bad, greedy_mismatches=bad, float_ties=ties)
                set_rows.append(row)
                bar.update(1)
        tf = {(c["name"], t): teacher_forced(target, models[c["name"]], es, reference[t], [t], e.top_p, c["vocab"],
                                                draft_vocab)[t]
              for c in ok if models.get(c["name"]) is not None for t in temps}
        for row in set_rows:
            row["teacher_forced_acceptance"] = tf.get((row["name"], row["temperature"]))
        rows += set_rows
        if hf_draft is not None:
            hf_rows += hf_assisted_rows(target, models[hf_draft["name"]], hf_draft["name"], hf_draft["draft"],
                                        es, e, eos, pad, bar)
    bar.close()
    rows += hf_rows

    report = build_report(cfg, rows, sets, target)
    report["fingerprint"] = fp
    atomic_write_json(out / "report.json", report)
    report_mod.render(report, out)
    report_mod.print_summary(report)
    if not report["greedy_identical"]:
        raise GreedyMismatch("speculative greedy output differs from the target's own greedy output (see "
                             f"doctor in {out / 'report.json'}): a decoder bug")
    return {"report": str(out / "report.json"), "best": report["best"], "greedy_identical": True,
            "rows": len(rows)}


def trained_on(cfg: DictConfig, sets: list[EvalSet]) -> dict[str, int]:
    """Per set, how many evaluated prompts the run's generated (training) records answer. Above 0 the
    draft was trained on prompts it is measured on, and α overstates what it does on new ones."""
    answered = {rid.split("#")[0] for rid in record_ids(run_dir(cfg))}
    counts = {s.name: sum(p.id in answered for p in s.prompts) for s in sets}
    for s in sets:
        if counts[s.name]:
            log.warning("eval_data.%s: the draft was trained on %d of the %d prompts evaluated here; hold them out "
                        "(eval_data.%s.shuffle=true eval_data.%s.limit=N with data.in_domain, or another data.source)",
                        s.name, counts[s.name], len(s.prompts), s.name, s.name)
    return counts


def build_report(cfg: DictConfig, rows: list[dict], sets: list[EvalSet], target) -> dict:
    e = cfg.evaluate
    param = next(target.parameters())
    settings = {**OmegaConf.to_container(e, resolve=True), "draft_vocab": int(cfg.model.draft_vocab or 0),
                "device": str(param.device),
                "dtype": str(param.dtype).removeprefix("torch."), "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "eval_sets": {s.name: {"prompts": len(s.prompts), "skipped_overlong": s.skipped, "template": s.template,
                                       "categories": dict(Counter(p.category for p in s.prompts)),
                                       "source": OmegaConf.to_container(cfg.eval_data[s.name], resolve=True)}
                              for s in sets}}
    for name, n in trained_on(cfg, sets).items():
        settings["eval_sets"][name]["trained_on"] = n
    checked = [r["greedy_identical"] for r in rows if r.get("greedy_identical") is not None]
    return {"target": str(cfg.model.target), "run_name": cfg.run_name, "settings": settings,
            "definitions": report_mod.DEFINITIONS, "rows": rows, "greedy_identical": all(checked),
            "best": report_mod.pick_best(rows, list(e.temperatures), list(e.batch_sizes), e.top_p),
            "doctor": diagnose(rows)}


def main_cli(cfg: DictConfig) -> dict:
    """cli() plus exit 1 (after the report is written) when greedy output differs."""
    try:
        return cli(run, cfg)
    except GreedyMismatch as err:
        print(report_mod.red(f"FAILED: {err}"), file=sys.stderr)
        sys.exit(EXIT_GREEDY_MISMATCH)


@hydra.main(version_base="1.3", config_path="../conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    main_cli(cfg)


if __name__ == "__main__":
    main()
