"""grpo.kl_reward_coef (verl use_kl_in_reward): the controller against verl's AdaptiveKLController in float64, the
penalty in the advantages by hand, the learner's per-response KL against a float64 forward pass, and a run whose
advantages table holds the advantages of its rewards less the KL, with the coefficient the controller moved."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from conftest import catalog_rows, learner_settings
from refiner_core.algo.advantages import group_advantages, informative_prompt_ids
from refiner_core.algo.kl_reward import kl_coef_at, kl_control_after, with_reward_kl
from refiner_core.config import load_recipe
from refiner_core.grpo import build_train_samples, kl_in_reward
from refiner_core.learners.base import SequenceKL, TrainSample
from refiner_core.learners.torch_learner import TorchLearner, make_torch_learner
from refiner_core.models import load_model
from refiner_core.peer_names import PEER_NAMES, peer_value_hint
from refiner_core.preflight import check_recipe

ADAPTIVE = ["grpo.kl_reward_coef=0.1", "grpo.kl_reward_target=0.05", "grpo.kl_reward_horizon=100"]


class VerlAdaptiveKLController:
    """verl/trainer/ppo/core_algos.py AdaptiveKLController, as verl writes it."""

    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl, n_steps):
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def test_the_controller_moves_as_verls():
    grpo = load_recipe(None, ADAPTIVE).grpo
    # by hand: KL twice the target -> error clipped to 0.2 -> x (1 + 0.2 x 8 / 100) = 1.016
    assert kl_control_after(0.1, 0.1, 8, grpo)["coef"] == pytest.approx(0.1016, abs=1e-15)
    # 10 % under the target -> x (1 - 0.1 x 8 / 100)
    assert kl_control_after(0.1, 0.045, 8, grpo)["coef"] == pytest.approx(0.0992, abs=1e-15)
    rng = np.random.default_rng(0)
    verl, state = VerlAdaptiveKLController(0.1, 0.05, 100), None
    for kl, n in zip(rng.uniform(0, 0.12, 20), rng.integers(1, 64, 20)):
        coef = kl_coef_at(state, grpo)
        assert coef == pytest.approx(verl.value, rel=1e-14)
        verl.update(kl, int(n))
        state = kl_control_after(coef, float(kl), int(n), grpo)
    assert state["coef"] != 0.1
    fixed = load_recipe(None, ["grpo.kl_reward_coef=0.1"]).grpo
    assert kl_coef_at(kl_control_after(0.1, 5.0, 64, fixed), fixed) == 0.1  # kl_reward_target 0: it stays


def _rows(rewards, kls, groups, coef):
    rows = [{"prompt_id": g, "sample_idx": i, "reward": r} for i, (r, g) in enumerate(zip(rewards, groups))]
    return with_reward_kl(rows, {(g, i): kl for i, (kl, g) in enumerate(zip(kls, groups))}, coef)


def test_the_advantages_read_the_reward_less_the_penalty():
    # Group a: rewards 1, 1 (flat) and KLs 0, 2 at coef 0.5 -> 1, 0: +-0.5 / (std 0.5 + eps 1e-4). Group b:
    # rewards 3, 1 and KLs 4, 0 -> 1, 1: flat, no signal.
    grpo = load_recipe(None, ["grpo.kl_reward_coef=0.5"]).grpo
    rows = _rows([1.0, 1.0, 3.0, 1.0], [0.0, 2.0, 4.0, 0.0], ["a", "a", "b", "b"], 0.5)
    out, stats = group_advantages(rows, grpo)
    assert [a["advantage"] for a in out] == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0], abs=1e-12)
    assert [(a["reward"], a["reward_kl"], a["kl_coef"]) for a in out][1] == (1.0, 2.0, 0.5)
    # whether a group teaches is the reward's spread, before the penalty (what dynamic sampling and the filter
    # read): b's rewards differ, a's do not; a still learns from the penalty while the filter is off
    assert stats["informative_groups"] == 1 and informative_prompt_ids(rows, grpo) == {"b"}
    # without the KL: the rewards alone
    plain, _ = group_advantages([{k: r[k] for k in ("prompt_id", "sample_idx", "reward")} for r in rows], grpo)
    assert [a["advantage"] for a in plain] == pytest.approx([0.0, 0.0, 1 / 1.0001, -1 / 1.0001], abs=1e-12)
    assert plain[0]["reward_kl"] is None and plain[0]["kl_coef"] is None


def test_under_normalize_then_sum_the_penalty_is_one_part():
    """The KL is normalised in its group as one more part, weighted -coef: in group a the reward is flat and the
    KL's z-score +-1 weighted -0.5 gives -0.5, +0.5; in group b the reward's z +-1 weighted 1 and the KL flat."""
    grpo = load_recipe(None, ["grpo.advantage_eps=0", "grpo.reward_aggregation=normalize_then_sum"]).grpo
    rows = _rows([1.0, 1.0, 3.0, 1.0], [2.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], 0.5)
    rows = [{**r, "parts": {"reward": (1.0, r["reward"])}} for r in rows]
    out, _ = group_advantages(rows, grpo, lambda r: r["parts"])
    summed = np.array([-0.5, 0.5, 1.0, -1.0])
    assert [a["advantage"] for a in out] == pytest.approx(list((summed - summed.mean()) / summed.std()), abs=1e-12)


def test_preflight_and_the_peer_names():
    [p] = [p for p in check_recipe(load_recipe(None, ["grpo.kl_reward_target=0.1"])) if "kl_reward" in p]
    assert p.startswith("grpo.kl_reward_target = 0.1 adapts the coefficient") and "grpo.kl_reward_coef > 0" in p
    assert not [p for p in check_recipe(load_recipe(None, ADAPTIVE)) if "kl_reward" in p]
    assert PEER_NAMES["use_kl_in_reward"].ours == PEER_NAMES["kl_coef"].ours == "grpo.kl_reward_coef"
    assert PEER_NAMES["target_kl"].ours == "grpo.kl_reward_target"
    assert peer_value_hint("grpo.kl_reward_estimator", "low_var_kl") == "verl's kl_penalty 'low_var_kl' is 'k3' here"


def _samples() -> list[TrainSample]:
    """Two groups (samples 0-1 and 2-4 share a prompt)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (6 + k,), generator=g).tolist() for k in range(2)]
    samples = []
    for k in range(5):
        n = 4 + 3 * k
        mask = None if k % 2 else [bool(t % 3) for t in range(n)]  # tool output (False) carries no KL
        samples.append(
            TrainSample(
                prompts[k >= 2],
                torch.randint(3, 2000, (n,), generator=g).tolist(),
                0.0,
                [0.0] * n,
                mask,
            )
        )
    return samples


def _response_logp_float64(model, sample: TrainSample, temperature: float) -> torch.Tensor:
    """One sequence, no padding, a full forward of a float64 copy; log-softmax at the temperature."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = copy.deepcopy(model).double()(input_ids=ids).logits[0] / temperature
    logp = torch.log_softmax(logits, dim=-1)[len(sample.prompt_ids) - 1 : -1]
    return logp.gather(-1, torch.tensor(sample.response_ids).unsqueeze(-1)).squeeze(-1)


def _kl_float64(d: torch.Tensor, sample: TrainSample, estimator: str) -> float:
    value = {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) - 1 + d}[estimator]
    mask = torch.ones(len(d)) if sample.loss_mask is None else torch.tensor(sample.loss_mask, dtype=torch.float64)
    return float((value * mask).sum())


@pytest.mark.parametrize("estimator,share_prompt", [("k1", False), ("k2", True), ("k3", False), ("k3", True)])
def test_the_learners_kl_equals_a_float64_forward(tiny_model_path, tiny_tokenizer, estimator, share_prompt):
    """5 responses of 4-16 tokens in two groups, 3 with tool tokens masked out, 2 to a forward (padded rows) or a
    group to a forward (its prompt read once), fp32 against float64: measured to 3e-6 relative; the bound leaves
    30x. The per-token log-probs it returns (the update reuses them) are each model's at every trained token."""
    policy, reference = load_model(tiny_model_path, trainable=True), load_model(tiny_model_path)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    settings = learner_settings(
        beta=0.0, kl_reward_coef=0.1, kl_reward_estimator=estimator, micro_batch_size=2, share_prompt=share_prompt
    )
    learner = TorchLearner(policy, reference, tiny_tokenizer.pad_token_id, settings)
    samples = _samples()
    got = learner.sequence_kl(samples)
    old = [_response_logp_float64(policy, s, settings.temperature) for s in samples]
    ref = [_response_logp_float64(reference, s, settings.temperature) for s in samples]
    want = [_kl_float64(o - r, s, estimator) for o, r, s in zip(old, ref, samples)]
    assert [m.total for m in got] == pytest.approx(want, rel=1e-4, abs=1e-7)
    assert min(abs(w) for w in want) > 1e-3  # the two models really differ
    for m, o, r, s in zip(got, old, ref, samples):  # at trained tokens (the loss reads no other)
        trained = [k for k in range(len(s.response_ids)) if s.loss_mask is None or s.loss_mask[k]]
        assert [m.old_logprobs[k] for k in trained] == pytest.approx(o[trained].tolist(), abs=1e-5)
        assert [m.reference_logprobs[k] for k in trained] == pytest.approx(r[trained].tolist(), abs=1e-5)
    assert policy.training  # scoring leaves the policy in training mode


def test_the_train_samples_carry_the_measures_logprobs():
    """kl_in_reward -> build_train_samples: each trained response carries the per-token log-probs its measure
    read; a response without tokens is not measured (KL 0) and not trained. The step's KL is the mean of the
    measured responses' per-token means: (3/3 + 1/2) / 2."""
    grpo = load_recipe(None, ["grpo.kl_reward_coef=0.5"]).grpo
    responses = {0: [5, 6, 7], 1: [8, 9], 2: []}
    rollouts = [
        {
            "prompt_id": "p",
            "sample_idx": i,
            "prompt_token_ids": [1, 2],
            "response_token_ids": ids,
            "response_logprobs": [-1.0] * len(ids),
            "finish_reason": "stop",
        }
        for i, ids in responses.items()
    ]
    rewards = [{"prompt_id": "p", "sample_idx": i, "reward": float(i)} for i in responses]

    def measure(samples: list[TrainSample]) -> list[SequenceKL]:
        assert [s.response_ids for s in samples] == [[5, 6, 7], [8, 9]]
        return [SequenceKL(3.0, [-0.1] * 3, [-0.2] * 3), SequenceKL(1.0, [-0.3] * 2, [-0.4] * 2)]

    rollouts, rewards, metrics, control = kl_in_reward(rollouts, rewards, measure, None, grpo)
    assert metrics == {"kl_reward_coef": 0.5, "reward_kl": pytest.approx(0.75)} and control == {"coef": 0.5}
    assert [(r["reward_kl"], r["kl_coef"]) for r in rewards] == [(3.0, 0.5), (1.0, 0.5), (0.0, 0.5)]
    samples, _, _ = build_train_samples(rollouts, rewards, grpo)
    assert [(s.old_logprobs, s.reference_logprobs) for s in samples] == [
        ([-0.1] * 3, [-0.2] * 3),
        ([-0.3] * 2, [-0.4] * 2),
    ]


def _counting_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("share_prompt", [False, True])
def test_the_update_reuses_the_measures_logprobs(tiny_model_path, tiny_tokenizer, share_prompt):
    """With the KL in the reward and in the loss (beta > 0), two optimizer steps (so pi_old is frozen): a train
    step on samples carrying the measure's log-probs runs no reference forward and no frozen policy forward, and
    moves the weights as the step that scores them itself (same batches: equal to 1e-6)."""
    settings = learner_settings(
        beta=0.04, kl_reward_coef=0.1, minibatches=2, micro_batch_size=2, share_prompt=share_prompt, learning_rate=1e-3
    )
    reference = load_model(tiny_model_path)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    samples = [dataclasses.replace(s, advantage=(-1.0) ** k) for k, s in enumerate(_samples()[:4])]
    moved, forwards = [], []
    for carried in (False, True):
        policy = load_model(tiny_model_path, trainable=True)
        learner = TorchLearner(policy, reference, tiny_tokenizer.pad_token_id, settings)
        batch = samples
        if carried:
            batch = [dataclasses.replace(s, **m.carried()) for s, m in zip(samples, learner.sequence_kl(samples))]
        policy_calls, reference_calls = _counting_forwards(policy), _counting_forwards(reference)
        metrics = learner.train_step(batch)
        forwards.append((policy_calls[0], reference_calls[0]))
        moved.append((metrics, {k: v.detach().clone() for k, v in policy.state_dict().items()}))
    (plain, plain_weights), (reused, reused_weights) = moved
    trained_batches = forwards[1][0]
    assert forwards == [(2 * trained_batches, trained_batches), (trained_batches, 0)] and trained_batches >= 2
    assert reused["kl"] == pytest.approx(plain["kl"], rel=1e-5) and plain["kl"] > 1e-4
    assert reused["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-8)
    assert max((plain_weights[k] - reused_weights[k]).abs().max().item() for k in plain_weights) < 1e-6
    assert (
        max((plain_weights[k] - v).abs().max().item() for k, v in load_model(tiny_model_path).state_dict().items())
        > 1e-4
    )


def test_the_reference_is_loaded_for_the_reward_alone(tiny_model_path, tiny_tokenizer):
    """beta 0 and no KL in the reward: no reference; kl_reward_coef > 0: the reference, which equals the starting
    policy, so the KL is exactly 0."""
    off = make_torch_learner(tiny_model_path, tiny_model_path, tiny_tokenizer, learner_settings(beta=0.0), None)
    assert off.reference is None
    with pytest.raises(ValueError, match="holds no reference model"):
        off.sequence_kl(_samples())
    on = make_torch_learner(
        tiny_model_path, tiny_model_path, tiny_tokenizer, learner_settings(beta=0.0, kl_reward_coef=0.1), None
    )
    assert [m.total for m in on.sequence_kl(_samples())] == [0.0] * 5


def _table(run_dir, sql: str) -> list[dict]:
    names = [d for d, *_ in catalog_rows(run_dir, f"DESCRIBE {sql}")]
    return [dict(zip(names, row)) for row in catalog_rows(run_dir, sql)]


def _group_std(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """float64: (v - group mean) / (group std (ddof 0) + 1e-4)."""
    out = np.zeros(len(values))
    for g in set(groups):
        block = values[groups == g]
        out[groups == g] = (block - block.mean()) / (block.std() + 1e-4)
    return out


def test_a_run_trains_on_its_rewards_less_the_kl_and_a_rescore_keeps_the_penalty(prefect_server, tiny_recipe, tmp_path):
    """Two steps, beta 0 (the reward alone reads the reference), an adaptive coefficient. Step 0's policy is the
    reference: KL exactly 0, so the controller moves the coefficient down (error -0.2); step 1's policy has moved:
    KL > 0, and its advantages are group_std of reward - coef x reward_kl."""
    from flows.refiner import refiner_pipeline
    from refiner_core.reward.rescore import rescore_run

    target, horizon, coef = 0.01, 64, 0.5
    recipe = {
        **tiny_recipe,
        "grpo": {
            **tiny_recipe["grpo"],
            "beta": 0.0,
            "learning_rate": 1e-2,
            "kl_reward_coef": coef,
            "kl_reward_target": target,
            "kl_reward_horizon": horizon,
        },
    }
    state = refiner_pipeline(recipe=recipe, run_dir=str(tmp_path), return_state=True)
    assert state.is_completed(), state.message
    steps = _table(tmp_path, "SELECT step, kl_reward_coef, reward_kl FROM steps ORDER BY step")
    responses = catalog_rows(tmp_path, "SELECT count(*) FROM rollouts WHERE step = 0")[0][0]
    assert steps[0]["kl_reward_coef"] == coef and steps[0]["reward_kl"] == 0.0
    assert steps[1]["kl_reward_coef"] == pytest.approx(coef * (1 - 0.2 * responses / horizon), rel=1e-12)
    assert steps[1]["reward_kl"] > 0

    order = "WHERE reward_version = '{}' AND step = 1 ORDER BY prompt_id, sample_idx"
    rows = _table(
        tmp_path,
        "SELECT a.*, r.response_tokens FROM advantages a JOIN rollouts r USING (run, step, prompt_id, sample_idx) "
        + order.format("train"),
    )
    kl = np.array([r["reward_kl"] for r in rows])
    reward, groups = np.array([r["reward"] for r in rows]), np.array([r["prompt_id"] for r in rows])
    assert {r["kl_coef"] for r in rows} == {steps[1]["kl_reward_coef"]} and (kl != 0).all()
    assert steps[1]["reward_kl"] == pytest.approx(np.mean(kl / [r["response_tokens"] for r in rows]), rel=1e-9)
    expected = _group_std(reward - steps[1]["kl_reward_coef"] * kl, groups)
    assert [r["advantage"] for r in rows] == pytest.approx(list(expected), abs=1e-9)
    assert np.abs(expected - _group_std(reward, groups)).max() > 1e-3  # the penalty changed them

    # a rescore with the rubric weighed down keeps training's penalty
    base = load_recipe(tmp_path / "recipe.yaml")
    rescore_run(tmp_path, base, load_recipe(tmp_path / "recipe.yaml", ["reward.rubric_weight=0.25"]), "rw")
    rescored = _table(tmp_path, "SELECT * FROM advantages " + order.format("rw"))
    assert [r["reward_kl"] for r in rescored] == list(kl)
    new_reward = np.array([r["reward"] for r in rescored])
    assert (new_reward != reward).any()
    assert [r["advantage"] for r in rescored] == pytest.approx(
        list(_group_std(new_reward - steps[1]["kl_reward_coef"] * kl, groups)), abs=1e-9
    )


def test_the_kl_panel_draws_the_kl_in_the_reward_beside_the_loss_term():
    from refiner_core.publish.plots import _draw

    steps = [
        {"run": "r", "step": k, "reward_mean": 1.0, "reward_std": 0.1, "kl": 0.01 * k, "loss": 0.0}
        | {"response_length_mean": 9.0, "reward_kl": 0.02 * k}
        for k in range(3)
    ]
    import matplotlib.pyplot as plt

    try:
        kl_axes = _draw(steps, None).axes[1]
        assert [line.get_label() for line in kl_axes.lines] == ["loss term (beta)", "in the reward (per token)"]
        assert list(kl_axes.lines[1].get_ydata()) == [0.0, 0.02, 0.04]
        without = _draw([{**s, "reward_kl": None} for s in steps], None).axes[1]
        assert len(without.lines) == 1 and without.get_legend() is None
    finally:
        plt.close("all")


def test_with_lora_the_reference_is_the_base_with_adapters_off(tiny_model_path, tiny_tokenizer):
    """Fresh adapters (B = 0) leave the policy equal to the base: KL exactly 0; one update on the adapters alone
    moves it away."""
    settings = learner_settings(
        beta=0.0,
        kl_reward_coef=0.1,
        learning_rate=1e-2,
        lora_rank=4,
        lora_alpha=8.0,
        lora_dropout=0.0,
        lora_target_modules=("all-linear",),
    )
    learner = make_torch_learner(tiny_model_path, tiny_model_path, tiny_tokenizer, settings, None)
    samples = [dataclasses.replace(s, advantage=(-1.0) ** k) for k, s in enumerate(_samples())]
    assert [m.total for m in learner.sequence_kl(samples)] == [0.0] * 5
    learner.train_step(samples)
    assert min(abs(m.total) for m in learner.sequence_kl(samples)) > 1e-6
