"""Test files longest first, from the seconds each took in a stored run (tests/file_seconds.json).

Under `--dist loadfile --no-loadscope-reorder` (scripts/run_tests.sh) xdist hands a worker the next file, in
collection order, whenever the worker runs low. Its default order (most tests first) starts the files of one or
two long end-to-end tests last, and the run ends with one worker idle while the other finishes them. Longest first
is the classic schedule for that: the short files fill in at the end. A file missing from the store (a new one)
counts as the longest, so it cannot be the one the run waits for. `--store-file-seconds` writes the seconds of the
files a run took (setup, call and teardown summed) into the store, keeping the entries of the other files that
still exist."""

from __future__ import annotations

import json
import os
import platform
import re
from collections import defaultdict
from pathlib import Path

import pytest

STORE = Path(__file__).with_name("file_seconds.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-file-seconds",
        action="store_true",
        help="write the seconds each test file took into tests/file_seconds.json (orders later runs' files)",
    )


def stored_seconds(path: Path = STORE) -> dict[str, float]:
    """file -> seconds; {} when nothing is stored yet."""
    try:
        return json.loads(path.read_text())["seconds"]
    except FileNotFoundError:
        return {}


def longest_first(files: list[str], seconds: dict[str, float]) -> list[str]:
    """`files` by stored seconds, descending; files without an entry first; ties keep their order."""
    unknown = float("inf")
    return sorted(files, key=lambda f: -seconds.get(f, unknown))


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(trylast=True)  # after other plugins' reordering: whole files move, each file's tests keep order
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[_file_of(item.nodeid)].append(item)
    items[:] = [item for f in longest_first(list(by_file), stored_seconds()) for item in by_file[f]]


def _cpu_name() -> str:
    try:
        return re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M).group(1)
    except (OSError, AttributeError):
        return platform.machine()


class _Timer:
    """On the process that reports (the xdist controller, or pytest alone): seconds per file and per worker."""

    def __init__(self) -> None:
        self.per_file: dict[str, float] = defaultdict(float)
        self.per_worker: dict[str, float] = defaultdict(float)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.per_file[_file_of(report.nodeid)] += report.duration
        self.per_worker[getattr(report, "node", None) and report.node.gateway.id or "main"] += report.duration

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter, config: pytest.Config) -> None:
        if len(self.per_worker) > 1:
            busy = ", ".join(f"{w} {s:.0f} s" for w, s in sorted(self.per_worker.items()))
            terminalreporter.write_line(f"test seconds per worker: {busy}")
        if config.getoption("--store-file-seconds") and self.per_file:
            stored = {**stored_seconds(), **{f: round(s, 1) for f, s in self.per_file.items()}}
            stored = {f: s for f, s in stored.items() if (config.rootpath / f).is_file()}  # gone: renamed, deleted
            record = {
                "measured_on": f"{_cpu_name()}, {os.cpu_count()} cores",
                "seconds": dict(sorted(stored.items())),
            }
            STORE.write_text(json.dumps(record, indent=1) + "\n")
            terminalreporter.write_line(f"stored the seconds of {len(self.per_file)} test files in {STORE}")


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(_Timer(), "refiner-file-timer")
