"""Speculative decoder benchmark: one table, every method measured side by side in one run.

    python scripts/bench_decoder.py                                   # embedded SmolLM2-135M, CPU-sized
    python scripts/bench_decoder.py --prompts 20 --max-new-tokens 128 --repeats 3 --device cuda
    python scripts/bench_decoder.py --target runs/r/target --draft runs/r/distill/best --gamma 4
    python scripts/bench_decoder.py --draft-layers 0,1,28,29 --temperatures 0 --batch 0 --json out.json
    python scripts/bench_decoder.py --draft runs/default/distill/best --draft-vocab 8192,16384 --vocab-from runs/default
    python scripts/bench_decoder.py --draft runs/default/distill/best --gamma 1 --ignore-eos   # equal work at T > 0

Rows (batch 1 unless said): the target alone (specdec's KV-cached loop, the speedup baseline), the
target alone through Hugging Face generate(), this decoder with the draft, Hugging Face assisted
generation with the same draft and the same constant γ, this decoder with the draft's LM head cut
to a draft vocabulary (--draft-vocab: the N tokens the target's generated answers use most, from
--vocab-from; or the draft dir's draft_vocab.json), this decoder with prompt lookup, Hugging
Face prompt lookup (prompt_lookup_num_tokens=γ, max_matching_ngram_size=3), and a batch-N row
(speculative throughput ÷ target-alone throughput, both at batch N). A batch runs until its slowest
row is done, so the batch rows also print occupancy: rows still decoding per target call ÷ N.

Protocol: prompts alternate MT-Bench / HumanEval, taken from the held-out ones (--held-out); every
method is warmed up on one prompt (untimed), then each repeat runs every method over all prompts in
turn (interleaved, so drift on a shared machine hits all alike); wall times are the median over
repeats. speedup = target-alone wall ÷ method wall (sampled outputs may stop at different lengths;
--ignore-eos makes every method write exactly --max-new-tokens per prompt). c = draft step ÷ target
step, the latter from the target-alone run. greedy_identical: every prompt's tokens equal the
target-alone greedy tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distill.config import DataConfig, ModelConfig  # noqa: E402
from distill.data import encode_prompt, load_prompts  # noqa: E402
from specdec.metrics import SpecMetrics  # noqa: E402
from distill.models import draft_from_target, load_model, load_target, shared_vocab_size  # noqa: E402
from specdec.drafters import frequent_tokens, load_draft_vocab  # noqa: E402
from specdec import (  # noqa: E402
    ModelDrafter,
    PromptLookupDrafter,
    SpeculativeDecoder,
    autoregressive_generate,
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct", help="embedded name, local dir or hub id")
    ap.add_argument("--draft", default=None, help="draft dir / hub id (default: --draft-layers of the target)")
    ap.add_argument("--draft-layers", default="0,29", help="target layers kept in the default draft")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--draft-vocab", default="", help="comma-separated sizes N: also run specdec with the draft's "
                    "head cut to N tokens ('file': the draft dir's draft_vocab.json)")
    ap.add_argument("--vocab-from", default=None, help="run dir whose generated answers rank the tokens")
    ap.add_argument("--prompts", type=int, default=6, help="half MT-Bench, half HumanEval")
    ap.add_argument("--held-out", type=int, default=48, help="prompts come from the first N of each set after a "
                    "seed-0 shuffle: the prompts a main-job draft (data.in_domain) was not trained on")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    ap.add_argument("--batch", type=int, default=8, help="batch size of the throughput row (0 = skip)")
    ap.add_argument("--ignore-eos", action="store_true", help="every method writes exactly --max-new-tokens per "
                    "prompt (no stop token), so wall times compare equal work even where sampled outputs differ")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face rows")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the rows here")
    return ap.parse_args(argv)


def load(args):
    cfg = ModelConfig(target=args.target, dtype=args.dtype, device=args.device)
    target, tok = load_target(cfg)
    if args.draft:
        draft = load_model(args.draft, args.dtype, args.device)
        name = args.draft
    else:
        layers = [int(x) for x in args.draft_layers.split(",")]
        draft = draft_from_target(target, layers)
        name = f"target layers {layers}"
    return target, draft, tok, name


def draft_vocabs(args, vocab: int, tok=None) -> dict[str, torch.Tensor]:
    """Row name -> draft vocabulary ids, for each size in --draft-vocab."""
    out = {}
    answers = None
    for size in filter(None, args.draft_vocab.split(",")):
        if size == "file":
            ids = load_draft_vocab(args.draft) if args.draft else None
            if ids is None:
                sys.exit(f"--draft-vocab file: {args.draft} holds no draft_vocab.json")
        else:
            if answers is None:
                if not args.vocab_from:
                    sys.exit("--draft-vocab N needs --vocab-from RUN_DIR (its generated answers rank the tokens)")
                from distill.records import load_generated
                answers = load_generated(args.vocab_from)["response_ids"]
            ids = frequent_tokens(answers, int(size), vocab, tok)  # as the pipeline ranks them
        out[f"specdec vocab {len(ids)}"] = ids
    return out


def bench_prompts(tok, n: int, held_out: int = 48) -> list[list[int]]:
    """n prompts alternating MT-Bench / HumanEval, from each set's held-out prompts: the first `held_out`
    after a seed-0 shuffle, which the main job (data.in_domain) and bench_distill.py never train on."""
    if (n + 1) // 2 > held_out:
        sys.exit(f"--prompts {n} needs {(n + 1) // 2} prompts per set, more than --held-out {held_out}")
    sets = [load_prompts(DataConfig(source=s, shuffle=True, seed=0, limit=held_out))
            for s in ("mt_bench", "humaneval")]
    ids = []
    for i in range(n):
        ds = sets[i % 2]
        ids.append(encode_prompt(tok, ds[i // 2]["messages"]))
    return ids


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class CallCounter:
    """Counts forward calls of a module (the target's, inside Hugging Face assisted generation)."""

    def __init__(self, module):
        self.calls = 0
        module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def run_methods(methods: dict, prompts: list[list[int]], repeats: int, device) -> dict:
    """methods: name -> fn(prompt_ids) -> (tokens, metrics|None). Returns name -> timings and outputs."""
    out = {name: {"walls": [], "tokens": None, "metrics": []} for name in methods}
    for fn in methods.values():  # warm-up, untimed
        fn(prompts[0][:32])
    for _ in range(repeats):
        for name, fn in methods.items():
            toks, mets, wall = [], [], 0.0
            for p in prompts:
                _sync(device)
                t0 = time.perf_counter()
                t, m = fn(p)
                _sync(device)
                wall += time.perf_counter() - t0
                toks.append(t)
                mets.append(m)
            out[name]["walls"].append(wall)
            print(f"  {name}: {sum(len(t) for t in toks)} tokens in {wall:.1f} s", file=sys.stderr, flush=True)
            out[name]["tokens"], out[name]["metrics"] = toks, mets
    return out


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else (str(x) if isinstance(x, (bool, str)) else format(x, spec))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, tok, draft_name = load(args)
    device = next(target.parameters()).device
    vocab = shared_vocab_size(tok, target, draft)
    eos = [] if args.ignore_eos else [tok.eos_token_id]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = bench_prompts(tok, args.prompts, args.held_out)
    g = args.gamma
    spec = SpeculativeDecoder(target, ModelDrafter(draft), gamma=g, eos_token_id=eos, pad_token_id=pad,
                              vocab_size=vocab)
    lookup = SpeculativeDecoder(target, PromptLookupDrafter(), gamma=g, eos_token_id=eos, pad_token_id=pad,
                                vocab_size=vocab)
    draft.generation_config.num_assistant_tokens = g
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # constant γ: never cut a block short
    subset = {name: SpeculativeDecoder(target, ModelDrafter(draft, vocab=ids), gamma=g, eos_token_id=eos,
                                       pad_token_id=pad, vocab_size=vocab)
              for name, ids in draft_vocabs(args, vocab, tok).items()}
    counter = CallCounter(target)
    print(f"target {args.target} | draft {draft_name} | γ={g} | {len(prompts)} prompts × {args.max_new_tokens} "
          f"tokens{' (EOS ignored)' if args.ignore_eos else ''} | {device} {target.dtype} | "
          f"threads {torch.get_num_threads()} | repeats {args.repeats}")

    rows = []
    for temp in [float(t) for t in args.temperatures.split(",")]:
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=temp, seed=args.seed)
        hf_kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=eos or None, pad_token_id=pad,
                     do_sample=temp > 0, temperature=temp if temp > 0 else None, top_k=0 if temp > 0 else None,
                     top_p=1.0 if temp > 0 else None)

        def hf(p, **extra):
            x = torch.tensor([p], device=device)
            counter.calls = 0
            out = target.generate(input_ids=x, attention_mask=torch.ones_like(x), **extra, **hf_kw)
            new = out[0, x.shape[1]:].tolist()
            cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
            return new[:cut], {"target_calls": counter.calls}

        methods = {
            "target alone": lambda p: (lambda r: (r.tokens[0], r.metrics))(
                autoregressive_generate(target, [p], eos_token_id=eos, pad_token_id=pad, vocab_size=vocab, **kw)),
            "specdec": lambda p: (lambda r: (r.tokens[0], r.metrics))(spec.generate([p], **kw)),
            "prompt lookup": lambda p: (lambda r: (r.tokens[0], r.metrics))(lookup.generate([p], **kw)),
        }
        for name, dec in subset.items():
            methods[name] = lambda p, dec=dec: (lambda r: (r.tokens[0], r.metrics))(dec.generate([p], **kw))
        if not args.no_hf:
            methods["HF generate (target alone)"] = lambda p: hf(p)
            methods["HF assisted"] = lambda p: hf(p, assistant_model=draft)
            methods["HF prompt lookup"] = lambda p: hf(p, prompt_lookup_num_tokens=g, max_matching_ngram_size=3)
        res = run_methods(methods, prompts, args.repeats, device)
        base = res["target alone"]
        base_wall = statistics.median(base["walls"])
        base_m = SpecMetrics.merge(base["metrics"], 1)
        for name, r in res.items():
            wall = statistics.median(r["walls"])
            n_tok = sum(len(t) for t in r["tokens"])
            row = {"method": name, "temperature": temp, "batch_size": 1, "gamma": g if name != "target alone" else None,
                   "tokens_per_s": n_tok / wall, "speedup": base_wall / wall, "wall_s": wall, "tokens": n_tok,
                   "acceptance_rate": None, "tokens_per_target_call": None, "cost_ratio": None,
                   "predicted_speedup": None, "greedy_identical": None}
            if isinstance(r["metrics"][0], dict):  # Hugging Face rows: τ from the counted target calls
                calls = sum(m["target_calls"] for m in r["metrics"])
                if name != "HF generate (target alone)" and calls:
                    row["tokens_per_target_call"] = n_tok / calls
            elif name != "target alone":
                m = SpecMetrics.merge(r["metrics"], 1)
                m.baseline_target_step_s = base_m.target_step_s
                row.update(acceptance_rate=m.acceptance_rate, tokens_per_target_call=m.tokens_per_target_call,
                           cost_ratio=m.cost_ratio, predicted_speedup=m.predicted_speedup,
                           draft_acceptance_ratio=m.draft_acceptance_ratio,
                           verify_cost=m.target_time_s / m.target_calls / base_m.target_step_s)
            if temp == 0:
                row["greedy_identical"] = r["tokens"] == base["tokens"]
            rows.append(row)
        if "HF assisted" in res:
            tps = {r["method"]: r["tokens_per_s"] for r in rows if r["temperature"] == temp}
            sub = "".join(f", {n} ÷ HF assisted = {tps[n] / tps['HF assisted']:.2f}" for n in subset)
            print(f"T={temp:g}: tokens/s ratios: specdec ÷ HF assisted = {tps['specdec'] / tps['HF assisted']:.2f}{sub}, "
                  f"prompt lookup ÷ HF prompt lookup = {tps['prompt lookup'] / tps['HF prompt lookup']:.2f}",
                  flush=True)

    if args.batch > 0:
        bp = [prompts[i % len(prompts)] for i in range(args.batch)]
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, seed=args.seed)
        batch_methods = {
            "target alone": lambda ps: autoregressive_generate(target, ps, eos_token_id=eos, pad_token_id=pad,
                                                               vocab_size=vocab, **kw),
        }
        for name, dec in {"specdec": spec, **subset}.items():
            batch_methods[name] = lambda ps, dec=dec: dec.generate(ps, **kw)
        walls = {n: [] for n in batch_methods}
        outs = {}
        for fn in batch_methods.values():
            fn([p[:32] for p in bp[:2]])  # warm-up
        for _ in range(args.repeats):
            for name, fn in batch_methods.items():
                _sync(device)
                t0 = time.perf_counter()
                outs[name] = fn(bp)
                _sync(device)
                walls[name].append(time.perf_counter() - t0)
        tput = {n: outs[n].metrics.emitted / statistics.median(w) for n, w in walls.items()}
        # rows still decoding per target call ÷ batch: a batch runs until its slowest row is done
        occ = {n: o.metrics.row_rounds / (o.metrics.target_calls * args.batch) for n, o in outs.items()}
        for name in list(batch_methods)[1:]:
            m = outs[name].metrics
            m.baseline_target_step_s = outs["target alone"].metrics.target_step_s
            rows.append({"method": f"{name} batch {args.batch}", "temperature": 0.0, "batch_size": args.batch,
                         "gamma": g, "tokens_per_s": tput[name], "speedup": tput[name] / tput["target alone"],
                         "acceptance_rate": m.acceptance_rate, "tokens_per_target_call": m.tokens_per_target_call,
                         "cost_ratio": m.cost_ratio, "predicted_speedup": m.predicted_speedup,
                         "greedy_identical": outs[name].tokens == outs["target alone"].tokens,
                         "target_alone_tokens_per_s": tput["target alone"],
                         "occupancy": occ[name], "target_alone_occupancy": occ["target alone"],
                         "verify_cost": m.target_time_s / m.target_calls / m.baseline_target_step_s})

    # verify÷step: one verify call (γ+1 tokens) ÷ one target-alone step; predicted_speedup assumes 1
    cols = ["method", "T", "batch", "tokens/s", "α", "τ", "c", "speedup", "predicted_speedup", "greedy_identical",
            "verify÷step"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        vals = [r["method"], fmt(r["temperature"], "g"), str(r["batch_size"]), fmt(r["tokens_per_s"], ".1f"),
                fmt(r["acceptance_rate"]), fmt(r["tokens_per_target_call"]), fmt(r["cost_ratio"], ".3f"),
                fmt(r["speedup"]), fmt(r["predicted_speedup"]), fmt(r["greedy_identical"]), fmt(r.get("verify_cost"))]
        print("| " + " | ".join(vals) + " |")
    for r in rows:
        if "occupancy" in r:
            print(f"{r['method']}: rows active per target call ÷ {args.batch} = {r['occupancy']:.2f} "
                  f"(target alone {r['target_alone_occupancy']:.2f}); predicted_speedup × that ratio = "
                  f"{r['predicted_speedup'] * r['occupancy'] / r['target_alone_occupancy']:.2f}, measured "
                  f"{r['speedup']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
