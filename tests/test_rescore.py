"""`refiner rescore`: a finished run (judged over HTTP by a loopback server that counts requests) gets a new
reward version from new weights, equal to a hand computation from the stored components, with no request."""

from __future__ import annotations

import math

import duckdb
import pytest

from conftest import run_cli
from fault_server import FaultServer
from refiner_core.advantages import compute_advantages


def _rows(run_dir, sql):
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    try:
        cur = con.execute(sql)
        return [dict(zip([d[0] for d in cur.description], r)) for r in cur.fetchall()]
    finally:
        con.close()


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rescore")
    with FaultServer(faults=False) as server:
        code, out, err, _ = run_cli(
            ["run", "recipes/tiny.yaml", "--run-dir", str(tmp / "run"), "--set", "judge.engine=openai",
             "--set", f"judge.base_url={server.base_url}", "--set", "judge.mode=json",
             "--set", f"judge.cache_path={tmp / 'cache'}", "--set", "grpo.steps=2"], tmp)
        assert code == 0, out + err
        judged = server.requests
        yield tmp / "run", server, judged


def test_rescore_makes_a_new_version_without_judge_calls(served_run, tmp_path):
    run_dir, server, judged = served_run
    assert judged > 0
    code, out, err, _ = run_cli(["rescore", str(run_dir), "--set", "reward.citation_weight=0.5",
                                 "--set", "reward.verification_reward=3", "--name", "cw05"], tmp_path)
    assert code == 0, out + err
    assert server.requests == judged  # not one request
    assert "reward version 'cw05'" in out and "0 judge calls" in out

    train = {(r["step"], r["prompt_id"], r["sample_idx"]): r
             for r in _rows(run_dir, "SELECT * FROM rewards WHERE reward_version = 'train'")}
    new = _rows(run_dir, "SELECT * FROM rewards WHERE reward_version = 'cw05'")
    assert len(new) == len(train) > 0
    for r in new:
        t = train[(r["step"], r["prompt_id"], r["sample_idx"])]
        judged_part = 0.0 if t["gated"] else t["rubric_weight"] * t["rubric_score"] + 0.5 * t["citation_score"]
        expected = (t["non_stop_penalty_value"] if t["non_stop_penalized"]
                    else 3.0 * judged_part + t["format_weight"] * t["format_score"] + t["overlong_penalty"])
        assert math.isclose(r["reward"], expected, abs_tol=1e-12)
    # the advantages of the new version are the group advantages of its rewards
    adv = _rows(run_dir, "SELECT a.*, r.reward AS r FROM advantages a JOIN rewards r "
                         "USING (run, step, prompt_id, sample_idx, reward_version) "
                         "WHERE reward_version = 'cw05' AND step = 0 ORDER BY prompt_id, sample_idx")
    expected_adv = compute_advantages([a["r"] for a in adv], [a["prompt_id"] for a in adv], "group_std", 1e-4)
    assert [a["advantage"] for a in adv] == pytest.approx(list(expected_adv), abs=1e-12)
    versions = _rows(run_dir, "SELECT step, reward_version FROM step_rewards ORDER BY 1, 2")
    assert [(v["step"], v["reward_version"]) for v in versions] == [(0, "cw05"), (0, "train"), (1, "cw05"), (1, "train")]
    assert _rows(run_dir, "SELECT count(*) AS n FROM rewards_recomputed WHERE abs(reward - reward_sql) > 1e-9") == [{"n": 0}]

    # rescoring again under the same name replaces the version
    code, out, err, _ = run_cli(["rescore", str(run_dir), "--set", "reward.citation_weight=0.5",
                                 "--set", "reward.verification_reward=3", "--name", "cw05"], tmp_path)
    assert code == 0 and len(_rows(run_dir, "SELECT * FROM rewards WHERE reward_version = 'cw05'")) == len(train)


def test_settings_that_need_new_judgments_are_refused(served_run, tmp_path):
    run_dir, server, judged = served_run
    code, out, err, _ = run_cli(["rescore", str(run_dir), "--set", "judge.max_new_tokens=4"], tmp_path)
    assert code == 2 and "would be re-judged" in err and "judge.max_new_tokens" in err
    code, out, err, _ = run_cli(["rescore", str(run_dir), "--set", "reward.citation_score=f1"], tmp_path)
    assert code == 2 and "needs claim judgments" in err
    code, out, err, _ = run_cli(["rescore", str(run_dir), "--set", "rollout.temperature=0.3"], tmp_path)
    assert code == 2 and "would change training" in err
    assert server.requests == judged
