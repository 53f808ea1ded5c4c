"""The model card of a published draft: what the evaluation stands behind, how to serve it, how it was trained.

    card = render_card(cfg, src, report, prev, summary, problems, manifest)    # a huggingface_hub.ModelCard

YAML metadata (base_model, tags, datasets, model-index built from huggingface_hub.EvalResult: α, τ and
only the speedups the evaluate stage did not flag, per eval set at the draft's γ), the evaluation table,
serving snippets at that γ (transformers assisted generation with a fixed γ, vLLM, SGLang; EAGLE-3 for a
feature head) and the training recipe, taken from the draft's own summary.json and the generate
manifest, never from the current config. `check_report` is the gate publish applies before staging.

Why one module of this size: every part of the card reads the same report rows and training summary,
and one rule (`shows`) decides which numbers may appear anywhere in it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from distill import tables
from distill.config import ConfigError
from distill.models import load_tokenizer
from distill.templates import prompt_code, stop_strings
from distill.utils import read_json
from specdec.drafters import DRAFT_VOCAB_FILE

log = logging.getLogger(__name__)

# Embedded model names -> the hub repo they were converted from (the card's base_model).
HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# Built-in prompt sources (distill/data.py) -> the Hub dataset holding the same prompts (card metadata).
# stdlib and file sources have none; a hub source is its data.path.
HUB_DATASETS = {"mt_bench": "HuggingFaceH4/mt_bench_prompts", "humaneval": "openai/openai_humaneval"}
TAGS = ["speculative-decoding", "draft-model", "distillation"]

@dataclass
class DraftSource:
    """Where the published weights come from and in which form they are staged."""

    name: str  # the report's row name for this draft ("best", "checkpoint-40") or its path
    path: Path  # the draft dir as given
    kind: str  # "model" (copy a plain dir) | "merge" (merge a LoRA adapter) | "adapter" (copy the adapter)
    #            | "head" (an EAGLE-3 feature head, student=head: copy its checkpoint as it is)
    weights: Path  # the dir holding the files to copy (model dir or adapter dir)


def _head_usage(target_id: str, repo: str, gamma: int, head_cfg: dict) -> list[str]:
    """The card's 'How to use' for a feature head: vLLM and SGLang load it as an EAGLE-3 draft."""
    layers = head_cfg.get("eagle_aux_hidden_state_layer_ids") or []
    out = [f"An EAGLE-3 draft head: one decoder layer that reads the target's hidden states entering layers "
           f"{layers} (vLLM's numbering) and proposes over a {head_cfg.get('draft_vocab_size')}-token draft "
           f"vocabulary (`d2t` maps it to the target's ids). It runs only beside this target.\n"]
    if len(layers) != 3 or head_cfg.get("num_hidden_layers") != 1:
        out.append(f"> **Note:** vLLM reads exactly three target layers and SGLang single-layer heads; this head "
                   f"reads {len(layers)} and has {head_cfg.get('num_hidden_layers')} layer(s), so it may load in "
                   f"neither. Train with head.layers of three ids and head.num_layers=1 to serve it.\n")
    out.append(f"vLLM:\n\n```python\nfrom vllm import LLM\n"
               f'llm = LLM(model="{target_id}", speculative_config={{"method": "eagle3", "model": "{repo}", '
               f'"num_speculative_tokens": {gamma}}})\n```\n\n'
               f"```bash\nvllm serve {target_id} --speculative-config '{{\"method\": \"eagle3\", \"model\": "
               f"\"{repo}\", \"num_speculative_tokens\": {gamma}}}'\n```\n")
    out.append(f"SGLang:\n\n```bash\npython -m sglang.launch_server --model-path {target_id} \\\n"
               f"    --speculative-algorithm EAGLE3 --speculative-draft-model-path {repo} \\\n"
               f"    --speculative-num-steps {gamma} --speculative-eagle-topk 1 --speculative-num-draft-tokens {gamma + 1}\n```\n")
    out.append(f"This project's lossless decoder (specdec):\n\n```python\n"
               f"from specdec import HeadDrafter, SpeculativeDecoder, load_head\n"
               f'head = load_head("<local copy of {repo}>", target)   # target: the HF model above\n'
               f"out = SpeculativeDecoder(target, HeadDrafter(head), gamma={gamma}).generate(prompt_ids)\n```\n")
    return out


def hub_id(name: Optional[str]) -> Optional[str]:
    """The hub repo a model name stands for, or None (test models, local dirs)."""
    if not name:
        return None
    if name in HUB_IDS:
        return HUB_IDS[name]
    if name == "tiny" or os.path.exists(name) or name.count("/") != 1 or name.startswith((".", "/")):
        return None
    return name


def base_model(m: DictConfig, draft_init: Optional[str] = None) -> Optional[str]:
    """The draft's init source for the card's base_model (None when it has no hub id). `draft_init`: the
    one the draft's training summary recorded, when it did (else m.draft_init)."""
    init = draft_init or m.draft_init
    if init == "pretrained":
        return hub_id(m.draft)
    return hub_id(m.target) if init == "from_target" else None


def dataset_id(source: dict) -> Optional[str]:
    """The Hub dataset a prompt source (a data / eval_data config) stands for, or None."""
    if source.get("source") == "hub":
        return hub_id(source.get("path"))
    return HUB_DATASETS.get(source.get("source"))


def training_datasets(manifest: Optional[dict]) -> Optional[list[str]]:
    """The Hub datasets the generate stage took prompts from (its manifest: data.source, plus the eval sets
    with data.in_domain), for the card's `datasets`; None when none has a Hub id."""
    if not manifest:
        return None
    sources = [(manifest.get("identity") or {}).get("data") or {}]
    sources += [s for s in (manifest.get("data_in_domain") or {}).values() if (s or {}).get("turn", 1) == 1]
    ids = [i for i in (dataset_id(s or {}) for s in sources) if i]
    return list(dict.fromkeys(ids)) or None


# ---------------------------------------------------------------- the evaluation report


def draft_rows(report: dict, src: DraftSource) -> list[dict]:
    """The report rows that measured this draft (matched by row name or by draft path)."""
    here = src.path.resolve()
    return [
        marked(r) for r in report.get("rows", [])
        if r.get("kind") in ("model", "head") and not r.get("error") and (r.get("name") == src.name or (r.get("draft") and Path(r["draft"]).resolve() == here))
    ]


def marked(row: dict) -> dict:
    """The row with `flagged` as the card applies it: the evaluation's flags, plus the speedups of a γ that
    was not timed (`costs_from_gamma`: modeled with another γ's costs), which are never shown as measured."""
    flags = dict(row.get("flagged") or {})
    if row.get("costs_from_gamma") is not None:
        why = f"not timed at this γ (modeled with the costs timed at γ = {row['costs_from_gamma']})"
        for k in ("speedup", "modeled_speedup"):
            if isinstance(row.get(k), (int, float)):
                flags.setdefault(k, why)
    return {**row, "flagged": flags}


def check_report(report: Optional[dict], src: DraftSource, report_path: Path, cfg: DictConfig) -> list[str]:
    """Raise ConfigError when the draft must not ship (unless publish.force); return the problems found."""
    problems: list[str] = []
    if report is None:
        problems.append(f"there is no evaluation report ({report_path} is missing): run "
                        f"`python -m distill.evaluate run_name={cfg.run_name}` first")
    else:
        rows = draft_rows(report, src)
        bad = [r for r in rows if r.get("greedy_identical") is False]
        if report.get("greedy_identical") is False or bad:
            where = ", ".join(sorted({f"{r.get('eval_set')} γ={r.get('gamma')}" for r in bad})) or "see report.md"
            problems.append(f"{report_path} shows greedy_identical: false ({where}): speculative greedy output "
                            f"differed from the target's own greedy output, so the measured speedups are not of a "
                            f"lossless decoder; read the report's doctor section")
        if not rows:
            problems.append(f"{report_path} has no rows for draft {src.name!r}: evaluate it with "
                            f"`python -m distill.evaluate run_name={cfg.run_name} evaluate.drafts=[{src.name}]`")
        elif not supported_speedups(rows):
            msg = (f"{report_path} shows no speedup for draft {src.name!r} that the measurement can support (every "
                   "speedup is flagged as noise, see the report's doctor): the card would have no number to show; "
                   "measure more prompts (evaluate.timed_prompts, evaluate.repeats) or ship a better draft")
            if cfg.publish.dry_run:  # the staged card shows "n.s." where a number would be
                log.warning("publish: %s", msg)
            else:
                problems.append(msg)
    if problems and not cfg.publish.force:
        raise ConfigError("refusing to publish " + str(src.path) + ": " + "; ".join(problems)
                          + ". To publish anyway, set publish.force=true.")
    for p in problems:
        log.warning("publish.force=true: publishing although %s", p)
    return problems


def supported_speedups(rows: list[dict]) -> list[dict]:
    """Rows with at least one speedup number the evaluation's doctor did not flag as noise."""
    return [r for r in rows if any(shows(marked(r), k) for k in ("speedup", "modeled_speedup"))]


def shows(row: dict, key: str) -> bool:
    """Whether the card may show row[key]: a number the evaluation did not flag."""
    return isinstance(row.get(key), (int, float)) and key not in (row.get("flagged") or {})


def _cell(row: dict, key: str, digits: int, suffix: str = "") -> str:
    if key in (row.get("flagged") or {}):
        return "n.s."
    return tables.ci_cell(row.get(key), row.get(f"{key}_ci"), digits, suffix)


def eval_table(rows: list[dict]) -> str:
    """A markdown table of report rows: setting, α, τ, tokens/s, speedup, modeled speedup ("n.s." where the
    evaluation flagged the number)."""
    head = ("| eval set | decoding | sampling | batch | γ | α [95% CI] | τ | tokens/s | speedup [95% CI] | "
            "modeled speedup [95% CI] |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = [
        f"| {r.get('eval_set')} | {tables.label(r['name'])} | {_sampling(r)} | {r.get('batch_size')} | "
        f"{'–' if r.get('kind') == 'target' else r.get('gamma', '–')} | {_cell(r, 'acceptance_rate', 3)} | "
        f"{_cell({**r, 'tokens_per_target_call_ci': None}, 'tokens_per_target_call', 2)} | "
        f"{_cell({**r, 'tokens_per_s_ci': None}, 'tokens_per_s', 1)} | "
        f"{_cell(r, 'speedup', 2, '×')} | {_cell(r, 'modeled_speedup', 2, '×')} |"
        for r in map(marked, rows)
    ]
    return head + "\n".join(lines) + "\n"


def headline_rows(rows: list[dict], gamma: int) -> list[dict]:
    """The card's headline setting, one row per eval set: the draft at its γ, greedy, the smallest batch."""
    greedy = [r for r in rows if not r.get("temperature") and r.get("gamma") == gamma]
    bs = min((r.get("batch_size") or 1 for r in greedy), default=1)
    return [r for r in greedy if (r.get("batch_size") or 1) == bs]


# model-index metrics: report field -> (metric type, name); each only where the evaluation did not flag it
INDEX_METRICS = {"acceptance_rate": ("acceptance_rate", "acceptance rate α"),
                 "tokens_per_target_call": ("tokens_per_target_call", "τ (tokens per target call)"),
                 "speedup": ("speedup", "speedup, measured (timed prompts)"),
                 "modeled_speedup": ("modeled_speedup", "speedup, modeled (every prompt, measured costs)")}


def eval_results(rows: list[dict], report: dict, target_id: str, gamma: int) -> list:
    """model-index entries (huggingface_hub.EvalResult) for the headline rows: per eval set α, τ and the
    speedups the evaluation did not flag. The dataset is the eval set's Hub dataset where it has one."""
    from huggingface_hub import EvalResult

    sets = (report.get("settings") or {}).get("eval_sets") or {}
    picked = sorted(headline_rows(rows, gamma), key=lambda r: str(r.get("eval_set")))
    names = [str(r.get("eval_set")) for r in picked]
    types = [dataset_id((sets.get(n) or {}).get("source") or {"source": n}) or n for n in names]
    out = []
    for r, name, dtype in zip(picked, names, types):
        r = marked(r)
        for key, (mtype, mname) in INDEX_METRICS.items():
            if shows(r, key):
                out.append(EvalResult(
                    task_type="text-generation",
                    task_name=f"speculative decoding with {target_id} (greedy, γ={gamma}, batch {r.get('batch_size')})",
                    dataset_type=dtype, dataset_name=name,
                    # two sets of one Hub dataset (MT-Bench turns 1 and 2) stay apart in the model-index
                    dataset_config=name if types.count(dtype) > 1 else None,
                    metric_type=mtype, metric_name=mname, metric_value=round(float(r[key]), 4)))
    return out


def _sampling(row: dict) -> str:
    return tables.sampling(row.get("temperature"), row.get("top_p"), bool(row.get("draft_sampled")))


def sort_rows(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (str(r.get("eval_set")), r.get("temperature") or 0.0, r.get("batch_size") or 1,
                                       r.get("gamma") or 0, tables.order(r.get("name")), str(r.get("name"))))


# ---------------------------------------------------------------- the model card


SOURCES = {"stdlib": "prompts built from the Python standard library (functions with docstrings, pydoc topics)",
           "mt_bench": "MT-Bench questions", "humaneval": "HumanEval problems"}


def _data_line(manifest: Optional[dict], summary: dict) -> str:
    """What the draft trained on: the generate stage's manifest (prompt source, sampling) and the record
    counts of the draft's training summary."""
    counts = ""
    if summary.get("train_records") is not None:
        counts = f"; {summary['train_records']} records trained on, {summary.get('holdout_records', '?')} held out"
    ident = (manifest or {}).get("identity") or {}
    d, g = ident.get("data") or {}, ident.get("sampling") or {}
    if not d.get("source"):
        return f"- **data**: the target's own answers{counts} (prompt source not recorded: no generate/manifest.json)"
    src = d["source"]
    if src == "hub":
        what = f"the Hub dataset `{d.get('path')}`" + (f" ({d['name']})" if d.get("name") else "")
    else:
        what = f"the prompts in `{d.get('path')}`" if src == "file" else SOURCES.get(src, src)
    if manifest.get("data_limit"):
        what += f", {'a shuffled sample of' if d.get('shuffle') else 'the first'} {manifest['data_limit']} prompts"
    if manifest.get("data_in_domain"):
        what += (f", plus the prompts of {', '.join(sorted(manifest['data_in_domain']))} that evaluation leaves "
                 f"out (in-domain)")
    if manifest.get("data_self_instruct"):
        what += f", plus up to {manifest['data_self_instruct']} prompts the target wrote itself (self-instruct)"
    t = g.get("temperature")
    samp = "greedy" if not t else f"sampled at T={t:g}, top-p {g.get('top_p', 1.0):g}"
    if (g.get("num_samples") or 1) > 1:
        samp += f", {g['num_samples']} answers per prompt"
    return (f"- **data**: the target's own answers ({samp}, up to {g.get('max_new_tokens', '?')} new tokens) to "
            f"{what}{counts}")


def _training_section(summary: Optional[dict], manifest: Optional[dict], is_best: bool) -> str:
    """How the draft was trained: the settings of the stage that trained it (its summary.json beside the
    draft: distill/ or distill-head/) and the data its generate stage recorded, never the config of a later
    stage (a sweep may have changed the loss since). `is_best`: the draft is that stage's best/, so the
    summary's α_TF is its own."""
    if not summary:
        return ("Not recorded: there is no training summary (summary.json) beside this draft, so its loss and "
                "settings are unknown here.\n")
    st = summary.get("settings") or {}
    lo, s, t, h = (st.get(k) or {} for k in ("loss", "student", "train", "head"))
    kind = s.get("kind") or summary.get("student")
    unknown = "not recorded in the training summary"
    if kind == "head":
        init = (f"the target's last decoder layer, final norm and LM-head rows, reading the target's hidden states "
                f"entering layers {h.get('layers')}")
    elif st.get("draft_init") == "from_target":
        init = f"layers {st.get('draft_layers')} of the target (embeddings, final norm and LM head copied)"
    elif st.get("draft_init") == "pretrained":
        init = f"`{st['draft']}`" if st.get("draft") else "a pretrained model"
    elif st.get("draft_init") == "config":
        init = "a fresh model from the target's config"
    else:
        init = unknown
    if lo.get("name"):
        loss = str(lo["name"]).upper() + (f" (β={lo.get('beta')})" if lo["name"] == "jsd" else "")
        loss += f", temperature {lo.get('temperature')}"
        loss += f", + {lo['ce_weight']} × cross-entropy" if lo.get("ce_weight") else ""
        loss += f", + {lo['prompt_ce_weight']} × prompt cross-entropy" if lo.get("prompt_ce_weight") else ""
        loss += {"online": "; teacher: the target's full distribution",
                 "topk": "; teacher: the target's stored top-k logits"}.get(t.get("teacher"), "")
        if kind != "head" and t.get("on_policy_fraction") is not None:
            loss += f"; on-policy fraction λ={t['on_policy_fraction']}"
    else:
        loss = unknown
    student = ("full fine-tune" if kind == "full" else
               f"feature head (EAGLE-3), training-time test over {h.get('ttt_steps')} steps" if kind == "head" else
               f"LoRA r={s.get('lora_r')}, α={s.get('lora_alpha')}" if kind == "lora" else unknown)
    if kind in ("full", "lora") and s.get("freeze_layers"):
        student += f", first {s['freeze_layers']} layer(s) frozen"
    steps = summary.get("step", t.get("max_steps"))
    recipe = (f"{steps} steps" + (" (stopped by its time budget)" if summary.get("stopped") == "time_budget" else "")
           + f", {st.get('global_batch') or t.get('batch_size', 0) * t.get('grad_accum', 1)} records per step, "
           f"lr {h.get('lr') if kind == 'head' else t.get('lr')} ({t.get('schedule')})") if t else unknown
    lines = [f"- **draft initialised from**: {init}", _data_line(manifest, summary), f"- **loss**: {loss}",
             f"- **student**: {student}; {recipe}"]
    init_tf = pick(summary, "init_teacher_forced_acceptance", "init.teacher_forced_acceptance", "init_alpha_tf")
    best_tf = pick(summary, "best_teacher_forced_acceptance", "best.teacher_forced_acceptance", "best_alpha_tf")
    step = pick(summary, "best_step", "best.step")
    if is_best and (init_tf is not None or best_tf is not None):
        scale = summary.get("logit_scale")
        lines.append(f"- **teacher-forced acceptance α_TF** on held-out answers: {tables.num(init_tf, 3)} before "
                     f"distillation → {tables.num(best_tf, 3)} after" + (f" (step {step})" if step is not None else "")
                     + (f", with the logits scaled by {scale:g} (calibrated on the holdout)"
                        if isinstance(scale, (int, float)) and scale != 1 else ""))
    return "\n".join(lines) + "\n"


def pick(d: dict, *dotted: str) -> Any:
    for key in dotted:
        cur: Any = d
        for part in key.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur is not None:
            return cur
    return None


def _speed(row: dict) -> float:
    """What the card ranks a row by: its modeled speedup, else its measured one, whichever may be shown."""
    return next((float(row[k]) for k in ("modeled_speedup", "speedup") if shows(row, k)), 0.0)


def card_gamma(report: Optional[dict], src: DraftSource, rows: list[dict], default: int) -> int:
    """The draft's γ (the card's headline, model-index and snippets): the evaluation's pick when it picked this
    draft, else the γ of its fastest supported greedy row, else its first greedy row's."""
    headline = (report or {}).get("best") or {}
    if headline.get("name") == src.name and headline.get("gamma"):
        return int(headline["gamma"])
    greedy = [r for r in rows if not r.get("temperature") and r.get("gamma")]
    ranked = supported_speedups(greedy)
    top = max(ranked, key=_speed) if ranked else (greedy[0] if greedy else {})
    return int(top.get("gamma") or default)


def render_card(cfg: DictConfig, src: DraftSource, report: Optional[dict], prev: Optional[dict],
                summary: Optional[dict], problems: list[str], manifest: Optional[dict] = None):
    """The model card (huggingface_hub.ModelCard): YAML metadata (with model-index and datasets) + what the
    draft is worth and how to use it. `summary`: the training summary beside the draft; `manifest`: the
    generate stage's manifest.json."""
    from huggingface_hub import ModelCard, ModelCardData

    target = (prev or {}).get("model", {}).get("target") or cfg.model.target
    target_id = hub_id(target) or target
    repo = cfg.publish.repo_id or f"<your-name>/{cfg.run_name}-draft"
    rows = draft_rows(report, src) if report else []
    gamma = card_gamma(report, src, rows, int(cfg.evaluate.gammas[0]))
    ranked = supported_speedups(headline_rows(rows, gamma))
    best = max(ranked, key=_speed) if ranked else None
    results = eval_results(rows, report, target_id, gamma) if report else []
    settings = (summary or {}).get("settings") or {}
    data = ModelCardData(base_model=hub_id(target) if src.kind == "head" else base_model(cfg.model, settings.get("draft_init")),
                         datasets=training_datasets(manifest), library_name="transformers",
                         pipeline_tag="text-generation",
                         tags=TAGS + (["lora"] if src.kind == "adapter" else ["eagle3"] if src.kind == "head" else []),
                         license=cfg.publish.license, model_name=repo.split("/")[-1] if results else None,
                         eval_results=results or None)
    link = f"[{target_id}](https://huggingface.co/{target_id})" if hub_id(target) else f"`{target}`"
    load = (f'draft = AutoModelForCausalLM.from_pretrained("{repo}")' if src.kind != "adapter" else
            f'from peft import AutoPeftModelForCausalLM\ndraft = AutoPeftModelForCausalLM.from_pretrained("{repo}").merge_and_unload()')
    body = [f"# {repo.split('/')[-1]}\n",
            f"A **draft model for speculative decoding** with {link}: it proposes γ tokens, the target verifies "
            f"them in one forward pass. The output distribution is exactly the target's (greedy decoding is "
            f"token-identical); only the time changes. It was distilled on the target's own answers.\n"]
    if target in HUB_IDS:
        body.append(f"(Trained and measured offline against `{target}`, this project's copy of the target converted "
                    f"from a Q4_1 GGUF file; acceptance with the original weights may differ slightly.)\n")
    body.append("## Evaluation\n")
    if best is not None:
        body.append(f"Best setting: **{best.get('eval_set')}, {_sampling(best)}, batch {best.get('batch_size')}, "
                    f"γ={best.get('gamma')}: α={tables.num(best.get('acceptance_rate'), 3)}, "
                    f"τ={tables.num(best.get('tokens_per_target_call'), 2)}, speedup {tables.shown(best, 'speedup')} measured, "
                    f"{tables.shown(best, 'modeled_speedup')} modeled**.\n")
    elif rows:
        body.append(f"No speedup that the evaluation can support at γ={gamma}, greedy: every such speedup below is "
                    f"flagged as noise (n.s.) by the evaluation's doctor, or was not timed.\n")
    if report:
        shown = sort_rows(rows + [r for r in report.get("rows", []) if r.get("name") in tables.ORDER
                                  and not r.get("error")])
        body.append(eval_table(shown))
        defs = report.get("definitions", {})
        keys = ("acceptance_rate", "tokens_per_target_call", "speedup", "modeled_speedup", "flagged")
        body.append("\n".join(f"- `{k}`: {defs[k]}" for k in keys if k in defs) + "\n")
        st = report.get("settings", {})
        device = f" on {st['device']}" if st.get("device") not in (None, "auto") else ""
        sets = ", ".join(f"{k} ({v.get('prompts')} prompts)" for k, v in (st.get("eval_sets") or {}).items())
        body.append(f"Measured with this project's lossless speculative decoder (greedy output checked token by token "
                    f"against the target's){device}: "
                    f"{sets or 'see report.json'}; α and τ by exact replay of greedy decoding over every prompt at "
                    f"max_new_tokens {st.get('max_new_tokens', '?')}; speedups timed on {st.get('timed_prompts', '?')} "
                    f"prompts per set, median of {st.get('repeats', '?')} runs after {st.get('warmup', '?')} warm-up. "
                    f"`hf_assisted` rows "
                    f"are transformers assisted generation with this draft, timed against transformers generate().\n")
    for p in problems:
        body.append(f"> **Warning:** published with publish.force=true although {p}.\n")
    body.append("## How to use\n")
    if src.kind == "head":
        body += _head_usage(target_id, repo, gamma, read_json(src.weights / "config.json"))
    else:
        # the snippet prompts the target as training and evaluation did (data.template of the run's last stage)
        template = (pick(prev, "data.template") if prev else None) or cfg.data.get("template")
        inputs = prompt_code(load_tokenizer(cfg.model.target, cfg.model.revision, cfg.model.cache_dir), template)
        stops = stop_strings((pick(prev, "generate.stop_strings") if prev else None) or cfg.generate.get("stop_strings"))
        stop_args = f", stop_strings={stops!r}, tokenizer=tok" if stops else ""
        # a fixed γ per round needs all three: transformers' default confidence threshold (0.4) ends a round
        # early whenever the draft is unsure, and a "heuristic" schedule changes the count between rounds
        body.append(f"transformers (assisted generation, γ = {gamma} draft tokens per round: `num_assistant_tokens` "
                    f"with the constant schedule, and the confidence threshold off so that no round stops "
                    f"early):\n\n```python\n"
                    f"from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                    f'tok = AutoTokenizer.from_pretrained("{target_id}")\n'
                    f'target = AutoModelForCausalLM.from_pretrained("{target_id}")\n{load}\n'
                    f"draft.generation_config.num_assistant_tokens = {gamma}\n"
                    f'draft.generation_config.num_assistant_tokens_schedule = "constant"\n'
                    f"draft.generation_config.assistant_confidence_threshold = 0.0\n"
                    f"{inputs}\n"
                    f"out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128, do_sample=False{stop_args})\n"
                    f"print(tok.decode(out[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True))\n```\n")
        if cfg.model.draft_vocab:
            body.append(f"This project's decoder reads `{DRAFT_VOCAB_FILE}` (the {cfg.model.draft_vocab} tokens the "
                        f"target's answers use most) and applies the draft's LM head to those rows only, as in the "
                        f"evaluation above; output stays exactly the target's:\n\n```bash\n"
                        f"python -m specdec --target {target_id} --draft {repo} --prompt \"Hello!\" --gamma {gamma}\n```\n")
        body.append(f"vLLM:\n\n```python\nfrom vllm import LLM\n"
                    f'llm = LLM(model="{target_id}", speculative_config={{"method": "draft_model", "model": "{repo}", '
                    f'"num_speculative_tokens": {gamma}}})\n```\n\n'
                    f"```bash\nvllm serve {target_id} --speculative-config '{{\"method\": \"draft_model\", \"model\": "
                    f"\"{repo}\", \"num_speculative_tokens\": {gamma}}}'\n```\n")
        body.append(f"SGLang:\n\n```bash\npython -m sglang.launch_server --model-path {target_id} \\\n"
                    f"    --speculative-algorithm STANDALONE --speculative-draft-model-path {repo} \\\n"
                    f"    --speculative-num-steps {gamma} --speculative-eagle-topk 1 --speculative-num-draft-tokens {gamma + 1}\n```\n")
    body.append("## Training\n")
    body.append(_training_section(summary, manifest, src.path.name == "best"))
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))
