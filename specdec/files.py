"""Replacing a directory whole: a finished temp dir takes the final name, so a reader never sees a half
written one (used by specdec.heads and distill.checkpoint)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished tmp dir to final, replacing an existing final dir (old one parked, then deleted)."""
    old = final.parent / f".{final.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
