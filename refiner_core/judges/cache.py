"""The judge cache: one small JSON file per (judge identity, sampling settings, exact prompt) key.

The judge identity says who answers, not only what the model is called: for a served judge the base URL, the
served name, what the server reports about that name (vLLM's `root`, the folder it loaded) and
`judge.cache_namespace`. It is plain JSON, hashed with sorted keys, so keys are the same in every process.

Files are written atomically (temp file + rename), so two processes sharing the cache never see a partial entry;
two writers of one key write the same answer and the last rename wins. Only answers are stored: transport
failures are never cached (they are retried next time), while replies the parser rejects are (they are the
judge's answer to that exact prompt). Default location: $REFINER_HOME/judge-cache, or `judge.cache_path`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from refiner_core.models import refiner_home
from refiner_core.storage import json_hash, write_json


def default_cache_dir() -> Path:
    return refiner_home() / "judge-cache"


def prompt_hash(messages: list[dict]) -> str:
    """Hash of the exact judge prompt (the chat messages)."""
    return json_hash(messages)


def cache_key(judge_identity: dict, sampling: dict, prompt_digest: str) -> str:
    return json_hash({"judge": judge_identity, "sampling": sampling, "prompt": prompt_digest})


@dataclass
class JudgeCache:
    root: Path

    def _path(self, key: str) -> Path:
        return Path(self.root) / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict | None:
        path = self._path(key)
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return None  # unreadable entry: treated as a miss and overwritten
        return entry if isinstance(entry, dict) and isinstance(entry.get("content"), str) else None

    def put(self, key: str, content: str, **meta) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json({"key": key, "content": content, "created": time.time(), **meta}, path)

    def __len__(self) -> int:
        return sum(1 for _ in Path(self.root).glob("*/*.json"))


def open_cache(cache_path: str = "") -> JudgeCache:
    return JudgeCache(Path(cache_path).expanduser() if cache_path else default_cache_dir())
