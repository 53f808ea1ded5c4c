"""Bad input and faults (docs/faults.md): each gives one message naming the fix, a non-zero exit, and
leaves what was there intact; a resume never walks into a bad state. Tiny model, offline, CPU."""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from distill import checkpoint as ck
from distill import train
from distill.train import TrainingDiverged
from test_train import assert_same_weights, gen, losses, make_cfg, setup_run  # noqa: F401 (gen: a fixture)

NAN = ("train.max_steps=4", "train.save_every=1", "train.eval_every=4")


def biggest(path) -> float:
    return max(float(v.abs().max()) for v in load_file(str(path / "model.safetensors")).values())


# ---------------------------------------------------------------- 1. a non-finite loss


def test_nan_loss_names_the_last_good_checkpoint_and_a_lower_lr_resumes_from_it(gen, tmp_path, caplog):
    # warm-up: step 1 runs at lr 0 (checkpoint-1 = the initial weights), step 2 at 5e29 blows the weights up
    # (finite, ~1e29: checkpoint-2), step 3's loss from them is NaN
    cfg = setup_run(gen, tmp_path, "nan", *NAN, "train.lr=1e30", "train.warmup_steps=2")
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3 .*checkpoint-2 came from the weights that "
                                               r"diverged.*last good checkpoint is \S*/checkpoint-1;.*train.lr"):
        train.run(cfg)
    out = tmp_path / "nan" / "distill"
    assert [s for s, _ in ck.checkpoints(out)] == [1]
    assert biggest(out / "diverged-checkpoint-2") > 1e20 and biggest(out / "checkpoint-1") < 10
    # the advice: a lower lr, rerun. It resumes from checkpoint-1 with the new rate and equals a run made
    # with that rate from the start (step 1 ran at lr 0 in both)
    caplog.set_level(logging.INFO, logger="distill.train")
    fixed = train.run(make_cfg(tmp_path, "nan", gen["prompts"], *NAN, "train.lr=1e-2", "train.warmup_steps=2"))
    assert "resuming from" in caplog.text and "checkpoint-1" in caplog.text and "train.lr=0.01" in caplog.text
    ref = train.run(setup_run(gen, tmp_path, "ref", *NAN, "train.lr=1e-2", "train.warmup_steps=2"))
    assert fixed["done"] and all(torch.isfinite(torch.tensor(losses(fixed))))
    assert losses(fixed) == losses(ref)
    assert_same_weights(out / "checkpoint-4", tmp_path / "ref" / "distill" / "checkpoint-4")


def test_nan_loss_with_no_good_checkpoint_says_the_rerun_starts_from_scratch(gen, tmp_path, caplog):
    cfg = setup_run(gen, tmp_path, "nan0", *NAN, "train.lr=1e30")
    with pytest.raises(TrainingDiverged, match=r"step 2 .*checkpoint-1 came from .*No good checkpoint.*from scratch"):
        train.run(cfg)
    out = tmp_path / "nan0" / "distill"
    assert ck.checkpoints(out) == [] and (out / "diverged-checkpoint-1").is_dir()
    caplog.set_level(logging.INFO, logger="distill.train")
    fixed = train.run(make_cfg(tmp_path, "nan0", gen["prompts"], *NAN, "train.lr=1e-2"))
    assert "training from scratch" in caplog.text and fixed["done"] and not list(out.glob("diverged-*"))
    ref = train.run(setup_run(gen, tmp_path, "ref0", *NAN, "train.lr=1e-2"))
    assert losses(fixed) == losses(ref)


def test_non_finite_weights_are_never_saved(gen, tmp_path, monkeypatch):
    real, calls = torch.optim.AdamW.step, {"n": 0}

    def poisoned(self, *a, **kw):  # the third update leaves a NaN in the weights (the loss was still finite)
        out = real(self, *a, **kw)
        calls["n"] += 1
        if calls["n"] == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    with pytest.raises(TrainingDiverged, match=r"weights are not finite after step 3.*last good checkpoint is \S*checkpoint-2"):
        train.run(setup_run(gen, tmp_path, "nanw", *NAN))
    out = tmp_path / "nanw" / "distill"
    assert [s for s, _ in ck.checkpoints(out)] == [1, 2] and not list(out.glob("*checkpoint-3"))
    for _, path in ck.checkpoints(out):
        assert all(bool(torch.isfinite(v).all()) for v in load_file(str(path / "model.safetensors")).values())
