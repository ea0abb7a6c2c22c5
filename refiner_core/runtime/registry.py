"""Name -> "module:factory" lookup for interchangeable backends.

Registry values are strings, imported only when chosen: importing refiner_core never imports vLLM or
DeepSpeed, and a missing optional backend fails only the run that asks for it."""

from __future__ import annotations

import importlib
from typing import Any


def resolve(registry: dict[str, str], kind: str, name: str) -> Any:
    """The factory registered as `name`; the one 'unknown X; choose from ...' error for every registry."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; choose from {sorted(registry)}")
    module, _, attr = registry[name].partition(":")
    return getattr(importlib.import_module(module), attr)
