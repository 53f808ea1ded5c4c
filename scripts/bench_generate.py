"""Generate-stage throughput vs a plain one-prompt-at-a-time `model.generate` loop, in one run.

    .venv/bin/python scripts/bench_generate.py                                   # 64 stdlib prompts x 128 tokens, batch 16
    .venv/bin/python scripts/bench_generate.py --prompts 16 --max-new-tokens 32  # CPU-sized check
    .venv/bin/python scripts/bench_generate.py --threads 1   # on a busy shared CPU: 2 threads stall each other
    .venv/bin/python scripts/bench_generate.py --bf16 --batch-size 32   # + the stage under bf16 autocast
    .venv/bin/python scripts/bench_generate.py --bf16 --no-loop --prompts 128 --batch-size 32   # fp32 vs bf16 only

Both sides decode greedily the same prompt ids with the embedded default target (SmolLM2-135M-Instruct,
fp32 on CPU) and stop at EOS or max-new-tokens. The stage side is `distill.generate.run` (length-sorted,
left-padded batches, shards written; model loading excluded from its time); the baseline is
`model.generate(do_sample=False)` for each prompt alone. Prints tokens/s of both, their ratio, how many
of the answers are token-identical, and the process's peak resident memory.

--bf16 also runs the stage with generate.mixed_precision=bf16 on the same prompts and prints its speed
against the fp32 stage, how many answers stay token-identical, where they first differ, and how far
the bf16 target's next-token distribution is from fp32's along the fp32 answers: total variation
TV = ½ Σ |p_fp32 − p_bf16| at T = 1, the error that top-k logits stored from a bf16 run carry.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from typing import Any

import torch
from hydra import compose, initialize_config_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from distill.generate import run  # noqa: E402
from distill.records import load_generated  # noqa: E402
from distill.models import load_target  # noqa: E402


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def stage(tmp: str, name: str, overrides: list[str]) -> tuple[Any, dict, list[dict]]:
    """distill.generate.run on the bench prompts -> (its config, its summary, its records in id order)."""
    cfg = compose("generate", overrides=[*overrides, f"runs_root={tmp}", f"run_name={name}"])
    summary = run(cfg)
    return cfg, summary, load_generated(os.path.join(tmp, name)).to_list()


@torch.no_grad()
def bf16_distance(model, records: list[dict]) -> torch.Tensor:
    """TV between the fp32 and bf16-autocast next-token distributions at each response position [N]."""
    tvs = []
    for r in records:
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]], device=model.device)
        span = slice(len(r["prompt_ids"]) - 1, ids.shape[1] - 1)  # the positions that predict the answer
        p = model(input_ids=ids).logits[0, span].float().softmax(-1)
        with torch.autocast(model.device.type, dtype=torch.bfloat16):
            q = model(input_ids=ids).logits[0, span].float().softmax(-1)
        tvs.append(0.5 * (p - q).abs().sum(-1))
    return torch.cat(tvs)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def loop(model, tok, records: list[dict], max_new_tokens: int, stage_tps: float) -> dict:
    """The baseline: model.generate on each prompt alone, greedy; its speed and how many answers match."""
    gen_kw = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    ids = torch.tensor([records[0]["prompt_ids"]])  # warm-up, excluded (the stage's first batch is not)
    model.generate(ids, attention_mask=torch.ones_like(ids), **{**gen_kw, "max_new_tokens": 2})
    tokens, identical, t0 = 0, 0, time.perf_counter()
    for r in records:
        ids = torch.tensor([r["prompt_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw)[0, ids.shape[1]:].tolist()
        tokens += len(out)
        identical += out == r["response_ids"]
    seconds = time.perf_counter() - t0
    return {"loop_tokens": tokens, "loop_s": round(seconds, 3), "loop_tokens_per_s": round(tokens / seconds, 2),
            "speedup": round(stage_tps * seconds / tokens, 2), "greedy_identical": f"{identical}/{len(records)}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--model", default="smollm2", help="a conf/model preset")
    ap.add_argument("--data", default="stdlib", help="a conf/data preset")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 is steadier on a CPU shared with other jobs")
    ap.add_argument("--bf16", action="store_true", help="also run the stage under bf16 autocast and compare")
    ap.add_argument("--no-loop", action="store_true", help="skip the one-at-a-time model.generate baseline")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(os.path.join(ROOT, "conf"), version_base="1.3"):
        common = [
            f"model={args.model}", f"data={args.data}", f"data.limit={args.prompts}", "logger=none",
            "generate.temperature=0", f"generate.max_new_tokens={args.max_new_tokens}",
            f"generate.batch_size={args.batch_size}", f"generate.shard_size={args.batch_size * 4}",
        ]
        cfg, summary, records = stage(tmp, "bench", common)
        mem_stage = peak_mib()
        if args.bf16:
            _, summary_bf16, records_bf16 = stage(tmp, "bench-bf16", [*common, "generate.mixed_precision=bf16"])

    model, tok = load_target(cfg.model)
    result = {
        "target": cfg.model.target, "prompts": len(records), "skipped": summary["skipped"],
        "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "torch_threads": torch.get_num_threads(),
        "stage_tokens": summary["new_tokens"], "stage_s": summary["seconds"], "stage_tokens_per_s": summary["tokens_per_s"],
        "peak_rss_mib_after_stage": round(mem_stage),
    }
    if not args.no_loop:
        result.update(loop(model, tok, records, args.max_new_tokens, summary["tokens_per_s"]))
    result["peak_rss_mib"] = round(peak_mib())
    if args.bf16:
        tv = bf16_distance(model, records)
        same = [a["response_ids"] == b["response_ids"] for a, b in zip(records, records_bf16)]
        result["bf16"] = {
            "stage_tokens": summary_bf16["new_tokens"], "stage_s": summary_bf16["seconds"],
            "stage_tokens_per_s": summary_bf16["tokens_per_s"],
            "speedup_over_fp32_stage": round(summary_bf16["tokens_per_s"] / summary["tokens_per_s"], 2),
            "greedy_identical": f"{sum(same)}/{len(same)}",
            "mean_first_difference": round(sum(first_difference(a["response_ids"], b["response_ids"])
                                               for a, b in zip(records, records_bf16)) / len(records), 1),
            "tv_mean": round(tv.mean().item(), 4), "tv_p95": round(tv.quantile(0.95).item(), 4),
            "positions": tv.numel(),
        }
    print(json.dumps(result, indent=2))
    if not args.no_loop:
        print(f"generate stage {result['stage_tokens_per_s']:.1f} tok/s vs one-at-a-time model.generate "
              f"{result['loop_tokens_per_s']:.1f} tok/s = {result['speedup']:.2f}x at batch {args.batch_size}; "
              f"greedy identical {result['greedy_identical']}; peak RSS {result['peak_rss_mib']} MiB")
    if args.bf16:
        b = result["bf16"]
        print(f"bf16 autocast stage {b['stage_tokens_per_s']:.1f} tok/s = {b['speedup_over_fp32_stage']:.2f}x the fp32 "
              f"stage; greedy identical {b['greedy_identical']} (first difference at token {b['mean_first_difference']} "
              f"on average); TV(p_fp32, p_bf16) mean {b['tv_mean']:.4f}, p95 {b['tv_p95']:.4f} over {b['positions']} positions")


if __name__ == "__main__":
    main()
