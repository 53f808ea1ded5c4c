"""Small helpers shared by the stages: atomic writes, the run directory, seeding, the CLI wrapper."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from distill.config import ConfigError, run_dir, stage_path, validate

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
    """runs/<run_name>/<stage> (created)."""
    d = stage_path(cfg, stage)
    d.mkdir(parents=True, exist_ok=True)
    return d


def save_config(cfg: DictConfig) -> None:
    """runs/<run_name>/config.yaml: the resolved config of the last stage run here."""
    atomic_write_text(Path(run_dir(cfg)) / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def start_stage(cfg: DictConfig, stage: str) -> Path:
    """Validate, record the config, seed; returns the stage's output dir. Every run(cfg) calls this."""
    if cfg.get("gamma") is not None:  # the sweep shorthand `gamma=3,5` stands for evaluate.gammas=[3] / [5]
        cfg.evaluate.gammas = [int(cfg.gamma)]
    validate(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    save_config(cfg)
    set_seed(cfg.seed)
    return stage_dir(cfg, stage)


def cli(run: Callable[[DictConfig], dict], cfg: DictConfig) -> dict:
    """Run a stage from a Hydra main: user errors become one line on stderr and exit code 2."""
    try:
        return run(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
