"""The hf engine on CPU under bf16 autocast: a decode step (one query token) runs torch's fp32 attention kernel on the
bf16-rounded inputs, every other call is transformers' own SDPA attention, bit for bit; each frozen weight is cast
to bf16 once per batch instead of at every step, with the same samples."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bench.hf_decode import gap_to_float64
from conftest import REPO
from refiner_core.learners.base import TrainSample
from refiner_core.learners.batching import collate
from refiner_core.learners.logprobs import token_logprobs
from refiner_core.models import load_model
from refiner_core.rollout.base import SamplingParams
from refiner_core.rollout.hf_engine import (
    CPU_DECODE_ATTENTION,
    HFRolloutEngine,
    _sdpa_cpu_decode_fp32,
    cached_weight_casts,
)


class _Attention(torch.nn.Module):
    num_key_value_groups = 2  # 4 query heads over 2 key/value heads, like the tiny Qwen3
    is_causal = True


def _inputs(query_tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 4, query_tokens, 32, generator=g)
    k, v = torch.randn(3, 2, 10, 32, generator=g), torch.randn(3, 2, 10, 32, generator=g)
    mask = torch.ones(3, 1, query_tokens, 10, dtype=torch.bool)
    mask[1, ..., :4] = False  # left padding
    mask[2, ..., :7] = False
    return q, k, v, mask


def _float64_attention(q, k, v, mask):
    q, k, v = (t.to(torch.bfloat16).double() for t in (q, k, v))
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ k.transpose(-1, -2)) * 32**-0.5
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return (weights @ v).transpose(1, 2)


def test_a_decode_step_under_bf16_autocast_equals_float64_attention_over_the_unpadded_keys():
    q, k, v, mask = _inputs(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _sdpa_cpu_decode_fp32(_Attention(), q, k, v, mask, dropout=0.0, scaling=32**-0.5)[0]
        theirs = sdpa_attention_forward(_Attention(), q, k, v, mask, dropout=0.0, scaling=32**-0.5)[0]
    reference = _float64_attention(q, k, v, mask)
    assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape == (3, 1, 4, 32)
    # bf16 output: a relative rounding of 2^-8
    torch.testing.assert_close(ours.double(), reference, atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(theirs.double(), reference, atol=1e-2, rtol=8e-3)
    unmasked = _float64_attention(q, k, v, torch.ones_like(mask))  # the padding changes the padded rows
    assert (unmasked[1:] - reference[1:]).abs().max() > 0.1


def test_every_other_call_is_transformers_own_bit_for_bit():
    for query_tokens, autocast in ((1, False), (5, True), (5, False)):
        q, k, v, mask = _inputs(query_tokens, seed=query_tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ours = _sdpa_cpu_decode_fp32(_Attention(), q, k, v, mask, dropout=0.0, scaling=32**-0.5)[0]
            theirs = sdpa_attention_forward(_Attention(), q, k, v, mask, dropout=0.0, scaling=32**-0.5)[0]
        assert torch.equal(ours, theirs), (query_tokens, autocast)


def _prompts(tokenizer) -> list[list[int]]:
    texts = ("short", "a much longer question about rivers, bridges and the towns between them")
    return [tokenizer(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n")["input_ids"] for t in texts]


def test_the_engine_switches_a_cpu_model_and_its_training_passes_stay_the_same(tiny_model_path, tiny_tokenizer):
    model = load_model(tiny_model_path)
    prompts = _prompts(tiny_tokenizer)
    samples = [TrainSample(p, list(range(100, 100 + n)), 0.0, [0.0] * n) for p, n in zip(prompts, (1, 9))]
    batch = collate(samples, tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        before = token_logprobs(model, batch, 1.0, "bf16")
        HFRolloutEngine(model, tiny_tokenizer, precision="bf16")
        after = token_logprobs(model, batch, 1.0, "bf16")
    assert model.config._attn_implementation == CPU_DECODE_ATTENTION
    assert torch.equal(before, after)


def test_bf16_samples_of_padded_prompts_are_scored_as_closely_to_float64_as_before(tiny_model_path, tiny_tokenizer):
    """Left-padded prompts of different lengths (the padding must stay masked at every decode step): the sampled
    log-probs are as close to a float64 forward pass over the same tokens as with transformers' own attention."""
    model = load_model(tiny_model_path)
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=8, precision="bf16")
    exact = load_model(tiny_model_path, dtype="float64")
    prompts = _prompts(tiny_tokenizer)
    gaps = {}
    for attention in ("sdpa", CPU_DECODE_ATTENTION):
        model.set_attn_implementation(attention)
        gens = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=3))
        gaps[attention] = gap_to_float64(exact, prompts, gens)["mean"]
    assert gaps[CPU_DECODE_ATTENTION] < 0.01 and gaps[CPU_DECODE_ATTENTION] <= 1.5 * gaps["sdpa"] + 1e-3, gaps


class _WeightCasts(TorchDispatchMode):
    """Counts fp32 -> bf16 copies of the model's parameters (autocast's casts of its weights)."""

    def __init__(self, model):
        super().__init__()
        self.weights = {p.data_ptr() for p in model.parameters()}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            self.count += args[0].data_ptr() in self.weights
        return func(*args, **kwargs)


def test_each_frozen_weight_is_cast_once_per_batch_with_the_same_samples(tiny_model_path, tiny_tokenizer):
    model = load_model(tiny_model_path)  # frozen, as the engine loads it
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=8, precision="bf16")
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    prompts = _prompts(tiny_tokenizer)
    runs, casts = {}, {}
    for cached in (False, True):
        engine.cache_weight_casts = cached
        with _WeightCasts(model) as counter:
            runs[cached] = [(g.token_ids, g.logprobs) for g in engine.generate(prompts, params)]
        casts[cached] = counter.count
    weights = sum(p.dim() == 2 for p in model.parameters())  # the matrices autocast casts for its matmuls
    assert runs[True] == runs[False]
    assert casts[True] <= weights < 12 * weights <= casts[False], (casts, weights)
    assert not any(p.requires_grad for p in model.parameters())  # frozen again after the call


def test_cached_casts_leave_trainable_weights_and_other_settings_alone(tiny_model_path):
    model = load_model(tiny_model_path)
    trainable = next(n for n, _ in model.named_parameters() if "q_proj" in n)
    model.get_parameter(trainable).requires_grad_(True)
    for precision in ("fp32", "bf16"):
        try:
            with cached_weight_casts(model, precision):
                marked = {n for n, p in model.named_parameters() if p.requires_grad}
                raise RuntimeError("generate failed")
        except RuntimeError:
            pass
        assert marked == ({trainable} if precision == "fp32" else {n for n, _ in model.named_parameters()})
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {trainable}, precision


def test_the_benchmark_compares_the_settings_on_the_tiny_model():
    out = subprocess.run(
        [sys.executable, "bench/hf_decode.py", "--model", "tiny-qwen3", "--prompt-tokens", "60", "--new-tokens", "8",
         "--rounds", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "transformers_sdpa" in out.stdout and '"speedup"' in out.stdout
    assert '"cached_casts_identical": true' in out.stdout
