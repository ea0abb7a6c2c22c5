"""The 'deepspeed' learner for real: torchrun subprocesses, ZeRO-3 on CPU (gloo), the tiny Qwen3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import learner_settings
from refiner_core.learners.base import TrainSample, make_learner
from refiner_core.learners.torch_learner import TorchLearner
from refiner_core.models import load_model

pytestmark = pytest.mark.slow


def _samples(seed: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    return [TrainSample(torch.randint(3, 2000, (12 + 3 * k,), generator=g).tolist(),
                        torch.randint(3, 2000, (6 + 2 * k,), generator=g).tolist(), adv,
                        (-7.0 - torch.rand(6 + 2 * k, generator=g)).tolist())
            for k, adv in enumerate([1.0, -1.0, 0.5, -0.5, 1.2, -0.3])]


def _settings(**kw):
    return learner_settings(**{"learning_rate": 1e-3, "weight_decay": 0.01, "max_grad_norm": 1.0, "beta": 0.04, "micro_batch_size": 2, "tis_cap": 2.0, **kw})


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_two_rank_zero3_equals_the_torch_learner_and_resumes(tiny_model_path, tiny_tokenizer, tmp_path):
    """6 sequences in 3 micro-batches of 2 over 2 ranks (rank 1 pads with a zero-weight copy), fp32, clipping, KL
    and TIS on, two AdamW steps at lr 1e-3. Measured (also with one rank, so it is DeepSpeed's fp32 arithmetic, not
    the sharding): losses equal to 4e-9, grad norm to 1.4e-5 relative, weights to 8e-6 max abs, i.e. 0.8% of one
    step's move (Adam moves every weight by ~lr); the bounds below leave 2-7x headroom."""
    samples = [_samples(0), _samples(1)]
    # The reference: the one-process torch learner, two train steps with its own optimizer.
    policy = load_model(tiny_model_path, trainable=True)
    torch_learner = TorchLearner(policy, load_model(tiny_model_path), tiny_tokenizer.pad_token_id,
                                 _settings())
    expected, expected_weights = [], []
    for batch in samples:
        expected.append(torch_learner.train_step(batch))
        expected_weights.append({k: v.detach().clone() for k, v in policy.state_dict().items()})

    settings = _settings(world_size=2, zero_stage=3)
    checkpoint = Path(tiny_model_path)
    for step, batch in enumerate(samples):
        learner = make_learner("deepspeed", checkpoint, tiny_model_path, tiny_tokenizer, settings,
                               checkpoint / "optimizer.pt")
        metrics = learner.train_step(batch)
        out = tmp_path / f"step_{step + 1}"
        learner.save(out)
        checkpoint = out

        # Both ranks trained their share: 2 + 1 real micro-batches, every response token counted once.
        stats = sorted(learner.rank_stats, key=lambda r: r["rank"])
        assert [(r["rank"], r["world_size"], r["micro_batches"]) for r in stats] == [(0, 2, 2), (1, 2, 1)]
        assert sum(r["tokens"] for r in stats) == sum(len(s.response_ids) for s in batch)
        assert all(r["tokens"] > 0 for r in stats)
        # The optimizer state came back from the previous step's checkpoint (same world size and stage).
        assert [(r["adam_steps_resumed"], r["adam_steps"]) for r in stats] == [(step, step + 1)] * 2

        want = expected[step]
        assert set(metrics) == set(want)
        for key in ("loss", "pg_loss", "kl", "clip_fraction", "response_tokens", "packing_efficiency", "lr"):
            assert metrics[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
        assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)

        # An HF checkpoint any transformers user can load, with the one-process learner's weights.
        loaded = load_model(out)
        diff = _max_diff(loaded.state_dict(), expected_weights[step])
        assert diff < 0.02 * 1e-3, diff
        assert (out / "deepspeed" / "refiner.json").exists()
    moved = _max_diff(expected_weights[1], load_model(tiny_model_path).state_dict())
    assert moved > 1e-3  # the weights really changed, by far more than the tolerance


def test_flow_with_the_deepspeed_learner(prefect_server, tiny_recipe, tmp_path):
    """One GRPO step of the tiny recipe through the real pipeline with grpo.learner=deepspeed (one rank, ZeRO-3)."""
    from flows.refiner import refiner_pipeline
    from refiner_core.models import load_model as load

    recipe = {**tiny_recipe, "grpo": {**tiny_recipe["grpo"], "learner": "deepspeed", "steps": 1, "world_size": 1}}
    state = refiner_pipeline(recipe=recipe, run_dir=str(tmp_path), return_state=True)
    assert state.is_completed(), state.message
    checkpoint = tmp_path / "checkpoints" / "step_0001"
    assert (checkpoint / "deepspeed" / "refiner.json").exists()
    assert load(checkpoint) is not None
