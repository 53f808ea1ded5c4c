"""The distill stage (distill/distill.py) on the tiny model: training, saving, resume, two processes, best
checkpoint by α_TF, bad input. Offline, CPU; the generated data comes from distill.generate on the
tiny target (with top-k logits), made once per module."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from distill import checkpoint as ck
from distill import generate, records
import distill.distill
from distill.config import ConfigError
from distill.distill import TrainingDiverged

ROOT = Path(__file__).resolve().parent.parent
CONF = str(ROOT / "conf")
PROMPTS = [
    "Hi", "What is two plus two?", "Write a haiku about the sea.", "Name three primes.", "x", "List the planets.",
    "Why is the sky blue?", "Tell me a joke about cats.", "Count to five.", "Spell python backwards.",
    "What is a list?", "Say hello in French.", "Define recursion.", "Add 17 and 25.", "Name a colour.",
    "What is the capital of Italy?", "Describe a cloud.", "Give me a word that rhymes with cat.",
    "Translate 'dog' to German.", "What day comes after Monday?",
]
BASE = [
    "model=tiny", "data=jsonl", "logger=none", "generate.max_new_tokens=16", "generate.store_topk=16",
    "generate.batch_size=8", "train.batch_size=4", "train.holdout=4", "train.max_steps=4", "train.eval_every=2",
    "train.save_every=2", "train.warmup_steps=0", "train.lr=1e-2", "train.keep_checkpoints=10",
]


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> dict:
    """Generated tiny-model data: {"prompts": jsonl path, "dir": runs/g/generate}."""
    root = tmp_path_factory.mktemp("gen")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cfg = make_cfg(root, "g", str(prompts), stage="generate")
    generate.run(cfg)
    return {"prompts": str(prompts), "dir": root / "g" / "generate"}


def overrides(root, name: str, prompts: str, *extra: str) -> list[str]:
    return [*BASE, f"data.path={prompts}", f"runs_root={root}", f"run_name={name}", *extra]


def make_cfg(root, name: str, prompts: str, *extra: str, stage: str = "distill"):
    with initialize_config_dir(CONF, version_base="1.3"):
        return compose(stage, overrides=overrides(root, name, prompts, *extra))


def setup_run(gen: dict, root: Path, name: str, *extra: str):
    """A run dir holding a copy of the generated data, and its config."""
    shutil.copytree(gen["dir"], root / name / "generate")
    return make_cfg(root, name, gen["prompts"], *extra)


def weights(path) -> dict:
    return load_file(str(Path(path) / "model.safetensors"))


def assert_same_weights(a, b, atol=0.0):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0 if atol == 0 else 1e-5, msg=k)


def losses(summary: dict) -> list[float]:
    return [h["loss"] for h in summary["history"] if h["loss"] is not None]


def test_loss_falls_and_full_student_saves_loadable_models(gen, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = setup_run(gen, tmp_path, "full", "train.max_steps=8", "train.eval_every=4", "train.save_every=4",
                    "train.batch_size=8", "student.freeze_embeddings=false")
    s = distill.distill.run(cfg)
    ls = losses(s)
    assert len(ls) == 8 and ls[-1] < 0.8 * ls[0], ls
    out = tmp_path / "full" / "distill"
    for d in ("best", "checkpoint-4", "checkpoint-8"):
        model = AutoModelForCausalLM.from_pretrained(out / d)
        AutoTokenizer.from_pretrained(out / d)
        assert model.config.num_hidden_layers == 1  # model=tiny keeps draft_layers [0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["done"] and summary["step"] == 8 and summary["stopped"] == "max_steps"
    assert summary["history"][0]["step"] == 0 and summary["init_teacher_forced_acceptance"] is not None
    assert all(k in summary["history"][-1] for k in ("loss", "teacher_forced_acceptance", "tokens_per_s"))
    # frozen embeddings stay exactly the target's
    cfg2 = setup_run(gen, tmp_path, "frozen", "train.max_steps=2", "student.freeze_embeddings=true")
    distill.distill.run(cfg2)
    target = weights(Path(os.environ.get("SPECDISTILL_CACHE", Path.home() / ".cache" / "specdistill")) / "tiny")
    best = weights(tmp_path / "frozen" / "distill" / "checkpoint-2")
    torch.testing.assert_close(best["model.embed_tokens.weight"], target["model.embed_tokens.weight"], atol=0, rtol=0)
    # frozen first layers stay the target's; the layers after them train
    cfg3 = setup_run(gen, tmp_path, "frozen1", "train.max_steps=2", "model.draft_layers=[0,1]", "student.freeze_layers=1")
    distill.distill.run(cfg3)
    ck = weights(tmp_path / "frozen1" / "distill" / "checkpoint-2")
    for k in (k for k in target if k.startswith("model.layers.")):
        same = torch.equal(ck[k], target[k])
        assert same if k.startswith("model.layers.0.") else not same, k


def test_best_is_chosen_by_alpha_and_rerun_returns_quickly(gen, tmp_path):
    cfg = setup_run(gen, tmp_path, "best", "train.max_steps=6", "train.eval_every=1", "train.save_every=1",
                    "train.lr=3e-2", "loss=tvd", "train.calibrate=false")
    s = distill.distill.run(cfg)
    evals = [(h["teacher_forced_acceptance"], -h["step"]) for h in s["history"] if h.get("teacher_forced_acceptance") is not None]
    alpha, neg_step = max(evals)
    assert s["best_step"] == -neg_step and s["best_teacher_forced_acceptance"] == pytest.approx(alpha)
    out = tmp_path / "best" / "distill"
    info = json.loads((out / "best" / "best.json").read_text())
    assert info["step"] == s["best_step"]
    if s["best_step"] > 0:
        assert_same_weights(out / "best", out / f"checkpoint-{s['best_step']}")
    mtime = (out / "checkpoint-6" / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = distill.distill.run(cfg)
    assert again["done"] and again["step"] == 6 and time.perf_counter() - t0 < 30
    assert (out / "checkpoint-6" / "model.safetensors").stat().st_mtime_ns == mtime
    # the same run dir asked for another draft: refused with what differs, never "already done"
    other = make_cfg(tmp_path, "best", gen["prompts"], "train.max_steps=6", "train.eval_every=1", "train.save_every=1",
                     "train.lr=1e-2", "loss=fkl", "train.calibrate=false")
    with pytest.raises(ConfigError, match=r"other settings \(loss.name: 'tvd' -> 'fkl'.*train.lr: 0.03 -> 0.01.*resume=never"):
        distill.distill.run(other)
    assert (out / "checkpoint-6" / "model.safetensors").stat().st_mtime_ns == mtime


def test_best_gets_the_logit_scale_with_the_highest_holdout_alpha(gen, tmp_path):
    """train.calibrate: best/ is the best checkpoint with its logits scaled by the s of highest holdout α_TF."""
    from distill.batches import split_holdout, teacher_forced_acceptance_on, to_examples
    from distill.records import load_generated
    from distill.models import load_draft, load_model, load_target
    from distill.distill import LOGIT_SCALES

    cfg = setup_run(gen, tmp_path, "cal", "train.max_steps=4", "train.eval_every=2", "train.save_every=2", "model.draft_vocab=0")
    s = distill.distill.run(cfg)
    out = tmp_path / "cal" / "distill"
    info = json.loads((out / "best" / "best.json").read_text())
    scores = {float(k): v for k, v in info["calibration"].items()}
    assert sorted(scores) == sorted(LOGIT_SCALES) and info["logit_scale"] == max(scores, key=scores.get)
    history = max(h["teacher_forced_acceptance"] for h in s["history"] if h.get("teacher_forced_acceptance") is not None)
    assert scores[1.0] == pytest.approx(history, abs=1e-6) == s["uncalibrated_best_teacher_forced_acceptance"]
    assert s["best_teacher_forced_acceptance"] == info["teacher_forced_acceptance"] == max(scores.values())
    assert s["logit_scale"] == info["logit_scale"] and info["step"] == s["best_step"]
    # best/ = that checkpoint (or the initial draft) with only its final norm scaled
    best = weights(out / "best")
    if s["best_step"]:
        ckpt = weights(out / f"checkpoint-{s['best_step']}")
    else:
        ckpt = load_draft(cfg.model).state_dict()
        ckpt.pop("lm_head.weight", None)  # tied to the embeddings: saved once
    assert best.keys() == ckpt.keys()
    for k in best:
        want = ckpt[k] * info["logit_scale"] if k == "model.norm.weight" else ckpt[k]
        torch.testing.assert_close(best[k], want, msg=k)
    # its α_TF, measured anew on the holdout, is the calibrated one
    target, _ = load_target(cfg.model)
    _, held = split_holdout(to_examples(load_generated(tmp_path / "cal"), cfg.train.max_seq_len), cfg.train.holdout, cfg.seed)
    got = teacher_forced_acceptance_on(target, load_model(str(out / "best")), held, target.config.vocab_size)
    assert got == pytest.approx(info["teacher_forced_acceptance"], abs=1e-5)
    # a rerun calls the run done and leaves best/ as it is
    again = distill.distill.run(cfg)
    assert again["logit_scale"] == info["logit_scale"] and weights(out / "best").keys() == best.keys()
    torch.testing.assert_close(weights(out / "best")["model.norm.weight"], best["model.norm.weight"], atol=0, rtol=0)


def resume_after_checkpoint_2(gen, tmp_path, *extra: str):
    """Train 4 steps in run a, and in run b as a kill right after checkpoint-2 leaves it, then resumed;
    asserts b equals a (weights and losses) -> b's config (both kinds of student use this)."""
    extra = (*extra, "train.max_steps=4", "train.save_every=2", "train.eval_every=2")
    a = distill.distill.run(setup_run(gen, tmp_path, "a", *extra))
    cfg_b = setup_run(gen, tmp_path, "b", *extra)
    distill.distill.run(cfg_b)
    out_b = tmp_path / "b" / "distill"
    # what a kill right after checkpoint-2 leaves: no checkpoint-4, a summary not done
    shutil.rmtree(out_b / "checkpoint-4")
    (out_b / "summary.json").unlink()
    b = distill.distill.run(cfg_b)
    assert b["step"] == 4
    assert_same_weights(tmp_path / "a" / "distill" / "checkpoint-4", out_b / "checkpoint-4")
    assert losses(a) == pytest.approx(losses(b), abs=1e-7)
    return cfg_b


def test_resume_equals_uninterrupted(gen, tmp_path):
    resume_after_checkpoint_2(gen, tmp_path)


def test_kill_9_then_resume_equals_uninterrupted(gen, tmp_path):
    extra = ("train.max_steps=8", "train.save_every=1", "train.eval_every=4")
    ref = distill.distill.run(setup_run(gen, tmp_path, "ref", *extra))
    setup_run(gen, tmp_path, "k", *extra)
    cmd = [sys.executable, "-m", "distill.distill", *overrides(tmp_path, "k", gen["prompts"], *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = tmp_path / "k" / "distill"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (out / "checkpoint-3").exists():
        time.sleep(0.05)
    killed = proc.poll() is None  # still running: the kill lands mid-run
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert killed and (out / "checkpoint-3").exists()
    s = distill.distill.run(make_cfg(tmp_path, "k", gen["prompts"], *extra))
    assert s["step"] == 8
    assert_same_weights(tmp_path / "ref" / "distill" / "checkpoint-8", out / "checkpoint-8")
    assert losses(ref) == pytest.approx(losses(s), abs=1e-7)
    assert not list(out.glob(".*"))  # no temp dir left behind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(gen, tmp_path):
    extra = ("train.max_steps=3", "train.eval_every=3", "train.save_every=3", "train.grad_accum=2")
    one = distill.distill.run(setup_run(gen, tmp_path, "one", "train.batch_size=4", *extra))
    setup_run(gen, tmp_path, "two", "train.batch_size=2", *extra)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(free_port()), "-m", "distill.distill",
           *overrides(tmp_path, "two", gen["prompts"], "train.batch_size=2", *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "distill" / "summary.json").read_text())
    assert two["settings"]["world_size"] == 2 and two["settings"]["global_batch"] == one["settings"]["global_batch"] == 8
    assert losses(two) == pytest.approx(losses(one), abs=1e-4)
    assert two["best_teacher_forced_acceptance"] == pytest.approx(one["best_teacher_forced_acceptance"], abs=1e-4)
    assert_same_weights(tmp_path / "one" / "distill" / "checkpoint-3", tmp_path / "two" / "distill" / "checkpoint-3", atol=1e-5)


def test_two_process_resume_equals_uninterrupted(gen, tmp_path):
    """Under the shipped 2-process config: accelerator.save_state / load_state carry model, optimizer,
    scheduler and both processes' RNG (on-policy steps sample), so a resumed run equals the uninterrupted one."""
    extra = ("train.max_steps=4", "train.save_every=2", "train.eval_every=2", "train.batch_size=2",
             "train.on_policy_fraction=0.5", "train.on_policy_max_new_tokens=4")
    setup_run(gen, tmp_path, "two", *extra)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "launch" / "cpu-2proc.yaml"),
           "--main_process_port", str(free_port()), "-m", "distill.distill",
           *overrides(tmp_path, "two", gen["prompts"], *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "two" / "distill"

    def launch() -> dict:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads((out / "summary.json").read_text())

    whole = launch()
    assert whole["settings"]["world_size"] == 2 and whole["step"] == 4
    assert any(h.get("on_policy") for h in whole["history"]) and not all(h.get("on_policy", True) for h in whole["history"][1:])
    shutil.copytree(out / "checkpoint-4", tmp_path / "whole-4")
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2]
    assert {"random_states_0.pkl", "random_states_1.pkl", "optimizer.bin"} <= {p.name for p in (out / "checkpoint-2" / "accelerate").iterdir()}
    # what a kill right after checkpoint-2 leaves: no checkpoint-4, a summary not done
    shutil.rmtree(out / "checkpoint-4")
    (out / "summary.json").unlink()
    resumed = launch()
    assert resumed["step"] == 4 and losses(resumed) == pytest.approx(losses(whole), abs=1e-7)
    assert [h.get("on_policy") for h in resumed["history"]] == [h.get("on_policy") for h in whole["history"]]
    assert_same_weights(tmp_path / "whole-4", out / "checkpoint-4")


def test_lora_saves_adapter_and_merged_model_that_agree(gen, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = setup_run(gen, tmp_path, "lora", "student=lora", "student.lora_r=4", "train.lr=5e-2")
    distill.distill.run(cfg)
    out = tmp_path / "lora" / "distill"
    ckpt = out / "checkpoint-4"
    merged = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    init = AutoModelForCausalLM.from_pretrained(out / "init").eval()
    x = torch.randint(3, 250, (2, 12))
    with torch.no_grad():
        base_logits = init(x).logits
        adapted = PeftModel.from_pretrained(init, ckpt / "adapter").eval()
        torch.testing.assert_close(merged(x).logits, adapted(x).logits, atol=1e-4, rtol=1e-4)
        assert (merged(x).logits - base_logits).abs().max() > 1e-3  # the adapter learned something
    cfg_json = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert Path(cfg_json["base_model_name_or_path"]).resolve() == (out / "init").resolve()


def test_lora_freeze_layers_puts_no_adapter_on_the_first_layers(gen, tmp_path):
    cfg = setup_run(gen, tmp_path, "lorafrz", "student=lora", "student.lora_r=4", "train.lr=5e-2", "train.max_steps=2",
                    "model.draft_layers=[0,1]", "student.freeze_layers=1")
    distill.distill.run(cfg)
    ckpt = tmp_path / "lorafrz" / "distill" / "checkpoint-2"
    assert json.loads((ckpt / "adapter" / "adapter_config.json").read_text())["layers_to_transform"] == [1]
    init, merged = weights(tmp_path / "lorafrz" / "distill" / "init"), weights(ckpt)
    for k in (k for k in init if k.startswith("model.layers.") and k.endswith("proj.weight")):
        same = torch.equal(merged[k], init[k])
        assert same if k.startswith("model.layers.0.") else not same, k


def test_topk_teacher_on_policy_gradient_checkpointing_and_wandb(gen, tmp_path):
    s = distill.distill.run(setup_run(gen, tmp_path, "topk", "train.teacher=topk", "loss=jsd", "train.max_steps=3",
                            "logger=wandb", "wandb_mode=offline"))
    assert s["done"] and all(x == x for x in losses(s))
    assert list((tmp_path / "topk" / "distill").glob("wandb/*"))
    s = distill.distill.run(setup_run(gen, tmp_path, "onp", "train.on_policy_fraction=1.0", "train.on_policy_max_new_tokens=6",
                            "train.max_steps=2", "loss=rkl"))
    assert all(h["on_policy"] for h in s["history"][1:]) and all(x == x for x in losses(s))
    plain = distill.distill.run(setup_run(gen, tmp_path, "gc0", "train.max_steps=2"))
    gc = distill.distill.run(setup_run(gen, tmp_path, "gc1", "train.max_steps=2", "train.gradient_checkpointing=true"))
    assert losses(plain) == pytest.approx(losses(gc), abs=1e-5)
    # prompt_grad=false: the same loss (the first step, same weights), a different gradient path
    nopg = distill.distill.run(setup_run(gen, tmp_path, "pg0", "train.max_steps=2", "train.prompt_grad=false"))
    assert losses(nopg)[0] == pytest.approx(losses(plain)[0], abs=1e-5) and losses(nopg)[1] == losses(nopg)[1]


def test_time_budget_stops_with_checkpoint_and_eval(gen, tmp_path):
    s = distill.distill.run(setup_run(gen, tmp_path, "tb", "train.max_steps=50", "train.time_budget_min=1e-6"))
    assert s["stopped"] == "time_budget" and s["step"] == 1 and s["done"]
    assert (tmp_path / "tb" / "distill" / "checkpoint-1").exists()
    assert s["history"][-1]["teacher_forced_acceptance"] is not None


def test_nan_loss_stops_and_keeps_last_good_checkpoint(gen, tmp_path, monkeypatch):
    real = distill.distill.chunked_distill_loss
    calls = {"n": 0}

    def flaky(*a, **kw):
        total, n = real(*a, **kw)
        calls["n"] += 1
        return (total * float("nan") if calls["n"] > 2 else total), n

    monkeypatch.setattr(distill.distill, "chunked_distill_loss", flaky)
    cfg = setup_run(gen, tmp_path, "nan", "train.max_steps=6", "train.save_every=1")
    # step 3's loss comes from checkpoint-2's weights: that one is set aside, checkpoint-1 is the last good one
    with pytest.raises(TrainingDiverged, match=r"step 3 .*micro-batch 0 records .*checkpoint-2 came from .*checkpoint-1"):
        distill.distill.run(cfg)
    out = tmp_path / "nan" / "distill"
    assert (out / "checkpoint-1" / "accelerate" / "optimizer.bin").exists() and not (out / "checkpoint-3").exists()
    assert (out / "diverged-checkpoint-2").is_dir() and [s for s, _ in ck.checkpoints(out)] == [1]


def test_a_draft_of_other_records_is_not_resumed(gen, tmp_path):
    cfg = setup_run(gen, tmp_path, "data", "train.max_steps=2")
    first = distill.distill.run(cfg)
    assert first["data"] == records.data_key(tmp_path / "data")
    shard = sorted((tmp_path / "data" / "generate").glob("*.parquet"))[-1]
    t = pq.read_table(shard)
    pq.write_table(t.slice(0, t.num_rows - 2), shard)  # the run's records change (here: two fewer)
    with pytest.raises(ConfigError, match="train.resume=never"):
        distill.distill.run(cfg)
    again = distill.distill.run(make_cfg(tmp_path, "data", gen["prompts"], "train.max_steps=2", "train.resume=never"))
    assert again["done"] and again["data"] == records.data_key(tmp_path / "data") != first["data"]
    assert distill.distill.run(cfg)["data"] == again["data"]  # and now resumes (done) as usual


def test_bad_input(gen, tmp_path):
    with pytest.raises(ConfigError, match="distill.generate"):
        distill.distill.run(make_cfg(tmp_path, "empty", gen["prompts"]))
    cfg = setup_run(gen, tmp_path, "tok", "train.max_steps=1")
    man = tmp_path / "tok" / "generate" / "manifest.json"
    man.write_text(json.dumps({**json.loads(man.read_text()), "tokenizer_fingerprint": "0" * 16}))
    with pytest.raises(ConfigError, match="another tokenizer"):
        distill.distill.run(cfg)
    with pytest.raises(ConfigError, match="lora_target_modules.*c_attn.*q_proj"):
        distill.distill.run(setup_run(gen, tmp_path, "lora", "student=lora", "student.lora_target_modules=[c_attn]"))
    with pytest.raises(ConfigError, match="store_topk"):
        distill.distill.run(setup_run(gen, tmp_path, "topk0", "train.teacher=topk", "generate.store_topk=0"))
    cfg = setup_run(gen, tmp_path, "nocol", "train.teacher=topk")
    for f in (tmp_path / "nocol" / "generate").glob("*.parquet"):
        t = pq.read_table(f)
        pq.write_table(t.drop(["topk_ids", "topk_logits"]).replace_schema_metadata(t.schema.metadata), f)
    with pytest.raises(ConfigError, match="no top-k logits"):
        distill.distill.run(cfg)
    with pytest.raises(ConfigError, match="freeze_layers=1 must leave"):
        distill.distill.run(setup_run(gen, tmp_path, "frz", "student.freeze_layers=1"))
    with pytest.raises(ConfigError, match="holdout"):
        distill.distill.run(setup_run(gen, tmp_path, "held", "train.holdout=100"))
    # the CLI: one line on stderr, exit code 2
    res = subprocess.run([sys.executable, "-m", "distill.distill", *overrides(tmp_path, "cli", gen["prompts"], "loss.name=foo")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "loss.name='foo'" in res.stderr


def test_examples_from_a_selected_view_are_those_rows(gen):
    from distill.batches import to_examples
    from distill.records import load_generated

    ds = load_generated(gen["dir"].parent)
    full = {e.id: e for e in to_examples(ds, 512, with_topk=True)}
    picked = to_examples(ds.select([3, 0, 5]), 512, with_topk=True)
    assert [e.id for e in picked] == [ds[i]["id"] for i in (3, 0, 5)]
    for e in picked:
        assert (e.prompt_ids, e.response_ids) == (full[e.id].prompt_ids, full[e.id].response_ids)
        assert (e.topk_ids == full[e.id].topk_ids).all()


def test_draft_vocabulary_trains_and_scores_q_as_decoded(gen, tmp_path):
    """model.draft_vocab: the loss and α_TF use the draft's softmax over the run's most used ids."""
    from distill.batches import holdout_reference, measure_alpha, split_holdout, to_examples
    from distill.records import load_generated
    from distill.losses import VocabSubset
    from distill.models import load_model, load_target
    from distill.records import run_draft_vocab

    cfg = setup_run(gen, tmp_path, "dv", "model.draft_vocab=40", "train.teacher=topk", "train.eval_every=1")
    s = distill.distill.run(cfg)
    assert s["settings"]["draft_vocab"] == 40 and all(x == x for x in losses(s))
    # on-policy steps sample from the draft vocabulary and are scored online (also restricted to it)
    onp = distill.distill.run(setup_run(gen, tmp_path, "dvo", "model.draft_vocab=40", "train.on_policy_fraction=1.0",
                              "train.on_policy_max_new_tokens=6", "train.max_steps=2", "loss=rkl"))
    assert all(h["on_policy"] for h in onp["history"][1:]) and all(x == x for x in losses(onp))
    target, _ = load_target(cfg.model)
    vocab = target.config.vocab_size
    _, held = split_holdout(to_examples(load_generated(tmp_path / "dv"), cfg.train.max_seq_len), cfg.train.holdout, cfg.seed)
    ref = holdout_reference(target, held, 4, vocab, "cpu")
    best = load_model(str(tmp_path / "dv" / "distill" / "best"))
    sub = VocabSubset(run_draft_vocab(cfg, vocab), vocab)
    num, den = measure_alpha(best, ref, vocab=vocab, subset=sub)
    assert num / den == pytest.approx(s["best_teacher_forced_acceptance"], abs=1e-5)
    whole = measure_alpha(best, ref, vocab=vocab)
    assert abs(whole[0] / whole[1] - num / den) > 1e-4  # the whole head scores another q
    from distill.batches import sample_on_policy

    target, tok = load_target(cfg.model)
    few = VocabSubset(torch.tensor([tok.eos_token_id, 5, 9, 40, 41]), vocab)
    for e in sample_on_policy(target, held, 8, tok, "cpu", few):
        assert set(e.response_ids) <= set(few.ids.tolist())
    # train.draft_vocab=false: the whole head is trained and scored, the draft vocabulary is decode-only
    s2 = distill.distill.run(setup_run(gen, tmp_path, "dv0", "model.draft_vocab=40", "train.draft_vocab=false", "train.max_steps=1"))
    assert s2["settings"]["draft_vocab"] == 0


def test_schedule_decays_over_the_time_budget_when_it_ends_the_run_first():
    from types import SimpleNamespace

    from distill.training import schedule

    clock = {"s": 0.0}
    for name, half in (("linear", 0.5), ("cosine", 0.5), ("constant", 1.0)):
        t = SimpleNamespace(warmup_steps=2, max_steps=1000, time_budget_min=1.0, schedule=name)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        sched = schedule(opt, t, lambda: clock["s"])
        f = sched.lr_lambdas[0]
        clock["s"] = 0.0
        assert (f(0), f(1), f(2)) == (0.0, 0.5, 1.0)  # warm-up, then the full rate
        clock["s"] = 30.0  # half the budget spent after only 10 of 1000 steps: the budget sets the pace
        assert f(12) == pytest.approx(half)
        clock["s"] = 60.0
        assert f(12) == pytest.approx(0.0 if name != "constant" else 1.0)
    t = SimpleNamespace(warmup_steps=0, max_steps=10, time_budget_min=None, schedule="linear")
    f = schedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), t, lambda: 1e9).lr_lambdas[0]
    assert f(5) == pytest.approx(0.5)  # no budget: steps alone


def test_prompt_ce_adds_the_drafts_language_model_loss_on_prompt_tokens():
    """loss.prompt_ce_weight=w adds w × Σ −log q(next prompt token) over each row's prompt positions to
    the distillation sum (checked against the draft's own logits), and the response count is unchanged."""
    from omegaconf import OmegaConf

    from distill.batches import Example, collate
    from distill.losses import DenseTeacher, VocabSubset
    from specdec.tiny import tiny_model

    torch.manual_seed(0)
    draft = tiny_model(seed=1).eval()
    exs = [Example("a", [1, 40, 41, 42, 43, 44], [50, 51, 52]), Example("b", [1, 60, 130, 61], [70, 71, 72, 73, 74])]
    b = collate(exs, 0)
    teacher = DenseTeacher(torch.randn(int(b["positions"].sum()), 259))
    with torch.no_grad():
        logits = draft(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.double()
    for subset in (None, VocabSubset(torch.arange(3, 120), 259)):
        def loss(w: float):
            lc = OmegaConf.create({"name": "fkl", "beta": 0.5, "temperature": 1.0, "ce_weight": 0.0,
                                   "chunk_size": 4, "prompt_ce_weight": w})
            with torch.no_grad():
                return distill.distill.DraftLoss(draft, lc, 259, subset=subset)(
                    b["input_ids"], b["attention_mask"], b["positions"], b["labels"], teacher)

        (base, n0), (mixed, n1) = loss(0.0), loss(0.5)
        assert n0 == n1 == 8 and float(mixed) > float(base)
        ref = 0.0  # with a subset: a softmax over its ids, and prompt tokens outside it are not trained
        ids = list(range(259)) if subset is None else subset.ids.tolist()
        for row, e in enumerate(exs):
            for j in range(len(e.prompt_ids) - 1):
                if e.prompt_ids[j + 1] in ids:
                    ref -= torch.log_softmax(logits[row, j, ids], -1)[ids.index(e.prompt_ids[j + 1])].item()
        assert float(mixed - base) == pytest.approx(0.5 * ref, rel=1e-4)
