"""Training curves of a distill stage: loss and α_TF against the optimizer step, read from its summary.

The trainers (distill/distill.py, distill/heads_train.py) call `training_curves(summary, path)` once their
final summary.json is written, into runs/<run>/plots/<stage>.png. An older run can be drawn by hand:

    python -m distill.plots runs/<run>/distill/summary.json      # -> runs/<run>/plots/distill.png

Only the summary's "history" is read (entries {"step", "loss", "teacher_forced_acceptance", ...}: loss is
null at step 0, α_TF present only on evaluation steps) plus "best_step" and "dir" for the marks and title.
matplotlib is imported here only, on its Agg canvas (files, no display).
"""
from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from distill.utils import read_json, writing

log = logging.getLogger(__name__)


def _points(history: list[dict], key: str, where=lambda h: True) -> tuple[list[int], list[float]]:
    """(steps, values) of the entries whose `key` is a finite number."""
    pts = [(h["step"], float(h[key])) for h in history
           if isinstance(h.get(key), (int, float)) and math.isfinite(h[key]) and where(h)]
    return [s for s, _ in pts], [v for _, v in pts]


def _title(summary: dict) -> str:
    d = Path(summary.get("dir") or "")
    run, stage = (d.parent.name or "?"), (d.name or summary.get("stage") or "distill")
    kind = " (feature head)" if summary.get("student") == "head" else ""
    loss = ((summary.get("settings") or {}).get("loss") or {}).get("name")
    return f"{run} / {stage}{kind}" + (f": loss {loss}" if loss else "") + f", step {summary.get('step', '?')}"


def curves_figure(summary: dict[str, Any]):
    """A matplotlib Figure (Agg canvas, no pyplot) of loss per step (top) and held-out α_TF per step (bottom,
    same step axis), the step best/ was taken from marked on both. A panel without points (no step trained
    yet, no α_TF measured) says so instead of drawing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    history = [h for h in summary.get("history") or [] if isinstance(h, dict) and isinstance(h.get("step"), int)]
    best_step: Optional[int] = summary.get("best_step")

    fig = Figure(figsize=(7.0, 5.5))
    FigureCanvasAgg(fig)
    ax_loss, ax_tf = fig.subplots(2, 1, sharex=True)
    fig.suptitle(_title(summary), fontsize=11)

    steps, losses = _points(history, "loss", lambda h: not h.get("on_policy"))
    on_steps, on_losses = _points(history, "loss", lambda h: bool(h.get("on_policy")))
    if steps or on_steps:
        ax_loss.plot(steps, losses, marker="o" if len(steps) <= 40 else None, ms=3, lw=1.2, label="loss (target's answers)")
        if on_steps:
            ax_loss.scatter(on_steps, on_losses, s=12, color="tab:orange", label="loss (draft's own samples, on-policy)", zorder=3)
            ax_loss.legend(fontsize=8)
    else:
        ax_loss.text(0.5, 0.5, "no training step logged yet", ha="center", va="center", transform=ax_loss.transAxes)
    ax_loss.set_ylabel("training loss")
    ax_loss.grid(alpha=0.3)

    tf_steps, tfs = _points(history, "teacher_forced_acceptance")
    if tf_steps:
        ax_tf.plot(tf_steps, tfs, marker="o", ms=4, lw=1.2, color="tab:green", label="α_TF (held-out records)")
        if best_step in tf_steps:
            a = tfs[tf_steps.index(best_step)]
            label = f"best/ = step {best_step} (α_TF {a:.4f})"
            scale, calibrated = summary.get("logit_scale"), summary.get("best_teacher_forced_acceptance")
            if isinstance(scale, (int, float)) and scale != 1.0 and isinstance(calibrated, (int, float)):
                label += f"; logits ×{scale:g}: {calibrated:.4f}"
            ax_tf.scatter([best_step], [a], marker="*", s=160, color="tab:red", zorder=4, label=label)
        ax_tf.legend(fontsize=8, loc="lower right")
    else:
        ax_tf.text(0.5, 0.5, "no α_TF measured", ha="center", va="center", transform=ax_tf.transAxes)
    if isinstance(best_step, int):
        for ax in (ax_loss, ax_tf):
            ax.axvline(best_step, color="tab:red", ls="--", lw=0.8, alpha=0.6)
    ax_tf.set_ylabel("α_TF = Σ min(p, q)")
    ax_tf.set_xlabel("optimizer step")
    ax_tf.grid(alpha=0.3)
    ax_tf.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def training_curves(summary: dict[str, Any], path: str | Path) -> Path:
    """Write curves_figure(summary) as a PNG to `path` (a temp file in the same directory, then renamed, so a
    reader never sees half a PNG); returns `path`. Any history, even an empty one, gives a valid image."""
    path = Path(path)
    fig = curves_figure(summary)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp.png", dir=path.parent)
    os.close(fd)
    with writing(path, lambda: Path(tmp).unlink(missing_ok=True)):
        fig.savefig(tmp, dpi=110, format="png")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600
        os.replace(tmp, path)
    log.info("distill: training curves -> %s", path)
    return path


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[0] in ("-h", "--help"):
        print("usage: python -m distill.plots runs/<run>/<stage>/summary.json [out.png]", file=sys.stderr)
        return 2
    src = Path(argv[0])
    if not src.is_file():
        print(f"error: no {src}; give the summary.json of a distill stage (runs/<run>/distill/summary.json)", file=sys.stderr)
        return 2
    out = Path(argv[1]) if len(argv) == 2 else src.parent.parent / "plots" / f"{src.parent.name}.png"
    print(training_curves(read_json(src), out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
