"""The generate stage (distill/generate.py) on the tiny model: records, determinism, greedy equality
with model.generate, crash + resume, two processes, bad input. Offline, CPU, seconds per test."""
from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from distill import generate
from distill.config import ConfigError
from distill.generate import run
from distill.records import load_generated
from distill.models import load_target, load_tokenizer, resolve_model_path

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONF = os.path.abspath(os.path.join(ROOT, "conf"))
PROMPTS = [
    "Hi",
    "What is two plus two? Answer briefly.",
    "Write a haiku about the sea.",
    "Name three prime numbers and explain why each is prime.",
    "x",
    "List the planets.",
    "Why is the sky blue? Explain it to a child in one or two short sentences.",
    "A prompt far longer than the others, " * 6,  # over max_prompt_tokens=120 (byte-level tokenizer)
]
SAMPLING = ["generate.temperature=0.9", "generate.top_k=40", "generate.top_p=0.95"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return str(path)


def overrides(root, prompts_file: str, *extra: str) -> list[str]:
    return [
        "model=tiny", "data=jsonl", f"data.path={prompts_file}", f"runs_root={root}", "run_name=t", "logger=none",
        "generate.max_new_tokens=12", "generate.batch_size=2", "generate.shard_size=4",
        "generate.max_prompt_tokens=120", *extra,
    ]


def make_cfg(root, prompts_file: str, *extra: str):
    with initialize_config_dir(CONF, version_base="1.3"):
        return compose("generate", overrides=overrides(root, prompts_file, *extra))


def records(path) -> list[dict]:
    return load_generated(path).to_list()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prompts_file):
    """An uninterrupted sampled run (2 samples per prompt, top-k logits stored)."""
    root = tmp_path_factory.mktemp("ref")
    summary = run(make_cfg(root, prompts_file, *SAMPLING, "generate.num_samples=2", "generate.store_topk=3"))
    return root / "t", summary


# ---------------------------------------------------------------- records and determinism


def test_records_and_summary(reference):
    path, summary = reference
    recs = records(path)
    expected_ids = sorted(f"file-{i}#{s}" for i in range(len(PROMPTS) - 1) for s in range(2))
    assert [r["id"] for r in recs] == expected_ids  # the overlong prompt file-7 is skipped
    assert summary["complete"] and summary["prompts"] == len(PROMPTS) and summary["skipped"] == 1
    assert summary["records"] == len(recs) and sum(summary["finish_reasons"].values()) == len(recs)
    assert summary["response_tokens"] == sum(len(r["response_ids"]) for r in recs)
    tok = load_tokenizer("tiny")
    for r in recs:
        assert r["source"] == "file" and r["prompt"].endswith("<|im_start|>assistant\n")
        assert r["prompt_ids"] == tok(r["prompt"], add_special_tokens=False)["input_ids"]
        n = len(r["response_ids"])
        assert 1 <= n <= 12 and r["finish_reason"] in ("eos", "length")
        assert (r["response_ids"][-1] == tok.eos_token_id) == (r["finish_reason"] == "eos")
        assert r["finish_reason"] == "eos" or n == 12
        assert tok.pad_token_id not in r["response_ids"][:-1] or tok.pad_token_id == tok.eos_token_id
        assert r["response"] == tok.decode(r["response_ids"], skip_special_tokens=True)
        assert (r["temperature"], r["top_p"], r["top_k"], r["max_new_tokens"]) == (0.9, 0.95, 40, 12)
        assert len(r["topk_ids"]) == n and all(len(k) == 3 for k in r["topk_ids"])
        assert all(a >= b for row in r["topk_logits"] for a, b in zip(row, row[1:]))  # sorted, largest first
    man = json.loads((path / "generate" / "manifest.json").read_text())
    assert man["model"] == "tiny" and man["sampling"]["temperature"] == 0.9 and man["tokenizer_fingerprint"]
    assert man["ids_done"] == expected_ids and man["skipped_ids"] == ["file-7"]
    # the two samples of a prompt are drawn with different seeds
    assert recs[0]["seed"] != recs[1]["seed"]


def test_same_seed_same_records_other_seed_differs(tmp_path, prompts_file, reference):
    ref = records(reference[0])
    run(make_cfg(tmp_path, prompts_file, *SAMPLING, "generate.num_samples=2", "generate.store_topk=3"))
    assert records(tmp_path / "t") == ref
    run(make_cfg(tmp_path, prompts_file, *SAMPLING, "generate.num_samples=2", "generate.store_topk=3",
                 "seed=1", "run_name=s1"))
    other = records(tmp_path / "s1")
    assert [r["id"] for r in other] == [r["id"] for r in ref]
    assert [r["response_ids"] for r in other] != [r["response_ids"] for r in ref]


def test_greedy_equals_model_generate_one_at_a_time(tmp_path, prompts_file):
    cfg = make_cfg(tmp_path, prompts_file, "generate.batch_size=4", "generate.overlong=truncate")
    summary = run(cfg)
    assert summary["truncated"] == 1 and summary["skipped"] == 0
    model, tok = load_target(cfg.model)
    recs = records(tmp_path / "t")
    assert len(recs) == len(PROMPTS)
    for r in recs:
        ids = torch.tensor([r["prompt_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                             pad_token_id=tok.pad_token_id)
        assert out[0, ids.shape[1]:].tolist() == r["response_ids"], r["id"]


def test_continuous_batching_equals_one_at_a_time_when_rows_end_early(tmp_path, prompts_file):
    """Rows that stop at EOS leave the batch and new prompts join it; every answer is unchanged."""
    cfg = make_cfg(tmp_path, prompts_file, "generate.batch_size=4", "generate.max_new_tokens=16")
    model, tok = load_target(cfg.model)
    items, _ = generate.build_items(cfg, tok, model.config)
    backend = generate.HFBackend(cfg, model, tok)
    free = {it.id: o.response_ids for it, o in backend.stream(items)}  # never stops early: pick an EOS that ends rows
    eos = collections.Counter(t for r in free.values() for t in r[2:-1]).most_common(1)[0][0]
    backend.eos, admitted, real = {eos}, [], backend._admit
    backend._admit = lambda new: admitted.append(len(new)) or real(new)
    out = {it.id: o for it, o in backend.stream(items)}
    assert len(admitted) > 2 and sum(admitted) == len(items)  # prompts joined a running batch
    lengths = {len(o.response_ids) for o in out.values()}
    assert len(lengths) > 1 and any(o.finish_reason == "eos" for o in out.values())
    for it in items:
        ids = torch.tensor([it.prompt_ids])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                             eos_token_id=eos, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        assert out[it.id].response_ids == ref, it.id


# ---------------------------------------------------------------- resume


def test_resume_after_crash_between_shards(tmp_path, prompts_file, reference, monkeypatch):
    extra = (*SAMPLING, "generate.num_samples=2", "generate.store_topk=3")
    real, written = generate.write_shard, []

    def crash_after_two(*args, **kw):
        if len(written) == 2:
            raise RuntimeError("simulated crash")
        real(*args, **kw)
        written.append(args[1])

    monkeypatch.setattr(generate, "write_shard", crash_after_two)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(make_cfg(tmp_path, prompts_file, *extra))
    assert len(list((tmp_path / "t" / "generate").glob("shard-*.parquet"))) == 2
    monkeypatch.setattr(generate, "write_shard", real)
    summary = run(make_cfg(tmp_path, prompts_file, *extra))
    assert summary["complete"] and summary["new_tokens"] < summary["response_tokens"]
    assert records(tmp_path / "t") == records(reference[0])  # no loss, no duplicates, same answers


def test_resume_after_crash_inside_shard(tmp_path, prompts_file, reference, monkeypatch):
    extra = (*SAMPLING, "generate.num_samples=2", "generate.store_topk=3")
    real, calls = generate.HFBackend._admit, []

    def crash_on_third_admission(self, items):
        calls.append(len(items))
        if len(calls) == 3:  # rows in flight, finished records not yet a whole shard
            raise KeyboardInterrupt
        return real(self, items)

    monkeypatch.setattr(generate.HFBackend, "_admit", crash_on_third_admission)
    with pytest.raises(KeyboardInterrupt):
        run(make_cfg(tmp_path, prompts_file, *extra))
    out = tmp_path / "t" / "generate"
    (out / ".shard-r0-00001.parquet.tmp-999").write_bytes(b"torn")  # as if killed while writing
    monkeypatch.setattr(generate.HFBackend, "_admit", real)
    run(make_cfg(tmp_path, prompts_file, *extra))
    assert not list(out.glob(".*tmp*"))
    assert records(tmp_path / "t") == records(reference[0])


def test_completed_run_returns_summary_without_work(tmp_path, prompts_file, monkeypatch):
    first = run(make_cfg(tmp_path, prompts_file))

    def no(*a, **k):
        raise AssertionError("a completed run must not load data or models again")

    monkeypatch.setattr(generate, "load_target", no)
    monkeypatch.setattr(generate, "load_prompts", no)
    assert run(make_cfg(tmp_path, prompts_file)) == first


def test_larger_limit_extends_the_same_set(tmp_path, prompts_file):
    run(make_cfg(tmp_path, prompts_file, "data.limit=3"))
    assert len(records(tmp_path / "t")) == 3
    summary = run(make_cfg(tmp_path, prompts_file))
    assert summary["records"] == len(PROMPTS) - 1 and summary["complete"]
    assert len({r["id"] for r in records(tmp_path / "t")}) == len(PROMPTS) - 1


def test_skip_is_part_of_the_identity_only_when_set(tmp_path, prompts_file):
    tok = load_tokenizer("tiny")
    plain = generate.identity(make_cfg(tmp_path, prompts_file), tok)
    assert "skip" not in plain["data"]  # data made before data.skip existed keeps matching
    skipped = generate.identity(make_cfg(tmp_path, prompts_file, "data.skip=2"), tok)
    assert skipped["data"]["skip"] == 2 and skipped != plain


def test_base_model_template_and_stop_strings(tmp_path, prompts_file):
    """data.template formats every prompt; an answer ends at the first token whose text completes a stop
    string (finish_reason stop), and is otherwise the answer generated without stop strings."""
    from omegaconf import OmegaConf

    fmt = "Question: {prompt}\nAnswer:"
    free_cfg = make_cfg(tmp_path / "free", prompts_file, "generate.batch_size=3")
    OmegaConf.update(free_cfg, "data.template", fmt)
    run(free_cfg)
    free = {r["id"]: r for r in records(tmp_path / "free" / "t")}
    tok = load_tokenizer("tiny")
    for r in free.values():
        text = fmt.format(prompt=PROMPTS[int(r["id"].split("-")[1])])
        assert r["prompt"] == text and r["prompt_ids"] == tok.encode(text)
    # the most common character of the free answers: several of them stop early
    chars = collections.Counter(c for r in free.values() for c in tok.decode(r["response_ids"], skip_special_tokens=True))
    stop = chars.most_common(1)[0][0]

    cfg = make_cfg(tmp_path / "stop", prompts_file, "generate.batch_size=3")
    OmegaConf.update(cfg, "data.template", fmt)
    OmegaConf.update(cfg, "generate.stop_strings", [stop, "never written"])
    summary = run(cfg)
    got = {r["id"]: r for r in records(tmp_path / "stop" / "t")}
    assert got.keys() == free.keys()
    for rid, r in got.items():
        ids = free[rid]["response_ids"]
        ends = [j + 1 for j in range(len(ids)) if stop in tok.decode(ids[: j + 1], skip_special_tokens=True)]
        if ends and (free[rid]["finish_reason"] == "length" or ends[0] <= len(ids) - 1):
            assert r["response_ids"] == ids[: ends[0]] and r["finish_reason"] == "stop", rid
        else:
            assert r["response_ids"] == ids and r["finish_reason"] == free[rid]["finish_reason"], rid
    assert summary["finish_reasons"].get("stop", 0) >= 2
    ident = generate.identity(cfg, tok)
    assert ident["sampling"]["stop_strings"] == [stop, "never written"] and ident["data"]["template"] == fmt
    plain = generate.identity(make_cfg(tmp_path, prompts_file), tok)
    assert "stop_strings" not in plain["sampling"] and "template" not in plain["data"]  # old data still matches


def _eval_file(tmp_path, texts: list[str], ids: list[str]) -> str:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": t, "id": i}) + "\n" for t, i in zip(texts, ids)))
    return str(path)


def _in_domain(tmp_path, prompts_file, eval_file, *extra):
    ev = ["source=file", f"path={eval_file}", "id_column=id", "shuffle=true", "limit=2"]  # one eval set, "ev"
    return make_cfg(tmp_path, prompts_file, "data.in_domain=true", "~eval_data.humaneval",
                    *(f"eval_data.mt_bench.{kv}" for kv in ev), *extra)


def test_in_domain_trains_on_the_eval_prompts_evaluation_leaves_out(tmp_path, prompts_file):
    eval_file = _eval_file(tmp_path, [f"Question number {i}?" for i in range(6)], [f"ev-{i}" for i in range(6)])
    cfg = _in_domain(tmp_path, prompts_file, eval_file)
    held_out = {r["id"] for r in generate.load_prompts(cfg.eval_data.mt_bench)}
    summary = run(cfg)
    ids = {r["id"] for r in records(tmp_path / "t")}
    assert len(held_out) == 2 and not ids & held_out
    assert {i for i in ids if i.startswith("file-ev-")} == {f"file-ev-{i}" for i in range(6)} - held_out
    assert summary["records"] == len(PROMPTS) - 1 + 4 and summary["complete"]
    tok = load_tokenizer("tiny")
    assert generate.identity(cfg, tok) == generate.identity(make_cfg(tmp_path, prompts_file), tok)
    manifest = json.loads((tmp_path / "t" / "generate" / "manifest.json").read_text())
    assert manifest["data_in_domain"]["mt_bench"]["limit"] == 2
    # another held-out split is another prompt set, not the finished one: the manifest is rewritten
    run(_in_domain(tmp_path, prompts_file, eval_file, "eval_data.mt_bench.limit=3"))
    manifest = json.loads((tmp_path / "t" / "generate" / "manifest.json").read_text())
    assert manifest["data_in_domain"]["mt_bench"]["limit"] == 3


def test_in_domain_bad_input_names_the_fix(tmp_path, prompts_file):
    with pytest.raises(ConfigError, match="eval_data.<name>.limit"):
        run(make_cfg(tmp_path, prompts_file, "data.in_domain=true"))  # the eval sets evaluate every prompt
    # ids "file-0".."file-2", as data's own rows have, but other prompts: whichever is held out, two clash
    clash = _eval_file(tmp_path, ["Not data's prompt 0", "Not data's prompt 1", "Not data's prompt 2"], ["0", "1", "2"])
    with pytest.raises(ConfigError, match="id_column"):
        run(_in_domain(tmp_path, prompts_file, clash, "eval_data.mt_bench.limit=1"))


def test_self_instruct_seeds_show_only_prompts_the_eval_set_leaves_out(tmp_path, prompts_file, monkeypatch):
    texts = [f"Question number {i}?" for i in range(6)]
    eval_file = _eval_file(tmp_path, texts, [f"ev-{i}" for i in range(6)])
    ev = ["source=file", f"path={eval_file}", "id_column=id", "shuffle=true", "limit=2"]
    seeded = ["~eval_data.humaneval", *(f"eval_data.mt_bench.{kv}" for kv in ev), "data.self_instruct=4",
              "data.self_instruct_max_tokens=6", "data.self_instruct_seeds=mt_bench", "data.self_instruct_shots=2"]
    cfg = make_cfg(tmp_path, prompts_file, *seeded)
    held_out = {r["id"] for r in generate.load_prompts(cfg.eval_data.mt_bench)}
    text_of = {f"file-ev-{i}": t for i, t in enumerate(texts)}
    prompts = []
    real = generate.HFBackend.stream
    monkeypatch.setattr(generate.HFBackend, "stream",
                        lambda self, items: prompts.extend(items) or real(self, items))
    run(cfg)
    tok = load_tokenizer("tiny")
    out = tmp_path / "t" / "generate"
    samples = [json.loads(line) for line in (out / generate.SELF_INSTRUCT_FILE).read_text().splitlines()]
    asked = {it.id: tok.decode(it.prompt_ids) for it in prompts if it.id.startswith("self_instruct-")}
    assert len(samples) == 4 and len(held_out) == 2
    for s in samples:
        assert len(s["shown"]) == 2 and not set(s["shown"]) & held_out, "never a prompt evaluation scores"
        turns = "".join(f"<|im_start|>user\n{text_of[i]}<|im_end|>\n" for i in s["shown"])
        assert asked[s["id"]] == turns + "<|im_start|>user\n"
    assert len({tuple(s["shown"]) for s in samples}) > 1, "each prompt sees its own draw of examples"
    ident = generate.identity(cfg, tok)
    assert ident != generate.identity(make_cfg(tmp_path, prompts_file, *seeded[:-1], "data.self_instruct_shots=3"), tok)
    assert generate.identity(make_cfg(tmp_path, prompts_file), tok) == generate.identity(
        make_cfg(tmp_path, prompts_file, "data.self_instruct_shots=5"), tok), "unseeded: the shots do not matter"
    # Prompts written after examples are not reused for a run without them (nor the other way round).
    for f in [*generate.shard_paths(out), out / "manifest.json"]:
        f.unlink()
    unseeded = make_cfg(tmp_path, prompts_file, "data.self_instruct=4", "data.self_instruct_max_tokens=6")
    with pytest.raises(ConfigError, match="other examples"):
        run(unseeded)
    run(make_cfg(tmp_path, prompts_file, "data.self_instruct=4", "data.self_instruct_max_tokens=6",
                 "generate.overwrite=true"))
    assert all("shown" not in json.loads(line) for line in (out / generate.SELF_INSTRUCT_FILE).read_text().splitlines())


def test_self_instruct_seeds_bad_input_names_the_fix(tmp_path, prompts_file, monkeypatch):
    monkeypatch.setattr(generate, "load_target", lambda *a: pytest.fail("bad input is refused before any sampling"))
    with pytest.raises(ConfigError, match="data.limit=0 must be >= 1"):
        run(make_cfg(tmp_path, prompts_file, "data.self_instruct=2", "data.limit=0"))
    with pytest.raises(ConfigError, match="data.self_instruct_max_tokens=0 must be >= 1"):
        run(make_cfg(tmp_path, prompts_file, "data.self_instruct=2", "data.self_instruct_max_tokens=0"))
    with pytest.raises(ConfigError, match="not an eval_data set"):
        run(make_cfg(tmp_path, prompts_file, "data.self_instruct=2", "data.self_instruct_seeds=nope"))
    with pytest.raises(ConfigError, match="eval_data.mt_bench.limit=N"):
        run(make_cfg(tmp_path, prompts_file, "data.self_instruct=2", "data.self_instruct_seeds=mt_bench"))
    with pytest.raises(ConfigError, match="only 78 prompts"):  # MT-Bench's 80 less the 2 it evaluates
        run(make_cfg(tmp_path, prompts_file, "data.self_instruct=2", "data.self_instruct_seeds=mt_bench",
                     "eval_data.mt_bench.limit=2", "data.self_instruct_shots=79"))


# ---------------------------------------------------------------- two processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_make_the_same_records(tmp_path, prompts_file):
    run(make_cfg(tmp_path / "one", prompts_file))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), "-m", "distill.generate",
           *overrides(tmp_path / "two", prompts_file)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "two" / "t" / "generate"
    assert {p.name.split("-")[1] for p in out.glob("shard-*.parquet")} == {"r0", "r1"}
    assert json.loads((out / "manifest.json").read_text())["num_processes"] == 2
    one, two = records(tmp_path / "one" / "t"), records(tmp_path / "two" / "t")
    assert [r["id"] for r in two] == [r["id"] for r in one]
    # Greedy, fp32: other batch compositions give the same tokens on the tiny model.
    assert [r["response_ids"] for r in two] == [r["response_ids"] for r in one]


# ---------------------------------------------------------------- bad input


def test_refuses_another_models_data_unless_overwrite(tmp_path, prompts_file):
    run(make_cfg(tmp_path, prompts_file))
    other = f"model.target={resolve_model_path('tiny')}"  # same weights, another model name
    with pytest.raises(ConfigError, match="other settings.*model.target.*overwrite=true"):
        run(make_cfg(tmp_path, prompts_file, other))
    with pytest.raises(ConfigError, match="sampling.temperature"):
        run(make_cfg(tmp_path, prompts_file, "generate.temperature=0.5"))
    summary = run(make_cfg(tmp_path, prompts_file, other, "generate.overwrite=true"))
    assert summary["complete"] and summary["records"] == len(PROMPTS) - 1
    shard = next((tmp_path / "t" / "generate").glob("shard-*.parquet"))
    assert generate.shard_identity(shard)["model"]["target"] == resolve_model_path("tiny")


@pytest.mark.parametrize(
    "bad, message",
    [
        ("generate.temperature=-1", "generate.temperature"),
        ("generate.top_p=0", "generate.top_p"),
        ("generate.top_k=-2", "generate.top_k"),
        ("generate.num_samples=2", "num_samples > 1 needs sampling"),
        ("generate.max_new_tokens=0", "max_new_tokens"),
        ("generate.max_prompt_tokens=0", "max_prompt_tokens"),
        ("generate.max_new_tokens=600", "leaves no room for a prompt"),
        ("data.source=nowhere", "data.source"),
        ("generate.backend=vllm", "vllm"),
        ("generate.mixed_precision=fp16", "generate.mixed_precision"),
        ("generate.backend=vllm generate.mixed_precision=bf16", "mixed_precision=bf16 is for the transformers"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, prompts_file, bad, message):
    if bad == "generate.backend=vllm" and torch.cuda.is_available():
        pytest.skip("this machine may run vLLM")
    with pytest.raises(ConfigError, match=message):
        run(make_cfg(tmp_path, prompts_file, *bad.split()))


def test_empty_prompt_set(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="no prompts|empty"):
        run(make_cfg(tmp_path, str(empty)))


def test_cli_exit_code_2(tmp_path, prompts_file):
    cmd = [sys.executable, "-m", "distill.generate", *overrides(tmp_path, prompts_file, "generate.top_p=1.5")]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "error:" in res.stderr and "generate.top_p" in res.stderr


# ---------------------------------------------------------------- self-instruct prompts


def test_keep_self_instruct_drops_cut_empty_and_repeated_prompts():
    samples = [{"id": "self_instruct-00003", "text": "Tell me a joke.", "finish_reason": "eos"},
               {"id": "self_instruct-00000", "text": " Tell me a joke. ", "finish_reason": "eos"},
               {"id": "self_instruct-00001", "text": "cut off mid", "finish_reason": "length"},
               {"id": "self_instruct-00002", "text": "  ", "finish_reason": "eos"},
               {"id": "self_instruct-00004", "text": "Name a river.", "finish_reason": "eos"}]
    kept = generate.keep_self_instruct(samples, 4)  # the first four by id; 00004 is beyond
    assert [(r["id"], r["text"]) for r in kept] == [("self_instruct-00000", "Tell me a joke.")]


def test_user_turn_prefix_is_the_template_up_to_the_users_text():
    tok = load_tokenizer("tiny")
    prefix = tok.decode(generate.user_turn_prefix(tok))
    assert prefix == "<|im_start|>user\n"
    assert tok.decode(generate.user_turn_prefix(tok, "Be brief.")).endswith("Be brief.<|im_end|>\n<|im_start|>user\n")


def test_self_instruct_prompts_are_sampled_once_and_answered(tmp_path, prompts_file, monkeypatch):
    # A random tiny model seldom ends a turn, so every non-empty sample counts as a prompt here.
    monkeypatch.setattr(generate, "keep_self_instruct",
                        lambda samples, n: [r for r in sorted(samples, key=lambda r: r["id"])[:n] if r["text"].strip()])
    short = "data.self_instruct_max_tokens=10"
    written = {}  # self-instruct prompt id -> its length in tokens, as sampled
    real = generate.HFBackend.stream

    def stream(self, items):
        for item, o in real(self, items):
            if item.source == "self_instruct" and not item.prompt:  # a prompt being written, not answered
                written[item.id] = len(o.response_ids)
            yield item, o
    monkeypatch.setattr(generate.HFBackend, "stream", stream)
    summary = run(make_cfg(tmp_path, prompts_file, "data.self_instruct=3", short))
    monkeypatch.setattr(generate.HFBackend, "stream", real)
    path = tmp_path / "t" / "generate" / generate.SELF_INSTRUCT_FILE
    samples = [json.loads(line) for line in path.read_text().splitlines()]
    assert [s["id"] for s in samples] == [f"self_instruct-{i:05d}" for i in range(3)]
    assert all(s["max_new_tokens"] == 10 for s in samples), "the length limit is recorded"
    assert len(written) == 3 and max(written.values()) == 10, "and applied (a random tiny model runs to it)"
    recs = {r["id"]: r for r in records(tmp_path / "t")}
    for s in samples:
        if s["text"].strip():
            assert recs[s["id"]]["source"] == "self_instruct"
            assert recs[s["id"]]["prompt"].startswith("<|im_start|>user\n" + s["text"].strip())
    assert summary["prompts"] == len(PROMPTS) + sum(bool(s["text"].strip()) for s in samples)
    # more self-instruct prompts sample only the new ones and answer only those
    calls = []
    monkeypatch.setattr(generate.HFBackend, "stream", lambda self, items: calls.append(len(items)) or real(self, items))
    run(make_cfg(tmp_path, prompts_file, "data.self_instruct=5", short))
    assert calls[0] == 2  # two new samples; then only their answers (if kept)
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()][:3] == [s["id"] for s in samples]
    assert run(make_cfg(tmp_path, prompts_file, "data.self_instruct=5", short)) is not None and len(calls) <= 2
    # other settings with overwrite=true replace the prompts along with the answers
    run(make_cfg(tmp_path, prompts_file, "data.self_instruct=2", short, "generate.max_new_tokens=8",
                 "generate.overwrite=true"))
    assert len(path.read_text().splitlines()) == 2
    # prompts written under another length limit are not reused (nor their answers: the identity differs)
    longer = ["data.self_instruct=2", "data.self_instruct_max_tokens=12", "generate.max_new_tokens=8"]
    with pytest.raises(ConfigError, match="self_instruct_max_tokens: 10 here, 12 requested"):
        run(make_cfg(tmp_path, prompts_file, *longer))
    for f in [*generate.shard_paths(path.parent), path.parent / "manifest.json"]:
        f.unlink()
    with pytest.raises(ConfigError, match="data.self_instruct_max_tokens than 12"):
        run(make_cfg(tmp_path, prompts_file, *longer))
    run(make_cfg(tmp_path, prompts_file, *longer, "generate.overwrite=true"))  # written again under the new limit
    assert [json.loads(line)["max_new_tokens"] for line in path.read_text().splitlines()] == [12, 12]
    tok = load_tokenizer("tiny")
    assert generate.identity(make_cfg(tmp_path, prompts_file, "data.self_instruct_max_tokens=96"), tok) == \
        generate.identity(make_cfg(tmp_path, prompts_file), tok), "the default keeps identities written before it"


# ---------------------------------------------------------------- bf16 autocast


def test_mixed_precision_runs_the_target_in_bf16_and_is_part_of_the_identity(tmp_path, prompts_file, monkeypatch):
    """generate.mixed_precision=bf16: every target forward pass (prefill and decode) computes in bf16, the
    stored top-k logits stay float; the identity names it only when set, so older data keeps matching."""
    tok = load_tokenizer("tiny")
    plain = generate.identity(make_cfg(tmp_path, prompts_file), tok)
    assert "autocast" not in plain["model"]
    bf16 = generate.identity(make_cfg(tmp_path, prompts_file, "generate.mixed_precision=bf16"), tok)
    assert bf16["model"]["autocast"] == "bf16" and bf16 != plain

    dtypes = collections.Counter()  # the logits of every prefill and decoding pass
    real_step = generate.KVModel.step

    def step_and_watch(kv, *a, **kw):
        out = real_step(kv, *a, **kw)
        dtypes.update([out.dtype])
        return out

    monkeypatch.setattr(generate.KVModel, "step", step_and_watch)
    run(make_cfg(tmp_path / "fp32", prompts_file, "generate.store_topk=3"))
    assert set(dtypes) == {torch.float32}
    dtypes.clear()
    run(make_cfg(tmp_path / "bf16", prompts_file, "generate.store_topk=3", "generate.mixed_precision=bf16"))
    assert set(dtypes) == {torch.bfloat16} and sum(dtypes.values()) > len(PROMPTS)
    a, b = records(tmp_path / "fp32" / "t"), records(tmp_path / "bf16" / "t")
    assert [r["id"] for r in a] == [r["id"] for r in b]
    # same prompts: the first greedy token almost always agrees, and the stored top logit is close, not equal
    first = [(x["response_ids"][0], y["response_ids"][0]) for x, y in zip(a, b)]
    assert sum(u == v for u, v in first) >= len(first) - 1
    top = torch.tensor([[x["topk_logits"][0][0], y["topk_logits"][0][0]] for x, y in zip(a, b)])
    assert (top[:, 0] - top[:, 1]).abs().max() <= 0.05 * top[:, 0].abs().max().clamp(min=1)
    assert not torch.equal(top[:, 0], top[:, 1])
    with pytest.raises(ConfigError, match="other settings.*autocast"):
        run(make_cfg(tmp_path / "fp32", prompts_file, "generate.store_topk=3", "generate.mixed_precision=bf16"))
