"""The heap frozen once a process's long-lived objects are in place: left out of full collections while garbage
made later is still collected, and unfrozen as the interpreter exits, so that duckdb (nanobind) reports no leak."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import REPO

PROCESS = """
import gc
import duckdb
from refiner_core.runtime.heap import freeze_heap

class Node:
    pass

connection = duckdb.connect()
connection.sql("SELECT 42").fetchall()
kept = Node()
kept.me = kept  # a cycle alive to the end
{freeze}
walked = {{id(o) for o in gc.get_objects()}}
print("kept walked:", id(kept) in walked, "frozen:", gc.get_freeze_count() > 0)
garbage = Node()
garbage.me = garbage
del garbage
print("garbage collected:", gc.collect() >= 1)
"""


def _run(freeze: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(PROCESS.format(freeze=freeze))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_frozen_objects_are_not_walked_later_garbage_is_collected_and_exit_reports_no_leak():
    done = _run("freeze_heap()")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["kept walked: False frozen: True", "garbage collected: True"]
    assert "leaked" not in done.stderr, done.stderr


def test_a_heap_left_frozen_at_exit_is_reported_as_leaks_by_duckdb():
    """Why freeze_heap unfreezes at exit: the same process with a bare gc.freeze()."""
    done = _run("gc.freeze()")
    assert done.returncode == 0
    assert "nanobind: leaked" in done.stderr
