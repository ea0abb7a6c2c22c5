"""The multi-turn tool-calling loop, over any rollout engine.

Each turn, every open conversation goes to the engine as token ids (prompt + everything kept so far); the
sampled ids are kept exactly as generated, never re-tokenized from text. Tool calls in a turn run together
(the tool bounds its own concurrency); their results are rendered by the chat template as `tool` messages and
only that rendering is tokenized (contents as plain text: tool output cannot forge special tokens), then
appended. The loss mask is true exactly on sampled tokens; inserted tokens carry log-prob 0 and no loss.

A conversation ends when a turn makes no tool call ('stop', or 'length' if the turn was cut), when the total
token budget after the prompt runs out ('length'), or when a turn still calls tools at `max_turns`
('max_turns': those calls are not run).

A policy cannot stall a run with tool calls: a turn's calls past `max_calls_per_turn`, and any call whose worst
case (the tool's `max_seconds`) no longer fits in the conversation's tool-time budget, are refused: answered
'error: refused: ...', recorded with status 'refused', never run, and no tool round for the TCR reward.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from refiner_core.agent.hermes import CLOSE, OPEN, ToolCall, invalid_call_result, parse_tool_calls
from refiner_core.agent.tools.base import Tool, ToolResult
from refiner_core.data.prompts import render_chat
from refiner_core.rollout.base import Generation, RolloutEngine, SamplingParams, chat_turn_end_id

EXCERPT_CHARS = 2000


@dataclass(frozen=True)
class AgentSettings:
    max_turns: int = 16  # assistant turns per conversation
    max_response_tokens: int = 10480  # sampled + inserted tokens after the prompt
    max_calls_per_turn: int = 4  # calls of one turn past this many are refused
    tool_seconds: float = 60.0  # tool time of one conversation: a call runs only if its worst case still fits
    stop_at_first_call: bool = True  # a sampled turn ends at its first </tool_call>: one call per sampled turn


@dataclass
class Turn:
    """One row of the `turns` table, without the run/step/prompt identity."""

    turn: int
    role: str  # 'assistant' | 'tool'
    call_idx: int  # 0 for the assistant row; the call's position in its turn for tool rows
    text: str
    token_start: int  # span in the response's token ids: [start, end)
    token_end: int
    tool_name: str | None = None
    arguments: str | None = None  # JSON text as parsed, or the raw block when it did not parse
    status: str | None = None
    exit_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    seconds: float | None = None
    failure: str | None = None
    finish_reason: str | None = None  # assistant rows: 'stop' | 'length' | 'tool_call' | 'max_turns'


@dataclass(eq=False)  # identity: one object per conversation
class AgentRollout:
    prompt_index: int
    sample_idx: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    finish_reason: str = ""
    tool_rounds: int = 0  # assistant turns with at least one call that ran (valid call, tool executed)
    # the last assistant turn's text, where the final answer is read; '' when that turn called a tool (the
    # conversation ran out of turns or tokens waiting for a result): its code is no answer
    final_text: str = ""
    tool_seconds: float = 0.0  # what the conversation's calls that ran took

    @property
    def open(self) -> bool:
        return not self.finish_reason

    def add(self, ids: list[int], logprobs: list[float], sampled: bool) -> tuple[int, int]:
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.loss_mask.extend([sampled] * len(ids))
        return start, len(self.token_ids)


def tool_message_ids(tokenizer, contents: list[str]) -> list[int]:
    """Token ids the chat template puts after an assistant turn's content for these tool messages, through the
    generation prompt of the next assistant turn. Only this piece is rendered and tokenized: the conversation
    before it is never re-tokenized. Starts with the template's end-of-turn token."""
    return following_ids(tokenizer, [{"role": "tool", "content": c} for c in contents])


def following_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids the chat template puts after an assistant turn's content for the messages that follow it (tool
    results, or a user turn), through the generation prompt of the next assistant turn; contents as plain text."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}, *messages]
    rendered = render_chat(tokenizer, messages, add_generation_prompt=True)
    if len(rendered.content_spans) < 2:
        raise ValueError("the chat template rewrites message contents; cannot tell where the tool messages begin")
    end = rendered.content_spans[1][1]
    cut = next((k for k, (a, _) in enumerate(rendered.offsets) if a >= end), len(rendered.input_ids))
    if cut < len(rendered.offsets) and rendered.offsets[cut][0] != end:
        raise ValueError("the chat template's tokens after an assistant turn do not start at a token boundary")
    return rendered.input_ids[cut:]


def end_of_turn_id(tokenizer, eos: set[int]) -> int:
    """The token that ends an assistant turn the loop writes itself (a scripted turn): the template's end-of-turn
    token (rollout.base.chat_turn_end_id) where it is an end-of-sequence token of the engine, else the tokenizer's
    EOS."""
    end = chat_turn_end_id(tokenizer)
    return end if end is not None and end in eos else tokenizer.eos_token_id


def assistant_turn_ids(tokenizer, text: str, end: int) -> list[int]:
    """An assistant turn written as text (not sampled): tokenized once, as plain text, plus the end-of-turn token."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [end]


def run_agent(
    engine: RolloutEngine,
    tokenizer,
    prompts: list[list[int]],
    params: SamplingParams,
    tools: dict[str, Tool],
    settings: AgentSettings,
    desc: str = "",
    scripted: dict[tuple[int, int], list[str]] | None = None,
    score: Callable[[list[list[int]], list[list[int]]], list[list[float]]] | None = None,
) -> list[AgentRollout]:
    """G = params.n conversations per prompt. `scripted` maps (prompt index, sample) to assistant texts used in
    place of sampling for that conversation's first turns (teacher-forced; `score` gives the policy's log-probs
    of those tokens); the engine samples any turn after the script."""
    scripted = scripted or {}
    hidden = [tag for tag in (OPEN, CLOSE) if tag not in _as_engines_decode(tokenizer, tag)]
    if hidden:
        raise ValueError(
            f"the tokenizer marks {' and '.join(hidden)} as special tokens: the engines' text (decoded without "
            "special tokens) would never show a tool call"
        )
    eos = set(getattr(engine, "eos_ids", None) or {tokenizer.eos_token_id})
    stop = tuple(dict.fromkeys([*params.stop, *([CLOSE] if settings.stop_at_first_call else [])]))
    rollouts = [AgentRollout(p, s) for p in range(len(prompts)) for s in range(params.n)]
    by_key = {(r.prompt_index, r.sample_idx): r for r in rollouts}
    turn = 0
    first = engine.generate(
        prompts,
        dataclasses.replace(params, stop=stop, max_new_tokens=min(params.max_new_tokens, settings.max_response_tokens)),
        desc=desc or "agent turn 0",
    )
    gens = {(g.prompt_index, g.sample_idx): g for g in first}
    while True:
        for key, gen in _scripted_turns(scripted, turn, rollouts, prompts, tokenizer, eos, score).items():
            gens[key] = gen
        calls: list[tuple[AgentRollout, int, ToolCall]] = []
        for key, gen in sorted(gens.items()):
            r = by_key[key]
            room = settings.max_response_tokens - len(r.token_ids)
            ids, lps, cut = gen.token_ids[:room], gen.logprobs[:room], len(gen.token_ids) > room
            text = gen.text if not cut else tokenizer.decode(ids, skip_special_tokens=True)
            start, end = r.add(ids, lps, sampled=True)
            ended = not cut and gen.finish_reason == "stop"
            found = parse_tool_calls(text, tools, ended=ended)
            finished = "stop" if ended else "length"
            # a turn cut by max_turn_tokens inside a call goes on: the call is answered as unclosed
            if found and not cut and turn + 1 >= settings.max_turns:
                finished = "max_turns"
            elif found and not cut:
                finished = ""
            turn_finish = (finished or "tool_call") if ended else "length"  # ended: 'stop', 'max_turns' or a call
            r.turns.append(Turn(turn, "assistant", 0, text, start, end, finish_reason=turn_finish))
            r.final_text = "" if found else text  # a turn that calls a tool is no answer, should the talk end there
            r.finish_reason = finished
            calls.extend((r, k, c) for k, c in enumerate(found) if not finished)
        if not calls:
            break
        results = _execute(calls, tools, settings)
        follow: list[AgentRollout] = []
        for r in dict.fromkeys(c[0] for c in calls):
            mine = [(k, call, res) for (owner, k, call), res in zip(calls, results) if owner is r]
            ids = tool_message_ids(tokenizer, [res.text for _, _, res in mine])
            if r.token_ids and r.token_ids[-1] in eos and ids and ids[0] == r.token_ids[-1]:
                ids = ids[1:]  # the model already ended its turn with the template's end-of-turn token
            r.tool_rounds += any(res.status not in NOT_RUN for _, _, res in mine)  # ran, whether or not shown
            if len(r.token_ids) + len(ids) >= settings.max_response_tokens:
                r.finish_reason = "length"  # no room for the results and another turn
                for k, call, res in mine:
                    r.turns.append(_tool_turn(turn, k, call, res, len(r.token_ids), len(r.token_ids)))
                continue
            start, end = r.add(ids, [0.0] * len(ids), sampled=False)
            for k, call, res in mine:
                r.turns.append(_tool_turn(turn, k, call, res, start, end))
            follow.append(r)
        turn += 1
        if not follow:
            break
        live = [r for r in follow if (r.prompt_index, r.sample_idx) not in _script_keys(scripted, turn)]
        gens = {}
        if live:
            budget = max(settings.max_response_tokens - len(r.token_ids) for r in live)
            turn_params = dataclasses.replace(
                params,
                n=1,
                stop=stop,
                seed=params.seed + 1_000_003 * turn,
                max_new_tokens=min(params.max_new_tokens, budget),
            )
            out = engine.generate(
                [prompts[r.prompt_index] + r.token_ids for r in live],
                turn_params,
                desc=f"{desc or 'agent'} turn {turn}",
            )
            for g in out:
                r = live[g.prompt_index]
                gens[(r.prompt_index, r.sample_idx)] = g
    for r in rollouts:
        r.finish_reason = r.finish_reason or "length"
    return rollouts


def _as_engines_decode(tokenizer, text: str) -> str:
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True)


def _script_keys(scripted: dict, turn: int) -> set[tuple[int, int]]:
    return {key for key, texts in scripted.items() if turn < len(texts)}


def _scripted_turns(scripted, turn, rollouts, prompts, tokenizer, eos, score) -> dict[tuple[int, int], Generation]:
    """This turn's scripted assistant texts as Generations: tokens as the tokenizer writes the text plus the
    end-of-turn token, log-probs from the policy (`score`)."""
    todo = [
        r
        for r in rollouts
        if (r.prompt_index, r.sample_idx) in _script_keys(scripted, turn)
        and (turn == 0 or (r.open and r.turns and r.turns[-1].role == "tool"))
    ]
    if not todo:
        return {}
    if score is None:
        raise ValueError("scripted turns need a scorer for the policy's log-probs")
    end = end_of_turn_id(tokenizer, eos)
    completions = [assistant_turn_ids(tokenizer, scripted[(r.prompt_index, r.sample_idx)][turn], end) for r in todo]
    logprobs = score([prompts[r.prompt_index] + r.token_ids for r in todo], completions)
    return {
        (r.prompt_index, r.sample_idx): Generation(
            r.prompt_index, r.sample_idx, ids, lps, scripted[(r.prompt_index, r.sample_idx)][turn], "stop"
        )
        for r, ids, lps in zip(todo, completions, logprobs)
    }


REFUSED = "refused"
NOT_RUN = ("invalid_call", REFUSED)  # statuses of calls that never ran: no tool round


def _refusal(rollout: AgentRollout, k: int, call: ToolCall, tools, settings: AgentSettings, reserved: dict):
    """Why the k-th call of a conversation's turn, a well-formed one, may not run, or None (then its worst case is
    reserved)."""
    if k >= settings.max_calls_per_turn:
        return f"{REFUSED}: max_calls_per_turn: at most {settings.max_calls_per_turn} tool calls per turn"
    worst = tools[call.name].max_seconds
    taken = rollout.tool_seconds + reserved.get(rollout, 0.0)
    if taken + worst > settings.tool_seconds:
        return (
            f"{REFUSED}: tool_seconds_per_rollout: {taken:.1f} of {settings.tool_seconds:g} s of tool time used or "
            f"reserved, and a call may take {worst:g} s"
        )
    reserved[rollout] = reserved.get(rollout, 0.0) + worst
    return None


def _execute(
    calls: list[tuple[AgentRollout, int, ToolCall]], tools: dict[str, Tool], settings: AgentSettings
) -> list[ToolResult]:
    """Run every valid call of the turn that the caps let through, grouped by tool (each tool runs its calls
    concurrently, bounded); the others are answered as invalid or refused."""
    results: list[ToolResult | None] = [None] * len(calls)
    by_tool: dict[str, list[int]] = {}
    reserved: dict[AgentRollout, float] = {}
    for i, (rollout, k, call) in enumerate(calls):
        if call.failure is not None:  # malformed, past the cap or not: the model is told what was wrong with it
            results[i] = invalid_call_result(call)
        elif (refusal := _refusal(rollout, k, call, tools, settings, reserved)) is not None:
            results[i] = ToolResult(text=f"error: {refusal}", status=REFUSED, failure=refusal)
        else:
            by_tool.setdefault(call.name, []).append(i)
    for name, idx in by_tool.items():
        t0 = time.monotonic()
        ran = tools[name].run_many([calls[i][2].arguments for i in idx])
        for i, res in zip(idx, ran):
            if not res.seconds and res.status not in NOT_RUN:  # a tool that does not time its runs: a share
                res.seconds = (time.monotonic() - t0) / len(idx)
            results[i] = res
            calls[i][0].tool_seconds += res.seconds
    return results  # type: ignore[return-value]


def _tool_turn(turn: int, k: int, call: ToolCall, res: ToolResult, start: int, end: int) -> Turn:
    if call.arguments is None:
        arguments = _storable(call.raw)
    else:
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        if not _encodes(arguments):  # an unpaired surrogate from a JSON escape: keep it escaped, the same JSON
            arguments = json.dumps(call.arguments)
    return Turn(
        turn,
        "tool",
        k,
        res.text,
        start,
        end,
        tool_name=_storable(call.name),
        arguments=arguments,
        status=res.status,
        exit_code=res.exit_code,
        stdout=res.stdout[:EXCERPT_CHARS] or None,
        stderr=res.stderr[:EXCERPT_CHARS] or None,
        seconds=res.seconds,
        failure=res.failure,
    )


def _encodes(text: str) -> bool:
    """Whether UTF-8 (and so Parquet) can hold `text`: not when it has unpaired surrogates, which a model's JSON
    escapes such as "\\ud800" produce."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _storable(text: str | None) -> str | None:
    """`text`, with any unpaired surrogates written as backslash escapes."""
    if text is None or _encodes(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode()


def model_scorer(model, temperature: float) -> Callable[[list[list[int]], list[list[int]]], list[list[float]]]:
    """Log-probs a model gives given completions after given prefixes, at the sampling temperature (what the
    engine would have recorded had it sampled those tokens). For scripted turns."""
    import torch

    def score(prefixes: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        out = []
        for prefix, completion in zip(prefixes, completions):
            ids = torch.tensor([prefix + completion], device=model.device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prefix) - 1 : -1].float()
            if temperature > 0 and temperature != 1.0:
                logits = logits / temperature
            picked = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prefix) :, None]).squeeze(-1)
            out.append(picked.tolist())
        return out

    return score
