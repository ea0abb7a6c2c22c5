"""GRPO that does not learn is not GRPO: the tiny model must climb a toy reward."""

import numpy as np
import pytest
import torch

from refiner_core.config import GRPOConfig
from refiner_core.grpo import grpo_loop, learner_settings
from refiner_core.learners.torch_learner import TorchLearner
from refiner_core.models import load_model
from refiner_core.rollout.base import SamplingParams
from refiner_core.rollout.hf_engine import HFRolloutEngine


def _run(tiny_model_path, tiny_tokenizer, reward_fn, steps, precision="fp32", **grpo_overrides):
    torch.manual_seed(0)
    policy = load_model(tiny_model_path, trainable=True)
    reference = load_model(tiny_model_path)
    grpo = GRPOConfig(micro_batch_size=32, **grpo_overrides)
    learner = TorchLearner(policy, reference, tiny_tokenizer.pad_token_id, learner_settings(grpo, 1.0, precision))
    engine = HFRolloutEngine(policy, tiny_tokenizer, batch_size=64, precision=precision)  # the live weights
    prompts = [
        tiny_tokenizer(f"<|im_start|>user\nquestion {i}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
            "input_ids"
        ]
        for i in range(8)
    ]
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=16, seed=1)
    return grpo_loop(engine, learner, prompts, reward_fn, grpo, params, steps=steps, prompts_per_step=4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_reward_rises_on_toy_task(tiny_model_path, tiny_tokenizer, precision):
    target = set(range(3, 203))  # ~10% of the vocabulary: reward = fraction of tokens drawn from it

    def reward(gen):
        return sum(t in target for t in gen.token_ids) / max(len(gen.token_ids), 1)

    history = _run(tiny_model_path, tiny_tokenizer, reward, steps=30, learning_rate=1e-2, beta=0.0, precision=precision)
    rewards = [h["reward_mean"] for h in history]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert first < 0.25, f"toy task should start hard, got {first:.3f}"
    assert last > first + 0.4 and last > 0.6, f"reward did not rise: {first:.3f} -> {last:.3f}"


def test_kl_penalty_holds_policy_near_reference(tiny_model_path, tiny_tokenizer):
    """Same task, strong beta: the KL term must shrink how far the policy moves (measured by KL)."""
    target = set(range(3, 203))

    def reward(gen):
        return sum(t in target for t in gen.token_ids) / max(len(gen.token_ids), 1)

    free = _run(tiny_model_path, tiny_tokenizer, reward, steps=12, learning_rate=1e-2, beta=1e-6)
    held = _run(tiny_model_path, tiny_tokenizer, reward, steps=12, learning_rate=1e-2, beta=2.0)
    assert held[-1]["kl"] < free[-1]["kl"] * 0.5, (held[-1]["kl"], free[-1]["kl"])


def test_kl_in_the_reward_holds_policy_near_reference(tiny_model_path, tiny_tokenizer):
    """Same task, beta 0 and the KL in the reward instead (grpo.kl_reward_coef): responses that drifted rank lower
    in their group, so the policy moves less (measured by the reward's own KL, per token)."""
    target = set(range(3, 203))

    def reward(gen):
        return sum(t in target for t in gen.token_ids) / max(len(gen.token_ids), 1)

    free = _run(tiny_model_path, tiny_tokenizer, reward, steps=12, learning_rate=1e-2, beta=0.0, kl_reward_coef=1e-6)
    held = _run(tiny_model_path, tiny_tokenizer, reward, steps=12, learning_rate=1e-2, beta=0.0, kl_reward_coef=0.5)
    assert held[0]["reward_kl"] == free[0]["reward_kl"] == 0.0  # the first step's policy is the reference
    assert held[-1]["reward_kl"] < free[-1]["reward_kl"] * 0.5, (held[-1]["reward_kl"], free[-1]["reward_kl"])
