"""Source rows: loading and validation, with the reason a rejected row is quarantined (prompt preparation:
data/prepare.py; the step schedule: data/schedule.py; quarantine reports: data/quarantine.py).

Two row shapes are accepted: refiner rows (id, question, reasoning, tool_output, answer?, rubrics?) and
open-instruct style chat rows (id, messages, ground_truth?, dataset?).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from refiner_core.data.formats import (
    check_citations,
    parse_answer,
    read_tool_output,
    render_snippets,
    tool_output_problem,
    tool_snippet_ids,
)
from refiner_core.data.prompts import refiner_messages
from refiner_core.data.rubric_fields import RubricError, instance_rubrics
from refiner_core.data.text_safety import DATA_CONTROL_CHARACTERS, LONE_SURROGATES, found_at

REQUIRED_TEXT_FIELDS = ("id", "question", "reasoning", "tool_output")
CHAT_ROLES = ("system", "user", "assistant", "tool")
CHAT_KEYS = ("role", "content")  # what every chat message holds; tool_calls, name, ... are optional
RAW_LIMIT = 4096
UTF8_BOM = b"\xef\xbb\xbf"  # some editors start UTF-8 files with it; it is not part of line 1's JSON


class TooManyRejected(RuntimeError):
    pass


@dataclass
class RawRow:
    row_ref: str  # line number in the source
    raw: str  # the text as read (for quarantine)
    data: dict | None  # parsed object, None when it did not parse
    error: str | None = None


@dataclass
class Rejection:
    row_ref: str
    reason: str
    detail: str
    raw: str

    def as_quarantine(self, run: str, stage: str, source: str) -> dict:
        return {
            "run": run,
            "stage": stage,
            "source": source,
            "row_ref": self.row_ref,
            "reason": self.reason,
            "detail": self.detail,
            "raw": self.raw[:RAW_LIMIT],
        }


@dataclass
class Validated:
    rows: list[dict] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)


def read_jsonl(path: Path) -> list[RawRow]:
    """Read JSONL bytes line by line; undecodable or unparseable lines become RawRows with an error. Lines end at
    LF only (a CRLF ending loses its CR), as the preflight and editors count them: bytes.splitlines would also
    break at a lone CR inside a line, splitting it in two and shifting every later row_ref."""
    lines = Path(path).read_bytes().removeprefix(UTF8_BOM).split(b"\n")
    lines = [line.removesuffix(b"\r") for line in lines]
    return [parse_jsonl_line(n, line) for n, line in enumerate(lines, start=1) if line.strip()]


def parse_jsonl_line(n: int, line: bytes) -> RawRow:
    """Line `n` of a JSONL file (without the file's BOM) as a RawRow, with an error when it is unusable."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return RawRow(f"line {n}", line.decode("utf-8", errors="replace"), None, f"non_utf8: {e.reason}")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return RawRow(f"line {n}", text, None, f"invalid_json: {e.msg} at char {e.pos}")
    if not isinstance(obj, dict):
        return RawRow(f"line {n}", text, None, f"not_an_object: got {type(obj).__name__}")
    return RawRow(f"line {n}", text, obj)


def content_hash(row: dict) -> str:
    """A valid row's content as written (prompts.content_hash): `refiner compare` matches prompts of two runs by
    it, so it stays what earlier versions computed."""
    if is_chat_row(row):
        material = [row.get("messages"), row.get("ground_truth")]
    else:
        material = [row.get(k) for k in ("question", "reasoning", "tool_output", "answer")]
    return _digest(material)


def duplicate_key(row: dict) -> str:
    """What makes two valid rows one (duplicate_content): as content_hash, but a chat row's messages count by their
    fields in whatever order its JSON wrote them, and its ground truth as the reference text it becomes (4 and "4"
    are one answer)."""
    if not is_chat_row(row):
        return content_hash(row)
    messages = [
        {"role": m["role"], "content": m["content"], **_sorted_keys({k: m[k] for k in m if k not in CHAT_KEYS})}
        for m in row["messages"]
    ]
    return _digest([messages, ground_truth_text(row.get("ground_truth"))])


def _digest(material: list) -> str:
    return hashlib.blake2b(json.dumps(material, default=str).encode(), digest_size=12).hexdigest()


def _sorted_keys(value):
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    return [_sorted_keys(v) for v in value] if isinstance(value, list) else value


def ground_truth_text(truth) -> str | None:
    """A valid chat row's ground truth as the reference answer text: a number as its text, blank as none."""
    truth = str(truth) if isinstance(truth, (int, float)) and not isinstance(truth, bool) else truth
    return truth if isinstance(truth, str) and truth.strip() else None


def messages_hash(messages: list[dict]) -> str:
    return _digest([[m["role"], m["content"]] for m in messages])


def prompt_messages(row: dict) -> list[dict]:
    """The conversation a valid row asks the policy to continue: the refiner prompt built from its question,
    reasoning and tool output, or a chat row's messages without a final assistant turn."""
    if not is_chat_row(row):
        return refiner_messages(row["question"], row["reasoning"], row["tool_output"])
    messages = row["messages"]
    return messages[:-1] if messages[-1]["role"] == "assistant" else messages


def prompt_hash(row: dict) -> str:
    """Hash of a valid row's prompt, its answer left out: rows that ask the same thing share it, whatever their
    answers, and whichever of the two shapes they have."""
    return messages_hash(prompt_messages(row))


def opening_hash(row: dict) -> str:
    """Hash of what a valid row asks before its first answer (its whole prompt where it holds no answer): the
    conversations that continue one opening share it, a longer one holding a shorter one's answers as context. An
    answer is an assistant turn after a user message: a greeting that opens a conversation belongs to its opening
    (else every conversation opening with one would share the empty opening, and so one split)."""
    messages = prompt_messages(row)
    first_answer = next((i for i, _ in answered_questions(messages)), len(messages))
    return messages_hash(messages[:first_answer])


def answered_questions(messages: list[dict]) -> list[tuple[int, str]]:
    """(index, question) of each assistant turn that answers a user message: the last user message before it.
    An assistant turn before any user message (a greeting) answers nothing."""
    answered, asked = [], None
    for i, m in enumerate(messages):
        if m["role"] == "user":
            asked = m["content"]
        elif m["role"] == "assistant" and asked is not None:
            answered.append((i, asked))
    return answered


def row_json(row: dict) -> str:
    """A validated row as JSON text for the quarantine, without the fields validation added. Values JSON has no
    type for (timestamps, dates, decimals of a Parquet or hub source) are written as their text."""
    return json.dumps({k: v for k, v in row.items() if k not in ("content_hash", "row_ref")}, default=str)


def is_chat_row(row: dict) -> bool:
    """Open-instruct style: the conversation is in `messages` (refiner fields absent)."""
    return "messages" in row and "question" not in row


def _check_text_fields(row: dict, keys: tuple[str, ...]) -> tuple[str, str] | None:
    for key in keys:
        if key not in row or row[key] is None:
            return "missing_field", f"field {key!r} is missing"
        if not isinstance(row[key], str):
            return "wrong_type", f"field {key!r} must be a string, got {type(row[key]).__name__}"
        if not row[key].strip():
            return (
                ("empty_tool_output", "tool_output is empty")
                if key == "tool_output"
                else ("empty_field", f"field {key!r} is empty")
            )
    return None


def check_messages(messages) -> str | None:
    """Why a chat conversation is unusable, or None."""
    if not isinstance(messages, list) or not messages:
        return f"'messages' must be a non-empty list, got {type(messages).__name__}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i} is not an object"
        if m.get("role") not in CHAT_ROLES:
            return f"message {i} has role {m.get('role')!r}; expected one of {list(CHAT_ROLES)}"
        if not isinstance(m.get("content"), str):
            return f"message {i} content must be a string, got {type(m.get('content')).__name__}"
    prompt = messages[:-1] if messages[-1]["role"] == "assistant" else messages
    if not any(m["role"] == "user" and m["content"].strip() for m in prompt):
        return "no non-empty user message before the final answer"
    return None


def find_control_character(value, where: str = "row") -> str | None:
    """Where the first control character (other than tab, newline, carriage return) in any text of a row is:
    "field 'question' holds U+0000 at offset 12", or None."""
    return _find_in_texts(DATA_CONTROL_CHARACTERS, value, where)


def _find_in_texts(pattern: re.Pattern, value, where: str) -> str | None:
    if isinstance(value, str):
        found = found_at(pattern, value)
        return f"{where} {found}" if found else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = f"field {key!r}" if where == "row" else f"{where}[{key!r}]"
        problem = _find_in_texts(pattern, item, inner)
        if problem:
            return problem
    return None


def check_row(row: dict) -> tuple[str, str] | None:
    """(reason, detail) when the row cannot be used, else None. Missing rubrics are not checked here: the
    rubric stage fills or quarantines them; malformed rubrics are rejected here."""
    surrogate = _find_in_texts(LONE_SURROGATES, row, "row")
    if surrogate:
        return "lone_surrogate", f"{surrogate}: a lone UTF-16 surrogate escape, which UTF-8 text cannot hold"
    control = find_control_character(row)
    if control:
        return "control_characters", control
    if is_chat_row(row):
        problem = _check_text_fields(row, ("id",))
        if problem:
            return problem
        why = check_messages(row["messages"])
        if why:
            return "invalid_messages", why
        broken = _check_tool_messages(row["messages"])
        if broken:
            return "invalid_tool_output", broken
        return _check_ground_truth(row.get("ground_truth")) or _check_rubrics(row)
    problem = _check_text_fields(row, REQUIRED_TEXT_FIELDS)
    if problem:
        return problem
    broken = tool_output_problem(row["tool_output"])
    if broken:
        return "invalid_tool_output", broken
    ids = tool_snippet_ids(row["tool_output"])
    if not ids:
        return "no_snippets", "tool_output contains no <snippet id=...> blocks"
    answer = row.get("answer", "")
    if answer not in (None, ""):
        if not isinstance(answer, str):
            return "wrong_type", f"field 'answer' must be a string, got {type(answer).__name__}"
        parsed = parse_answer(answer)
        if not parsed.has_answer or not parsed.well_formed:
            return "bad_answer_format", "; ".join(parsed.problems)
        check = check_citations(parsed, ids)
        if check.n_invalid:
            return "unknown_snippet_id", f"answer cites IDs absent from tool_output: {sorted(set(check.invalid_ids))}"
    return _check_supporting_ids(row.get("supporting_ids"), ids) or _check_rubrics(row)


def _check_tool_messages(messages: list[dict]) -> str | None:
    """Why the tool messages cannot be read as one tool output, or None. The prompt's citable snippets are read
    from them joined, and a snippet ID given again with another text (a second search numbering its results
    from S1 again) would end that reading there, every later ID dropped."""
    given_in: dict[str, tuple[int, str]] = {}  # snippet ID -> (the message that gave it first, its text)
    for i, message in enumerate(messages):
        if message["role"] != "tool":
            continue
        texts, broken = read_tool_output(message["content"])
        if broken:
            return f"message {i}: {broken}"
        for sid, text in texts.items():
            first, known = given_in.setdefault(sid, (i, text))
            if known != text:
                return f"message {i}: snippet ID {sid!r} was given in message {first} with another text"
    return None


def _check_ground_truth(truth) -> tuple[str, str] | None:
    """A chat row's ground truth, when given, is text or a finite number (read as its text)."""
    if truth is None or isinstance(truth, str) or (isinstance(truth, int) and not isinstance(truth, bool)):
        return None
    if isinstance(truth, float):  # NaN is how JSON writers and Parquet say "missing": no answer is "nan"
        return None if math.isfinite(truth) else ("wrong_type", f"field 'ground_truth' is {truth!r}, not a number")
    return "wrong_type", f"field 'ground_truth' must be a string or a number, got {type(truth).__name__}"


def _check_supporting_ids(supporting, snippet_ids: list[str]) -> tuple[str, str] | None:
    """supporting_ids, when given, is a non-empty list of IDs of the row's own snippets."""
    if supporting is None:
        return None
    if not isinstance(supporting, list) or not all(isinstance(i, str) for i in supporting):
        return "wrong_type", f"field 'supporting_ids' must be a list of snippet IDs, got {supporting!r}"
    if not supporting:
        return "unknown_supporting_id", "supporting_ids is empty: name at least one snippet, or leave the field out"
    unknown = sorted(set(supporting) - set(snippet_ids))
    if unknown:
        return "unknown_supporting_id", f"supporting_ids names IDs absent from tool_output: {unknown}"
    return None


def _check_rubrics(row: dict) -> tuple[str, str] | None:
    try:
        instance_rubrics(row.get("positive_rubrics"), row.get("negative_rubrics"), allow_empty=True)
    except RubricError as e:
        return "invalid_rubrics", str(e)
    return None


def normalise_row(row: dict) -> tuple[str, str] | None:
    """Bring the shapes real data sets use into the canonical one, in place: integer IDs (common in Parquet and
    hub data) become text, a tool output given as a list of snippet objects is rendered as snippet markup.
    (reason, detail) when that is impossible."""
    if isinstance(row.get("id"), int) and not isinstance(row["id"], bool):
        row["id"] = str(row["id"])
    if isinstance(row.get("tool_output"), list) and not is_chat_row(row):
        try:
            row["tool_output"] = render_snippets(row["tool_output"])
        except ValueError as e:
            return "invalid_tool_output", str(e)
    return None


def validate_rows(raw_rows: list[RawRow]) -> Validated:
    out = Validated()
    seen_ids: set[str] = set()
    seen_hashes: set[str] = set()
    for raw in raw_rows:
        if raw.data is None:
            reason, _, detail = raw.error.partition(": ")
            out.rejected.append(Rejection(raw.row_ref, reason, detail, raw.raw))
            continue
        problem = normalise_row(raw.data) or check_row(raw.data)
        if problem is None and raw.data["id"] in seen_ids:
            problem = ("duplicate_id", f"id {raw.data['id']!r} already seen")
        digest = content_hash(raw.data) if problem is None else ""
        key = duplicate_key(raw.data) if problem is None else ""
        if problem is None and key in seen_hashes:
            problem = ("duplicate_content", "same question, reasoning, tool output and answer as an earlier row")
        if problem:
            out.rejected.append(Rejection(raw.row_ref, *problem, raw.raw))
            continue
        seen_ids.add(raw.data["id"])
        seen_hashes.add(key)
        out.rows.append({**raw.data, "content_hash": digest, "row_ref": raw.row_ref})
    return out


def accepted_raw_rows(raw_rows: list[RawRow]) -> list[RawRow]:
    """The rows validate_rows accepts, as RawRows: later stages that re-read the source (rubric ingest) see
    exactly the rows prepare-data kept, even when an ID also appears on an earlier, rejected line."""
    kept = {r["row_ref"] for r in validate_rows(raw_rows).rows}
    return [r for r in raw_rows if r.row_ref in kept]


def split_of(prompt_id: str, validation_fraction: float, seed: int) -> str:
    """Deterministic per-row split: stable when rows are added or removed."""
    if validation_fraction <= 0:
        return "train"
    h = int(hashlib.blake2b(f"{seed}:{prompt_id}".encode(), digest_size=8).hexdigest(), 16)
    return "validation" if (h % 10_000) / 10_000 < validation_fraction else "train"


def check_rejected_fraction(
    rejected: list[Rejection], total: int, max_fraction: float, where: str, n_rejected: int | None = None
) -> None:
    """Fail only above the configured fraction, naming the first rows and their reasons. `n_rejected`
    overrides len(rejected) when only some rejections count against `total` (e.g. prompts left without rubrics)."""
    n_rejected = len(rejected) if n_rejected is None else n_rejected
    fraction = n_rejected / max(total, 1)
    if fraction <= max_fraction:
        return
    counts: dict[str, int] = {}
    for r in rejected:
        counts[r.reason] = counts.get(r.reason, 0) + 1
    first = "; ".join(f"{r.row_ref}: {r.reason} ({r.detail})" for r in rejected[:5])
    raise TooManyRejected(
        f"{n_rejected}/{total} rows rejected ({fraction:.0%} > max_rejected_fraction {max_fraction:.0%}); "
        f"reasons {counts}. First: {first}. Every rejected row is in {where} (table 'quarantine')."
    )
