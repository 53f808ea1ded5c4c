"""Small helpers shared by the stages: atomic writes, JSON, the run directory and its config record, logging by rank."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from omegaconf import DictConfig, OmegaConf

from distill.config import ConfigError, run_dir, stage_path

log = logging.getLogger("distill")


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def writing(path: str | Path, cleanup: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """Around a write of `path` (a temp file or dir): on any error run `cleanup` (remove the partial
    write), and turn a full disk (or quota) into one ConfigError naming the fix."""
    try:
        yield
    except BaseException as e:
        if cleanup is not None:
            cleanup()
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            raise ConfigError(f"no space left on the device while writing {path} ({e.strerror}); free some space "
                              "(or set runs_root to another disk) and rerun: the partial write was removed, what "
                              "was written before is intact, and the run resumes from it") from None
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temp file in the same dir, fsync, rename: readers never see a torn file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with writing(path, lambda: Path(tmp).unlink(missing_ok=True)):
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600
        os.replace(tmp, path)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def stage_dir(cfg: DictConfig, stage: str) -> Path:
    """runs/<run_name>/<stage>, or <stage>@<tag> with cfg.stage_tag (created): where the stage being run writes."""
    d = stage_path(cfg, stage, own=True)
    d.mkdir(parents=True, exist_ok=True)
    return d


def config_path(cfg: DictConfig, stage: Optional[str] = None) -> Path:
    """runs/<run_name>/config.yaml, or config@<tag>.yaml: where this job records its config (stage None), or
    where the config of the job that made `stage`'s dir (the one stage_path finds) was recorded."""
    tag = cfg.get("stage_tag")
    if stage is not None:
        name = stage_path(cfg, stage).name
        tag = name.split("@", 1)[1] if "@" in name else None
    return Path(run_dir(cfg)) / (f"config@{tag}.yaml" if tag else "config.yaml")


def save_config(cfg: DictConfig) -> None:
    """runs/<run_name>/config.yaml (config@<tag>.yaml with cfg.stage_tag): the resolved config of the last
    stage run here (with that tag), so the jobs of a stage's sweep keep one record each."""
    atomic_write_text(config_path(cfg), OmegaConf.to_yaml(cfg, resolve=True))


def process_rank() -> int:
    """This process's rank under `accelerate launch`/torchrun, known before accelerate starts: RANK, else
    LOCAL_RANK; 0 for a process launched alone."""
    for var in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def setup_logging() -> None:
    """INFO and above on rank 0, WARNING and above on the other ranks, so a multi-process launch prints each
    line once. Adds a handler only where none is set up (Hydra sets up its own)."""
    level = logging.INFO if process_rank() == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)


def wandb_start(cfg: DictConfig, name: str, job_type: str, where: str | Path) -> Any:
    """A W&B run named `name` in group <run_name>, mode cfg.wandb_mode, files under `where`. Offline it is
    quiet: `wandb_finish` says in one line where it is and how to sync it."""
    import wandb

    quiet = {"settings": wandb.Settings(silent=True)} if cfg.wandb_mode == "offline" else {}
    return wandb.init(project=cfg.wandb_project, name=name, group=str(cfg.run_name), job_type=job_type,
                      mode=cfg.wandb_mode, dir=str(where), config=OmegaConf.to_container(cfg, resolve=True),
                      reinit="finish_previous", **quiet)


def wandb_finish(run: Any, cfg: DictConfig, who: str) -> None:
    where = os.path.dirname(run.dir)  # <dir>/wandb/offline-run-<time>-<id>
    run.finish()
    if cfg.wandb_mode == "offline":
        log.info("%s: W&B offline run in %s (upload: wandb sync %s; logger=none turns W&B off)", who, where, where)
