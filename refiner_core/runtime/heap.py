"""Objects that live as long as their process, kept out of the garbage collector's full passes.

A full collection walks every tracked object. Once torch, transformers and prefect are imported that is ~600k
objects (twice that with vLLM or DeepSpeed), 0.3-0.4 s a pass on 2 CPU cores, and CPython starts one whenever the
long-lived objects have grown by a quarter; an explicit `gc.collect()` (an engine closed) is another. `gc.freeze()`
moves the objects alive now to a generation no collection walks. vLLM freezes its engine's heap after start-up the
same way (vllm/utils/gc_utils.py `freeze_gc_heap`).
"""

from __future__ import annotations

import atexit
import gc

_unfreeze_registered = False


def freeze_heap() -> None:
    """Collect what is garbage now, then keep every object still alive out of later full collections: call it once
    what stays alive to the process's end (imported modules, a model it trains throughout) is in place.

    As the interpreter exits the heap is unfrozen again, so that its teardown frees those objects: extensions built
    with nanobind (duckdb) report every object of theirs left unfreed as a leak on the terminal."""
    global _unfreeze_registered
    gc.collect()
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True
