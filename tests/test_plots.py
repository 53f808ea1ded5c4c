"""Training curves (distill/plots.py) and the smoke run's offline W&B run: a real tiny smoke run (generate,
then distill with head.also so both trainers run) with W&B on as experiment=smoke sets it, and the figure
for that run's summary and for histories with nothing to draw yet.

    pytest tests/test_plots.py -q
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from matplotlib.image import imread

import distill.distill
from distill import generate, plots
from distill.utils import read_json

CONF = str(Path(__file__).resolve().parent.parent / "conf")
PNG = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 10_000, (path, len(data))
    assert imread(str(path)).shape[:2] == (605, 770)  # 7 x 5.5 in at 110 dpi
    assert not [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp.png")]  # no temp file left


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    """runs/smoke of `experiment=smoke model=tiny head.also=true` (generate, distill) with the smoke
    experiment's own logger (conftest.py turns it off for the other tests); returns the run directory."""
    root = tmp_path_factory.mktemp("smoke")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SPECDISTILL_LOGGER", raising=False)
        with initialize_config_dir(CONF, version_base="1.3"):
            over = ["model=tiny", "experiment=smoke", f"runs_root={root}", "head.also=true", "train.max_steps=3"]
            gen_cfg, cfg = compose("generate", overrides=over), compose("distill", overrides=over)
        assert cfg.logger == "wandb" and cfg.wandb_mode == "offline"
        generate.run(gen_cfg)
        distill.distill.run(cfg)
    return root / "smoke"


def test_smoke_distill_leaves_an_offline_wandb_run_and_curves(smoke):
    for stage in ("distill", "distill-head"):  # the draft's trainer and the head's, each its own W&B run
        runs = list((smoke / stage / "wandb").glob("offline-run-*"))
        assert len(runs) == 1 and list(runs[0].glob("*.wandb")), (stage, runs)
    summary = read_json(smoke / "distill-head" / "summary.json")
    assert summary["done"] and summary["step"] == 3
    assert_png(smoke / "plots" / "distill-head.png")  # written by the head's trainer at its final summary


def test_curves_of_a_real_run_draw_its_history(smoke, tmp_path):
    summary = read_json(smoke / "distill" / "summary.json")
    fig = plots.curves_figure(summary)
    ax_loss, ax_tf = fig.axes
    trained = [h for h in summary["history"] if h["loss"] is not None]
    assert list(ax_loss.lines[0].get_xdata()) == [h["step"] for h in trained] == [1, 2, 3]
    assert list(ax_loss.lines[0].get_ydata()) == pytest.approx([h["loss"] for h in trained])
    evals = [h for h in summary["history"] if "teacher_forced_acceptance" in h]
    assert list(ax_tf.lines[0].get_xdata()) == [h["step"] for h in evals] == [0, 2, 3]
    best = summary["best_step"]
    star = ax_tf.collections[0].get_offsets()[0]
    assert star[0] == best and star[1] == pytest.approx(next(h for h in evals if h["step"] == best)["teacher_forced_acceptance"])
    assert "smoke / distill" in fig.texts[0].get_text()
    out = plots.training_curves(summary, tmp_path / "plots" / "distill.png")
    assert out == tmp_path / "plots" / "distill.png"
    assert_png(out)


@pytest.mark.parametrize("history,empty_panels", [
    ([{"step": 0, "loss": None, "teacher_forced_acceptance": 0.25, "tokens_per_s": None}], ["no training step"]),
    ([{"step": 0, "loss": None}, {"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}], ["no α_TF"]),
    ([{"step": 0, "loss": None, "teacher_forced_acceptance": math.nan}, {"step": 1, "loss": math.inf}],
     ["no training step", "no α_TF"]),  # the head's α_TF is NaN when no position counts
    ([], ["no training step", "no α_TF"]),
])
def test_nothing_to_draw_yet_still_gives_a_valid_figure(tmp_path, history, empty_panels):
    summary = {"dir": "runs/r/distill", "best_step": 0 if history else None, "history": history}
    fig = plots.curves_figure(summary)
    notes = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert [n for n in notes if any(n.startswith(e) for e in empty_panels)] == notes and len(notes) == len(empty_panels)
    assert_png(plots.training_curves(summary, tmp_path / "c.png"))


def test_a_failed_write_keeps_the_old_figure(tmp_path, monkeypatch):
    path = plots.training_curves({"history": [{"step": 1, "loss": 1.0}]}, tmp_path / "c.png")
    before = path.read_bytes()

    def broken(self, fname, **kw):
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError("disk went away")

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", broken)
    with pytest.raises(OSError, match="disk went away"):
        plots.training_curves({"history": [{"step": 1, "loss": 2.0}]}, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["c.png"]


def test_command_line_draws_a_stage_summary(smoke, tmp_path, capsys):
    src = smoke / "distill" / "summary.json"
    out = tmp_path / "x.png"
    assert plots.main([str(src), str(out)]) == 0 and capsys.readouterr().out.strip() == str(out)
    assert_png(out)
    assert plots.main([str(tmp_path / "missing.json")]) == 2 and "error: no" in capsys.readouterr().err
