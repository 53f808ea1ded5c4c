"""Publish: stage the distilled draft as an upload folder with a model card, then upload it.

    python -m distill.publish model=tiny experiment=smoke              # dry run (default): stage only
    python -m distill.publish experiment=default publish.dry_run=false publish.repo_id=me/smollm2-draft

Reads only the run directory: runs/<run>/distill/best (or publish.draft), evaluate/report.json,
distill/summary.json and config.yaml. Writes runs/<run>/publish/, the exact folder that is (or would
be) uploaded: a plain transformers model dir (a LoRA adapter is merged unless publish.merge=false),
tokenizer files, generation config and README.md (the model card: YAML metadata, the evaluation
table, how to use the draft with transformers, vLLM and SGLang, and how it was trained). The folder
is built in a temp dir and swapped in whole; runs/<run>/publish.json records what was staged (and
uploaded) so a rerun with the same inputs does nothing.

Uploading uses huggingface_hub (create_repo, create_branch for publish.revision, upload_folder) with
the token from HF_TOKEN or `hf auth login`, and honours HF_ENDPOINT. A draft with no evaluation
report, or whose report shows greedy_identical: false, is refused unless publish.force=true.

Why one module of this size: the card, the staged folder and the upload share one fingerprint and
one record (publish.json); splitting them would pass both around.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from distill import report as report_mod
from distill import tables
from distill.config import ConfigError, run_dir, stage_path
from distill.models import check_tokenizers, load_draft, load_tokenizer
from distill.records import check_records_owner, run_draft_vocab
from distill.templates import prompt_code, stop_strings
from distill.utils import atomic_write_json, cli, read_json, start_stage, writing
from specdec.drafters import DRAFT_VOCAB_FILE, save_draft_vocab
from specdec.heads import is_head_dir
from specdec.hub import endpoint

log = logging.getLogger(__name__)

# Embedded model names -> the hub repo they were converted from (the card's base_model).
HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
TAGS = ["speculative-decoding", "draft-model", "distillation"]
MODEL_FILES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
               "pytorch_model*.bin", "pytorch_model.bin.index.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")


@dataclass
class DraftSource:
    """Where the published weights come from and in which form they are staged."""

    name: str  # the report's row name for this draft ("best", "checkpoint-40") or its path
    path: Path  # the draft dir as given
    kind: str  # "model" (copy a plain dir) | "merge" (merge a LoRA adapter) | "adapter" (copy the adapter)
    #            | "head" (an EAGLE-3 feature head, student=head: copy its checkpoint as it is)
    weights: Path  # the dir holding the files to copy (model dir or adapter dir)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def _is_model_dir(d: Path) -> bool:
    return (d / "config.json").is_file() and any(_matches(f.name, MODEL_FILES[2:]) for f in d.iterdir())


def resolve_draft(cfg: DictConfig) -> DraftSource:
    """Find the draft to publish: publish.draft is "fastest" (the draft the evaluation ranks first: a
    standalone draft or the feature head; distill/best when there is no report yet), "best", a checkpoint
    name of this run, or a path."""
    distill_dir = stage_path(cfg, "distill")
    want = cfg.publish.draft
    report_path = stage_path(cfg, "evaluate") / "report.json"
    top = (read_json(report_path).get("best") or {}) if want == "fastest" and report_path.is_file() else {}
    if top.get("draft"):
        path, name = Path(top["draft"]), str(top["name"])
    else:
        want = "best" if want == "fastest" else want
        path = distill_dir / want if (distill_dir / want).is_dir() or want == "best" else Path(want)
        name = path.name if path.parent.resolve() == distill_dir.resolve() else str(path)
    if not path.is_dir():
        raise ConfigError(
            f"no draft at {path}: run the distill stage first (`python -m distill.distill run_name={cfg.run_name}`) "
            f"or set publish.draft=<a draft dir>"
        )
    if is_head_dir(path):
        return DraftSource(name, path, "head", path)
    adapter = next((d for d in (path, path / "adapter") if (d / "adapter_config.json").is_file()), None)
    merged = next((d for d in (path, path / "merged", path.parent / f"{path.name}-merged") if _is_model_dir(d)), None)
    if cfg.publish.merge or adapter is None:
        if merged is not None:
            if not cfg.publish.merge:
                log.warning("publish.merge=false but %s is a full model (no LoRA adapter): staging the model", path)
            return DraftSource(name, path, "model", merged)
        if adapter is not None:
            return DraftSource(name, path, "merge", adapter)
        raise ConfigError(f"{path} holds neither a model (config.json + weights) nor a LoRA adapter; "
                          f"point publish.draft at a draft dir")
    return DraftSource(name, path, "adapter", adapter)


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


def base_model(m: DictConfig) -> Optional[str]:
    """The draft's init source for the card's base_model (None when it has no hub id)."""
    if m.draft_init == "pretrained":
        return hub_id(m.draft)
    return hub_id(m.target) if m.draft_init == "from_target" else None


# ---------------------------------------------------------------- the evaluation report


def draft_rows(report: dict, src: DraftSource) -> list[dict]:
    """The report rows that measured this draft (matched by row name or by draft path)."""
    here = src.path.resolve()
    return [
        r for r in report.get("rows", [])
        if r.get("kind") in ("model", "head") and not r.get("error") and (r.get("name") == src.name or (r.get("draft") and Path(r["draft"]).resolve() == here))
    ]


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
    return [r for r in rows if any(isinstance(r.get(k), (int, float)) and k not in (r.get("flagged") or {})
                                   for k in ("speedup", "modeled_speedup"))]


def eval_table(rows: list[dict]) -> str:
    """A markdown table of report rows: setting, α, τ, tokens/s, speedup, predicted speedup."""
    head = ("| eval set | decoding | sampling | batch | γ | α [95% CI] | τ | tokens/s | speedup [95% CI] | "
            "modeled speedup [95% CI] |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = [
        f"| {r.get('eval_set')} | {tables.label(r['name'])} | {_sampling(r)} | {r.get('batch_size')} | "
        f"{'–' if r.get('kind') == 'target' else r.get('gamma', '–')} | "
        f"{tables.ci_cell(r.get('acceptance_rate'), r.get('acceptance_rate_ci'), 3)} | "
        f"{tables.num(r.get('tokens_per_target_call'), 2)} | {tables.num(r.get('tokens_per_s'), 1)} | "
        f"{tables.shown(r, 'speedup')} | {tables.shown(r, 'modeled_speedup')} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def _sampling(row: dict) -> str:
    return tables.sampling(row.get("temperature"), row.get("top_p"), bool(row.get("draft_sampled")))


def sort_rows(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (str(r.get("eval_set")), r.get("temperature") or 0.0, r.get("batch_size") or 1,
                                       r.get("gamma") or 0, tables.order(r.get("name")), str(r.get("name"))))


# ---------------------------------------------------------------- the model card


def _training_section(cfg: DictConfig, prev: Optional[dict], summary: Optional[dict]) -> str:
    """Training data, loss and student settings (from the run's config.yaml) and α_TF (summary.json)."""
    c = prev or OmegaConf.to_container(cfg, resolve=True)
    d, g, lo, s, t, m = (c.get(k, {}) for k in ("data", "generate", "loss", "student", "train", "model"))
    trained = (summary or {}).get("settings") or {}  # what the draft's own stage trained (a head beside a draft)
    s, t = trained.get("student") or s, trained.get("train") or t
    head_cfg = trained.get("head") or c.get("head", {})
    src = d.get("source")
    data = {"stdlib": "prompts built from the Python standard library (functions with docstrings, pydoc topics)",
            "mt_bench": "MT-Bench questions", "humaneval": "HumanEval problems"}.get(src, f"{src} `{d.get('path')}`")
    samp = "greedy" if not g.get("temperature") else f"sampled at T={g.get('temperature')}, top-p={g.get('top_p')}"
    init = (f"layers {m.get('draft_layers')} of the target (embeddings, final norm and LM head copied)"
            if m.get("draft_init") == "from_target" else
            f"`{m.get('draft')}`" if m.get("draft_init") == "pretrained" else "a fresh model from the target's config")
    if s.get("kind") == "head":
        init = "the target's last decoder layer, final norm and LM-head rows (reading its hidden states)"
    loss = lo.get("name", "?").upper() + (f" (β={lo.get('beta')})" if lo.get("name") == "jsd" else "")
    loss += f", temperature {lo.get('temperature')}" + (f", + {lo.get('ce_weight')} × cross-entropy" if lo.get("ce_weight") else "")
    student = ("full fine-tune" if s.get("kind") == "full" else
               f"feature head (EAGLE-3), training-time test over {head_cfg.get('ttt_steps')} steps"
               if s.get("kind") == "head" else f"LoRA r={s.get('lora_r')}, α={s.get('lora_alpha')}")
    lines = [
        f"- **draft initialised from**: {init}",
        f"- **data**: the target's own answers ({samp}, up to {g.get('max_new_tokens')} new tokens) to "
        f"{data}" + (f", first {d.get('limit')} prompts" if d.get("limit") else ""),
        f"- **loss**: {loss}; on-policy fraction λ={t.get('on_policy_fraction')}",
        f"- **student**: {student}; {t.get('max_steps')} steps, batch {t.get('batch_size')} × "
        f"{t.get('grad_accum')} accumulation, lr {head_cfg.get('lr') if s.get('kind') == 'head' else t.get('lr')} "
        f"({t.get('schedule')})",
    ]
    if summary:
        init_tf = pick(summary, "init_teacher_forced_acceptance", "init.teacher_forced_acceptance", "init_alpha_tf")
        best_tf = pick(summary, "best_teacher_forced_acceptance", "best.teacher_forced_acceptance", "best_alpha_tf")
        step = pick(summary, "best_step", "best.step")
        if init_tf is not None or best_tf is not None:
            lines.append(f"- **teacher-forced acceptance α_TF** on held-out answers: {tables.num(init_tf, 3)} before "
                         f"distillation → {tables.num(best_tf, 3)} after" + (f" (step {step})" if step is not None else ""))
    return "\n".join(lines) + "\n"


def pick(d: dict, *dotted: str) -> Any:
    for key in dotted:
        cur: Any = d
        for part in key.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur is not None:
            return cur
    return None


def render_card(cfg: DictConfig, src: DraftSource, report: Optional[dict], prev: Optional[dict],
                summary: Optional[dict], problems: list[str]):
    """The model card (huggingface_hub.ModelCard): YAML metadata + what the draft is worth and how to use it."""
    from huggingface_hub import ModelCard, ModelCardData

    target = (prev or {}).get("model", {}).get("target") or cfg.model.target
    target_id = hub_id(target) or target
    repo = cfg.publish.repo_id or f"<your-name>/{cfg.run_name}-draft"
    rows = draft_rows(report, src) if report else []
    ranked = supported_speedups(rows)
    best = max(ranked, key=lambda r: report_mod.headline_speedup(r) or 0.0) if ranked else None
    headline = (report or {}).get("best") or {}
    gamma = int(headline.get("gamma") if headline.get("name") == src.name else (best or {}).get("gamma")
                or cfg.evaluate.gammas[0])
    data = ModelCardData(base_model=base_model(cfg.model), library_name="transformers", pipeline_tag="text-generation",
                         tags=TAGS + (["lora"] if src.kind == "adapter" else ["eagle3"] if src.kind == "head" else []),
                         license=cfg.publish.license)
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
        body.append("No speedup that the evaluation can support: every speedup below is flagged as noise (n.s.) by "
                    "the evaluation's doctor.\n")
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
        body.append(f"transformers (assisted generation; `num_assistant_tokens` sets γ):\n\n```python\n"
                    f"from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                    f'tok = AutoTokenizer.from_pretrained("{target_id}")\n'
                    f'target = AutoModelForCausalLM.from_pretrained("{target_id}")\n{load}\n'
                    f"draft.generation_config.num_assistant_tokens = {gamma}\n"
                    f'draft.generation_config.num_assistant_tokens_schedule = "constant"\n'
                    f"{inputs}\n"
                    f"out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128, do_sample=False{stop_args})\n"
                    f"print(tok.decode(out[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True))\n```\n")
        if cfg.model.draft_vocab:
            body.append(f"This project's decoder reads `{DRAFT_VOCAB_FILE}` (the {cfg.model.draft_vocab} tokens the "
                        f"target's answers use most) and applies the draft's LM head to those rows only, as in the "
                        f"evaluation above; output stays exactly the target's:\n\n```bash\n"
                        f"python -m specdec --target {target_id} --draft {repo} --prompt \"Hello!\" --gamma {gamma}\n```\n")
        body.append(f"vLLM:\n\n```python\nfrom vllm import LLM\n"
                    f'llm = LLM(model="{target_id}", speculative_config={{"model": "{repo}", "num_speculative_tokens": {gamma}}})\n```\n\n'
                    f"```bash\nvllm serve {target_id} --speculative-config '{{\"model\": \"{repo}\", \"num_speculative_tokens\": {gamma}}}'\n```\n")
        body.append(f"SGLang:\n\n```bash\npython -m sglang.launch_server --model-path {target_id} \\\n"
                    f"    --speculative-algorithm STANDALONE --speculative-draft-model-path {repo} \\\n"
                    f"    --speculative-num-steps {gamma} --speculative-eagle-topk 1 --speculative-num-draft-tokens {gamma + 1}\n```\n")
    body.append("## Training\n")
    body.append(_training_section(cfg, prev, summary))
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


# ---------------------------------------------------------------- staging


def _copy(src_dir: Path, dst: Path, patterns: tuple[str, ...]) -> list[str]:
    names = sorted(f.name for f in src_dir.iterdir() if f.is_file() and _matches(f.name, patterns))
    for n in names:
        shutil.copy2(src_dir / n, dst / n)
        os.chmod(dst / n, 0o644)  # the upload folder is for sharing, whatever the source's mode
    return names


def merge_adapter(adapter_dir: Path, cfg: DictConfig):
    """Merge a LoRA adapter into the run's initial draft: runs/<run>/distill/init (saved by the distill
    stage), else rebuilt from cfg.model. (adapter_config.json's base_model_name_or_path is not used: a
    from_target draft inherits the target's name.) An adapter that does not fit is a ConfigError.
    """
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    init = stage_path(cfg, "distill") / "init"
    base = AutoModelForCausalLM.from_pretrained(init) if _is_model_dir(init) else load_draft(cfg.model).cpu()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    missing = [str(w.message) for w in caught if "missing adapter keys" in str(w.message)]
    if missing:
        raise ConfigError(f"the LoRA adapter in {adapter_dir} does not fit the draft built from model.* "
                          f"(draft_init={cfg.model.draft_init}); publish with the model settings it was trained "
                          f"with. {missing[0][:300]}")
    return model.merge_and_unload().eval()


def _stage_adapter(src: DraftSource, tmp: Path, cfg: DictConfig) -> None:
    _copy(src.weights, tmp, ADAPTER_FILES)
    acfg = read_json(tmp / "adapter_config.json")
    base = acfg.get("base_model_name_or_path")
    if hub_id(base) is None:  # a local path or nothing: only a hub id is usable by whoever downloads it
        base = hub_id(cfg.model.draft) if cfg.model.draft_init == "pretrained" else None
        if base is None:
            raise ConfigError(
                f"publish.merge=false uploads a LoRA adapter, which needs a hub base model, but this draft's base "
                f"(model.draft_init={cfg.model.draft_init}) is not a hub model; set publish.merge=true to upload "
                f"the merged draft"
            )
        acfg["base_model_name_or_path"] = base
        (tmp / "adapter_config.json").write_text(json.dumps(acfg, indent=2) + "\n")


def stage(cfg: DictConfig, src: DraftSource, card, tmp: Path) -> None:
    """Fill tmp with the upload folder: weights (or adapter), tokenizer, generation config, README.md."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    if src.kind in ("model", "head"):  # a head: its EAGLE-3 config.json and model.safetensors, as trained
        _copy(src.weights, tmp, MODEL_FILES)
    elif src.kind == "merge":
        merge_adapter(src.weights, cfg).save_pretrained(tmp)
    else:
        _stage_adapter(src, tmp, cfg)
    has_tok = bool(_copy(src.weights, tmp, TOKENIZER_FILES) or _copy(src.path, tmp, TOKENIZER_FILES))
    target_tok = load_tokenizer(cfg.model.target, cfg.model.revision, cfg.model.cache_dir)
    if not has_tok:  # the draft shares the target's tokenizer
        target_tok.save_pretrained(tmp)
    check_tokenizers(target_tok, AutoTokenizer.from_pretrained(tmp), "target", "staged draft")
    if src.kind in ("model", "merge") and not (tmp / "generation_config.json").exists():
        gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(tmp))
        gen.pad_token_id = target_tok.pad_token_id
        gen.save_pretrained(tmp)
    ids = run_draft_vocab(cfg, len(target_tok), target_tok) if src.kind != "head" else None  # a head carries d2t
    if ids is not None:  # the vocabulary the evaluation decoded with, for specdec users of the draft
        save_draft_vocab(tmp, ids, source=f"the {len(ids)} tokens the target's generated answers use most")
    card.save(tmp / "README.md")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(src: DraftSource, card_text: str, cfg: DictConfig) -> str:
    """What the staged folder depends on: the card, the source files (name, size, mtime), merge settings."""
    files = sorted((str(f.relative_to(src.path)), f.stat().st_size, f.stat().st_mtime_ns)
                   for f in src.path.rglob("*") if f.is_file() and "trainer_state" not in f.parts)
    key = {"card": card_text, "kind": src.kind, "weights": str(src.weights), "files": files,
           "model": OmegaConf.to_container(cfg.model, resolve=True)}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _recover(rd: Path, out: Path) -> None:
    """Undo what a kill during swap_in leaves: out moved aside as .publish.old-* and the new one not yet in
    place. The previous folder goes back (publish.json still describes it)."""
    old = sorted(rd.glob(f".{out.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if old and not out.exists():
        os.rename(old[-1], out)
        log.warning("publish: an interrupted publish had moved %s aside; restored it", out)


def swap_in(tmp: Path, out: Path) -> None:
    """Replace out with tmp (two renames; a kill between them leaves .publish.old-*, which the next run
    puts back before it stages anything)."""
    os.chmod(tmp, 0o755)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- upload


def upload(cfg: DictConfig, folder: Path) -> dict:
    """create_repo (exist_ok) -> create_branch (if publish.revision) -> upload_folder; returns the commit."""
    from huggingface_hub import HfApi

    p = cfg.publish
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)  # read now: tests point it at a local server
    repo_url = api.create_repo(p.repo_id, repo_type="model", private=p.private, exist_ok=True)
    if p.revision and p.revision != "main":
        api.create_branch(p.repo_id, branch=p.revision, repo_type="model", exist_ok=True)
    info = api.upload_folder(repo_id=p.repo_id, folder_path=str(folder), repo_type="model", revision=p.revision,
                             commit_message=f"Upload draft model ({cfg.run_name})",
                             commit_description=f"Target: {cfg.model.target}. Staged by distill.publish.")
    log.info("uploaded %s to %s (%s)", folder, repo_url, info.commit_url)
    return {"repo_id": p.repo_id, "revision": p.revision or "main", "repo_url": str(repo_url),
            "commit_url": info.commit_url, "commit": info.oid, "private": p.private, "time": time.time()}


def _check_upload_settings(cfg: DictConfig) -> None:
    from huggingface_hub import constants, get_token

    rid = cfg.publish.repo_id
    if not rid:
        raise ConfigError("publish.repo_id is required to upload: set publish.repo_id=<user or org>/<name> "
                          "(or keep publish.dry_run=true to only stage the folder)")
    if rid.count("/") != 1 or not all(rid.split("/")):
        raise ConfigError(f"publish.repo_id={rid!r} must look like <user or org>/<name>")
    if constants.is_offline_mode():
        raise ConfigError("HF_HUB_OFFLINE is set, so uploads are blocked: unset it, or use publish.dry_run=true")
    if get_token() is None:
        raise ConfigError("no Hugging Face token: run `hf auth login` or set HF_TOKEN=<a write token>")


# ---------------------------------------------------------------- the stage


def run(cfg: DictConfig) -> dict:
    rd = Path(run_dir(cfg))
    prev_cfg = rd / "config.yaml"  # read before start_stage overwrites it: the config distill/evaluate ran with
    prev = OmegaConf.to_container(OmegaConf.load(prev_cfg), resolve=False) if prev_cfg.is_file() else None
    out = start_stage(cfg, "publish")

    check_records_owner(cfg)  # the card names cfg.model.target: the records and the draft must be its
    if not cfg.publish.dry_run:
        _check_upload_settings(cfg)
    src = resolve_draft(cfg)
    report_path = stage_path(cfg, "evaluate") / "report.json"
    report = read_json(report_path) if report_path.is_file() else None
    problems = check_report(report, src, report_path, cfg)
    # the summary of the stage that trained this draft (distill/, or distill-head/ for the head beside it)
    sdir = src.path.parent if (src.path.parent / "summary.json").is_file() else stage_path(cfg, "distill")
    summary = read_json(sdir / "summary.json") if (sdir / "summary.json").is_file() else None
    if summary and summary.get("target", cfg.model.target) != cfg.model.target and src.name in ("best", "head"):
        raise ConfigError(f"{src.path} was distilled for model.target={summary['target']!r}, not {cfg.model.target!r}; "
                          f"publish with model.target={summary['target']}, or distill this target first")
    card = render_card(cfg, src, report, prev, summary, problems)
    fp = fingerprint(src, str(card), cfg)

    _recover(rd, out)
    record_path = rd / "publish.json"
    record = read_json(record_path) if record_path.is_file() else {}
    if record.get("fingerprint") == fp and (out / "README.md").is_file():
        log.info("publish: %s is up to date (%s)", out, fp)
    else:
        for stale in rd.glob(".publish.*"):  # leftovers of an interrupted staging
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".publish.tmp-", dir=rd))
        try:
            with writing(out):  # a full disk: one message (tmp is removed below; the previous folder stays)
                stage(cfg, src, card, tmp)
            swap_in(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(out.iterdir()) if f.is_file()}
        record = {"fingerprint": fp, "draft": str(src.path), "kind": src.kind, "files": files,
                  "forced": problems, "uploads": record.get("uploads", [])}
        atomic_write_json(record_path, record)
        log.info("publish: staged %s (%d files, from %s, %s)", out, len(files), src.path, src.kind)
    summary_out = {"stage": "publish", "folder": str(out), "draft": str(src.path), "kind": src.kind,
                   "fingerprint": fp, "dry_run": bool(cfg.publish.dry_run), "files": sorted(record["files"])}
    if cfg.publish.dry_run:
        log.info("publish.dry_run=true: staged only; upload with publish.dry_run=false publish.repo_id=<user>/<name>")
        return summary_out
    try:
        uploaded = upload(cfg, out)
    except Exception as e:  # no network, a refused token, a server error: one message, the staged folder stays
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"upload of {out} to {cfg.publish.repo_id} at {endpoint()} failed ({type(e).__name__}: "
                          f"{first}); check the network (or HF_ENDPOINT) and that the token may write there "
                          "(HF_TOKEN or `hf auth login`), then rerun: the staged folder is kept") from None
    record["uploads"] = record.get("uploads", []) + [uploaded]
    atomic_write_json(record_path, record)
    return {**summary_out, "upload": uploaded}


@hydra.main(version_base="1.3", config_path="../conf", config_name="publish")
def main(cfg: DictConfig) -> None:
    cli(run, cfg)


if __name__ == "__main__":
    main()
