"""grpo.async_steps: the rollout of step N is sampled by the policy after max(N - K, 0) updates, beside the judge and
update of the steps before it; every stage stays cached, and K = 0 keeps the synchronous order."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from conftest import catalog_rows, learner_settings, math_rows_file
from refiner_core import live
from refiner_core.checkpoints import TRAINING_STATE_FILES
from refiner_core.config import load_recipe, recipe_from_dict
from refiner_core.ground_truth import Verdict
from refiner_core.preflight import check_values
from refiner_core.storage import dir_hash
from test_pipeline import STAGES, _run

REPO = Path(__file__).resolve().parents[1]
STEPS, TIS_CAP = 3, 2.0
LEARNING_RATE = 1e-2  # large: one update moves the policy far enough that a lagged sample's weight shows it


def _recipe(data: Path, *extra: str) -> dict:
    return load_recipe(REPO / "recipes" / "gt-grpo-math.yaml", [
        "model.policy=tiny-qwen3", "model.dtype=float32", "model.max_position_embeddings=2048", f"data.path={data}",
        "data.validation_fraction=0", "rollout.engine=hf", "rollout.samples_per_prompt=2",
        "rollout.prompts_per_step=2", "rollout.max_new_tokens=6", "rollout.batch_size=32", "grpo.learner=torch",
        "grpo.world_size=1", f"grpo.steps={STEPS}", "grpo.micro_batch_size=8", "eval.every=0", "run.keep_last=0",
        "model.precision=fp32", "reward.verifier=alternating", f"grpo.learning_rate={LEARNING_RATE}",
        f"grpo.tis_cap={TIS_CAP}", *extra]).to_dict()


def alternating_verifier():
    """Reward = sample_idx % 2: every group's rewards differ, so every update moves the policy."""

    def verify_step(rollouts: list[dict], prompts: dict[str, dict]) -> list[Verdict]:
        return [Verdict(float(r["sample_idx"] % 2), None, "alternating") for r in rollouts]

    return verify_step


@pytest.fixture(scope="module")
def runs(prefect_server, tmp_path_factory):
    from refiner_core.verifiers import VERIFIERS

    folder = tmp_path_factory.mktemp("async-steps")
    data = math_rows_file(folder, 8)
    ahead = _recipe(data, "grpo.async_steps=1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(VERIFIERS, "alternating", "test_async_steps:alternating_verifier")
        state, tasks = _run(ahead, folder / "async")
        assert state.is_completed(), state.message
        rerun_state, rerun_tasks = _run(ahead, folder / "async")
        assert rerun_state.is_completed(), rerun_state.message
        sync_state, _ = _run(_recipe(data), folder / "sync")
        assert sync_state.is_completed(), sync_state.message
    return {"async": folder / "async", "sync": folder / "sync", "tasks": tasks, "rerun_tasks": rerun_tasks}


def _sampled_by(run_dir: Path) -> list[tuple[int, str, str]]:
    """(step, policy folder, policy hash) of each step's rollouts."""
    return catalog_rows(run_dir, "SELECT DISTINCT step, policy, policy_hash FROM rollouts ORDER BY step")


def _checkpoint(run_dir: Path, updates: int) -> tuple[str, str]:
    path = run_dir / "checkpoints" / f"step_{updates:04d}"
    return str(path), dir_hash(path, TRAINING_STATE_FILES)


def test_async_rollouts_use_the_policy_one_update_behind(runs):
    run_dir = runs["async"]
    sampled = _sampled_by(run_dir)
    assert [step for step, _, _ in sampled] == list(range(STEPS))  # one policy per step
    start = sampled[0][1:]
    assert sampled[1][1:] == start  # step 1 was sampled while update 0 ran: the starting policy
    assert sampled[2][1:] == _checkpoint(run_dir, 1)  # step 2: the output of update 0
    assert start[0] not in {_checkpoint(run_dir, n)[0] for n in range(1, STEPS + 1)}


def test_steps_record_the_policy_lag_and_the_importance_weight(runs):
    rows = catalog_rows(runs["async"], "SELECT step, policy_lag, importance_weight_mean, response_tokens FROM steps "
                                       "ORDER BY step")
    assert [(step, lag) for step, lag, _, _ in rows] == [(0, 0), (1, 1), (2, 1)]
    assert all(trained > 0 and 0 < weight <= TIS_CAP for _, _, weight, trained in rows)  # grpo.tis_cap on
    sync = catalog_rows(runs["sync"], "SELECT step, policy_lag, importance_weight_mean FROM steps ORDER BY step")
    assert [(step, lag) for step, lag, _ in sync] == [(step, 0) for step in range(STEPS)]
    assert all(weight == pytest.approx(1.0, abs=1e-6) for _, _, weight in sync)  # on-policy: same numerics
    assert all(abs(weight - 1) > 1e-3 for _, lag, weight, _ in rows if lag)  # off-policy by one update


def _importance_weight_mean(policy: str, rows: list[tuple]) -> float:
    """Mean over response tokens of min(pi(policy) / pi_rollout, TIS_CAP) (grpo.tis_level token, tis_mode
    truncate, tis_floor 0), pi computed by hand from the policy folder's model in fp32."""
    import torch

    from refiner_core.models import load_model

    model, weights = load_model(policy).eval(), []
    for prompt, response, rollout_logprobs, temperature in rows:
        ids = torch.tensor([list(prompt) + list(response)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        weights.append(torch.exp(logp - torch.tensor(rollout_logprobs)).clamp(max=TIS_CAP))
    return torch.cat(weights).mean().item()


def test_lagged_samples_are_weighted_against_the_policy_that_trains_on_them(runs):
    """Step 1 was sampled by the starting policy and trained by the output of update 0: its importance weight
    mean is the hand-computed one against that output (every rollout trained, no group filter)."""
    run_dir = runs["async"]
    rows = catalog_rows(run_dir, "SELECT prompt_token_ids, response_token_ids, response_logprobs, temperature "
                                 "FROM rollouts WHERE step = 1 ORDER BY prompt_id, sample_idx")
    [(weight, tokens)] = catalog_rows(run_dir, "SELECT importance_weight_mean, response_tokens FROM steps "
                                               "WHERE step = 1")
    assert tokens == sum(len(response) for _, response, _, _ in rows)
    trained_from = _checkpoint(run_dir, 1)[0]
    assert weight == pytest.approx(_importance_weight_mean(trained_from, rows), abs=1e-4)
    sampled_by = _sampled_by(run_dir)[1][1]
    assert abs(weight - _importance_weight_mean(sampled_by, rows)) > 1e-3  # the lag shows in the weight


def test_sync_rollouts_use_the_previous_update(runs):
    run_dir = runs["sync"]
    sampled = _sampled_by(run_dir)
    assert [s[1:] for s in sampled[1:]] == [_checkpoint(run_dir, n) for n in range(1, STEPS)]
    assert sampled[0][1:] == _sampled_by(runs["async"])[0][1:]  # both start from the same policy


def test_an_async_rerun_is_cached_for_every_stage(runs):
    stages = {name for name in runs["rerun_tasks"] if name.split("[")[0] in STAGES}
    assert stages == {name for name in runs["tasks"] if name.split("[")[0] in STAGES}
    assert {f"rollout[step={n}]" for n in range(STEPS)} <= stages
    assert {runs["rerun_tasks"][name][0] for name in stages} == {"Cached"}, runs["rerun_tasks"]


def test_preflight_checks_async_steps(tiny_recipe):
    def problems(**changes) -> list[str]:
        recipe = json.loads(json.dumps(tiny_recipe))
        for key, value in changes.items():
            section, field = key.split("__")
            recipe[section][field] = value
        return check_values(recipe_from_dict(recipe))

    assert any(p.startswith("grpo.async_steps = -1") for p in problems(grpo__async_steps=-1))
    assert any("run.save_every must be 1" in p for p in problems(grpo__async_steps=1, run__save_every=2))
    assert any("dynamic_sampling" in p for p in problems(grpo__async_steps=1, rollout__dynamic_sampling=True))
    assert not any("async_steps" in p for p in problems(grpo__async_steps=2))


def test_an_update_waits_while_a_rollout_engine_copies_the_learner(tiny_model_path, tiny_tokenizer, tmp_path):
    """A rollout sampled ahead syncs from the live learner in a worker thread: the update that would change those
    weights cannot take the learner until the copy is done."""
    from refiner_core.learners.torch_learner import make_torch_learner
    from refiner_core.rollout.base import make_engine

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    live.open_run(run_dir, owner="test")
    try:
        model = str(tiny_model_path)
        settings = learner_settings()
        learner = make_torch_learner(model, model, tiny_tokenizer, settings, None)
        key = live.learner_key("torch", model, {"path": model, "hash": "base"}, settings, "float32")
        live.keep_learner(run_dir, key, learner, "weights-held")
        engine, copying, finish = make_engine("hf", model, 8), threading.Event(), threading.Event()
        load = engine.load_weights

        def paused_load(weights):
            copying.set()
            assert finish.wait(30)
            load(weights)

        engine.load_weights = paused_load
        policy = {"path": str(tmp_path / "step_0001"), "hash": "weights-held", "model": model, "unsaved": True}
        acquired, taken = [], []
        rollout = threading.Thread(target=lambda: acquired.append(
            live.rollout_engine(run_dir, "engine", policy, lambda path: engine)[1]))
        rollout.start()
        assert copying.wait(30)
        update = threading.Thread(target=lambda: taken.append(live.take_learner(run_dir, key, "weights-held")))
        update.start()
        update.join(0.5)
        assert update.is_alive() and not taken  # waits for the copy
        finish.set()
        rollout.join(30)
        update.join(30)
        assert taken == [learner]
        assert acquired[0].how == "synced" and acquired[0].source == "learner's memory"
    finally:
        live.close_run(run_dir)
