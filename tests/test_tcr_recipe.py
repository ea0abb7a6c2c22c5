"""recipes/tcr-smollm2.yaml, seed 004 end to end: the SFT cold start on tool-using conversations, then GRPO-TCR, with
held-out evaluations of the base model, the cold start and GRPO steps through the agent loop; their tool-use columns
in the evals table, the eval summary, the model card and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refiner_core.agent.hermes import hermes_block
from refiner_core.agent.loop import AgentSettings, model_scorer, run_agent
from refiner_core.agent.rollout import eval_row
from refiner_core.agent.tools.python_sandbox import PythonSandbox, PythonTool, SandboxLimits, check_sandbox
from refiner_core.config import RewardConfig, load_recipe
from refiner_core.data.prompts import render_prompt
from refiner_core.eval.evaluate import format_table, markdown_table, score_responses, summarize
from refiner_core.models import load_model
from refiner_core.preflight import check_recipe
from refiner_core.rollout.base import SamplingParams
from refiner_core.rollout.hf_engine import HFRolloutEngine
from refiner_core.store.storage import query

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tcr-smollm2.yaml"
TCR_REWARD = RewardConfig(verifier="tcr", verification_reward=1.0, citation_weight=0.0, format_weight=0.0)


def test_the_recipe_runs_both_stages_with_the_published_algorithm():
    cfg = load_recipe(RECIPE)
    assert cfg.model.policy == "smollm2-135m-instruct"
    assert cfg.sft.enabled and cfg.sft.path == "data/math-tools/cold-start.jsonl"
    assert cfg.data.path == "data/math-tools/questions.jsonl" and cfg.data.validation_fraction > 0
    agent = cfg.rollout.agent
    assert agent.enabled and agent.tools == ["python"] and agent.max_turns >= 2
    assert agent.max_calls_per_turn >= 1 and agent.tool_seconds_per_rollout >= agent.sandbox_wall_seconds
    assert (cfg.reward.verifier, cfg.reward.overlong_factor) == ("tcr", 1.0) and cfg.reward.overlong_buffer > 0
    assert (cfg.grpo.beta, cfg.grpo.clip_eps_low, cfg.grpo.clip_eps_high) == (0.0, 0.2, 0.28)
    assert cfg.grpo.loss_aggregation == "token_mean" and (cfg.rollout.engine, cfg.grpo.learner) == ("hf", "torch")
    assert cfg.eval.every and cfg.grpo.steps % cfg.eval.every == 0 and cfg.eval.greedy
    assert check_recipe(cfg) == []


def test_agent_evaluations_count_calls_turns_and_boxed_answers(tiny_model_path, tiny_tokenizer):
    """Real conversations of the loop (scripted tool-using turns, the sandbox running the calls) become eval rows,
    scored by the training reward code: per-response counts, and the summary checked by hand."""
    check_sandbox()
    tool = PythonTool(PythonSandbox(SandboxLimits(wall_seconds=10.0), concurrency=2))
    model = load_model(tiny_model_path)
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=2)
    prompts = [
        {"prompt_id": pid, "prompt_token_ids": render_prompt(tiny_tokenizer, [{"role": "user", "content": q}])[1]}
        for pid, q in (("a", "What is 6 * 7?"), ("b", "What is 2 + 3?"))
    ]
    call = hermes_block("python", {"code": "print(6 * 7)"})
    failing = hermes_block("python", {"code": "import sys; sys.exit(3)"})
    scripted = {
        (0, 0): [call, "The result is \\boxed{42}."],  # right, one call
        (1, 0): ['<tool_call>{"name": "python"</tool_call>' + failing, "It is 7."],  # wrong, unboxed, 2 bad calls
    }
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=300, seed=1)
    try:
        conversations = run_agent(
            engine,
            tiny_tokenizer,
            [p["prompt_token_ids"] for p in prompts],
            params,
            {"python": tool},
            AgentSettings(max_turns=3, max_response_tokens=300),
            scripted=scripted,
            score=model_scorer(model, 1.0),
        )
    finally:
        tool.close()
    responses = [
        eval_row(c, prompts[c.prompt_index], "greedy", params, 300, "hf", tiny_tokenizer) for c in conversations
    ]
    rows = score_responses(
        responses,
        {"a": {"ground_truth": "42", "snippet_ids": []}, "b": {"ground_truth": "5", "snippet_ids": []}},
        {},
        None,
        TCR_REWARD,
        "zero",
        4000,
        run="r",
        step=0,
        phase="sft",
        policy={"path": "p", "hash": "h"},
        pass_rubric_score=0.5,
    )
    by_prompt = {r["prompt_id"]: r for r in rows}
    a, b = by_prompt["a"], by_prompt["b"]
    counts = ("turns", "tool_calls", "well_formed_calls", "tool_errors", "refused_calls", "tool_rounds")
    assert [a[k] for k in counts] == [2, 1, 1, 0, 0, 1]
    assert [b[k] for k in counts] == [2, 2, 1, 2, 0, 1]  # one call did not parse, the other exited 3
    assert (a["passed"], a["boxed"], a["reward"]) == (True, True, 1.0)
    assert (b["passed"], b["boxed"]) == (False, False) and b["reward"] == pytest.approx(-0.9)
    [summary] = summarize(rows, pass_k=1)
    assert (summary["accuracy"], summary["boxed"], summary["tool_call_rate"]) == (0.5, 0.5, 1.0)
    assert summary["well_formed_calls"] == pytest.approx(2 / 3) and summary["tool_errors"] == pytest.approx(2 / 3)
    assert summary["turns"] == 2.0 and summary["mean_tokens"] == (a["response_tokens"] + b["response_tokens"]) / 2
    header = format_table([summary]).splitlines()[0]
    for column in ("accuracy", "boxed", "tool calls", "well-formed calls", "tool errors", "turns", "mean tokens"):
        assert column in header and column in markdown_table([summary]).splitlines()[0]
    judged = {**summary, **dict.fromkeys(("accuracy", "boxed", "tool_call_rate", "turns"))}
    assert "accuracy" not in format_table([judged]) and "tool calls" not in markdown_table([judged])
    assert "format-valid" not in format_table([summary]) and "format-valid" in markdown_table([judged])


@pytest.fixture(scope="module")
def tcr_run(prefect_server, tmp_path_factory):
    """The recipe on the tiny model, cut short: 24 cold-start conversations plus two unusable ones, one GRPO step,
    three held-out questions evaluated at each phase."""
    from flows.refiner import refiner_pipeline

    check_sandbox()
    folder = tmp_path_factory.mktemp("tcr-data")
    rows = [json.loads(line) for line in (REPO / "data" / "math-tools" / "cold-start.jsonl").read_text().splitlines()]
    bad = [
        {**rows[0], "id": "bad-role", "messages": rows[0]["messages"][:2] + [{"role": "function", "content": "1"}]},
        {**rows[1], "id": "bad-tool", "tools": [{"function": {"name": "browser"}}]},
    ]
    (folder / "cold.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:24] + bad))
    overrides = [
        "model.policy=tiny-qwen3",
        "model.dtype=float32",
        "model.max_position_embeddings=2048",
        f"sft.path={folder / 'cold.jsonl'}",
        "sft.learning_rate=3e-3",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.agent.max_turn_tokens=24",
        "grpo.steps=1",
        "grpo.learning_rate=1e-3",
        "eval.every=1",
        "eval.prompts=3",
        "run.save_every=1",
    ]
    recipe = load_recipe(RECIPE, overrides).to_dict()
    run_dir = tmp_path_factory.mktemp("tcr-run")
    state = refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    return run_dir, state.result()


def test_the_cold_start_quarantines_unusable_conversations_and_trains_on_the_rest(tcr_run):
    run_dir, _ = tcr_run
    db = run_dir / "catalog.duckdb"
    assert query(db, "SELECT reason FROM quarantine WHERE stage = 'prepare-sft' ORDER BY reason")[1] == [
        ("unknown_role",),
        ("unknown_tool",),
    ]
    stats = dict(query(db, "SELECT name, value FROM sft_stats WHERE kind = 'count'")[1])
    assert stats["tool_conversations"] == stats["examples_out"] == 24
    _, policies = query(db, "SELECT DISTINCT policy FROM rollouts")
    assert policies == [(str(run_dir / "checkpoints" / "sft"),)]


def test_base_cold_start_and_grpo_are_evaluated_with_the_agent_loop(tcr_run):
    run_dir, result = tcr_run
    db = run_dir / "catalog.duckdb"
    phases = query(
        db,
        "SELECT phase, step, count(*), count(turns), count(tool_calls), min(turns), count(boxed) FROM evals "
        "GROUP BY ALL ORDER BY step, phase",
    )[1]
    assert phases == [("base", 0, 3, 3, 3, 1, 3), ("sft", 0, 3, 3, 3, 1, 3), ("grpo", 1, 3, 3, 3, 1, 3)]
    assert {s["phase"] for s in result["evals"]} == {"base", "sft", "grpo"}
    assert all(s["tool_call_rate"] is not None and s["accuracy"] is not None for s in result["evals"])
    card = (run_dir / "checkpoints" / "step_0001" / "README.md").read_text()
    assert "| tool calls |" in card and "| turns |" in card and "| accuracy |" in card


def test_refiner_plot_draws_the_tool_use_panels(tcr_run, tmp_path):
    from refiner_core.publish.plots import eval_summary, plot_steps

    run_dir, _ = tcr_run
    evals = eval_summary(run_dir / "catalog.duckdb")
    assert {"accuracy", "tool_call_rate", "turns", "boxed"} <= {k for e in evals for k, v in e.items() if v is not None}
    _, steps = query(run_dir / "catalog.duckdb", "SELECT * FROM steps")
    columns, _ = query(run_dir / "catalog.duckdb", "SELECT * FROM steps LIMIT 0")
    out = plot_steps([dict(zip(columns, r)) for r in steps], tmp_path / "curves.png", evals=evals)
    assert out.stat().st_size > 10_000


@pytest.mark.slow
def test_smollm2_after_the_cold_start_calls_the_tool_where_the_base_model_does_not(prefect_server, tmp_path):
    """The recipe on SmolLM2-135M-Instruct, shortened: a cold start of one epoch on 16 conversations at three
    times the recipe's rate, one GRPO step, four held-out questions, conversations cut at 128 tokens (a call comes in
    the first turn). The base model never writes a tool call; the cold-start checkpoint does, in at least half."""
    from flows.refiner import refiner_pipeline

    check_sandbox()
    lines = (REPO / "data" / "math-tools" / "cold-start.jsonl").read_text().splitlines()
    (tmp_path / "cold.jsonl").write_text("\n".join(lines[:16]) + "\n")
    overrides = [
        f"sft.path={tmp_path / 'cold.jsonl'}",
        "sft.epochs=1",
        "sft.learning_rate=3e-4",
        "rollout.max_new_tokens=128",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "grpo.steps=1",
        "eval.every=1",
        "eval.prompts=4",
        "run.save_every=1",
    ]
    run_dir = tmp_path / "run"
    state = refiner_pipeline(recipe=load_recipe(RECIPE, overrides).to_dict(), run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    called = dict(
        query(
            run_dir / "catalog.duckdb",
            "SELECT phase, avg((tool_calls > 0)::INT) FROM evals WHERE step = 0 GROUP BY phase",
        )[1]
    )
    assert called["base"] == 0.0 and called["sft"] >= 0.5, called
