"""Benchmark the distill stage on the embedded default: α_TF before/after on held-out HumanEval and MT-Bench.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_distill.py --minutes 20           # the goal run (defaults)
    .venv/bin/python scripts/bench_distill.py --minutes 3 --name l4 model.draft_layers=[0,1,28,29] train.lr=1e-3
    .venv/bin/python scripts/bench_distill.py --init-only --shapes "[[0,29],[0,1,28,29],[0,1,2,3,4,5]]"
    .venv/bin/python scripts/bench_distill.py --data runs/default --minutes 10   # train on a run's records
    .venv/bin/python scripts/bench_distill.py --measure runs/default/distill/best   # α_TF of a trained draft
    .venv/bin/python scripts/bench_distill.py --data runs/default --in-domain --minutes 15   # + in-domain prompts

Generates (once, resumable, under --root) the target's answers: --train-records stdlib prompts with
top-64 logits (the training set) and --eval-records HumanEval and MT-Bench prompts (held out, never
trained on). With --in-domain it also answers the HumanEval and MT-Bench prompts the held-out sets
leave out (same shuffle, data.skip=--eval-records; --in-domain-samples N > 1: N answers sampled at
T = 1 each) and trains on the union of those and the training records. Then it measures α_TF
(teacher_forced_acceptance: mean Σ min(p, q) over the target's response tokens) of the initial
draft, trains with `python -m distill.distill`'s run() for at most --minutes (train.time_budget_min;
any distill override can follow), and measures α_TF of distill/best.
Prints training tokens/s, peak memory (max RSS; GPU peak when on GPU), and a rough cost ratio
c = one draft decode step ÷ one target decode step (batch 1, KV cache; evaluate measures it properly).
On a shared machine set OMP_NUM_THREADS to the cores you really have: oversubscribed OpenMP threads
spin and can make every step several times slower.
Goal (issue 5): α_TF ≥ 0.60 on HumanEval and ≥ 0.45 on MT-Bench after ≤ 20 min on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from distill import generate  # noqa: E402
import distill.distill
from distill.batches import LogitScale, holdout_reference, measure_alpha, to_examples  # noqa: E402
from distill.records import load_generated  # noqa: E402
from distill.losses import VocabSubset  # noqa: E402
from distill.models import draft_from_target, load_draft, load_model, load_target, shared_vocab_size  # noqa: E402
from specdec.drafters import frequent_tokens  # noqa: E402

CONF = str(ROOT / "conf")
EVAL_SETS = ("humaneval", "mt_bench")


def cfg_for(stage: str, overrides: list[str]):
    with initialize_config_dir(CONF, version_base="1.3"):
        return compose(stage, overrides=overrides)


def ensure_generated(root: str, name: str, extra: list[str]) -> str:
    base = [f"runs_root={root}", f"run_name={name}", "logger=none", "generate.max_new_tokens=128", "generate.batch_size=16"]
    summary = generate.run(cfg_for("generate", base + extra))
    print(f"[data] {name}: {summary['records']} records, {summary['response_tokens']} response tokens", flush=True)
    return os.path.join(root, name)


def union(root: str, name: str, parts: list[str]) -> str:
    """A run dir whose generate/ links every shard of `parts` (run dirs): their records as one set."""
    out = Path(root) / name / "generate"
    out.mkdir(parents=True, exist_ok=True)
    for part in parts:
        for shard in generate.shard_paths(Path(part) / "generate"):
            link = out / f"shard-r{Path(part).name}-{shard.name.removeprefix('shard-r')}"
            if not link.exists():
                os.symlink(os.path.abspath(shard), link)
    return str(out.parent)


def references(root: str, target, tok, vocab: int, n_eval: int) -> dict:
    refs = {}
    for s in EVAL_SETS:
        d = ensure_generated(root, f"bench-{s}", [f"data={s}", f"data.limit={n_eval}", "data.shuffle=true"])
        path = Path(d) / "reference.pt"
        if path.exists():
            refs[s] = torch.load(path, weights_only=False)
            continue
        t0 = time.perf_counter()
        refs[s] = holdout_reference(target, to_examples(load_generated(d), 2048), 8, vocab, target.device)
        torch.save(refs[s], path)
        print(f"[ref] {s}: target reference in {time.perf_counter() - t0:.0f} s (tail mass {refs[s].tail_mass:.2e})", flush=True)
    return refs


def alphas(draft, refs: dict, vocab: int, subset=None) -> dict:
    out = {}
    for s, ref in refs.items():
        num, den = measure_alpha(draft, ref, vocab=vocab, subset=subset)
        out[s] = num / den
    return out


@torch.no_grad()
def decode_step_s(model, steps: int = 24) -> float:
    """Median seconds of one batch-1 decode step with a KV cache after a 64-token prefill."""
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.arange(100, 164).unsqueeze(0).to(model.device)
    out = model(ids, use_cache=True)
    times = []
    tok = ids[:, -1:]
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(tok, use_cache=True, **{key: out[key]})
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def peak_memory_gib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    if torch.cuda.is_available():
        rss = max(rss, torch.cuda.max_memory_allocated() / 2**30)
    return rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="training time budget (train.time_budget_min)")
    ap.add_argument("--train-records", type=int, default=640, help="stdlib prompts answered by the target")
    ap.add_argument("--eval-records", type=int, default=48, help="held-out HumanEval and MT-Bench prompts each")
    ap.add_argument("--root", default=str(ROOT / "runs" / "bench"), help="where bench runs live")
    ap.add_argument("--name", default=None, help="run name of the training run (default: from the overrides)")
    ap.add_argument("--init-only", action="store_true", help="only measure initial α_TF and c of --shapes")
    ap.add_argument("--no-generate", action="store_true", help="train on the records already generated (no top-up)")
    ap.add_argument("--measure", default=None, help="only measure α_TF of this draft dir on the held-out sets")
    ap.add_argument("--data", default=None, help="train on this run's generated records (with top-k logits) instead")
    ap.add_argument("--in-domain", action="store_true",
                    help="also train on the HumanEval / MT-Bench prompts the held-out sets leave out")
    ap.add_argument("--in-domain-samples", type=int, default=1,
                    help="answers per in-domain prompt: 1 = the greedy answer, N > 1 = N sampled at T = 1 "
                         "(implies --in-domain)")
    ap.add_argument("--skip-before", action="store_true", help="do not measure the initial draft (saves minutes)")
    ap.add_argument("--shapes", default="[[0,29],[0,1,28,29],[0,10,20,29]]", help="draft_layers lists for --init-only")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="score q over the N tokens the training answers use most (default: the run's model.draft_vocab)")
    ap.add_argument("overrides", nargs="*", help="distill config overrides, e.g. train.lr=1e-3 loss=tvd")
    args = ap.parse_args()
    if args.in_domain_samples < 1:
        ap.error(f"--in-domain-samples={args.in_domain_samples} must be >= 1")
    args.in_domain = args.in_domain or args.in_domain_samples > 1

    model_ov = [o for o in args.overrides if o.startswith("model")]
    target, tok = load_target(cfg_for("distill", model_ov).model)
    vocab = shared_vocab_size(tok, target)
    refs = references(args.root, target, tok, vocab, args.eval_records)
    t_target = decode_step_s(target)

    data = args.data or os.path.join(args.root, "bench-data")
    trains = not (args.measure or args.init_only)
    if (trains or args.in_domain) and not args.no_generate and not args.data:
        ensure_generated(args.root, "bench-data", ["data=stdlib", f"data.limit={args.train_records}", "generate.store_topk=64"])
    if args.in_domain:  # the complement of references()' held-out sets: same shuffle and seed, skip instead of limit
        n = args.in_domain_samples
        sampling, tag = ([], "") if n == 1 else ([f"generate.num_samples={n}", "generate.temperature=1.0"], f"-x{n}")
        extra = [ensure_generated(args.root, f"bench-train-{s}{tag}",
                                  [f"data={s}", f"data.skip={args.eval_records}", "data.shuffle=true",
                                   "generate.store_topk=64", *sampling]) for s in EVAL_SETS]
        data = union(args.root, f"bench-union-{Path(data).name}{tag}", [data, *extra])

    def subset_of(n: int):
        if not n:
            return None
        answers = load_generated(data)["response_ids"]
        return VocabSubset(frequent_tokens(answers, min(n, vocab), vocab, tok), vocab)

    if args.measure:
        sub = subset_of(args.draft_vocab or 0)
        a = alphas(load_model(args.measure, device=str(target.device)), refs, vocab, sub)
        print(f"{args.measure}: α_TF humaneval {a['humaneval']:.3f}, mt_bench {a['mt_bench']:.3f}"
              + (f" (draft vocabulary of {sub.size} tokens from {data})" if sub else ""))
        return

    if args.init_only:
        print(f"{'draft_layers':<28} {'α_TF humaneval':>15} {'α_TF mt_bench':>14} {'c (decode)':>11}")
        for shape in ast.literal_eval(args.shapes):
            d = draft_from_target(target, list(shape))
            a = alphas(d, refs, vocab)
            print(f"{str(shape):<28} {a['humaneval']:>15.3f} {a['mt_bench']:>14.3f} {decode_step_s(d) / t_target:>11.3f}", flush=True)
        return

    name = args.name or "train-" + "-".join(o.replace("=", "").replace("/", "") for o in args.overrides)[:80] or "train-default"
    run_path = Path(args.root) / name
    run_path.mkdir(parents=True, exist_ok=True)
    if not (run_path / "generate").exists():
        os.symlink(os.path.abspath(os.path.join(data, "generate")), run_path / "generate")
    cfg = cfg_for("distill", [f"runs_root={args.root}", f"run_name={name}", "logger=none",
                              f"train.time_budget_min={args.minutes}", *args.overrides])
    n_sub = args.draft_vocab if args.draft_vocab is not None else (cfg.model.draft_vocab if cfg.train.draft_vocab else 0)
    sub = subset_of(n_sub)  # α_TF as the draft decodes (and, with train.draft_vocab, as it trains)
    init = load_draft(cfg.model, target, tok)
    before = {s: float("nan") for s in EVAL_SETS} if args.skip_before else alphas(init, refs, vocab, sub)
    c = decode_step_s(init) / t_target
    del init
    t0 = time.perf_counter()
    summary = distill.distill.run(cfg)
    wall = time.perf_counter() - t0
    best = load_model(str(run_path / "distill" / "best"), device=str(target.device))
    after = alphas(best, refs, vocab, sub)
    scale = summary.get("logit_scale", 1.0)
    uncalibrated = after
    if scale != 1.0:  # train.calibrate scaled best/'s logits: also score it without that scale
        LogitScale(best).set(1.0 / scale)
        uncalibrated = alphas(best, refs, vocab, sub)
    row = {
        "name": name, "data": data, "overrides": args.overrides, "draft_layers": list(cfg.model.draft_layers),
        "steps": summary["step"], "train_s": summary.get("elapsed_s"), "wall_s": round(wall, 1),
        "tokens_per_s": summary["tokens_per_s"], "train_tokens": summary["train_tokens"],
        "holdout_alpha_init": summary["init_teacher_forced_acceptance"],
        "holdout_alpha_best": summary["best_teacher_forced_acceptance"], "best_step": summary["best_step"],
        "alpha_before": before, "alpha_after": after, "logit_scale": scale, "alpha_after_uncalibrated": uncalibrated,
        "cost_ratio_estimate": round(c, 3),
        "peak_memory_gib": round(peak_memory_gib(), 2), "threads": torch.get_num_threads(), "draft_vocab": n_sub,
    }
    print(json.dumps(row))
    print(f"\n{'':<10} {'α_TF humaneval':>15} {'α_TF mt_bench':>14}")
    print(f"{'before':<10} {before['humaneval']:>15.3f} {before['mt_bench']:>14.3f}")
    if scale != 1.0:
        print(f"{'after, s=1':<10} {uncalibrated['humaneval']:>15.3f} {uncalibrated['mt_bench']:>14.3f}   "
              f"(without the logit scale {scale:g} fitted on the training holdout)")
    print(f"{'after':<10} {after['humaneval']:>15.3f} {after['mt_bench']:>14.3f}   (goal ≥ 0.60 / ≥ 0.45)")
    print(f"training: {summary['step']} steps, {summary['train_tokens']} response tokens in {summary['elapsed_s']:.0f} s, "
          f"{summary['tokens_per_s']} tokens/s; peak memory {row['peak_memory_gib']} GiB; c ≈ {c:.3f}")
    with open(Path(args.root) / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
