"""The judge cache: one small JSON file (an http_chat.AnswerCache entry) per (judge identity, sampling settings,
exact prompt) key.

The judge identity says who answers, not only what the model is called: for a served judge the base URL, the
served name, what the server reports about that name (vLLM's `root`, the folder it loaded) and
`judge.openai.cache_namespace`. It is plain JSON, hashed with sorted keys, so keys are the same in every process.

Only answers are stored: transport failures are never cached (they are retried next time), while replies the
parser rejects are (they are the judge's answer to that exact prompt). Default location: $REFINER_HOME/judge-cache,
or `judge.openai.cache_path`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from refiner_core.models import refiner_home
from refiner_core.runtime.http_chat import AnswerCache
from refiner_core.store.storage import json_hash

# Set by `fresh_answers`: judgments that measure the judge as it answers now (judge.anchor_every) read no cached
# answer (the same prompt's answer from step 0 would give 0 drift by construction) and write none (a cached answer
# stands for the judgment the run trained on; a rescore must find that one).
FRESH: ContextVar[bool] = ContextVar("judge_fresh_answers", default=False)


@contextmanager
def fresh_answers() -> Iterator[None]:
    """Judgments made in the block neither read nor write the judge cache."""
    token = FRESH.set(True)
    try:
        yield
    finally:
        FRESH.reset(token)


def default_cache_dir() -> Path:
    return refiner_home() / "judge-cache"


def prompt_hash(messages: list[dict]) -> str:
    """Hash of the exact judge prompt (the chat messages)."""
    return json_hash(messages)


def cache_key(judge_identity: dict, sampling: dict, prompt_digest: str) -> str:
    return json_hash({"judge": judge_identity, "sampling": sampling, "prompt": prompt_digest})


def open_cache(cache_path: str = "") -> AnswerCache:
    return AnswerCache(Path(cache_path).expanduser() if cache_path else default_cache_dir())
