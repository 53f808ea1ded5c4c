"""Peak memory of one distillation step over a 262,144-token vocabulary (Gemma 3's size), per loss.chunk_size.

    .venv/bin/python scripts/bench_vocab_memory.py                          # chunk sizes 64 .. 1024 and unchunked
    .venv/bin/python scripts/bench_vocab_memory.py --chunks 256,512 --positions 1024 --hidden 640

Each setting runs in a fresh process (peak RSS is per process): a tiny random Llama draft and target
(2 layers, hidden 64 by default, tied 262,144-row embeddings), a batch of --batch rows of --seq tokens
whose last --positions tokens in all are response positions, and one training step of distill.distill's
DraftLoss (forward KL against the target's hidden states projected chunk by chunk, as train.teacher=online
does; embeddings and head frozen as with student.freeze_embeddings=true), backward and an AdamW step.
Prints, per chunk size, the RSS before the step, the process's peak RSS after it, and their difference:
the memory the step itself needed (dominated by [chunk_size, V] float32 blocks: 1 MiB per row).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

VOCAB = 262_144


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one(chunk: int, args: argparse.Namespace) -> dict:
    """One training step at this chunk size, in this process -> the memory numbers (MiB)."""
    import torch
    from omegaconf import OmegaConf

    from distill.losses import HiddenTeacher
    from specdec.tiny import tiny_model
    from distill.distill import DraftLoss

    torch.set_num_threads(args.threads)
    kw = dict(vocab_size=VOCAB, hidden=args.hidden, num_layers=2, initializer_range=0.02)
    target, draft = tiny_model(seed=0, **kw), tiny_model(seed=1, **kw).train()
    for emb in (draft.get_input_embeddings(), draft.get_output_embeddings()):
        emb.weight.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids)
    positions = torch.zeros_like(ids, dtype=torch.bool)
    per_row = args.positions // args.batch
    positions[:, args.seq - per_row - 1 : args.seq - 1] = True  # the response: each position predicts the next token
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    loss_cfg = OmegaConf.create({"name": "fkl", "beta": 0.5, "temperature": 1.0, "ce_weight": 0.0,
                                 "prompt_ce_weight": 0.0, "chunk_size": chunk})
    student = DraftLoss(draft, loss_cfg, VOCAB)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    teacher = HiddenTeacher(hidden[positions], target.get_output_embeddings())
    before = _rss_mib()
    total, n = student(ids, mask, positions, labels, teacher)
    (total / n).backward()
    opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"chunk_size": chunk, "positions": int(n), "rss_before_mib": round(before), "peak_rss_mib": round(peak),
            "step_mib": round(peak - before), "loss": round(float(total / n), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="64,128,256,512,1024,0", help="loss.chunk_size values; 0 = one chunk (unchunked)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--positions", type=int, default=1024, help="response positions in the batch")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # internal: one setting, JSON out
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one or args.positions, args)))
        return
    print(f"vocabulary {VOCAB}, batch {args.batch} x {args.seq} tokens, {args.positions} response positions, "
          f"hidden {args.hidden}, fkl, online teacher")
    print(f"{'chunk_size':>10} {'RSS before':>11} {'peak RSS':>9} {'step needs':>11}")
    base = [sys.executable, os.path.abspath(__file__), "--batch", str(args.batch), "--seq", str(args.seq),
            "--positions", str(args.positions), "--hidden", str(args.hidden), "--threads", str(args.threads)]
    for c in [int(x) for x in args.chunks.split(",")]:
        out = subprocess.run([*base, "--one", str(c)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        label = f"{r['chunk_size']}" + (" (all)" if c == 0 else "")
        print(f"{label:>10} {r['rss_before_mib']:>8} MiB {r['peak_rss_mib']:>5} MiB {r['step_mib']:>7} MiB", flush=True)


if __name__ == "__main__":
    main()
