"""The distill stage with student=head (distill/heads_train.py) on the tiny model: the loss falls, best/ is
the head of highest held-out α_TF and reloads, resume equals an uninterrupted run, bad input.

    pytest tests/test_heads_train.py -q
"""
from __future__ import annotations

import json

import pytest
import torch

import distill.distill
from distill.config import ConfigError
from distill.heads_train import measure_head
from specdec import SpeculativeDecoder
from specdec.head_drafter import HeadDrafter
from specdec.heads import load_head
from test_distill import assert_same_weights, gen, losses, make_cfg, resume_after_checkpoint_2, setup_run  # noqa: F401 (gen: a fixture)

HEAD = ("student=head", "head.lr=1e-2", "head.ttt_steps=3")


def test_head_loss_falls_and_best_is_a_loadable_head(gen, tmp_path):
    cfg = setup_run(gen, tmp_path, "h", *HEAD, "train.max_steps=10", "train.eval_every=5", "train.save_every=5",
                    "train.batch_size=8")
    s = distill.distill.run(cfg)
    ls = losses(s)
    assert s["student"] == "head" and len(ls) == 10 and ls[-1] < 0.8 * ls[0], ls
    out = tmp_path / "h" / "distill"
    evals = [(h["teacher_forced_acceptance"], -h["step"]) for h in s["history"] if h.get("teacher_forced_acceptance") is not None]
    assert len(evals) == 3 and all(h.get("greedy_agreement") is not None for h in s["history"] if "teacher_forced_acceptance" in h)
    alpha, neg_step = max(evals)
    assert s["best_step"] == -neg_step and s["best_teacher_forced_acceptance"] == pytest.approx(alpha)
    if s["best_step"] > 0:
        assert_same_weights(out / "best", out / f"checkpoint-{s['best_step']}")
    # best/ is an EAGLE-3 head of the tiny target (2 layers: it reads the state entering layer 1)
    from distill.models import load_target

    target, tok = load_target(cfg.model)
    head = load_head(out / "best", target)
    cfg_json = json.loads((out / "best" / "config.json").read_text())
    assert cfg_json["architectures"] == ["LlamaForCausalLMEagle3"] and head.feature_layers == (1,)
    assert json.loads((out / "best" / "best.json").read_text())["step"] == s["best_step"]
    # the held-out α_TF recorded for best/ is what the reloaded head measures (the measure is the head's own)
    from distill.batches import holdout_reference, split_holdout, to_examples
    from distill.records import load_generated
    from distill.heads_train import target_pass
    from distill.losses import VocabSubset
    from specdec.features import FeatureTaps

    _, held = split_holdout(to_examples(load_generated(tmp_path / "h"), cfg.train.max_seq_len), cfg.train.holdout, cfg.seed)
    ref = holdout_reference(target, held, cfg.train.batch_size, len(tok), "cpu")
    with FeatureTaps(target, head.feature_layers) as taps:
        feats = [target_pass(target, taps, b, False)[0] for b in ref.batches]
    tf, agree, den = measure_head(head, ref, feats, VocabSubset(head.vocab_ids, len(tok)))
    assert tf / den == pytest.approx(s["best_teacher_forced_acceptance"], abs=1e-5)
    # and it decodes losslessly
    prompts = [[5, 6, 7], [44], [9, 10, 11, 12]]
    a = SpeculativeDecoder(target, HeadDrafter(head), gamma=3).generate(prompts, max_new_tokens=12)
    from specdec import autoregressive_generate

    assert a.tokens == autoregressive_generate(target, prompts, max_new_tokens=12).tokens


def test_head_with_draft_vocabulary_and_topk_teacher(gen, tmp_path):
    cfg = setup_run(gen, tmp_path, "v", *HEAD, "model.draft_vocab=40", "train.teacher=topk", "train.max_steps=4")
    s = distill.distill.run(cfg)
    ls = losses(s)
    assert all(torch.isfinite(torch.tensor(ls))) and ls[-1] < ls[0], ls
    head = load_head(tmp_path / "v" / "distill" / "best")
    assert head.vocab_ids.numel() == 40 and s["settings"]["draft_vocab"] == 40


def test_head_resume_equals_uninterrupted(gen, tmp_path):
    cfg_b = resume_after_checkpoint_2(gen, tmp_path, *HEAD)
    again = distill.distill.run(cfg_b)  # done: nothing is trained again
    assert again["done"] and again["step"] == 4


def test_head_bad_input(gen, tmp_path):
    with pytest.raises(ConfigError, match="distill.generate"):
        distill.distill.run(make_cfg(tmp_path, "empty", gen["prompts"], *HEAD))
    with pytest.raises(ConfigError, match=r"head.layers.*distinct ids in \[1, 1\]"):
        distill.distill.run(setup_run(gen, tmp_path, "lay", *HEAD, "head.layers=[0,1]"))
    with pytest.raises(ConfigError, match="on_policy_fraction"):
        distill.distill.run(setup_run(gen, tmp_path, "onp", *HEAD, "train.on_policy_fraction=0.5"))
    with pytest.raises(ConfigError, match="ttt_steps"):
        distill.distill.run(setup_run(gen, tmp_path, "ttt", *HEAD, "head.ttt_steps=0"))
