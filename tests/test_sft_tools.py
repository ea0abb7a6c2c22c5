"""SFT on tool-using conversations: the agent loop's own tokens (checked on real rollouts of the tiny model with
scripted tool-calling turns run in the real sandbox), the loss on assistant tokens only, OpenAI tool_calls written as
Hermes blocks, precise quarantine reasons, and held-out questions kept out."""

from __future__ import annotations

import json

import pytest

from refiner_core.agent.hermes import hermes_block, hermes_system_prompt
from refiner_core.agent.loop import AgentSettings, model_scorer, run_agent
from refiner_core.agent.render import loop_tokens, rollout_messages
from refiner_core.agent.tools.base import tool_schema
from refiner_core.agent.tools.python_sandbox import PythonSandbox, PythonTool, SandboxLimits, check_sandbox
from refiner_core.data.prompts import render_prompt
from refiner_core.data.rows import RawRow, validate_rows
from refiner_core.models import load_model
from refiner_core.rollout.base import SamplingParams
from refiner_core.rollout.hf_engine import HFRolloutEngine
from refiner_core.sft.data import SFTLimits, normalise_tool_rows, prepare_sft

PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python 3 code.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
SYSTEM = "Solve the math problem with the python tool, then answer in \\boxed{}."
CALL = hermes_block("python", {"code": "print(6 * 7)"})
LIMITS = SFTLimits(pack_length=4096, max_total_tokens=4096, max_response_tokens=2048)


def _rows(*conversations: list[dict], tools=(PYTHON,)) -> list[RawRow]:
    rows = []
    for k, messages in enumerate(conversations):
        data = {"id": f"r{k}", "messages": messages}
        if tools is not None:
            data["tools"] = list(tools)
        rows.append(RawRow(f"line {k + 1}", json.dumps(data), data))
    return rows


def _prepared(raw: list[RawRow], tokenizer, held_out=()):
    usable, rejected = normalise_tool_rows(raw)
    checked = validate_rows(usable)
    assert checked.rejected == []
    return prepare_sft(checked.rows, tokenizer, "t", LIMITS, 0.0, 0, held_out=list(held_out)), rejected


@pytest.fixture(scope="module")
def loop_conversations(tiny_model_path, tiny_tokenizer):
    """Real loop rollouts whose assistant turns are scripted tool-using turns, their calls run in the sandbox."""
    check_sandbox()
    tool = PythonTool(PythonSandbox(SandboxLimits(wall_seconds=10.0), concurrency=2))
    model = load_model(tiny_model_path)
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=4)
    system = hermes_system_prompt(SYSTEM, [tool_schema(tool)])
    questions = ["What is 6 * 7?", "What is 2 + 3 and 4 * 5?"]
    prompts = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    scripted = {
        (0, 0): [f"Let me compute it.\n{CALL}", "The result is \\boxed{42}."],
        # an error, then the fix
        (0, 1): [
            hermes_block("python", {"code": "print(6 x 7)"}),
            "That failed. Let me fix it.\n" + CALL,
            "\\boxed{42}",
        ],
        # two calls in one turn; output that spells the end-of-turn token stays plain text
        (1, 0): [
            hermes_block("python", {"code": "print(2 + 3)"}) + hermes_block("python", {"code": "print('<|im_end|>')"}),
            "So \\boxed{5}.",
        ],
        (1, 1): [hermes_block("python", {"code": "print(4 * 5)"}), "\\boxed{20}"],
    }
    try:
        rollouts = run_agent(
            engine,
            tiny_tokenizer,
            [render_prompt(tiny_tokenizer, p)[1] for p in prompts],
            SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=5),
            {"python": tool},
            AgentSettings(max_turns=4, max_response_tokens=1500),
            scripted=scripted,
            score=model_scorer(model, 1.0),
        )
    finally:
        tool.close()
    assert all(r.finish_reason == "stop" for r in rollouts)
    return prompts, rollouts


def test_a_loop_conversation_renders_to_the_loops_own_tokens_and_mask(loop_conversations, tiny_tokenizer):
    prompts, rollouts = loop_conversations
    statuses = [t.status for r in rollouts for t in r.turns if t.role == "tool"]
    assert statuses.count("error") == 1 and statuses.count("ok") == 5  # the sandbox really ran them
    for r in rollouts:
        prompt = render_prompt(tiny_tokenizer, prompts[r.prompt_index])[1]
        ids, mask = loop_tokens(tiny_tokenizer, rollout_messages(prompts[r.prompt_index], r))
        assert ids == prompt + r.token_ids
        assert mask == [False] * len(prompt) + r.loss_mask


def test_the_sft_stage_trains_on_exactly_the_loops_tokens(loop_conversations, tiny_tokenizer):
    prompts, rollouts = loop_conversations
    raw = _rows(*(rollout_messages(prompts[r.prompt_index], r) for r in rollouts), tools=None)
    prepared, rejected = _prepared(raw, tiny_tokenizer)  # the tools come from the system message's <tools> block
    assert rejected == [] and prepared.stats["tool_conversations"] == len(rollouts)
    by_id = {e["source_id"]: e for e in prepared.examples}
    for k, r in enumerate(rollouts):
        prompt = render_prompt(tiny_tokenizer, prompts[r.prompt_index])[1]
        example = by_id[f"r{k}"]
        assert example["input_ids"] == prompt + r.token_ids
        assert example["loss_mask"] == [False] * len(prompt) + r.loss_mask
        assert example["prompt_tokens"] == len(prompt)


def test_the_loss_covers_the_assistants_tokens_only(tiny_tokenizer):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": f"Let me compute it.\n{CALL}"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The result is \\boxed{42}."},
    ]
    (prepared, _) = _prepared(_rows(messages), tiny_tokenizer)
    [example] = prepared.examples
    ids, mask = example["input_ids"], example["loss_mask"]
    learned = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert learned == f"Let me compute it.\n{CALL}<|im_end|>The result is \\boxed{{42}}.<|im_end|>"
    masked = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert masked.startswith("<|im_start|>system\n" + SYSTEM) and "<|im_start|>tool\n42" in masked
    assert "What is 6 * 7?" in masked and "boxed{42}" not in masked


def test_two_assistant_turns_in_a_row_are_framed_as_the_template_frames_them(tiny_tokenizer):
    """The template's end of turn and the next turn's header between them, not trained: the model never learns to
    write on after its own end-of-turn token."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The tool says 42."},
        {"role": "assistant", "content": "\\boxed{42}"},
    ]
    (prepared, _) = _prepared(_rows(messages), tiny_tokenizer)
    [example] = prepared.examples
    ids, mask = example["input_ids"], example["loss_mask"]
    assert tiny_tokenizer.decode(ids).endswith(
        "The tool says 42.<|im_end|>\n<|im_start|>assistant\n\\boxed{42}<|im_end|>"
    )
    learned = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert learned == f"{CALL}<|im_end|>The tool says 42.<|im_end|>\\boxed{{42}}<|im_end|>"


def test_turns_end_at_the_templates_end_of_turn_where_the_eos_is_another_token(tiny_tokenizer):
    """A base checkpoint's tokenizer (EOS <|endoftext|> under ChatML): the engines stop at the template's <|im_end|>
    too (rollout.base.stop_token_ids), so the loop ends its turns there, and SFT trains the same tokens."""
    import copy

    base = copy.deepcopy(tiny_tokenizer)
    base.eos_token = "<|endoftext|>"
    messages = [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "\\boxed{42}"},
    ]
    ids, mask = loop_tokens(base, messages)
    assert base.convert_tokens_to_ids("<|endoftext|>") not in ids
    assert base.decode([t for t, m in zip(ids, mask) if m]) == f"{CALL}<|im_end|>\\boxed{{42}}<|im_end|>"
    assert base.decode(ids).endswith(
        f"{CALL}<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n\\boxed{{42}}<|im_end|>"
    )


def test_openai_tool_calls_are_written_as_hermes_blocks(tiny_tokenizer):
    hermes = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "Let me compute it.\n" + CALL + "\n" + hermes_block("python", {"code": "1"})},
        {"role": "tool", "content": "42"},
        {"role": "tool", "content": "(no output)"},
        {"role": "assistant", "content": "\\boxed{42}"},
    ]
    openai = [
        *hermes[:2],
        {
            "role": "assistant",
            "content": "Let me compute it.",
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "python", "arguments": '{"code": "print(6 * 7)"}'},
                },
                {"id": "b", "type": "function", "function": {"name": "python", "arguments": {"code": "1"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "42"},
        {"role": "tool", "tool_call_id": "b", "content": "(no output)"},
        hermes[-1],
    ]
    [converted], rejected = normalise_tool_rows(_rows(openai))
    assert rejected == [] and converted.data["messages"] == hermes
    [as_hermes], [as_openai] = (_prepared(raw, tiny_tokenizer)[0].examples for raw in (_rows(hermes), _rows(openai)))
    assert as_openai["input_ids"] == as_hermes["input_ids"] and as_openai["loss_mask"] == as_hermes["loss_mask"]
    content_none = [*hermes[:2], {**openai[2], "content": None}, *openai[3:]]
    [row], _ = normalise_tool_rows(_rows(content_none))
    assert row.data["messages"][2]["content"] == CALL + "\n" + hermes_block("python", {"code": "1"})


USER = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 6 * 7?"}]
BROWSER = hermes_block("browser", {"url": "x"})


@pytest.mark.parametrize(
    ("messages", "tools", "reason", "detail"),
    [
        (USER + [{"role": "function", "content": "42"}], (PYTHON,), "unknown_role", "message 2 has role 'function'"),
        (
            USER + [{"role": "assistant", "content": "Let me think."}, {"role": "tool", "content": "42"}],
            (PYTHON,),
            "tool_turn_without_call",
            "message 3 is a tool result with no tool call before it",
        ),
        (
            USER + [{"role": "assistant", "content": CALL}, {"role": "assistant", "content": "\\boxed{42}"}],
            (PYTHON,),
            "tool_call_without_result",
            "message 2: 1 tool call(s) with no tool result after them",
        ),
        (USER + [{"role": "assistant", "content": CALL}], (PYTHON,), "tool_call_without_result", "message 2"),
        (
            USER + [{"role": "assistant", "content": '<tool_call>{"name": "python", "arguments": {</tool_call>'}],
            (PYTHON,),
            "bad_tool_call",
            "message 2: bad_json",
        ),
        (
            USER
            + [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "python", "arguments": '{"code": '}}],
                }
            ],
            (PYTHON,),
            "bad_tool_call",
            "message 2 tool_calls[0]: arguments are not JSON",
        ),
        (  # an integer past Python's conversion limit
            USER
            + [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "python", "arguments": '{"n": ' + "9" * 5000 + "}"}}],
                }
            ],
            (PYTHON,),
            "bad_tool_call",
            "message 2 tool_calls[0]: arguments are not JSON: Exceeds the limit",
        ),
        (
            USER + [{"role": "assistant", "content": BROWSER}, {"role": "tool", "content": "page"}],
            (PYTHON,),
            "unknown_tool",
            "message 2 calls 'browser'; the row offers python",
        ),
        (
            USER + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"}],
            None,
            "unknown_tool",
            "the row offers no tool",
        ),
        (USER + [{"role": "assistant", "content": CALL}], "python", "invalid_tools", "'tools' must be a list"),
    ],
)
def test_unusable_tool_rows_are_quarantined_with_the_reason(messages, tools, reason, detail):
    raw = _rows(messages, tools=tools if isinstance(tools, tuple) or tools is None else None)
    if isinstance(tools, str):
        raw[0].data["tools"] = tools
    kept, [rejection] = normalise_tool_rows(raw)
    assert kept == [] and rejection.reason == reason and detail in rejection.detail
    assert rejection.row_ref == "line 1" and json.loads(rejection.raw)["id"] == "r0"


def test_tools_listed_in_the_system_message_are_offered(tiny_tokenizer):
    system = hermes_system_prompt(SYSTEM, [PYTHON])
    messages = [
        {"role": "system", "content": system},
        USER[1],
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "\\boxed{42}"},
    ]
    kept, rejected = normalise_tool_rows(_rows(messages, tools=None))
    assert rejected == [] and len(kept) == 1
    _, [unknown] = normalise_tool_rows(_rows([*messages[:2], {"role": "assistant", "content": BROWSER}], tools=None))
    assert unknown.reason == "unknown_tool" and "the row offers python" in unknown.detail


def test_a_held_out_question_never_reaches_the_cold_start(tiny_tokenizer):
    def conversation(question: str) -> list[dict]:
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
            {"role": "assistant", "content": CALL},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "\\boxed{42}"},
        ]

    held_out = [{"prompt_id": "q-7", "prompt_hash": "other", "question": "What is 6 * 7?"}]
    prepared, _ = _prepared(
        _rows(conversation("What is 6 * 7?"), conversation("What is 7 * 6?")), tiny_tokenizer, held_out
    )
    assert prepared.stats["held_out_rows"] == 1
    assert [e["source_id"] for e in prepared.examples] == ["r1"]
