"""The evaluate stage's prompt sets: each eval_data entry encoded for the target, categories kept.

    sets = load_eval_sets(cfg, tok, target, answers)    # answers: measure.Answers (turn-2 sets need it)

A turn-2 set (MT-Bench second turns, eval_data.<name>.turn: 2) puts the target's own greedy answer
to the first turn before the second, so the prompt is a real two-turn conversation.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig

from distill.config import ConfigError
from distill.data import encode_prompt, load_prompts, prompt_token_limit
from distill.templates import effective_template

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    id: str
    category: str
    ids: list[int]


def round_robin(prompts: list[Prompt], n: Optional[int]) -> list[int]:
    """Indices of the first n prompts taken in turn from each category (all when n is None or larger)."""
    if n is None or n >= len(prompts):
        return list(range(len(prompts)))
    by_cat: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_cat.setdefault(p.category, []).append(i)
    picked: list[int] = []
    while len(picked) < n:
        for idx in by_cat.values():
            if idx and len(picked) < n:
                picked.append(idx.pop(0))
    return picked


@dataclass
class EvalSet:
    name: str
    prompts: list[Prompt]
    skipped: int  # prompts longer than the prompt limit
    template: str = "chat"  # how its prompts were rendered (distill.templates.effective_template)

    def batches(self, size: int) -> list[list[int]]:
        """Prompt indices in batches of `size`, never mixing categories (first-appearance order)."""
        cats = list(dict.fromkeys(p.category for p in self.prompts))
        out = []
        for c in cats:
            idx = [i for i, p in enumerate(self.prompts) if p.category == c]
            out += [idx[i : i + size] for i in range(0, len(idx), size)]
        return out

    def subset(self, idx: list[int]) -> "EvalSet":
        return EvalSet(self.name, [self.prompts[i] for i in idx], 0, self.template)


def load_eval_sets(cfg: DictConfig, tok, target, answers) -> list[EvalSet]:
    """Each eval_data set encoded for the target; prompts_per_set picks round-robin over categories. A
    turn-2 set (MT-Bench second turns) puts the target's own greedy answer to turn 1 before turn 2."""
    e = cfg.evaluate
    limit = prompt_token_limit(e.max_prompt_tokens, target.config, e.max_new_tokens)
    eos = tok.eos_token_id
    sets = []
    for name, dcfg in cfg.eval_data.items():
        ds = list(load_prompts(dcfg))
        template = dcfg.get("template") or cfg.data.get("template")  # null: the template the draft trained with
        if dcfg.get("turn", 1) == 2:
            ds = [r for r in ds if len(r["messages"]) >= 2]
            firsts = [encode_prompt(tok, r["messages"][:-1], template=template) for r in ds]
            log.info("eval_data.%s: the target answers %d first turns", name, len(ds))
            answers_ = answers(firsts, 0.0)
            ds = [{**r, "messages": r["messages"][:-1] + [{"role": "assistant", "content": tok.decode(
                [t for t in a if t != eos], skip_special_tokens=True)}] + r["messages"][-1:]}
                  for r, a in zip(ds, answers_)]
        prompts, skipped = [], 0
        for row in ds:
            ids = encode_prompt(tok, row["messages"], template=template)
            if len(ids) > limit:
                skipped += 1
                continue
            prompts.append(Prompt(row["id"], row["category"] or name, ids))
        if not prompts:
            raise ConfigError(f"eval_data.{name}: all {len(ds)} prompts are longer than {limit} tokens; raise "
                              "evaluate.max_prompt_tokens or lower evaluate.max_new_tokens")
        prompts = [prompts[i] for i in round_robin(prompts, e.prompts_per_set)]
        if skipped:
            log.warning("eval_data.%s: skipped %d prompts longer than %d tokens", name, skipped, limit)
        sets.append(EvalSet(name, prompts, skipped, effective_template(tok, template)))
    return sets
