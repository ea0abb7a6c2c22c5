"""The rollout stage's agent mode: one step's conversations as ROLLOUTS rows and TURNS rows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from refiner_core import REPO_ROOT
from refiner_core.agent.loop import REFUSED, AgentRollout, AgentSettings, model_scorer, run_agent
from refiner_core.agent.tools.base import make_tool
from refiner_core.config import AgentConfig
from refiner_core.models import release_gpu_cache
from refiner_core.rollout.base import RolloutEngine, SamplingParams


def read_scripted(path: str | Path, chosen: list[str], samples: int) -> dict[tuple[int, int], list[str]]:
    """Scripted conversations of this step's prompts: (prompt index, sample) -> assistant texts."""
    path = Path(path) if Path(path).is_absolute() else REPO_ROOT / path
    index = {prompt_id: k for k, prompt_id in enumerate(chosen)}
    scripted = {}
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        turns = row.get("turns")
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns) or "sample_idx" not in row:
            raise ValueError(f"{path} line {n}: expected {{prompt_id, sample_idx, turns: [text, ...]}}")
        if str(row.get("prompt_id")) in index and 0 <= int(row["sample_idx"]) < samples:
            scripted[(index[str(row["prompt_id"])], int(row["sample_idx"]))] = turns
    return scripted


def agent_rollouts(
    engine: RolloutEngine,
    tokenizer,
    policy_path: str,
    prompts: list[list[int]],
    chosen: list[str],
    params: SamplingParams,
    agent: AgentConfig,
    budget: int,
    desc: str = "",
) -> list[AgentRollout]:
    """Run the agent loop over the step's prompts with the configured tools (closed afterwards); `budget` caps
    each conversation's response tokens, sampled and inserted."""
    tools = {name: make_tool(name, agent) for name in agent.tools}
    scripted, score = {}, None
    if agent.scripted_path:
        scripted = read_scripted(agent.scripted_path, chosen, params.n)
        if scripted:
            from refiner_core.models import load_model

            score = model_scorer(load_model(policy_path), params.temperature)
    if agent.max_turn_tokens > 0:
        params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, agent.max_turn_tokens))
    settings = agent_settings(agent, budget)
    try:
        return run_agent(engine, tokenizer, prompts, params, tools, settings, desc=desc, scripted=scripted, score=score)
    finally:
        for tool in tools.values():
            tool.close()
        if score is not None:  # the scripted turns' scorer held a copy of the policy
            score = None
            release_gpu_cache()


def agent_settings(agent: AgentConfig, budget: int) -> AgentSettings:
    """The loop's settings from rollout.agent, with `budget` response tokens per conversation."""
    return AgentSettings(
        max_turns=agent.max_turns,
        max_response_tokens=budget,
        max_calls_per_turn=agent.max_calls_per_turn,
        tool_seconds=agent.tool_seconds_per_rollout,
        stop_at_first_call=agent.stop_at_first_call,
    )


def rollout_row(r: AgentRollout, tokenizer) -> dict:
    """The agent-specific columns of a ROLLOUTS row."""
    return {
        "response_token_ids": r.token_ids,
        "response_logprobs": r.logprobs,
        "response_mask": r.loss_mask,
        "response_text": tokenizer.decode(r.token_ids, skip_special_tokens=True),
        "response_tokens": len(r.token_ids),
        "finish_reason": r.finish_reason,
        "tool_rounds": r.tool_rounds,
        "final_text": r.final_text,
    }


def call_counts(r: AgentRollout) -> dict:
    """A conversation's assistant turns and tool calls by outcome (refiner_core.eval.evaluate.AGENT_COLUMNS)."""
    calls = [t for t in r.turns if t.role == "tool"]
    return {
        "turns": sum(t.role == "assistant" for t in r.turns),
        "tool_calls": len(calls),
        "well_formed_calls": sum(t.status != "invalid_call" for t in calls),
        "tool_errors": sum(t.status != "ok" for t in calls),
        "refused_calls": sum(t.status == REFUSED for t in calls),
        "tool_rounds": r.tool_rounds,
    }


def agent_eval_responses(
    engine: RolloutEngine, tokenizer, prompts: list[dict], modes: dict[str, SamplingParams], agent: AgentConfig
) -> list[dict]:
    """Held-out conversations for every eval mode (refiner_core.eval.evaluate.EvalSettings.sampling): the same
    loop, tools and caps as training, never scripted; each mode's max_new_tokens is a conversation's budget.
    Rollout-shaped rows with the eval `mode`, the final answer's turn and the call counts."""
    tools = {name: make_tool(name, agent) for name in agent.tools}
    rows = []
    try:
        for mode, params in modes.items():
            budget = params.max_new_tokens
            if agent.max_turn_tokens > 0:
                params = dataclasses.replace(params, max_new_tokens=min(budget, agent.max_turn_tokens))
            conversations = run_agent(
                engine,
                tokenizer,
                [p["prompt_token_ids"] for p in prompts],
                params,
                tools,
                agent_settings(agent, budget),
                desc=f"eval {mode}",
            )
            rows += [
                eval_row(c, prompts[c.prompt_index], mode, params, budget, engine.name, tokenizer)
                for c in conversations
            ]
    finally:
        for tool in tools.values():
            tool.close()
    return rows


def eval_row(
    c: AgentRollout, prompt: dict, mode: str, params: SamplingParams, budget: int, engine: str, tokenizer
) -> dict:
    """One held-out conversation as an eval response row (refiner_core.eval.evaluate.score_responses reads it)."""
    return {
        "mode": mode,
        "prompt_id": prompt["prompt_id"],
        "sample_idx": c.sample_idx,
        "temperature": params.temperature,
        "seed": params.seed,
        "engine": engine,
        "prompt_token_ids": prompt["prompt_token_ids"],
        **rollout_row(c, tokenizer),
        "max_new_tokens": budget,
        **call_counts(c),
    }


def turn_rows(r: AgentRollout, identity: dict) -> list[dict]:
    """TURNS rows of one conversation; `identity` holds run, step, prompt_id, sample_idx."""
    return [{**identity, **dataclasses.asdict(t)} for t in r.turns]


def agent_problems(agent) -> list[str]:
    """What keeps rollout.agent (an AgentConfig) from running, known before any stage starts."""
    from refiner_core.agent.tools.base import TOOLS
    from refiner_core.agent.tools.python_sandbox import SandboxUnavailable, check_sandbox

    problems = []
    if not agent.tools:  # each name is checked with the other backends' (preflight.backend_problems)
        problems.append(f"rollout.agent.tools = {agent.tools!r}: choose one or more of {sorted(TOOLS)}")
    for name in (
        "max_turns",
        "max_calls_per_turn",
        "tool_concurrency",
        "sandbox_cpu_seconds",
        "sandbox_memory_mb",
        "sandbox_max_processes",
        "sandbox_max_file_mb",
        "sandbox_max_output_bytes",
    ):
        if getattr(agent, name) < 1:
            problems.append(f"rollout.agent.{name} = {getattr(agent, name)!r}: must be at least 1")
    if agent.sandbox_wall_seconds <= 0 or agent.max_turn_tokens < 0:
        problems.append("rollout.agent: sandbox_wall_seconds must be positive and max_turn_tokens at least 0")
    elif agent.tool_seconds_per_rollout < agent.sandbox_wall_seconds:
        problems.append(
            f"rollout.agent.tool_seconds_per_rollout = {agent.tool_seconds_per_rollout!r}: at least "
            f"sandbox_wall_seconds ({agent.sandbox_wall_seconds!r}), or no call could ever run"
        )
    if agent.scripted_path:
        path = Path(agent.scripted_path)
        if not (path if path.is_absolute() else REPO_ROOT / path).is_file():
            problems.append(f"rollout.agent.scripted_path: {agent.scripted_path} does not exist")
    if "python" in agent.tools:
        try:
            check_sandbox()
        except SandboxUnavailable as e:
            problems.append(f"rollout.agent.tools: {e}")
    return problems
