"""Every main config composes with every experiment preset and every group option, and validates."""
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from distill.config import ConfigError, validate

CONF = Path(__file__).resolve().parents[1] / "conf"
MAINS = ["generate", "distill", "evaluate", "publish", "pipeline"]
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
GROUPS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml")) for g in ("model", "data", "loss", "student")}


def _compose(name, overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def test_presets_exist():
    assert {"smoke", "default"} <= set(EXPERIMENTS)
    assert {"fkl", "rkl", "jsd", "tvd"} <= set(GROUPS["loss"])
    assert {"full", "lora"} <= set(GROUPS["student"])
    assert {"smollm2", "tiny"} <= set(GROUPS["model"])


@pytest.mark.parametrize("main", MAINS)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_main_with_every_experiment(main, experiment):
    cfg = _compose(main, [f"experiment={experiment}"])
    validate(cfg)
    assert cfg.run_name == experiment
    assert set(cfg.eval_data) >= {"mt_bench", "humaneval"}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option(group, option):
    cfg = _compose("pipeline", [f"{group}={option}", "experiment=smoke"])
    if group == "data" and OmegaConf.select(cfg, "data.path") == "???":
        pytest.skip("example preset needs data.path")
    validate(cfg)
    if group == "loss":
        assert cfg.loss.name == option


def test_smoke_is_small():
    cfg = _compose("pipeline", ["experiment=smoke"])
    assert cfg.train.max_steps <= 10 and cfg.evaluate.prompts_per_set <= 4 and cfg.wandb_mode == "offline"  # smoke: W&B on, never online


@pytest.mark.parametrize(
    "override,needle",
    [
        ("generate.temperature=-1", "generate.temperature"),
        ("generate.top_p=0", "generate.top_p"),
        ("loss.name=kl", "loss.name='kl'"),
        ("train.on_policy_fraction=2", "on_policy_fraction"),
        ("evaluate.gammas=[0]", "evaluate.gammas"),
        ("train.teacher=topk", "generate.store_topk"),
        ("model.draft_init=pretrained", "model.draft="),
        ("generate.num_samples=4", "generate.temperature > 0"),
        ("loss.prompt_ce_weight=-1", "loss.prompt_ce_weight must be >= 0"),
        ("loss.prompt_ce_weight=0.5 train.prompt_grad=false", "set train.prompt_grad=true"),
        ("data.template=Answer:", "data.template: 'Answer:' has no {prompt} field"),
        ("data.template='Q:{question}'", "use data.template=chat or a format string"),
        ("eval_data.mt_bench.template='{prompt'", "eval_data.mt_bench.template: '{prompt' is not a format string"),
        ("generate.stop_strings=['']", "generate.stop_strings"),
    ],
)
def test_bad_values_name_the_fix(override, needle):
    cfg = _compose("pipeline", override.split())
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert needle in str(e.value)


def test_plain_template_and_stop_strings_validate():
    validate(_compose("pipeline", ["data.template='Question: {prompt}\\nAnswer:'", "generate.stop_strings=['\\nQuestion:']",
                                   "eval_data.humaneval.template='{prompt}'"]))


def test_typo_fails_at_composition():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose("pipeline", ["train.lrr=1"])
