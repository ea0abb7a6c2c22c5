"""A gradient whose norm is NaN or inf skips its optimizer step: the torch learner and SFT leave the weights and the
AdamW state as they were (stepping wrote NaN into every weight and every later step stayed NaN), so the next step
is exactly a fresh learner's first one. The DeepSpeed ranks: tests/test_deepspeed_learner.py; the monitor:
tests/test_monitors.py."""

from __future__ import annotations

import dataclasses
import math

import torch

from conftest import learner_settings
from refiner_core.algo.packing import concat_pack
from refiner_core.learners.base import TrainSample
from refiner_core.learners.torch_learner import TorchLearner, grad_norm_metrics
from refiner_core.models import load_model
from refiner_core.sft.train import SFTSettings, train_sft

# An advantage near float32's largest value: the loss overflows to inf and the backward pass makes NaN gradients.
OVERFLOWING_ADVANTAGE = 3e38


def _samples(seed: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    return [
        TrainSample(
            torch.randint(3, 2000, (10 + k,), generator=g).tolist(),
            torch.randint(3, 2000, (5 + k,), generator=g).tolist(),
            advantage,
            (-7.0 - torch.rand(5 + k, generator=g)).tolist(),
        )
        for k, advantage in enumerate([1.0, -1.0, 0.5, -0.5])
    ]


def _overflowing(samples: list[TrainSample]) -> list[TrainSample]:
    return [dataclasses.replace(samples[0], advantage=OVERFLOWING_ADVANTAGE), *samples[1:]]


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _learner(tiny_model_path, pad_id: int, **settings) -> tuple[torch.nn.Module, TorchLearner]:
    policy = load_model(tiny_model_path, trainable=True)
    kw = {"max_grad_norm": 1.0, "weight_decay": 0.01, **settings}
    return policy, TorchLearner(policy, load_model(tiny_model_path), pad_id, learner_settings(**kw))


def test_grad_norm_metrics_average_the_steps_taken():
    assert grad_norm_metrics([2.0, 4.0]) == {"grad_norm": 3.0, "skipped_optimizer_steps": 0}
    assert grad_norm_metrics([2.0, math.nan, math.inf, 4.0]) == {"grad_norm": 3.0, "skipped_optimizer_steps": 2}
    assert grad_norm_metrics([math.nan]) == {"grad_norm": None, "skipped_optimizer_steps": 1}


def test_a_nan_gradient_skips_the_step_and_the_next_step_is_a_fresh_learners_first(tiny_model_path, tiny_tokenizer):
    pad = tiny_tokenizer.pad_token_id
    policy, learner = _learner(tiny_model_path, pad)
    start = _weights(policy)
    metrics = learner.train_step(_overflowing(_samples(0)))
    assert metrics["skipped_optimizer_steps"] == 1 and metrics["grad_norm"] is None
    assert all(torch.equal(v, start[k]) for k, v in policy.state_dict().items())
    assert learner.optimizer.state == {}  # no moment, no step count: AdamW never ran
    after = learner.train_step(_samples(1))

    fresh_policy, fresh = _learner(tiny_model_path, pad)
    want = fresh.train_step(_samples(1))
    assert after["skipped_optimizer_steps"] == 0 and math.isfinite(after["grad_norm"])
    assert {k: after[k] for k in ("loss", "grad_norm", "kl")} == {k: want[k] for k in ("loss", "grad_norm", "kl")}
    assert all(torch.equal(v, fresh_policy.state_dict()[k]) for k, v in policy.state_dict().items())
    assert any(not torch.equal(v, start[k]) for k, v in policy.state_dict().items())


def test_one_skipped_minibatch_of_two_leaves_the_other_step(tiny_model_path, tiny_tokenizer):
    """grpo.minibatches 2: two optimizer steps in one update; the one holding the overflowing sample is skipped,
    the other taken, and grad_norm is the taken step's."""
    policy, learner = _learner(tiny_model_path, tiny_tokenizer.pad_token_id, minibatches=2, micro_batch_size=1)
    start = _weights(policy)
    metrics = learner.train_step(_overflowing(_samples(0)))
    assert metrics["skipped_optimizer_steps"] == 1 and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert all(torch.isfinite(v).all() for v in policy.state_dict().values())
    assert any(not torch.equal(v, start[k]) for k, v in policy.state_dict().items())


def test_sft_skips_a_step_whose_gradient_is_nan(tiny_model_path, tiny_tokenizer):
    """Two copies of one pack, two optimizer steps; the first forward pass gives NaN logits. The first step is
    recorded with its NaN norm and not taken, so the weights end as a fresh model's after the one pack."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 2000, (24,), generator=g).tolist()
    pack = concat_pack([(tokens, [False] * 8 + [True] * 16)])
    settings = SFTSettings(learning_rate=1e-3, max_grad_norm=1.0, weight_decay=0.01)
    model = load_model(tiny_model_path, trainable=True)
    calls = []

    def nan_once(module, args, output):
        calls.append(1)
        return output * math.nan if len(calls) == 1 else output

    hook = model.lm_head.register_forward_hook(nan_once)
    history = train_sft(model, [pack, pack], [], tiny_tokenizer.pad_token_id, settings)
    hook.remove()
    assert [math.isnan(r["grad_norm"]) for r in history] == [True, False]

    fresh = load_model(tiny_model_path, trainable=True)
    train_sft(fresh, [pack], [], tiny_tokenizer.pad_token_id, settings)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())
    assert any(
        not torch.equal(v, w)
        for v, w in zip(fresh.state_dict().values(), load_model(tiny_model_path).state_dict().values())
    )
