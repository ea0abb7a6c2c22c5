"""`refiner fork` on the tiny recipe: a fork runs its parent's recipe before the fork step, served from the parent's
stage cache (`Cached`, hard-linked files, identical tables), and its own settings from the fork step; a setting the
stages before step 0 read makes it share no step and says which; a fork of a fork reuses both; the parent folder
is never written; forks that cannot be made are refused before anything runs."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import duckdb
import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import REPO, RUN_TABLES, table_key
from flows.cli import app
from flows.run_folder import ForkError, plan_fork
from refiner_core.config import load_recipe
from refiner_core.store.checkpoints import step_checkpoints
from refiner_core.store.forks import Fork, changed_before_steps, read_fork, shared_disk, trunk_segments, write_fork

TABLES = {table: table_key(table) for table in RUN_TABLES}  # table -> its key, to compare rows in order


def _task_states(flow_run_id) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200)
    return {r.name: r.state.name for r in runs}


def _run(recipe: dict, run_dir: Path):
    from flows.refiner import refiner_pipeline

    state = refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    return _task_states(state.state_details.flow_run_id)


def _fork(parent: Path, new: Path, at: int, overrides: list[str]):
    cfg, record = plan_fork(parent, new, at, overrides)
    new.mkdir(parents=True, exist_ok=True)
    write_fork(record)
    return record, _run(cfg.to_dict(), new)


def _rows(run_dir: Path, table: str, where: str = "") -> list[tuple]:
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    try:
        return con.execute(f"SELECT * EXCLUDE (run) FROM {table} {where} ORDER BY {TABLES[table]}").fetchall()
    finally:
        con.close()


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def parent(prefect_server, tiny_model_path, tmp_path_factory):
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml").to_dict()
    run_dir = tmp_path_factory.mktemp("parent").resolve()
    _run(recipe, run_dir)
    return run_dir


def test_fork_reuses_the_steps_before_it_and_trains_on_with_its_settings(parent, tmp_path):
    before = _snapshot(parent)
    fork_dir = tmp_path / "lr"
    record, states = _fork(parent, fork_dir, 1, ["grpo.learning_rate=0.01"])
    assert record.shares_steps and record.settings == ["grpo.learning_rate=0.01"] and record.run == "lr"
    for name in ("prepare-data", "ingest-rubrics", "rollout[step=0]", "judge[step=0]", "grpo-update[step=0]"):
        assert states[name] == "Cached", (name, states)
    assert states["grpo-update[step=1]"] == "Completed"  # the new learning rate
    # step 1's rollout and judgments read the same policy and settings as the parent's: the cache reuses them too
    assert states["rollout[step=1]"] == states["judge[step=1]"] == "Cached"
    for table in TABLES:
        where = "" if table in ("prompts", "rubrics") else "WHERE step < 1"
        assert _rows(fork_dir, table, where) == _rows(parent, table, where), table
    assert _rows(fork_dir, "steps", "WHERE step = 1") != _rows(parent, "steps", "WHERE step = 1")
    con = duckdb.connect(str(fork_dir / "catalog.duckdb"), read_only=True)
    assert con.execute("SELECT DISTINCT run FROM rollouts").fetchall() == [("lr",)]
    assert con.execute("SELECT parent_run, fork_step, settings, shares_steps FROM forks").fetchall() == [
        (parent.name, 1, "--set grpo.learning_rate=0.01", True)
    ]
    assert con.execute("SELECT lr FROM steps ORDER BY step").fetchall() == [(1e-3,), (0.01,)]
    con.close()
    for shared in ("rollouts/step=0/rollouts.parquet", "scores/step=0/rewards.parquet", "checkpoints/step_0001"):
        target = fork_dir / shared
        files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.is_file())
        assert files and all(os.path.samefile(f, parent / f.relative_to(fork_dir)) for f in files), shared
    assert not os.path.samefile(
        fork_dir / "checkpoints/step_0002/model.safetensors", parent / "checkpoints/step_0002/model.safetensors"
    )
    disk = shared_disk(parent, fork_dir)
    assert disk["shared"] > 0 and disk["own"] > 0
    card = (fork_dir / "checkpoints/step_0002/README.md").read_text()
    assert f"is a fork of run `{parent.name}`" in card and "at step 1" in card
    assert _snapshot(parent) == before  # nothing of the parent was written or touched

    from refiner_core.reward.rescore import rescore_run

    recipe = load_recipe(fork_dir / "recipe.yaml")  # rescoring a fork covers its parent's steps too, under its name
    version, rescored = rescore_run(fork_dir, recipe, load_recipe(fork_dir / "recipe.yaml", ["reward.format_weight=2"]))
    assert [s.rollouts for s in rescored] == [16, 16]
    con = duckdb.connect(str(fork_dir / "catalog.duckdb"), read_only=True)
    assert con.execute(
        "SELECT DISTINCT run, stale FROM step_rewards WHERE reward_version = ?", [version]
    ).fetchall() == [("lr", False)]
    con.close()
    assert _snapshot(parent) == before

    rerun = _run(load_recipe(fork_dir / "recipe.yaml").to_dict(), fork_dir)  # resuming a fork: all Cached
    assert {s for n, s in rerun.items() if n.split("[")[0] in ("rollout", "judge", "grpo-update")} == {"Cached"}

    nested = tmp_path / "lr-again"  # a fork of the fork, changing nothing: every stage comes from an ancestor
    record, states = _fork(fork_dir, nested, 1, [])
    assert record.parent_run == "lr" and record.settings == []
    assert {s for n, s in states.items() if n.split("[")[0] in ("rollout", "judge", "grpo-update")} == {"Cached"}, (
        states
    )
    assert _rows(nested, "steps") == _rows(fork_dir, "steps")
    assert _snapshot(parent) == before
    # the difficulty ledger counts each rollout once: step 1's rollout too is the parent's, in both forks
    from refiner_core.publish.run_sql import copied_steps

    catalogs = [folder / "catalog.duckdb" for folder in (parent, fork_dir, nested)]
    assert copied_steps(catalogs) == [{"run": "lr", "lo": 0, "hi": 2}, {"run": "lr-again", "lo": 0, "hi": 2}]

    shown = CliRunner().invoke(app, ["show", str(fork_dir)])
    assert f"fork of {parent.name} ({parent}) at step 1: steps 0-0 are {parent.name}'s" in shown.output


def test_a_setting_read_before_step_0_shares_no_step_and_says_which(parent, tmp_path):
    record, states = _fork(parent, tmp_path / "split", 0, ["data.validation_fraction=0.3", "grpo.steps=1"])
    assert not record.shares_steps
    assert "data.validation_fraction changed" in record.note and "no step of" in record.note
    assert states["prepare-data"] == "Completed" and states["rollout[step=0]"] == "Completed"
    assert changed_before_steps(
        load_recipe(parent / "recipe.yaml").to_dict(), load_recipe(parent / "recipe.yaml", ["run.seed=1"]).to_dict()
    ) == ["run.seed"]


def test_a_fork_resumed_or_run_with_a_setting_read_before_step_0_is_refused(parent, tmp_path, api_env):
    """A fork's steps before its fork step run with its parent's recipe: the same fork command again with another
    data split, or `refiner run` of its folder with one, would keep the parent's split there (it did, silently,
    and recorded the new value in recipe.yaml). Both are refused, saying what to do; without the change both go."""
    from conftest import run_cli

    fork_dir, settings = tmp_path / "fork", ["grpo.steps=2", "grpo.learning_rate=0.01"]
    _fork(parent, fork_dir, 1, settings)
    with pytest.raises(ForkError, match=r"data.validation_fraction changed from it: the stages before step 0 read"):
        plan_fork(parent, fork_dir, 1, [*settings, "data.validation_fraction=0.5"])
    assert plan_fork(parent, fork_dir, 1, settings)[1].shares_steps
    recipe = ["run", str(REPO / "recipes" / "tiny.yaml"), "--run-dir", str(fork_dir)]
    recipe += [f"--set={s}" for s in settings]
    code, _, err, _ = run_cli([*recipe, "--set=data.validation_fraction=0.5"], tmp_path, api_env)
    assert code == 2 and f"refiner fork {parent} NEW --at 1 --set ..." in err, err[-2000:]
    assert "validation_fraction: 0.5" not in (fork_dir / "recipe.yaml").read_text()


def test_a_fork_into_a_folder_an_earlier_run_left_reuses_its_parent(parent, tmp_path):
    """A run of the parent's recipe in the folder, removed, then a fork into it: the stages before the fork step
    have keys that run's records hold, naming its deleted files. The parent's results serve (hard-linked), not a
    recomputation of them."""
    import shutil

    folder = tmp_path / "used"
    _run(load_recipe(REPO / "recipes" / "tiny.yaml").to_dict(), folder)
    shutil.rmtree(folder)
    _, states = _fork(parent, folder, 1, ["grpo.learning_rate=0.01"])
    assert states["rollout[step=0]"] == states["grpo-update[step=0]"] == "Cached", states
    rollouts = "rollouts/step=0/rollouts.parquet"
    assert os.path.samefile(folder / rollouts, parent / rollouts)


def test_a_fork_judges_its_own_steps_with_its_own_judge_settings(parent, tmp_path):
    """The step judge of a fork's own segment takes the fork's judge settings, not the ancestor's it ran before."""
    record, states = _fork(parent, tmp_path / "judge", 1, ["judge.max_response_chars=40"])
    assert record.shares_steps
    assert states["judge[step=0]"] == states["rollout[step=1]"] == "Cached"  # the parent's settings and policy
    assert states["judge[step=1]"] == "Completed", states  # its cache key holds 40: not the parent's judgment


def test_a_forks_judge_budget_prices_the_steps_it_shares_at_its_own_prices(parent, tmp_path):
    """A fork that sets judge prices and a budget over an unpriced parent: the step it shares counts at the fork's
    prices in the estimate of its first own step too (at the parent's, $0, that step ran past the budget)."""
    from flows.refiner import refiner_pipeline
    from refiner_core.judges.cost import JudgeBudgetExceeded

    con = duckdb.connect(str(parent / "catalog.duckdb"), read_only=True)
    [(tokens,)] = con.execute("SELECT judge_prompt_tokens FROM steps WHERE step = 0").fetchall()
    con.close()
    step0 = tokens * 1000.0 / 1e6
    budget = ["judge.price_per_mtok_in=1000", f"judge.budget_usd={1.5 * step0}"]
    cfg, record = plan_fork(parent, tmp_path / "priced", 1, ["rollout.temperature=0.9", *budget])
    (tmp_path / "priced").mkdir()
    write_fork(record)
    state = refiner_pipeline(recipe=cfg.to_dict(), run_dir=str(tmp_path / "priced"), return_state=True)
    assert state.is_failed()
    with pytest.raises(JudgeBudgetExceeded, match=r"spent over 1 step\(s\).*step 1 would cost about"):
        state.result()


def test_the_same_command_resumes_a_fork_after_its_parent_pruned_the_fork_step(
    prefect_server, tiny_model_path, tmp_path
):
    """The fork holds its own hard link of step_0001: the parent going on and pruning its copy (run.keep_last 2)
    does not stop the same command from resuming it from its own copy; a new fork there is still refused. The fork
    sampled step 1 before the parent did: its own rollout stands once the parent has one of the same inputs (the
    parent's was adopted over it, and the fork's update, whose input it is, ran again)."""
    small = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12"]
    parent, fork_dir, fork_settings = tmp_path / "p", tmp_path / "f", ["grpo.steps=2", "grpo.learning_rate=0.01"]
    _run(load_recipe(REPO / "recipes" / "tiny.yaml", [*small, "grpo.steps=1"]).to_dict(), parent)
    first, states = _fork(parent, fork_dir, 1, fork_settings)
    assert states["rollout[step=1]"] == "Completed"  # the parent has no step 1 yet
    _run(load_recipe(REPO / "recipes" / "tiny.yaml", [*small, "grpo.steps=4"]).to_dict(), parent)
    assert 1 not in step_checkpoints(parent / "checkpoints") and 1 in step_checkpoints(fork_dir / "checkpoints")
    record, states = _fork(parent, fork_dir, 1, fork_settings)
    stages = {s for n, s in states.items() if n.split("[")[0] in ("prepare-data", "rollout", "judge", "grpo-update")}
    assert stages == {"Cached"}, sorted(states.items())
    rollouts = "rollouts/step=1/rollouts.parquet"
    assert not os.path.samefile(fork_dir / rollouts, parent / rollouts)
    assert record.segments == first.segments  # the recipe it ran steps 0-0 with, not the parent's grpo.steps 4
    with pytest.raises(ForkError, match=r"step_0001 \(the policy after step 0\) was pruned.*--at 3, 4"):
        plan_fork(parent, tmp_path / "g", 1, fork_settings)


def test_a_fork_does_not_act_again_on_a_monitor_its_parent_failed_at(prefect_server, tiny_model_path, tmp_path):
    """The parent's kl_jump (action fail) tripped at step 1, failed it, and the run went on past it. A fork at 2 runs
    step 1 as the parent ran it: it records the event as the parent's (outcome 'inherited') and goes on; it failed
    there again."""
    from flows.refiner import refiner_pipeline

    small = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12"]
    monitor = ["monitors.kl_jump=0.1", "monitors.kl_jump_action=fail"]  # step 1's figure is about 0.36
    parent = tmp_path / "p"
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", [*small, *monitor, "grpo.steps=2"]).to_dict()
    failed = refiner_pipeline(recipe=recipe, run_dir=str(parent), return_state=True)
    assert failed.is_failed() and "monitor kl_jump tripped at step 1" in failed.message, failed.message
    _run(recipe, parent)  # goes on past the event it acted on
    _fork(parent, tmp_path / "f", 2, ["grpo.steps=3", "monitors.kl_jump_action=warn"])  # its own step 2 warns
    events = duckdb.connect(str(tmp_path / "f" / "catalog.duckdb"), read_only=True)
    try:
        outcome = events.execute("SELECT outcome FROM monitor_events WHERE step = 1 AND monitor = 'kl_jump'").fetchall()
    finally:
        events.close()
    assert outcome == [("inherited",)]


def test_the_same_command_resumes_a_fork_that_pruned_its_fork_step_as_its_parent_did(
    prefect_server, tiny_model_path, tmp_path
):
    """A 4-step fork at step 1 keeps its last 2 checkpoints, so its own step_0001 goes; the parent, run on to 4
    steps, prunes its copy too. The fork trained from it already: the same command resumes it, every stage Cached
    (it was refused: 'step_0001 ... was pruned')."""
    small = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12"]
    parent, fork_dir, fork_settings = tmp_path / "p", tmp_path / "f", ["grpo.steps=4", "grpo.learning_rate=0.01"]
    _run(load_recipe(REPO / "recipes" / "tiny.yaml", [*small, "grpo.steps=1"]).to_dict(), parent)
    _fork(parent, fork_dir, 1, fork_settings)
    _run(load_recipe(REPO / "recipes" / "tiny.yaml", [*small, "grpo.steps=4"]).to_dict(), parent)
    assert 1 not in step_checkpoints(parent / "checkpoints") and 1 not in step_checkpoints(fork_dir / "checkpoints")
    _, states = _fork(parent, fork_dir, 1, fork_settings)
    stages = {s for n, s in states.items() if n.split("[")[0] in ("prepare-data", "rollout", "judge", "grpo-update")}
    assert stages == {"Cached"}, sorted(states.items())


def test_the_same_command_resumes_a_fork_whose_parent_folder_is_gone(prefect_server, tiny_model_path, tmp_path):
    """With the parent folder deleted, `refiner fork` resumes the fork from what it holds (every stage Cached, its
    tables unchanged) with the recipe it recorded; a --set that would change that recipe, or a fork that never ran,
    is refused with the reason (exit 2)."""
    import shutil

    small = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12"]
    parent, fork_dir, fork_settings = tmp_path / "p", tmp_path / "f", ["grpo.steps=2", "grpo.learning_rate=0.01"]
    _run(load_recipe(REPO / "recipes" / "tiny.yaml", small).to_dict(), parent)
    _fork(parent, fork_dir, 1, fork_settings)
    before = {table: _rows(fork_dir, table) for table in ("rollouts", "steps")}
    shutil.rmtree(parent)
    record, states = _fork(parent, fork_dir, 1, fork_settings)
    stages = {s for n, s in states.items() if n.split("[")[0] in ("prepare-data", "rollout", "judge", "grpo-update")}
    assert stages == {"Cached"}, sorted(states.items())
    assert {table: _rows(fork_dir, table) for table in before} == before
    assert record.note == f"{parent} is gone: the fork resumes with the recipe it recorded"
    cli = CliRunner()
    changed = cli.invoke(app, ["fork", str(parent), str(fork_dir), "--at", "1", "--set", "grpo.learning_rate=0.02"])
    assert changed.exit_code == 2 and "changes grpo.learning_rate: run it with the --set settings" in changed.output
    never_ran = tmp_path / "g"
    never_ran.mkdir()
    write_fork(dataclasses.replace(record, run_dir=str(never_ran)))
    missing = cli.invoke(app, ["fork", str(parent), str(never_ran), "--at", "1"])
    assert missing.exit_code == 2 and "never ran: there is nothing to fork from" in missing.output
    other = cli.invoke(app, ["fork", str(tmp_path / "nowhere"), str(tmp_path / "h"), "--at", "1"])
    assert other.exit_code == 2 and "has no recipe.yaml: not a run folder" in other.output


def test_a_fork_stays_whole_when_its_parent_that_pruned_its_early_checkpoints_is_deleted(
    prefect_server, tiny_model_path, tmp_path
):
    """The parent (run.keep_last 2, 4 steps) pruned the checkpoints of steps 1 and 2 before the fork at 3 was made,
    and the fork's updates 0 and 1 name them. Once the parent folder is gone the fork still knows them pruned on
    purpose, so the same command recomputes nothing."""
    import shutil

    small = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12"]
    parent, fork_dir = tmp_path / "p", tmp_path / "f"
    _run(load_recipe(REPO / "recipes" / "tiny.yaml", [*small, "grpo.steps=4"]).to_dict(), parent)
    assert sorted(step_checkpoints(parent / "checkpoints")) == [3, 4]
    _fork(parent, fork_dir, 3, ["grpo.learning_rate=0.01"])
    shutil.rmtree(parent)
    for log in (fork_dir / "logs").iterdir():
        log.unlink()
    _fork(parent, fork_dir, 3, ["grpo.learning_rate=0.01"])
    [log] = (fork_dir / "logs").iterdir()
    assert "recomputing" not in log.read_text()


def test_a_lora_fork_stays_whole_when_its_parent_is_deleted(prefect_server, tiny_model_path, tmp_path):
    """LoRA adapters on the SFT warm start, forked at step 1: both adapter-only checkpoints of the fork (the step it
    shares and the step it trained) load on the fork's own hard-linked checkpoints/sft once the parent folder is
    gone. Both named the parent's checkpoints/sft, and loading them failed with the Hub's "Repo id" error."""
    import shutil

    from refiner_core.models import checkpoint_adapter, load_model

    small = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12"]
    lora = ["sft.epochs=1", "model.lora_rank=4", "model.lora_alpha=8"]
    parent, fork_dir = tmp_path / "p", tmp_path / "f"
    _run(load_recipe(REPO / "recipes" / "tiny-sft.yaml", [*small, *lora]).to_dict(), parent)
    _fork(parent, fork_dir, 1, ["grpo.steps=2", "grpo.learning_rate=0.01"])
    checkpoints = fork_dir / "checkpoints"
    want = {step: load_model(checkpoints / step).state_dict() for step in ("step_0001", "step_0002")}
    shutil.rmtree(parent)
    for step, weights in want.items():
        assert checkpoint_adapter(checkpoints / step).base == str((checkpoints / "sft").resolve())
        got = load_model(checkpoints / step).state_dict()
        assert all(torch.equal(got[name], weights[name]) for name in weights), step


def _fake_parent(folder: Path, finished: int, checkpoints: list[int]) -> Path:
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", ["grpo.steps=4"]).to_dict()
    recipe["model"]["precision"] = "fp32"
    recipe["model"]["lora_sync"] = "merged"
    folder.mkdir(parents=True)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    for step in range(finished):
        (folder / "metrics" / f"step={step}").mkdir(parents=True)
        (folder / "metrics" / f"step={step}" / "steps.parquet").write_bytes(b"")
    for step in checkpoints:
        (folder / "checkpoints" / f"step_{step:04d}").mkdir(parents=True)
    return folder


def test_forks_that_cannot_be_made_are_refused_before_anything_runs(tmp_path):
    parent = _fake_parent(tmp_path / "p", finished=3, checkpoints=[2, 3])
    with pytest.raises(ForkError, match="has not finished step 3"):
        plan_fork(parent, tmp_path / "f", 4, ["grpo.steps=6"])
    with pytest.raises(ForkError, match=r"step_0001 \(the policy after step 0\) was pruned.*--at 2, 3"):
        plan_fork(parent, tmp_path / "f", 1, [])
    with pytest.raises(ForkError, match="would compute no step"):
        plan_fork(parent, tmp_path / "f", 3, ["grpo.steps=3"])
    with pytest.raises(ForkError, match="--at -1: a step is 0 or more"):
        plan_fork(parent, tmp_path / "f", -1, [])
    # what trains at the fork step is the parent's: its adapters kept their own alpha (the fork's recipe and model
    # card said 64), and adapters on a full-weight parent sat on the base model, not on the parent's policy
    with pytest.raises(ForkError, match=r"model.lora_rank changed: the fork trains on from the parent's policy"):
        plan_fork(parent, tmp_path / "f", 2, ["model.lora_rank=4"])
    assert plan_fork(parent, tmp_path / "f", 0, ["model.lora_rank=4"])[1].at == 0
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ForkError, match="a-file is a file: choose a new folder"):
        plan_fork(parent, tmp_path / "a-file", 2, [])
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "catalog.duckdb").write_text("")
    with pytest.raises(ForkError, match="holds another run"):
        plan_fork(parent, tmp_path / "busy", 2, [])
    cfg, record = plan_fork(parent, tmp_path / "f", 2, ["rollout.temperature=0.5"])
    assert (
        record.shares_steps
        and cfg.rollout.temperature == 0.5
        and record.segments[0]["recipe"]["rollout"]["temperature"] == 1.0
    )
    assert "records no code version" in record.note
    assert read_fork(tmp_path / "f") is None  # planning writes nothing
    result = CliRunner().invoke(app, ["fork", str(parent), str(tmp_path / "g"), "--at", "1"])
    assert result.exit_code == 2 and "was pruned" in result.output
    assert not (tmp_path / "g").exists()


def test_a_fork_folder_inside_its_parent_or_around_it_is_refused(tmp_path):
    """PARENT/forks/x was accepted: its files then lie below the parent's folder too, so adopting one rebased the
    fork's own path onto PARENT/forks/x/forks/x/..., and the parent's disk counted the fork's files as its own."""
    parent = _fake_parent(tmp_path / "runs" / "p", finished=3, checkpoints=[2, 3])
    with pytest.raises(
        ForkError, match=r"runs/p/forks/x is inside the parent's folder .*runs/p: choose a folder neither"
    ):
        plan_fork(parent, parent / "forks" / "x", 2, [])
    with pytest.raises(ForkError, match=r"runs holds the parent's folder .*runs/p: choose a folder neither"):
        plan_fork(parent, tmp_path / "runs", 2, [])
    assert plan_fork(parent, tmp_path / "runs" / "p2", 2, [])[1].parent_dir == str(parent.resolve())  # a sibling
    for new in (parent / "forks" / "x", tmp_path / "runs"):
        result = CliRunner().invoke(app, ["fork", str(parent), str(new), "--at", "2"])
        assert result.exit_code == 2 and "neither inside nor around it" in result.output, result.output
    assert not (parent / "forks").exists()


def test_a_fork_of_a_fork_runs_each_step_with_the_recipe_that_computed_it():
    """P's steps 0-1, then A's (a fork of P at 2) up to B's fork step: a fork of a fork inherits its parent's
    segments before the parent's own fork step."""
    a = Fork("a", "a", "p", "p", 2, [], True, "", segments=[{"until": 2, "recipe": {"name": "P"}}])
    assert trunk_segments(a, {"name": "A"}, 5) == [
        {"until": 2, "recipe": {"name": "P"}},
        {"until": 5, "recipe": {"name": "A"}},
    ]
    assert trunk_segments(a, {"name": "A"}, 1) == [{"until": 1, "recipe": {"name": "P"}}]  # before A's own steps
    assert trunk_segments(None, {"name": "P"}, 3) == [{"until": 3, "recipe": {"name": "P"}}]
    assert trunk_segments(None, {"name": "P"}, 0) == []
    unshared = Fork("a", "a", "p", "p", 2, [], False, "data.path changed", segments=[])
    assert trunk_segments(unshared, {"name": "A"}, 3) == [{"until": 3, "recipe": {"name": "A"}}]


def test_a_fork_that_turns_on_evaluation_says_heldout_gap_has_no_baseline(tmp_path):
    """The parent evaluated nothing (eval.every 0); a fork at 2 with eval.every 1 runs the warm start and its step-0
    evaluation as the parent did, so heldout_gap, which compares with that evaluation, stays empty: the fork says
    so. At 0 the fork computes every step, its step-0 evaluation included: nothing to say."""
    parent = _fake_parent(tmp_path / "p", finished=3, checkpoints=[2, 3])
    _, record = plan_fork(parent, tmp_path / "f", 2, ["eval.every=1"])
    assert "heldout_gap has no baseline in the fork" in record.note
    _, record = plan_fork(parent, tmp_path / "g", 0, ["eval.every=1"])
    assert "heldout_gap" not in record.note
    _, record = plan_fork(parent, tmp_path / "h", 2, ["grpo.learning_rate=0.01"])
    assert "heldout_gap" not in record.note


def test_a_resumed_fork_keeps_the_recipe_it_recorded_when_its_parent_changed_since(tmp_path):
    """A fork killed mid-run, its parent extended to 4 steps meanwhile: the same command resumed the fork with the
    parent's recipe as it is now (4 steps), while its record said 3. It resumes with what it recorded, the command's
    settings over it; a --set still extends it."""
    parent = _fake_parent(tmp_path / "p", finished=3, checkpoints=[2, 3])
    recipe = yaml.safe_load((parent / "recipe.yaml").read_text())
    recipe["grpo"]["steps"] = 3
    (parent / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    fork_dir = tmp_path / "f"
    cfg, record = plan_fork(parent, fork_dir, 2, ["grpo.learning_rate=0.02"])
    fork_dir.mkdir()
    write_fork(record)
    (fork_dir / "recipe.yaml").write_text(yaml.safe_dump(cfg.to_dict()))  # as the run writes it when it starts
    recipe["grpo"]["steps"] = 4  # the parent goes on
    recipe["grpo"]["beta"] = 0.5
    (parent / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    recipe["run"]["seed"] = 99  # and even a setting the stages before step 0 read
    (parent / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    resumed, again = plan_fork(parent, fork_dir, 2, ["grpo.learning_rate=0.02"])
    assert (resumed.grpo.steps, resumed.grpo.beta, resumed.grpo.learning_rate) == (3, cfg.grpo.beta, 0.02)
    assert resumed.to_dict() == cfg.to_dict()
    # its record as written at the start: the settings it changed, its shared steps, no note of a changed seed
    assert (again.settings, again.shares_steps, again.segments, again.note) == (
        record.settings,
        True,
        record.segments,
        record.note,
    )
    assert record.settings == ["grpo.learning_rate=0.02"]
    extended, longer = plan_fork(parent, fork_dir, 2, ["grpo.learning_rate=0.02", "grpo.steps=5"])
    assert (extended.grpo.steps, extended.grpo.beta) == (5, cfg.grpo.beta)
    assert longer.settings == ["grpo.learning_rate=0.02", "grpo.steps=5"]
