"""The eval stage: held-out prompts, the rollout engine and the training reward code -> the `evals` table."""

from __future__ import annotations

import duckdb
import pytest

from conftest import REPO
from refiner_core.config import load_recipe
from refiner_core.eval.evaluate import eval_steps, format_table, held_out_prompts, pass_at_k, passed, summarize


@pytest.mark.parametrize(
    "steps, every, expected",
    [
        (2, 0, []),
        (2, 1, [0, 1, 2]),
        (5, 2, [0, 2, 4, 5]),  # the last step is always evaluated
        (4, 2, [0, 2, 4]),
        (3, 10, [0, 3]),
    ],
)
def test_eval_steps(steps, every, expected):
    assert eval_steps(steps, every) == expected


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 0, 3, 0.0),
        (5, 3, 3, 1.0),  # C(2,3) = 0: every 3-subset holds a pass
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


def test_held_out_prompts_are_the_validation_split_in_id_order():
    rows = [
        {"prompt_id": p, "split": s}
        for p, s in [("c", "validation"), ("a", "train"), ("d", "validation"), ("b", "validation")]
    ]
    kept = [p["prompt_id"] for p in rows]
    assert [p["prompt_id"] for p in held_out_prompts(rows, 0, kept)] == ["b", "c", "d"]
    assert [p["prompt_id"] for p in held_out_prompts(rows, 2, kept)] == ["b", "c"]


def test_held_out_prompts_leave_out_those_the_rubric_stage_rejected():
    """A held-out prompt quarantined as missing_rubrics has nothing to score it by: the eval failed on it (a
    retried ValueError) at step 0. The rubric stage's held_out_ids name those it kept."""
    rows = [{"prompt_id": p, "split": "validation"} for p in ("c", "nr", "a", "b")]
    assert [p["prompt_id"] for p in held_out_prompts(rows, 0, ["a", "b", "c"])] == ["a", "b", "c"]
    assert [p["prompt_id"] for p in held_out_prompts(rows, 2, ["a", "b", "c"])] == ["a", "b"]


def test_eval_prompts_keep_twin_views_together():
    """Co-rewarding-I labels a view by its twin's votes: eval.prompts 3 cut m1 from its twin m1-r, and m1 scored 0
    (no label) however right its answers were. A pair is taken or left whole."""
    rows = [
        {"prompt_id": p, "split": "validation", "twin_id": t}
        for p, t in [("m0", "m0-r"), ("m0-r", "m0"), ("m1", "m1-r"), ("m1-r", "m1")]
    ]
    kept = [p["prompt_id"] for p in rows]
    assert [p["prompt_id"] for p in held_out_prompts(rows, 3, kept)] == ["m0", "m0-r"]
    assert [p["prompt_id"] for p in held_out_prompts(rows, 4, kept)] == ["m0", "m0-r", "m1", "m1-r"]


def _judged(**kw):
    row = {
        "verifier": "judge",
        "correct": None,
        "format_ok": True,
        "n_citations": 2,
        "n_invalid_citations": 0,
        "rubric_score": 0.6,
    }
    return {**row, **kw}


def test_passed_needs_valid_format_valid_citations_and_the_rubric_threshold():
    assert passed(_judged(), 0.5)
    assert not passed(_judged(rubric_score=0.4), 0.5)
    assert not passed(_judged(format_ok=False), 0.5)
    assert not passed(_judged(n_citations=0), 0.5)
    assert not passed(_judged(n_invalid_citations=1), 0.5)
    assert passed({"verifier": "ground_truth", "correct": 1.0}, 0.5)
    assert not passed({"verifier": "ground_truth", "correct": 0.0}, 0.5)


def test_summary_by_hand():
    def row(
        prompt, idx, ok, citation, rubric, passed_, reward, finish="stop", mode="sampled", distractor=None, recall=None
    ):
        return {
            "step": 3,
            "phase": "grpo",
            "mode": mode,
            "prompt_id": prompt,
            "sample_idx": idx,
            "format_ok": ok,
            "citation_valid_fraction": citation,
            "verifier": "judge",
            "rubric_score": rubric,
            "passed": passed_,
            "reward": reward,
            "finish_reason": finish,
            "cites_distractor": distractor,
            "supporting_recall": recall,
        }

    rows = [
        row("p", 0, True, 1.0, 0.8, True, 9.0, distractor=True, recall=1.0),
        row("p", 1, False, 0.0, 0.2, False, 2.0, "length", distractor=False, recall=0.5),
        row("q", 0, True, 0.5, 0.6, False, 6.0, distractor=False, recall=0.0),
        row("q", 1, False, 0.0, 0.4, False, 4.0),  # q's row labels no supporting snippets here: not counted
    ]
    rows.append(row("p", 0, True, 1.0, 0.5, True, 7.0, mode="greedy"))
    greedy, sampled = summarize(rows, pass_k=2)
    assert (greedy["mode"], greedy["responses"], greedy["pass_at_1"], greedy["k"]) == ("greedy", 1, 1.0, 1)
    assert sampled["prompts"] == 2 and sampled["responses"] == 4
    assert sampled["format_valid"] == 0.5
    assert sampled["citation_valid"] == pytest.approx(1.5 / 4)
    assert sampled["judge_score"] == pytest.approx(2.0 / 4)
    assert sampled["reward"] == pytest.approx(21.0 / 4)
    assert sampled["stopped"] == 0.75
    assert sampled["cites_distractor"] == pytest.approx(1 / 3) and greedy["cites_distractor"] is None
    assert sampled["supporting_recall"] == pytest.approx(1.5 / 3) and greedy["supporting_recall"] is None
    assert sampled["pass_at_1"] == pytest.approx((0.5 + 0.0) / 2)  # p: 1 of 2 passed, q: none
    assert sampled["pass_at_k"] == pytest.approx((1.0 + 0.0) / 2)  # p: any of 2 passed
    table = format_table([greedy, sampled]).splitlines()
    assert table[0].split()[:3] == ["step", "policy", "mode"]
    assert table[2].split()[:8] == ["3", "grpo", "sampled", "2", "50%", "38%", "33%", "50%"]
    assert table[1].split()[6:8] == ["-", "-"]  # no labelled prompt answered greedily


def test_co_rewarding_2_held_out_answers_have_no_reward_but_their_accuracy():
    """The EMA teacher answers the step's training prompts only: a held-out answer has no label, and its reward
    read 0 whatever it answered (the table's reward a constant 0, heldout_gap blind). It is NULL now; `passed` and
    accuracy come from the ground truth."""
    from refiner_core.config import RewardConfig
    from refiner_core.eval.evaluate import score_responses

    prompts = {
        f"q{i}": {"prompt_id": f"q{i}", "question": f"What is {i} + 1?", "snippet_ids": [], "ground_truth": str(i + 1)}
        for i in range(2)
    }
    responses = [
        {"mode": "greedy", "prompt_id": pid, "sample_idx": 0, "temperature": 0.0, "response_token_ids": [1],
         "response_logprobs": [0.0], "response_text": f"So \\boxed{{{answer}}}", "response_tokens": 4,
         "finish_reason": "stop", "max_new_tokens": 32}
        for pid, answer in (("q0", 1), ("q1", 5))
    ]  # fmt: skip
    rows = {
        verifier: score_responses(
            responses, prompts, {}, None, RewardConfig(verifier=verifier), "zero", 2000, run="r", step=0,
            phase="base", policy={"path": "p", "hash": "h"}, pass_rubric_score=0.5,
        )
        for verifier in ("ground_truth", "co_rewarding_teacher")
    }  # fmt: skip
    assert [r["reward"] for r in rows["ground_truth"]] == [10.0, 0.0]  # reward.verification_reward 10
    assert [(r["reward"], r["passed"], r["correct"]) for r in rows["co_rewarding_teacher"]] == [
        (None, True, 1.0),
        (None, False, 0.0),
    ]
    [summary] = summarize(rows["co_rewarding_teacher"], pass_k=1)
    assert (summary["reward"], summary["accuracy"], summary["pass_at_1"]) == (None, 0.5, 0.5)


def test_answers_whose_judgments_all_failed_are_no_score_in_the_summary():
    """judge.on_failure skip: an answer whose every judgment failed is `dropped` with rubric score 0 and reward
    format-only; averaged in, a judge outage read as a worse policy (judge score 0.333 for 0.5). Left out of the
    score, reward and pass means; a mode with no scored answer shows '-'."""
    base = {"step": 1, "phase": "grpo", "mode": "sampled", "verifier": "judge", "format_ok": True}
    base |= {"citation_valid_fraction": 1.0, "finish_reason": "stop", "cites_distractor": None}
    rows = [
        {**base, "prompt_id": "p", "sample_idx": 0, "rubric_score": 0.5, "reward": 7.0, "passed": True},
        {**base, "prompt_id": "p", "sample_idx": 1, "rubric_score": 0.5, "reward": 7.0, "passed": False},
        {
            **base,
            "prompt_id": "q",
            "sample_idx": 0,
            "rubric_score": 0.0,
            "reward": 2.0,
            "passed": False,
            "dropped": True,
        },
        {
            **base,
            "prompt_id": "q",
            "sample_idx": 1,
            "rubric_score": 0.0,
            "reward": 2.0,
            "passed": False,
            "dropped": True,
        },
    ]
    [summary] = summarize(rows, pass_k=2)
    assert (summary["prompts"], summary["responses"]) == (2, 4)
    assert (summary["judge_score"], summary["reward"]) == (0.5, 7.0)
    assert (summary["pass_at_1"], summary["pass_at_k"], summary["k"]) == (0.5, 1.0, 2)  # over p alone
    [failed] = summarize([{**r, "dropped": True} for r in rows], pass_k=2)
    assert failed["judge_score"] is failed["reward"] is failed["pass_at_1"] is failed["pass_at_k"] is None
    assert format_table([failed]).splitlines()[1].split()[8:12] == ["-", "-", "100%", "-"]


def _eval_states(flow_run_id) -> list[tuple[str, str]]:
    """(task run name, state name) of every eval task run of a flow run, in start order."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
            limit=200,
        )
    return [(r.name, r.state.name) for r in runs if r.name.startswith("eval")]


def _run(recipe: dict, run_dir):
    from flows.refiner import refiner_pipeline

    state = refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    return state.result(), _eval_states(state.state_details.flow_run_id)


EVAL_OVERRIDES = [
    "data.validation_fraction=0.25",
    "grpo.steps=2",
    "eval.every=2",
    "eval.prompts=3",
    "eval.samples=2",
    "eval.max_new_tokens=16",
]


@pytest.fixture(scope="module")
def sft_eval_run(prefect_server, tiny_model_path, tmp_path_factory):
    recipe = load_recipe(REPO / "recipes" / "tiny-sft.yaml", EVAL_OVERRIDES).to_dict()
    run_dir = tmp_path_factory.mktemp("eval")
    result, states = _run(recipe, run_dir)
    return recipe, run_dir, result, states


def _query(run_dir, sql):
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_eval_rows_for_base_sft_and_last_step(sft_eval_run):
    recipe, run_dir, result, states = sft_eval_run
    evaluated = _query(
        run_dir,
        "SELECT step, phase, mode, count(*), count(DISTINCT prompt_id) FROM evals "
        "GROUP BY ALL ORDER BY step, phase, mode",
    )
    # step 1 is skipped (eval.every=2); greedy: 1 response per prompt, sampled: 2
    assert evaluated == [
        (0, "base", "greedy", 3, 3),
        (0, "base", "sampled", 6, 3),
        (0, "sft", "greedy", 3, 3),
        (0, "sft", "sampled", 6, 3),
        (2, "grpo", "greedy", 3, 3),
        (2, "grpo", "sampled", 6, 3),
    ]
    # held-out prompts: validation split, never rolled out for training
    assert _query(run_dir, "SELECT DISTINCT p.split FROM evals e JOIN prompts p USING (run, prompt_id)") == [
        ("validation",)
    ]
    assert _query(run_dir, "SELECT count(*) FROM evals e JOIN rollouts r USING (run, prompt_id)") == [(0,)]
    # nor imitated by the SFT warm start
    held_out = _query(run_dir, "SELECT count(*) FROM prompts WHERE split = 'validation'")[0][0]
    assert _query(run_dir, "SELECT value FROM sft_stats WHERE name = 'held_out_rows'") == [(float(held_out),)]
    # sft.path is empty: SFT reads data.path itself, where a held-out prompt's ID names its row
    assert _query(run_dir, "SELECT value FROM sft_stats WHERE name = 'held_out_by_prompt_id'") == [(float(held_out),)]
    assert _query(
        run_dir,
        "SELECT count(*) FROM sft_examples s JOIN prompts p ON p.prompt_id = s.source_id WHERE p.split = 'validation'",
    ) == [(0,)]
    # the policy evaluated at each point: base model, SFT checkpoint, GRPO step 2 checkpoint
    policies = dict(_query(run_dir, "SELECT DISTINCT phase, policy FROM evals"))
    assert policies["sft"].endswith("checkpoints/sft") and policies["grpo"].endswith("checkpoints/step_0002")
    assert "checkpoints" not in policies["base"]
    # greedy responses are deterministic: the same policy twice would give the same text; temperature recorded
    assert _query(run_dir, "SELECT DISTINCT mode, temperature FROM evals ORDER BY 1") == [
        ("greedy", 0.0),
        ("sampled", 1.0),
    ]
    assert _query(run_dir, "SELECT max(response_tokens) <= 16 FROM evals") == [(True,)]
    # the printed summary covers every evaluated policy and mode
    assert [(s["step"], s["phase"], s["mode"]) for s in result["evals"]] == [
        (0, "base", "greedy"),
        (0, "base", "sampled"),
        (0, "sft", "greedy"),
        (0, "sft", "sampled"),
        (2, "grpo", "greedy"),
        (2, "grpo", "sampled"),
    ]
    assert [name for name, _ in states] == ["eval[step=0]", "eval[step=0]", "eval[step=2]"]
    assert {state for _, state in states} == {"Completed"}
    # what each evaluation's judgments cost, in judge_spend beside the steps' rollout judging
    spent = _query(
        run_dir,
        "SELECT step, phase, requests > 0, prompt_tokens > 0 FROM judge_spend WHERE stage = 'eval' ORDER BY 1, 2",
    )
    assert spent == [(0, "base", True, True), (0, "sft", True, True), (2, "grpo", True, True)]


def test_eval_reward_parts_match_the_training_reward_code(sft_eval_run):
    from refiner_core.eval.evaluate import passed as passes
    from refiner_core.reward.compose import format_parts

    _, run_dir, _, _ = sft_eval_run
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    try:
        cur = con.execute(
            "SELECT e.*, p.snippet_ids, p.supporting_ids FROM evals e JOIN prompts p USING (run, prompt_id)"
        )
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r)) for r in cur.fetchall()]
    finally:
        con.close()
    for row in rows:
        parts = format_parts(row["response_text"], row["snippet_ids"], row["supporting_ids"])
        assert {k: row[k] for k in parts} == parts
        assert row["supporting_ids"] is not None  # the sample rows label their supporting snippets
        assert row["passed"] == passes(row, 0.5)
        assert row["reward"] == pytest.approx(
            row["verification_reward"]
            * (row["rubric_weight"] * row["rubric_score"] + row["citation_weight"] * row["citation_score"])
            + row["format_weight"] * row["format_score"]
            + row["distractor_term"]
            + row["recall_term"]
        )


def test_cached_rerun_does_not_reevaluate(sft_eval_run):
    recipe, run_dir, first, _ = sft_eval_run
    files = sorted((run_dir / "evals").rglob("*.parquet"))
    before = {f: f.stat().st_mtime_ns for f in files}
    result, states = _run(recipe, run_dir)
    assert states == [("eval[step=0]", "Cached"), ("eval[step=0]", "Cached"), ("eval[step=2]", "Cached")]
    assert {f: f.stat().st_mtime_ns for f in files} == before
    assert result["evals"] == first["evals"]


def test_plot_draws_eval_curves(sft_eval_run, tmp_path):
    from conftest import run_cli
    from refiner_core.publish.plots import eval_summary

    _, run_dir, result, _ = sft_eval_run
    summary = eval_summary(run_dir / "catalog.duckdb")
    assert [(s["step"], s["phase"], s["mode"], s["format_valid"]) for s in summary] == [
        (s["step"], s["phase"], s["mode"], s["format_valid"]) for s in result["evals"]
    ]
    code, out, err, _ = run_cli(["plot", str(run_dir), "-o", str(tmp_path / "curves.png")], tmp_path)
    assert code == 0, err
    from PIL import Image

    with Image.open(tmp_path / "curves.png") as png:  # training curves above, held-out curves below
        assert png.size == (2400, 600)  # six held-out panels under four training ones


def test_the_plot_card_and_tracker_summary_is_the_eval_stages_at_the_runs_pass_k(sft_eval_run, tmp_path):
    """eval_summary (curves, model cards, trackers) takes k from the run's eval.pass_k, as the eval stage did; it
    took every sample, so with eval.pass_k below eval.samples they showed another pass@k under the same name."""
    import shutil

    import yaml

    from refiner_core.publish.plots import eval_summary

    _, run_dir, result, _ = sft_eval_run
    fields = ("step", "phase", "mode", "k", "pass_at_k", "pass_at_1")
    assert [tuple(s[f] for f in fields) for s in eval_summary(run_dir / "catalog.duckdb")] == [
        tuple(s[f] for f in fields) for s in result["evals"]
    ]
    shutil.copy(run_dir / "catalog.duckdb", tmp_path / "catalog.duckdb")
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "eval": {**recipe["eval"], "pass_k": 1}}))
    sampled = [s for s in eval_summary(tmp_path / "catalog.duckdb") if s["mode"] == "sampled"]
    assert sampled and all(s["k"] == 1 and s["pass_at_k"] == s["pass_at_1"] for s in sampled)


def test_documented_eval_query_runs_on_a_real_catalog(sft_eval_run):
    import re

    from refiner_core.store.storage import query

    _, run_dir, _, _ = sft_eval_run
    page = (REPO / "docs" / "pipeline.md").read_text()
    section = page.split("## Held-out evaluation", 1)[1].split("\n## ", 1)[0]
    sql = re.search(r'refiner sql RUN_DIR "(SELECT [^"]+)"', section).group(1)
    columns, rows = query(run_dir / "catalog.duckdb", sql)
    assert columns[:3] == ["step", "phase", "mode"]
    assert [r[:3] for r in rows] == [
        (0, "base", "greedy"),
        (0, "base", "sampled"),
        (0, "sft", "greedy"),
        (0, "sft", "sampled"),
        (2, "grpo", "greedy"),
        (2, "grpo", "sampled"),
    ]


def test_an_answer_whose_judgments_all_failed_has_no_passed_verdict():
    """judge.on_failure skip: the evals row of an answer whose judgments all failed holds passed NULL, neither a
    pass nor a fail (it read False: `avg(passed::INT)` over evals counted a judge outage as a worse policy)."""
    from refiner_core.config import RewardConfig
    from refiner_core.eval.evaluate import score_responses
    from test_openai_judge import make_batch

    class FailsOnSampleOne:
        name = "fails-on-one"

        def complete(self, conversations):
            return ["no verdict" if "variant 1." in str(c) else '{"score": 2}' for c in conversations]

    rollouts, prompts, rubrics = make_batch(1, 2, 2)
    responses = [{**r, "mode": "sampled", "temperature": 1.0, "max_new_tokens": 32} for r in rollouts]
    rows = score_responses(
        responses, prompts, rubrics, FailsOnSampleOne(), RewardConfig(), "skip", 2000, run="r", step=0,
        phase="base", policy={"path": "p", "hash": "h"}, pass_rubric_score=0.5,
    )  # fmt: skip
    assert [(r["sample_idx"], r["dropped"], r["passed"]) for r in rows] == [(0, False, True), (1, True, None)]
    [summary] = summarize(rows, pass_k=2)
    assert summary["pass_at_1"] == 1.0
