"""publish: the staged folder is a loadable draft with a model card; uploads go to a local fake Hub."""
from __future__ import annotations

import base64
import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

from distill import publish
from distill.card import base_model
from distill.config import ConfigError
from distill.models import draft_from_target, load_model, load_tokenizer
from specdec.tiny import tiny_draft
from distill.utils import read_json

CONF = Path(__file__).resolve().parents[1] / "conf"
RUN = "pub"


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="publish", overrides=[
            "model=tiny", "experiment=smoke", f"runs_root={tmp_path / 'runs'}", f"run_name={RUN}", *overrides])


def _row(name, kind, **kw):
    row = {"name": name, "kind": kind, "draft": None, "eval_set": "mt_bench", "temperature": 0.0, "top_p": 1.0,
           "gamma": 4, "batch_size": 1, "draft_sampled": False, "acceptance_rate": 0.61,
           "tokens_per_target_call": 2.3, "tokens_per_s": 150.0, "speedup": 1.4, "speedup_spread": [1.3, 1.5],
           "predicted_speedup": 1.6, "greedy_identical": True}
    row.update(kw)
    return row


def _report(greedy_identical=True):
    rows = [_row("target", "target", gamma=None, acceptance_rate=None, tokens_per_target_call=1.0, speedup=1.0,
                 speedup_spread=None, predicted_speedup=None, greedy_identical=None),
            _row("init", "model", acceptance_rate=0.31, speedup=0.9),
            _row("best", "model", greedy_identical=greedy_identical),
            _row("best", "model", eval_set="humaneval", acceptance_rate=0.72, speedup=1.7),
            _row("hf_assisted", "hf_assisted", acceptance_rate=None, speedup=1.2)]
    return {"target": "tiny", "settings": {"max_new_tokens": 24, "device": "cpu"},
            "definitions": {"acceptance_rate": "accepted ÷ tried", "speedup": "target time ÷ speculative time"},
            "rows": rows, "greedy_identical": greedy_identical, "best": {"name": "best", "gamma": 4}, "doctor": []}


def _summary(loss="fkl", kind="full", **extra):
    """A distill stage's summary.json as the trainers write it (settings: what trained the draft)."""
    settings = {"loss": {"name": loss, "beta": 0.5, "temperature": 1.0, "ce_weight": 0.0},
                "student": {"kind": kind, "lora_r": 16, "lora_alpha": 32, "freeze_layers": 0},
                "train": {"max_steps": 6, "batch_size": 2, "grad_accum": 1, "lr": 1e-4, "schedule": "cosine",
                          "teacher": "online", "on_policy_fraction": 0.0},
                "global_batch": 2, "draft_init": "from_target", "draft_layers": [0, 1]}
    settings.update(extra)
    return {"best_step": 6, "step": 6, "init_teacher_forced_acceptance": 0.52, "best_teacher_forced_acceptance": 0.71,
            "train_records": 20, "holdout_records": 4, "settings": settings}


@pytest.fixture
def run(tmp_path):
    """A run dir as the earlier stages leave it: distill/best (+ a checkpoint's training state), summary, report."""
    rd = tmp_path / "runs" / RUN
    best = rd / "distill" / "best"
    best.mkdir(parents=True)
    target = load_model("tiny", device="cpu")
    tiny_draft(target, noise=0.3).save_pretrained(best)
    load_tokenizer("tiny").save_pretrained(best)
    (best / "accelerate").mkdir()
    (best / "accelerate" / "optimizer.bin").write_bytes(b"not for upload")
    (best / "trainer_state.json").write_text("{}")
    (rd / "distill" / "summary.json").write_text(json.dumps(_summary()))
    (rd / "evaluate").mkdir()
    (rd / "evaluate" / "report.json").write_text(json.dumps(_report()))
    return rd


def test_staged_folder_is_a_working_assistant_model(tmp_path, run):
    out = publish.run(_cfg(tmp_path))
    folder = Path(out["folder"])
    assert folder == run / "publish" and out["kind"] == "model" and out["dry_run"]
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"} <= names
    assert "trainer_state.json" not in names and "accelerate" not in names
    assert not list(run.glob(".publish.*"))  # temp dirs swapped in and gone

    draft = AutoModelForCausalLM.from_pretrained(folder)
    target = load_model("tiny", device="cpu")
    tok = load_tokenizer(str(folder))
    inputs = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about tests."}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        plain = target.generate(**inputs, max_new_tokens=24, do_sample=False)
        assisted = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=draft)
    assert assisted.tolist() == plain.tolist()


def test_model_card_metadata_and_body(tmp_path, run):
    publish.run(_cfg(tmp_path, "publish.repo_id=me/tiny-draft", "publish.license=mit"))
    from huggingface_hub import ModelCard

    card = ModelCard.load(run / "publish" / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"speculative-decoding", "draft-model", "distillation"} <= set(card.data.tags)
    assert card.data.license == "mit"
    assert card.data.base_model is None  # the tiny test target has no hub id
    text = card.text
    assert "assistant_model=draft" in text
    assert ('speculative_config={"method": "draft_model", "model": "me/tiny-draft", "num_speculative_tokens": 4}'
            in text)
    assert """--speculative-config '{"method": "draft_model", "model": "me/tiny-draft", "num_speculative_tokens": 4}'""" in text
    assert "--speculative-algorithm STANDALONE --speculative-draft-model-path me/tiny-draft" in text
    assert "--speculative-num-steps 4 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5" in text
    assert "| humaneval | distilled draft (best) | greedy | 1 | 4 | 0.720 |" in text
    assert "undistilled draft (init)" in text and "HF assisted generation" in text
    assert "0.520 before distillation → 0.710 after (step 6)" in text
    assert "FKL" in text


def _card_inputs(card_text: str, tok) -> list[int]:
    """Run the card's `inputs = ...` lines (up to the generate call) with `tok` -> the prompt ids."""
    code = card_text.split("inputs = ", 1)[1].split("out = target.generate", 1)[0]
    scope = {"tok": tok}
    exec("inputs = " + code, scope)
    return scope["inputs"]["input_ids"][0].tolist()


@pytest.mark.parametrize("template,chat", [(None, True), ("Question: {prompt}\\nAnswer:", True), (None, False)],
                         ids=["chat-template", "plain-format", "no-chat-template-fallback"])
def test_card_prompts_the_target_as_training_and_evaluation_did(tmp_path, run, template, chat):
    from distill.data import encode_prompt

    tok = load_tokenizer("tiny")
    if not chat:  # a base model's tokenizer: the target dir carries no chat template
        tok.chat_template = None
    target_dir = tmp_path / "target"
    load_model("tiny", device="cpu").save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    overrides = [f"model.target={target_dir}", "generate.stop_strings=['\\nQuestion:']"]
    if template:
        overrides.append(f"data.template='{template}'")
    publish.run(_cfg(tmp_path, *overrides))
    text = (run / "publish" / "README.md").read_text()
    assert ("apply_chat_template" in text) == (chat and template is None)
    assert _card_inputs(text, tok) == encode_prompt(tok, [{"role": "user", "content": "Hello!"}], template=template)
    assert "stop_strings=['\\nQuestion:'], tokenizer=tok" in text


def test_base_model_of_the_embedded_default():
    from omegaconf import OmegaConf

    m = OmegaConf.create({"target": "smollm2-135m-instruct", "draft_init": "from_target", "draft": None})
    assert base_model(m) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    m.draft_init, m.draft = "pretrained", "Qwen/Qwen2.5-0.5B-Instruct"
    assert base_model(m) == "Qwen/Qwen2.5-0.5B-Instruct"


def test_rerun_is_a_no_op_and_changes_restage(tmp_path, run):
    publish.run(_cfg(tmp_path))
    stamp = {p.name: p.stat().st_mtime_ns for p in (run / "publish").iterdir()}
    publish.run(_cfg(tmp_path))
    assert {p.name: p.stat().st_mtime_ns for p in (run / "publish").iterdir()} == stamp
    publish.run(_cfg(tmp_path, "publish.repo_id=me/other"))  # the card changes -> restaged
    assert "me/other" in (run / "publish" / "README.md").read_text()


def test_refuses_without_report_or_with_greedy_mismatch(tmp_path, run):
    (run / "evaluate" / "report.json").unlink()
    with pytest.raises(ConfigError, match="no evaluation report.*publish.force=true"):
        publish.run(_cfg(tmp_path))
    (run / "evaluate" / "report.json").write_text(json.dumps(_report(greedy_identical=False)))
    with pytest.raises(ConfigError, match="greedy_identical: false.*publish.force=true"):
        publish.run(_cfg(tmp_path))
    out = publish.run(_cfg(tmp_path, "publish.force=true"))
    assert "greedy_identical: false" in (Path(out["folder"]) / "README.md").read_text()


def test_flagged_numbers_never_reach_the_card_and_block_an_upload(tmp_path, run, fake_hub):
    noise = {"speedup": "its 95% interval [0.81, 2.90] includes 1"}
    report = _report()
    for r in report["rows"]:
        if r["name"] == "best":
            r.update(speedup=2.11, flagged=noise)
    (run / "evaluate" / "report.json").write_text(json.dumps(report))
    out = publish.run(_cfg(tmp_path))  # a dry run stages the card, with n.s. in place of the number
    card = (Path(out["folder"]) / "README.md").read_text()
    assert "2.11" not in card and "n.s." in card and "No speedup that the evaluation can support" in card
    with pytest.raises(ConfigError, match="no speedup .* can support.*evaluate.timed_prompts.*publish.force=true"):
        publish.run(_cfg(tmp_path, "publish.dry_run=false", "publish.repo_id=me/tiny-draft"))
    # one supported number is enough to publish, and it is the one the card shows
    report["rows"][3].update(flagged={}, speedup=1.7)
    (run / "evaluate" / "report.json").write_text(json.dumps(report))
    card = (Path(publish.run(_cfg(tmp_path))["folder"]) / "README.md").read_text()
    assert "speedup 1.70× measured" in card and "2.11" not in card


# ---------------------------------------------------------------- model-index, the training section, a fixed γ


def _index(folder) -> dict:
    """{(eval set, metric type): value} of the staged card's model-index, as huggingface_hub parses it."""
    from huggingface_hub import EvalResult, ModelCard

    results = ModelCard.load(Path(folder) / "README.md").data.eval_results
    assert results and all(isinstance(r, EvalResult) for r in results)
    return {(r.dataset_name, r.metric_type): r.metric_value for r in results}


def _write_manifest(run, data, in_domain=None):
    """generate/manifest.json as the generate stage writes it (the parts publish reads)."""
    (run / "generate").mkdir(exist_ok=True)
    (run / "generate" / "manifest.json").write_text(json.dumps({
        "identity": {"data": data, "sampling": {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 24,
                                                "num_samples": 1}},
        "data_limit": 50, "data_self_instruct": 0, "data_in_domain": in_domain}))


def test_model_index_holds_the_headline_row_of_each_eval_set(tmp_path, run):
    report = _report()
    report["settings"]["eval_sets"] = {"mt_bench": {"source": {"source": "mt_bench"}},
                                       "humaneval": {"source": {"source": "humaneval"}},
                                       "mt_bench_2turn": {"source": {"source": "mt_bench", "turn": 2}}}
    report["rows"] += [
        _row("best", "model", eval_set="mt_bench_2turn", acceptance_rate=0.44, tokens_per_target_call=1.9,
             speedup=1.1, modeled_speedup=1.15),
        # the same draft at other settings (sampled, batch 2, another γ): none of them is the headline
        _row("best", "model", temperature=1.0, acceptance_rate=0.5, speedup=1.25),
        _row("best", "model", batch_size=2, acceptance_rate=0.59, speedup=1.05),
        _row("best", "model", gamma=2, acceptance_rate=0.66, tokens_per_target_call=1.6, speedup=1.3)]
    (run / "evaluate" / "report.json").write_text(json.dumps(report))
    _write_manifest(run, {"source": "hub", "path": "HuggingFaceH4/ultrachat_200k", "shuffle": True},
                    in_domain={"humaneval": {"source": "humaneval", "limit": 48},
                               "mt_bench_2turn": {"source": "mt_bench", "turn": 2}})
    folder = Path(publish.run(_cfg(tmp_path, "publish.repo_id=me/tiny-draft"))["folder"])
    from huggingface_hub import ModelCard

    data = ModelCard.load(folder / "README.md").data
    assert data.model_name == "tiny-draft"
    assert data.datasets == ["HuggingFaceH4/ultrachat_200k", "openai/openai_humaneval"]  # turn 2 trains nothing
    assert {r.task_type for r in data.eval_results} == {"text-generation"}
    assert _index(folder) == {
        ("humaneval", "acceptance_rate"): 0.72, ("humaneval", "tokens_per_target_call"): 2.3,
        ("humaneval", "speedup"): 1.7,
        ("mt_bench", "acceptance_rate"): 0.61, ("mt_bench", "tokens_per_target_call"): 2.3, ("mt_bench", "speedup"): 1.4,
        ("mt_bench_2turn", "acceptance_rate"): 0.44, ("mt_bench_2turn", "tokens_per_target_call"): 1.9,
        ("mt_bench_2turn", "speedup"): 1.1, ("mt_bench_2turn", "modeled_speedup"): 1.15}
    by = {r.dataset_name: r for r in data.eval_results}
    assert by["humaneval"].dataset_type == "openai/openai_humaneval"
    # MT-Bench's two turns come from one Hub dataset and stay two entries
    assert by["mt_bench"].dataset_type == by["mt_bench_2turn"].dataset_type == "HuggingFaceH4/mt_bench_prompts"
    assert by["mt_bench"].dataset_config != by["mt_bench_2turn"].dataset_config
    assert "γ=4" in by["mt_bench"].task_name and "greedy" in by["mt_bench"].task_name


def test_flagged_and_untimed_speedups_stay_out_of_model_index_and_table(tmp_path, run):
    report = _report()
    for r in report["rows"]:
        if r["name"] == "best" and r["eval_set"] == "mt_bench":
            r.update(speedup=2.11, modeled_speedup=1.93, flagged={"speedup": "its 95% interval [0.81, 2.90] includes 1"})
    # γ=2 was not timed: its speedup is modeled with γ=4's costs (evaluate flags it; here even the flag is missing)
    report["rows"] += [_row("best", "model", eval_set=s, gamma=2, speedup=None, modeled_speedup=3.33, costs_from_gamma=4)
                       for s in ("mt_bench", "humaneval")]
    (run / "evaluate" / "report.json").write_text(json.dumps(report))
    folder = Path(publish.run(_cfg(tmp_path))["folder"])
    index = _index(folder)
    assert ("mt_bench", "speedup") not in index and index[("mt_bench", "modeled_speedup")] == 1.93
    assert index[("humaneval", "speedup")] == 1.7
    text = (folder / "README.md").read_text()
    assert "2.11" not in text and "3.33" not in text
    line = next(x for x in text.splitlines() if x.startswith("| mt_bench | distilled draft (best) | greedy | 1 | 4 |"))
    assert [c.strip() for c in line.split("|")[-3:-1]] == ["n.s.", "1.93×"]
    # the evaluation picked the untimed γ: α and τ are published there, no speedup at all
    report["best"] = {"name": "best", "gamma": 2}
    (run / "evaluate" / "report.json").write_text(json.dumps(report))
    folder = Path(publish.run(_cfg(tmp_path))["folder"])
    assert {metric for _, metric in _index(folder)} == {"acceptance_rate", "tokens_per_target_call"}
    text = (folder / "README.md").read_text()
    assert "3.33" not in text and "No speedup that the evaluation can support at γ=2" in text
    assert "Best setting" not in text and "num_assistant_tokens = 2" in text


def test_training_section_comes_from_the_drafts_own_summary(tmp_path, run):
    from omegaconf import OmegaConf

    _write_manifest(run, {"source": "stdlib", "shuffle": True})
    # a later config (the run's config.yaml and the cfg given to publish) says otherwise on every field
    later = ["loss=tvd", "student=lora", "train.lr=5e-3", "model.draft_layers=[0]", "data.source=humaneval",
             "generate.max_new_tokens=99"]
    (run / "config.yaml").write_text(OmegaConf.to_yaml(_cfg(tmp_path, *later)))
    text = (Path(publish.run(_cfg(tmp_path, *later))["folder"]) / "README.md").read_text()
    training = text.split("## Training", 1)[1]
    assert "- **loss**: FKL, temperature 1.0" in training and "TVD" not in text
    assert "- **student**: full fine-tune; 6 steps, 2 records per step, lr 0.0001 (cosine)" in training
    assert "layers [0, 1] of the target" in training
    assert ("greedy, up to 24 new tokens) to prompts built from the Python standard library" in training
            and "HumanEval" not in training and "99" not in training)
    assert "0.520 before distillation → 0.710 after (step 6)" in training


def test_training_section_of_a_head_is_the_heads_own(tmp_path, run):
    from specdec.heads import FeatureHead
    from specdec.tiny import tiny_model

    head_dir = run / "distill-head" / "best"
    FeatureHead.from_target(tiny_model(seed=0, num_layers=8), vocab_ids=torch.arange(3, 131)).save_pretrained(head_dir)
    load_tokenizer("tiny").save_pretrained(head_dir)
    (run / "distill-head" / "summary.json").write_text(json.dumps(_summary(
        loss="rkl", kind="head", head={"ttt_steps": 5, "lr": 0.002, "layers": [2, 4, 5]})))
    report = _report()
    report["rows"] += [_row("head", "head", draft=str(head_dir), eval_set=s, speedup=1.9) for s in ("mt_bench", "humaneval")]
    report["best"] = {"name": "head", "draft": str(head_dir), "gamma": 4}
    (run / "evaluate" / "report.json").write_text(json.dumps(report))
    out = publish.run(_cfg(tmp_path))  # publish.draft=fastest: the head; distill/summary.json says FKL
    assert out["kind"] == "head"
    training = (Path(out["folder"]) / "README.md").read_text().split("## Training", 1)[1]
    assert "- **loss**: RKL, temperature 1.0; teacher: the target's full distribution\n" in training
    assert "FKL" not in training and "λ" not in training
    assert "feature head (EAGLE-3), training-time test over 5 steps; 6 steps, 2 records per step, lr 0.002" in training
    assert "hidden states entering layers [2, 4, 5]" in training


def test_transformers_snippet_proposes_gamma_tokens_every_round(tmp_path, run, monkeypatch):
    from transformers.generation import candidate_generator as cg

    report = _report()
    for r in report["rows"]:
        r["gamma"] = None if r["kind"] == "target" else 3
    report["best"]["gamma"] = 3
    (run / "evaluate" / "report.json").write_text(json.dumps(report))
    folder = Path(publish.run(_cfg(tmp_path))["folder"])
    text = (folder / "README.md").read_text()
    draft = AutoModelForCausalLM.from_pretrained(folder)
    exec("\n".join(x for x in text.splitlines() if x.startswith("draft.generation_config.")), {"draft": draft})
    assert draft.generation_config.num_assistant_tokens == 3
    assert draft.generation_config.num_assistant_tokens_schedule == "constant"

    proposed = []  # (tokens the draft proposed, the room left before max_length) per round
    get_candidates = cg.AssistedCandidateGenerator.get_candidates

    def spy(self, input_ids, **kw):
        ids, logits = get_candidates(self, input_ids, **kw)
        proposed.append((ids.shape[1] - input_ids.shape[1], self.main_model_max_length - input_ids.shape[1] - 1))
        return ids, logits

    monkeypatch.setattr(cg.AssistedCandidateGenerator, "get_candidates", spy)
    tok = load_tokenizer(str(folder))
    inputs = tok.apply_chat_template([{"role": "user", "content": "Count to ten."}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():  # no EOS: every round could propose γ tokens, and with the card's settings every one does
        load_model("tiny", device="cpu").generate(**inputs, assistant_model=draft, max_new_tokens=40, do_sample=False,
                                                  eos_token_id=None)
    assert len(proposed) > 5 and all(n == min(3, room) for n, room in proposed)


def test_upload_needs_repo_id_and_draft(tmp_path, run):
    with pytest.raises(ConfigError, match="publish.repo_id is required"):
        publish.run(_cfg(tmp_path, "publish.dry_run=false"))
    shutil.rmtree(run / "distill" / "best")
    with pytest.raises(ConfigError, match="no draft at"):
        publish.run(_cfg(tmp_path))


def _lora_run(run):
    """distill/ as a LoRA student with student.merge=false leaves it: best/adapter/ over init/ (layers [0])."""
    from peft import LoraConfig, get_peft_model

    shutil.rmtree(run / "distill" / "best")
    base = draft_from_target(load_model("tiny", device="cpu"), [0])
    base.save_pretrained(run / "distill" / "init")
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(run / "distill" / "best" / "adapter")
    load_tokenizer("tiny").save_pretrained(run / "distill" / "best")
    return peft_model


def test_lora_adapter_is_merged(tmp_path, run):
    peft_model = _lora_run(run)
    out = publish.run(_cfg(tmp_path, "model.draft_layers=[0]"))
    assert out["kind"] == "merge"
    merged = AutoModelForCausalLM.from_pretrained(out["folder"])
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, atol=1e-4, rtol=1e-4)
    assert not (Path(out["folder"]) / "adapter_config.json").exists()
    # with student.merge=true the merged model sits beside adapter/: it is copied as is
    merged.save_pretrained(run / "distill" / "best")
    out = publish.run(_cfg(tmp_path, "model.draft_layers=[0]"))
    assert out["kind"] == "model" and not (Path(out["folder"]) / "adapter").exists()


def test_lora_adapter_unmerged_needs_a_hub_base(tmp_path, run):
    _lora_run(run)
    with pytest.raises(ConfigError, match="publish.merge=true"):
        publish.run(_cfg(tmp_path, "model.draft_layers=[0]", "publish.merge=false"))
    out = publish.run(_cfg(tmp_path, "publish.merge=false", "model.draft_init=pretrained", "model.draft=org/tiny-base"))
    folder = Path(out["folder"])
    assert out["kind"] == "adapter" and not (folder / "model.safetensors").exists()
    assert read_json(folder / "adapter_config.json")["base_model_name_or_path"] == "org/tiny-base"
    assert "lora" in (folder / "README.md").read_text().split("---")[1]


# ---------------------------------------------------------------- a fake Hub on 127.0.0.1


class FakeHub:
    """Answers the calls huggingface_hub makes for create_repo, create_branch and upload_folder; records them.

    Every file is declared "regular" at preupload, so the commit carries its bytes (base64) and the test
    can compare them with the staged folder. Anything else gets a 404 (and fails the test).
    """

    def __init__(self, max_requests=50):
        self.requests, self.files, self.repos, self.branches = [], {}, set(), set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, payload = hub.handle(self.path, body, {k.lower(): v for k, v in self.headers.items()})
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                if len(hub.requests) >= max_requests:  # bounded: a runaway client cannot keep it alive
                    threading.Thread(target=hub.server.shutdown, daemon=True).start()

            do_GET = do_PUT = do_POST

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def handle(self, raw_path, body, headers):
        path = urlsplit(raw_path).path
        self.requests.append({"path": path, "query": urlsplit(raw_path).query, "headers": headers, "body": body})
        if path == "/api/repos/create":
            req = json.loads(body)
            rid = f"{req['organization']}/{req['name']}"
            if rid in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.url}/{rid}"}
            self.repos.add(rid)
            return 200, {"url": f"{self.url}/{rid}", "name": rid}
        if path == "/api/validate-yaml":
            return 200, {"errors": [], "warnings": []}
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit|branch)/(.+)", path)
        if not m or m.group(1) not in self.repos:
            return 404, {"error": f"not found: {path}"}
        rid, op, rev = m.group(1), m.group(2), unquote(m.group(3))
        if op == "branch":
            self.branches.add(rev)
            return 200, {}
        if rev != "main" and rev not in self.branches:
            return 404, {"error": f"revision {rev} not found"}
        if op == "preupload":
            files = json.loads(body)["files"]
            return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
        for line in body.splitlines():  # commit: ndjson, a header then one line per file
            item = json.loads(line)
            if item["key"] == "file":
                self.files[(rid, rev, item["value"]["path"])] = base64.b64decode(item["value"]["content"])
        return 200, {"commitUrl": f"{self.url}/{rid}/commit/{'a' * 40}", "commitOid": "a" * 40, "pullRequestUrl": None}

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub(monkeypatch):
    from huggingface_hub import constants

    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_fake_test_token")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest sets offline mode for everything else
        yield hub


@pytest.mark.timeout(120)
def test_upload_to_fake_hub(tmp_path, run, fake_hub):
    cfg = _cfg(tmp_path, "publish.dry_run=false", "publish.repo_id=me/tiny-draft", "publish.private=true",
               "publish.revision=v1")
    out = publish.run(cfg)
    paths = [r["path"] for r in fake_hub.requests]
    assert paths[0] == "/api/repos/create" and "/api/models/me/tiny-draft/branch/v1" in paths
    assert paths[-1] == "/api/models/me/tiny-draft/commit/v1"
    create = json.loads(fake_hub.requests[0]["body"])
    assert create["name"] == "tiny-draft" and create["organization"] == "me" and create["visibility"] == "private"
    assert all(r["headers"].get("authorization") == "Bearer hf_fake_test_token" for r in fake_hub.requests)
    folder = Path(out["folder"])
    staged = {p.name: p.read_bytes() for p in folder.iterdir()}
    uploaded = {path: data for (rid, rev, path), data in fake_hub.files.items() if (rid, rev) == ("me/tiny-draft", "v1")}
    assert uploaded == staged  # exactly the staged folder
    assert out["upload"]["commit"] == "a" * 40
    assert read_json(tmp_path / "runs" / RUN / "publish.json")["uploads"][-1]["revision"] == "v1"

    fake_hub.requests.clear()  # a second upload: the repo exists (409 is fine), the branch too
    publish.run(cfg)
    assert [r["path"] for r in fake_hub.requests][-1] == "/api/models/me/tiny-draft/commit/v1"


def test_upload_needs_a_token(tmp_path, run, fake_hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(ConfigError, match="hf auth login"):
        publish.run(_cfg(tmp_path, "publish.dry_run=false", "publish.repo_id=me/tiny-draft"))
    assert fake_hub.requests == []


def test_draft_vocabulary_travels_with_the_draft(tmp_path, run):
    from conftest import write_generated

    from specdec.drafters import load_draft_vocab

    write_generated(run, [[7, 7, 9, 40], [9, 41]])
    out = publish.run(_cfg(tmp_path, "model.draft_vocab=6", "publish.repo_id=me/tiny-draft"))
    folder = Path(out["folder"])
    # by count, then the lowest single-character tokens: ids 0-2 are the tiny tokenizer's specials
    assert load_draft_vocab(folder).tolist() == [3, 4, 7, 9, 40, 41]
    card = (folder / "README.md").read_text()
    assert "draft_vocab.json" in card and "python -m specdec --target" in card
    publish.run(_cfg(tmp_path, "publish.repo_id=me/tiny-draft"))  # model.draft_vocab=0: no file
    assert load_draft_vocab(folder) is None


# -- a feature head (student=head): the EAGLE-3 checkpoint vLLM and SGLang load ------------------
# What their EAGLE-3 loaders read (vLLM vllm/model_executor/models/llama_eagle3.py, SGLang
# python/sglang/srt/models/llama_eagle3.py): the layer as midlayer.* (vLLM renames it layers.0.*; both
# stack q/k/v and gate/up themselves), fc.weight [H, 3·H_target], norm.weight, lm_head.weight [draft vocab, H],
# d2t (draft id -> target id offsets) and t2d (skipped by both); no embed_tokens (shared from the target).
EAGLE3_TENSORS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
}


def test_head_is_staged_as_an_eagle3_checkpoint(tmp_path, run):
    from safetensors.torch import load_file

    from specdec.tiny import tiny_model
    from specdec.heads import FeatureHead, load_head

    target = tiny_model(seed=0, num_layers=8)  # 8 layers: EAGLE-3's own choice, the states entering 2, 4 and 5
    ids = torch.arange(3, 131)
    head = FeatureHead.from_target(target, vocab_ids=ids)
    best = run / "distill" / "best"
    shutil.rmtree(best)
    head.save_pretrained(best)
    load_tokenizer("tiny").save_pretrained(best)
    report = _report()
    for r in report["rows"]:
        r["kind"] = "head" if r["name"] == "best" else r["kind"]
    (run / "evaluate" / "report.json").write_text(json.dumps(report))
    out = publish.run(_cfg(tmp_path, "publish.repo_id=me/tiny-eagle3"))
    folder = Path(out["folder"])
    assert out["kind"] == "head"
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "README.md"}
    assert "generation_config.json" not in {p.name for p in folder.iterdir()}

    cfg = read_json(folder / "config.json")
    H = target.config.hidden_size
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == H and cfg["target_hidden_size"] == H
    assert cfg["draft_vocab_size"] == 128 and cfg["vocab_size"] == 259 and cfg["tie_word_embeddings"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: the state entering layer j
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}  # SGLang adds 1
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_theta", "max_position_embeddings", "hidden_act"):
        assert key in cfg, key

    t = load_file(str(folder / "model.safetensors"))
    assert set(t) == EAGLE3_TENSORS
    heads, kv, D = target.config.num_attention_heads, target.config.num_key_value_heads, target.config.head_dim
    assert t["fc.weight"].shape == (H, 3 * H)
    assert t["midlayer.self_attn.q_proj.weight"].shape == (heads * D, 2 * H)  # [embedding, fused feature]
    assert t["midlayer.self_attn.k_proj.weight"].shape == (kv * D, 2 * H)
    assert t["lm_head.weight"].shape == (128, H)
    assert t["d2t"].dtype == torch.int64 and torch.equal(torch.arange(128) + t["d2t"], ids)  # vLLM: base + d2t
    assert t["t2d"].dtype == torch.bool and t["t2d"].sum() == 128
    assert torch.equal(load_head(folder, target).lm_head.weight, head.lm_head.weight)

    text = (folder / "README.md").read_text()
    assert 'speculative_config={"method": "eagle3", "model": "me/tiny-eagle3", "num_speculative_tokens": 4}' in text
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path me/tiny-eagle3" in text
    assert "assistant_model" not in text and "may load in" not in text
    assert "| humaneval | distilled draft (best) | greedy | 1 | 4 | 0.720 |" in text
