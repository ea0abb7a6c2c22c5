"""The refiner's prompt: system instructions plus the agent's reasoning and raw tool output."""

from __future__ import annotations

REFINER_SYSTEM_PROMPT = (
    "You are a research refiner. You receive a question, a search agent's reasoning and the raw output of a "
    "search tool. Write exactly one <answer>...</answer> block that answers the question. Wrap every factual "
    "claim as <snippet id=ID1,ID2>claim</snippet>, citing only snippet IDs that appear in the tool output. "
    "Do not add facts that the snippets do not support."
)


def refiner_messages(question: str, reasoning: str, tool_output: str) -> list[dict]:
    user = (
        f"Question:\n{question}\n\n"
        f"Agent reasoning:\n{reasoning}\n\n"
        f"Search tool output:\n{tool_output}\n\n"
        "Write the refined answer."
    )
    return [{"role": "system", "content": REFINER_SYSTEM_PROMPT}, {"role": "user", "content": user}]


def render_prompt(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text, list(ids)


JUDGE_SYSTEM_PROMPT = (
    "You are a strict grader. Read the question, the response and one criterion. Decide how well the response "
    'meets the criterion: 0 = not at all, 1 = partially, 2 = fully. Reply with JSON only: {"score": 0}, '
    '{"score": 1} or {"score": 2}.'
)


def judge_messages(question: str, response: str, criterion: str) -> list[dict]:
    user = f"Question:\n{question}\n\nResponse:\n{response}\n\nCriterion:\n{criterion}\n\nJSON:"
    return [{"role": "system", "content": JUDGE_SYSTEM_PROMPT}, {"role": "user", "content": user}]
