"""run.save_every: checkpoints every N steps, the weights in between only in the live learner. A run saving every
2nd step gives the tables and final weights of one saving every step; a run interrupted between saves writes the
unsaved weights as it ends and its rerun resumes from them; a run killed between saves (nothing written) is rerun
by recomputing the unsaved updates (seeded: the same weights, the same hashes) instead of reusing cache entries
that name weights nobody holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, catalog_rows, run_cli
from refiner_core.config import recipe_from_dict
from refiner_core.preflight import check_values
from refiner_core.runtime import live, live_learner
from refiner_core.runtime.identity import weights_hash
from refiner_core.runtime.unsaved_weights import WRITTEN_AT_CLOSE, mark_recorded
from tasks.stage import damaged_outputs

STEPS = 3


def _recipe(tiny_recipe: dict, save_every: int, **run) -> dict:
    """The tiny recipe, smaller: 3 steps of 2 prompts x 2 samples, every step checkpoint kept (keep_last 0)."""
    return {
        **tiny_recipe,
        "run": {**tiny_recipe["run"], "save_every": save_every, "keep_last": 0, **run},
        "rollout": {**tiny_recipe["rollout"], "prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 12},
        "grpo": {**tiny_recipe["grpo"], "steps": STEPS},
    }


def _pipeline(recipe: dict, run_dir: Path):
    from flows.refiner import refiner_pipeline

    return refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)


def _results(run_dir: Path, policy_hash: bool) -> dict:
    hashes = "policy_hash, " if policy_hash else ""  # a step between saves names its weights by another hash
    return {
        "rollouts": catalog_rows(
            run_dir,
            f"SELECT step, prompt_id, sample_idx, {hashes}response_token_ids, "
            "response_logprobs FROM rollouts ORDER BY ALL",
        ),
        "rewards": catalog_rows(
            run_dir, "SELECT step, prompt_id, sample_idx, reward_version, reward FROM rewards ORDER BY ALL"
        ),
        "steps": catalog_rows(run_dir, "SELECT step, loss, kl, grad_norm, reward_mean FROM steps ORDER BY step"),
        "weights": load_file(str(run_dir / "checkpoints" / f"step_{STEPS:04d}" / "model.safetensors")),
    }


def _same(a: dict, b: dict) -> None:
    for table in ("rollouts", "rewards", "steps"):
        assert len(a[table]) == len(b[table]) > 0, table
        assert a[table] == b[table], table
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def _recomputed(run_dir: Path) -> list[str]:
    """The stages whose cached results the newest run of the folder found damaged."""
    newest = sorted((run_dir / "logs").glob("run-*.log"))[-1].read_text()
    return [
        line.split(": cached result refers")[0].split()[-1]
        for line in newest.splitlines()
        if ": cached result refers to missing or changed files" in line
    ]


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.mark.slow
def test_save_every_2_equals_saving_every_step_and_a_lost_learner_recomputes(api_env, tiny_recipe, tmp_path):
    every, second = tmp_path / "every", tmp_path / "second"
    interrupted, killed = tmp_path / "interrupted", tmp_path / "killed"
    assert _pipeline(_recipe(tiny_recipe, 1), every).is_completed()
    assert _pipeline(_recipe(tiny_recipe, 2), second).is_completed()
    assert _checkpoints(every) == ["step_0001", "step_0002", "step_0003"]
    assert _checkpoints(second) == ["step_0002", "step_0003"]  # every 2nd step, and the last
    assert not (second / "checkpoints" / "step_0002" / "optimizer.pt").exists()  # only with the newest
    assert (second / "checkpoints" / "step_0003" / "optimizer.pt").exists()
    uninterrupted = _results(second, policy_hash=True)
    _same(_results(second, policy_hash=False), _results(every, policy_hash=False))
    unsaved = catalog_rows(second, "SELECT DISTINCT policy, policy_hash FROM rollouts WHERE step = 1")
    assert unsaved == [(str(second / "checkpoints" / "step_0001"), unsaved[0][1])]  # the checkpoint not written
    assert unsaved[0][1].startswith("weights-")  # named by the state dict's hash

    # Ctrl-C after step 0's update, whose weights are only in memory: the run's end writes them to step_0001,
    # marked with the hash its manifest names, and the rerun resumes from them (nothing recomputed).
    overrides = [
        f"--set={k}={v}"
        for k, v in (
            ("run.save_every", 2),
            ("run.keep_last", 0),
            ("run.retries", 0),
            ("rollout.prompts_per_step", 2),
            ("rollout.samples_per_prompt", 2),
            ("rollout.max_new_tokens", 12),
            ("grpo.steps", STEPS),
        )
    ]
    cli = ["run", str(REPO / "recipes" / "tiny.yaml"), *overrides, "--run-dir"]
    code, _, err, _ = run_cli([*cli, str(interrupted)], tmp_path, {**api_env, "REFINER_INTERRUPT_ONCE": "rollout@1"})
    assert code == 130, err[-3000:]
    assert "run ended between saves (run.save_every): weights weights-" in err
    assert _checkpoints(interrupted) == ["step_0001"]
    assert (interrupted / "checkpoints" / "step_0001" / WRITTEN_AT_CLOSE).read_text() == unsaved[0][1]
    code, _, err, _ = run_cli([*cli, str(interrupted)], tmp_path, api_env)
    assert code == 0, err[-3000:]
    assert _recomputed(interrupted) == []
    newest = sorted((interrupted / "logs").glob("run-*.log"))[-1].read_text()
    assert "grpo-update step 1: learner loaded from " + str(interrupted / "checkpoints" / "step_0001") in newest
    _same(_results(interrupted, policy_hash=True), uninterrupted)

    # Killed after step 0's update (no cleanup, like SIGKILL): step 0's weights are nowhere, and the rerun may not
    # take its cached update. The rerun recomputes it, saves step_0002, and is killed again; step 0's weights are
    # still nowhere, but step_0002 was saved from them: nothing needs them again.
    for code_wanted, recomputed, checkpoints in (
        (137, [], []),
        (137, ["grpo-update"], ["step_0002"]),
        (0, [], ["step_0002", "step_0003"]),
    ):
        code, _, err, _ = run_cli(
            [*cli, str(killed)], tmp_path, {**api_env, "REFINER_KILL_ONCE": "rollout@1,rollout@2"}
        )
        assert code == code_wanted, err[-3000:]
        assert _recomputed(killed) == recomputed
        assert _checkpoints(killed) == checkpoints
    _same(_results(killed, policy_hash=True), uninterrupted)  # the recomputed update made the same weights

    # Killed after step 1's update wrote step_0002, before its result was stored: step_0002 does not stand for step
    # 0's weights (step 1's update runs again, from them), so step 0's update is recomputed first.
    after_save = tmp_path / "after_save"
    env = {**api_env, "REFINER_KILL_ONCE": "grpo-update@1:end"}
    code, _, err, _ = run_cli([*cli, str(after_save)], tmp_path, env)
    assert code == 137 and _checkpoints(after_save) == ["step_0002"], err[-3000:]
    code, _, err, _ = run_cli([*cli, str(after_save)], tmp_path, api_env)
    assert code == 0, err[-3000:]
    assert _recomputed(after_save) == ["grpo-update"]
    _same(_results(after_save, policy_hash=True), uninterrupted)


@pytest.mark.slow
def test_a_longer_rerun_keeps_the_updates_that_ran_and_equals_a_run_of_that_length(
    api_env, tiny_recipe, tmp_path, info_logs
):
    """Which updates save follows grpo.steps (the last one does): a 3-step run saved step 2's update, a 4-step run
    leaves it unsaved. That is how the result is kept, not what it is, so the longer rerun takes it from the cache
    (it recomputed it from step_0002, whose optimizer state the newest checkpoint had taken, and trained on from a
    fresh AdamW) and its steps equal a 4-step run's."""
    longer, fresh = tmp_path / "longer", tmp_path / "fresh"
    assert _pipeline(_recipe(tiny_recipe, 2), longer).is_completed()
    four = {**_recipe(tiny_recipe, 2), "grpo": {**tiny_recipe["grpo"], "steps": 4}}
    assert _pipeline(four, longer).is_completed()
    newest = sorted((longer / "logs").glob("run-*.log"))[-1].read_text()
    assert "Task run 'grpo-update[step=2]' - Finished in state Cached" in newest
    assert "AdamW starts afresh" not in newest
    assert _pipeline(four, fresh).is_completed()
    steps = "SELECT step, loss, kl, grad_norm, reward_mean FROM steps ORDER BY step"
    assert catalog_rows(longer, steps) == catalog_rows(fresh, steps)

    # The other way: the 4-step run left step 2's update unsaved; a 3-step rerun needs it written (the run's
    # result). Its cached result named weights nobody holds and the run ended with no step_0003 on disk.
    assert not (fresh / "checkpoints" / "step_0003").exists()
    assert _pipeline(_recipe(tiny_recipe, 2), fresh).is_completed()
    newest = sorted((fresh / "logs").glob("run-*.log"))[-1].read_text()
    assert "step_0003 (never saved; this run needs it written)" in newest
    assert "Task run 'grpo-update[step=1]' - Finished in state Cached" in newest
    [(checkpoint,)] = catalog_rows(fresh, "SELECT checkpoint FROM steps WHERE step = 2")
    assert (fresh / "checkpoints" / "step_0003" / "model.safetensors").is_file() and checkpoint.endswith("step_0003")


def test_unsaved_weights_are_intact_only_while_held_or_saved_later(tmp_path):
    """An update's cached manifest naming weights never written is damaged unless the run's live learner holds
    them, or a later step checkpoint was saved from them."""

    class Learner:
        def weights(self):
            return {"w": torch.arange(4, dtype=torch.bfloat16)}

        def close(self):
            pass

    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "step_0001"
    held = weights_hash(Learner().weights())
    assert held == weights_hash({"w": torch.arange(4, dtype=torch.bfloat16)})
    assert held != weights_hash({"w": torch.arange(4, dtype=torch.float32)})
    manifest = {"policy": {"path": str(checkpoint), "hash": held, "model": "base", "unsaved": True}}
    assert damaged_outputs(manifest, str(run_dir)) == [f"{checkpoint} (never saved; no live learner holds it)"]

    live.open_run(run_dir, owner="test")
    try:
        assert live_learner.keep_learner(run_dir, "key", Learner(), held)
        assert damaged_outputs(manifest, str(run_dir)) == []
        live_learner.keep_learner(run_dir, "key", Learner(), "other weights")
        assert damaged_outputs(manifest, str(run_dir)) != []
    finally:
        live.close_run(run_dir)
    later = run_dir / "checkpoints" / "step_0002"
    later.mkdir(parents=True)  # saved after step_0001's weights, by an update killed before its result was stored
    # an earlier run of the folder pruned a checkpoint of that name: not these weights, which nothing holds
    (run_dir / "checkpoints" / "pruned.json").write_text(json.dumps([str(checkpoint)]))
    assert damaged_outputs(manifest, str(run_dir)) != []
    mark_recorded({"policy": {"path": str(later), "hash": "h"}})
    assert damaged_outputs(manifest, str(run_dir)) == []


@pytest.mark.slow
def test_a_rerun_killed_between_saves_recomputes_over_an_earlier_runs_checkpoints(api_env, tmp_path):
    """A 4-step run saves every step and prunes steps 1 and 2 (run.keep_last 2). A rerun with another learning rate
    and run.save_every 2, killed before step 1's rollout, leaves step 0's new weights nowhere. Neither the earlier
    run's pruned step_0001 nor its recorded step_0003 and step_0004, trained from other weights, stands for them:
    the next rerun recomputes step 0's update and finishes (every rerun failed: 'the weights of ... were never
    saved')."""
    cli = ["run", str(REPO / "recipes" / "tiny.yaml"), "--run-dir", str(tmp_path / "run")]
    small = [
        "--set=grpo.steps=4",
        "--set=run.retries=0",
        "--set=rollout.prompts_per_step=2",
        "--set=rollout.samples_per_prompt=2",
        "--set=rollout.max_new_tokens=12",
    ]
    code, _, err, _ = run_cli([*cli, *small], tmp_path, api_env)
    assert code == 0 and _checkpoints(tmp_path / "run") == ["step_0003", "step_0004"], err[-3000:]
    changed = [*small, "--set=grpo.learning_rate=3e-5", "--set=run.save_every=2"]
    code, _, err, _ = run_cli([*cli, *changed], tmp_path, {**api_env, "REFINER_KILL_ONCE": "rollout@1"})
    assert code == 137, err[-3000:]
    code, _, err, _ = run_cli([*cli, *changed], tmp_path, api_env)
    assert code == 0, err[-3000:]
    assert _recomputed(tmp_path / "run") == ["grpo-update"]


def test_save_every_needs_the_live_learner(tiny_recipe):
    problems = check_values(recipe_from_dict(_recipe(tiny_recipe, 2, keep_engines=False)))
    assert any(p.startswith("run.save_every = 2 keeps the weights") for p in problems), problems
    assert not any("save_every" in p for p in check_values(recipe_from_dict(_recipe(tiny_recipe, 2))))
    assert any(p.startswith("run.save_every = 0") for p in check_values(recipe_from_dict(_recipe(tiny_recipe, 0))))


def test_a_failed_update_between_saves_is_retried_from_the_live_learner(tiny_recipe, tmp_path, monkeypatch, info_logs):
    """run.save_every 2, where update 1 starts from weights only the live learner holds. Its first attempt fails
    before its training step (the learner goes back, weights as they were); its second once the training step
    returned, before its checkpoint and tables were written (a full disk, say: the learner holds the trained
    weights and what writing them needs); the third writes them without training again, then fails before its
    result was stored (the learner holds that result): the fourth takes it. Nothing is recomputed, and the run ends
    with the tables and weights of an uninterrupted one; before, the retry found no learner and the run failed."""
    plain, failed = tmp_path / "plain", tmp_path / "failed"
    assert _pipeline(_recipe(tiny_recipe, 2), plain).is_completed()
    monkeypatch.setenv("REFINER_FAIL_ONCE", "grpo-update@1:train,grpo-update@1:trained,grpo-update@1:end")
    state = _pipeline(_recipe(tiny_recipe, 2, retries=3), failed)
    assert state.is_completed(), state.message
    fired = sorted(p.name for p in (failed / ".faults").iterdir())
    assert fired == ["raise-grpo-update@1:end", "raise-grpo-update@1:train", "raise-grpo-update@1:trained"]
    log = sorted((failed / "logs").glob("run-*.log"))[-1].read_text()
    assert "grpo-update step 1: an earlier attempt trained this update and failed writing its outputs" in log
    assert "grpo-update step 1: an earlier attempt finished this update" in log
    assert log.count("grpo-update step 1: loss") == 1  # written by the third attempt, taken by the fourth
    _same(_results(failed, policy_hash=True), _results(plain, policy_hash=True))
