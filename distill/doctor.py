"""Diagnostics: turn an evaluation's numbers into advice (the `doctor` section of report.json).

    from distill.doctor import diagnose
    findings = diagnose(report["rows"])   # [{"rule", "severity", "draft", "message", ...}]

Each rule reads only the row fields evaluate writes (names from docs/architecture.md, "Metric
definitions") and fires at most once per (rule, draft), quoting the worst setting and how many
settings it saw. Severities: error (a result that must not ship), warning (the draft or the settings
leave speed on the table), info.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

# Thresholds, named so the report can say what fired and why.
SLOW_COST_RATIO = 0.2  # c above this with speedup < 1: the draft's own steps eat the gain
LOW_ALPHA = 0.4  # α below this: draft and target disagree too often for any γ to pay off
OVERHEAD_FRACTION = 0.8  # measured < 0.8 × predicted: time goes somewhere the formula does not model
POSITION_DROP = 0.2  # per-position acceptance falling by more than this from k = 1 to the last k
MIN_TRIED = 10  # positions tried fewer times than this are too noisy to judge
TEMPERATURE_DROP = 0.15  # sampled α this far below greedy α

NOISE_OVER_PREDICTION = 1.2  # measured speedup above 1.2 × the modeled one: luck or a broken baseline
MIN_REPEATS, MIN_WARMUP = 3, 1  # fewer timed repeats or warm-up runs than this: timings are noise

RULES = {
    "noise": "a speedup the measurement cannot support (interval includes 1, above 1.2 × modeled, > 1 with τ = 1, "
             f"or timed with < {MIN_REPEATS} repeats / < {MIN_WARMUP} warm-up): flagged, never headlined or published",
    "replay_mismatch": "replayed greedy counts differ from decoded ones where no float tie explains it: a bug",
    "recommendation": "which drafter and γ to ship: the highest mean unflagged speedup over the eval sets (greedy, "
                      "batch 1)",
    "greedy_mismatch": "speculative greedy tokens differ from the target's own (not a float tie): a decoder bug",
    "float_tie": "a greedy divergence where the target's top-2 logit gap was < 1e-4 (floating-point order)",
    "broken_draft": "a draft could not be loaded or evaluated",
    "reference_skipped": "the hf_assisted reference could not be measured (e.g. a padded-vocabulary draft); the reason",
    "draft_too_slow": f"speedup < 1 with cost ratio c > {SLOW_COST_RATIO}",
    "low_acceptance": f"acceptance_rate α < {LOW_ALPHA}",
    "decoder_overhead": f"measured speedup < {OVERHEAD_FRACTION} × predicted_speedup",
    "acceptance_falls_with_position": f"per-position acceptance falls by > {POSITION_DROP} from k = 1 to a later k",
    "temperature_effect": f"sampled α more than {TEMPERATURE_DROP} below greedy α for the same draft and γ",
}


def _setting(row: dict) -> str:
    t = row.get("temperature")
    samp = "greedy" if not t else f"T={t:g}, top_p={row.get('top_p', 1.0):g}"
    return f"{row.get('eval_set')}, γ={row.get('gamma')}, {samp}, batch {row.get('batch_size')}"


def _num(row: dict, key: str) -> Optional[float]:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and v == v else None  # drops None and NaN


def time_split(row: dict) -> str:
    """Where a speculative run's wall time went: draft, target (verify), prefill, the rest."""
    wall = _num(row, "wall_time_s")
    if not wall:
        return "no timing recorded"
    parts = {k: _num(row, f"{k}_time_s") or 0.0 for k in ("draft", "target", "prefill")}
    parts["other (decoder bookkeeping, host syncs)"] = max(wall - sum(parts.values()), 0.0)
    text = ", ".join(f"{k} {100 * v / wall:.0f}%" for k, v in parts.items())
    verify, step = _num(row, "verify_call_s"), _num(row, "target_step_s")
    if verify and step:
        text += (
            f"; one verify call of γ+1 tokens takes {1e3 * verify:.2f} ms vs {1e3 * step:.2f} ms for one "
            f"target-alone step ({verify / step:.2f}×; the prediction assumes 1×)"
        )
    return text


def noise_flags(row: dict, settings: Optional[dict] = None) -> dict[str, str]:
    """{field: why} for the speedup numbers of a row that the measurement cannot support. Fields:
    speedup (measured on the timed subset) and modeled_speedup (replayed counts × measured costs)."""
    if row.get("kind") in (None, "target") or row.get("error"):
        return {}
    s = settings or {}
    flags: dict[str, str] = {}
    tau = _num(row, "tokens_per_target_call")
    short = (s.get("repeats", MIN_REPEATS) < MIN_REPEATS or s.get("warmup", MIN_WARMUP) < MIN_WARMUP)
    for key, ci_key in (("speedup", "speedup_ci"), ("modeled_speedup", "modeled_speedup_ci")):
        v = _num(row, key)
        if v is None:
            continue
        ci = row.get(ci_key)
        why = []
        if key == "modeled_speedup" and row.get("costs_from_gamma") is not None:
            why.append(f"modeled with the costs timed at γ = {row['costs_from_gamma']}: a verify call costs more "
                       "than the line through one timed γ says at other γ (add this γ to evaluate.timed_gammas)")
        basis = (row.get("prompts") if key == "modeled_speedup" and row.get("scored_by") == "replay"
                 else row.get("decoded_prompts") or row.get("timed_prompts"))
        if isinstance(basis, int) and basis < 2:
            why.append(f"from {basis} prompt(s): no interval over prompts (raise evaluate.timed_prompts"
                       + ("" if key == "modeled_speedup" and row.get("scored_by") == "replay" else
                          "; the greedy modeled_speedup covers every prompt") + ")")
        if short:
            why.append(f"timed with {s.get('repeats')} repeat(s) after {s.get('warmup')} warm-up run(s) "
                       f"(need ≥ {MIN_REPEATS} and ≥ {MIN_WARMUP}: evaluate.repeats, evaluate.warmup)")
        if ci and ci[0] <= 1 <= ci[1]:
            why.append(f"its 95% interval [{ci[0]:.2f}, {ci[1]:.2f}] includes 1")
        if v > 1 and tau is not None and tau <= 1 and row.get("kind") != "hf_assisted":
            why.append(f"{v:.2f}× with τ = {tau:.2f}: nothing was accepted, so nothing can be faster")
        model = _num(row, "modeled_speedup_timed")
        if key == "speedup" and model and v > NOISE_OVER_PREDICTION * model:
            why.append(f"measured {v:.2f}× is above {NOISE_OVER_PREDICTION} × the modeled {model:.2f}× on the same "
                       "prompts")
        if why:
            flags[key] = "; ".join(why)
    return flags


def _position_drop(row: dict) -> Optional[tuple[float, int, int]]:
    """(drop, last judged k, suggested γ) when per-position acceptance falls, else None."""
    acc = row.get("per_position_acceptance") or []
    tried = (row.get("counters") or {}).get("tried_at")
    pts = [
        (k + 1, a) for k, a in enumerate(acc)
        if a is not None and (tried is None or (k < len(tried) and tried[k] >= MIN_TRIED))
    ]
    if len(pts) < 2:
        return None
    first = pts[0][1]
    k_last, a_last = min(pts[1:], key=lambda p: p[1])
    drop = first - a_last
    if drop <= POSITION_DROP:
        return None
    keep = [k for k, a in pts if a >= first - POSITION_DROP]
    suggested = max(1, next((k - 1 for k, a in pts if a < first - POSITION_DROP), keep[-1]))
    return drop, k_last, suggested


def recommend(rows: list[dict]) -> Optional[dict[str, Any]]:
    """Which drafter to ship: the (candidate, γ) with the highest mean unflagged speedup over the eval sets
    at greedy, batch 1 (modeled over every prompt where there is one, else measured), against the others."""
    score: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for r in rows:
        if (r.get("error") or r.get("kind") in (None, "target", "hf_assisted") or r.get("temperature")
                or r.get("batch_size") != 1):
            continue
        flagged = r.get("flagged") or {}
        key = "modeled_speedup" if _num(r, "modeled_speedup") is not None else "speedup"
        v = _num(r, key)
        if v is not None and key not in flagged:
            score[(str(r.get("name")), int(r.get("gamma") or 0))][str(r.get("eval_set"))] = v
    sets = sorted({s for by_set in score.values() for s in by_set})
    full = {k: sum(v.values()) / len(v) for k, v in score.items() if len(v) == len(sets)}
    if not full:
        return None
    ranked = sorted(full.items(), key=lambda kv: -kv[1])
    (name, gamma), mean = ranked[0]
    per_set = ", ".join(f"{s} {score[(name, gamma)][s]:.2f}×" for s in sets)
    others = "; ".join(f"{n} γ={g} {m:.2f}×" for (n, g), m in ranked[1:4])
    verdict = (f"ship {name} at γ = {gamma}: mean speedup {mean:.2f}× over {', '.join(sets)} ({per_set})"
               if mean > 1 else f"nothing measured here beats the target alone (best: {name} at γ = {gamma}, "
               f"{mean:.2f}×); serve the target alone or train a better draft")
    return {"rule": "recommendation", "severity": "info", "draft": name, "setting": f"γ={gamma}, greedy, batch 1",
            "message": verdict + (f". Next: {others}" if others else "") + " (modeled over every prompt where "
            "available, else measured; flagged numbers left out)", "count": 1}


def diagnose(rows: list[dict]) -> list[dict[str, Any]]:
    """Findings for a list of report rows; each {"rule", "severity", "draft", "message", "count", "setting"}."""
    worst: dict[tuple[str, str], tuple[float, dict]] = {}
    counts: dict[tuple[str, str], int] = defaultdict(int)

    def flag(rule: str, severity: str, row: dict, score: float, message: str) -> None:
        key = (rule, str(row.get("name")))
        counts[key] += 1
        if key not in worst or score > worst[key][0]:
            worst[key] = (score, {"rule": rule, "severity": severity, "draft": row.get("name"),
                                  "setting": _setting(row), "message": message})

    for row in rows:
        name = row.get("name")
        if row.get("error") and row.get("kind") == "hf_assisted":  # a reference that could not be measured
            flag("reference_skipped", "info", row, 0.0, f"{name} ({row.get('eval_set')}): {row['error']}")
            continue
        if row.get("error"):
            flag("broken_draft", "error", row, 1.0, f"{name} ({row.get('draft')}) was not evaluated: {row['error']}")
            continue
        if row.get("kind") not in ("model", "prompt_lookup", "hybrid", "hf_assisted"):
            continue
        where = f"{name} ({_setting(row)})"
        for key, why in (row.get("flagged") or {}).items():
            flag("noise", "info", row, 0.0, f"{where}: {key} is not shown or published: {why}. More timed prompts "
                 "(evaluate.timed_prompts) or repeats narrow the interval")
        check = row.get("replay_check") or {}
        for m in check.get("mismatches") or []:
            flag("replay_mismatch", "error", row, 1.0,
                 f"{where}: prompt {m.get('prompt_id')}: replayed vs decoded {m.get('replayed_vs_decoded')}: a bug "
                 "in the decoder or the replay; the α and τ of this row are not valid")
        for m in row.get("greedy_mismatches") or []:
            flag("greedy_mismatch", "error", row, 1.0,
                 f"{where}: prompt {m.get('prompt_id')} diverges at token {m.get('position')} "
                 f"(target {m.get('expected')}, speculative {m.get('got')}, top-2 logit gap {m.get('gap'):.3g}): "
                 "a decoder bug; the speed numbers of this row are not valid")
        for t in row.get("float_ties") or []:
            flag("float_tie", "info", row, 0.0,
                 f"{where}: prompt {t.get('prompt_id')} diverges at token {t.get('position')} where the target's "
                 f"top-2 logit gap is {t.get('gap'):.2g} < 1e-4: a floating-point tie, not a bug")
        a, c, s, pred = (_num(row, k) for k in ("acceptance_rate", "cost_ratio", "speedup", "predicted_speedup"))
        model = row.get("kind") == "model"  # advice about draft size and training fits a model draft only
        if model and s is not None and c is not None and s < 1 and c > SLOW_COST_RATIO:
            flag("draft_too_slow", "warning", row, c,
                 f"{where}: speedup {s:.2f} < 1 with cost ratio c = {c:.2f} > {SLOW_COST_RATIO}: the draft is too "
                 "slow for this target; use a smaller draft (fewer model.draft_layers) or a larger target")
        if model and a is not None and a < LOW_ALPHA:
            flag("low_acceptance", "warning", row, LOW_ALPHA - a,
                 f"{where}: α = {a:.2f} < {LOW_ALPHA}: draft and target disagree; distill longer "
                 "(train.max_steps), try another loss (loss=rkl, loss=jsd or loss=tvd), or use a draft "
                 "from the target's family")
        if s is not None and pred and s < OVERHEAD_FRACTION * pred:
            flag("decoder_overhead", "warning", row, 1 - s / pred,
                 f"{where}: measured speedup {s:.2f} is {100 * s / pred:.0f}% of the predicted {pred:.2f}: "
                 f"decoder overhead. Time split: {time_split(row)}")
        fall = _position_drop(row)
        if fall is not None:
            drop, k_last, g = fall
            flag("acceptance_falls_with_position", "warning", row, drop,
                 f"{where}: per-position acceptance falls by {drop:.2f} from k = 1 to k = {k_last}: later draft "
                 f"tokens are mostly wasted; lower γ (evaluate.gammas=[{g}]) or use evaluate.gamma_policy=adaptive")

    # sampled vs greedy α for the same draft, set, γ and batch size
    greedy = {(r.get("name"), r.get("eval_set"), r.get("gamma"), r.get("batch_size")): _num(r, "acceptance_rate")
              for r in rows if r.get("kind") == "model" and r.get("temperature") == 0}
    for row in rows:
        if row.get("kind") != "model" or not row.get("temperature"):
            continue
        a0 = greedy.get((row.get("name"), row.get("eval_set"), row.get("gamma"), row.get("batch_size")))
        a = _num(row, "acceptance_rate")
        if a0 is not None and a is not None and a0 - a > TEMPERATURE_DROP:
            flag("temperature_effect", "warning", row, a0 - a,
                 f"{row.get('name')} ({_setting(row)}): α = {a:.2f} sampled vs {a0:.2f} greedy: a temperature "
                 "effect; the draft matches the target's top choice but not its spread. If you serve with "
                 "sampling, distill on sampled targets (generate.temperature) or at that temperature "
                 "(loss.temperature)")

    out = []
    ship = recommend(rows)
    if ship is not None:
        out.append(ship)
    for key, (_, finding) in worst.items():
        n = counts[key]
        more = f" (in {n} settings; worst shown)" if n > 1 else ""
        out.append({**finding, "count": n, "message": finding["message"] + more})
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(out, key=lambda f: (order[f["severity"]], f["rule"], str(f["draft"])))
