"""End to end on the tiny Qwen3: every stage for real, caching, retries and resume."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, catalog_rows, run_cli
from refiner_core.config import recipe_from_dict

STAGES = ("prepare-data", "ingest-rubrics", "rollout", "judge", "grpo-update")


def _task_states(flow_run_id) -> dict[str, tuple[str, int]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
            limit=200,
        )
    return {r.name: (r.state.name, r.run_count) for r in runs}


def _run(recipe: dict, run_dir: Path):
    from flows.refiner import refiner_pipeline

    state = refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)
    return state, _task_states(state.state_details.flow_run_id)


def _counts(run_dir: Path) -> dict[str, int]:
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    try:
        names = ["prompts", "rubrics", "rollouts", "judge_scores", "rewards", "steps", "quarantine"]
        return {n: con.execute(f"SELECT count(*) FROM {n}").fetchone()[0] for n in names}
    finally:
        con.close()


def _weights(folder: Path) -> dict:
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def finished_run(prefect_server, tiny_model_path, tmp_path_factory):
    from refiner_core.config import load_recipe

    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "tiny.yaml").to_dict()
    run_dir = tmp_path_factory.mktemp("e2e")
    state, tasks = _run(recipe, run_dir)
    assert state.is_completed(), state.message
    return recipe, run_dir, tasks


def test_each_step_publishes_ui_artifacts(finished_run):
    """A table of the steps, the step's best and worst rollout, the curves as an image: one version per step."""
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.artifacts import artifact_key

    recipe, run_dir, _ = finished_run
    steps = recipe["grpo"]["steps"]
    with get_client(sync_client=True) as client:
        found = {
            what: client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(run_dir.name, what)]))
            )
            for what in ("steps", "rollouts", "curves")
        }
    assert {what: len(versions) for what, versions in found.items()} == {
        "steps": steps,
        "rollouts": steps,
        "curves": steps,
    }
    tables = [json.loads(a.data) if isinstance(a.data, str) else a.data for a in found["steps"]]
    assert sorted(len(t) for t in tables) == list(range(1, steps + 1))  # the steps so far, each step
    assert all("best" in a.data and "worst" in a.data for a in found["rollouts"])
    assert (run_dir / "curves.png").exists() and "](data:image/png;base64," in found["curves"][0].data


def test_long_stages_report_progress_to_the_ui(finished_run):
    """Each rollout, judge and update task run carries a progress artifact that ended at 100 %, naming its bar."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterType,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterName,
    )

    recipe, run_dir, _ = finished_run
    cfg = recipe_from_dict(recipe)
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=[f"{run_dir.name}: steps 0-{cfg.grpo.steps - 1}"])
            )
        )[0]
        task_names = {
            r.id: r.name
            for r in client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])), limit=200
            )
        }
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                type=ArtifactFilterType(any_=["progress"]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])
            )
        )
    progress = {task_names[a.task_run_id]: (float(a.data), a.description) for a in artifacts}
    sequences = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    for step in range(cfg.grpo.steps):
        assert progress[f"rollout[step={step}]"] == (100.0, f"rollout: rollout step {step} {sequences}/{sequences} seq")
        assert progress[f"judge[step={step}]"][0] == 100.0 and "judge:" in progress[f"judge[step={step}]"][1]
        assert progress[f"grpo-update[step={step}]"][0] == 100.0
        assert progress[f"grpo-update[step={step}]"][1].startswith("grpo-update: update ")
    assert "prepare-data" not in progress  # quick stages draw no bar, so they get no artifact


def test_e2e_tables_and_weights(finished_run, tiny_model_path):
    recipe, run_dir, tasks = finished_run
    cfg = recipe_from_dict(recipe)
    assert (cfg.grpo.steps, cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt) == (2, 4, 4)
    counts = _counts(run_dir)
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    rubrics_per_rollout = con.execute(
        "SELECT sum(n) FROM (SELECT count(*) AS n FROM rollouts JOIN rubrics USING (run, prompt_id) "
        "GROUP BY step, prompt_id, sample_idx)"
    ).fetchone()[0]
    distinct_prompts = con.execute("SELECT count(DISTINCT (step, prompt_id)) FROM rollouts").fetchone()[0]
    mismatched = con.execute(
        "SELECT count(*) FROM rewards_recomputed WHERE abs(reward - reward_sql) > 1e-9"
    ).fetchone()[0]
    keys_unique = con.execute(
        "SELECT count(*) = count(DISTINCT (step, prompt_id, sample_idx, rubric_id)) FROM judge_scores"
    ).fetchone()[0]
    lengths_ok = con.execute(
        "SELECT bool_and(len(response_token_ids) = len(response_logprobs) AND "
        "response_tokens = len(response_token_ids)) FROM rollouts"
    ).fetchone()[0]
    con.close()
    assert counts["prompts"] == 69 and counts["quarantine"] == 0
    assert counts["rubrics"] > 69 * 3
    assert counts["rollouts"] == 2 * 4 * 4 and distinct_prompts == 8
    assert counts["rewards"] == 32 and counts["steps"] == 2
    assert counts["judge_scores"] == rubrics_per_rollout
    assert mismatched == 0 and keys_unique and lengths_ok
    base, final = _weights(tiny_model_path), _weights(run_dir / "checkpoints" / "step_0002")
    changed = [k for k in base if not (base[k] == final[k]).all()]
    assert len(changed) > len(base) // 2, f"only {len(changed)}/{len(base)} tensors changed"
    for state, _ in (tasks[name] for name in tasks if name.split("[")[0] in STAGES):
        assert state == "Completed"


def test_every_documented_and_cli_query_runs_on_a_real_catalog(finished_run):
    """The `refiner sql` examples of README.md and docs/*.md, and the CLI's, run unchanged on a run's catalog."""
    import re

    from flows.supervisor import EXAMPLE_SQL
    from refiner_core.store.storage import query

    _, run_dir, _ = finished_run
    repo = Path(__file__).parents[1]
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    queries = [q for page in pages for q in re.findall(r'refiner sql \S+ "([^"]+)"', page.read_text())]
    assert len(queries) >= 10
    for sql in queries + list(EXAMPLE_SQL):
        columns, _ = query(run_dir / "catalog.duckdb", sql)
        assert columns, sql
    assert query(run_dir / "catalog.duckdb", queries[0])[1], "the first example (steps) returns rows"


def test_checkpoint_loads_with_automodel(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_dir, _ = finished_run
    folder = run_dir / "checkpoints" / "step_0001"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    out = model.generate(**tok("<|im_start|>user\nhi<|im_end|>\n", return_tensors="pt"), max_new_tokens=3)
    assert out.shape[1] > 0


def test_rerun_after_success_is_all_cached(finished_run):
    recipe, run_dir, _ = finished_run
    before = _counts(run_dir)
    mtime = (run_dir / "rollouts" / "step=0" / "rollouts.parquet").stat().st_mtime_ns
    state, tasks = _run(recipe, run_dir)
    assert state.is_completed()
    stage_states = {name: s for name, (s, _) in tasks.items() if name.split("[")[0] in STAGES}
    assert len(stage_states) == 2 + 3 * 2
    assert set(stage_states.values()) == {"Cached"}, stage_states
    assert _counts(run_dir) == before
    assert (run_dir / "rollouts" / "step=0" / "rollouts.parquet").stat().st_mtime_ns == mtime


def test_extending_or_shortening_a_run_keeps_finished_steps_cached(finished_run):
    """ "Train one more step" reuses every finished step; going back to fewer steps is all Cached."""
    recipe, run_dir, _ = finished_run
    longer = {**recipe, "grpo": {**recipe["grpo"], "steps": 3}}
    state, tasks = _run(longer, run_dir)
    assert state.is_completed(), state.message
    for step in (0, 1):
        for name in ("rollout", "judge", "grpo-update"):
            assert tasks[f"{name}[step={step}]"][0] == "Cached", (name, step, tasks)
    assert {tasks[f"{n}[step=2]"][0] for n in ("rollout", "judge", "grpo-update")} == {"Completed"}
    assert _counts(run_dir)["steps"] == 3
    state, tasks = _run(recipe, run_dir)
    assert {s for name, (s, _) in tasks.items() if name.split("[")[0] in STAGES} == {"Cached"}
    assert _counts(run_dir)["steps"] == 2


def test_a_setting_a_stage_does_not_read_leaves_it_cached(finished_run):
    """A looser prompt limit reruns prepare-data; its output is the same, so everything after it stays Cached.
    The SFT section is read by no stage of a run without SFT."""
    recipe, run_dir, _ = finished_run
    changed = {
        **recipe,
        "data": {**recipe["data"], "max_prompt_tokens": recipe["data"]["max_prompt_tokens"] + 1},
        "sft": {**recipe["sft"], "epochs": 7, "learning_rate": 0.5},
    }
    state, tasks = _run(changed, run_dir)
    assert state.is_completed(), state.message
    assert tasks["prepare-data"][0] == "Completed"
    assert {s for name, (s, _) in tasks.items() if name.split("[")[0] in STAGES[1:]} == {"Cached"}


def test_changed_config_recomputes_only_downstream(finished_run, tmp_path):
    recipe, run_dir, _ = finished_run
    changed = {**recipe, "grpo": {**recipe["grpo"], "learning_rate": 5e-4}}
    state, tasks = _run(changed, run_dir)
    assert state.is_completed()
    assert tasks["prepare-data"][0] == tasks["ingest-rubrics"][0] == "Cached"
    assert tasks["rollout[step=0]"][0] == tasks["judge[step=0]"][0] == "Cached"
    assert tasks["grpo-update[step=0]"][0] == "Completed"  # lr enters the update's key
    assert tasks["rollout[step=1]"][0] == "Completed"  # new policy weights -> new content hash


def test_stage_failing_once_is_retried(prefect_server, tiny_recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("REFINER_FAIL_ONCE", "judge@1")
    recipe = {**tiny_recipe, "run": {**tiny_recipe["run"], "retry_delay_seconds": 0.1}}
    state, tasks = _run(recipe, tmp_path)
    assert state.is_completed(), state.message
    assert tasks["judge[step=1]"] == ("Completed", 2)  # failed once, retried once
    assert tasks["judge[step=0]"] == ("Completed", 1)
    assert _counts(tmp_path)["steps"] == 2


def test_failed_run_resumes_at_failed_stage(prefect_server, tiny_recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("REFINER_FAIL_ONCE", "grpo-update@1")
    recipe = {**tiny_recipe, "run": {**tiny_recipe["run"], "retries": 0}}
    state, tasks = _run(recipe, tmp_path)
    assert state.is_failed()
    assert tasks["grpo-update[step=1]"][0] == "Failed"
    assert not (tmp_path / "checkpoints" / "step_0002").exists()
    state, tasks = _run(recipe, tmp_path)  # the fault fired once already
    assert state.is_completed(), state.message
    before_failure = [
        "prepare-data",
        "ingest-rubrics",
        "rollout[step=0]",
        "judge[step=0]",
        "grpo-update[step=0]",
        "rollout[step=1]",
        "judge[step=1]",
    ]
    assert {tasks[n][0] for n in before_failure} == {"Cached"}
    assert tasks["grpo-update[step=1]"][0] == "Completed"
    assert (tmp_path / "checkpoints" / "step_0002" / "model.safetensors").exists()


def test_interrupted_and_killed_process_resumes(tmp_path):
    """Ctrl-C (SIGINT) in the rollout of step 1, then a hard kill (no cleanup) in its judge; each time the
    same command picks up where the last one stopped, and the third finishes the run."""
    run_dir = tmp_path / "run"
    args = ["run", str(REPO / "recipes" / "tiny.yaml"), "--run-dir", str(run_dir)]
    env = {"REFINER_INTERRUPT_ONCE": "rollout@1", "REFINER_KILL_ONCE": "judge@1"}

    def cli() -> tuple[int, str]:
        code, out, err, _ = run_cli(args, tmp_path, env)
        return code, out + err

    code, log = cli()
    assert code == 130, log[-2000:]
    assert "run the same command again to resume" in log
    assert (run_dir / "checkpoints" / "step_0001").exists() and not (run_dir / "rollouts" / "step=1").exists()
    code, log = cli()
    assert code == 137, log[-2000:]
    assert "Task run 'grpo-update[step=0]' - Finished in state Cached" in log
    assert "Task run 'rollout[step=1]' - Finished in state Completed" in log
    assert not (run_dir / "scores" / "step=1").exists()
    code, log = cli()
    assert code == 0, log[-3000:]
    for name in (
        "prepare-data",
        "ingest-rubrics",
        "rollout[step=0]",
        "judge[step=0]",
        "grpo-update[step=0]",
        "rollout[step=1]",
    ):
        assert f"Task run '{name}' - Finished in state Cached" in log, name
    assert "Task run 'judge[step=1]' - Finished in state Completed" in log
    assert "catalog:" in log
    assert _counts(run_dir)["steps"] == 2


def test_deleted_outputs_are_recomputed_not_trusted(finished_run):
    """Cache hits whose files are gone or edited are recomputed; nothing downstream sees a dangling manifest."""
    recipe, run_dir, _ = finished_run
    before = _counts(run_dir)
    (run_dir / "rollouts" / "step=1" / "rollouts.parquet").unlink()
    shutil.rmtree(run_dir / "data")
    state, tasks = _run(recipe, run_dir)
    assert state.is_completed(), state.message
    assert tasks["prepare-data"][0] == "Completed" and tasks["rollout[step=1]"][0] == "Completed"
    assert tasks["rollout[step=0]"][0] == "Cached"  # its file is intact
    assert _counts(run_dir) == before


def test_judge_prices_apply_afterwards_and_a_budget_stops_before_the_step_that_would_exceed_it(finished_run):
    """Prices are in no cache key: set on a finished run, every stage stays Cached and the catalog prices each step's
    judge tokens. A budget that the first step's cost leaves no room for stops the run before step 1 (resumable);
    a larger one lets the same command finish."""
    from refiner_core.judges.cost import JudgeBudgetExceeded

    recipe, run_dir, _ = finished_run
    [(prompt_tokens, completion_tokens, requests)] = catalog_rows(
        run_dir, "SELECT sum(prompt_tokens), sum(completion_tokens), sum(attempts) FROM judge_scores WHERE step = 0"
    )
    assert prompt_tokens > 0 and completion_tokens == 0 and requests > 0  # expected_score writes no token
    priced = {**recipe, "judge": {**recipe["judge"], "price_per_mtok_in": 1000.0, "price_per_mtok_out": 2000.0}}
    step0 = prompt_tokens * 1000.0 / 1e6
    tight = {**priced, "judge": {**priced["judge"], "budget_usd": 1.5 * step0}}
    state, tasks = _run(tight, run_dir)
    assert state.is_failed()
    with pytest.raises(JudgeBudgetExceeded, match=r"step 1 would cost about"):
        state.result()
    assert tasks["grpo-update[step=0]"][0] == "Cached" and "judge[step=1]" not in tasks
    steps = "SELECT step, judge_requests, judge_prompt_tokens, judge_cost_usd FROM steps ORDER BY step"
    assert catalog_rows(run_dir, steps)[0] == (0, requests, prompt_tokens, pytest.approx(step0))

    roomy = {**priced, "judge": {**priced["judge"], "budget_usd": 1e9}}
    state, tasks = _run(roomy, run_dir)
    assert state.is_completed(), state.message
    assert {s for name, (s, _) in tasks.items() if name.split("[")[0] in STAGES} == {"Cached"}
    rows = catalog_rows(run_dir, steps)
    judged = catalog_rows(run_dir, "SELECT step, sum(prompt_tokens) FROM judge_scores GROUP BY step ORDER BY step")
    assert [(s, t, c) for s, _, t, c in rows] == [(s, t, pytest.approx(t * 1000.0 / 1e6)) for s, t in judged]
    card = (run_dir / "checkpoints" / "step_0002" / "README.md").read_text()
    total = sum(t for _, t in judged) * 1000.0 / 1e6
    assert f"over 2 GRPO step(s): ${total:.4f} at $1000 / $2000 per million" in card


def test_masked_truncation_and_a_decaying_rate_are_recorded(prefect_server, tiny_recipe, tmp_path):
    """The tiny model never emits EOS in 32 tokens: under grpo.mask_truncated every response is judged and kept in
    the catalog, none is trained, each step says so (steps.masked_truncated, a warning) and the policy stays as it
    was. A cosine decay over the run's 2 steps to half the rate: steps.lr 1e-3, then 7.5e-4."""
    grpo = {"steps": 2, "mask_truncated": True, "lr_scheduler_type": "cosine", "min_lr_ratio": 0.5}
    recipe = {**tiny_recipe, "grpo": {**tiny_recipe["grpo"], **grpo}}
    run_dir = tmp_path / "masked"
    state, tasks = _run(recipe, run_dir)
    assert state.is_completed(), state.message
    [(rollouts, cut_off, trained, rewarded)] = catalog_rows(
        run_dir,
        "SELECT count(*), count(*) FILTER (WHERE r.finish_reason = 'length'), count(*) FILTER (WHERE a.trained), "
        "count(w.reward) FROM rollouts r JOIN advantages a USING (run, step, prompt_id, sample_idx) "
        "JOIN rewards w USING (run, step, prompt_id, sample_idx)",
    )
    steps = catalog_rows(run_dir, "SELECT masked_truncated, response_tokens, lr FROM steps ORDER BY step")
    sampled_by = catalog_rows(run_dir, "SELECT DISTINCT policy FROM rollouts WHERE step = 0")
    assert rollouts == cut_off == rewarded == 32 and trained == 0
    assert [s[:2] for s in steps] == [(16, 0), (16, 0)]
    assert [s[2] for s in steps] == pytest.approx([1e-3, 7.5e-4])
    log = "\n".join(p.read_text() for p in (run_dir / "logs").glob("run-*.log"))
    assert log.count("nothing to train on: all 16 responses that would be trained ran out of tokens") == 2
    start, end = _weights(Path(sampled_by[0][0])), _weights(run_dir / "checkpoints" / "step_0002")
    assert all(torch.equal(start[k], end[k]) for k in start)
