"""Speculative decoding from the command line.

    python -m specdec --target HuggingFaceTB/SmolLM2-360M-Instruct --draft HuggingFaceTB/SmolLM2-135M-Instruct \\
        --prompt "Write a haiku about caches." --gamma 4 --max-new-tokens 128
    python -m specdec --target DIR --prompt-lookup --prompt "..." --temperature 0.7 --top-p 0.9
    python -m specdec --target DIR --draft DIR --prompt "..." --baseline   # also time the target alone

stdout: the generated text, a line "--- metrics", then the metrics as JSON.

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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding of one prompt.")
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
    return ap


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
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
