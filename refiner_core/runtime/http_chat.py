"""An OpenAI-compatible chat-completions client: one POST /v1/chat/completions with a timeout, retried on
transport faults (timeouts, refused connections, HTTP 429 / 5xx, bodies that are not a chat-completions reply)
with exponential backoff and full jitter. What the model wrote is never retried: a reply that is valid
chat-completions JSON is the model's answer, whatever its content.

`AnswerCache` keeps answers on disk, one JSON file per request key, so that a rerun never pays twice. Pure code
(httpx), no Prefect. The judge and rubric generation use both.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from refiner_core.store.storage import write_json

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class ChatError(RuntimeError):
    """A request that produced no model answer. `kind`: timeout | refused | http_NNN | invalid_response |
    budget_exhausted; `retryable` says whether another attempt could help; `attempts` is set by the retry loop."""

    def __init__(self, kind: str, detail: str, retryable: bool, retry_after: float | None = None):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.retryable, self.retry_after = kind, detail, retryable, retry_after
        self.attempts = 0


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3  # attempts = 1 + max_retries at most
    backoff_seconds: float = 0.5  # the first retry waits up to this (full jitter), doubling each retry
    backoff_max_seconds: float = 30.0


def backoff_delay(retry: int, policy: RetryPolicy, rng: random.Random, retry_after: float | None = None) -> float:
    """Full jitter: uniform(0, min(max, base * 2**retry)); a server's Retry-After (capped) is a floor."""
    delay = rng.uniform(0.0, min(policy.backoff_max_seconds, policy.backoff_seconds * (2**retry)))
    if retry_after is not None:
        delay = max(delay, min(retry_after, policy.backoff_max_seconds))
    return delay


def chat_once(client: httpx.Client, base_url: str, body: dict, api_key: str = "", timeout_seconds: float = 60.0) -> str:
    """POST {base_url}/chat/completions once; the first choice's message content, or ChatError."""
    url = base_url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = client.post(url, json=body, headers=headers, timeout=timeout_seconds)
    except httpx.TimeoutException:
        raise ChatError("timeout", f"no answer from {url} within {timeout_seconds}s", True) from None
    except httpx.ConnectError as e:
        raise ChatError("refused", f"{url}: {e}", True) from None
    except httpx.TransportError as e:  # reset connections, protocol errors
        raise ChatError("transport", f"{url}: {type(e).__name__}: {e}", True) from None
    if response.status_code != 200:
        retry_after = None
        try:
            retry_after = float(response.headers.get("retry-after", ""))
        except ValueError:
            pass
        status = response.status_code
        raise ChatError(
            f"http_{status}",
            f"{url}: {response.text[:200]!r}",
            status in RETRYABLE_STATUS or status >= 500,
            retry_after,
        )
    try:
        content = response.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ChatError("invalid_response", f"not a chat-completions reply: {response.text[:200]!r}", True) from None
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ChatError("invalid_response", f"message content is {type(content).__name__}, not a string", True)
    return content


class RequestBudget:
    """At most `limit` requests (attempts, retries included) in all; 0 = unlimited. Thread-safe."""

    def __init__(self, limit: int = 0):
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.limit and self.used >= self.limit:
                return False
            self.used += 1
            return True


def chat_with_retries(
    client: httpx.Client,
    base_url: str,
    body: dict,
    *,
    api_key: str = "",
    timeout_seconds: float = 60.0,
    policy: RetryPolicy = RetryPolicy(),
    budget: RequestBudget | None = None,
    rng: random.Random | None = None,
    sleep=time.sleep,
) -> tuple[str, int]:
    """(content, attempts). Raises ChatError (with .attempts) once retries are spent or the fault is final."""
    rng = rng or random.Random()
    attempts = 0
    while True:
        if budget is not None and not budget.take():
            err = ChatError("budget_exhausted", f"request budget of {budget.limit} requests used up", False)
            err.attempts = attempts
            raise err
        attempts += 1
        try:
            return chat_once(client, base_url, body, api_key, timeout_seconds), attempts
        except ChatError as e:
            e.attempts = attempts
            if not e.retryable or attempts > policy.max_retries:
                raise
            sleep(backoff_delay(attempts - 1, policy, rng, e.retry_after))


def list_models(base_url: str, api_key: str = "", timeout_seconds: float = 10.0) -> list[str]:
    """Model ids the server lists at GET {base_url}/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=timeout_seconds)
    response.raise_for_status()
    return [m["id"] for m in response.json().get("data", [])]


@dataclass
class AnswerCache:
    """Model answers on disk, one JSON file per key under `root`. Files are written atomically (temp file + rename),
    so two processes sharing the cache never see a partial entry; two writers of one key write the same answer and
    the last rename wins. An unreadable entry is a miss, overwritten by the next answer."""

    root: Path

    def _path(self, key: str) -> Path:
        return Path(self.root) / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict | None:
        try:
            entry = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        return entry if isinstance(entry, dict) and isinstance(entry.get("content"), str) else None

    def put(self, key: str, content: str, **meta) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json({"key": key, "content": content, "created": time.time(), **meta}, path)

    def __len__(self) -> int:
        return sum(1 for _ in Path(self.root).glob("*/*.json"))
