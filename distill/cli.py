"""The stages' command lines: `@stage_main("<stage>")` in place of `@hydra.main(...)`.

Hydra reports a mistyped key, a value of the wrong type or an unknown config group option in several
lines, advises `+key=value` (which only hides a typo), and exits 1. Under `stage_main` each of these is
one line on stderr that names the fix, with exit code 2, like every other user error (distill.cli.cli):

    error: data.sorce is not a setting (did you mean data.source?); every key: python -m distill.generate --cfg job
    error: train.lr=abc: train.lr must be a number, e.g. train.lr=0.0001
    error: model=nosuch: no such model config; choose one of llama-3.1-8b, qwen2.5-7b, smollm2, tiny

A flag between overrides (`key=a -m key2=b`) is one line too. `HYDRA_FULL_ERROR=1` keeps Hydra's own
report. Errors raised while a stage runs are not touched here (`cli` below handles its ConfigError).
The stage itself logs INFO on rank 0 only (distill.utils.setup_logging). Each stage's `--help` is
conf/hydra/help/<stage>.yaml; the `${yaml:...}` resolver registered here prints a config value there the
way it is typed on the command line.

Running a stage: every stage's run(cfg) starts with `start_stage` (validate, the sweep tag, logging, the
config record, the seed) and its main calls it through `cli` (a ConfigError is one line and exit 2; in a
sweep job the result then becomes the job's row of the comparison table).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import hydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf
from accelerate.utils import set_seed
from omegaconf.errors import OmegaConfBaseException

from distill import sweep
from distill.config import ConfigError, did_you_mean, validate
from distill.utils import save_config, setup_logging, stage_dir

log = logging.getLogger("distill")

FULL_ERROR = "HYDRA_FULL_ERROR"  # Hydra re-raises instead of printing when this is "1"


def as_typed(value: Any) -> str:
    """A config value as it is typed in an override: null, true, [0,1], {}, 0.0001."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(as_typed(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{as_typed(v)}" for k, v in value.items()) + "}"
    return str(value)


OmegaConf.register_new_resolver("yaml", as_typed, replace=True)

_TYPES = {"Float": "a number", "Integer": "an integer", "Boolean": "true or false", "String": "a string"}


def value_error(override: str, err: OmegaConfBaseException) -> str:
    """One line for a value of the wrong type (`train.lr=abc`), with an example of the right type."""
    full_key = str(getattr(err, "full_key", "") or override.split("=", 1)[0])
    key = re.sub(r"\[\d+\]$", "", full_key)
    first = str(getattr(err, "msg", err)).splitlines()[0]
    parent, name = getattr(err, "parent_node", None), getattr(err, "key", None)
    node = parent._get_node(name) if isinstance(parent, DictConfig) and isinstance(name, str) and name in parent else None
    if re.search(r"is not a subclass of", first):
        typ = OmegaConf.get_type(node) if node is not None else None
        first_key = f", e.g. {key}.{dataclasses.fields(typ)[0].name}=..." if dataclasses.is_dataclass(typ) else ""
        return f"{override}: {key} is a section, not a value; set its keys one at a time{first_key}"
    conv = re.search(r"converted to (\w+)", first)
    what = (_TYPES.get(conv.group(1), conv.group(1).lower()) if conv else "true or false" if "not a valid bool" in first
            else "a list" if "is not a ListConfig" in first else "a mapping" if "is not a DictConfig" in first else None)
    if what is None:
        return f"{override}: {first}"
    if full_key != key:  # an item of a list
        return f"{override}: each item of {key} must be {what}"
    now = None if node is None or node._is_missing() or node._is_none() else as_typed(
        node if isinstance(node, (DictConfig, ListConfig)) else node._value())
    return f"{override}: {key} must be {what}" + (f", e.g. {key}={now}" if now else "")


def composition_error(err: BaseException, stage: str) -> Optional[str]:
    """The one-line message for a Hydra composition or override error, or None for any other exception."""
    if not isinstance(err, (HydraException, OmegaConfBaseException)):
        return None
    cause, text = err.__cause__, str(err)
    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        hint = did_you_mean(option, err.options, f"{group}=")
        return f"{group}={option}: no such {group} config{hint}; choose one of {', '.join(err.options)}"
    if isinstance(err, OverrideParseException):
        why = [ln for ln in err.message.splitlines() if ln.strip() and not ln.startswith(("See ", "Error parsing"))]
        return f"cannot read the override {err.override!r}: {'; '.join(why)}; write key=value (values with spaces " \
               "or special characters in quotes: key='a b')"
    used = re.search(r"use \+(\S+)", text) or re.search(r"merging override (\S+)", text)
    override = used.group(1) if used else None
    if text.startswith("Could not override") and isinstance(cause, OmegaConfBaseException):
        key, parent = str(cause.full_key), getattr(cause, "parent_node", None)
        known = list(parent.keys()) if isinstance(parent, DictConfig) else []
        section, _, name = key.rpartition(".")
        hint = did_you_mean(name, known, section + "." if section else "")
        if isinstance(parent, DictConfig) and not dataclasses.is_dataclass(OmegaConf.get_type(parent)):
            return f"{key} is not in {section or 'the config'}{hint}; to add it, write +{override or key + '=...'}"
        return f"{key} is not a setting{hint}; every key: python -m distill.{stage} --cfg job"
    if text.startswith("Error merging override") and override and isinstance(cause, OmegaConfBaseException):
        return value_error(override, cause)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if isinstance(cause, OmegaConfBaseException):
        lines.append(str(cause).splitlines()[0])
    return "; ".join(lines[:2]) + f" ({FULL_ERROR}=1 shows Hydra's full report)"


def stage_main(stage: str) -> Callable[[Callable[[DictConfig], Any]], Callable[[], None]]:
    """hydra.main over conf/<stage>.yaml for a stage's `main(cfg)`, plus: composition and override errors as
    one line and exit code 2; INFO logging on rank 0 only (distill.utils.setup_logging)."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], None]:
        user_env: dict[str, Optional[str]] = {}  # HYDRA_FULL_ERROR as the user set it

        @functools.wraps(task)  # Hydra finds the stage's file (search path, job name) through __wrapped__
        def job(cfg: DictConfig) -> Any:
            _set_env(FULL_ERROR, user_env.get(FULL_ERROR))  # errors of the stage itself: Hydra's usual report
            setup_logging()
            result = task(cfg)
            _set_env(FULL_ERROR, "1")  # the next multirun job's composition errors come back to main()
            return result

        hydra_main = hydra.main(version_base="1.3", config_path="../conf", config_name=stage)(job)

        @functools.wraps(task)
        def main() -> None:
            user_env[FULL_ERROR] = os.environ.get(FULL_ERROR)
            if user_env[FULL_ERROR] == "1":
                return hydra_main()
            _check_flags(stage)
            os.environ[FULL_ERROR] = "1"  # Hydra raises its errors to us instead of printing them
            try:
                hydra_main()
            except Exception as err:
                msg = composition_error(err, stage)
                if msg is None:
                    raise
                print(f"error: {msg}", file=sys.stderr)
                sys.exit(2)
            finally:
                _set_env(FULL_ERROR, user_env[FULL_ERROR])

        return main

    return decorate


def _check_flags(stage: str) -> None:
    """Parse the command line with hydra.main's own parser first, so that a bad flag is one line too (argparse
    prints its whole usage)."""
    from hydra._internal.utils import get_args_parser  # what hydra.main parses sys.argv with

    def fail(message: str) -> None:
        stray = message.startswith("unrecognized arguments") and "=" in message
        fix = ("put Hydra's flags (-m, --cfg job, --help) before or after all the overrides, not between them"
               if stray else f"see python -m distill.{stage} --help")
        print(f"error: {message}; {fix}", file=sys.stderr)
        sys.exit(2)

    parser = get_args_parser()
    parser.error = fail  # type: ignore[method-assign]
    parser.parse_args()


def _set_env(name: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# ---------------------------------------------------------------- running a stage


def start_stage(cfg: DictConfig, stage: str) -> Path:
    """Validate, record the config, seed; returns the stage's output dir. Every run(cfg) calls this.
    In a job of the stage's own multirun (stage_tag unset) it sets stage_tag from the job's overrides."""
    if cfg.get("gamma") is not None:  # the sweep shorthand `gamma=3,5` stands for evaluate.gammas=[3] / [5]
        cfg.evaluate.gammas = [int(cfg.gamma)]
    validate(cfg)
    tag = sweep.stage_tag(cfg)
    if tag is not None:
        if not tag or sweep.slug(tag) != tag:
            raise ConfigError(f"stage_tag={tag!r} becomes part of directory names (<stage>@<tag>); use letters, "
                              f"digits and ._=,+- only, at most 200 characters, e.g. stage_tag={sweep.slug(tag) or 'a'}")
        cfg.stage_tag = tag
    setup_logging()
    for warning in sweep.upstream_warnings(cfg, stage):
        log.warning("%s: %s", stage, warning)
    save_config(cfg)
    set_seed(cfg.seed)  # accelerate's: python, numpy, torch and every accelerator device
    return stage_dir(cfg, stage)


def cli(run: Callable[[DictConfig], dict], cfg: DictConfig) -> dict:
    """Run a stage from a Hydra main: user errors become one line on stderr and exit code 2. In a job of
    the stage's own multirun, its row then goes into the sweep's comparison table (distill/sweep.py)."""
    try:
        result = run(cfg)
        sweep.add_stage_row(cfg, result)
        return result
    except ConfigError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        sys.exit(2)


def one_line(message: str) -> str:
    """validate()'s list of one problem ("invalid config:\n  - X") as one line; longer lists stay a list."""
    head, sep, items = message.partition("\n  - ")
    return f"{head} {items}" if sep and "\n" not in items else message
