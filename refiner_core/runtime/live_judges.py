"""Judges a run keeps live across its steps: those that hold their model in this process (a served judge holds a
client, cheap to build), keyed by the judge model and its settings, closed with the run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refiner_core.config import JudgeConfig
from refiner_core.runtime.live import LOCK, run_of
from refiner_core.store.storage import json_hash


@dataclass
class KeptJudge:
    judge: Any

    def close(self) -> None:
        """The run ends: the judge's model engine, where it has one, is closed."""
        engine = getattr(self.judge, "engine", None)
        if engine is not None:
            engine.close()


def judge(
    run_dir: str | Path,
    model: dict,
    settings: JudgeConfig,
    dtype: str,
    precision: str,
    build: Callable[[], Any],
    in_process: bool,
) -> Any:
    """The judge `build()` makes, kept for the run when it holds its model in this process (`in_process`: its
    table entry says so; a served judge holds a client, cheap to build): keyed by the judge model's path and content
    hash, its settings, dtype and precision."""
    run = run_of(run_dir)
    if run is None or not in_process:
        return build()
    key = json_hash([model["path"], model["hash"], dataclasses.asdict(settings), dtype, precision])
    with LOCK:
        kept = run.judges.get(key)
    if kept is None:
        kept = KeptJudge(build())
        with LOCK:
            run.judges[key] = kept
    return kept.judge
