"""Publish: stage the distilled draft as an upload folder with a model card, then upload it.

    python -m distill.publish model=tiny experiment=smoke              # dry run (default): stage only
    python -m distill.publish experiment=default publish.dry_run=false publish.repo_id=me/smollm2-draft

Reads only the run directory: runs/<run>/distill/best (or publish.draft), evaluate/report.json, the
summary.json beside the draft (distill/ or distill-head/), generate/manifest.json and config.yaml.
Writes runs/<run>/publish/, the exact folder that is (or would be) uploaded: a plain transformers
model dir (a LoRA adapter is merged unless publish.merge=false), tokenizer files, generation config
and README.md (the model card: YAML metadata with model-index and datasets, the evaluation table,
how to use the draft at its γ with transformers, vLLM and SGLang, and how it was trained). The folder
is built in a temp dir and swapped in whole; runs/<run>/publish.json records what was staged (and
uploaded) so a rerun with the same inputs does nothing.

Uploading uses huggingface_hub (create_repo, create_branch for publish.revision, upload_folder) with
the token from HF_TOKEN or `hf auth login`, and honours HF_ENDPOINT. A draft with no evaluation
report, or whose report shows greedy_identical: false, is refused unless publish.force=true.

The card itself (metadata, model-index, snippets, the training section) is distill/card.py.
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
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from distill import checkpoint as ck
from distill.card import DraftSource, check_report, hub_id, render_card
from distill.config import ConfigError, run_dir, stage_path
from distill.models import check_tokenizers, load_draft, load_tokenizer
from distill.records import check_records_owner, run_draft_vocab
from distill.cli import cli, stage_main, start_stage
from distill.sweep import stage_tag
from distill.utils import atomic_write_json, config_path, read_json, writing
from specdec.drafters import save_draft_vocab
from specdec.heads import is_head_dir
from specdec.hub import endpoint

log = logging.getLogger(__name__)

MODEL_FILES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
               "pytorch_model*.bin", "pytorch_model.bin.index.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")


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
                   for f in src.path.rglob("*") if f.is_file() and not set(f.relative_to(src.path).parts) & set(ck.TRAINING_FILES))
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
    cfg.stage_tag = stage_tag(cfg)  # as start_stage sets it: a sweep job reads its own draft's config
    prev_cfg = config_path(cfg, "distill")  # read before start_stage overwrites it: the config distill ran with
    prev = OmegaConf.to_container(OmegaConf.load(prev_cfg), resolve=False) if prev_cfg.is_file() else None
    out = start_stage(cfg, "publish")

    check_records_owner(cfg)  # the card names cfg.model.target: the records and the draft must be its
    if not cfg.publish.dry_run:
        _check_upload_settings(cfg)
    src = resolve_draft(cfg)
    report_path = stage_path(cfg, "evaluate") / "report.json"
    report = read_json(report_path) if report_path.is_file() else None
    problems = check_report(report, src, report_path, cfg)
    # the summary of the stage that trained this draft (distill/, or distill-head/ for the head beside it);
    # a draft from elsewhere has none here (the run's own summary describes another draft)
    sdir = src.path.parent
    summary = read_json(sdir / "summary.json") if (sdir / "summary.json").is_file() else None
    if summary and summary.get("target", cfg.model.target) != cfg.model.target and src.name in ("best", "head"):
        raise ConfigError(f"{src.path} was distilled for model.target={summary['target']!r}, not {cfg.model.target!r}; "
                          f"publish with model.target={summary['target']}, or distill this target first")
    manifest_path = stage_path(cfg, "generate") / "manifest.json"  # the prompts and sampling the draft trained on
    manifest = read_json(manifest_path) if manifest_path.is_file() else None
    card = render_card(cfg, src, report, prev, summary, problems, manifest)
    fp = fingerprint(src, str(card), cfg)

    _recover(rd, out)
    record_path = rd / f"{out.name}.json"  # publish.json (publish@<tag>.json for a sweep's job)
    record = read_json(record_path) if record_path.is_file() else {}
    if record.get("fingerprint") == fp and (out / "README.md").is_file():
        log.info("publish: %s is up to date (%s)", out, fp)
    else:
        for stale in rd.glob(f".{out.name}.*"):  # leftovers of an interrupted staging (of this job's folder)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=rd))
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


@stage_main("publish")
def main(cfg: DictConfig) -> None:
    cli(run, cfg)


if __name__ == "__main__":
    main()
