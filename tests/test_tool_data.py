"""scripts/make_tool_data.py and the rows it wrote: real sandbox results, right answers, an error then a fix in some
conversations, and no cold-start question among the questions GRPO trains on or holds out."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from refiner_core.agent.hermes import parse_tool_calls
from refiner_core.config import load_recipe
from refiner_core.data.rows import prompt_hash, split_of, validate_rows
from refiner_core.data.sources import load_rows
from refiner_core.reward.ground_truth import last_boxed
from refiner_core.sft.data import SFTLimits, normalise_tool_rows, prepare_sft
from scripts.make_tool_data import FAMILIES, PATTERNS, WORDINGS, make, problem_of_question, reworded

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "math-tools"
RECIPE = REPO / "recipes" / "tcr-smollm2.yaml"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _question(row: dict) -> str:
    return [m for m in row["messages"] if m["role"] == "user"][-1]["content"]


COLD = _jsonl(DATA / "cold-start.jsonl")
QUESTIONS = _jsonl(DATA / "questions.jsonl")


def test_every_question_is_one_of_the_families():
    for row in COLD + QUESTIONS + _jsonl(DATA / "train.jsonl"):
        assert problem_of_question(_question(row)) is not None, _question(row)
    import random

    rng = random.Random(0)
    for make_problem in FAMILIES.values():
        for _ in range(20):
            problem = make_problem(rng)
            for k in range(len(WORDINGS[problem.family])):
                assert problem_of_question(reworded(problem, k).question) == problem.key
    families = Counter(problem_of_question(_question(r))[0] for r in COLD)
    assert set(families) == set(FAMILIES) and min(families.values()) == 40


def _wording(question: str) -> int:
    return next(k for k, (family, pattern) in enumerate(PATTERNS) if pattern.fullmatch(question)) % 3


def test_grpo_asks_in_wordings_the_cold_start_never_saw():
    assert {_wording(_question(r)) for r in COLD} == {0}
    asked = Counter(_wording(_question(r)) for r in QUESTIONS)
    assert set(asked) == {0, 1, 2} and min(asked.values()) > len(QUESTIONS) / 5


def test_cold_start_conversations_call_the_tool_read_it_and_answer_right():
    assert len(COLD) == 320 and len(QUESTIONS) == 160
    two_calls = 0
    for row in COLD:
        roles = [m["role"] for m in row["messages"]]
        calls = roles.count("tool")
        assert roles == ["system", "user"] + ["assistant", "tool"] * calls + ["assistant"]
        tools = [m["content"] for m in row["messages"] if m["role"] == "tool"]
        assert tools[-1] == row["ground_truth"]  # what the sandbox printed is the answer
        assert last_boxed(row["messages"][-1]["content"]) == row["ground_truth"]
        for m in row["messages"]:
            if m["role"] == "assistant" and m is not row["messages"][-1]:
                [call] = parse_tool_calls(m["content"], {"python"})
                assert call.failure is None and set(call.arguments) == {"code"}
        if calls == 2:  # the first try failed in the sandbox, the assistant read the error and fixed the code
            two_calls += 1
            assert "Error" in tools[0] and tools[0].splitlines()[-1] in row["messages"][4]["content"]
    assert 0.08 < two_calls / len(COLD) < 0.3
    assert {r["messages"][0]["content"] for r in COLD + QUESTIONS} == {QUESTIONS[0]["messages"][0]["content"]}


def test_the_cold_start_never_asks_a_question_grpo_trains_on_or_holds_out(tiny_tokenizer):
    cold = {problem_of_question(_question(r)) for r in COLD}
    asked = {problem_of_question(_question(r)) for r in QUESTIONS + _jsonl(DATA / "train.jsonl")}
    assert len(cold) == len(COLD) and cold.isdisjoint(asked)
    # Whatever split a seed holds out: the recipe's seed and the bench's second one.
    fraction = load_recipe(RECIPE).data.validation_fraction
    usable, rejected = normalise_tool_rows(load_rows(str(DATA / "cold-start.jsonl")))
    rows = validate_rows(usable).rows
    assert rejected == [] and len(rows) == len(COLD)
    for seed in (42, 7):
        held_out = [
            {"prompt_id": r["id"], "prompt_hash": prompt_hash(r), "question": _question(r)}
            for r in QUESTIONS
            if split_of(r["id"], fraction, seed) == "validation"
        ]
        assert len(held_out) >= 30
        assert {q["question"] for q in held_out}.isdisjoint(_question(r) for r in COLD)
    prepared = prepare_sft(rows, tiny_tokenizer, "t", SFTLimits(pack_length=2048), 0.1, 42, held_out=held_out)
    assert prepared.stats["held_out_rows"] == 0 and prepared.rejected == []
    assert prepared.stats["tool_conversations"] == len(COLD)


@pytest.fixture(scope="module")
def python_tool():
    from refiner_core.agent.tools.python_sandbox import make_python_tool
    from refiner_core.config import AgentConfig

    tool = make_python_tool(AgentConfig(tool_concurrency=2))
    yield tool
    tool.close()


def test_the_generator_runs_the_sandbox_and_is_seeded(python_tool, tmp_path):
    excluded = tmp_path / "asked.jsonl"
    excluded.write_text(json.dumps(QUESTIONS[0]) + "\n")
    questions, cold = make(8, 12, 5, python_tool, excluded=[excluded])
    again = make(8, 12, 5, python_tool, excluded=[excluded])
    assert (questions, cold) == again
    assert make(8, 12, 6, python_tool, excluded=[excluded])[1] != cold
    keys = {problem_of_question(_question(r)) for r in cold}
    assert problem_of_question(_question(QUESTIONS[0])) not in keys
    assert keys.isdisjoint(problem_of_question(_question(r)) for r in questions)
    failing = [r for r in cold if sum(m["role"] == "tool" for m in r["messages"]) == 2]
    assert failing and all(
        "Traceback" in r["messages"][3]["content"] or "Error" in r["messages"][3]["content"] for r in failing
    )
