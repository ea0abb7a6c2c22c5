"""Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in an assistant turn.

A block that cannot become a call (bad JSON, not an object, no name, unknown tool, arguments not an object,
an unclosed block) is still returned, with `failure` saying why: the loop feeds that back to the model as the
tool's answer and records it, so a malformed call never crashes a stage.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from refiner_core.agent.tools.base import ToolResult

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOO_DEEP = "bad_json: nested deeper than the JSON parser goes"


@dataclass
class ToolCall:
    name: str | None
    arguments: dict | None
    raw: str  # the block's text between the tags
    failure: str | None = None  # 'bad_json: ...', 'unknown_tool: ...', ...


def parse_tool_calls(text: str, known_tools: set[str] | dict, ended: bool = True) -> list[ToolCall]:
    """Every tool-call block of one assistant turn, in order. A block ends at a closing tag and starts at the first
    opening tag before it (after the previous block) whose text to the closing tag is JSON, else at the last one:
    an earlier one may be the tag named in prose ("I will write a <tool_call> block"), a later one the tag inside the
    call's code (print("<tool_call>")). After the last closing tag, an opening tag followed by a JSON object (or by
    nothing) is a block never closed: a call when the turn `ended` (an end of turn, not a length cut) and the
    object parses, as vLLM's Hermes parser reads it, else an unclosed_tool_call failure; an opening tag followed by
    prose is prose."""
    calls, start = [], 0
    while (close := text.find(CLOSE, start)) != -1:
        opens = [m.end() for m in re.finditer(re.escape(OPEN), text[start:close])]
        if opens:  # the first opening tag whose block is JSON (the tag may sit inside its code), else the last
            raw = next(
                (r for r in (text[start + o : close] for o in opens) if _is_json(r)), text[start + opens[-1] : close]
            )
            calls.append(_parse_block(raw, known_tools))
        start = close + len(CLOSE)
    tail = text[start:]
    opened = tail.find(OPEN)
    while opened != -1:
        raw = tail[opened + len(OPEN) :]
        if not raw.strip() or raw.lstrip().startswith("{"):
            call = _parse_block(raw, known_tools) if ended and raw.strip() else None
            if call is None or (call.failure or "").startswith("bad_json"):
                call = ToolCall(None, None, raw, f"unclosed_tool_call: no {CLOSE} after {OPEN}")
            calls.append(call)
            break
        opened = tail.find(OPEN, opened + len(OPEN))
    return calls


def _is_json(raw: str) -> bool:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return True


def _parse_block(raw: str, known_tools) -> ToolCall:
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall(None, None, raw, f"bad_json: {e.msg} at line {e.lineno} column {e.colno}")
    except RecursionError:
        return ToolCall(None, None, raw, TOO_DEEP)
    except ValueError as e:  # an integer past Python's digit limit (a degenerate sample of digits)
        return ToolCall(None, None, raw, f"bad_json: {e}")
    if not isinstance(payload, dict):
        return ToolCall(
            None, None, raw, f'not_an_object: expected {{"name": ..., "arguments": ...}}, got {type(payload).__name__}'
        )
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, raw, 'missing_name: the call has no "name" string')
    if name not in known_tools:
        shown = repr(name) if len(name) <= 100 else f"{name[:100]!r}..."  # escaped: the model's text, shown back
        return ToolCall(name, None, raw, f"unknown_tool: {shown}; available: {', '.join(sorted(known_tools))}")
    if "arguments" not in payload:
        return ToolCall(name, None, raw, 'missing_arguments: the call has no "arguments" object')
    arguments = payload["arguments"]
    if isinstance(arguments, str):  # OpenAI-style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return ToolCall(name, None, raw, f"bad_json: arguments string: {e.msg}")
        except RecursionError:
            return ToolCall(name, None, raw, TOO_DEEP)
        except ValueError as e:
            return ToolCall(name, None, raw, f"bad_json: arguments string: {e}")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, raw, f"bad_arguments: expected an object, got {type(arguments).__name__}")
    return ToolCall(name, arguments, raw)


def hermes_block(name: str, arguments: dict) -> str:
    """One tool call as the policy is taught to write it (what parse_tool_calls reads back)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def invalid_call_result(call: ToolCall) -> ToolResult:
    return ToolResult(text=f"error: {call.failure}", status="invalid_call", failure=call.failure)


def hermes_system_prompt(instructions: str, tool_schemas: list[dict]) -> str:
    """A system message that lists the tools and the call format (Qwen's Hermes wording), for models whose chat
    template takes no `tools` argument."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_schemas)
    return (
        f"{instructions}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )
