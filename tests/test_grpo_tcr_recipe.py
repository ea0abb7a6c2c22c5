"""recipes/grpo-tcr.yaml end to end on the tiny model, scaled down as docs/recipes.md shows, with scripted tool-using
conversations mixed in: turns, loss masks and TCR rewards in the catalog."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_ON_CPU
from refiner_core.config import load_recipe
from refiner_core.preflight import check_recipe
from refiner_core.store.storage import query

REPO = Path(__file__).resolve().parents[1]
# The scaled-down line of docs/recipes.md: tiny model, hf engine, torch learner, short budgets.
TINY_TCR = [
    *TINY_ON_CPU,
    "rollout.samples_per_prompt=4",
    "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=160",
    "rollout.batch_size=16",
    "rollout.agent.max_turns=3",
    "rollout.agent.max_turn_tokens=40",
    "rollout.agent.tool_concurrency=2",
    "rollout.agent.scripted_path=data/math-tools/scripted.jsonl",
    "reward.overlong_buffer=100",
    "grpo.steps=2",
    "grpo.learning_rate=1e-3",
    "grpo.micro_batch_size=8",
    "grpo.pack_length=0",
    "run.save_every=1",
]
BUDGET, BUFFER = 160, 100
SCRIPTED = "data/math-tools/scripted.jsonl"
BAD_CODE = (
    r'<tool_call>{"name": "python", "arguments": {"code": "print(\u0000)"}}</tool_call>'
    r'<tool_call>{"name": "python", "arguments": {"code": "\ud800"}}</tool_call>'
)


@pytest.fixture(scope="module")
def tcr_run(prefect_server, tmp_path_factory):
    from flows.refiner import refiner_pipeline
    from refiner_core.agent.tools.python_sandbox import check_sandbox

    check_sandbox()
    # Sample 3 of every question calls the tool with code the interpreter cannot be given: JSON escapes of a NUL
    # and of an unpaired surrogate. Those calls are recorded as invalid; the run goes on.
    lines = (REPO / SCRIPTED).read_text().splitlines()
    scripted = tmp_path_factory.mktemp("scripted") / "scripted.jsonl"
    scripted.write_text(
        "\n".join(
            lines
            + [
                json.dumps({"prompt_id": prompt_id, "sample_idx": 3, "turns": [BAD_CODE]})
                for prompt_id in sorted({json.loads(line)["prompt_id"] for line in lines})
            ]
        )
    )
    recipe = load_recipe(
        REPO / "recipes" / "grpo-tcr.yaml", TINY_TCR + [f"rollout.agent.scripted_path={scripted}"]
    ).to_dict()
    run_dir = tmp_path_factory.mktemp("tcr")
    state = refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    return run_dir


def rows(run_dir: Path, sql: str) -> list[tuple]:
    return query(run_dir / "catalog.duckdb", sql)[1]


def test_published_settings():
    cfg = load_recipe(REPO / "recipes" / "grpo-tcr.yaml")
    assert cfg.rollout.agent.enabled and cfg.rollout.agent.max_turns == 16 and cfg.rollout.agent.tools == ["python"]
    assert (cfg.rollout.samples_per_prompt, cfg.rollout.max_new_tokens, cfg.rollout.temperature) == (8, 10480, 1.0)
    assert (cfg.grpo.clip_eps_low, cfg.grpo.clip_eps_high, cfg.grpo.beta) == (0.2, 0.28, 0.0)
    assert (cfg.grpo.loss_aggregation, cfg.grpo.learning_rate) == ("token_mean", 1e-6)
    # packs of up to 16384 tokens, one per micro-batch: not a whole group of 8 long conversations
    assert (cfg.grpo.share_prompt, cfg.grpo.micro_batch_size, cfg.grpo.pack_length) == (False, 1, 16384)
    assert (cfg.reward.verifier, cfg.reward.overlong_buffer, cfg.reward.overlong_factor) == ("tcr", 3000, 1.0)
    assert cfg.reward.verification_reward == 1.0
    # stage 1, the multi-turn SFT cold start, is one --set away (off: model.policy is its checkpoint)
    assert not cfg.sft.enabled and cfg.sft.epochs == 10 and cfg.sft.path == "data/math-tools/cold-start.jsonl"
    assert (cfg.rollout.agent.max_calls_per_turn, cfg.rollout.agent.tool_seconds_per_rollout) == (4, 60.0)
    both = load_recipe(REPO / "recipes" / "grpo-tcr.yaml", ["sft.enabled=true", "model.policy=smollm2-135m-instruct"])
    assert check_recipe(both) == []


def test_turns_cover_every_token_and_masks_cover_the_models(tcr_run):
    assert rows(tcr_run, "SELECT count(*) FROM rollouts") == [(2 * 4 * 4,)]
    # Spans: assistant turns and tool results tile each response exactly, in order.
    bad_tiling = rows(
        tcr_run,
        """
        WITH spans AS (SELECT DISTINCT step, prompt_id, sample_idx, token_start, token_end, role FROM turns)
        SELECT o.step, o.prompt_id, o.sample_idx FROM rollouts o JOIN spans s USING (step, prompt_id, sample_idx)
        GROUP BY o.step, o.prompt_id, o.sample_idx, o.response_tokens
        HAVING sum(s.token_end - s.token_start) <> o.response_tokens OR min(s.token_start) <> 0
            OR max(s.token_end) <> o.response_tokens""",
    )
    assert bad_tiling == []
    # The loss mask is true exactly on assistant spans.
    mismatched = rows(
        tcr_run,
        """
        SELECT o.step, o.prompt_id, o.sample_idx FROM rollouts o
        JOIN (SELECT step, prompt_id, sample_idx, sum(token_end - token_start) AS sampled FROM turns
              WHERE role = 'assistant' GROUP BY ALL) t USING (step, prompt_id, sample_idx)
        WHERE len(list_filter(o.response_mask, lambda m: m)) <> t.sampled
           OR len(o.response_mask) <> o.response_tokens OR len(o.response_logprobs) <> o.response_tokens""",
    )
    assert mismatched == []
    masked_positions = rows(
        tcr_run,
        """
        SELECT count(*) FROM rollouts o JOIN turns t USING (step, prompt_id, sample_idx)
        WHERE t.role = 'tool' AND t.token_end > t.token_start
          AND list_bool_or(list_slice(o.response_mask, t.token_start + 1, t.token_end))""",
    )
    assert masked_positions == [(0,)]
    # The learner trained on exactly the sampled tokens.
    trained = rows(
        tcr_run,
        """
        SELECT s.step, s.response_tokens, (SELECT sum(len(list_filter(response_mask, lambda m: m))) FROM rollouts o
                                           WHERE o.step = s.step) FROM steps s ORDER BY s.step""",
    )
    assert len(trained) == 2 and all(a == b for _, a, b in trained)


def test_scripted_tool_calls_ran_in_the_sandbox_and_failures_are_recorded(tcr_run):
    ran = rows(
        tcr_run,
        """
        SELECT t.status, t.exit_code, t.text = p.ground_truth FROM turns t JOIN prompts p USING (run, prompt_id)
        WHERE t.role = 'tool' AND t.sample_idx = 0 AND t.turn = 0""",
    )
    assert len(ran) == 8 and all(r == ("ok", 0, True) for r in ran)  # 4 prompts x 2 steps, each scripted
    bad = rows(
        tcr_run,
        "SELECT status, split_part(failure, ':', 1), text LIKE 'error: bad_json%' FROM turns "
        "WHERE role = 'tool' AND sample_idx = 1 AND failure IS NOT NULL",
    )
    assert bad and all(b == ("invalid_call", "bad_json", True) for b in bad)
    # The documented questions: which tool calls failed and why; where the agent ran out of budget.
    failed = rows(
        tcr_run,
        "SELECT status, split_part(failure, ':', 1) AS why, count(*) FROM turns "
        "WHERE role = 'tool' AND (failure IS NOT NULL OR status <> 'ok') GROUP BY ALL",
    )
    assert ("invalid_call", "bad_json", len(bad)) in failed
    out_of_budget = rows(tcr_run, "SELECT finish_reason, count(*) FROM rollouts GROUP BY ALL")
    assert sum(n for _, n in out_of_budget) == 32 and dict(out_of_budget).get("stop", 0) >= 8


def test_code_the_interpreter_cannot_be_given_is_an_invalid_call_and_the_run_goes_on(tcr_run):
    recorded = rows(
        tcr_run,
        "SELECT status, split_part(failure, ':', 1), arguments FROM turns "
        "WHERE role = 'tool' AND sample_idx = 3 ORDER BY step, prompt_id, call_idx",
    )
    assert len(recorded) == 2 * 4 * 2  # steps x prompts x calls
    assert all((status, why) == ("invalid_call", "bad_code") for status, why, _ in recorded)
    assert [json.loads(arguments)["code"] for _, _, arguments in recorded[:2]] == ["print(\x00)", "\ud800"]
    assert rows(tcr_run, "SELECT max(tool_rounds) FROM rollouts WHERE sample_idx = 3") == [(0,)]


def test_rewards_are_tcr_plus_the_overlong_penalty(tcr_run):
    scored = rows(
        tcr_run,
        """
        SELECT w.verifier, w.correct, w.verifier_score, w.overlong_penalty, w.reward, o.tool_rounds,
               o.response_tokens, o.sample_idx, o.final_text
        FROM rewards w JOIN rollouts o USING (run, step, prompt_id, sample_idx) WHERE w.reward_version = 'train'""",
    )
    assert len(scored) == 32
    for verifier, correct, score, penalty, reward, rounds, length, sample, final in scored:
        assert verifier == "tcr"
        expected = 1.0 if correct == 1.0 else min(-1.0 + 0.1 * rounds, -0.6)
        assert score == pytest.approx(expected)
        assert penalty == pytest.approx(min(0.0, -(length - (BUDGET - BUFFER)) / BUFFER))
        assert reward == pytest.approx(score + penalty)
        if sample == 0:  # scripted: one tool round, then the right answer in the final turn
            assert (correct, rounds) == (1.0, 1) and final.startswith("The result is \\boxed{")
    wrong_after_tool = [s for s in scored if s[7] == 2 and s[5] == 1 and s[1] == 0.0]
    assert all(s[2] == pytest.approx(-0.9) for s in wrong_after_tool)
    by_rounds = rows(
        tcr_run,
        "SELECT o.tool_rounds, count(*) AS n, round(avg(w.reward), 3) AS reward, "
        "avg(w.correct) AS accuracy FROM rewards w JOIN rollouts o USING (run, step, "
        "prompt_id, sample_idx) GROUP BY 1 ORDER BY 1",
    )  # as in docs/recipes.md
    assert by_rounds[0][0] == 0 and by_rounds[-1][0] >= 1 and sum(n for _, n, _, _ in by_rounds) == 32
    assert rows(tcr_run, "SELECT count(*) FROM rewards_recomputed WHERE abs(reward - reward_sql) > 1e-9") == [(0,)]
