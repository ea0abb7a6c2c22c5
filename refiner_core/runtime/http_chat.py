"""An OpenAI-compatible chat-completions client: one POST /v1/chat/completions with a timeout, retried on
transport faults (timeouts, refused connections, HTTP 429 / 5xx, bodies that are not a chat-completions reply)
with exponential backoff and full jitter. What the model wrote is never retried: a reply that is valid
chat-completions JSON is the model's answer, whatever its content.

`AnswerCache` keeps answers on disk, one JSON file per request key, so that a rerun never pays twice. Pure code
(httpx), no Prefect. The judge and rubric generation use both.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from refiner_core.store.storage import write_json

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
# A reply body's size limit: a floor for error pages and usage, plus generously many bytes per token asked for (a
# token is a few characters, JSON-escaped at most 6 bytes each). A body past it is no answer to this request.
REPLY_BYTES_FLOOR = 1 << 20
REPLY_BYTES_PER_TOKEN = 64
ERROR_DETAIL_BYTES = 64 << 10  # of an error reply's body: enough for its message


class ChatError(RuntimeError):
    """A request that produced no model answer. `kind`: timeout | refused | http_NNN | invalid_response | oversized |
    budget_exhausted; `retryable` says whether another attempt could help; `attempts` is set by the retry loop.
    prompt_tokens / completion_tokens: what the server said the failed attempts took (a reply it sent with usage but
    no usable answer), None where it said nothing."""

    def __init__(
        self,
        kind: str,
        detail: str,
        retryable: bool,
        retry_after: float | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.retryable, self.retry_after = kind, detail, retryable, retry_after
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens
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


@dataclass(frozen=True)
class ChatReply:
    """A model's answer, with the tokens the server says the request took (its `usage`; None when it sends none)."""

    content: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def chat_once(
    client: httpx.Client, base_url: str, body: dict, api_key: str = "", timeout_seconds: float = 60.0
) -> ChatReply:
    """POST {base_url}/chat/completions once; the first choice's message content and the reply's token usage, or
    ChatError. `timeout_seconds` bounds each read (httpx's timeout) and the reply's body as a whole, one sent a few
    bytes at a time included; a 200 reply's size is bounded by the tokens it may hold (body['max_tokens'])."""
    url = base_url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_seconds
    limit = REPLY_BYTES_FLOOR + REPLY_BYTES_PER_TOKEN * int(body.get("max_tokens") or 0)
    try:
        with client.stream("POST", url, json=body, headers=headers, timeout=timeout_seconds) as response:
            if response.status_code != 200:  # its status decides a retry, whatever its body's size
                raw = _read(response, deadline, ERROR_DETAIL_BYTES, cut=True)
            else:
                raw = _read(response, deadline, limit, cut=False)
                if raw is None:
                    raise ChatError(
                        "oversized",
                        f"{url}: a reply of over {limit} bytes for max_tokens {body.get('max_tokens')}",
                        False,
                    )
    except httpx.TimeoutException:
        raise ChatError("timeout", f"no whole answer from {url} within {timeout_seconds}s", True) from None
    except httpx.ConnectError as e:
        raise ChatError("refused", f"{url}: {e}", True) from None
    except httpx.TransportError as e:  # reset connections, protocol errors
        raise ChatError("transport", f"{url}: {type(e).__name__}: {e}", True) from None
    except httpx.DecodingError as e:  # a body its Content-Encoding does not decode
        raise ChatError("invalid_response", f"{url}: {e}", True) from None
    text = raw.decode("utf-8", errors="replace")  # for messages; the reply is parsed from its bytes (RFC 8259)
    if response.status_code != 200:
        retry_after = None
        try:
            retry_after = float(response.headers.get("retry-after", ""))
        except ValueError:
            pass
        status = response.status_code
        raise ChatError(
            f"http_{status}",
            f"{url}: {text[:200]!r}",
            status in RETRYABLE_STATUS or status >= 500,
            retry_after,
        )
    try:
        reply = json.loads(raw)
    except ValueError:
        raise ChatError("invalid_response", f"not a chat-completions reply: {text[:200]!r}", True) from None
    usage = reply.get("usage") if isinstance(reply, dict) and isinstance(reply.get("usage"), dict) else {}
    tokens = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ChatError(
            "invalid_response", f"not a chat-completions reply: {text[:200]!r}", True, None, *tokens
        ) from None
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ChatError(
            "invalid_response", f"message content is {type(content).__name__}, not a string", True, None, *tokens
        )
    return ChatReply(content, *tokens)


def _read(response: httpx.Response, deadline: float, limit: int, cut: bool) -> bytes | None:
    """The reply's body (decoded per its Content-Encoding) by `deadline`, else httpx.ReadTimeout. Past `limit` bytes:
    the first `limit` when `cut`, else None."""
    raw = bytearray()
    for chunk in response.iter_bytes():
        raw += chunk
        if len(raw) > limit:
            return bytes(raw[:limit]) if cut else None
        if time.monotonic() > deadline:
            raise httpx.ReadTimeout("the reply did not end in time")
    return bytes(raw)


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


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


class Pacer:
    """At most `requests_per_minute` requests and `tokens_per_minute` tokens in any 60 seconds (0 = no limit), over
    every thread that shares it. A request is admitted with an estimate of its tokens (the prompt's characters / 4
    plus its max_tokens), corrected once the reply says what it took; one larger than the whole token limit waits
    for an empty window. `clock` and `sleep` are injectable, so pacing is tested by counting, not timing."""

    WINDOW = 60.0

    def __init__(self, requests_per_minute: int = 0, tokens_per_minute: int = 0, clock=time.monotonic, sleep=None):
        self.requests_per_minute, self.tokens_per_minute = requests_per_minute, tokens_per_minute
        self.clock = clock
        self.sleep = sleep or time.sleep
        self.admitted: list[list[float]] = []  # [when, tokens] of the requests of the last WINDOW seconds
        self.waited = 0.0  # seconds spent waiting, over all requests
        self._lock = threading.Lock()

    @property
    def limited(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)

    def admit(self, tokens: int) -> list[float]:
        """Wait until a request of about `tokens` fits both limits; returns its entry, for `settle`."""
        with self._lock:  # one waiter at a time: requests are admitted in the order they asked
            while True:
                now = self.clock()
                self.admitted = [e for e in self.admitted if e[0] > now - self.WINDOW]
                wait = self._wait(now, tokens)
                if wait <= 0:
                    entry = [now, float(tokens)]
                    self.admitted.append(entry)
                    return entry
                self.waited += wait
                self.sleep(wait)

    def _wait(self, now: float, tokens: int) -> float:
        """Seconds until the oldest requests that stand in the way leave the window (0: admit now)."""
        waits = [0.0]
        if self.requests_per_minute and len(self.admitted) >= self.requests_per_minute:
            waits.append(self.admitted[len(self.admitted) - self.requests_per_minute][0] + self.WINDOW - now)
        if self.tokens_per_minute and self.admitted:
            used = sum(e[1] for e in self.admitted)
            excess = used + min(tokens, self.tokens_per_minute) - self.tokens_per_minute
            for when, taken in self.admitted:  # oldest first: wait until enough of them have left
                if excess <= 0:
                    break
                waits.append(when + self.WINDOW - now)
                excess -= taken
        return max(waits)

    def settle(self, entry: list[float], tokens: int | None) -> None:
        """The request took `tokens` (None: unknown, the estimate stands)."""
        if tokens is not None:
            with self._lock:
                entry[1] = float(tokens)


_PACERS: dict[tuple, Pacer] = {}
_PACERS_LOCK = threading.Lock()


def shared_pacer(key: tuple, requests_per_minute: int, tokens_per_minute: int) -> Pacer:
    """One pacer per endpoint and limits for the whole process: every stage and judge that calls the same server
    counts against the same minute."""
    key = (*key, requests_per_minute, tokens_per_minute)
    with _PACERS_LOCK:
        return _PACERS.setdefault(key, Pacer(requests_per_minute, tokens_per_minute))


def estimated_tokens(body: dict) -> int:
    """A request's tokens before it is sent: its messages' characters / 4, plus the most it may write."""
    chars = sum(len(str(m.get("content", ""))) for m in body.get("messages", []))
    return chars // 4 + int(body.get("max_tokens") or 0)


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
    reply, attempts = chat_reply(
        client,
        base_url,
        body,
        api_key=api_key,
        timeout_seconds=timeout_seconds,
        policy=policy,
        budget=budget,
        rng=rng,
        sleep=sleep,
    )
    return reply.content, attempts


def chat_reply(
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
    pacer: Pacer | None = None,
    cancelled: threading.Event | None = None,
) -> tuple[ChatReply, int]:
    """(reply, attempts), every attempt paced by `pacer`. Raises ChatError (with .attempts) once retries are spent,
    the fault is final or `cancelled` is set."""
    rng = rng or random.Random()
    attempts = 0
    spent = [None, None]  # tokens the server said failed attempts took: counted with the answer or the failure

    def failed(err: ChatError) -> ChatError:
        err.attempts = attempts
        err.prompt_tokens, err.completion_tokens = spent
        return err

    while True:
        if cancelled is not None and cancelled.is_set():
            raise failed(ChatError("cancelled", "the work was cancelled (it stalled)", False))
        if budget is not None and not budget.take():
            raise failed(ChatError("budget_exhausted", f"request budget of {budget.limit} requests used up", False))
        entry = pacer.admit(estimated_tokens(body)) if pacer is not None and pacer.limited else None
        attempts += 1
        try:
            reply = chat_once(client, base_url, body, api_key, timeout_seconds)
        except ChatError as e:
            spent = [_add(spent[0], e.prompt_tokens), _add(spent[1], e.completion_tokens)]
            if not e.retryable or attempts > policy.max_retries:
                raise failed(e) from None
            sleep(backoff_delay(attempts - 1, policy, rng, e.retry_after))
            continue
        if entry is not None and reply.prompt_tokens is not None and reply.completion_tokens is not None:
            pacer.settle(entry, reply.prompt_tokens + reply.completion_tokens)
        if spent != [None, None]:
            reply = dataclasses.replace(
                reply,
                prompt_tokens=_add(reply.prompt_tokens, spent[0]) if reply.prompt_tokens is not None else None,
                completion_tokens=_add(reply.completion_tokens, spent[1])
                if reply.completion_tokens is not None
                else None,
            )
        return reply, attempts


def _add(total: int | None, tokens: int | None) -> int | None:
    return tokens if total is None else total + (tokens or 0)


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
