"""Generate-stage throughput vs a plain one-prompt-at-a-time `model.generate` loop, in one run.

    .venv/bin/python scripts/bench_generate.py                                   # 64 stdlib prompts x 128 tokens, batch 16
    .venv/bin/python scripts/bench_generate.py --prompts 16 --max-new-tokens 32  # CPU-sized check
    .venv/bin/python scripts/bench_generate.py --threads 1   # on a busy shared CPU: 2 threads stall each other

Both sides decode greedily the same prompt ids with the embedded default target (SmolLM2-135M-Instruct,
fp32 on CPU) and stop at EOS or max-new-tokens. The stage side is `distill.generate.run` (length-sorted,
left-padded batches, shards written; model loading excluded from its time); the baseline is
`model.generate(do_sample=False)` for each prompt alone. Prints tokens/s of both, their ratio, how many
of the answers are token-identical, and the process's peak resident memory.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import torch
from hydra import compose, initialize_config_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from distill.generate import load_generated, run  # noqa: E402
from distill.models import load_target  # noqa: E402


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--model", default="smollm2", help="a conf/model preset")
    ap.add_argument("--data", default="stdlib", help="a conf/data preset")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 is steadier on a CPU shared with other jobs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose("generate", overrides=[
            f"model={args.model}", f"data={args.data}", f"data.limit={args.prompts}", f"runs_root={tmp}",
            "run_name=bench", "logger=none", "generate.temperature=0", f"generate.max_new_tokens={args.max_new_tokens}",
            f"generate.batch_size={args.batch_size}", f"generate.shard_size={args.batch_size * 4}",
        ])
        summary = run(cfg)
        records = load_generated(os.path.join(tmp, "bench")).to_list()
        mem_stage = peak_mib()

    model, tok = load_target(cfg.model)
    gen_kw = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
    with torch.no_grad():  # warm-up (excluded), as the stage's first batch is not excluded: conservative
        ids = torch.tensor([records[0]["prompt_ids"]])
        model.generate(ids, attention_mask=torch.ones_like(ids), **{**gen_kw, "max_new_tokens": 2})
    base_tokens, identical, t0 = 0, 0, time.perf_counter()
    with torch.no_grad():
        for r in records:
            ids = torch.tensor([r["prompt_ids"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw)[0, ids.shape[1]:].tolist()
            base_tokens += len(out)
            identical += out == r["response_ids"]
    base_s = time.perf_counter() - t0
    base_tps = base_tokens / base_s
    result = {
        "target": cfg.model.target, "prompts": len(records), "skipped": summary["skipped"],
        "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "torch_threads": torch.get_num_threads(),
        "stage_tokens": summary["new_tokens"], "stage_s": summary["seconds"], "stage_tokens_per_s": summary["tokens_per_s"],
        "loop_tokens": base_tokens, "loop_s": round(base_s, 3), "loop_tokens_per_s": round(base_tps, 2),
        "speedup": round(summary["tokens_per_s"] / base_tps, 2), "greedy_identical": f"{identical}/{len(records)}",
        "peak_rss_mib_after_stage": round(mem_stage), "peak_rss_mib": round(peak_mib()),
    }
    print(json.dumps(result, indent=2))
    print(f"generate stage {result['stage_tokens_per_s']:.1f} tok/s vs one-at-a-time model.generate "
          f"{result['loop_tokens_per_s']:.1f} tok/s = {result['speedup']:.2f}x at batch {args.batch_size}; "
          f"greedy identical {result['greedy_identical']}; peak RSS {result['peak_rss_mib']} MiB")


if __name__ == "__main__":
    main()
