"""Rows of the evaluation report: from replayed counters, from decoded (timed) runs, and the HF reference.

Every row carries its settings, α and τ with 95% bootstrap intervals over prompts, the counters, and
(where timed) costs and speedups; docs/architecture.md lists the fields.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import torch

from distill.evalsets import EvalSet
from distill.measure import Timed, measured_speedup, modeled_speedup, time_decoders
from specdec.decoder import DecodeResult
from specdec.kv import logits_width
from specdec.metrics import SpecMetrics, bootstrap_ci, predicted_speedup

log = logging.getLogger(__name__)


def _ci_of(parts: list[SpecMetrics], num, den) -> Optional[list[float]]:
    return bootstrap_ci([float(num(m)) for m in parts], [float(den(m)) for m in parts])


def alpha_tau(parts: list[SpecMetrics]) -> dict[str, Any]:
    """α and τ of merged per-prompt (or per-batch) counters, with bootstrap intervals over the parts."""
    m = SpecMetrics.merge(parts)
    return {"acceptance_rate": m.acceptance_rate, "tokens_per_target_call": m.tokens_per_target_call,
            "acceptance_rate_ci": _ci_of(parts, lambda x: x.accepted, lambda x: x.accepted + x.rejections),
            "tokens_per_target_call_ci": _ci_of(parts, lambda x: x.emitted, lambda x: x.row_rounds)}


def counts_fields(m: SpecMetrics, parts: list[SpecMetrics], cats: dict[str, list[SpecMetrics]]) -> dict[str, Any]:
    """The fields every speculative row takes from its counters (decoded or replayed)."""
    d = m.to_dict()
    return {
        **alpha_tau(parts), "gamma": m.gamma, "gamma_policy": m.gamma_policy, "mean_gamma": d["mean_gamma"],
        **{k: d[k] for k in ("draft_acceptance_ratio", "per_position_acceptance", "expected_tokens_per_call")},
        "tokens": m.emitted, "accepted_length_histogram": d["accepted_length_histogram"],
        "by_category": {c: {"acceptance_rate": SpecMetrics.merge(ps).acceptance_rate,
                            "tokens_per_target_call": SpecMetrics.merge(ps).tokens_per_target_call,
                            "prompts": sum(x.batch_size for x in ps)} for c, ps in cats.items()},
        "counters": {k: d[k] for k in ("target_calls", "row_rounds", "draft_calls", "proposed", "accepted",
                                       "rejections", "emitted", "tried_at", "accepted_at")},
    }


def decoded_row(timed: Timed, base: Timed, es: EvalSet, bs: int, baseline_step: Optional[float], **info) -> dict:
    """A row from decoding the timed subset: counters and timers of the median repeat, median wall times."""
    m = timed.metrics(bs)
    m.baseline_target_step_s = baseline_step
    parts = [r.metrics for r in timed.results]
    cats: dict[str, list[SpecMetrics]] = {}
    for b, res in zip(timed.batches, timed.results):
        cats.setdefault(es.prompts[b[0]].category, []).append(res.metrics)
    d = m.to_dict()
    sp = measured_speedup(base, timed)
    return {
        **info, "eval_set": es.name, "temperature": m.temperature, "top_p": m.top_p, "batch_size": m.batch_size,
        "draft_sampled": m.draft_sampled, "prompts": len(es.prompts), "timed_prompts": len(es.prompts),
        "scored_by": "decoding", **counts_fields(m, parts, cats),
        **{k: d[k] for k in ("cost_ratio", "predicted_speedup", "draft_step_s", "target_step_s")},
        "teacher_forced_acceptance": None, "teacher_forced_acceptance_ci": None,
        "tokens_per_s": m.emitted / sp["wall_time_s"] if sp["wall_time_s"] else None, **sp,
        "draft_time_s": m.draft_time_s, "target_time_s": m.target_time_s, "prefill_time_s": m.prefill_time_s,
        "verify_call_s": m.target_time_s / m.target_calls if m.target_calls else None,
        "modeled_speedup": None, "modeled_speedup_ci": None, "modeled_speedup_timed": None,
        "greedy_identical": None, "float_ties": [], "greedy_mismatches": [], "replay_check": None, "error": None,
    }


def replayed_row(parts: list[SpecMetrics], es: EvalSet, **info) -> dict:
    """A greedy batch-1 row from replay over every prompt of the set; timing fields stay empty."""
    m = SpecMetrics.merge(parts)
    cats: dict[str, list[SpecMetrics]] = {}
    for p, part in zip(es.prompts, parts):
        cats.setdefault(p.category, []).append(part)
    empty = ("cost_ratio", "predicted_speedup", "draft_step_s", "target_step_s", "tokens_per_s", "speedup",
             "speedup_spread", "speedup_ci", "wall_time_s", "wall_times_s", "draft_time_s", "target_time_s",
             "prefill_time_s", "verify_call_s", "modeled_speedup", "modeled_speedup_ci", "modeled_speedup_timed",
             "greedy_identical", "replay_check", "teacher_forced_acceptance", "teacher_forced_acceptance_ci")
    return {**info, "eval_set": es.name, "temperature": 0.0, "top_p": 1.0, "batch_size": 1, "draft_sampled": False,
            "prompts": len(es.prompts), "timed_prompts": 0, "scored_by": "replay", **counts_fields(m, parts, cats),
            **dict.fromkeys(empty), "float_ties": [], "greedy_mismatches": [], "error": None}


def with_costs(row: dict, costs, prompt_tokens: list[int], parts: list[SpecMetrics]) -> dict:
    """A replayed (or once-decoded) row plus what its candidate's timed run measured: the costs, the
    cost ratio, and the speedup those costs model for its counters (every prompt, with an interval)."""
    if costs is None:
        return row
    c = costs.draft_step_s / costs.target_step_s if costs.target_step_s else None
    a, g = row["acceptance_rate"], row["mean_gamma"]
    full = modeled_speedup(costs, prompt_tokens, parts)
    return {**row, "cost_ratio": c, "draft_step_s": costs.draft_step_s, "target_step_s": costs.target_step_s,
            "verify_call_s": costs.verify_call_s(g or 0.0),
            "predicted_speedup": predicted_speedup(a, g, c) if None not in (a, g, c) else None,
            "modeled_speedup": full["value"], "modeled_speedup_ci": full["ci"]}


def with_timing(row: dict, dec: dict, costs, timed_tokens: list[int], timed_parts: list[SpecMetrics]) -> dict:
    """The row of the timed γ plus what decoding the timed subset measured: speedup, checks, and the
    modeled speedup of the same prompts (what the measured one checks)."""
    keep = ("tokens_per_s", "speedup", "speedup_spread", "speedup_ci", "wall_time_s", "wall_times_s", "draft_time_s",
            "target_time_s", "prefill_time_s", "greedy_identical", "float_ties", "greedy_mismatches", "timed_prompts")
    row = {**row, **{k: dec[k] for k in keep}}
    if costs is not None:
        row["modeled_speedup_timed"] = modeled_speedup(costs, timed_tokens, timed_parts)["value"]
    return row


def sampled_row(run: Timed, sub: EvalSet, prompts: int, costs, temperature: float, top_p: float, **info) -> dict:
    """A sampled (T > 0) batch-1 row from one untimed decoding of the subset: α and τ decoded, the
    speedup modeled from those counters and the greedy run's costs."""
    parts = [r.metrics for r in run.results]
    row = replayed_row(parts, sub, **info)
    row.update(temperature=temperature, top_p=top_p, draft_sampled=run.metrics(1).draft_sampled, prompts=prompts,
               decoded_prompts=len(sub.prompts), scored_by="decoding")
    return with_costs(row, costs, [len(p.ids) for p in sub.prompts], parts)


def _hf_generate(target, ids: list[int], max_new: int, eos: int, pad: int, assistant=None) -> list[int]:
    x = torch.tensor([ids], device=next(target.parameters()).device)
    out = target.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                          temperature=None, top_p=None, top_k=None, assistant_model=assistant,
                          eos_token_id=eos, pad_token_id=pad)
    return out[0, x.shape[1]:].tolist()


@torch.inference_mode()
def hf_assisted_row(target, draft, name: str, path: Optional[str], es: EvalSet, gamma: int, max_new: int, e,
                    eos: int, pad: int) -> dict:
    """transformers assisted generation (batch 1, greedy, constant γ) vs transformers' plain generate, on the
    timed subset."""
    def decoder(assistant):
        def dec(batch, seed, n=None):
            toks = _hf_generate(target, batch[0], n or max_new, eos, pad, assistant)
            return DecodeResult([toks], ["eos" if eos in toks else "length"])
        return dec

    def skipped(why: str) -> dict:  # a reference row that could not be measured: the report says why
        log.warning("hf_assisted on %s skipped: %s", es.name, why)
        return {"name": "hf_assisted", "kind": "hf_assisted", "draft": path, "assistant": name, "eval_set": es.name,
                "error": f"skipped: {why}", "greedy_identical": None}

    rows = {logits_width(target), logits_width(draft)}
    if len(rows) > 1:  # transformers takes a vocabulary size that differs from the target's for another tokenizer
        return skipped(f"the draft's embedding has {logits_width(draft)} rows and the target's {logits_width(target)} "
                       "(a padded vocabulary over the same tokenizer), which transformers' assisted generation "
                       "refuses as different tokenizers; the speculative rows above decode this draft as usual")
    gc = copy.deepcopy(draft.generation_config)
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # never stop a draft block early
    try:
        plain, run = time_decoders([decoder(None), decoder(draft)], [p.ids for p in es.prompts], es.batches(1),
                                   e.warmup, e.repeats, e.seed)
    except Exception as err:  # a reference from another library: its failure must not cost the report
        return skipped(f"transformers' assisted generation failed ({type(err).__name__}: "
                       f"{str(err).splitlines()[0] if str(err) else ''})")
    finally:
        draft.generation_config = gc
    sp = measured_speedup(plain, run)
    emitted, plain_emitted = (sum(len(r.tokens[0]) for r in x.results) for x in (run, plain))
    return {"name": "hf_assisted", "kind": "hf_assisted", "draft": path, "assistant": name, "eval_set": es.name,
            "temperature": 0.0, "top_p": 1.0, "gamma": gamma, "gamma_policy": "constant", "batch_size": 1,
            "draft_sampled": False, "prompts": len(es.prompts), "timed_prompts": len(es.prompts),
            "scored_by": "decoding", "tokens_per_s": emitted / sp["wall_time_s"], **sp,
            "speedup_baseline": "transformers generate() without an assistant",
            "baseline_tokens_per_s": plain_emitted / (sp["wall_time_s"] * sp["speedup"]),
            "greedy_identical": None, "error": None}
