"""The 'openai' judge: an OpenAI-compatible server (`vllm serve`, `refiner judge serve`, any /v1/chat/completions).

Pairs are judged concurrently (a thread pool of `concurrency` workers sharing one httpx connection pool), with a
progress bar (judged / total, failures, cache hits). Each answer is cached by (judge identity, sampling settings,
exact prompt hash) before it is used, so re-scoring the same pair never calls the server again; transport failures
(after retries) come back as failed rows and are not cached. The identity is the base URL, the served name, what
the server reports about that name at GET /models (read once per judge) and `judge.openai.cache_namespace`; a server
that does not list the name gets no caching, since nothing would tell its answers from another judge's. The API
key is read from the environment variable named by `judge.openai.api_key_env` and kept only in memory.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import httpx

from refiner_core.config import ConfigError, JudgeConfig, OpenAIJudgeConfig
from refiner_core.judges.base import Completion, parse_judge_output
from refiner_core.judges.cache import FRESH, cache_key, open_cache, prompt_hash
from refiner_core.judges.cost import PAYER
from refiner_core.runtime.http_chat import AnswerCache, ChatError, RequestBudget, RetryPolicy, chat_reply, shared_pacer
from refiner_core.runtime.progress import check_stalled, on_stall, probing

# What a GET /models entry says about the weights behind a name (vLLM: `root` is the folder or hub id it loaded,
# `parent` a LoRA adapter's base). Fields that change on every listing (vLLM's `created`, its permission ids)
# stay out, so the same server gives the same key in every process.
REPORTED_IDENTITY_FIELDS = ("root", "parent", "owned_by", "max_model_len")


@dataclass
class OpenAIJudge:
    base_url: str
    model: str
    api_key: str = field(default="", repr=False)
    concurrency: int = 8
    timeout_seconds: float = 60.0
    policy: RetryPolicy = RetryPolicy()
    request_budget: int = 0
    temperature: float = 0.0
    max_tokens: int = 16
    cache: AnswerCache | None = None
    cache_namespace: str = ""
    progress: bool = True
    seed: int = 0
    name: str = "openai"
    listed: list[dict] | None = field(default=None, repr=False)  # GET /models, when the factory already read it
    more_base_urls: tuple[str, ...] = ()  # servers of the same model beside base_url (judge.openai.more_base_urls)
    max_requests_per_minute: int = 0  # pacing over all servers of the judge (judge.openai.max_requests_per_minute)
    max_tokens_per_minute: int = 0

    def __post_init__(self):
        self.budget = RequestBudget(self.request_budget)
        self.requests_made = 0  # attempts made by this judge (all complete calls), for logs and benchmarks
        self.tokens_used = [0, 0]  # prompt and completion tokens the server reported, over all complete calls
        self.pacer = shared_pacer(
            (tuple(self.endpoints_of()), self.model), self.max_requests_per_minute, self.max_tokens_per_minute
        )
        self.model_name = self.model
        self.name = f"openai:{self.model}"
        self.cache_off_reason = ""  # why this judge neither reads nor writes the cache, when it does not
        self._identity: dict | None = None
        self.endpoints = self.endpoints_of()

    def endpoints_of(self) -> list[str]:
        return [self.base_url, *self.more_base_urls]

    def endpoint(self, digest: str) -> str:
        """The server a pair goes to: always the same one for the same prompt, so reruns ask the same server."""
        return self.endpoints[int(digest[:8], 16) % len(self.endpoints)]

    def identity(self) -> dict | None:
        """Who answers, as the cache key holds it; None (no caching) when the server does not list the served
        name. The server is asked once per judge."""
        if self._identity is None and not self.cache_off_reason:
            try:
                listed = (
                    self.listed
                    if self.listed is not None
                    else listed_models(self.base_url, self.api_key, self.timeout_seconds)
                )
            except ConnectionError as e:
                self.cache_off_reason = f"judge cache off: {e}"
                return None
            card = next((m for m in listed if m.get("id") == self.model), None)
            if card is None:
                self.cache_off_reason = (
                    f"judge cache off: the server at {self.base_url} does not list "
                    f"{self.model!r} at GET /models, so nothing identifies its weights"
                )
                return None
            urls = " ".join(sorted(url.rstrip("/") for url in self.endpoints))  # the weights checked equal on each
            self._identity = {
                "base_url": urls,
                "model": self.model,
                "reported": {k: card[k] for k in REPORTED_IDENTITY_FIELDS if card.get(k) is not None},
                "namespace": self.cache_namespace,
            }
        return self._identity

    @property
    def sampling(self) -> dict:
        return {"temperature": self.temperature, "max_tokens": self.max_tokens}

    def body(self, messages: list[dict]) -> dict:
        return {"model": self.model, "messages": messages, **self.sampling}

    def complete(self, conversations: list[list[dict]]) -> list[str]:
        return [c.text or "" for c in self.complete_detailed(conversations)]

    def complete_detailed(self, conversations: list[list[dict]]) -> list[Completion]:
        out: list[Completion | None] = [None] * len(conversations)
        todo = []
        identity = self.identity() if self.cache is not None and conversations and not FRESH.get() else None
        cache = self.cache if identity is not None else None
        payer = PAYER.get()
        repaid = [0, 0, 0]  # requests and tokens of hits this stage paid for in an earlier attempt
        for i, messages in enumerate(conversations):
            digest = prompt_hash(messages)
            key = cache_key(identity, self.sampling, digest) if cache is not None else ""
            hit = cache.get(key) if cache is not None else None
            if hit is not None:  # nothing paid now; what an earlier attempt of this stage paid counts here
                paid = (hit.get("attempts", 0), hit.get("prompt_tokens"), hit.get("completion_tokens"))
                attempts, tokens_in, tokens_out = paid if payer is not None and payer.counts(key, hit) else (0, 0, 0)
                out[i] = Completion(
                    hit["content"], None, 0.0, attempts, True, self.model, digest, tokens_in, tokens_out
                )
                repaid = [repaid[0] + attempts, repaid[1] + (tokens_in or 0), repaid[2] + (tokens_out or 0)]
            else:
                todo.append((i, messages, digest, key))
        self.requests_made += repaid[0]
        self.tokens_used = [self.tokens_used[0] + repaid[1], self.tokens_used[1] + repaid[2]]
        bar = _progress(len(conversations), self.progress)
        bar.update(len(conversations) - len(todo))
        lock, failures, unparsed = threading.Lock(), [0], [0]
        hits = len(conversations) - len(todo)
        cancelled = threading.Event()  # set when the stage stalls: no request starts after it

        def one(job) -> None:
            i, messages, digest, key = job
            rng = random.Random(f"{self.seed}:{digest}")  # reproducible jitter per pair
            start = time.perf_counter()
            try:
                reply, attempts = chat_reply(
                    client,
                    self.endpoint(digest),
                    self.body(messages),
                    api_key=self.api_key,
                    timeout_seconds=self.timeout_seconds,
                    policy=self.policy,
                    budget=self.budget,
                    rng=rng,
                    pacer=self.pacer,
                    cancelled=cancelled,
                )
                done = Completion(
                    reply.content,
                    None,
                    time.perf_counter() - start,
                    attempts,
                    False,
                    self.model,
                    digest,
                    reply.prompt_tokens,
                    reply.completion_tokens,
                )
                if cache is not None:
                    cache.put(
                        key,
                        reply.content,
                        judge=identity,
                        sampling=self.sampling,
                        prompt_hash=digest,
                        paid_by=payer.name if payer else "",
                        paid_in=payer.attempt if payer else "",
                        attempts=attempts,
                        prompt_tokens=reply.prompt_tokens,
                        completion_tokens=reply.completion_tokens,
                    )
            except ChatError as e:
                attempts = e.attempts
                done = Completion(
                    None,
                    f"{e.kind}: {e.detail}"[:500],
                    None,
                    e.attempts,
                    False,
                    self.model,
                    digest,
                    e.prompt_tokens,
                    e.completion_tokens,
                )
            with lock:
                out[i] = done
                self.requests_made += attempts
                self.tokens_used = [
                    self.tokens_used[0] + (done.prompt_tokens or 0),
                    self.tokens_used[1] + (done.completion_tokens or 0),
                ]
                failures[0] += done.failure is not None
                unparsed[0] += done.text is not None and parse_judge_output(done.text).failure is not None
                bar.set_postfix(failed=failures[0], unparseable=unparsed[0], cached=hits, refresh=False)
                bar.update(1)

        in_flight = max(1, self.concurrency) * len(self.endpoints)
        limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
        try:
            with on_stall(cancelled.set), probing(self.liveness), httpx.Client(limits=limits) as client:
                if todo:
                    pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="judge")
                    try:
                        _wait_all([pool.submit(one, job) for job in todo])
                    finally:  # a stalled stage does not wait for the requests still hanging
                        pool.shutdown(wait=not cancelled.is_set(), cancel_futures=True)
        finally:
            bar.close()
        return out  # type: ignore[return-value]

    def liveness(self) -> str:
        """What each server says when asked GET /models: down (refused), not answering, or up (then its chat
        completions are what hangs: an engine behind the API that died or is overloaded)."""
        return "; ".join(server_liveness(url, self.api_key) for url in self.endpoints)


def server_liveness(base_url: str, api_key: str = "", timeout_seconds: float = 5.0) -> str:
    url = base_url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_seconds)
    except httpx.ConnectError as e:
        return f"judge server at {base_url} is down: it refused the connection ({e})"
    except httpx.TimeoutException:
        return f"judge server at {base_url} is not answering: GET /models got no reply in {timeout_seconds:g} s"
    except httpx.HTTPError as e:
        return f"judge server at {base_url}: GET /models failed: {type(e).__name__}: {e}"
    return (
        f"judge server at {base_url} is up (GET /models: HTTP {response.status_code}) but its chat completions have "
        "not answered: the model behind it may have died or be overloaded"
    )


def _wait_all(futures: list) -> None:
    """Wait for every future, looking up every 0.2 s so that a stalled stage's cancellation lands here; the first
    worker's exception is raised."""
    pending = set(futures)
    while pending:
        check_stalled()
        _, pending = wait(pending, timeout=0.2)
    for future in futures:
        future.result()


def _progress(total: int, enabled: bool):
    from refiner_core.runtime.progress import progress_bar

    return progress_bar(total, "judge", "pair", disable=None if enabled and total else True)  # None: on a terminal


def api_key_from_env(name: str) -> str:
    if not name:
        return ""
    key = os.environ.get(name)
    if key is None:
        raise ConfigError(f"judge.openai.api_key_env names {name!r}, but that environment variable is not set")
    return key


def listed_models(base_url: str, api_key: str, timeout_seconds: float) -> list[dict]:
    """The entries of GET {base_url}/models; ConnectionError when the server cannot be reached or answers
    something else."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=min(timeout_seconds, 30.0))
        response.raise_for_status()
        entries = response.json().get("data", [])
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise ConnectionError(
            f"judge server at {base_url} did not list its models (GET /models): {type(e).__name__}: {e}"
        ) from None
    if not isinstance(entries, list) or not all(isinstance(m, dict) for m in entries):
        raise ConnectionError(f"judge server at {base_url}: GET /models is not an OpenAI model list")
    return entries


def same_weights(model: str, base_urls: list[str], api_key: str, timeout_seconds: float) -> None:
    """Refuse servers that do not all list `model` with the same reported weights: their judgments would mix."""
    cards = {}
    for url in base_urls:
        card = next((m for m in listed_models(url, api_key, timeout_seconds) if m.get("id") == model), None)
        if card is None:
            raise ValueError(
                f"judge server at {url} does not list {model!r} (GET /models); every server in "
                "judge.openai.base_url and judge.openai.more_base_urls must serve the same model"
            )
        cards[url] = {k: card.get(k) for k in REPORTED_IDENTITY_FIELDS}
    if len({json.dumps(c, sort_keys=True) for c in cards.values()}) > 1:
        raise ValueError(
            f"judge servers report different weights for {model!r}: "
            + "; ".join(f"{url}: {card}" for url, card in cards.items())
        )


def make_openai_judge(
    model_path: str, judge: JudgeConfig, dtype: str = "float32", precision: str = "fp32"
) -> OpenAIJudge:
    """`model_path` (the located judge checkpoint) is not used: the server holds the model."""
    if judge.mode != "json":
        raise ConfigError(f"judge.engine 'openai' supports judge.mode 'json' only, not {judge.mode!r}")
    api = judge.openai
    api_key = api_key_from_env(api.api_key_env)
    base_url, timeout = api.base_url or OpenAIJudgeConfig.base_url, float(api.timeout_seconds)
    model, listed = api.api_model, None
    if not model:  # the first model the server lists
        try:
            listed = listed_models(base_url, api_key, timeout)
        except ConnectionError as e:
            raise ConnectionError(f"{e}. Start one with `refiner judge serve MODEL`, or set api.api_model.") from None
        if not listed or "id" not in listed[0]:
            raise ConnectionError(f"judge server at {base_url} lists no models; set api.api_model")
        model = listed[0]["id"]
    more = tuple(api.more_base_urls)
    if more:
        same_weights(model, [base_url, *more], api_key, timeout)
    return OpenAIJudge(
        base_url=base_url,
        more_base_urls=more,
        model=model,
        api_key=api_key,
        concurrency=api.concurrency,
        timeout_seconds=timeout,
        policy=RetryPolicy(api.max_retries, api.backoff_seconds, api.backoff_max_seconds),
        request_budget=api.request_budget,
        temperature=api.temperature,
        max_tokens=judge.max_new_tokens,
        cache=open_cache(api.cache_path) if api.cache else None,
        cache_namespace=api.cache_namespace,
        listed=listed,
        max_requests_per_minute=api.max_requests_per_minute,
        max_tokens_per_minute=api.max_tokens_per_minute,
    )
