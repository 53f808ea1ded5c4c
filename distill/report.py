"""report.json -> report.md + plots (and the terminal summary), usable on its own:

    python -m distill.report runs/<run>/evaluate/report.json      # rewrites report.md and plots/ beside it

The evaluate stage calls `render(report, out_dir)` and `print_summary(report)`. Everything here reads
only report.json (shape: docs/architecture.md "report.json", and distill/evaluate.py), so a report
can be re-rendered without models.

Why one module of this size: report.md, the plots and the terminal summary all read the same rows.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")  # files only; no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from distill import tables  # noqa: E402
from distill.utils import atomic_write_text  # noqa: E402
from specdec.metrics import predicted_speedup  # noqa: E402

DEFINITIONS = {
    "gamma": "γ: draft tokens proposed per round (0 for the target alone)",
    "acceptance_rate": "α: accepted draft tokens ÷ draft tokens tried (accepted + the one rejection that ends a "
                       "round); the per-token acceptance probability of Leviathan et al.",
    "draft_acceptance_ratio": "accepted ÷ proposed draft tokens (what vLLM calls acceptance); not α",
    "tokens_per_target_call": "τ: tokens emitted ÷ target forward calls (row-rounds); 1 + mean accepted",
    "per_position_acceptance": "P(draft token k accepted | tokens 1..k-1 accepted), k = 1..γ",
    "teacher_forced_acceptance": "α_TF: mean over the target's own answers to the same prompts at the row's "
                                 "sampling settings (greedy, or sampled at that temperature/top-p) of "
                                 "Σ_x min(p(x), q(x)) = 1 − TV(p, q), with the settings applied to both "
                                 "(greedy: argmax agreement); needs no decoding",
    "cost_ratio": "c: one draft forward step ÷ one target-alone decoding step (same device, same batch size)",
    "tokens_per_s": "new tokens (all prompts) ÷ median wall time of the run",
    "speedup": "median wall time of target-alone decoding ÷ median wall time of this row, same prompts, same "
               "batches, same max_new_tokens, warm-up excluded, the two timed interleaved (hf_assisted: ÷ transformers "
               "generate() without an assistant)",
    "speedup_spread": "[median baseline ÷ slowest repeat, median baseline ÷ fastest repeat]",
    "predicted_speedup": "(1 − α^(γ+1)) ÷ ((1 − α)(γc + 1)) from this row's measured α, c and mean γ",
    "scored_by": "replay: greedy α, τ and counters from exact replay over every prompt of the set (no decoding); "
                 "decoding: from decoding the timed subset",
    "modeled_speedup": "Σ over every prompt of the modeled target-alone time ÷ Σ of the modeled speculative time: "
                       "replayed counts (tokens, rounds, draft steps) × costs measured on the timed subset (target "
                       "step, verify call, draft step, prefill per prompt token); decoder bookkeeping not modeled",
    "modeled_speedup_timed": "modeled_speedup over the timed subset only: the check of the model against `speedup`",
    "speedup_ci": "95% percentile bootstrap interval over timed prompts (batches) of Σ median baseline wall ÷ Σ "
                  "median wall; *_ci fields likewise over the prompts a number covers",
    "replay_check": "replayed counters equal the decoded ones on every timed prompt (greedy, batch 1), except where a "
                    "draft or target argmax is a float tie",
    "flagged": "{field: why} for speedup numbers the measurement cannot support; never headlined or published",
    "timed_prompts": "prompts decoded for real and timed (at settings.timed_max_new_tokens)",
    "expected_tokens_per_call": "(1 − α^(γ+1)) ÷ (1 − α): τ predicted from α for i.i.d. acceptance",
    "greedy_identical": "speculative greedy tokens equal the target-alone greedy tokens (same batch size) on "
                        "every prompt; a divergence where the target's top-2 logit gap < 1e-4 is a float tie "
                        "(listed in float_ties) and does not count; null for sampled rows",
    "by_category": "acceptance_rate and τ per prompt category (batches never mix categories)",
    "accepted_length_histogram": "row-rounds with n = 0, 1, ... draft tokens accepted",
    "verify_call_s": "mean seconds of one target verify call (γ+1 tokens) in the speculative run",
    "target_step_s": "mean seconds of one target-alone decoding step (the denominator of c)",
    "draft_sampled": "proposals drawn from the draft's distribution q (else its argmax or a lookup)",
    "temperature": "sampling temperature applied to p and q (0 = greedy)",
    "batch_size": "prompts decoded together (the last batch of a category may be smaller)",
}
SPEC_KINDS = ("model", "prompt_lookup", "hybrid")  # rows this project's decoder measured with a drafter
PLOTS = ("per_position_acceptance", "speedup_vs_gamma", "acceptance_by_category", "accepted_length_histogram")
SEVERITY_MARK = {"error": "✗", "warning": "!", "info": "i"}


def _color(text: str, code: str, stream=sys.stdout) -> str:
    on = os.environ.get("FORCE_COLOR") or (hasattr(stream, "isatty") and stream.isatty())
    return f"\033[{code}m{text}\033[0m" if on and not os.environ.get("NO_COLOR") else text


def red(text: str) -> str:
    return _color(text, "31;1", sys.stderr)


def _ok_rows(report: dict) -> list[dict]:
    return [r for r in report.get("rows", []) if not r.get("error")]


def headline_setting(report: dict) -> tuple[float, int, Optional[int]]:
    """(temperature, batch size, γ) the plots and per-category table use: the best draft's."""
    best, s = report.get("best") or {}, report.get("settings", {})
    temps, sizes = s.get("temperatures") or [0.0], s.get("batch_sizes") or [1]
    temp = best.get("temperature", 0.0 if 0.0 in temps else temps[0])
    return temp, best.get("batch_size", min(sizes)), best.get("gamma")


# -- the headline ----------------------------------------------------------------------------------
def headline_speedup(row: dict) -> Optional[float]:
    """The number a row is ranked by: its modeled speedup over every prompt when there is one (replayed
    counts, measured costs), else the speedup measured on the timed subset. A γ that was not timed (its
    speedup modeled with another γ's costs: `costs_from_gamma`) is not ranked."""
    if row.get("costs_from_gamma") is not None:
        return None
    v = row.get("modeled_speedup")
    return v if isinstance(v, (int, float)) else row.get("speedup")


def pick_best(rows: list[dict], temperatures: list[float], batch_sizes: list[int],
              top_p: float = 1.0) -> Optional[dict]:
    """The draft (and γ) with the highest mean headline speedup over eval sets at the headline setting:
    greedy if evaluated (else the first temperature), the smallest batch size. Distilled drafts first;
    init only when there is no other. `flagged` says which of its numbers must not be shown."""
    temp = 0.0 if 0.0 in temperatures else temperatures[0]
    bs = min(batch_sizes)

    def at(kind, name=None):
        return [r for r in rows if r.get("kind") == kind and not r.get("error") and r.get("batch_size") == bs
                and r.get("temperature") == temp and (name is None or r["name"] == name)]

    def mean(rs, k):
        vals = [r[k] for r in rs if isinstance(r.get(k), (int, float))]
        return sum(vals) / len(vals) if vals else None

    models = at("model") + at("head")
    pool = [r for r in models if r["name"] != "init"] or models
    if not pool:
        return None
    scored = {}
    for key in dict.fromkeys((r["name"], r["gamma"]) for r in pool):
        rs = [r for r in pool if (r["name"], r["gamma"]) == key]
        vals = [headline_speedup(r) for r in rs if isinstance(headline_speedup(r), (int, float))]
        scored[key] = (sum(vals) / len(vals) if vals else 0.0, rs)
    (name, gamma), (_, rs) = max(scored.items(), key=lambda kv: kv[1][0])

    def ref(kind, nm=None):  # measured on the same timed prompts; flagged numbers are left out
        return mean([r for r in at(kind, nm) if (kind == "hf_assisted" or r["gamma"] == gamma)
                     and "speedup" not in (r.get("flagged") or {})], "speedup")

    flagged: dict[str, list[str]] = {}
    for r in rs:
        for k, why in (r.get("flagged") or {}).items():
            flagged.setdefault(k, []).append(f"{r['eval_set']}: {why}")
    return {"name": name, "draft": rs[0]["draft"], "gamma": gamma, "temperature": temp, "top_p": top_p,
            "batch_size": bs, "eval_sets": [r["eval_set"] for r in rs], "speedup": mean(rs, "speedup"),
            **{k: mean(rs, k) for k in ("acceptance_rate", "teacher_forced_acceptance", "tokens_per_target_call",
                                        "draft_acceptance_ratio", "cost_ratio", "predicted_speedup", "tokens_per_s",
                                        "modeled_speedup")},
            "speedup_by_set": {r["eval_set"]: r.get("speedup") for r in rs},
            "modeled_speedup_by_set": {r["eval_set"]: r.get("modeled_speedup") for r in rs},
            "flagged": flagged,
            "init_speedup": ref("model", "init") if name != "init" else None,
            "prompt_lookup_speedup": ref("prompt_lookup"),
            "hybrid_speedup": ref("hybrid", "hybrid_head" if rs[0].get("kind") == "head" else "hybrid"),
            "hf_assisted_speedup": ref("hf_assisted") if temp == 0 and bs == 1 else None,
            "greedy_identical": all(r.get("greedy_identical") is not False for r in rs),
            "note": "mean over eval sets at this γ, temperature and batch size"}


# -- tables ----------------------------------------------------------------------------------------
COLUMNS = ["draft", "set", "sampling", "γ", "batch", "prompts (timed)", "α [95% CI]", "α_TF", "τ", "c", "tokens/s",
           "speedup [95% CI]", "modeled [95% CI]", "greedy identical"]


def table_rows(report: dict) -> list[list[str]]:
    out = []
    for r in _ok_rows(report):
        gi = r.get("greedy_identical")
        ties = len(r.get("float_ties") or [])
        gi_s = "–" if gi is None else ("yes" if gi else "NO")
        gi_s += f" ({ties} float tie{'s' * (ties > 1)})" if ties else ""
        check = r.get("replay_check")
        if check:
            gi_s += "; replay = decoded" if check.get("equal") else "; REPLAY ≠ DECODED"
        out.append([
            r["name"], str(r.get("eval_set")), tables.sampling(r.get("temperature"), r.get("top_p")),
            str(r.get("gamma", "–")), str(r.get("batch_size")), f"{r.get('prompts', '–')} ({r.get('timed_prompts', 0)})",
            tables.ci_cell(r.get("acceptance_rate"), r.get("acceptance_rate_ci")),
            tables.num(r.get("teacher_forced_acceptance")), tables.num(r.get("tokens_per_target_call")), tables.num(r.get("cost_ratio"), 3),
            tables.num(r.get("tokens_per_s"), 1), tables.shown(r, "speedup"), tables.shown(r, "modeled_speedup"), gi_s,
        ])
    return out


def category_table(report: dict) -> tuple[list[str], list[list[str]]]:
    """α per category (columns) per draft (rows) at the headline setting."""
    temp, bs, gamma = headline_setting(report)
    rows = [r for r in _ok_rows(report) if r.get("kind") in SPEC_KINDS and r.get("temperature") == temp
            and r.get("batch_size") == bs and (gamma is None or r.get("gamma") == gamma)]
    cats = list(dict.fromkeys(f"{r['eval_set']}/{c}" if c != r["eval_set"] else c
                              for r in rows for c in (r.get("by_category") or {})))
    table: dict[str, dict[str, str]] = {}
    for r in rows:
        for c, v in (r.get("by_category") or {}).items():
            key = f"{r['eval_set']}/{c}" if c != r["eval_set"] else c
            table.setdefault(r["name"], {})[key] = tables.num(v.get("acceptance_rate"))
    return ["draft", *cats], [[n, *(vals.get(c, "–") for c in cats)] for n, vals in table.items()]


def headline(report: dict) -> str:
    b = report.get("best")
    if not b:
        return "No draft was evaluated (only references or errors)."
    flagged = b.get("flagged") or {}
    setting = (f"γ = {b['gamma']}, {tables.sampling(b['temperature'], b.get('top_p'))}, batch {b['batch_size']}; "
               f"mean over {', '.join(b.get('eval_sets', []))}")
    name = f"**Best draft: `{b['name']}`**" + (f" (`{b['draft']}`)" if b.get("draft") else "")
    speeds = []
    if isinstance(b.get("modeled_speedup"), (int, float)) and "modeled_speedup" not in flagged:
        speeds.append(f"**{tables.num(b['modeled_speedup'], 2, '×')} modeled speedup** over every prompt")
    if isinstance(b.get("speedup"), (int, float)) and "speedup" not in flagged:
        speeds.append(f"{tables.num(b['speedup'], 2, '×')} measured on the timed prompts")
    text = name + ": " + ("; ".join(speeds) if speeds else
                          "**no speedup over the target alone that the measurement can support**") + f" ({setting}). "
    text += (f"α = {tables.num(b.get('acceptance_rate'))}, α_TF = {tables.num(b.get('teacher_forced_acceptance'))}, "
             f"τ = {tables.num(b.get('tokens_per_target_call'))}, c = {tables.num(b.get('cost_ratio'), 3)}.")
    if flagged:
        text += " Not shown: " + "; ".join(f"{k} ({'; '.join(v)})" for k, v in flagged.items()) + "."
    names = (("undistilled init", "init_speedup"), ("prompt lookup", "prompt_lookup_speedup"),
             ("hybrid (prompt lookup + this draft)", "hybrid_speedup"),
             ("transformers assisted generation, same draft", "hf_assisted_speedup"))
    refs = [(k, b[key]) for k, key in names if b.get(key) is not None]
    if refs and speeds:
        text += " Measured on the same timed prompts: " + "; ".join(f"{k} {tables.num(v, 2, '×')}" for k, v in refs) + "."
    return text


def render_markdown(report: dict) -> str:
    s = report.get("settings", {})
    ok = report.get("greedy_identical")
    ties = sum(len(r.get("float_ties") or []) for r in report.get("rows", []))
    temp, bs, gamma = headline_setting(report)
    lines = [
        f"# Speculative decoding evaluation: {report.get('run_name', '')}", "",
        f"Target `{report.get('target')}` on {s.get('device')} ({s.get('dtype')}); max_new_tokens "
        f"{s.get('max_new_tokens')}; {s.get('repeats')} timed repeats (median, spread min–max), "
        f"{s.get('warmup')} warm-up run(s) excluded. Eval sets: "
        + ", ".join(f"{k} ({v.get('prompts')} prompts)" for k, v in (s.get("eval_sets") or {}).items()) + "."
        + (f" Model drafts decode with a draft vocabulary of {s['draft_vocab']} tokens (transformers assisted "
           "generation uses the whole head)." if s.get("draft_vocab") else ""), "",
        "## Headline", "", headline(report), "",
        "Greedy speculative output identical to the target's own: "
        + ("**yes**" if ok else "**NO: a decoder bug (see Doctor)**")
        + (f" ({ties} float tie(s), top-2 logit gap < 1e-4)" if ties else "") + ".", "",
        "## Doctor", "",
    ]
    doc = report.get("doctor") or []
    lines += [f"- **{d['severity']}** `{d['rule']}`: {d['message']}" for d in doc] or ["No problems found."]
    lines += ["", "## All rows", "", tables.markdown(COLUMNS, table_rows(report)), ""]
    errors = [r for r in report.get("rows", []) if r.get("error")]
    if errors:
        lines += ["### Not evaluated", ""]
        lines += [f"- `{r['name']}` ({r.get('draft')}): {r['error']}" for r in errors] + [""]
    heads, cat_rows = category_table(report)
    lines += [f"## α per category ({tables.sampling(temp)}, batch {bs}" + (f", γ = {gamma}" if gamma else "") + ")", "",
              tables.markdown(heads, cat_rows) if cat_rows else "No speculative rows.", "", "## Plots", ""]
    lines += [f"![{p}](plots/{p}.png)" for p in PLOTS] + ["", "## Definitions", ""]
    lines += [f"- `{k}`: {v}" for k, v in (report.get("definitions") or {}).items()]
    return "\n".join(lines) + "\n"


# -- plots -----------------------------------------------------------------------------------------
def _spec_rows(report: dict, temp: float, bs: int, kinds=SPEC_KINDS) -> list[dict]:
    return [r for r in _ok_rows(report) if r.get("kind") in kinds and r.get("temperature") == temp
            and r.get("batch_size") == bs]


def _sets(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["eval_set"] for r in rows)) or ["(none)"]


def _empty(ax, text="no speculative rows at this setting") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def plot_per_position(report: dict, path: Path) -> None:
    temp, bs, _ = headline_setting(report)
    rows = _spec_rows(report, temp, bs)
    sets = _sets(rows)
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 3.6), squeeze=False)
    for ax, es in zip(axes[0], sets):
        mine = [r for r in rows if r["eval_set"] == es]
        for name in dict.fromkeys(r["name"] for r in mine):
            r = max((x for x in mine if x["name"] == name), key=lambda x: x.get("gamma") or 0)
            acc = r.get("per_position_acceptance") or []
            pts = [(k + 1, a) for k, a in enumerate(acc) if a is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{name} (γ={r['gamma']})")
        if not ax.lines:
            _empty(ax)
        ax.set(title=f"{es}, {tables.sampling(temp)}, batch {bs}", xlabel="draft position k",
               ylabel="P(accept k | 1..k−1 accepted)", ylim=(0, 1.05))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.lines:
            ax.legend(fontsize=7)
    _save(fig, path)


def plot_speedup_vs_gamma(report: dict, path: Path) -> None:
    temp, bs, _ = headline_setting(report)
    rows = _spec_rows(report, temp, bs, (*SPEC_KINDS, "hf_assisted"))
    sets = _sets(rows)
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 3.6), squeeze=False)
    for ax, es in zip(axes[0], sets):
        mine = [r for r in rows if r["eval_set"] == es]
        for name in dict.fromkeys(r["name"] for r in mine):
            rs = [r for r in mine if r["name"] == name and r.get("speedup") is not None]
            rs.sort(key=lambda r: r["gamma"])
            if not rs:
                continue
            g = [r["gamma"] for r in rs]
            err = [[max(r["speedup"] - r["speedup_spread"][0], 0) for r in rs],
                   [max(r["speedup_spread"][1] - r["speedup"], 0) for r in rs]]
            line = ax.errorbar(g, [r["speedup"] for r in rs], yerr=err, marker="o", capsize=3,
                               label=f"{name} measured", linestyle="--" if rs[0]["kind"] == "hf_assisted" else "-")
            alphas = [r["acceptance_rate"] for r in rs if r.get("acceptance_rate") is not None]
            costs = [r["cost_ratio"] for r in rs if r.get("cost_ratio") is not None]
            if alphas and costs:
                a, c = sum(alphas) / len(alphas), sum(costs) / len(costs)
                grid = list(range(1, max(g) + 3))
                ax.plot(grid, [predicted_speedup(min(a, 1.0), x, c) for x in grid], ":",
                        color=line[0].get_color(), label=f"{name} predicted (α={a:.2f}, c={c:.2f})")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        if not mine:
            _empty(ax)
        ax.set(title=f"{es}, {tables.sampling(temp)}, batch {bs}", xlabel="γ", ylabel="speedup over target alone")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if mine:
            ax.legend(fontsize=7)
    _save(fig, path)


def plot_category(report: dict, path: Path) -> None:
    heads, rows = category_table(report)
    cats = heads[1:]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(cats) * max(len(rows), 1) * 0.5 + 3), 3.8))
    width = 0.8 / max(len(rows), 1)
    for i, row in enumerate(rows):
        vals = [float(v) if v != "–" else float("nan") for v in row[1:]]  # no bar where not measured
        ax.bar([j + i * width for j in range(len(cats))], vals, width, label=row[0])
    if rows:
        ticks = [j + width * (len(rows) - 1) / 2 for j in range(len(cats))]
        ax.set_xticks(ticks, cats, rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=7)
    else:
        _empty(ax)
    temp, bs, gamma = headline_setting(report)
    ax.set(ylabel="α", ylim=(0, 1.05), title=f"α per category ({tables.sampling(temp)}, batch {bs}, γ={gamma})")
    _save(fig, path)


def plot_accepted_lengths(report: dict, path: Path) -> None:
    temp, bs, _ = headline_setting(report)
    rows = _spec_rows(report, temp, bs)
    gamma = max((r.get("gamma") or 0 for r in rows), default=None)  # the largest γ shows the whole shape
    rows = [r for r in rows if r.get("gamma") == gamma]
    hist: dict[str, list[int]] = {}
    for r in rows:
        h = hist.setdefault(r["name"], [])
        for n, v in enumerate(r.get("accepted_length_histogram") or []):
            h.extend([0] * (n + 1 - len(h)))
            h[n] += v
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / max(len(hist), 1)
    for i, (name, h) in enumerate(hist.items()):
        total = sum(h) or 1
        ax.bar([n + i * width for n in range(len(h))], [v / total for v in h], width, label=name)
    if hist:
        n = max(len(h) for h in hist.values())
        ax.set_xticks([x + width * (len(hist) - 1) / 2 for x in range(n)], [str(x) for x in range(n)])
        ax.legend(fontsize=7)
    else:
        _empty(ax)
    ax.set(xlabel="draft tokens accepted in a round", ylabel="share of rounds",
           title=f"accepted length ({tables.sampling(temp)}, batch {bs}, γ={gamma}, all sets)")
    _save(fig, path)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)  # atomic: a reader never sees half a PNG


def render(report: dict, out_dir: str | Path) -> dict[str, str]:
    """Write report.md and plots/*.png into out_dir; returns {name: path}."""
    out_dir = Path(out_dir)
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    paths = {p: out_dir / "plots" / f"{p}.png" for p in PLOTS}
    plot_per_position(report, paths["per_position_acceptance"])
    plot_speedup_vs_gamma(report, paths["speedup_vs_gamma"])
    plot_category(report, paths["acceptance_by_category"])
    plot_accepted_lengths(report, paths["accepted_length_histogram"])
    atomic_write_text(out_dir / "report.md", render_markdown(report))
    return {"report.md": str(out_dir / "report.md"), **{k: str(v) for k, v in paths.items()}}


def print_summary(report: dict, stream=None) -> None:
    """The final table, the headline, the doctor's findings and the greedy check, on the terminal."""
    stream = stream or sys.stdout
    print("\n" + tables.text(COLUMNS, table_rows(report)), file=stream)
    for r in report.get("rows", []):
        if r.get("error"):
            print(_color(f"not evaluated: {r['name']} ({r.get('draft')}): {r['error']}", "31", stream), file=stream)
    print("\n" + headline(report).replace("**", "").replace("`", ""), file=stream)
    for d in report.get("doctor") or []:
        code = {"error": "31;1", "warning": "33", "info": "36"}[d["severity"]]
        print(_color(f"[{SEVERITY_MARK[d['severity']]} {d['severity']}] {d['rule']}: {d['message']}", code, stream),
              file=stream)
    if report.get("greedy_identical"):
        print("greedy speculative output identical to the target's: yes", file=stream)
    else:
        print(_color("GREEDY MISMATCH: speculative greedy output differs from the target's (a decoder bug)",
                     "31;1", stream), file=stream)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m distill.report runs/<run>/evaluate/report.json", file=sys.stderr)
        sys.exit(2)
    path = Path(argv[0])
    if not path.is_file():
        print(f"error: {path} does not exist; run `python -m distill.evaluate ...` first", file=sys.stderr)
        sys.exit(2)
    report = json.loads(path.read_text())
    for name, p in render(report, path.parent).items():
        print(f"wrote {p}")
    print_summary(report)


if __name__ == "__main__":
    main()
