"""The suite's file order: longest stored first, files without an entry before them, ties as collected."""

from __future__ import annotations

import json

from file_order import STORE, longest_first, stored_seconds


def test_longest_first_puts_unknown_files_then_the_longest_first():
    seconds = {"a.py": 1.0, "b.py": 30.0, "c.py": 30.0, "d.py": 0.5}
    assert longest_first(["a.py", "b.py", "new.py", "c.py", "d.py"], seconds) == [
        "new.py",
        "b.py",
        "c.py",
        "a.py",
        "d.py",
    ]


def test_stored_seconds_reads_the_store_and_an_absent_store_is_empty(tmp_path):
    assert stored_seconds(tmp_path / "absent.json") == {}
    path = tmp_path / "seconds.json"
    path.write_text(json.dumps({"measured_on": "x", "seconds": {"tests/test_a.py": 2.5}}))
    assert stored_seconds(path) == {"tests/test_a.py": 2.5}


def test_the_stored_files_exist():
    """A renamed or deleted test file's entry would linger and mislead the order."""
    from conftest import REPO

    missing = [f for f in stored_seconds(STORE) if not (REPO / f).is_file()]
    assert not missing, f"tests/file_seconds.json names files that are gone: {missing}"
