"""Rubric generation through an OpenAI-compatible chat-completions endpoint, for rows that have none.

Answers are cached on disk per request (keyed by a hash of the request body, not the URL), so a rerun never
pays twice. Transport failures (timeout, refused connection, HTTP errors) are not cached: a rerun retries
them. Junk answers are cached like any answer: the same request would be paid again for the same junk.
Every failure is a `RubricGenerationError` with a quarantine reason, never a crash.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from refiner_core.rubrics import RubricError, instance_rubrics
from refiner_core.storage import write_json

GENERATION_SYSTEM_PROMPT = (
    "You write grading rubrics for answers to research questions. Given a question, the search results an "
    "answer may use and possibly a reference answer, write criteria a grader can check one at a time. "
    "Positive rubrics describe what a good answer does; negative rubrics describe mistakes it must avoid. "
    'Reply with JSON only: {"positive_rubrics": [{"title": "...", "description": "...", "weight": 1.0}, ...], '
    '"negative_rubrics": [...]}.'
)
MAX_TOOL_OUTPUT_CHARS = 6000
_FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


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
    return {"model": settings.model, "messages": messages, "max_tokens": settings.max_tokens,
            "temperature": settings.temperature}


def cache_key(body: dict) -> str:
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()


def parse_generated(content: str) -> list[dict]:
    """Strict: one JSON object (optionally in a ```json fence) with two lists of rubrics, at least one rubric."""
    text = content.strip()
    fenced = _FENCE_RE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RubricGenerationError("rubric_generation_unparseable",
                                    f"answer is not JSON ({e.msg} at char {e.pos}): {content[:200]!r}") from None
    if not isinstance(obj, dict) or not {"positive_rubrics", "negative_rubrics"} <= set(obj):
        raise RubricGenerationError("rubric_generation_invalid",
                                    f"expected an object with positive_rubrics and negative_rubrics: {content[:200]!r}")
    try:
        return instance_rubrics(obj["positive_rubrics"], obj["negative_rubrics"])
    except RubricError as e:
        raise RubricGenerationError("rubric_generation_invalid", str(e)) from None


def chat_completion(body: dict, settings: GenerationSettings) -> str:
    """POST /chat/completions and return the first choice's content; transport problems raise."""
    url = settings.endpoint.rstrip("/") + "/chat/completions"
    headers = {"Content-Type": "application/json"}
    if settings.api_key:
        headers["Authorization"] = f"Bearer {settings.api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=settings.timeout_seconds) as response:
            payload = response.read()
    except urllib.error.HTTPError as e:
        raise RubricGenerationError("rubric_generation_http_error", f"HTTP {e.code} from {url}") from None
    except (socket.timeout, TimeoutError):
        raise RubricGenerationError("rubric_generation_timeout",
                                    f"no answer from {url} within {settings.timeout_seconds}s") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            raise RubricGenerationError("rubric_generation_timeout",
                                        f"no answer from {url} within {settings.timeout_seconds}s") from None
        raise RubricGenerationError("rubric_generation_http_error", f"{url}: {e.reason}") from None
    except OSError as e:
        raise RubricGenerationError("rubric_generation_http_error", f"{url}: {e}") from None
    try:
        content = json.loads(payload)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise RubricGenerationError("rubric_generation_invalid",
                                    f"not a chat-completions response: {payload[:200]!r}") from None
    if not isinstance(content, str):
        raise RubricGenerationError("rubric_generation_invalid", "message content is not a string")
    return content


def generate_rubrics(question: str, tool_output: str, reference_answer: str,
                     settings: GenerationSettings) -> tuple[list[dict], bool]:
    """(normalised instance rubrics, served_from_cache). Raises RubricGenerationError on any failure."""
    body = request_body(generation_messages(question, tool_output, reference_answer), settings)
    path = Path(settings.cache_dir) / f"{cache_key(body)}.json"
    cached = path.exists()
    if cached:
        content = json.loads(path.read_text())["content"]
    else:
        try:
            content = chat_completion(body, settings)
        except RubricGenerationError as e:
            e.answered = False
            raise
        write_json({"request": body, "content": content}, path)
    try:
        return parse_generated(content), cached
    except RubricGenerationError as e:
        e.answered, e.from_cache = True, cached
        raise
