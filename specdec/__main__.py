"""Speculative decoding from the command line.

    python -m specdec --target HuggingFaceTB/SmolLM2-360M-Instruct --draft HuggingFaceTB/SmolLM2-135M-Instruct \\
        --prompt "Write a haiku about caches." --gamma 4 --max-new-tokens 128
    python -m specdec --target DIR --prompt-lookup --prompt "..." --temperature 0.7 --top-p 0.9
    python -m specdec --target DIR --draft DIR --prompt "..." --baseline   # also time the target alone

stdout: the generated text, a line "--- metrics", then a short summary (target and draft, γ, tokens,
α, τ, tokens/s; with --baseline the speedup and whether greedy output equals the target's), or with
--json every setting, counter and metric as JSON. A bad argument or input is one line on stderr, exit 2.

Model arguments take a local directory or a hub id (from_pretrained). The target's chat template,
if it has one, wraps the prompt (--raw to send the text as is). A draft that ships a draft_vocab.json
(a published distilled draft does) decodes with its LM head cut to those tokens (--draft-vocab none:
the whole vocabulary; --draft-vocab FILE: another list).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch

from .decoder import SpeculativeDecoder, autoregressive_generate
from .drafters import DRAFT_VOCAB_FILE, ModelDrafter, PromptLookupDrafter, load_draft_vocab
from .hub import ModelSourceError, endpoint, offline, pretrained, unreachable
from .kv import logits_width


EXAMPLES = """examples:
  python -m specdec --target DIR --draft DIR --prompt "Write a haiku about caches." --gamma 4 --baseline
  python -m specdec --target DIR --prompt-lookup --prompt "..." --temperature 0.7 --top-p 0.9
  python -m specdec --target DIR --draft DIR --prompt "..." --baseline --json   # every counter and metric

--target and --draft take a local directory or a hub id; the draft must use the target's tokenizer.
Output: the text, a line "--- metrics", then the summary (or with --json all metrics as JSON)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints its whole usage; one line names the problem
        print(f"error: {message}; see python -m specdec --help", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m specdec", description="Lossless speculative decoding of one prompt.",
                 epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model: local dir or hub id")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--draft", help="draft model (same tokenizer as the target): local dir or hub id")
    src.add_argument("--prompt-lookup", action="store_true", help="draft by n-gram lookup in the context, no model")
    ap.add_argument("--draft-vocab", default="auto",
                    help="auto (the draft's draft_vocab.json if it has one) | none | path to a draft_vocab.json")
    ap.add_argument("--prompt", required=True, help="the user message")
    ap.add_argument("--raw", action="store_true", help="do not apply the chat template")
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    ap.add_argument("--gamma-policy", choices=["constant", "adaptive"], default="constant")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-ngram", type=int, default=3, help="prompt lookup: longest n-gram to match")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--baseline", action="store_true", help="also decode with the target alone; report speedup")
    ap.add_argument("--json", action="store_true", help="print every setting, counter and metric as JSON")
    return ap


def _num(x: float | None, digits: int) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def summary(report: dict, args: argparse.Namespace) -> str:
    """The result in a few lines: what decoded with what, then α, τ, tokens/s and (with --baseline) speedup."""
    if args.prompt_lookup:
        draft = f"prompt lookup (n-grams of up to {args.max_ngram} tokens)"
    else:
        vocab = report.get("draft_vocab")
        draft = args.draft + (f", draft vocabulary of {vocab} tokens" if vocab else "")
    sampling = ("greedy" if args.temperature == 0 else
                f"sampled at temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k}, seed {args.seed}")
    alpha = report.get("acceptance_rate")
    lines = [
        ("target", args.target),
        ("draft", draft),
        ("decoding", f"{sampling}; γ = {report['gamma']} ({report['gamma_policy']})"),
        ("tokens", f"{report['emitted']} new in {report['wall_time_s']:.2f} s = {_num(report['tokens_per_s'], 1)} "
                   f"tokens/s ({report['target_calls']} target calls)"),
        ("α", f"{_num(alpha, 3)} (accepted ÷ tried draft tokens)" if alpha is not None
              else "n/a (no draft token was tried)"),
        ("τ", f"{_num(report.get('tokens_per_target_call'), 2)} tokens per target call"),
    ]
    if "speedup" in report:
        lines.append(("speedup", f"{report['speedup']:.2f}× over the target alone "
                                 f"({_num(report.get('baseline_tokens_per_s'), 1)} tokens/s)"))
    else:
        modeled = report.get("predicted_speedup")
        lines.append(("speedup", "not measured (--baseline times the target alone)"
                      + (f"; predicted from α, γ and c: {modeled:.2f}×" if modeled is not None else "")))
    if "greedy_identical" in report:
        lines.append(("identical", "yes: the same tokens as the target alone" if report["greedy_identical"]
                      else "NO: the output differs from the target alone's"))
    return "\n".join(f"{k:<10} {v}" for k, v in lines) + "\nevery metric: --json"


def _load(name: str, device: str, dtype: torch.dtype, what: str):
    import transformers
    from transformers import AutoModelForCausalLM

    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return pretrained(AutoModelForCausalLM.from_pretrained, name, what, **{key: dtype}).to(device).eval()


def _tokenizer(name: str, what: str):
    from transformers import AutoTokenizer

    return pretrained(AutoTokenizer.from_pretrained, name, what)


def _draft_vocab(draft: str, choice: str):
    """Token ids for the draft's LM head: from a file, the draft's own draft_vocab.json, or None."""
    if choice == "none":
        return None
    if choice != "auto":
        ids = load_draft_vocab(choice)
        if ids is None:
            raise ValueError(f"--draft-vocab {choice}: no such file (give a {DRAFT_VOCAB_FILE}, auto or none)")
        return ids
    if Path(draft).is_dir():
        return load_draft_vocab(draft)
    try:  # a hub draft: its draft_vocab.json, if it ships one
        from huggingface_hub import hf_hub_download

        cache_only = offline() or unreachable(endpoint()) is not None  # no minute of retries when offline
        return load_draft_vocab(hf_hub_download(draft, DRAFT_VOCAB_FILE, local_files_only=cache_only))
    except Exception:  # no such file (or offline): the whole vocabulary
        return None


def _same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    default_dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype
    try:
        tok = _tokenizer(args.target, "--target")
        target = _load(args.target, args.device, dtype, "--target")
        dtok = None if args.prompt_lookup else _tokenizer(args.draft, "--draft")
    except ModelSourceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    vocab_size, draft_ids = None, None
    if args.prompt_lookup:
        drafter = PromptLookupDrafter(max_ngram=args.max_ngram)
    else:
        if not _same_tokenizer(tok, dtok):
            print(f"error: {args.draft} does not use the tokenizer of {args.target}; speculative decoding needs "
                  "the same tokenizer (pick a draft from the same model family)", file=sys.stderr)
            return 2
        try:
            draft = _load(args.draft, args.device, dtype, "--draft")
        except ModelSourceError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        try:
            draft_ids = _draft_vocab(args.draft, args.draft_vocab)
            drafter = ModelDrafter(draft, vocab=draft_ids)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if logits_width(draft) != logits_width(target):
            vocab_size = len(tok)  # padded embedding rows differ; compare real tokens only
    if tok.chat_template and not args.raw:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tok(args.prompt)["input_ids"]
    models = [("target", target)] + ([] if args.prompt_lookup else [("draft", draft)])
    contexts = {n: getattr(m.config, "max_position_embeddings", None) for n, m in models}
    context = min((c for c in contexts.values() if c), default=None)
    if context and len(ids) + args.max_new_tokens > context:
        who = " and ".join(f"the {n}'s {c}" for n, c in contexts.items() if c)
        fix = (f"lower --max-new-tokens to {context - len(ids)} or shorten the prompt" if len(ids) < context
               else "shorten the prompt")
        print(f"error: the prompt has {len(ids)} tokens and --max-new-tokens is {args.max_new_tokens}: "
              f"{len(ids) + args.max_new_tokens} positions, more than the context of {context} "
              f"(max_position_embeddings: {who}); {fix}", file=sys.stderr)
        return 2
    eos = [t for t in {tok.eos_token_id, getattr(target.generation_config, "eos_token_id", None)} if t is not None]
    eos = sorted({x for t in eos for x in (t if isinstance(t, list) else [t])})
    try:
        dec = SpeculativeDecoder(target, drafter, gamma=args.gamma, gamma_policy=args.gamma_policy,
                                 eos_token_id=eos, vocab_size=vocab_size)
        sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed)
        out = dec.generate([ids], **sampling)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(tok.decode(out.tokens[0], skip_special_tokens=True))
    report = out.metrics.to_dict()
    if args.baseline:
        base = autoregressive_generate(target, [ids], eos_token_id=eos, vocab_size=vocab_size, **sampling)
        out.metrics.baseline_target_step_s = base.metrics.target_step_s
        report = out.metrics.to_dict()
        report["speedup"] = base.metrics.wall_time_s / out.metrics.wall_time_s
        report["baseline_tokens_per_s"] = base.metrics.tokens_per_s
        if args.temperature == 0:
            report["greedy_identical"] = base.tokens == out.tokens
    report["draft_vocab"] = None if draft_ids is None else len(draft_ids)
    print("--- metrics")
    print(json.dumps(report, indent=2) if args.json else summary(report, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
