"""Rubric generation through an OpenAI-compatible chat-completions endpoint, for rows that have none.

The HTTP client and the answer cache are refiner_core.runtime.http_chat's, as for the judge. Answers are cached on
disk per request (keyed by a hash of the request body, not the URL), so a rerun never pays twice. One attempt per row:
transport failures (timeout, refused connection, HTTP errors) are not cached, the row is quarantined, and a rerun
asks again. Junk answers are cached like any answer: the same request would be paid again for the same junk.
Every failure is a `RubricGenerationError` with a quarantine reason, never a crash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

from refiner_core.data.rubric_fields import RubricError, instance_rubrics
from refiner_core.runtime.http_chat import AnswerCache, ChatError, RetryPolicy, chat_with_retries
from refiner_core.store.storage import json_hash

GENERATION_SYSTEM_PROMPT = (
    "You write grading rubrics for answers to research questions. Given a question, the search results an "
    "answer may use and possibly a reference answer, write criteria a grader can check one at a time. "
    "Positive rubrics describe what a good answer does; negative rubrics describe mistakes it must avoid. "
    'Reply with JSON only: {"positive_rubrics": [{"title": "...", "description": "...", "weight": 1.0}, ...], '
    '"negative_rubrics": [...]}.'
)
MAX_TOOL_OUTPUT_CHARS = 6000
_FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
ONE_ATTEMPT = RetryPolicy(max_retries=0)  # a failed row is quarantined; the stage's rerun asks again


class RubricGenerationError(RuntimeError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail
        self.answered: bool | None = None  # set by generate_rubrics: an answer existed (fresh or cached)
        self.from_cache = False


@dataclass(frozen=True)
class GenerationSettings:
    endpoint: str  # base URL, e.g. http://127.0.0.1:8000/v1
    model: str
    cache_dir: Path
    api_key: str = ""
    timeout_seconds: float = 60.0
    max_tokens: int = 1024
    temperature: float = 0.0


def generation_messages(question: str, tool_output: str, reference_answer: str = "") -> list[dict]:
    user = f"Question:\n{question}\n\nSearch results:\n{tool_output[:MAX_TOOL_OUTPUT_CHARS]}\n\n"
    if reference_answer:
        user += f"Reference answer:\n{reference_answer}\n\n"
    user += "JSON:"
    return [{"role": "system", "content": GENERATION_SYSTEM_PROMPT}, {"role": "user", "content": user}]


def request_body(messages: list[dict], settings: GenerationSettings) -> dict:
    return {
        "model": settings.model,
        "messages": messages,
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
    }


def cache_key(body: dict) -> str:
    return json_hash(body)


def parse_generated(content: str) -> list[dict]:
    """Strict: one JSON object (optionally in a ```json fence) with two lists of rubrics, at least one rubric."""
    text = content.strip()
    fenced = _FENCE_RE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RubricGenerationError(
            "rubric_generation_unparseable", f"answer is not JSON ({e.msg} at char {e.pos}): {content[:200]!r}"
        ) from None
    except (ValueError, RecursionError) as e:  # an integer past Python's digit limit, nesting too deep
        raise RubricGenerationError(
            "rubric_generation_unparseable", f"answer is unreadable JSON ({type(e).__name__}): {content[:200]!r}"
        ) from None
    if not isinstance(obj, dict) or not {"positive_rubrics", "negative_rubrics"} <= set(obj):
        raise RubricGenerationError(
            "rubric_generation_invalid",
            f"expected an object with positive_rubrics and negative_rubrics: {content[:200]!r}",
        )
    try:
        return instance_rubrics(obj["positive_rubrics"], obj["negative_rubrics"])
    except RubricError as e:
        raise RubricGenerationError("rubric_generation_invalid", str(e)) from None


def chat_completion(body: dict, settings: GenerationSettings) -> str:
    """POST /chat/completions once and return the first choice's content; transport problems raise."""
    try:
        with httpx.Client() as client:
            content, _ = chat_with_retries(
                client,
                settings.endpoint,
                body,
                api_key=settings.api_key,
                timeout_seconds=settings.timeout_seconds,
                policy=ONE_ATTEMPT,
            )
    except ChatError as e:
        reason = {"timeout": "rubric_generation_timeout", "invalid_response": "rubric_generation_invalid"}
        raise RubricGenerationError(
            reason.get(e.kind, "rubric_generation_http_error"), f"{e.kind}: {e.detail}"
        ) from None
    return content


def generate_rubrics(
    question: str, tool_output: str, reference_answer: str, settings: GenerationSettings
) -> tuple[list[dict], bool]:
    """(normalised instance rubrics, served_from_cache). Raises RubricGenerationError on any failure."""
    body = request_body(generation_messages(question, tool_output, reference_answer), settings)
    cache, key = AnswerCache(Path(settings.cache_dir)), cache_key(body)
    entry = cache.get(key)
    cached = entry is not None
    if cached:
        content = entry["content"]
    else:
        try:
            content = chat_completion(body, settings)
        except RubricGenerationError as e:
            e.answered = False
            raise
        cache.put(key, content, request=body)
    try:
        return parse_generated(content), cached
    except RubricGenerationError as e:
        e.answered, e.from_cache = True, cached
        raise
