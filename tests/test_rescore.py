"""`refiner rescore`: a finished run (judged over HTTP by a loopback server that counts requests) gets a new
reward version from new weights, equal to a hand computation from the stored components, with no request; a
later run that changes the judged steps marks the version stale, and `refiner sql` / `show` say how to redo it."""

from __future__ import annotations

import math

import duckdb
import pytest

from conftest import run_cli
from fault_server import FaultServer
from refiner_core.algo.advantages import compute_advantages


def _rows(run_dir, sql):
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    try:
        cur = con.execute(sql)
        return [dict(zip([d[0] for d in cur.description], r)) for r in cur.fetchall()]
    finally:
        con.close()


@pytest.fixture(scope="module")
def served_run(api_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rescore")
    with FaultServer(faults=False) as server:
        command = [
            "run",
            "recipes/tiny.yaml",
            "--run-dir",
            str(tmp / "run"),
            "--set",
            "judge.engine=openai",
            "--set",
            f"judge.openai.base_url={server.base_url}",
            "--set",
            "judge.mode=json",
            "--set",
            f"judge.openai.cache_path={tmp / 'cache'}",
            "--set",
            "grpo.steps=2",
        ]
        code, out, err, _ = run_cli(command, tmp, api_env)
        assert code == 0, out + err
        judged = server.requests
        yield tmp / "run", server, judged, command


def test_rescore_makes_a_new_version_without_judge_calls(served_run, tmp_path):
    run_dir, server, judged, _ = served_run
    assert judged > 0
    code, out, err, _ = run_cli(
        [
            "rescore",
            str(run_dir),
            "--set",
            "reward.citation_weight=0.5",
            "--set",
            "reward.verification_reward=3",
            "--set",
            "reward.distractor_penalty=2",
            "--set",
            "reward.supporting_recall_weight=1.5",
            "--name",
            "cw05",
        ],
        tmp_path,
    )
    assert code == 0, out + err
    assert server.requests == judged  # not one request
    assert "reward version 'cw05'" in out and "0 judge calls" in out

    train = {
        (r["step"], r["prompt_id"], r["sample_idx"]): r
        for r in _rows(run_dir, "SELECT * FROM rewards WHERE reward_version = 'train'")
    }
    new = _rows(run_dir, "SELECT * FROM rewards WHERE reward_version = 'cw05'")
    assert len(new) == len(train) > 0
    for r in new:
        t = train[(r["step"], r["prompt_id"], r["sample_idx"])]
        judged_part = 0.0 if t["gated"] else t["rubric_weight"] * t["rubric_score"] + 0.5 * t["citation_score"]
        expected = (
            t["non_stop_penalty_value"]
            if t["non_stop_penalized"]
            else 3.0 * judged_part
            + t["format_weight"] * t["format_score"]
            + t["overlong_penalty"]
            - 2.0 * bool(t["cites_distractor"])  # NULL (no answer block) costs nothing
            + 1.5 * (t["supporting_recall"] or 0.0)
        )
        assert math.isclose(r["reward"], expected, abs_tol=1e-12)
    # the advantages of the new version are the group advantages of its rewards
    adv = _rows(
        run_dir,
        "SELECT a.*, r.reward AS r FROM advantages a JOIN rewards r "
        "USING (run, step, prompt_id, sample_idx, reward_version) "
        "WHERE reward_version = 'cw05' AND step = 0 ORDER BY prompt_id, sample_idx",
    )
    expected_adv = compute_advantages([a["r"] for a in adv], [a["prompt_id"] for a in adv], "group_std", 1e-4)
    assert [a["advantage"] for a in adv] == pytest.approx(list(expected_adv), abs=1e-12)
    versions = _rows(run_dir, "SELECT step, reward_version FROM step_rewards ORDER BY 1, 2")
    assert [(v["step"], v["reward_version"]) for v in versions] == [
        (0, "cw05"),
        (0, "train"),
        (1, "cw05"),
        (1, "train"),
    ]
    assert _rows(run_dir, "SELECT count(*) AS n FROM rewards_recomputed WHERE abs(reward - reward_sql) > 1e-9") == [
        {"n": 0}
    ]

    # rescoring again under the same name replaces the version
    code, out, err, _ = run_cli(
        [
            "rescore",
            str(run_dir),
            "--set",
            "reward.citation_weight=0.5",
            "--set",
            "reward.verification_reward=3",
            "--name",
            "cw05",
        ],
        tmp_path,
    )
    assert code == 0 and len(_rows(run_dir, "SELECT * FROM rewards WHERE reward_version = 'cw05'")) == len(train)


def test_settings_that_need_new_judgments_are_refused(served_run, tmp_path):
    run_dir, server, judged, _ = served_run
    code, out, err, _ = run_cli(["rescore", str(run_dir), "--set", "judge.max_new_tokens=4"], tmp_path)
    assert code == 2 and "would be re-judged" in err and "judge.max_new_tokens" in err
    code, out, err, _ = run_cli(["rescore", str(run_dir), "--set", "reward.citation_score=f1"], tmp_path)
    assert code == 2 and "needs claim judgments" in err
    code, out, err, _ = run_cli(["rescore", str(run_dir), "--set", "rollout.temperature=0.3"], tmp_path)
    assert code == 2 and "would change training" in err
    code, out, err, _ = run_cli(["rescore", str(run_dir)], tmp_path)  # would only repeat training's rewards
    assert code == 2 and "no --set changes a setting of the run" in err
    escape = ["rescore", str(run_dir), "--set", "reward.citation_weight=0.5", "--name", "../../escape"]
    code, out, err, _ = run_cli(escape, tmp_path)
    assert code == 2 and "--name '../../escape': use 1-100 letters" in err
    assert not (run_dir.parent / "escape").exists()
    assert server.requests == judged


def test_values_a_run_refuses_are_refused_and_a_replaced_version_is_named(served_run, tmp_path):
    """A rescore took grpo.advantage_eps=-1 (every advantage of a group with std under 1 flipped its sign) and
    reward.overlong_buffer past max_new_tokens (every reward fell by 1), which `refiner run` refuses; and a --name
    given again with other settings replaced the version without a word (it says so now). On a copy of the run:
    the module's run keeps its versions for the tests after this one."""
    import shutil

    run_dir, server, judged = shutil.copytree(served_run[0], tmp_path / "run"), served_run[1], served_run[2]
    for setting, why in (
        ("grpo.advantage_eps=-1", "grpo.advantage_eps = -1.0: must be >= 0"),
        ("reward.overlong_buffer=100", "reward.overlong_buffer = 100: must be between 0 (off) and"),
    ):
        code, out, err, _ = run_cli(["rescore", str(run_dir), "--set", setting], tmp_path)
        assert code == 2 and "nothing was rescored" in err and why in err, err
    first = ["rescore", str(run_dir), "--set", "reward.verification_reward=3", "--name", "vr"]
    assert run_cli(first, tmp_path)[0] == 0
    again = ["rescore", str(run_dir), "--set", "reward.verification_reward=7", "--name", "vr"]
    code, out, err, _ = run_cli(again, tmp_path)
    assert code == 0 and "replacing reward version 'vr', computed with --set reward.verification_reward=3.0" in err
    weights = _rows(run_dir, "SELECT DISTINCT verification_reward FROM reward_weights WHERE reward_version = 'vr'")
    assert weights == [{"verification_reward": 7.0}]
    code, out, err, _ = run_cli(again, tmp_path)
    assert code == 0 and "replacing" not in err  # the same settings again: a refresh
    assert server.requests == judged


STALE_SQL = "SELECT step, reward_version, stale FROM step_rewards ORDER BY step, reward_version"


def test_a_rerun_that_changes_judged_steps_marks_the_rescore_stale(served_run, api_env, tmp_path):
    """Runs last: it reruns the module's run (the tests above count its judge requests)."""
    run_dir, server, _, command = served_run
    rescore = ["rescore", str(run_dir), "--set", "reward.citation_weight=0.5", "--name", "cw05"]
    code, out, err, _ = run_cli(rescore, tmp_path)
    assert code == 0, out + err
    assert _rows(run_dir, "SELECT DISTINCT settings FROM rescores WHERE reward_version = 'cw05'") == [
        {"settings": "--set reward.citation_weight=0.5"}
    ]

    # A rerun that changes nothing (every stage cached) leaves the version current.
    code, out, err, _ = run_cli(command, tmp_path, api_env)
    assert code == 0, out + err
    code, out, err, _ = run_cli(["sql", str(run_dir), STALE_SQL, "-f", "csv"], tmp_path)
    assert code == 0 and "stale" not in err, err
    assert out.split() == [
        "step,reward_version,stale",
        "0,cw05,False",
        "0,train,False",
        "1,cw05,False",
        "1,train,False",
    ]

    # Another learning rate: step 1 samples from another policy, so its judgments change; step 0's do not.
    code, out, err, _ = run_cli([*command, "--set", "grpo.learning_rate=0.01"], tmp_path, api_env)
    assert code == 0, out + err
    assert [(r["step"], r["reward_version"], r["stale"]) for r in _rows(run_dir, STALE_SQL)] == [
        (0, "cw05", False),
        (0, "train", False),
        (1, "cw05", True),
        (1, "train", False),
    ]
    redo = f"refiner rescore {run_dir} --name cw05 --set reward.citation_weight=0.5"
    warning = f"rescore version cw05 is stale for step 1 (a later run changed their judgments): rerun `{redo}`"
    code, out, err, _ = run_cli(["sql", str(run_dir), "SELECT count(*) FROM steps"], tmp_path)
    assert code == 0 and warning in err, err
    code, out, err, _ = run_cli(["show", str(run_dir)], tmp_path)
    assert code == 0 and warning in err, err

    # The stale rows are wrong where marked: a fresh rescore of the current judgments differs on step 1 only.
    code, out, err, _ = run_cli([*rescore[:-1], "fresh"], tmp_path)
    assert code == 0, out + err
    assert _differing(run_dir)[0] == 0 and _differing(run_dir)[1] > 0

    # The command the warning gives makes the version current again, equal to the fresh rescore.
    code, out, err, _ = run_cli(redo.split()[1:], tmp_path)
    assert code == 0, out + err
    assert not any(r["stale"] for r in _rows(run_dir, STALE_SQL))
    assert _differing(run_dir) == {0: 0, 1: 0}
    code, out, err, _ = run_cli(["show", str(run_dir)], tmp_path)
    assert code == 0 and "stale" not in err, err


def _differing(run_dir) -> dict[int, int]:
    """Per step: rollouts whose cw05 reward differs from the 'fresh' version's."""
    rows = _rows(
        run_dir,
        "SELECT step, count(*) FILTER (WHERE abs(c.reward - f.reward) > 1e-12) AS n FROM rewards c "
        "JOIN rewards f USING (run, step, prompt_id, sample_idx) WHERE c.reward_version = 'cw05' "
        "AND f.reward_version = 'fresh' GROUP BY step",
    )
    return {r["step"]: r["n"] for r in rows}


def test_a_catalog_published_before_a_column_existed_takes_the_new_versions_rows(tmp_path):
    """A run's catalog from before the advantages table had its KL columns: a rescore's rows (with them) go in,
    the older rows read NULL there, and a table the catalog lacks altogether is created."""
    from refiner_core.schema import ADVANTAGES, RESCORES, duckdb_ddl
    from refiner_core.store.storage import replace_version_rows, write_table

    db = tmp_path / "catalog.duckdb"
    old = duckdb_ddl(ADVANTAGES).replace(',\n  "reward_kl" DOUBLE', "").replace(',\n  "kl_coef" DOUBLE', "")
    assert "reward_kl" not in old and "kl_coef" not in old
    con = duckdb.connect(str(db))
    con.execute(old)
    con.execute(
        "INSERT INTO advantages BY NAME SELECT 'r' run, 0 step, 'train' reward_version, 'p' prompt_id, "
        "0 sample_idx, 1.0 reward, 0.5 advantage, true trained"
    )
    con.close()
    row = {"run": "r", "step": 0, "reward_version": "v1", "prompt_id": "p", "sample_idx": 0, "reward": 2.0}
    advantages = tmp_path / "advantages.parquet"
    write_table(ADVANTAGES, [{**row, "advantage": 0.1, "reward_kl": 3.0, "kl_coef": 0.1, "trained": True}], advantages)
    rescores = tmp_path / "rescores.parquet"
    write_table(
        RESCORES, [{"run": "r", "step": 0, "reward_version": "v1", "settings": "", "inputs_hash": "h"}], rescores
    )
    replace_version_rows(db, {"advantages": [str(advantages)], "rescores": [str(rescores)]}, "v1")
    rows = _rows(tmp_path, "SELECT reward_version, reward_kl, kl_coef FROM advantages ORDER BY reward_version")
    assert rows == [
        {"reward_version": "train", "reward_kl": None, "kl_coef": None},
        {"reward_version": "v1", "reward_kl": 3.0, "kl_coef": 0.1},
    ]
    assert _rows(tmp_path, "SELECT inputs_hash FROM rescores") == [{"inputs_hash": "h"}]


def test_only_the_runs_own_steps_are_rescored(tmp_path):
    """A folder run for 3 steps, then for 2: step 2's scores are still on disk but not the run's (its catalog holds
    steps 0 and 1). Rescoring them made a version over 3 steps and a stale warning no rescore could clear."""
    from refiner_core.reward.rescore import scored_steps

    for step in (0, 1, 2):
        folder = tmp_path / "scores" / f"step={step}"
        folder.mkdir(parents=True)
        (folder / "reward_inputs.parquet").touch()
    (tmp_path / "scores" / "step=3").mkdir()  # judged in part: no reward inputs
    assert scored_steps(tmp_path, 2) == [0, 1]
    assert scored_steps(tmp_path, 5) == [0, 1, 2]


def test_a_step_scored_with_claims_rescores_though_no_answer_held_a_claim(api_env, tmp_path):
    """reward.citation_score dr_tulu, and no rollout of the tiny model wrote an answer block: no claim to judge, and
    rewards the stored rows decide (citation 0 without an answer). A rescore was refused as if the step had been
    scored with 'valid_ids' (it was not)."""
    run_dir = tmp_path / "run"
    code, out, err, _ = run_cli(
        ["run", "recipes/tiny.yaml", "--run-dir", str(run_dir), "--set", "reward.citation_score=dr_tulu",
         "--set", "grpo.steps=1"],
        tmp_path,
        api_env,
    )  # fmt: skip
    assert code == 0, out + err
    assert _rows(run_dir, "SELECT count(*) AS n FROM citation_claims")[0]["n"] == 0
    assert _rows(run_dir, "SELECT DISTINCT citation_score_kind AS k FROM reward_weights") == [{"k": "dr_tulu"}]
    rescore = ["rescore", str(run_dir), "--set", "reward.citation_weight=0.5", "--name", "cw05"]
    code, out, err, _ = run_cli(rescore, tmp_path)
    assert code == 0, out + err
    weights = _rows(
        run_dir, "SELECT citation_weight, citation_score_kind FROM reward_weights WHERE reward_version = 'cw05'"
    )
    assert weights == [{"citation_weight": 0.5, "citation_score_kind": "dr_tulu"}]


def test_rescore_refuses_on_failure_fail():
    """judge.on_failure 'fail' stops a judge stage at a failed judgment; a rescore has no stage to stop (its SQL read
    'fail' as 'zero', a version silently equal to it)."""
    from refiner_core.config import load_recipe
    from refiner_core.reward.rescore import RescoreError, check_rescorable

    with pytest.raises(RescoreError, match=r"judge.on_failure='fail' stops a judge stage"):
        check_rescorable(load_recipe(None), load_recipe(None, ["judge.on_failure=fail"]), 0, [])
    check_rescorable(load_recipe(None), load_recipe(None, ["judge.on_failure=skip"]), 0, [])
    fail = load_recipe(None, ["judge.on_failure=fail"])  # a run that stops on failures rescores its rewards
    check_rescorable(fail, load_recipe(None, ["judge.on_failure=fail", "reward.format_weight=0.5"]), 0, [])
