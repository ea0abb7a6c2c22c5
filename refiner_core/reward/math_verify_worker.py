"""math-verify in a process of its own, with a time limit per comparison.

Some answers make sympy compute for good: `\\boxed{10^{10^{10}}}` is evaluated exactly, in one C call that holds the
interpreter, so no thread can stop it and math-verify's own timeouts (SIGALRM) work only on a main thread, which a
Prefect task is not. Here each comparison runs in a child process (`python -m
refiner_core.reward.math_verify_worker`, JSON lines on stdin/stdout) that the kernel ends when it runs past its
limit (an alarm left at its default action ends the process even inside C code); the caller then gets no verdict
and a reason, and the next comparison starts a new child. A child whose parent is gone reads end-of-file and ends.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import weakref

LIMIT_SECONDS = 10  # one comparison; ordinary answers take milliseconds


def decide(target: str, gold: str) -> tuple[bool | None, str | None]:
    """math-verify's verdict on two texts as it reads them, or (None, why) when it cannot decide."""
    try:
        from math_verify import parse
        from math_verify import verify as mv_verify
    except ImportError:
        return None, "math-verify is not installed"
    try:
        # this process's main thread: math-verify's own timeouts are left off, the alarm of `serve` bounds the call
        gold_parsed = parse(gold, parsing_timeout=None)
        target_parsed = parse(target, parsing_timeout=None)
        if not gold_parsed or not target_parsed:
            return None, "math-verify could not parse " + ("the reference" if not gold_parsed else "the answer")
        return bool(mv_verify(gold_parsed, target_parsed, timeout_seconds=None)), None
    except Exception as e:  # a verifier bug must not decide a reward silently: the caller falls back, says why
        return None, f"math-verify failed: {type(e).__name__}: {e}"[:200]


def serve(limit: int) -> None:
    """The child's loop: one {"target", "gold"} line in, one {"decided", "detail"} line out."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the kernel ends the process at the alarm, whatever it runs
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning: this alarm is it
    replies, sys.stdout = sys.stdout, sys.stderr  # a library's print() must not come between the replies
    for line in sys.stdin:
        request = json.loads(line)
        signal.alarm(limit)
        decided, detail = decide(request["target"], request["gold"])
        signal.alarm(0)
        replies.write(json.dumps({"decided": decided, "detail": detail}) + "\n")
        replies.flush()


class MathVerifier:
    """The caller's side: one child per process, started on first use, replaced when it ended or ran too long."""

    def __init__(self, limit: int = LIMIT_SECONDS):
        self.limit = limit
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        mine = weakref.ref(self)
        # a forked copy starts a child of its own, with a free lock (a fork made while another thread compares
        # holds this one taken)
        os.register_at_fork(after_in_child=lambda: (me := mine()) is not None and me._forget_parents_child())

    def _forget_parents_child(self) -> None:
        self._lock = threading.Lock()
        self._proc = None  # the parent's: left to it

    def decide(self, target: str, gold: str) -> tuple[bool | None, str | None]:
        with self._lock:
            proc = self._child()
            try:
                proc.stdin.write(json.dumps({"target": target, "gold": gold}) + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], self.limit + 5)
                line = proc.stdout.readline() if ready else ""
            except OSError:  # the child ended while being written to
                line = ""
            try:
                reply = json.loads(line) if line else None
            except json.JSONDecodeError:
                reply = None
            if reply is None:
                self.close()
                why = f"no verdict within {self.limit} s" if not line else f"a reply that is no verdict: {line[:80]!r}"
                return None, f"math-verify gave {why} (stopped)"
            return reply["decided"], reply["detail"]

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.limit)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
        return self._proc

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
            self._proc = None


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else LIMIT_SECONDS)
