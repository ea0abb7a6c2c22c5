"""Name -> "module:factory" lookup for interchangeable backends, open to outside code.

Registry values are strings, imported only when chosen: importing refiner_core never imports vLLM or
DeepSpeed, and a missing optional backend fails only the run that asks for it. A recipe may also name a backend
that is not registered by its import path, `package.module:factory` (verl and prime-rl take the same), so a
judge, engine, learner, verifier or tool written outside this repository plugs in without editing it.
`problem` is the check preflight runs over every backend name before anything starts."""

from __future__ import annotations

import difflib
import functools
import importlib
import re
from dataclasses import dataclass
from typing import Any

IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Backend:
    """What a backend table's entry is: its factory, and what the run does with what it builds."""

    factory: str  # "package.module:factory", imported only when a recipe chooses it
    in_process: bool = True  # holds its model in this process, so a run keeps one; False: a client of a server
    section: str = ""  # the recipe section of its own settings ('' = none but the table's section)


Registry = dict[str, "str | Backend"]  # a plain "module:factory" string is a Backend with the defaults


def backend(registry: Registry, name: str) -> Backend:
    """The entry of `name`; a name the table does not hold is an import path to outside code (built for each use:
    the run keeps only the table's own in-process backends)."""
    entry = registry.get(name, name)
    if isinstance(entry, Backend):
        return entry
    return Backend(entry, in_process=name in registry)


def resolve(registry: Registry, kind: str, name: str) -> Any:
    """The factory registered as `name`, or the one an import path `package.module:factory` names."""
    trouble = problem(registry, kind, name)
    if trouble:
        raise ValueError(f"{kind} {name!r}: {trouble}")
    module, _, attr = backend(registry, name).factory.partition(":")
    return getattr(importlib.import_module(module), attr)


def problem(registry: Registry, kind: str, name: str) -> str | None:
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


def outside_sources(value: Any) -> dict[str, str]:
    """{module: hash of its package's sources} for every import path `value` holds (any string in it, however
    nested) that names code outside this repository's hashed packages: a stage keyed by it is recomputed when that
    code is edited, as the code version does for refiner_core and tasks. An import path that does not import is
    left to preflight."""
    found: dict[str, str] = {}
    for text in _strings(value):
        if IMPORT_PATH.match(text):
            module = text.partition(":")[0]
            digest = _package_hash(module.partition(".")[0])
            if digest:
                found[module] = digest
    return found


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


@functools.cache
def _package_hash(top: str) -> str | None:
    """A hash of a top-level module's sources (every file of a package: the helpers a factory imports and the data
    files it reads count too); None for this repository's own packages (in the code version) and for what cannot
    be found."""
    import hashlib
    import importlib.util
    from pathlib import Path

    from refiner_core import HASHED_PACKAGES, add_sources

    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package (a namespace package, without __init__.py, has no origin)
        roots = [Path(folder).resolve() for folder in spec.submodule_search_locations]
    elif spec.origin and Path(spec.origin).is_file():
        roots = [Path(spec.origin).resolve()]
    else:
        return None
    if any(root in HASHED_PACKAGES for root in roots):
        return None
    digest = hashlib.sha256()
    for root in roots:
        add_sources(digest, root, every_file=True)
    return digest.hexdigest()[:16]
