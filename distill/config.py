"""Structured configs for every stage (one schema, registered in Hydra's ConfigStore).

Each stage's main YAML (`conf/<stage>.yaml`) starts from the `schema` node below, so every stage sees
the same keys and a typo in an override fails at composition time. `validate(cfg)` turns user
mistakes into one `ConfigError` that names the fix; stages call it before doing any work.

Sections: model (target/draft), data (training prompts), eval_data (evaluation prompt sets),
generate, loss, student, head (student=head), train, evaluate, publish.

Why one module of this size: one schema and its validation; split, the rules would drift from the
fields they check.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from distill.errors import ConfigError
from distill.templates import template_problem


@dataclass
class ModelConfig:
    target: str = MISSING  # hub id, local dir, "smollm2-135m-instruct" (embedded) or "tiny" (tests)
    revision: Optional[str] = None
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    trust_remote_code: bool = False
    cache_dir: Optional[str] = None  # where converted embedded models live; env SPECDISTILL_CACHE
    # Draft initialisation: "from_target" keeps draft_layers of the target (embeddings, final norm
    # and LM head copied); "pretrained" loads `draft` (same tokenizer); "config" builds a fresh
    # model from the target's config with `draft_config` overrides.
    draft_init: str = "from_target"
    draft: Optional[str] = None
    draft_layers: list[int] = field(default_factory=lambda: [0, 29])
    draft_config: dict[str, Any] = field(default_factory=dict)
    # Draft vocabulary: decode with the draft's LM head cut to the N tokens this run's generated answers
    # use most (specdec.drafters.frequent_tokens); 0 = the whole vocabulary. Lossless either way.
    draft_vocab: int = 0


@dataclass
class DataConfig:
    # stdlib | mt_bench | humaneval | file (jsonl/json/parquet at `path`) | hub (datasets name at `path`)
    source: str = "stdlib"
    path: Optional[str] = None
    name: Optional[str] = None  # hub dataset config name
    split: str = "train"
    prompt_column: str = "prompt"  # used when messages_column is unset
    messages_column: Optional[str] = None  # a column of chat turns [{role, content}, ...]
    id_column: Optional[str] = None  # default: "<source>-<row index>"
    system_prompt: Optional[str] = None
    # How prompts become the target's input (distill/templates.py): "chat" = the tokenizer's chat template
    # (null means chat; without a chat template: a plain "user: ...\nassistant:" transcript and a warning),
    # or a format string for base models, e.g. "Question: {prompt}\nAnswer:" ({system}: the system prompt).
    # In an eval_data set, null = data.template (evaluate with the prompts the draft was trained on).
    template: Optional[str] = None
    limit: Optional[int] = None  # keep the first N after shuffling
    skip: int = 0  # drop the first N after shuffling: the complement of a limit=N set (keeps held-out prompts out)
    shuffle: bool = False
    seed: int = 0
    # Plus up to N prompts the target writes itself (a user turn sampled from its chat template's
    # opening, kept when it ends): chat-like training data from no data at all. Made by generate.
    self_instruct: int = 0
    # The most tokens a written prompt may take; a prompt still unfinished there is dropped. 96 fits a chat
    # question; HumanEval-style function stubs need ~256.
    self_instruct_max_tokens: int = 96
    # Show the target `self_instruct_shots` prompts of this eval_data set (only those it does not evaluate)
    # as earlier user turns before it writes each prompt: prompts of that set's kind. null = no examples.
    self_instruct_seeds: Optional[str] = None
    self_instruct_shots: int = 3
    # Plus the evaluation sets' own prompts that evaluation leaves out: every prompt of each eval_data
    # source except the ones that set evaluates (so each set needs a limit: shuffle + limit=N holds N out).
    in_domain: bool = False
    # 2: MT-Bench second turns after the target's own answer to the first (eval_data sets only; nothing
    # trains on them). The same shuffle/seed/limit as a turn-1 set picks the same questions.
    turn: int = 1


@dataclass
class GenerateConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    # An answer also ends (finish_reason "stop") once its text ends with one of these, e.g. ["\nQuestion:"]
    # for a base model prompted with data.template="Question: {prompt}\nAnswer:"; the tokens stay in it.
    stop_strings: list[str] = field(default_factory=list)
    num_samples: int = 1  # answers per prompt (must be 1 when greedy)
    batch_size: int = 16
    max_prompt_tokens: int = 1024
    overlong: str = "skip"  # skip | truncate (keep the last max_prompt_tokens tokens)
    shard_size: int = 64  # records per shard file; a crash loses at most the shard in progress
    store_topk: int = 0  # store the target's top-k logits per response token (0 = off)
    backend: str = "transformers"  # transformers | vllm
    # bf16: the target's forward passes run under bf16 autocast (weights stay as loaded); its p is close to,
    # not equal to, fp32's. Pays most for long prefills (self-instruct writing); docs/measurements.md
    mixed_precision: str = "no"
    overwrite: bool = False


@dataclass
class LossConfig:
    name: str = "fkl"  # fkl | rkl | jsd | tvd
    beta: float = 0.5  # JSD mixture weight (0 -> forward KL limit, 1 -> reverse KL limit)
    temperature: float = 1.0  # softens both distributions before the divergence
    ce_weight: float = 0.0  # mix in cross-entropy on the target's tokens
    # also train the draft as a language model on the prompt tokens (cross-entropy on each next prompt
    # token, summed, times this weight, per response token); the prompt already runs forward and
    # backward, so this adds only the head projection at prompt positions. Needs train.prompt_grad
    prompt_ce_weight: float = 0.0
    chunk_size: int = 512  # response positions projected to the vocabulary at once


@dataclass
class StudentConfig:
    kind: str = "full"  # full | lora | head (a feature head: see the head section)
    freeze_embeddings: bool = True  # embeddings/LM head shared with the target stay fixed
    freeze_layers: int = 0  # the draft's first N decoder layers keep the target's weights (no backward through them)
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    merge: bool = True  # also save a merged plain model next to the adapter


@dataclass
class HeadConfig:
    """student=head: an EAGLE-3 style feature head (specdec.heads) instead of a standalone draft."""

    # target layers whose hidden states the head reads (id j = the state entering layer j, as vLLM counts);
    # null = EAGLE-3's low / middle / high choice (2, L//2, L-3). vLLM and SGLang serve exactly three.
    layers: Optional[list[int]] = None
    num_layers: int = 1  # decoder layers in the head (SGLang serves 1)
    # training-time test: unroll the head K steps on its own hidden states, the loss at every step
    ttt_steps: int = 3
    lr: float = 1e-3  # a new layer on fixed features: the standalone drafts' 1e-4 moves it too slowly
    # with a standalone student: the distill stage also trains a head (runs/<run>/distill-head), evaluate
    # scores it as "head" (evaluate.drafts=[best,head]) and publish ships whichever measured fastest
    also: bool = False
    time_budget_min: Optional[float] = None  # the head's own budget beside the standalone one (null: train's)


@dataclass
class TrainConfig:
    max_steps: int = 200
    time_budget_min: Optional[float] = None  # stop (and checkpoint) after this many minutes
    batch_size: int = 8  # per process
    grad_accum: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    schedule: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 10
    max_grad_norm: float = 1.0
    max_seq_len: int = 512
    teacher: str = "online"  # online (target logits in-process) | topk (stored by generate)
    on_policy_fraction: float = 0.0  # λ: share of batches whose responses the draft samples
    on_policy_max_new_tokens: int = 64
    # with model.draft_vocab > 0: train q as the draft decodes, a softmax over the draft vocabulary only
    # (α_TF and best/ too); false trains the whole head
    draft_vocab: bool = True
    holdout: int = 16  # generated records held out for α_TF
    # after training: fit one logit scale s (q = softmax(s·z)) that maximises α_TF on the holdout and write it
    # into best/'s final norm (full student only; the target's distribution is untouched, decoding stays lossless)
    calibrate: bool = True
    eval_every: int = 50
    save_every: int = 50
    keep_checkpoints: int = 3
    resume: str = "auto"  # auto | never
    gradient_checkpointing: bool = False
    # false: the prompt prefix runs without autograd (as a KV cache); same loss, cheaper backward, the
    # gradient through prompt activations is dropped (ignored with gradient_checkpointing). On the default
    # draft its extra steps did not make up for that gradient (docs/measurements.md, "Loss and gradient options")
    prompt_grad: bool = True
    mixed_precision: str = "auto"  # auto: bf16 on GPU, no on CPU


@dataclass
class EvaluateConfig:
    # Drafts to evaluate: paths, globs, or the names "best", "checkpoints" (all of the run's).
    drafts: list[str] = field(default_factory=lambda: ["best"])
    # Reference rows: target (alone), init (undistilled draft), prompt_lookup, hybrid (prompt lookup where the
    # context has a match, the first draft where it has none), hf_assisted.
    references: list[str] = field(default_factory=lambda: ["target", "init", "prompt_lookup", "hybrid", "hf_assisted"])
    gammas: list[int] = field(default_factory=lambda: [4])
    gamma_policy: str = "constant"  # constant | adaptive
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    top_p: float = 1.0
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    # Greedy α, τ and counters come from exact replay over every prompt at this length (no decoding)
    max_new_tokens: int = 128
    # Prompts per set decoded for real and timed (costs, measured speedup, the greedy and replay checks),
    # at timed_max_new_tokens (null: max_new_tokens); sampled rows and batch sizes > 1 are measured on them
    timed_prompts: int = 4
    timed_max_new_tokens: Optional[int] = 64
    # γ each candidate is timed at (null: every γ of gammas). An untimed γ's speedup is modeled with the
    # largest timed γ's costs and flagged (a verify call's cost is not linear in its proposals on CPU)
    timed_gammas: Optional[list[int]] = None
    sampled_prompts: Optional[int] = None  # α_TF at T > 0 scores the target's sampled answers to this many per set (null: all)
    repeats: int = 3  # timed runs per decoder (median); fewer than 3 flags every speedup as noise
    warmup: int = 1  # untimed runs first; 0 flags every speedup as noise
    reference_batch_size: int = 16  # the target's reference answers are decoded in batches of this size
    prompts_per_set: Optional[int] = None  # None = every prompt in each eval set
    max_prompt_tokens: int = 1024  # longer eval prompts are skipped (and counted in the report)
    seed: int = 0


@dataclass
class PublishConfig:
    repo_id: Optional[str] = None  # <user>/<name>; required unless dry_run
    dry_run: bool = True
    private: bool = False
    revision: Optional[str] = None
    license: str = "apache-2.0"
    merge: bool = True  # LoRA: upload a merged model (false: the adapter with base_model)
    force: bool = False  # publish without (or with a failing) evaluation report
    draft: str = "fastest"  # "fastest" (the evaluation's top draft: standalone or head), "best", a checkpoint, a path


@dataclass
class Config:
    run_name: str = "default"
    runs_root: str = "runs"
    seed: int = 0
    logger: str = "wandb"  # wandb | none
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "specdistill"
    stages: list[str] = field(default_factory=lambda: ["generate", "distill", "evaluate", "publish"])
    gamma: Optional[int] = None  # shorthand for evaluate.gammas=[gamma], for sweeps: -m gamma=3,5
    # A stage writes runs/<run>/<stage>@<tag> (and config@<tag>.yaml) and reads an earlier stage's tagged dir made
    # from the most of its overrides, else <stage>: the jobs of one stage's sweep (`python -m distill.distill -m
    # loss=fkl,tvd`) share a run dir, not their output. null: a stage sweep job's overrides (distill/sweep.py), else none
    stage_tag: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval_data: dict[str, DataConfig] = field(default_factory=dict)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)


def register() -> None:
    ConfigStore.instance().store(name="schema", node=Config)


register()

CHOICES = {
    "model.dtype": {"auto", "float32", "bfloat16", "float16"},
    "model.draft_init": {"from_target", "pretrained", "config"},
    "data.source": {"stdlib", "mt_bench", "humaneval", "file", "hub"},
    "generate.overlong": {"skip", "truncate"},
    "generate.backend": {"transformers", "vllm"},
    "generate.mixed_precision": {"no", "bf16"},
    "loss.name": {"fkl", "rkl", "jsd", "tvd"},
    "student.kind": {"full", "lora", "head"},
    "train.schedule": {"cosine", "linear", "constant"},
    "train.teacher": {"online", "topk"},
    "train.resume": {"auto", "never"},
    "evaluate.gamma_policy": {"constant", "adaptive"},
    "logger": {"wandb", "none"},
    "wandb_mode": {"offline", "online", "disabled"},
}
STAGES = ("generate", "distill", "evaluate", "publish")
REFERENCES = ("target", "init", "prompt_lookup", "hybrid", "hf_assisted")
HEAD_STAGE = "distill-head"  # runs/<run>/distill-head: the head trained beside the standalone draft (head.also)
DRAFT_KINDS = ("model", "head")  # report rows of a trained draft: a standalone model or a feature head


def _get(cfg: DictConfig, dotted: str) -> Any:
    return OmegaConf.select(cfg, dotted)


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Dotted keys of `cfg` that its schema does not have: Hydra's `+key=value` adds them to a structured
    config without a word, and no stage would read them (a typo such as `+train.lrr=1` would be ignored)."""
    found: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        typ = OmegaConf.get_type(node)
        fields = {f.name for f in dataclasses.fields(typ)} if dataclasses.is_dataclass(typ) else None
        for key in node.keys():
            if fields is not None and key not in fields:
                found.append(f"{prefix}{key}")
                continue
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
                walk(child, f"{prefix}{key}.")

    walk(cfg, "")
    return found


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """' (did you mean <prefix><closest>?)' for the known name closest to `name`, or '' when none is close."""
    near = difflib.get_close_matches(name, [str(k) for k in known], n=1)
    return f" (did you mean {prefix}{near[0]}?)" if near else ""


def validate(cfg: DictConfig | Config) -> None:
    """Raise ConfigError (one message naming the fix) for values no stage can run with."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    errors: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errors.append(msg)

    for key in unknown_keys(cfg):
        section, _, name = key.rpartition(".")
        known = [f.name for f in dataclasses.fields(OmegaConf.get_type(OmegaConf.select(cfg, section) if section else cfg))]
        hint = did_you_mean(name, known, f"{section}." if section else "")
        errors.append(f"{key} is not a setting: `+` added it and no stage reads it; remove it{hint}")
    for key, allowed in CHOICES.items():
        val = _get(cfg, key)
        need(val in allowed, f"{key}={val!r} is not one of {sorted(allowed)}; set {key}=<one of those>")
    need(bool(cfg.run_name) and os.sep not in str(cfg.run_name), "run_name must be a non-empty name without '/'")
    unknown = [s for s in cfg.stages if s not in STAGES]
    need(not unknown, f"stages has unknown {unknown}; choose from {list(STAGES)}")
    need(cfg.data.self_instruct >= 0, f"data.self_instruct={cfg.data.self_instruct} must be >= 0 (0 = off)")
    need(cfg.data.get("self_instruct_max_tokens", DataConfig.self_instruct_max_tokens) >= 1,
         f"data.self_instruct_max_tokens={cfg.data.get('self_instruct_max_tokens')} must be >= 1")
    need(cfg.model.draft_vocab >= 0, f"model.draft_vocab={cfg.model.draft_vocab} must be >= 0 (0 = whole vocabulary)")
    g = cfg.generate
    need(g.temperature >= 0, f"generate.temperature={g.temperature} must be >= 0 (0 = greedy)")
    need(0 < g.top_p <= 1, f"generate.top_p={g.top_p} must be in (0, 1]")
    need(g.top_k >= 0, f"generate.top_k={g.top_k} must be >= 0 (0 = off)")
    need(g.max_new_tokens >= 1, "generate.max_new_tokens must be >= 1")
    need(g.batch_size >= 1 and g.shard_size >= 1, "generate.batch_size and generate.shard_size must be >= 1")
    need(g.num_samples >= 1, "generate.num_samples must be >= 1")
    need(
        g.num_samples == 1 or g.temperature > 0,
        "generate.num_samples > 1 needs sampling: set generate.temperature > 0 (greedy answers are identical)",
    )
    need(g.store_topk >= 0, "generate.store_topk must be >= 0 (0 = off)")
    need(g.backend != "vllm" or g.get("mixed_precision", "no") == "no",
         "generate.mixed_precision=bf16 is for the transformers backend; with vllm set model.dtype=bfloat16 "
         "and generate.mixed_precision=no")
    d = cfg.get("data")
    if d is not None and d.get("in_domain"):
        whole = [n for n, ed in cfg.get("eval_data", {}).items() if ed.get("limit") is None]
        need(not whole, f"data.in_domain trains on the eval_data prompts that evaluation leaves out, but {whole} "
             "evaluate every prompt; hold some out with eval_data.<name>.shuffle=true eval_data.<name>.limit=N")
    for name, dc in [("data", d), *((f"eval_data.{k}", v) for k, v in (cfg.get("eval_data") or {}).items())]:
        problem = template_problem(dc.get("template")) if dc is not None else None
        need(problem is None, f"{name}.template: {problem}; use {name}.template=chat or a format string such as "
             "'Question: {prompt}\\nAnswer:'")
    stops = list(g.get("stop_strings") or [])
    need(all(isinstance(x, str) and x for x in stops),
         f"generate.stop_strings={stops} must be non-empty strings, e.g. '[\"\\nQuestion:\"]'")
    if d is not None:  # before any slow work (self-instruct sampling comes before the prompts are loaded)
        need(d.get("limit") is None or d.limit >= 1, f"data.limit={d.get('limit')} must be >= 1 (or null for every prompt)")
        need(d.get("skip", 0) >= 0, f"data.skip={d.get('skip')} must be >= 0")
    seeds = d.get("self_instruct_seeds") if d is not None else None
    if seeds:
        sets = cfg.get("eval_data", {})
        need(seeds in sets, f"data.self_instruct_seeds={seeds!r} is not an eval_data set; use one of {sorted(sets)}")
        need(seeds not in sets or sets[seeds].get("limit") is not None,
             f"data.self_instruct_seeds={seeds!r} shows the prompts eval_data.{seeds} leaves out, but it evaluates "
             f"every prompt; hold some out with eval_data.{seeds}.shuffle=true eval_data.{seeds}.limit=N")
        need(d.self_instruct_shots >= 1, f"data.self_instruct_shots={d.self_instruct_shots} must be >= 1")
    lo = cfg.loss
    need(0 <= lo.beta <= 1, f"loss.beta={lo.beta} must be in [0, 1]")
    need(lo.temperature > 0, f"loss.temperature={lo.temperature} must be > 0")
    need(lo.ce_weight >= 0, "loss.ce_weight must be >= 0")
    need(lo.get("prompt_ce_weight", 0) >= 0, "loss.prompt_ce_weight must be >= 0")
    need(lo.chunk_size >= 1, "loss.chunk_size must be >= 1")
    need(cfg.get("gamma") is None or cfg.gamma >= 1, f"gamma={cfg.get('gamma')} must be >= 1 (or null: use evaluate.gammas)")
    t = cfg.train
    need(t.max_steps >= 1, "train.max_steps must be >= 1")
    need(t.batch_size >= 1 and t.grad_accum >= 1, "train.batch_size and train.grad_accum must be >= 1")
    need(t.lr > 0, "train.lr must be > 0")
    need(not lo.get("prompt_ce_weight", 0) or t.prompt_grad or t.gradient_checkpointing,
         "loss.prompt_ce_weight trains on the prompt tokens, which train.prompt_grad=false runs without autograd; "
         "set train.prompt_grad=true or loss.prompt_ce_weight=0")
    need(0 <= t.on_policy_fraction <= 1, "train.on_policy_fraction (λ) must be in [0, 1]")
    need(t.eval_every >= 1 and t.save_every >= 1, "train.eval_every and train.save_every must be >= 1")
    need(
        t.teacher != "topk" or g.store_topk > 0,
        "train.teacher=topk needs stored logits: set generate.store_topk=<k> (e.g. 64) and regenerate",
    )
    s = cfg.student
    need(s.lora_r >= 1, "student.lora_r must be >= 1")
    h = cfg.get("head")
    if h is not None and (s.kind == "head" or h.get("also")):
        need(h.num_layers >= 1, f"head.num_layers={h.num_layers} must be >= 1")
        need(h.ttt_steps >= 1, f"head.ttt_steps={h.ttt_steps} must be >= 1 (1 = no training-time test)")
        need(h.layers is None or len(h.layers) >= 1, "head.layers must list at least one target layer (or be null)")
        need(t.on_policy_fraction == 0, "student=head trains on the target's own answers; set train.on_policy_fraction=0")
    e = cfg.evaluate
    need(len(e.gammas) > 0 and all(x >= 1 for x in e.gammas), f"evaluate.gammas={list(e.gammas)} must be >= 1")
    need(all(x >= 0 for x in e.temperatures), "evaluate.temperatures must be >= 0")
    need(0 < e.top_p <= 1, "evaluate.top_p must be in (0, 1]")
    need(all(b >= 1 for b in e.batch_sizes), "evaluate.batch_sizes must be >= 1")
    need(e.max_prompt_tokens >= 1, "evaluate.max_prompt_tokens must be >= 1")
    need(e.repeats >= 1 and e.warmup >= 0, "evaluate.repeats must be >= 1 and evaluate.warmup >= 0")
    need(not e.get("timed_gammas") or set(e.timed_gammas) <= set(e.gammas),
         f"evaluate.timed_gammas={list(e.get('timed_gammas') or [])} must be among evaluate.gammas={list(e.gammas)}")
    need(e.get("sampled_prompts") is None or e.sampled_prompts >= 1, "evaluate.sampled_prompts must be >= 1 (or null: all)")
    need(e.get("timed_prompts", 0) >= 0, "evaluate.timed_prompts must be >= 0 (0: replay only, no timing)")
    need(e.get("timed_max_new_tokens") is None or e.timed_max_new_tokens >= 1,
         "evaluate.timed_max_new_tokens must be >= 1 (or null: evaluate.max_new_tokens)")
    need(e.get("reference_batch_size", 1) >= 1, "evaluate.reference_batch_size must be >= 1")
    bad_refs = [r for r in e.references if r not in REFERENCES]
    need(not bad_refs, f"evaluate.references has unknown {bad_refs}; choose from {', '.join(REFERENCES)}")
    m = cfg.model
    need(m.target not in (None, "", "???"), "model.target is required: a hub id, a local dir, or model=smollm2")
    if m.draft_init == "pretrained":
        need(bool(m.draft), "model.draft_init=pretrained needs model.draft=<hub id or dir>")
    if m.draft_init == "from_target":
        need(len(m.draft_layers) > 0, "model.draft_layers must list at least one target layer index")
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def run_dir(cfg: DictConfig) -> str:
    """runs/<run_name>: the directory all stages of one run share."""
    return os.path.join(cfg.runs_root, cfg.run_name)


def stage_path(cfg: DictConfig, stage: str, own: bool = False) -> Path:
    """runs/<run_name>/<stage>: where `stage` (generate, distill, distill-head, evaluate, publish) writes, and
    where the stages after it read it (not created here). With cfg.stage_tag set: <stage>@<tag> for the
    stage being run (own=True: start_stage), and for a stage run before it the best of `read_tags`, or
    <stage> untagged when none fits (a stage that was not swept)."""
    base = Path(run_dir(cfg))
    tag = cfg.get("stage_tag")
    if tag and not own:
        tag = next(iter(read_tags(base, stage, str(tag))), None)
    return base / f"{stage}@{tag}" if tag else base / stage


def tag_overrides(tag: str) -> frozenset[str]:
    """The overrides a stage tag was made from (distill/sweep.py joins them with ','): split before each key=."""
    return frozenset(re.split(r",(?=\+{0,2}[A-Za-z_][\w.+-]*=)", tag))


def read_tags(base: Path, stage: str, tag: str) -> list[str]:
    """The tags of the <stage>@* dirs under `base` that a job tagged `tag` may read, best first: its own tag;
    else the tags made from the most of its overrides (the sweep before it had fewer: an evaluate sweep with
    the distill sweep's overrides plus evaluate.* ones), several when those tie; [] when none fits."""
    if (base / f"{stage}@{tag}").is_dir():
        return [tag]
    mine = tag_overrides(tag)
    fits = [t for t in (d.name.split("@", 1)[1] for d in base.glob(f"{stage}@*") if d.is_dir())
            if tag_overrides(t) <= mine]
    most = max((len(tag_overrides(t)) for t in fits), default=0)
    return sorted(t for t in fits if len(tag_overrides(t)) == most)
