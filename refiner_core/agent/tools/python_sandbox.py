"""Run model-written Python in a bubblewrap sandbox: the agent's code-interpreter tool.

Each call starts a fresh interpreter under `bwrap` with
- no network: a private network namespace holding only its own loopback (the host's loopback services,
  abstract Unix sockets and every outside address are unreachable);
- a read-only root assembled from /usr (and the /bin, /lib, /sbin links to it), the loader cache and the
  interpreter's own installation (its prefix and, for a virtual environment, the base prefix). Nothing else of
  the host exists inside: not the repository, not /home or /root, not /etc beyond the loader cache;
- a private writable /tmp (tmpfs of `tmp_bytes`), the working folder, discarded after the call;
- a scrubbed environment (PATH, HOME=/tmp, LANG only), no stdin, and private PID, IPC and UTS namespaces: the
  code sees only its own processes and cannot signal the host's;
- rlimits set by `prlimit` before bwrap starts: CPU seconds (SIGXCPU, then SIGKILL one second later), address
  space, processes and the size of any file written;
- when the parent runs as root, the code runs as an unprivileged uid (one per concurrent slot) with no
  capabilities and no_new_privs: the kernel does not enforce RLIMIT_NPROC for root, and an unprivileged uid
  cannot read root-only files even where they are visible;
- a wall-clock timeout that kills bwrap's whole process group; with it dies the sandbox's PID namespace and
  every process left in it (a detached child cannot outlive the call);
- stdout and stderr each kept up to `max_output_bytes` (the rest is read and dropped, and counted).

What it does NOT protect against (do not run it on a machine where these matter):
- kernel bugs: the sandbox is namespaces + rlimits on a shared kernel, not a virtual machine;
- CPU and memory contention: limits are per process; a call may still use up to `max_processes` processes,
  each with `cpu_seconds` of CPU and `memory_bytes` of address space, until the wall-clock timeout;
- disk space outside the rlimit: /tmp is RAM-backed (tmpfs, capped by `tmp_bytes`);
- information readable in the bound paths: /usr and the Python installation are readable, including any
  secrets someone put there; the kernel's view (/proc/cpuinfo, uname) is not hidden;
- timing side channels and covert channels between concurrent calls;
- when the parent is not root: bwrap runs in an unprivileged user namespace, the code keeps the caller's uid,
  and RLIMIT_NPROC counts every process of that user (set `max_processes` above what the user already runs);
- nested user namespaces are not disabled when the parent is root (read-only bind mounts stay locked
  read-only inside them).

Where bubblewrap is missing or cannot create namespaces (some containers forbid it), `check_sandbox` raises
SandboxUnavailable with the reason and the fix; the tool never falls back to running code unsandboxed.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from refiner_core.agent.tools.base import ToolResult

INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; scripts/setup.sh does it when "
                "run as root)")


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot run here; code is never run without it."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_bytes: int = 1 << 30
    max_processes: int = 32
    max_file_bytes: int = 16 << 20
    tmp_bytes: int = 64 << 20
    max_output_bytes: int = 4096
    max_code_bytes: int = 64 << 10


@dataclass
class ExecResult:
    status: str  # 'ok' | 'error' (non-zero exit) | 'timeout' | 'cpu_limit' | 'file_size_limit' | 'killed:SIG...'
    exit_code: int | None  # None when the wall-clock timeout killed it
    stdout: str
    stderr: str
    stdout_bytes: int  # produced, before truncation
    stderr_bytes: int
    seconds: float

    @property
    def truncated(self) -> bool:
        return self.stdout_bytes > len(self.stdout.encode()) or self.stderr_bytes > len(self.stderr.encode())


def _program(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        hint = INSTALL_HINT if name == "bwrap" else "install util-linux"
        raise SandboxUnavailable(f"the Python tool needs {name}, which is not on PATH: {hint}")
    return path


class _Capped:
    """Reads a pipe to the end, keeping the first `limit` bytes and counting the rest."""

    def __init__(self, pipe, limit: int):
        self.kept = bytearray()
        self.total = 0
        self.thread = threading.Thread(target=self._read, args=(pipe, limit), daemon=True)
        self.thread.start()

    def _read(self, pipe, limit: int) -> None:
        with pipe:
            for chunk in iter(lambda: pipe.read1(65536), b""):
                self.total += len(chunk)
                if len(self.kept) < limit:
                    self.kept.extend(chunk[: limit - len(self.kept)])

    def text(self) -> str:
        self.thread.join(timeout=5)
        text = self.kept.decode("utf-8", errors="replace")
        if self.total > len(self.kept):
            text += f"\n[output truncated: {self.total} bytes, first {len(self.kept)} shown]"
        return text


_LIMIT_SIGNALS = {signal.SIGXCPU: "cpu_limit", signal.SIGXFSZ: "file_size_limit"}


def _status(code: int | None, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if code == 0:
        return "ok"
    if code is not None and code > 128:  # bwrap reports a child killed by a signal as 128 + signal
        try:
            sig = signal.Signals(code - 128)
        except ValueError:
            return "error"
        return _LIMIT_SIGNALS.get(sig, f"killed:{sig.name}")
    return "error"


class PythonSandbox:
    """Runs code strings in fresh sandboxed interpreters, at most `concurrency` at once."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), interpreter: str = sys.executable,
                 concurrency: int = 4, uid_base: int = 61000):
        self.limits = limits
        self.interpreter = interpreter
        self.concurrency = max(1, concurrency)
        self.as_root = os.geteuid() == 0
        self._slots: queue.Queue[int] = queue.Queue()
        for slot in range(self.concurrency):
            self._slots.put(uid_base + slot)
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="sandbox")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def run_many(self, codes: list[str]) -> list[ExecResult]:
        """All calls of a step, `concurrency` at a time, results in input order."""
        return list(self._pool.map(self.run, codes))

    def run(self, code: str) -> ExecResult:
        if len(code.encode()) > self.limits.max_code_bytes:
            return ExecResult("error", None, "", f"code is longer than {self.limits.max_code_bytes} bytes", 0, 0, 0.0)
        uid = self._slots.get()
        try:
            return self._run(code, uid)
        finally:
            if self.as_root:  # the killed namespace's processes are reaped asynchronously: reuse a clean uid
                _wait_until_gone(uid)
            self._slots.put(uid)

    def command(self, code: str, uid: int) -> list[str]:
        lim = self.limits
        bwrap = _program("bwrap")  # first: the missing piece people are most likely to lack
        prlimit = [_program("prlimit"), f"--cpu={lim.cpu_seconds}:{lim.cpu_seconds + 1}", f"--as={lim.memory_bytes}",
                   f"--nproc={lim.max_processes}", f"--fsize={lim.max_file_bytes}", "--core=0", "--"]
        box = [bwrap, "--ro-bind", "/usr", "/usr"]
        for link in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):
            if os.path.islink(link):
                box += ["--symlink", os.readlink(link), link]
            elif os.path.isdir(link):
                box += ["--ro-bind", link, link]
        box += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        # The private /tmp first: an interpreter installed under /tmp (a checkout there) is bound on top of it.
        box += ["--perms", "1777", "--size", str(lim.tmp_bytes), "--tmpfs", "/tmp"]
        made: set[str] = {"/", "/usr", "/etc", "/tmp"}
        for root in _interpreter_roots(self.interpreter):
            if root == "/usr" or root.startswith("/usr/"):
                continue
            for parent in reversed(Path(root).parents):  # bwrap would create them 0700: unreadable as another uid
                if str(parent) not in made:
                    box += ["--perms", "0755", "--dir", str(parent)]
                    made.add(str(parent))
            box += ["--ro-bind", root, root]
            made.add(root)
        box += ["--dev", "/dev", "--proc", "/proc", "--chdir", "/tmp", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv",
                "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
                "--setenv", "LANG", "C.UTF-8"]
        if self.as_root:
            # Root's processes are exempt from RLIMIT_NPROC: the code runs as an unprivileged uid instead.
            box += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--",
                    _program("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                    "--bounding-set=-all", "--no-new-privs"]
        else:
            box += ["--unshare-user"]
        return [*prlimit, *box, "--", self.interpreter, "-I", "-B", "-c", code]

    def _run(self, code: str, uid: int) -> ExecResult:
        lim = self.limits
        t0 = time.monotonic()
        proc = subprocess.Popen(self.command(code, uid), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={}, start_new_session=True, close_fds=True)
        out, err = _Capped(proc.stdout, lim.max_output_bytes), _Capped(proc.stderr, lim.max_output_bytes)
        timed_out = False
        try:
            code_ = proc.wait(timeout=lim.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
            code_ = None
        finally:
            try:  # bwrap's group; its PID namespace, and every process left in it, dies with it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        return ExecResult(_status(code_, timed_out), code_, out.text(), err.text(), out.total, err.total,
                          time.monotonic() - t0)


def _wait_until_gone(uid: int, timeout: float = 5.0) -> None:
    """Wait (briefly) until no process of `uid` is left, so its process limit is whole for the next call."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _uid_has_processes(uid):
        time.sleep(0.02)


def _uid_has_processes(uid: int) -> bool:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(entry.path).st_uid == uid:
                    return True
            except OSError:
                continue
    return False


@lru_cache(maxsize=8)
def _interpreter_roots(interpreter: str) -> tuple[str, ...]:
    """Folders the interpreter needs, outermost only: its prefix (a virtual environment, bound at its own path so
    the interpreter finds pyvenv.cfg) and the base installation it runs from."""
    probe = subprocess.run([interpreter, "-I", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
                           capture_output=True, text=True, timeout=60, check=True)
    found = probe.stdout.splitlines()
    prefixes = sorted({os.path.abspath(p) for p in found} | {os.path.realpath(p) for p in found}, key=len)
    return tuple(p for i, p in enumerate(prefixes) if not any(p == q or p.startswith(q + "/") for q in prefixes[:i]))


_checked: dict[str, str] = {}


def check_sandbox(interpreter: str = sys.executable) -> None:
    """Fail with the reason and the fix unless a sandboxed interpreter runs here (checked once per process)."""
    key = f"{interpreter}|{shutil.which('bwrap')}"  # a changed PATH is checked again
    if _checked.get(key) == "ok":
        return
    box = PythonSandbox(SandboxLimits(wall_seconds=60.0, cpu_seconds=30), interpreter=interpreter, concurrency=1)
    try:
        result = box.run("print('sandbox-ok')")
    except SandboxUnavailable:
        raise
    except OSError as e:
        raise SandboxUnavailable(f"cannot start the Python sandbox ({e}): {INSTALL_HINT}") from e
    finally:
        box.close()
    if result.stdout.strip() != "sandbox-ok":
        raise SandboxUnavailable(
            f"bubblewrap is installed but cannot create the sandbox here (status {result.status}): "
            f"{result.stderr.strip()[:500]}. It needs user or mount namespaces (run as root, or enable "
            "kernel.unprivileged_userns_clone); the Python tool never runs code unsandboxed.")
    _checked[key] = "ok"


def python_tool_result(result: ExecResult) -> ToolResult:
    """The text the model sees for one run, and the record kept of it."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.status == "timeout":
        parts.append("error: the code ran out of time and was stopped")
    elif result.status == "cpu_limit":
        parts.append("error: the code used up its CPU time and was stopped")
    elif result.status not in ("ok", "error"):
        parts.append(f"error: the code was stopped ({result.status})")
    text = "\n".join(parts) if parts else "(no output)"
    return ToolResult(text=text, status=result.status, exit_code=result.exit_code, stdout=result.stdout,
                      stderr=result.stderr, seconds=result.seconds, failure=None)


class PythonTool:
    """The 'python' tool: {"code": "..."} runs in the sandbox; stdout (and stderr) come back to the model."""

    name = "python"
    description = ("Run Python 3 code in a sandbox (no network, no files kept between calls) and return what it "
                   "prints. Use print() to see results.")
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                  "required": ["code"]}

    def __init__(self, sandbox: PythonSandbox):
        self.sandbox = sandbox

    def run_many(self, arguments: list[dict]) -> list[ToolResult]:
        bad = [_bad_arguments(a) for a in arguments]
        runnable = [a["code"] for a, why in zip(arguments, bad) if why is None]
        ran = iter(self.sandbox.run_many(runnable))
        return [ToolResult(f"error: {why}", "invalid_call", failure=why) if why else python_tool_result(next(ran))
                for why in bad]

    def close(self) -> None:
        self.sandbox.close()


def _bad_arguments(arguments: dict) -> str | None:
    if "code" not in arguments:
        return f"missing_argument: 'code' (got {sorted(arguments)})"
    if not isinstance(arguments["code"], str):
        return f"wrong_type: 'code' must be a string, got {type(arguments['code']).__name__}"
    return None


def make_python_tool(settings: dict) -> PythonTool:
    """settings: the agent config's sandbox fields (sandbox_* names) and tool_concurrency."""
    check_sandbox()
    limits = SandboxLimits(
        cpu_seconds=settings.get("sandbox_cpu_seconds", SandboxLimits.cpu_seconds),
        wall_seconds=settings.get("sandbox_wall_seconds", SandboxLimits.wall_seconds),
        memory_bytes=settings.get("sandbox_memory_mb", SandboxLimits.memory_bytes >> 20) << 20,
        max_processes=settings.get("sandbox_max_processes", SandboxLimits.max_processes),
        max_file_bytes=settings.get("sandbox_max_file_mb", SandboxLimits.max_file_bytes >> 20) << 20,
        max_output_bytes=settings.get("sandbox_max_output_bytes", SandboxLimits.max_output_bytes),
    )
    return PythonTool(PythonSandbox(limits, concurrency=settings.get("tool_concurrency", 4)))
