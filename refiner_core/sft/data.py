"""SFT data preparation: chat rendering with assistant-only loss masks, token limits, dedupe, split, packing, stats.

Assistant spans are found by rendering prefixes of the conversation with the tokenizer's own chat template
(conversation up to turn k with the generation prompt = where the assistant's text starts; up to and including
turn k = where it ends; a conversation that opens with an assistant turn: where its content starts) and mapping
those character offsets onto the tokens of the full rendering, tokenized with a cut at each span's start and end:
the prompt's tokens are the ones rollout renders (render_prompt), even where an answer starts with whitespace the
tokenizer would otherwise merge into the template's. No special token is searched for, so any template that
renders prefixes consistently works; one that does not (e.g. it rewrites earlier turns) is reported instead of
producing a wrong mask.

Tool-using conversations (a `tool` turn, or an assistant turn that calls a tool: Hermes `<tool_call>` blocks in
its content or OpenAI `tool_calls`) are checked first (normalise_tool_rows): OpenAI calls are written as Hermes
blocks, the form the policy writes and the loop parses, and a row is quarantined with the reason when a message
has an unknown role, a tool turn has no call before it, a call has no result after it, a call does not parse, or
it calls a tool the row does not offer (its `tools` list, else the <tools> block of its system message). Such a
conversation is tokenized by the agent loop's own rendering (refiner_core.agent.render.loop_tokens): the tokens
SFT trains on are the tokens the policy continues from at rollout, and the loss covers the assistant's text and
end-of-turn tokens only (tool results, system and user turns are masked).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

import jinja2
import numpy as np

from refiner_core.algo.packing import pack_sequences, packing_efficiency
from refiner_core.config import SFTConfig
from refiner_core.data.prompts import UnsafeTemplateError, refiner_messages, render_chat
from refiner_core.data.rows import (
    CHAT_ROLES,
    RawRow,
    Rejection,
    answered_questions,
    is_chat_row,
    messages_hash,
    opening_hash,
    prompt_hash,
    row_json,
    split_of,
)


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class SFTLimits:
    max_prompt_tokens: int = 6144
    prompt_policy: str = "drop"
    max_response_tokens: int = 1024
    response_policy: str = "drop"
    max_total_tokens: int = 8192
    total_policy: str = "drop"
    pack_length: int = 8192

    @classmethod
    def from_config(cls, sft: SFTConfig) -> SFTLimits:
        return cls(**{k: getattr(sft, k) for k in cls.__dataclass_fields__})


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[bool]

    @property
    def prompt_tokens(self) -> int:
        """Tokens before the first assistant token."""
        return next((i for i, m in enumerate(self.loss_mask) if m), len(self.loss_mask))


def sft_messages(row: dict) -> list[dict] | None:
    """The conversation to learn from: a refiner row's prompt plus its answer, or a chat row's messages.
    None when there is nothing to learn (no answer, no assistant turn with text)."""
    if is_chat_row(row):
        messages = row["messages"]
        return messages if any(m["role"] == "assistant" and m["content"].strip() for m in messages) else None
    answer = row.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        return None
    return refiner_messages(row["question"], row["reasoning"], row["tool_output"]) + [
        {"role": "assistant", "content": answer}
    ]


def _template(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character span of every assistant turn with text in it. The span
    ends after the template's end-of-turn marker; trailing whitespace the template adds between turns is excluded.
    A blank assistant turn has none: it would teach ending the turn at once (as a conversation whose only answer
    is blank, which sft_messages skips)."""
    full = _template(tokenizer, messages, False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or not message["content"].strip():
            continue
        before = _template(tokenizer, messages[:k], True) if k else full[: _first_content_start(tokenizer, messages)]
        through = _template(tokenizer, messages[: k + 1], False)
        if not (through.startswith(before) and full.startswith(through)):
            raise TemplateError(f"chat template does not render turn {k} as a prefix of the conversation")
        end = len(through.rstrip())
        if end <= len(before):
            raise TemplateError(f"assistant turn {k} renders to nothing")
        spans.append((len(before), end))
    return full, spans


def _first_content_start(tokenizer, messages: list[dict]) -> int:
    """Where the first message's content starts in the rendering: the template's text before an opening
    assistant turn (its header, a default system prompt) is not the assistant's to learn."""
    rendered = render_chat(tokenizer, messages, add_generation_prompt=False)
    start, end = rendered.content_spans[0] if rendered.content_spans else (0, -1)
    if rendered.text[start:end] != messages[0]["content"]:
        raise TemplateError("chat template rewrites message contents; cannot tell where assistant turn 0 starts")
    return start


def render_with_mask(tokenizer, messages: list[dict]) -> Rendered:
    """Token IDs of the rendered conversation and, per token, whether it is assistant text (loss applies).
    A token belongs to a span when its first character does. No token crosses a span's start or end: the text
    before a span is tokenized as that prompt alone would be, and an answer's leading whitespace is the answer's."""
    full, spans = assistant_char_spans(tokenizer, messages)
    cuts = tuple(offset for span in spans for offset in span)
    encoded = render_chat(tokenizer, messages, add_generation_prompt=False, boundaries=cuts)  # contents stay text
    if encoded.text != full:
        raise TemplateError("chat template renders the conversation differently on a second call")
    mask = [any(s <= start < e for s, e in spans) for start, _ in encoded.offsets]
    return Rendered(encoded.input_ids, mask)


def render_as_loop(tokenizer, messages: list[dict]) -> Rendered:
    """A tool-using conversation as the agent loop's token ids, the loss on the assistant's tokens."""
    from refiner_core.agent.render import loop_tokens

    try:
        ids, mask = loop_tokens(tokenizer, messages)
    except ValueError as e:  # a template that rewrites contents: the loop could not frame tool results either
        raise TemplateError(str(e)) from e
    return Rendered(ids, mask)


def is_tool_conversation(messages: list) -> bool:
    """A `tool` turn, or an assistant turn with OpenAI tool_calls or a Hermes <tool_call> block."""
    return any(
        isinstance(m, dict)
        and (
            m.get("role") == "tool"
            or bool(m.get("tool_calls"))
            or (m.get("role") == "assistant" and isinstance(m.get("content"), str) and "<tool_call>" in m["content"])
        )
        for m in messages
    )


# How a conversation becomes tokens and a loss mask: the chat template's rendering, or the agent loop's.
RENDERERS = {"chat": render_with_mask, "agent": render_as_loop}


def renderer(messages: list[dict]) -> str:
    return "agent" if is_tool_conversation(messages) else "chat"


def offered_tools(row: dict) -> tuple[set[str] | None, str | None]:
    """(names of the tools a chat row offers, None) or (None, why its `tools` list is unusable). The row's `tools`
    list (OpenAI function objects or names), else the tools its system message lists in a <tools> block (as
    hermes_system_prompt writes them, one JSON object a line), else none."""
    if row.get("tools") is not None:
        listed = row["tools"]
        if not isinstance(listed, list):
            return None, f"'tools' must be a list, got {type(listed).__name__}"
        names = set()
        for k, item in enumerate(listed):
            name = _tool_name(item)
            if name is None:
                return None, f"tools[{k}] names no tool: expected a name or {{'function': {{'name': ...}}}}"
            names.add(name)
        return names, None
    names = set()
    for m in row["messages"]:
        if not isinstance(m, dict) or m.get("role") != "system" or not isinstance(m.get("content"), str):
            continue
        for block in re.findall(r"<tools>(.*?)</tools>", m["content"], re.DOTALL):
            for line in block.splitlines():
                try:
                    name = _tool_name(json.loads(line)) if line.strip() else None
                except json.JSONDecodeError:
                    continue
                if name:
                    names.add(name)
    return names, None


def _tool_name(item) -> str | None:
    if isinstance(item, str):
        return item or None
    if isinstance(item, dict):
        inner = item.get("function", item)
        name = inner.get("name") if isinstance(inner, dict) else None
        return name if isinstance(name, str) and name else None
    return None


def _assistant_text(k: int, message: dict, offered: set[str]) -> tuple[str | None, int, tuple[str, str] | None]:
    """(the turn's text with its OpenAI tool_calls written as Hermes blocks, its calls, None) or (None, 0,
    (reason, detail))."""
    from refiner_core.agent.hermes import hermes_block, parse_tool_calls

    content = message.get("content")
    content = "" if content is None and message.get("tool_calls") else content
    if not isinstance(content, str):
        return None, 0, ("invalid_messages", f"message {k} content must be a string, got {type(content).__name__}")
    blocks = []
    listed = message.get("tool_calls") or []
    if not isinstance(listed, list):
        return None, 0, ("bad_tool_call", f"message {k} tool_calls must be a list, got {type(listed).__name__}")
    for j, call in enumerate(listed):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            return None, 0, ("bad_tool_call", f"message {k} tool_calls[{j}]: no function name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:  # not JSON, or an integer past Python's digit limit
                detail = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                return None, 0, ("bad_tool_call", f"message {k} tool_calls[{j}]: arguments are not JSON: {detail}")
            except RecursionError:
                return None, 0, ("bad_tool_call", f"message {k} tool_calls[{j}]: arguments nest deeper than JSON goes")
        if not isinstance(arguments, dict):
            return None, 0, ("bad_tool_call", f"message {k} tool_calls[{j}]: arguments must be a JSON object")
        blocks.append(hermes_block(name, arguments))
    text = "\n".join(([content] if content else []) + blocks)
    calls = parse_tool_calls(text, offered)
    for call in calls:
        if call.failure is None:
            continue
        if call.failure.startswith("unknown_tool"):
            offers = ", ".join(sorted(offered)) or "no tool (no 'tools' list, no <tools> block in its system message)"
            return None, 0, ("unknown_tool", f"message {k} calls {call.name!r}; the row offers {offers}")
        return None, 0, ("bad_tool_call", f"message {k}: {call.failure}")
    return text, len(calls), None


def hermes_conversation(row: dict) -> tuple[list[dict] | None, tuple[str, str] | None]:
    """(the row's messages, every call written as a Hermes block, None) or (None, (reason, detail)): an unknown
    role, a tool turn with no call before it, a call with no result after it, a call that does not parse, a call
    to a tool the row does not offer, a conversation opening with an assistant turn."""
    offered, problem = offered_tools(row)
    if problem:
        return None, ("invalid_tools", problem)
    if row["messages"] and isinstance(row["messages"][0], dict) and row["messages"][0].get("role") == "assistant":
        return None, ("no_prompt", "message 0 is an assistant turn: the agent loop starts from a system or user prompt")
    out: list[dict] = []
    pending, caller = 0, -1  # calls of the last assistant turn still waiting for their result
    for k, m in enumerate(row["messages"]):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in CHAT_ROLES:
            return None, ("unknown_role", f"message {k} has role {role!r}; expected one of {list(CHAT_ROLES)}")
        if role == "tool":
            if not pending:
                return None, ("tool_turn_without_call", f"message {k} is a tool result with no tool call before it")
            pending -= 1
            out.append({"role": "tool", "content": m.get("content")})
            continue
        if pending:
            return None, _without_result(caller, pending)
        if role == "assistant":
            text, pending, problem = _assistant_text(k, m, offered)
            if problem:
                return None, problem
            caller = k
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": role, "content": m.get("content")})
    if pending:
        return None, _without_result(caller, pending)
    return out, None


def _without_result(caller: int, pending: int) -> tuple[str, str]:
    return "tool_call_without_result", f"message {caller}: {pending} tool call(s) with no tool result after them"


def normalise_tool_rows(raw_rows: list[RawRow]) -> tuple[list[RawRow], list[Rejection]]:
    """Tool-using chat rows with their calls in the Hermes format; the rows that cannot be, as rejections. Other
    rows pass unchanged (validate_rows checks them)."""
    kept, rejected = [], []
    for raw in raw_rows:
        data = raw.data
        if data is None or not is_chat_row(data) or not isinstance(data["messages"], list):
            kept.append(raw)
            continue
        if not is_tool_conversation(data["messages"]) and all(
            isinstance(m, dict) and m.get("role") in CHAT_ROLES for m in data["messages"]
        ):
            kept.append(raw)
            continue
        messages, problem = hermes_conversation(data)
        if problem:
            rejected.append(Rejection(raw.row_ref, *problem, raw.raw))
        else:
            kept.append(RawRow(raw.row_ref, raw.raw, {**data, "messages": messages}, raw.error))
    return kept, rejected


def apply_limits(rendered: Rendered, limits: SFTLimits) -> tuple[Rendered | None, str | None, list[str]]:
    """(kept example or None, drop reason, truncations applied). Prompt truncation keeps the prompt's last
    tokens (nearest the answer); response and total truncation cut the end."""
    ids, mask = rendered.input_ids, rendered.loss_mask
    truncated: list[str] = []
    if not any(mask):
        return None, "no_assistant_tokens", truncated
    prompt = rendered.prompt_tokens
    if prompt > limits.max_prompt_tokens:
        if limits.prompt_policy == "drop":
            return None, "prompt_too_long", truncated
        cut = prompt - limits.max_prompt_tokens
        ids, mask, prompt = ids[cut:], mask[cut:], limits.max_prompt_tokens
        truncated.append("prompt_truncated")
    if len(ids) - prompt > limits.max_response_tokens:
        if limits.response_policy == "drop":
            return None, "response_too_long", truncated
        ids, mask = ids[: prompt + limits.max_response_tokens], mask[: prompt + limits.max_response_tokens]
        truncated.append("response_truncated")
    if len(ids) > limits.max_total_tokens:
        if limits.total_policy == "drop":
            return None, "total_too_long", truncated
        ids, mask = ids[: limits.max_total_tokens], mask[: limits.max_total_tokens]
        truncated.append("total_truncated")
    if len(ids) > limits.pack_length:
        return None, "longer_than_pack_length", truncated
    if not any(mask):
        return None, "no_assistant_tokens", truncated
    return Rendered(ids, mask), None, truncated


def assign_splits(
    hashes: list[str], prompts: list[str], source_ids: list[str], validation_fraction: float, seed: int
) -> list[str]:
    """Seeded split by example (content) hash, taken per prompt: the examples that share a prompt (`prompts`: the
    hashes of their openings, what each asks before its first answer) all take the split of the one with the
    smallest source ID, so no prompt is both trained on and validated, nor a validated conversation's answers trained
    on as turns of a longer conversation that continues it. With a positive fraction and at least two prompts, at
    least one prompt lands in validation so validation loss always exists."""
    lead: dict[str, tuple[str, str]] = {}  # prompt hash -> (smallest source ID, that example's hash)
    for digest, prompt, source_id in zip(hashes, prompts, source_ids):
        lead[prompt] = min(lead.get(prompt, (source_id, digest)), (source_id, digest))
    split = {prompt: split_of(digest, validation_fraction, seed) for prompt, (_, digest) in lead.items()}
    if validation_fraction > 0 and len(split) >= 2 and "validation" not in split.values():
        score = {p: hashlib.blake2b(f"{seed}:{d}".encode(), digest_size=8).hexdigest() for p, (_, d) in lead.items()}
        split[min(score, key=score.get)] = "validation"
    return [split[p] for p in prompts]


@dataclass
class PreparedSFT:
    examples: list[dict] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def prepare_sft(
    rows: list[dict],
    tokenizer,
    run: str,
    limits: SFTLimits,
    validation_fraction: float,
    seed: int,
    histogram_bins: int = 10,
    held_out: list[dict] = (),
    same_source: bool = False,
    context: int | None = None,
) -> PreparedSFT:
    """Validated rows (from data.validate_rows) -> packed SFT examples, rejections and a stats summary.
    Rows of the `held_out` prompts (the GRPO data's validation split, each with its prompt_hash) are left out:
    evaluation scores them. `same_source`: the rows come from the source the prompts were read from (see
    without_held_out). `context`: the policy's context length; an example longer than it, after the limits, is
    dropped (past_model_context): the model has no positions for its end."""
    out = PreparedSFT()
    rows, held_out_by = without_held_out(rows, held_out, same_source)
    held_out_rows = sum(held_out_by.values())
    seen: set[str] = set()
    kept: list[tuple[dict, Rendered, str, list[str]]] = []
    skipped_no_answer = tool_conversations = 0
    truncations: dict[str, int] = {}
    for row in rows:
        raw = row_json(row)
        messages = sft_messages(row)
        if messages is None:
            skipped_no_answer += 1  # a valid GRPO prompt, just nothing to imitate
            continue
        digest = messages_hash(messages)
        if digest in seen:
            out.rejected.append(
                Rejection(row["row_ref"], "duplicate_example", "renders the same conversation as an earlier row", raw)
            )
            continue
        seen.add(digest)
        try:
            rendered = RENDERERS[renderer(messages)](tokenizer, messages)
        except (TemplateError, UnsafeTemplateError, jinja2.TemplateError) as e:  # the template refuses this row
            out.rejected.append(Rejection(row["row_ref"], "template_error", f"{type(e).__name__}: {e}", raw))
            continue
        limited, reason, truncated = apply_limits(rendered, limits)
        if limited is None:
            out.rejected.append(Rejection(row["row_ref"], reason, _limit_detail(reason, rendered, limits), raw))
            continue
        if context is not None and len(limited.input_ids) > context:
            detail = f"{len(limited.input_ids)} tokens > the policy's context of {context} (max_position_embeddings)"
            out.rejected.append(Rejection(row["row_ref"], "past_model_context", detail, raw))
            continue
        for t in truncated:
            truncations[t] = truncations.get(t, 0) + 1
        tool_conversations += renderer(messages) == "agent"
        kept.append((row, limited, digest, truncated))

    splits = assign_splits(
        [d for _, _, d, _ in kept],
        [opening_hash(row) for row, _, _, _ in kept],
        [row["id"] for row, _, _, _ in kept],
        validation_fraction,
        seed,
    )
    for (row, rendered, digest, truncated), split in zip(kept, splits):
        prompt = rendered.prompt_tokens
        out.examples.append(
            {
                "run": run,
                "example_id": digest,
                "split": split,
                "source_ref": row["row_ref"],
                "source_id": row["id"],
                "input_ids": rendered.input_ids,
                "loss_mask": rendered.loss_mask,
                "prompt_tokens": prompt,
                "response_tokens": len(rendered.input_ids) - prompt,
                "assistant_tokens": sum(rendered.loss_mask),
                "total_tokens": len(rendered.input_ids),
                "truncated": ",".join(truncated) or None,
                "pack_id": -1,
                "pack_offset": 0,
            }
        )
    packing = {}
    for split in ("train", "validation"):
        idx = [i for i, e in enumerate(out.examples) if e["split"] == split]
        lengths = [out.examples[i]["total_tokens"] for i in idx]
        packs = pack_sequences(lengths, limits.pack_length)
        for p, pack in enumerate(packs):
            offset = 0
            for k in pack:
                example = out.examples[idx[k]]
                example["pack_id"], example["pack_offset"] = p, offset
                offset += example["total_tokens"]
        packing[split] = {
            "packs": len(packs),
            "tokens": sum(lengths),
            "efficiency": packing_efficiency(lengths, packs, limits.pack_length),
        }
    out.examples.sort(key=lambda e: (e["split"], e["pack_id"], e["pack_offset"]))

    dropped: dict[str, int] = {}
    for r in out.rejected:
        dropped[r.reason] = dropped.get(r.reason, 0) + 1
    out.stats = {
        "rows_in": len(rows) + held_out_rows,
        "held_out_rows": held_out_rows,
        "held_out": held_out_by,
        "examples_out": len(out.examples),
        "skipped_no_answer": skipped_no_answer,
        "tool_conversations": tool_conversations,  # kept examples rendered as the agent loop tokenizes them
        "dropped": dropped,
        "truncated": truncations,
        "train_examples": sum(e["split"] == "train" for e in out.examples),
        "validation_examples": sum(e["split"] == "validation" for e in out.examples),
        "packing": {**packing, "pack_length": limits.pack_length},
        "histograms": {
            name: token_histogram([e[name] for e in out.examples], histogram_bins)
            for name in ("prompt_tokens", "response_tokens", "total_tokens")
        },
    }
    return out


def without_held_out(rows: list[dict], held_out: list[dict], same_source: bool) -> tuple[list[dict], dict[str, int]]:
    """Rows that are not held-out prompts, and how many were left out by what matched: 'prompt_id' (only when
    `same_source`: the rows come from the prompts' own source, where a held-out prompt's ID is its row; IDs of
    another file name other rows), 'prompt' (the same prompt, whatever the answer: prompt_hash) or 'question'
    (a chat row that asks a held-out prompt's questions, in its order, before one of its answers, whatever the
    answers between them; or whose first question is a held-out prompt's last). The warm start must not imitate an
    answer to a prompt the evaluation scores."""
    ids = {p["prompt_id"] for p in held_out} if same_source else set()
    hashes = {p["prompt_hash"] for p in held_out}
    questions = {p["question"] for p in held_out if p.get("question")}
    asked = {tuple(p.get("asked") or [p["question"]]) for p in held_out if p.get("question")}

    def matched(row: dict) -> str | None:
        if row["id"] in ids:
            return "prompt_id"
        if prompt_hash(row) in hashes:
            return "prompt"
        if not is_chat_row(row):
            return None
        sequences = asked_before_answers(row["messages"])
        first = sequences[0][-1] if sequences else None
        return "question" if first in questions or asked & set(sequences) else None

    kept, left_out = [], dict.fromkeys(("prompt_id", "prompt", "question"), 0)
    for row in rows:
        reason = matched(row)
        if reason:
            left_out[reason] += 1
        else:
            kept.append(row)
    return kept, left_out


def asked_before_answers(messages: list[dict]) -> list[tuple[str, ...]]:
    """For each assistant turn that answers a user message, the user messages before it, in order."""
    return [
        tuple(m["content"] for m in messages[:index] if m["role"] == "user")
        for index, _ in answered_questions(messages)
    ]


def _limit_detail(reason: str, rendered: Rendered, limits: SFTLimits) -> str:
    prompt, total = rendered.prompt_tokens, len(rendered.input_ids)
    return {
        "prompt_too_long": f"{prompt} prompt tokens > max_prompt_tokens {limits.max_prompt_tokens}",
        "response_too_long": f"{total - prompt} response tokens > max_response_tokens {limits.max_response_tokens}",
        "total_too_long": f"{total} tokens > max_total_tokens {limits.max_total_tokens}",
        "longer_than_pack_length": f"{total} tokens > pack_length {limits.pack_length}",
        "no_assistant_tokens": "no assistant token left to learn from",
    }.get(reason, reason)


def token_histogram(values: list[int], bins: int) -> dict:
    """{'edges': [...], 'counts': [...]} plus summary numbers; empty input gives empty lists."""
    if not values:
        return {"edges": [], "counts": [], "min": 0, "max": 0, "mean": 0.0}
    counts, edges = np.histogram(np.asarray(values), bins=max(1, bins))
    return {
        "edges": [float(e) for e in edges],
        "counts": [int(c) for c in counts],
        "min": int(min(values)),
        "max": int(max(values)),
        "mean": float(np.mean(values)),
    }


def stats_rows(run: str, stats: dict) -> list[dict]:
    """The stats summary as long rows for the sft_stats table (one number per row)."""
    rows = []

    def add(
        kind: str,
        name: str,
        value: float,
        split: str | None = None,
        low: float | None = None,
        high: float | None = None,
    ) -> None:
        rows.append(
            {
                "run": run,
                "kind": kind,
                "name": name,
                "split": split,
                "bin_low": low,
                "bin_high": high,
                "value": float(value),
            }
        )

    for name in ("rows_in", "examples_out", "skipped_no_answer", "train_examples", "validation_examples"):
        add("count", name, stats[name])
    add("count", "held_out_rows", stats.get("held_out_rows", 0))
    for matched, n in stats.get("held_out", {}).items():
        add("count", f"held_out_by_{matched}", n)
    add("count", "tool_conversations", stats.get("tool_conversations", 0))
    add("count", "invalid_rows", stats.get("invalid_rows", 0))
    for reason, n in stats.get("invalid", {}).items():  # rows refused before rendering (quarantine's reasons)
        add("invalid", reason, n)
    for reason, n in stats["dropped"].items():
        add("dropped", reason, n)
    for reason, n in stats["truncated"].items():
        add("truncated", reason, n)
    for split in ("train", "validation"):
        for key in ("packs", "tokens", "efficiency"):
            add("packing", key, stats["packing"][split][key], split)
    for name, hist in stats["histograms"].items():
        for low, high, count in zip(hist["edges"], hist["edges"][1:], hist["counts"]):
            add("histogram", name, count, None, low, high)
    return rows
