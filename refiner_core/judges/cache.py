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

from pathlib import Path

from refiner_core.models import refiner_home
from refiner_core.runtime.http_chat import AnswerCache
from refiner_core.store.storage import json_hash


def default_cache_dir() -> Path:
    return refiner_home() / "judge-cache"


def prompt_hash(messages: list[dict]) -> str:
    """Hash of the exact judge prompt (the chat messages)."""
    return json_hash(messages)


def cache_key(judge_identity: dict, sampling: dict, prompt_digest: str) -> str:
    return json_hash({"judge": judge_identity, "sampling": sampling, "prompt": prompt_digest})


def open_cache(cache_path: str = "") -> AnswerCache:
    return AnswerCache(Path(cache_path).expanduser() if cache_path else default_cache_dir())
