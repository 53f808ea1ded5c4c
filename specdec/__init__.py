"""specdec: a lossless speculative decoder with KV caches for both models, usable on its own.

    from specdec import SpeculativeDecoder, ModelDrafter, PromptLookupDrafter, autoregressive_generate
    out = SpeculativeDecoder(target, ModelDrafter(draft), gamma=4).generate(prompts, max_new_tokens=64)
    out = SpeculativeDecoder(target, HeadDrafter(load_head("head_dir", target)), gamma=4).generate(prompts)
    out.tokens, out.finish_reasons, out.metrics.to_dict()

CLI: ``python -m specdec --target DIR --draft DIR --prompt "..."`` (see specdec/__main__.py).
"""
from .decoder import DecodeResult, GammaPolicy, SpeculativeDecoder, autoregressive_generate, left_pad
from .drafters import Drafter, ModelDrafter, PromptLookupDrafter
from .head_drafter import HeadDrafter, head_replay_proposals
from .heads import FeatureHead, load_head
from .metrics import SpecMetrics, expected_tokens_per_call, predicted_speedup, teacher_forced_acceptance
from .sampling import (
    SamplingParams,
    acceptance_probs,
    greedy_verify,
    logits_to_probs,
    next_token_probs,
    rejection_sample,
    residual_probs,
    sample,
)

__all__ = [
    "DecodeResult", "Drafter", "FeatureHead", "GammaPolicy", "HeadDrafter", "ModelDrafter", "PromptLookupDrafter", "SamplingParams",
    "SpecMetrics", "SpeculativeDecoder", "acceptance_probs", "autoregressive_generate",
    "expected_tokens_per_call", "greedy_verify", "head_replay_proposals", "left_pad", "load_head", "logits_to_probs", "next_token_probs",
    "predicted_speedup", "rejection_sample", "residual_probs", "sample", "teacher_forced_acceptance",
]
