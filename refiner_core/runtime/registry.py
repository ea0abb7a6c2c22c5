"""Name -> "module:factory" lookup for interchangeable backends, open to outside code.

Registry values are strings, imported only when chosen: importing refiner_core never imports vLLM or
DeepSpeed, and a missing optional backend fails only the run that asks for it. A recipe may also name a backend
that is not registered by its import path, `package.module:factory` (verl and prime-rl take the same), so a
judge, engine, learner, verifier or tool written outside this repository plugs in without editing it.
`problem` is the check preflight runs over every backend name before anything starts."""

from __future__ import annotations

import difflib
import importlib
import re
from typing import Any

IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def resolve(registry: dict[str, str], kind: str, name: str) -> Any:
    """The factory registered as `name`, or the one an import path `package.module:factory` names."""
    trouble = problem(registry, kind, name)
    if trouble:
        raise ValueError(f"{kind} {name!r}: {trouble}")
    module, _, attr = registry.get(name, name).partition(":")
    return getattr(importlib.import_module(module), attr)


def problem(registry: dict[str, str], kind: str, name: str) -> str | None:
    """Why `name` names no backend of `registry` (with the closest registered name), or None; `kind` (e.g.
    'judge engine') names the table in the message. An import path is
    imported to check that its factory exists: outside code is the user's, and importing it says at once whether
    it is there."""
    if name in registry:
        return None
    if not IMPORT_PATH.match(str(name)):
        close = difflib.get_close_matches(str(name), list(registry), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown {kind}{hint}; choose from {sorted(registry)} or give an import path 'package.module:factory'"
    module, _, attr = name.partition(":")
    try:
        imported = importlib.import_module(module)
    except Exception as e:  # the outside module's own import error, whatever it is
        return f"cannot import {module} ({type(e).__name__}: {e})"
    if not callable(getattr(imported, attr, None)):
        return f"{module} has no callable {attr!r}"
    return None
