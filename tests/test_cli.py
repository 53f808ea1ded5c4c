"""The command lines: each stage's --help, one-line errors for typos and bad values (exit 2), rank-0 logging.

The stage CLIs run as `python -m distill.<stage>` does (runpy, as __main__), in one helper process that imports
the stage modules once (a process per call would spend ~8 s on imports each); one real subprocess per kind
of CLI checks what reaches the terminal.

    pytest tests/test_cli.py -q
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distill.config import ConfigError
from distill.cli import cli
from distill.utils import setup_logging

REPO = Path(__file__).resolve().parents[1]
STAGES = ("generate", "distill", "evaluate", "publish", "pipeline")

# Runs each call's `python -m <module> <args>` in this one process and prints [{code, out, err, root_level}].
DRIVER = """
import contextlib, io, json, logging, os, runpy, sys
results = []
for module, args, env in json.loads(sys.argv[1]):
    os.environ.update(env)
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [module, *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        except BaseException as e:
            code, err = "raised", io.StringIO(repr(e))
    results.append({"code": code, "out": out.getvalue(), "err": err.getvalue(),
                    "root_level": logging.getLogger().level})
    for key in env:
        os.environ.pop(key)
print("RESULTS " + json.dumps(results))
"""


def run_many(calls: list[tuple[str, list[str], dict]]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(calls)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.rsplit("RESULTS ", 1)[1])


def one_line(res: dict) -> str:
    """The whole stderr of a failed call: exactly one line, `error: ...`, exit code 2, no traceback."""
    assert res["code"] == 2, res
    lines = res["err"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and res["err"].endswith("\n"), res["err"]
    return lines[0]


# stage -> (an option its --help shows with its value, a typo, the key named, the suggestion)
# (distill first: its --help must work before another stage module has registered the ${yaml:} resolver)
CASES = {
    "distill": ("train.lr=0.0001", "train.lrr=1", "train.lrr", "did you mean train.lr?"),
    "generate": ("generate.max_new_tokens=128", "data.sorce=x", "data.sorce", "did you mean data.source?"),
    "evaluate": ("evaluate.gammas=[4]", "gamma_s=3", "gamma_s", "did you mean gamma?"),
    "publish": ("publish.dry_run=true", "publish.dryrun=false", "publish.dryrun", "did you mean publish.dry_run?"),
    "pipeline": ("stages=[generate,distill,evaluate,publish]", "evaluate.gamas=[2]", "evaluate.gamas",
                 "did you mean evaluate.gammas?"),
}
# generate: a bad value, an unknown group option, a near-miss option, flags between overrides, a `+` typo
# (caught by validate inside the stage), a value validate refuses under RANK=1 / RANK=0 (the log level then)
EXTRA = {
    "bad_value": ["train.lr=abc"],
    "bad_group": ["model=nosuch"],
    "near_group": ["experiment=smok"],
    "flag_order": ["model=tiny", "-m", "data.source=stdlib,mt_bench"],
    "plus_typo": ["model=tiny", "+train.lrr=1"],
    "rank1": ["model=tiny", "generate.top_p=2"],
    "rank0": ["model=tiny", "generate.top_p=2"],
    "help_overrides": ["--help", "experiment=smoke", "model=tiny"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = f"runs_root={tmp_path_factory.mktemp('cli_runs')}"  # where Hydra puts the logs of a job that starts
    calls = []
    for stage, (_, typo, _, _) in CASES.items():
        calls += [(f"distill.{stage}", ["--help"], {}), (f"distill.{stage}", [typo], {})]
    for name, args in EXTRA.items():
        env = {"RANK": name[-1]} if name.startswith("rank") else {}
        calls.append(("distill.evaluate" if name == "help_overrides" else "distill.generate",
                      [*args, runs] if "--help" not in args and "-m" not in args else args, env))
    res = run_many(calls)
    by_stage = {stage: {"help": res[2 * i], "typo": res[2 * i + 1]} for i, stage in enumerate(CASES)}
    return by_stage, dict(zip(EXTRA, res[2 * len(CASES):]))


@pytest.mark.parametrize("stage", STAGES)
def test_stage_help_is_the_stages_own(results, stage):
    res = results[0][stage]["help"]
    assert res["code"] == 0 and res["err"] == "", res
    text, option = res["out"], CASES[stage][0]
    assert text.startswith(f"python -m distill.{stage} [overrides]: ")
    assert "powered by Hydra" not in text
    assert option in text  # a main option with its value
    assert "model: llama-3.1-8b, qwen2.5-7b, smollm2, tiny" in text  # the config groups
    examples = text.split("Examples:\n")[1].split("\n\n")[0].splitlines()
    assert 3 <= len(examples) <= 4 and all(f"-m distill.{stage}" in line for line in examples)
    assert f"python -m distill.{stage} [overrides] --cfg job" in text


def test_help_shows_values_with_the_overrides_given(results):
    res = results[1]["help_overrides"]
    assert res["code"] == 0
    assert "evaluate.gammas=[2]" in res["out"] and "evaluate.temperatures=[0.0]" in res["out"]  # experiment=smoke's
    assert "evaluate.timed_gammas=null" in res["out"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_typo_is_one_line_naming_the_key_and_the_closest(results, stage):
    _, _, key, hint = CASES[stage]
    msg = one_line(results[0][stage]["typo"])
    assert msg.startswith(f"error: {key} is not a setting ({hint})"), msg
    assert "+" not in msg  # Hydra's advice (`+key=value`) would hide the typo


def test_bad_values_and_options_are_one_line(results):
    extra = results[1]
    assert one_line(extra["bad_value"]) == "error: train.lr=abc: train.lr must be a number, e.g. train.lr=0.0001"
    assert one_line(extra["bad_group"]) == ("error: model=nosuch: no such model config; choose one of "
                                            "llama-3.1-8b, qwen2.5-7b, smollm2, tiny")
    assert "(did you mean experiment=smoke?)" in one_line(extra["near_group"])
    msg = one_line(extra["flag_order"])
    assert "unrecognized arguments: data.source=stdlib,mt_bench" in msg and "before or after all the overrides" in msg
    msg = one_line(extra["plus_typo"])
    assert "train.lrr is not a setting" in msg and "did you mean train.lr?" in msg


def test_stages_log_info_on_rank_0_only(results):
    extra = results[1]
    for name in ("rank1", "rank0"):  # the stage started (validate refused top_p inside it), after Hydra's logging setup
        assert "generate.top_p=2.0 must be in (0, 1]" in one_line(extra[name])
    assert extra["rank1"]["root_level"] == logging.WARNING
    assert extra["rank0"]["root_level"] == logging.INFO


def test_setup_logging_keeps_info_to_rank_0(monkeypatch, caplog):
    root, log = logging.getLogger(), logging.getLogger("distill.test_cli")
    before = root.level
    try:
        for env, info_shown in (({"RANK": "1"}, False), ({"LOCAL_RANK": "3"}, False), ({"RANK": "0", "LOCAL_RANK": "3"}, True),
                                ({}, True)):
            for var in ("RANK", "LOCAL_RANK"):
                monkeypatch.delenv(var, raising=False)
            for var, value in env.items():
                monkeypatch.setenv(var, value)
            setup_logging()
            caplog.clear()
            log.info("an info line")
            log.warning("a warning")
            assert [r.getMessage() for r in caplog.records] == ["an info line"] * info_shown + ["a warning"], env
    finally:
        root.setLevel(before)


def test_cli_prints_a_single_config_problem_on_one_line(capsys):
    def fails(problems):
        def run(cfg):
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
        return run

    with pytest.raises(SystemExit) as done:
        cli(fails(["train.lr must be > 0"]), None)
    assert done.value.code == 2 and capsys.readouterr().err == "error: invalid config: train.lr must be > 0\n"
    with pytest.raises(SystemExit):
        cli(fails(["a is wrong", "b is wrong"]), None)
    assert capsys.readouterr().err == "error: invalid config:\n  - a is wrong\n  - b is wrong\n"  # a list stays a list


def test_the_terminal_sees_one_line():
    """A real `python -m distill.generate` with a typo: stderr is that one line (no import noise, no traceback)."""
    proc = subprocess.run([sys.executable, "-m", "distill.generate", "data.sorce=x"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("error: data.sorce is not a setting (did you mean data.source?); every key: "
                           "python -m distill.generate --cfg job\n")


def test_hydra_full_error_keeps_hydras_report():
    proc = subprocess.run([sys.executable, "-m", "distill.publish", "publish.dryrun=false"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "Key 'dryrun' not in 'PublishConfig'" in proc.stderr


def data_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distill.data", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_data_preview_help_and_errors():
    proc = data_cli("--help")
    assert proc.returncode == 0 and "python -m distill.data source=mt_bench limit=3" in proc.stdout
    assert "  source=stdlib\n" in proc.stdout and "  limit=null\n" in proc.stdout  # every setting with its default
    for args, expected in (
        (["sorce=mt_bench"], "error: sorce is not a setting (did you mean source?); python -m distill.data --help lists them"),
        (["limit=abc"], "error: limit=abc: limit must be an integer"),
        (["source=nosuch"], "error: data.source='nosuch' is unknown; set data.source to one of "
                            "['file', 'hub', 'humaneval', 'mt_bench', 'stdlib']"),
    ):
        proc = data_cli(*args)
        assert (proc.returncode, proc.stderr) == (2, expected + "\n"), proc.stderr
    proc = data_cli("data.source=mt_bench", "limit=2")  # the stages' data.* spelling works too
    assert proc.returncode == 0 and proc.stdout.startswith("2 prompts from mt_bench")
