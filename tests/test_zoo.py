"""The model zoo: every architecture family in specdec.tiny.ZOO (Llama, Qwen2, Qwen3, Gemma 2, Gemma 3,
Mistral, Phi-3, GPT-NeoX) as a tiny random model built here (4 layers, hidden 64, 259 ids, 16-token
windows where the family has them). For each: a draft made of target layers, speculative decoding
token-identical to the target's own greedy output 4+ windows long, and a save/load round trip of the
draft. One non-Llama family (Gemma 2: windowed and full layers, eager attention) also runs the whole
pipeline (generate -> distill -> evaluate -> publish dry run) on the CPU.

    pytest tests/test_zoo.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

from distill import pipeline
from distill.models import draft_from_target, load_model
from specdec.tiny import WINDOW, ZOO, tiny_tokenizer, tiny_zoo_model
from specdec import SpeculativeDecoder
from test_specdec_decoder import _prompts

CONF = Path(__file__).resolve().parents[1] / "conf"


def _pipeline_cfg(tmp_path, target_dir):
    """The smoke pipeline on a local tiny target: generate, 2 training steps, evaluate 4 windows long, publish."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="pipeline", overrides=[
            "experiment=smoke", f"runs_root={tmp_path / 'runs'}", f"model.target={target_dir}",
            "model.draft_layers=[0,3]", "model.dtype=float32", "model.device=cpu", "data.limit=6",
            f"generate.max_new_tokens={2 * WINDOW}", "train.max_steps=2", "evaluate.references=[target]",
            f"evaluate.max_new_tokens={4 * WINDOW}"])


@pytest.mark.parametrize("family", sorted(ZOO))
def test_draft_from_target_decodes_like_the_target_and_round_trips(family, tmp_path):
    target = tiny_zoo_model(family, seed=0, num_layers=4)
    draft = draft_from_target(target, [0, -1])
    assert type(draft) is type(target) and draft.config.num_hidden_layers == 2
    types = getattr(target.config, "layer_types", None)
    if types:  # each kept layer keeps its attention kind
        assert draft.config.layer_types == [types[0], types[-1]]
    body = draft.base_model
    last = target.base_model.layers[-1]
    for a, b in zip(body.layers[1].parameters(), last.parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()  # a copy of the target's last layer

    prompts = _prompts([3, WINDOW + 4, 1], seed=1)
    max_new = 4 * WINDOW + 4
    ref = [target.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    res = SpeculativeDecoder(target, draft, gamma=3, eos_token_id=[]).generate(prompts, max_new_tokens=max_new)
    assert res.tokens == ref
    assert 0 < res.metrics.accepted < res.metrics.proposed, "partial acceptance: rollbacks must happen"

    draft.save_pretrained(tmp_path / "draft")
    loaded = load_model(str(tmp_path / "draft"), dtype="float32", device="cpu")
    assert type(loaded) is type(draft)
    assert getattr(loaded.config, "sliding_window", None) == getattr(draft.config, "sliding_window", None)
    assert getattr(loaded.config, "layer_types", None) == getattr(draft.config, "layer_types", None)
    x = torch.tensor(_prompts([3 * WINDOW], seed=2))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x).logits, draft(x).logits, rtol=0, atol=0)


def test_a_gemma2_target_runs_the_whole_pipeline(tmp_path):
    """Generate, distill a few steps, evaluate (greedy speculative output identical to the target's past the
    window) and publish (dry run) with a tiny Gemma 2 target given as a local model directory."""
    target_dir = tmp_path / "gemma2"
    tiny_zoo_model("gemma2", seed=0, num_layers=4).save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    pipeline.run(_pipeline_cfg(tmp_path, target_dir))
    rd = tmp_path / "runs" / "smoke"
    summary = json.loads((rd / "distill" / "summary.json").read_text())
    assert summary["history"], "the distill stage trained"
    report = json.loads((rd / "evaluate" / "report.json").read_text())
    assert report["greedy_identical"] is True
    rows = [r for r in report["rows"] if r["kind"] == "model"]
    assert rows and all(r.get("acceptance_rate") is not None for r in rows)
    published = AutoModelForCausalLM.from_pretrained(rd / "publish")
    assert type(published).__name__ == "Gemma2ForCausalLM"
    assert published.config.layer_types == ["sliding_attention", "full_attention"]
    assert "apply_chat_template" in (rd / "publish" / "README.md").read_text()


def test_a_base_model_runs_the_pipeline_with_a_plain_template_and_stop_strings(tmp_path):
    """A Qwen2 base model (windowed layers, no chat template): prompts through data.template, answers
    that end at a stop string the target writes, evaluation on the same template, a card that matches."""
    from omegaconf import OmegaConf

    from distill.data import encode_prompt, load_prompts
    from distill.records import load_generated

    fmt = "Question: {prompt}\nAnswer:"
    target = tiny_zoo_model("qwen2", seed=0, num_layers=4)
    tok = tiny_tokenizer()
    tok.chat_template = None
    target_dir = tmp_path / "qwen2-base"
    target.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    cfg = _pipeline_cfg(tmp_path, target_dir)
    OmegaConf.update(cfg, "data.template", fmt)
    # the most common character of the target's own answers is a stop string it writes
    answers = []
    for row in load_prompts(cfg.data):
        ids = torch.tensor([encode_prompt(tok, row["messages"], template=fmt)])
        out = target.generate(ids, max_new_tokens=2 * WINDOW, do_sample=False, eos_token_id=2, pad_token_id=0)
        answers.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    stop = max(set("".join(answers)), key="".join(answers).count)
    OmegaConf.update(cfg, "generate.stop_strings", [stop])
    pipeline.run(cfg)

    rd = tmp_path / "runs" / "smoke"
    records = load_generated(rd).to_list()
    assert all(r["prompt"].startswith("Question: ") and r["prompt"].endswith("\nAnswer:") for r in records)
    stopped = [r for r in records if r["finish_reason"] == "stop"]
    assert len(stopped) >= 2 and all(stop in r["response"] for r in stopped)
    report = json.loads((rd / "evaluate" / "report.json").read_text())
    assert report["greedy_identical"] is True
    assert {s["template"] for s in report["settings"]["eval_sets"].values()} == {fmt}
    card = (rd / "publish" / "README.md").read_text()
    assert "apply_chat_template" not in card and f"tok({fmt!r}.format(prompt=" in card
    assert f"stop_strings={[stop]!r}, tokenizer=tok" in card
