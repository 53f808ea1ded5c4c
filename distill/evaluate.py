"""Evaluate drafts inside the lossless speculative decoder: α, τ, c, speedup with intervals, a report.

    python -m distill.evaluate model=tiny experiment=smoke evaluate.drafts=[]      # seconds on CPU
    python -m distill.evaluate experiment=smoke                    # SmolLM2: best + references, minutes on CPU
    python -m distill.evaluate experiment=smoke evaluate.drafts=[checkpoints] evaluate.gammas=[1,2,4]
    python -m distill.evaluate evaluate.drafts=[path/to/draft,'runs/x/distill/checkpoint-*'] \
        evaluate.references=[target] evaluate.temperatures=[0,0.7] evaluate.batch_sizes=[1,4]

Drafts (evaluate.drafts): paths, globs, a hub id, or the names "best" (runs/<run>/distill/best) and
"checkpoints" (every runs/<run>/distill/checkpoint-*). References (evaluate.references): target
(alone: the speed baseline), init (the undistilled draft from model.draft_init), prompt_lookup,
hf_assisted (transformers assisted generation with the first draft; batch 1, greedy, timed subset).

How it measures (distill/measure.py; docs/architecture.md, "Evaluation"):
- the target's greedy answers to every prompt of a set (evaluate.max_new_tokens each), and one
  teacher-forced pass of each draft over them (a feature head: one target pass and a γ-step unroll),
  give greedy α, τ and every counter for every γ by exact replay (specdec/replay.py), with 95%
  bootstrap intervals over prompts;
- `evaluate.timed_prompts` prompts per set are decoded for real at the timed γ (warm-up, then
  `repeats` interleaved timed runs): the costs (target step, verify call linear in its proposals,
  draft step, prefill), the measured speedup, the greedy identity check, and the cross-check that
  replayed counts equal decoded ones;
- modeled_speedup: the replayed counts of every prompt, at every γ, times the measured costs;
- sampled rows (T > 0) are decoded once on the timed subset, batch sizes > 1 decoded and timed there;
  α_TF at T > 0 scores the target's sampled answers to `evaluate.sampled_prompts` prompts per set.

Writes runs/<run>/evaluate/report.json (every number with its settings, plus definitions), report.md
and plots/ (rendered by distill/report.py). Exit codes: 0 ok; 2 bad input (one message); 1 speculative
greedy output differed from the target's own, or replayed counts from decoded ones, where no float tie
explains it (a decoder bug; the report is written first).

Why one module of this size: the stage's flow (candidates, replay, timing, checks, the report) reads
top to bottom here; the eval sets (distill/evalsets.py), the rows (eval_rows.py) and the measurements
(measure.py) are apart.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from distill import report as report_mod
from distill.config import DRAFT_KINDS, HEAD_STAGE, REFERENCES, ConfigError, stage_path
from distill.doctor import diagnose, noise_flags
from distill.eval_rows import decoded_row, hf_assisted_row, replayed_row, sampled_row, with_costs, with_timing
from distill.evalsets import EvalSet, load_eval_sets, round_robin
from distill.measure import (
    FLOAT_TIE_GAP,
    Answers,
    costs_from,
    greedy_check,
    head_teacher_forced,
    replay_check,
    teacher_forced,
    time_decoders,
)
from distill.models import (
    check_tokenizers,
    load_draft,
    load_model,
    load_target,
    load_tokenizer,
    shared_vocab_size,
)
from distill.records import check_records_owner, record_ids, run_draft_vocab
from distill.templates import CHAT
from distill.cli import cli, stage_main, start_stage
from distill.utils import atomic_write_json
from specdec.decoder import SpeculativeDecoder, autoregressive_generate
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.head_drafter import HeadDrafter, head_replay_proposals
from specdec.heads import FeatureHead, is_head_dir, load_head
from specdec.hybrid import HybridDrafter, HybridHeadDrafter
from specdec.kv import KVModel
from specdec.metrics import bootstrap_ci
from specdec.replay import Proposals, draft_argmax, hybrid_proposals, lookup_proposals, model_proposals, near_ties, replay

log = logging.getLogger(__name__)
EXIT_GREEDY_MISMATCH = 1


class GreedyMismatch(RuntimeError):
    """Speculative greedy tokens (or replayed counts) differed from the target's own (not a float tie)."""


# -- inputs ---------------------------------------------------------------------------------------
def _step(p: str) -> tuple[int, str]:
    m = re.search(r"checkpoint-(\d+)$", str(p).rstrip("/"))
    return (int(m.group(1)) if m else -1, str(p))


def resolve_drafts(cfg: DictConfig) -> list[tuple[str, str]]:
    """(name, path or model id) of every draft in evaluate.drafts, de-duplicated; ConfigError when a
    name or glob matches nothing."""
    ddir = stage_path(cfg, "distill")
    found: list[tuple[str, str]] = []
    for spec in cfg.evaluate.drafts:
        spec = str(spec)
        if spec in ("best", "head"):
            best = (ddir if spec == "best" else stage_path(cfg, HEAD_STAGE)) / "best"
            if not best.is_dir():
                how = "" if spec == "best" else " with head.also=true (or student=head run_name=<another run>)"
                raise ConfigError(f"evaluate.drafts has {spec!r} but {best} does not exist: run the distill stage "
                                  f"first{how}, or name drafts: evaluate.drafts=[<dir>] (or [] for references only)")
            if spec == "head":  # the head trained beside the standalone draft keeps its own name
                found.append(("head", str(best)))
                continue
            paths = [str(best)]
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
    out, names = [], set(REFERENCES)
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


# -- the stage ------------------------------------------------------------------------------------
def _candidates(cfg: DictConfig, tok) -> list[dict]:
    """Model drafts to evaluate, tokenizers checked up front (a mismatch stops the run before work), and
    the run's generated records (the draft vocabulary and the trained-on counts read them) checked to be
    this target's."""
    check_records_owner(cfg, tok)
    out = []
    for name, path in resolve_drafts(cfg):
        c = {"name": name, "kind": "model", "draft": path, "error": None}
        if is_head_dir(path):  # a feature head: its shape is checked against the target when loaded
            out.append({**c, "kind": "head"})
            continue
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
    first = next((c for c in out if c["kind"] == "model" and c["name"] != "init"), None)
    if "hybrid" in refs and first is not None:  # prompt lookup + the first draft
        out.append({"name": "hybrid", "kind": "hybrid", "draft": first["draft"], "model_of": first["name"],
                    "error": first["error"]})
    head = next((c for c in out if c["kind"] == "head"), None)
    if "hybrid" in refs and head is not None:  # prompt lookup + the first feature head
        out.append({"name": "hybrid_head", "kind": "hybrid", "draft": head["draft"], "model_of": head["name"],
                    "error": head["error"]})
    return out


def _load_candidate(cfg: DictConfig, c: dict, target, tok):
    m = cfg.model
    if c["name"] == "init" and c["draft"] is None:
        return load_draft(m, target, tok)
    if c["kind"] == "head":
        return load_head(c["draft"], target)
    return load_model(c["draft"], m.dtype, m.device, None, m.trust_remote_code, m.cache_dir, "evaluate.drafts")


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


class _Stage:
    """What one evaluation run holds: the target, the candidates and their models, the settings."""

    def __init__(self, cfg: DictConfig, target, tok, ok: list[dict], models: dict, draft_vocab, answers: Answers, bar):
        self.cfg, self.e, self.target, self.ok, self.models, self.draft_vocab, self.bar = (
            cfg, cfg.evaluate, target, ok, models, draft_vocab, bar)
        self.eos, self.pad, self.vocab = tok.eos_token_id, tok.pad_token_id, shared_vocab_size(tok, target)
        e, self.answers = self.e, answers
        # init is the distilled draft before training when both are full models of one shape: their steps
        # cost the same, so init borrows the distilled draft's timed costs instead of being timed itself
        size = lambda m: (type(m).__name__, sum(p.numel() for p in m.parameters()))  # noqa: E731
        twin = next((c["name"] for c in ok if c["kind"] == "model" and c["name"] != "init"), None)
        self.twin = {"init": twin} if (twin and "init" in models and models["init"] is not None
                                       and size(models["init"]) == size(models[twin])) else {}
        # the γ each candidate is timed at (default: every γ); an untimed γ is modeled with the largest's costs
        self.timed_gammas = sorted(set(e.timed_gammas or e.gammas))
        self.depth = max(e.gammas) * (2 if e.gamma_policy == "adaptive" else 1)  # the longest block replay asks

    def target_decode(self, temp: float, max_new: int):
        return lambda batch, seed, n=None: autoregressive_generate(
            self.target, batch, max_new_tokens=n or max_new, temperature=temp, top_p=self.e.top_p, seed=seed,
            eos_token_id=self.eos, pad_token_id=self.pad, vocab_size=self.vocab)

    def drafter(self, c: dict):
        model = self.models[c["name"]]
        return (PromptLookupDrafter() if c["kind"] == "prompt_lookup" else
                HybridHeadDrafter(model) if c["kind"] == "hybrid" and isinstance(model, FeatureHead) else
                HybridDrafter(model, vocab=self.draft_vocab) if c["kind"] == "hybrid" else
                HeadDrafter(model) if c["kind"] == "head" else ModelDrafter(model, vocab=self.draft_vocab))

    def spec_decode(self, c: dict, gamma: int, temp: float, max_new: int):
        dec = SpeculativeDecoder(self.target, self.drafter(c), gamma=gamma, gamma_policy=self.e.gamma_policy,
                                 eos_token_id=self.eos, pad_token_id=self.pad, vocab_size=self.vocab)
        return lambda batch, seed, n=None: dec.generate(batch, max_new_tokens=n or max_new, temperature=temp,
                                                        top_p=self.e.top_p, seed=seed)

    def proposals(self, prompts: list[list[int]], ids: list[str], y: list[list[int]]):
        """Per candidate: its greedy proposals for every prompt (replay's input), the prompts where a
        near-tie argmax could make decoding differ, and the first proposal's greedy agreement."""
        proposals, agree, tie_prompts = {}, {}, {}
        tfs: dict[int, list] = {}  # id(model) -> its teacher-forced argmax and gaps (a hybrid reuses its draft's)
        heads: dict[int, list] = {}  # id(head) -> its replayed proposals and gaps per prompt (the same)
        for c in self.ok:
            name, model = c["name"], self.models[c["name"]]
            if c["kind"] == "prompt_lookup":
                proposals[name] = [lookup_proposals(p, a) for p, a in zip(prompts, y)]
                continue
            if isinstance(model, FeatureHead):  # the head, or lookup + the head
                if id(model) not in heads:
                    heads[id(model)] = [head_replay_proposals(model, self.target, p, a, self.depth)
                                        for p, a in zip(prompts, y)]
                got = heads[id(model)]
                blocks = [_block_proposals(props.tolist()) for props, _ in got]
                tie_prompts[name] = {pid for pid, (_, gap) in zip(ids, got) if bool((gap < FLOAT_TIE_GAP).any())}
                if c["kind"] == "hybrid":
                    proposals[name] = [hybrid_proposals(p, a, b) for p, a, b in zip(prompts, y, blocks)]
                    continue
                proposals[name] = blocks
                agree[name] = [(int((props[:, 0] == torch.tensor(a)).sum()), len(a)) for (props, _), a in zip(got, y)]
                continue
            if id(model) not in tfs:
                tfs[id(model)] = [draft_argmax(model, p, a, c["vocab"], self.draft_vocab) for p, a in zip(prompts, y)]
            tf = tfs[id(model)]
            tie_prompts[name] = {pid for pid, (_, gap) in zip(ids, tf) if near_ties(gap, FLOAT_TIE_GAP)}
            if c["kind"] == "hybrid":
                proposals[name] = [hybrid_proposals(p, a, pred) for p, a, (pred, _) in zip(prompts, y, tf)]
                continue
            proposals[name] = [model_proposals(pred) for pred, _ in tf]
            agree[name] = [(sum(x == t for x, t in zip(pred, a)), len(a)) for (pred, _), a in zip(tf, y)]
        return proposals, agree, tie_prompts

    def measure(self, es: EvalSet) -> list[dict]:
        """Every row of one eval set (see the module docstring for what comes from where)."""
        e, target, bar = self.e, self.target, self.bar
        prompts, ids = [p.ids for p in es.prompts], [p.id for p in es.prompts]
        lens = [len(p) for p in prompts]
        temps = list(e.temperatures)
        bar.set_postfix_str(f"{es.name}: the target's answers")
        y = self.answers(prompts, 0.0)
        sampled = [prompts[i] for i in round_robin(es.prompts, e.sampled_prompts)]  # α_TF at T > 0 scores these
        answers = {t: self.answers(sampled, t) for t in temps if t > 0}
        # Greedy: one teacher-forced pass per model draft (a head: one target pass and a short unroll),
        # then exact replay for every γ.
        bar.set_postfix_str(f"{es.name}: replay")
        proposals, agree, tie_prompts = self.proposals(prompts, ids, y)
        stop = {self.eos}
        replayed = {(c["name"], g): [replay(a, prop, g, e.max_new_tokens, stop, e.gamma_policy)
                                     for a, prop in zip(y, proposals[c["name"]])]
                    for c in self.ok for g in e.gammas}
        # A candidate that accepted nothing anywhere cannot beat the target alone: it is not timed.
        timed_cands = [c for c in self.ok if any(m.accepted for g in e.gammas for m in replayed[(c["name"], g)])]
        tidx = round_robin(es.prompts, e.timed_prompts)
        sub = es.subset(tidx)
        sub_ids, sub_lens = [p.ids for p in sub.prompts], [len(p.ids) for p in sub.prompts]
        tmax = min(e.timed_max_new_tokens or e.max_new_tokens, e.max_new_tokens)
        y_t = [y[i][:tmax] for i in tidx]
        rows: list[dict] = []
        timed: dict[tuple[str, int], dict] = {}  # (candidate, γ) -> its greedy batch-1 run and costs
        gts = self.timed_gammas
        borrows = {n: t for n, t in self.twin.items() if any(c["name"] == t for c in timed_cands)}
        if tidx and 1 in e.batch_sizes:
            # Greedy, batch 1: the target alone and each candidate at the timed γ, interleaved repeats.
            specs = [(c, g) for c in timed_cands if c["name"] not in borrows for g in gts]
            bar.set_postfix_str(f"{es.name}: target + {len(specs)} speculative, timed")
            runs = time_decoders([self.target_decode(0.0, tmax)] + [self.spec_decode(c, g, 0.0, tmax) for c, g in specs],
                                 sub_ids, sub.batches(1), e.warmup, e.repeats, e.seed)
            base, bm = runs[0], runs[0].metrics(1)
            if "target" in e.references:
                row = decoded_row(base, base, sub, 1, None, name="target", kind="target", draft=None)
                rows.append({**row, "prompts": len(es.prompts), "gamma": 0, "acceptance_rate": None,
                             "acceptance_rate_ci": None, "per_position_acceptance": [], "by_category": {}})
            for (c, g), run_ in zip(specs, runs[1:]):
                row = decoded_row(run_, base, sub, 1, bm.target_step_s, name=c["name"], kind=c["kind"], draft=c["draft"])
                bad, ties = greedy_check(target, sub_ids, [p.id for p in sub.prompts], y_t, run_.tokens(len(tidx)),
                                         self.vocab)
                row.update(greedy_identical=not bad, greedy_mismatches=bad, float_ties=ties)
                timed[(c["name"], g)] = {"row": row, "run": run_, "costs": costs_from(bm, run_.metrics(1), sum(sub_lens))}
            bar.update(1)
        # Greedy, batch 1: replay over every prompt; a timed run's costs model every γ.
        for c in self.ok:
            for g in e.gammas:
                parts = replayed[(c["name"], g)]
                row = replayed_row(parts, es, name=c["name"], kind=c["kind"], draft=c["draft"])
                own = borrows.get(c["name"], c["name"])
                tr = timed.get((own, g)) or timed.get((own, gts[-1]))
                if own != c["name"] and tr is not None:
                    row["costs_of"] = own
                if tr is None:
                    row["not_timed"] = ("nothing accepted on any prompt: it cannot beat the target alone"
                                        if c not in timed_cands else "evaluate.timed_prompts=0 or no batch size 1")
                    rows.append(row)
                    continue
                row = with_costs(row, tr["costs"], lens, parts)
                if (own, g) not in timed:  # modeled with the costs of another γ's run (extrapolated)
                    row["costs_from_gamma"] = gts[-1]
                if own == c["name"] and (c["name"], g) in timed:  # a timed row: measured speedup, greedy identity, replay = decoding
                    props = [proposals[c["name"]][i] for i in tidx]
                    again = [replay(a, prop, g, tmax, stop, e.gamma_policy) for a, prop in zip(y_t, props)]
                    row = with_timing(row, tr["row"], tr["costs"], sub_lens, again)
                    ties = tie_prompts.get(c["name"], set()) | {x["prompt_id"] for x in row["float_ties"]}
                    row["replay_check"] = replay_check([p.id for p in sub.prompts], again,
                                                       [r.metrics for r in tr["run"].results], ties)
                rows.append(row)
        # Sampled, batch 1: each candidate decoded once on the timed subset at the largest timed γ (α and τ
        # by decoding; the speedup modeled from those counters and the greedy run's costs).
        for t in [t for t in temps if t > 0] if tidx and 1 in e.batch_sizes else []:
            bar.set_postfix_str(f"{es.name} T={t:g}: {len(timed_cands)} speculative, decoded once")
            runs = time_decoders([self.spec_decode(c, gts[-1], t, tmax) for c in timed_cands], sub_ids, sub.batches(1),
                                 0, 1, e.seed)
            for c, run_ in zip(timed_cands, runs):
                own = borrows.get(c["name"], c["name"])
                rows.append(sampled_row(run_, sub, len(es.prompts), timed[(own, gts[-1])]["costs"], t, e.top_p,
                                        name=c["name"], kind=c["kind"], draft=c["draft"]))
            bar.update(1)
        # Batch sizes > 1: decoded and timed on the subset, every candidate at every γ.
        for bs, t in [(bs, t) for bs in e.batch_sizes if bs > 1 for t in temps] if tidx else []:
            specs = [(c, g) for c in timed_cands for g in e.gammas]
            bar.set_postfix_str(f"{es.name} batch={bs} T={t:g}: target + {len(specs)} speculative, timed")
            runs = time_decoders([self.target_decode(t, tmax)] + [self.spec_decode(c, g, t, tmax) for c, g in specs],
                                 sub_ids, sub.batches(bs), e.warmup, e.repeats, e.seed)
            base = runs[0]
            bm = base.metrics(bs)
            if "target" in e.references:
                row = decoded_row(base, base, sub, bs, None, name="target", kind="target", draft=None)
                rows.append({**row, "prompts": len(es.prompts), "gamma": 0, "acceptance_rate": None,
                             "acceptance_rate_ci": None, "per_position_acceptance": [], "by_category": {}})
            for (c, g), run_ in zip(specs, runs[1:]):
                row = decoded_row(run_, base, sub, bs, bm.target_step_s, name=c["name"], kind=c["kind"], draft=c["draft"])
                if t == 0:
                    bad, ties = greedy_check(target, sub_ids, [p.id for p in sub.prompts], y_t, run_.tokens(len(tidx)),
                                             self.vocab)
                    row.update(greedy_identical=not bad, greedy_mismatches=bad, float_ties=ties)
                rows.append({**row, "prompts": len(es.prompts)})
            bar.update(1)
        # α_TF: greedy agreement over every prompt (from the replay's pass), sampled α_TF at T > 0.
        for c in self.ok:
            if c["kind"] not in DRAFT_KINDS:  # α_TF compares two distributions: a lookup has none
                continue
            model = self.models[c["name"]]
            tf = {0.0: agree[c["name"]]}
            for t in temps:
                if t > 0:
                    bar.set_postfix_str(f"{es.name}: α_TF of {c['name']} at T={t:g}")
                    tf[t] = (head_teacher_forced(target, model, sampled, answers[t], t, e.top_p, self.vocab)
                             if c["kind"] == "head" else
                             teacher_forced(target, model, sampled, answers[t], t, e.top_p, c["vocab"], self.draft_vocab))
            for row in rows:
                if row["name"] == c["name"] and row.get("temperature") in tf:
                    parts = tf[row["temperature"]]
                    n = sum(k for _, k in parts)
                    row["teacher_forced_acceptance"] = sum(s for s, _ in parts) / n if n else None
                    row["teacher_forced_acceptance_ci"] = bootstrap_ci([s for s, _ in parts], [k for _, k in parts])
        order = {"target": -1, **{c["name"]: i for i, c in enumerate(self.ok)}}
        return sorted(rows, key=lambda r: (order[r["name"]], r["temperature"], r["batch_size"], r["gamma"]))


def _block_proposals(blocks: list[list[int]]) -> Proposals:
    """Proposals from a table of blocks: row e is the block proposed after e emitted tokens."""
    return lambda e, k: blocks[e][:k] if e < len(blocks) else [-1] * k  # past y's end: never tested


def _best_gamma(rows: list[dict], name: str, default: int) -> int:
    scored = [r for r in rows if r["name"] == name and r.get("scored_by") == "replay"
              and isinstance(report_mod.headline_speedup(r), (int, float))]
    return max(scored, key=report_mod.headline_speedup)["gamma"] if scored else default


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
        _refuse_unloadable(done["rows"], out)
        return {"report": str(out / "report.json"), "best": done["best"], "greedy_identical": True,
                "rows": len(done["rows"]), "skipped": True}
    target, tok = _load_target(cfg)
    cands = _candidates(cfg, tok)
    answers = Answers(target, e.max_new_tokens, e.top_p, e.seed, tok.eos_token_id, tok.pad_token_id,
                      shared_vocab_size(tok, target), e.reference_batch_size)
    sets = load_eval_sets(cfg, tok, target, answers)
    vocab = shared_vocab_size(tok, target)
    draft_vocab = run_draft_vocab(cfg, vocab, tok)  # None: the drafts' whole vocabulary
    rows: list[dict] = []
    models: dict[str, Any] = {}  # candidate name -> loaded draft (None: prompt lookup)
    for c in cands:  # all loaded up front: every setting times all decoders side by side
        if c["kind"] in DRAFT_KINDS and not c["error"]:
            try:
                model = _load_candidate(cfg, c, target, tok)
                c["vocab"] = shared_vocab_size(tok, target, *([model] if c["kind"] == "model" else []))
                models[c["name"]] = model
            except ConfigError:
                raise
            except Exception as err:
                c["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                log.warning("draft %s (%s) could not be loaded: %s", c["name"], c["draft"], c["error"])
        elif c["kind"] == "prompt_lookup":
            models[c["name"]] = None
        elif c["kind"] == "hybrid" and not c["error"]:
            first = next(x for x in cands if x["name"] == c["model_of"])
            c["error"], c["vocab"] = first["error"], first.get("vocab")
            models[c["name"]] = models.get(first["name"])
        if c["error"]:
            rows.append({"name": c["name"], "kind": c["kind"], "draft": c["draft"], "error": c["error"],
                         "eval_set": None, "greedy_identical": None})
    ok = [c for c in cands if not c["error"]]
    if draft_vocab is not None:  # checked before any timing: a draft that cannot use it stops the run now
        bad = [c["name"] for c in ok if c["kind"] == "model" and models.get(c["name"]) is not None
               and not KVModel(models[c["name"]], c["vocab"]).lazy_head_ok]
        if bad:
            raise ConfigError(f"model.draft_vocab={cfg.model.draft_vocab} needs drafts whose logits are their LM head "
                              f"applied to the last hidden state; {bad} are not (logit scaling or soft-capping): "
                              "set model.draft_vocab=0")
    hf_draft = next((c for c in ok if c["kind"] == "model"), None) if "hf_assisted" in e.references else None
    per_set = len(e.batch_sizes) * len(e.temperatures) * bool(e.timed_prompts) + bool(hf_draft and e.timed_prompts)
    bar = tqdm(total=len(sets) * per_set, desc="evaluate", unit="setting", file=sys.stderr)
    stage = _Stage(cfg, target, tok, ok, models, draft_vocab, answers, bar)
    hf_rows: list[dict] = []  # appended after the decoder's rows
    for es in sets:
        set_rows = stage.measure(es)
        rows += set_rows
        if hf_draft is not None and e.timed_prompts:
            gamma = _best_gamma(set_rows, hf_draft["name"], e.gammas[0])
            bar.set_postfix_str(f"hf_assisted {es.name} γ={gamma}")
            sub = es.subset(round_robin(es.prompts, e.timed_prompts))
            tmax = min(e.timed_max_new_tokens or e.max_new_tokens, e.max_new_tokens)
            hf_rows.append(hf_assisted_row(target, models[hf_draft["name"]], hf_draft["name"], hf_draft["draft"], sub,
                                           gamma, tmax, e, stage.eos, stage.pad))
            bar.update(1)
    bar.close()
    rows += hf_rows

    report = build_report(cfg, rows, sets, target)
    report["fingerprint"] = fp
    atomic_write_json(out / "report.json", report)
    report_mod.render(report, out)
    report_mod.print_summary(report)
    if not report["greedy_identical"]:
        raise GreedyMismatch("speculative greedy output differs from the target's own greedy output, or replayed "
                             f"counts from decoded ones (see doctor in {out / 'report.json'}): a decoder bug")
    _refuse_unloadable(rows, out)
    return {"report": str(out / "report.json"), "best": report["best"], "greedy_identical": True,
            "rows": len(rows)}


def _refuse_unloadable(rows: list[dict], out: Path) -> None:
    """Exit 2 (ConfigError) after the report when a requested draft could not be loaded: its row is only an
    error, and a run that measured nothing of it must not pass as done."""
    bad = [f"{r['name']} ({r.get('draft')}): {r['error']}" for r in rows if r.get("kind") in DRAFT_KINDS and r.get("error")]
    if bad:
        raise ConfigError(f"{len(bad)} requested draft(s) could not be loaded: {'; '.join(bad)}. The report "
                          f"{out / 'report.json'} holds the rest; replace or remove them in evaluate.drafts")


def trained_on(cfg: DictConfig, sets: list[EvalSet]) -> dict[str, int]:
    """Per set, how many evaluated prompts the run's generated (training) records answer. Above 0 the
    draft was trained on prompts it is measured on, and α overstates what it does on new ones."""
    answered = {rid.split("#")[0] for rid in record_ids(stage_path(cfg, "generate"))}
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
    for row in rows:
        row["flagged"] = noise_flags(row, settings)
    checked = [r["greedy_identical"] for r in rows if r.get("greedy_identical") is not None]
    checked += [r["replay_check"]["equal"] for r in rows if r.get("replay_check")]
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


@stage_main("evaluate")
def main(cfg: DictConfig) -> None:
    main_cli(cfg)


if __name__ == "__main__":
    main()
