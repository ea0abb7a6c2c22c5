"""grpo.async_steps: the rollout of step N is sampled by the policy after max(N - K, 0) updates, beside the judge and
update of the steps before it; every stage stays cached, and K = 0 keeps the synchronous order. A rollout sampled
ahead that fails stops the run at its step, and the rerun resumes there with the tables of a run that never failed."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from conftest import TINY_ON_CPU, catalog_rows, learner_settings, math_rows_file
from refiner_core.config import EngineSettings, load_recipe, recipe_from_dict
from refiner_core.preflight import check_values
from refiner_core.reward.ground_truth import Verdict
from refiner_core.runtime import live, live_engines, live_learner
from refiner_core.store.checkpoints import TRAINING_STATE_FILES
from refiner_core.store.storage import dir_hash
from test_pipeline import STAGES, _run

REPO = Path(__file__).resolve().parents[1]
STEPS, TIS_CAP = 3, 2.0
LEARNING_RATE = 1e-2  # large: one update moves the policy far enough that a lagged sample's weight shows it


def _recipe(data: Path, *extra: str) -> dict:
    return load_recipe(
        REPO / "recipes" / "gt-grpo-math.yaml",
        [
            *TINY_ON_CPU,
            f"data.path={data}",
            "data.validation_fraction=0",
            "rollout.samples_per_prompt=2",
            "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=6",
            "rollout.batch_size=32",
            f"grpo.steps={STEPS}",
            "grpo.micro_batch_size=8",
            "eval.every=0",
            "run.keep_last=0",
            "run.save_every=1",
            "model.precision=fp32",
            "reward.verifier=alternating",
            f"grpo.learning_rate={LEARNING_RATE}",
            f"grpo.tis_cap={TIS_CAP}",
            *extra,
        ],
    ).to_dict()


def alternating_verifier():
    """Reward = sample_idx % 2: every group's rewards differ, so every update moves the policy."""

    def verify_step(rollouts: list[dict], prompts: dict[str, dict]) -> list[Verdict]:
        return [Verdict(float(r["sample_idx"] % 2), None, "alternating") for r in rollouts]

    return verify_step


@pytest.fixture(scope="module")
def runs(prefect_server, tmp_path_factory):
    from refiner_core.reward.verifiers import VERIFIERS

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
    rows = catalog_rows(
        runs["async"], "SELECT step, policy_lag, importance_weight_mean, response_tokens FROM steps ORDER BY step"
    )
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
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        weights.append(torch.exp(logp - torch.tensor(rollout_logprobs)).clamp(max=TIS_CAP))
    return torch.cat(weights).mean().item()


def test_lagged_samples_are_weighted_against_the_policy_that_trains_on_them(runs):
    """Step 1 was sampled by the starting policy and trained by the output of update 0: its importance weight
    mean is the hand-computed one against that output (every rollout trained, no group filter)."""
    run_dir = runs["async"]
    rows = catalog_rows(
        run_dir,
        "SELECT prompt_token_ids, response_token_ids, response_logprobs, temperature "
        "FROM rollouts WHERE step = 1 ORDER BY prompt_id, sample_idx",
    )
    [(weight, tokens)] = catalog_rows(
        run_dir, "SELECT importance_weight_mean, response_tokens FROM steps WHERE step = 1"
    )
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
        key = live_learner.learner_key("torch", model, {"path": model, "hash": "base"}, settings, "float32")
        live_learner.keep_learner(run_dir, key, learner, "weights-held")
        engine, copying, finish = (
            make_engine(model, EngineSettings.of(engine="hf", batch_size=8)),
            threading.Event(),
            threading.Event(),
        )
        load = engine.load_weights

        def paused_load(weights):
            copying.set()
            assert finish.wait(30)
            load(weights)

        engine.load_weights = paused_load
        policy = {"path": str(tmp_path / "step_0001"), "hash": "weights-held", "model": model, "unsaved": True}
        acquired, taken = [], []
        rollout = threading.Thread(
            target=lambda: acquired.append(
                live_engines.rollout_engine(run_dir, "engine", policy, lambda path: engine)[1]
            )
        )
        rollout.start()
        assert copying.wait(30)
        update = threading.Thread(target=lambda: taken.append(live_learner.take_learner(run_dir, key, "weights-held")))
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


TWO_AHEAD_STEPS = 4  # grpo.async_steps 2: steps 0-2 are sampled by the starting policy, step 3 by update 0's output


def _two_ahead_recipe(folder: Path, *extra: str) -> dict:
    return _recipe(
        math_rows_file(folder, 8), "grpo.async_steps=2", f"grpo.steps={TWO_AHEAD_STEPS}", "run.retries=0", *extra
    )


@pytest.fixture(scope="module")
def two_ahead(prefect_server, tmp_path_factory):
    """grpo.async_steps 2 over 4 steps with retries off: a run and its rerun."""
    from refiner_core.reward.verifiers import VERIFIERS

    folder = tmp_path_factory.mktemp("two-ahead")
    recipe, run_dir = _two_ahead_recipe(folder), folder / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(VERIFIERS, "alternating", "test_async_steps:alternating_verifier")
        state, tasks = _run(recipe, run_dir)
        assert state.is_completed(), state.message
        state, rerun_tasks = _run(recipe, run_dir)
        assert state.is_completed(), state.message
    return {"recipe": recipe, "run_dir": run_dir, "tasks": tasks, "rerun_tasks": rerun_tasks}


@pytest.fixture(scope="module")
def failed_ahead(prefect_server, tmp_path_factory):
    """grpo.async_steps 2 over 4 steps with retries off: a run that never fails; another whose rollout of step 2
    (sampled ahead while steps 0 and 1 are judged and trained) fails once, what that run left, and its rerun.
    tis_cap 0 leaves the updates their full size. The two folders share a name, so their rows name the same run."""
    from refiner_core.reward.verifiers import VERIFIERS

    folder = tmp_path_factory.mktemp("failed-ahead")
    recipe = _two_ahead_recipe(folder, "grpo.tis_cap=0")
    clean, failed = folder / "clean" / "failed-ahead", folder / "failed" / "failed-ahead"
    out = {"clean": clean, "failed": failed}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(VERIFIERS, "alternating", "test_async_steps:alternating_verifier")
        state, _ = _run(recipe, clean)
        assert state.is_completed(), state.message
        patch.setenv("REFINER_FAIL_ONCE", "rollout@2")
        out["failed_state"], out["failed_tasks"] = _run(recipe, failed)
        out["left"] = {
            "trained": catalog_rows(failed, "SELECT step FROM steps ORDER BY step"),
            "sampled": catalog_rows(failed, "SELECT DISTINCT step FROM rollouts ORDER BY step"),
            "checkpoints": sorted(p.name for p in (failed / "checkpoints").glob("step_*")),
            "rollout_folders": sorted(p.name for p in (failed / "rollouts").glob("step=*")),
        }
        state, out["resumed_tasks"] = _run(recipe, failed)  # the fault fired once already
        assert state.is_completed(), state.message
    return out


def test_two_steps_ahead_sample_with_the_policy_two_updates_behind(two_ahead):
    from refiner_core.models import resolve_model

    run_dir, recipe = two_ahead["run_dir"], two_ahead["recipe"]
    lags = catalog_rows(run_dir, "SELECT step, policy_lag FROM steps ORDER BY step")
    assert [lag for _, lag in lags] == [0, 1, 2, 2]  # min(N, 2)
    model = recipe["model"]
    base = resolve_model(model["policy"], model["max_position_embeddings"], recipe["run"]["seed"])
    starting = (str(base), dir_hash(base))  # what locate-model hands the flow
    assert _sampled_by(run_dir) == [(0, *starting), (1, *starting), (2, *starting), (3, *_checkpoint(run_dir, 1))]


def test_keep_last_keeps_the_policies_rollouts_sampled_ahead_read(prefect_server, tmp_path, monkeypatch):
    """grpo.async_steps 3 with run.keep_last 2: the rollout of step N reads the policy after N - 3 updates, so the
    newest 4 checkpoints stay (with 2, a rollout slower than judge and update found its checkpoint pruned, and every
    rerun failed on it)."""
    from refiner_core.reward.verifiers import VERIFIERS

    monkeypatch.setitem(VERIFIERS, "alternating", "test_async_steps:alternating_verifier")
    recipe = _recipe(math_rows_file(tmp_path, 8), "grpo.async_steps=3", "grpo.steps=5", "run.keep_last=2")
    state, _ = _run(recipe, tmp_path / "run")
    assert state.is_completed(), state.message
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert kept == ["step_0002", "step_0003", "step_0004", "step_0005"]


def test_a_rerun_two_steps_ahead_is_cached_for_every_stage(two_ahead):
    stages = {name for name in two_ahead["tasks"] if name.split("[")[0] in STAGES}
    assert {f"{stage}[step={n}]" for stage in STAGES[2:] for n in range(TWO_AHEAD_STEPS)} <= stages
    assert {name: two_ahead["rerun_tasks"][name][0] for name in stages} == {name: "Cached" for name in stages}


def test_a_failed_rollout_sampled_ahead_fails_the_run_at_its_step(failed_ahead):
    """The rollout of step 2 failed while steps 0 and 1 were trained: the run fails when step 2 needs it, naming
    the stage and step; nothing from step 2 on is sampled or trained, and the rollout of step 3, queued behind it,
    never ran."""
    state, tasks = failed_ahead["failed_state"], failed_ahead["failed_tasks"]
    assert state.is_failed()
    assert "injected fault in stage 'rollout' (step 2)" in state.message, state.message
    assert tasks["rollout[step=2]"] == ("Failed", 1)  # retries off: one attempt
    assert tasks["grpo-update[step=1]"] == ("Completed", 1)
    assert tasks.get("rollout[step=3]", ("never created",))[0] != "Completed"
    assert not {f"{stage}[step={n}]" for stage in ("judge", "grpo-update") for n in (2, 3)} & tasks.keys()
    assert failed_ahead["left"] == {
        "trained": [(0,), (1,)],
        "sampled": [(0,), (1,)],
        "checkpoints": ["step_0001", "step_0002"],
        "rollout_folders": ["step=0", "step=1"],
    }


def _tables(run_dir: Path) -> dict[str, list[tuple]]:
    """Every row a run's steps produced, less paths and timings."""
    return {
        "rollouts": catalog_rows(
            run_dir,
            "SELECT step, prompt_id, sample_idx, policy_hash, response_token_ids, "
            "response_logprobs FROM rollouts ORDER BY ALL",
        ),
        "rewards": catalog_rows(
            run_dir, "SELECT step, prompt_id, sample_idx, reward_version, reward FROM rewards ORDER BY ALL"
        ),
        "advantages": catalog_rows(
            run_dir, "SELECT step, prompt_id, sample_idx, advantage, trained FROM advantages ORDER BY ALL"
        ),
        "steps": catalog_rows(
            run_dir,
            "SELECT step, policy_lag, loss, pg_loss, kl, grad_norm, reward_mean, "
            "importance_weight_mean, response_tokens FROM steps ORDER BY step",
        ),
    }


def test_the_rerun_after_a_failed_rollout_resumes_it_and_equals_a_run_that_never_failed(failed_ahead):
    from test_pipeline import _counts

    tasks = failed_ahead["resumed_tasks"]
    before = ["prepare-data", "ingest-rubrics"] + [f"{stage}[step={n}]" for stage in STAGES[2:] for n in (0, 1)]
    after = [f"{stage}[step={n}]" for stage in STAGES[2:] for n in (2, 3)]
    assert {name: tasks[name][0] for name in before} == {name: "Cached" for name in before}
    assert {name: tasks[name][0] for name in after} == {name: "Completed" for name in after}
    clean, resumed = failed_ahead["clean"], failed_ahead["failed"]
    assert _counts(resumed) == _counts(clean)
    assert _tables(resumed) == _tables(clean)  # the same samples, rewards and updates, bit for bit
    assert len(_tables(resumed)["steps"]) == TWO_AHEAD_STEPS


def _hand_loss(run_dir: Path, step: int, start: str, reference: str, grpo) -> dict[str, float]:
    """loss, pg_loss and kl of the update of `step`, recomputed in float64 from its stored batch: the rollouts the
    advantages table marks trained, with their advantages and engine log-probs; `start` holds the weights the
    update started from, `reference` the KL's reference. With one optimizer step (grpo.minibatches 1) pi_old is
    the starting policy itself, so rho = 1 and the clip cannot bind: per token pg = max(-A rho, -A clip(rho,
    1 - eps_low, 1 + eps_high)) * min(pi_old / pi_rollout, tis_cap), kl = k3 of log pi_old - log pi_ref clamped
    to +-kl_clamp; token_mean: every sum over the trained tokens divided by their count."""
    import torch

    from refiner_core.models import load_model
    from refiner_core.store.storage import query

    _, rows = query(
        run_dir / "catalog.duckdb",
        """
        SELECT r.prompt_token_ids, r.response_token_ids, r.response_logprobs, r.temperature, a.advantage
        FROM rollouts r JOIN advantages a USING (run, step, prompt_id, sample_idx)
        WHERE r.step = ? AND a.reward_version = 'train' AND a.trained ORDER BY r.prompt_id, r.sample_idx""",
        [step],
    )
    policy, ref = load_model(start, "float64").eval(), load_model(reference, "float64").eval()
    pg, kl = [], []
    for prompt, response, rollout_logprobs, temperature, advantage in rows:
        ids, picked = torch.tensor([list(prompt) + list(response)]), torch.tensor(response)[:, None]
        with torch.no_grad():
            logp, ref_logp = (
                torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature, -1).gather(
                    -1, picked
                )[:, 0]
                for model in (policy, ref)
            )
        ratio = torch.exp(logp - logp)  # pi / pi_old with pi_old = pi
        surrogate = torch.maximum(
            -advantage * ratio, -advantage * ratio.clamp(1 - grpo.clip_eps_low, 1 + grpo.clip_eps_high)
        )
        weight = torch.exp(logp - torch.tensor(rollout_logprobs, dtype=torch.float64)).clamp(max=grpo.tis_cap)
        d = (logp - ref_logp).clamp(-grpo.kl_clamp, grpo.kl_clamp)
        pg.append(surrogate * weight)
        kl.append(torch.exp(-d) - 1 + d)
    pg_sum, kl_sum, tokens = torch.cat(pg).sum().item(), torch.cat(kl).sum().item(), sum(len(p) for p in pg)
    return {"loss": (pg_sum + grpo.beta * kl_sum) / tokens, "pg_loss": pg_sum / tokens, "kl": kl_sum / tokens}


def test_the_loss_of_a_lagged_step_equals_a_hand_computation_on_its_stored_batch(two_ahead):
    """Steps 1-3 were sampled one or two updates behind the policy that trained on them: steps.loss, pg_loss and
    kl equal the float64 hand computation against the checkpoint each update started from, within 1e-6 (the
    learner computes log-probs in fp32: a few 1e-7 of rounding on values near log(vocab) = 7.6 per token, then
    averaged; measured 4e-8). With the sampling policy in place of that checkpoint they differ by more than 1e-3
    (measured: kl by 0.02 to 0.05, pg_loss by 0.004 to 0.036): the stale samples were scored by the trained
    policy."""
    cfg = recipe_from_dict(two_ahead["recipe"])
    grpo = cfg.grpo
    assert (
        grpo.policy_loss,
        grpo.loss_aggregation,
        grpo.kl_estimator,
        grpo.minibatches,
        grpo.tis_level,
        grpo.tis_mode,
        grpo.tis_floor,
        grpo.entropy_coef,
    ) == ("ppo_clip", "token_mean", "k3", 1, "token", "truncate", 0.0, 0.0)  # what _hand_loss computes
    assert grpo.beta > 0 and grpo.tis_cap == TIS_CAP and not cfg.model.reference  # the KL is against the start
    run_dir = two_ahead["run_dir"]
    sampled_by = {step: policy for step, policy, _ in _sampled_by(run_dir)}
    start = sampled_by[0]
    metrics = catalog_rows(
        run_dir, "SELECT step, policy_lag, loss, pg_loss, kl FROM steps WHERE policy_lag > 0 ORDER BY step"
    )
    assert [step for step, *_ in metrics] == [1, 2, 3]
    for step, lag, *recorded in metrics:
        trained_from = _checkpoint(run_dir, step)[0]
        assert sampled_by[step] == (start if step - lag == 0 else _checkpoint(run_dir, step - lag)[0])
        recorded = dict(zip(("loss", "pg_loss", "kl"), recorded))
        hand = _hand_loss(run_dir, step, trained_from, start, grpo)
        assert recorded == pytest.approx(hand, abs=1e-6, rel=0), step
        stale = _hand_loss(run_dir, step, sampled_by[step], start, grpo)
        assert max(abs(recorded[name] - stale[name]) for name in recorded) > 1e-3, step


def _ends(flow_run_id) -> tuple[object, dict[str, object]]:
    """When the flow run ended (its final state, set once the flow function returned and gave its folder back,
    as the end hooks close the run's engines), and when each of its task runs did."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200
        )
    return flow_run.end_time, {r.name: r.end_time for r in task_runs}


def test_a_run_failing_beside_a_rollout_sampled_ahead_ends_after_it(prefect_server, tmp_path, monkeypatch):
    """The update of step 0 fails while the rollout of step 1 samples ahead in a worker thread: the run waits for
    that rollout before it gives its folder back and its end hooks close the engines, so no stage of a failed run
    outlives it; the finished rollout is cached for the rerun."""
    from refiner_core.reward.verifiers import VERIFIERS

    monkeypatch.setitem(VERIFIERS, "alternating", "test_async_steps:alternating_verifier")
    monkeypatch.setenv("REFINER_FAIL_ONCE", "grpo-update@0")
    # generations long enough that the rollout of step 1 still samples when the update of step 0 starts
    recipe = _recipe(
        math_rows_file(tmp_path, 8), "grpo.async_steps=1", "grpo.steps=2", "run.retries=0", "rollout.max_new_tokens=320"
    )
    state, tasks = _run(recipe, tmp_path / "run")
    assert state.is_failed() and "injected fault in stage 'grpo-update' (step 0)" in state.message, state.message
    assert tasks["rollout[step=1]"][0] == "Completed"
    flow_end, task_ends = _ends(state.state_details.flow_run_id)
    assert max(task_ends.values()) <= flow_end, {name: end for name, end in task_ends.items() if end > flow_end}
    state, tasks = _run(recipe, tmp_path / "run")
    assert state.is_completed(), state.message
    assert tasks["rollout[step=1]"][0] == "Cached"


def test_a_rollout_sampled_ahead_samples_what_it_samples_alone(tiny_model_path, tiny_tokenizer):
    """A rollout sampled ahead runs in a worker thread (seeding torch's process-wide generator, then drawing from
    it) while the update of an earlier step runs: the update must leave that generator alone, or a step sampled
    again (its cached outputs gone, a fresh run of the recipe) gets other responses than the first time."""
    from refiner_core.learners.base import TrainSample
    from refiner_core.learners.torch_learner import make_torch_learner
    from refiner_core.rollout.base import SamplingParams, make_engine

    engine = make_engine(str(tiny_model_path), EngineSettings.of(engine="hf", batch_size=32))
    prompts, params = [[1, 2, 3, 4], [5, 6, 7]], SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=7)
    learner = make_torch_learner(tiny_model_path, tiny_model_path, tiny_tokenizer, learner_settings(), None)
    batch = [TrainSample([1, 2, 3], [4, 5], adv, [-1.0, -1.0]) for adv in (1.0, -1.0)]

    def sample(into: list, done: threading.Event) -> None:
        try:
            into.append([g.token_ids for g in engine.generate(prompts, params)])
        finally:
            done.set()

    alone: list = []
    sample(alone, threading.Event())
    for _ in range(3):
        beside, done = [], threading.Event()
        worker = threading.Thread(target=sample, args=(beside, done))
        worker.start()
        while not done.is_set():
            learner.train_step(batch)
        worker.join()
        assert beside == alone
