"""Packed updates: several sequences per row, attention kept inside each, the same loss and gradients as padding."""

import pytest
import torch

from conftest import learner_settings
from refiner_core.learners.base import TrainSample
from refiner_core.learners.batching import collate, collate_group, collate_rows, pack_rows, prompt_groups
from refiner_core.learners.logprobs import token_logprobs
from refiner_core.learners.packed_attention import apply_packed_attention
from refiner_core.learners.torch_learner import TorchLearner
from refiner_core.models import load_model


def _samples(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        prompt = torch.randint(3, 2000, (4 + 3 * k % 11,), generator=g).tolist()
        response = torch.randint(3, 2000, (2 + 5 * k % 9,), generator=g).tolist()
        rollout_lp = (-torch.rand(len(response), generator=g) * 8).tolist()
        out.append(TrainSample(prompt, response, float(torch.randn(1, generator=g)), rollout_lp))
    return out


def _settings(**kw):
    return learner_settings(**{"beta": 0.05, "loss_constant": 16.0, "micro_batch_size": 2, "tis_cap": 2.0, **kw})


def test_pack_rows_first_fit_decreasing_and_long_sequences_alone():
    samples = [TrainSample([1] * p, [2] * r, 0.0, [0.0] * r) for p, r in [(3, 2), (8, 4), (2, 1), (20, 5), (4, 3)]]
    # lengths 5, 12, 3, 25, 7 into rows of 16: 25 alone; FFD: 12 -> row A, 7 -> row B, 5 -> B, 3 -> A
    assert pack_rows(samples, 16) == [[3], [1, 2], [4, 0]]
    assert pack_rows(samples, 0) == [[0], [1], [2], [3], [4]]


def test_packed_logprobs_equal_per_sequence_logprobs(tiny_model_path):
    """position_ids restarting at 0 isolate sequences under the installed transformers' sdpa attention."""
    model = load_model(tiny_model_path)
    samples = _samples()
    rows = pack_rows(samples, 48)
    assert max(len(r) for r in rows) >= 3  # the case really packs
    packed = collate_rows([[samples[i] for i in row] for row in rows], pad_id=0)
    with torch.no_grad():
        packed_lp = token_logprobs(model, packed, temperature=0.7)
        for r, row in enumerate(rows):
            alone = [collate([samples[i]], pad_id=0) for i in row]
            want = torch.cat([token_logprobs(model, b, 0.7)[0][b["mask"][0].bool()] for b in alone])
            torch.testing.assert_close(packed_lp[r][packed["mask"][r].bool()], want, rtol=0, atol=1e-5)
        # without the restart, later sequences would attend to earlier ones: the test can tell the difference
        leaky = dict(packed, position_ids=torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"]))
        leaky_lp = token_logprobs(model, leaky, temperature=0.7)
    assert (leaky_lp - packed_lp)[packed["mask"].bool()].abs().max() > 1e-2


def _update(tiny_model_path, samples, **settings) -> tuple[dict, torch.Tensor]:
    """One train step of a fresh policy against a reference that differs from it (so the KL term is not zero):
    the metrics and the flat gradient."""
    policy = load_model(tiny_model_path, trainable=True)
    reference = load_model(tiny_model_path)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    apply_packed_attention([policy, reference], settings.get("packed_attention", "mask"))
    metrics = TorchLearner(policy, reference, 0, _settings(**settings)).train_step(samples)
    return metrics, torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])


def _same_update(want: tuple[dict, torch.Tensor], got: tuple[dict, torch.Tensor]) -> None:
    """The same loss and gradients, fp32 to 1e-5."""
    (want_metrics, want_grads), (got_metrics, got_grads) = want, got
    assert want_metrics["kl"] > 0 and want_grads.abs().max() > 0
    for key in ("loss", "pg_loss", "kl", "clip_fraction", "response_tokens"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-5), key
    torch.testing.assert_close(got_grads, want_grads, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sum_constant"])
def test_packed_update_equals_padded_update(tiny_model_path, aggregation):
    """The reference pass, TIS and KL all packed the same way."""
    samples = _samples()
    padded = _update(tiny_model_path, samples, loss_aggregation=aggregation)
    packed = _update(tiny_model_path, samples, loss_aggregation=aggregation, pack_length=48)
    _same_update(padded, packed)
    assert packed[0]["packing_efficiency"] > padded[0]["packing_efficiency"]


def test_per_sequence_attention_update_equals_padded_update(tiny_model_path):
    """grpo.packed_attention 'per_sequence' on packed rows (and on padded ones, whose padding tail is a sequence of
    its own): the loss and gradients of the masked padded update."""
    samples = _samples()
    padded = _update(tiny_model_path, samples)
    _same_update(padded, _update(tiny_model_path, samples, pack_length=48, packed_attention="per_sequence"))
    _same_update(padded, _update(tiny_model_path, samples, packed_attention="per_sequence"))


def test_packing_efficiency_hand_computed(tiny_model_path):
    samples = [TrainSample([1] * p, [2] * r, 1.0, [-1.0] * r) for p, r in [(3, 2), (8, 4), (2, 1), (4, 3)]]
    # padded, 2 rows per pass: (5, 12) -> 2 x 12, (3, 7) -> 2 x 7; 27 real tokens of 38 computed
    policy = load_model(tiny_model_path, trainable=True)
    padded = TorchLearner(policy, None, 0, _settings(beta=0.0)).train_step(samples)
    assert padded["packing_efficiency"] == pytest.approx(27 / 38)
    # packed into 16: rows [12, 3] and [7, 5] -> one pass of 2 x 15; 27 of 30
    packed = TorchLearner(policy, None, 0, _settings(beta=0.0, pack_length=16)).train_step(samples)
    assert packed["packing_efficiency"] == pytest.approx(27 / 30)


def _grouped_samples(groups=3, size=4, seed=1):
    """GRPO groups: `size` responses of varied length (one of a single token) after each shared prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(groups):
        prompt = torch.randint(3, 2000, (5 + 4 * k,), generator=g).tolist()
        for j in range(size):
            n = 1 if (k, j) == (1, 2) else 2 + (5 * j + k) % 7
            response = torch.randint(3, 2000, (n,), generator=g).tolist()
            mask = [i % 3 != 1 for i in range(n)] if (k, j) == (2, 1) else None  # tool tokens left out
            out.append(
                TrainSample(
                    prompt,
                    response,
                    float(torch.randn(1, generator=g)),
                    (-torch.rand(n, generator=g) * 8).tolist(),
                    mask,
                )
            )
    return out


def test_shared_prompt_logprobs_equal_per_sequence_logprobs(tiny_model_path):
    model = load_model(tiny_model_path)
    samples = _grouped_samples()
    groups = prompt_groups(samples)
    assert [len(g) for g in groups] == [4, 4, 4]
    with torch.no_grad():
        for group in groups:
            batch = collate_group([samples[i] for i in group], pad_id=0)
            shared = token_logprobs(model, batch, temperature=0.7)
            for r, i in enumerate(group):
                alone = collate([samples[i]], pad_id=0)
                want = token_logprobs(model, alone, 0.7)[0][alone["mask"][0].bool()]
                torch.testing.assert_close(shared[r][batch["mask"][r].bool()], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sum_constant"])
def test_shared_prompt_update_equals_padded_update(tiny_model_path, aggregation):
    """One prompt forward per group, its keys/values reused: the same update as one padded sequence per row, with
    the reference pass, TIS, KL and a loss mask."""
    samples = _grouped_samples()
    padded = _update(tiny_model_path, samples, loss_aggregation=aggregation)
    shared = _update(tiny_model_path, samples, loss_aggregation=aggregation, share_prompt=True)
    _same_update(padded, shared)
    assert shared[0]["packing_efficiency"] > 1.0  # each prompt computed once instead of four times
