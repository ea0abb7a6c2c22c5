"""Run model-written Python in a bubblewrap sandbox: the agent's code-interpreter tool.

Each call starts a fresh interpreter under `bwrap` with
- no network: a private network namespace holding only its own loopback (the host's loopback services,
  abstract Unix sockets and every outside address are unreachable);
- a read-only root assembled from /usr (and the /bin, /lib, /sbin links to it), the loader cache and the
  interpreter's own installation (its prefix and, for a virtual environment, the base prefix). Nothing else of
  the host exists inside: not the repository, not /home or /root, not /etc beyond the loader cache. The folders
  bwrap makes are read-only too, with or without root;
- a /dev of null, zero, full, random, urandom and tty only, read-only: no /dev/shm (no POSIX shared memory), no
  /dev/pts;
- a private writable /tmp (tmpfs of `tmp_bytes` and at most `tmp_inodes` files and folders: bwrap's tmpfs caps
  only bytes, so a launcher remounts it with an inode cap before the code starts), the working folder, discarded
  after the call. The launcher stays as the code's parent and reports its wait status (bwrap's exit code reads
  a signal N as 128 + N, as it would an exit code of the code's own);
- a scrubbed environment (PATH, HOME=/tmp, LANG, PYTHONHASHSEED only), no stdin, and private PID, IPC and UTS
  namespaces: the code sees only its own processes and cannot signal the host's;
- the same output for the same code in every run, so a seeded run (and a resumed one) repeats its conversations:
  string hashing is not randomized (PYTHONHASHSEED=0: a printed set of strings keeps its order) and neither is the
  address space (`setarch -R`: an object's repr, `<generator object ... at 0x...>`, keeps its address). Where the
  machine forbids turning address randomization off (a container's seccomp profile may), `fixed_addresses` is
  False and a warning says so once. Code that reads the clock or draws from `random` still varies;
- rlimits set by `prlimit` before bwrap starts: CPU seconds (SIGXCPU, then SIGKILL one second later), address
  space, processes and the size of any file written;
- a seccomp filter (classic BPF, built here) that fails with EPERM: the kernel keyring (add_key, request_key,
  keyctl: a key stored there would outlive the call and be read by the next one), memory that the address-space
  limit does not count (memfd_create, memfd_secret, SysV shmget/shmat and msgget), a user namespace of its own
  (unshare, clone with CLONE_NEWUSER; clone3 gets ENOSYS: in one the code could mount a tmpfs of any size), and
  every syscall of another ABI (i386 or x32 calls from an x86-64 process);
- when the parent runs as root, the code runs as an unprivileged uid with no capabilities and no_new_privs: the
  kernel does not enforce RLIMIT_NPROC for root, and an unprivileged uid cannot read root-only files even where
  they are visible. Each sandbox object claims its own uids (one per concurrent slot) with lock files under
  /run/refiner-sandbox-uids, skipping uids that are accounts or own processes, so two runs on one machine never
  share a process limit; the claim ends with `close()` or the process;
- a wall-clock timeout that kills bwrap's whole process group; with it dies the sandbox's PID namespace and
  every process left in it (a detached child cannot outlive the call);
- stdout and stderr each kept up to `max_output_bytes` (the rest is read and dropped, and counted).

What it does NOT protect against (do not run it on a machine where these matter):
- kernel bugs: the sandbox is namespaces + rlimits on a shared kernel, not a virtual machine;
- CPU and memory contention: limits are per process; a call may still use up to `max_processes` processes,
  each with `cpu_seconds` of CPU and `memory_bytes` of address space, until the wall-clock timeout;
- kernel memory no limit counts: pipe and socket buffers, up to the open-file limit of each process (no cgroup
  memory limit is set);
- disk space outside the rlimit: /tmp is RAM-backed (tmpfs, capped by `tmp_bytes`);
- information readable in the bound paths: /usr and the Python installation are readable, including any
  secrets someone put there; the kernel's view (/proc/cpuinfo, uname) is not hidden;
- timing side channels and covert channels between concurrent calls;
- when the parent is not root: bwrap runs in an unprivileged user namespace, the code keeps the caller's uid,
  and RLIMIT_NPROC counts every process of that user, other runs' sandboxes included (set `max_processes` above
  what the user already runs);
- other architectures than x86-64 and aarch64: there is no seccomp filter for them, and the sandbox refuses to
  run there.

Code the interpreter cannot be given (a NUL character, an unpaired surrogate that UTF-8 cannot encode, more than
`max_code_bytes`) never runs: the tool answers with an 'invalid_call' naming the reason.

Where bubblewrap is missing or cannot create namespaces (some containers forbid it), `check_sandbox` raises
SandboxUnavailable with the reason and the fix; the tool never falls back to running code unsandboxed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import platform
import pwd
import queue
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from refiner_core.agent.tools.base import ToolResult
from refiner_core.config import AgentConfig

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; scripts/setup.sh does it when run as root)"
)


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
    tmp_inodes: int = 4096  # files and folders in /tmp
    max_output_bytes: int = 4096
    max_code_bytes: int = 64 << 10


@dataclass
class ExecResult:
    status: str  # 'ok' | 'error' (non-zero exit) | 'timeout' | 'cpu_limit' | 'file_size_limit' | 'killed:SIG...'
    exit_code: int | None  # 128 + N for signal N (as a shell shows it); None when the wall-clock timeout killed it
    stdout: str
    stderr: str
    stdout_bytes: int  # produced, before truncation
    stderr_bytes: int
    seconds: float
    truncated: bool  # some of stdout or stderr was dropped (max_output_bytes)


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

# Syscall numbers the seccomp filter looks at, by architecture, with its AUDIT_ARCH_* value.
_SYSCALLS = {
    "x86_64": (
        0xC000003E,
        {
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "memfd_create": 319,
            "memfd_secret": 447,
            "shmget": 29,
            "shmat": 30,
            "msgget": 68,
            "unshare": 272,
            "clone": 56,
            "clone3": 435,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "memfd_create": 279,
            "memfd_secret": 447,
            "shmget": 194,
            "shmat": 196,
            "msgget": 186,
            "unshare": 97,
            "clone": 220,
            "clone3": 435,
        },
    ),
}
# Refused outright: the kernel keyring, memory the address-space limit does not count, new namespaces.
DENIED_SYSCALLS = (
    "add_key",
    "request_key",
    "keyctl",
    "memfd_create",
    "memfd_secret",
    "shmget",
    "shmat",
    "msgget",
    "unshare",
)
_X32_SYSCALL_BIT, _CLONE_NEWUSER = 0x40000000, 0x10000000
_EPERM, _ENOSYS = 1, 38
_SECCOMP_RET_ALLOW = 0x7FFF0000

# Runs first inside the sandbox, with CAP_SYS_ADMIN: remount /tmp (keeping nosuid and nodev) with at most argv[1]
# inodes, then run the rest of argv in a child and write its wait status to the file descriptor argv[2] (bwrap
# reports a child killed by a signal as 128 + signal, which an exit code of the code's own, sys.exit(152), would
# otherwise read as). mount(2) directly: util-linux mount refuses remounts to a non-root uid.
_LAUNCHER = """import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV, MS_REMOUNT = 2, 4, 32
if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_REMOUNT | MS_NOSUID | MS_NODEV, b"nr_inodes=" + sys.argv[1].encode()):
    sys.exit("sandbox launcher: cannot cap the inodes of /tmp: " + os.strerror(ctypes.get_errno()))
report = int(sys.argv[2])
os.set_inheritable(report, False)
child = os.fork()
if child == 0:
    try:
        os.execv(sys.argv[3], sys.argv[3:])
    finally:
        os._exit(127)
status = os.waitpid(child, 0)[1]
os.write(report, str(status).encode())
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""


@lru_cache(maxsize=2)
def seccomp_program(machine: str | None = None) -> bytes:
    """A classic-BPF seccomp filter, as `bwrap --seccomp FD` reads it: EPERM for DENIED_SYSCALLS, for clone with
    CLONE_NEWUSER (a user namespace of its own would give the code the capabilities to mount an uncapped tmpfs)
    and for every call of another ABI than the machine's own; ENOSYS for clone3, whose flags a filter cannot read
    (the C library then falls back to clone); everything else is allowed."""
    machine = machine or platform.machine()
    if machine not in _SYSCALLS:
        raise SandboxUnavailable(
            f"the Python sandbox has no seccomp filter for {machine}: it runs on {' and '.join(_SYSCALLS)} only"
        )
    arch, number = _SYSCALLS[machine]
    load, jump_eq, jump_ge, jump_set, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K
    # seccomp_data: nr at offset 0, arch at 4, the low half of args[0] at 16. A string names the next instruction;
    # jumps go forward only.
    assembly = [
        (load, 4),
        (jump_eq, arch, None, "deny"),
        (load, 0),
        *([(jump_ge, _X32_SYSCALL_BIT, "deny", None)] if machine == "x86_64" else []),  # x32 calls set this bit
        (jump_eq, number["clone3"], "enosys", None),
        (jump_eq, number["clone"], "clone", None),
        *[(jump_eq, number[name], "deny", None) for name in DENIED_SYSCALLS],
        (ret, _SECCOMP_RET_ALLOW),
        "clone",
        (load, 16),
        (jump_set, _CLONE_NEWUSER, "deny", None),
        (ret, _SECCOMP_RET_ALLOW),
        "deny",
        (ret, 0x00050000 | _EPERM),  # SECCOMP_RET_ERRNO | errno
        "enosys",
        (ret, 0x00050000 | _ENOSYS),
    ]
    at, n = {}, 0
    for entry in assembly:
        if isinstance(entry, str):
            at[entry] = n
        else:
            n += 1
    program, n = [], 0
    for entry in assembly:
        if isinstance(entry, str):
            continue
        code, k, *targets = entry
        jt, jf = (0 if label is None else at[label] - n - 1 for label in (targets or [None, None]))
        program.append(struct.pack("=HBBI", code, jt, jf, k))
        n += 1
    return b"".join(program)


def code_problem(code: str, max_bytes: int) -> str | None:
    """Why `code` cannot be handed to the interpreter (argv holds no NUL, UTF-8 no lone surrogate), or None."""
    nul = code.find("\0")
    if nul >= 0:
        return f"bad_code: the code holds a NUL character (at index {nul})"
    try:
        size = len(code.encode())
    except UnicodeEncodeError as e:
        return (
            f"bad_code: the code holds {code[e.start]!r}, an unpaired surrogate that UTF-8 cannot encode "
            f"(at index {e.start})"
        )
    if size > max_bytes:
        return f"code_too_long: {size} bytes, the limit is {max_bytes}"
    return None


def _status(code: int | None, timed_out: bool, wait_status: int | None) -> str:
    """The call's status from bwrap's exit code and, where the launcher reported it, the code's wait status
    (None: the launcher itself failed or was killed; bwrap's 128 + signal is read as a signal then)."""
    if timed_out:
        return "timeout"
    if wait_status is not None:
        if os.WIFEXITED(wait_status):
            return "ok" if os.WEXITSTATUS(wait_status) == 0 else "error"
        number = os.WTERMSIG(wait_status)
    elif code == 0:
        return "ok"
    elif code is not None and code > 128:
        number = code - 128
    else:
        return "error"
    try:
        sig = signal.Signals(number)
    except ValueError:
        return "error"
    return _LIMIT_SIGNALS.get(sig, f"killed:{sig.name}")


def _read_report(fd: int) -> int | None:
    """The wait status the launcher wrote, or None where it wrote none."""
    os.set_blocking(fd, False)  # bwrap waits for the launcher, which wrote before it exited: nothing to wait for
    try:
        text = os.read(fd, 64)
    except BlockingIOError:
        return None
    finally:
        os.close(fd)
    return int(text) if text.strip().isdigit() else None


class PythonSandbox:
    """Runs code strings in fresh sandboxed interpreters, at most `concurrency` at once."""

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        interpreter: str = sys.executable,
        concurrency: int = 4,
        uid_base: int = 61000,
    ):
        self.limits = limits
        self.interpreter = interpreter
        self.concurrency = max(1, concurrency)
        self.as_root = os.geteuid() == 0
        # As root, each slot runs as a uid of its own; otherwise the code keeps the caller's uid.
        self.uids, self._uid_locks = _claim_uids(uid_base, self.concurrency) if self.as_root else ((), [])
        self._slots: queue.Queue[int] = queue.Queue()
        for slot in self.uids or range(self.concurrency):
            self._slots.put(slot)
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="sandbox")
        self.fixed_addresses = addresses_can_be_fixed()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in self._uid_locks:
            os.close(fd)
        self._uid_locks = []

    def run_many(self, codes: list[str]) -> list[ExecResult]:
        """All calls of a step, `concurrency` at a time, results in input order."""
        return list(self._pool.map(self.run, codes))

    def run(self, code: str) -> ExecResult:
        """Run one code string; code with a `code_problem` is refused with ValueError (PythonTool checks first)."""
        problem = code_problem(code, self.limits.max_code_bytes)
        if problem:
            raise ValueError(problem)
        uid = self._slots.get()
        try:
            return self._run(code, uid)
        finally:
            if self.as_root:  # the killed namespace's processes are reaped asynchronously: reuse a clean uid
                _wait_until_gone(uid)
            self._slots.put(uid)

    def command(self, code: str, uid: int, seccomp_fd: int, report_fd: int) -> list[str]:
        lim = self.limits
        bwrap = _program("bwrap")  # first: the missing piece people are most likely to lack
        prlimit = [
            _program("prlimit"),
            f"--cpu={lim.cpu_seconds}:{lim.cpu_seconds + 1}",
            f"--as={lim.memory_bytes}",
            f"--nproc={lim.max_processes}",
            f"--fsize={lim.max_file_bytes}",
            "--core=0",
            "--",
        ]
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
        # A /dev of the harmless devices only, read-only with the rest of the root (no /dev/shm, no /dev/pts).
        # Not bwrap's --dev: without root it mounts devpts from a second user namespace, where the launcher
        # could not remount /tmp.
        box += ["--dir", "/dev"]
        for device in ("null", "zero", "full", "random", "urandom", "tty"):
            box += ["--dev-bind-try", f"/dev/{device}", f"/dev/{device}"]
        for name, target in (
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ):
            box += ["--symlink", target, f"/dev/{name}"]
        box += [
            "--proc",
            "/proc",
            "--remount-ro",
            "/",
            "--chdir",
            "/tmp",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/local/bin:/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--setenv",
            "PYTHONHASHSEED",
            "0",
            "--seccomp",
            str(seccomp_fd),
            "--cap-add",
            "CAP_SYS_ADMIN",
        ]  # for the launcher's remount only
        # bwrap's --size caps the bytes of /tmp but not its inodes: the launcher remounts it with an inode cap, then
        # setpriv drops every capability before the interpreter starts.
        launcher = [self.interpreter, "-I", "-S", "-B", "-c", _LAUNCHER, str(lim.tmp_inodes), str(report_fd)]
        drop = [_program("setpriv"), "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        if self.as_root:
            # Root's processes are exempt from RLIMIT_NPROC: the code runs as an unprivileged uid instead.
            box += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
            drop[1:1] = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        else:  # the caller's uid inside its own user namespace; CAP_SETPCAP lets setpriv empty the bounding set
            box += ["--unshare-user", "--cap-add", "CAP_SETPCAP"]
        # -P -s rather than -I, which would ignore PYTHONHASHSEED; bwrap cleared every other PYTHON* variable. -u:
        # what the code printed before a timeout, a signal or os._exit reaches the model (a pipe buffers it).
        fixed = [_program("setarch"), "-R"] if self.fixed_addresses else []
        interpreter = [self.interpreter, "-P", "-s", "-B", "-u", "-c", code]
        return [*prlimit, *box, "--", *launcher, *drop, "--", *fixed, *interpreter]

    def _run(self, code: str, uid: int) -> ExecResult:
        lim = self.limits
        t0 = time.monotonic()
        seccomp_read, seccomp_write = os.pipe()  # the filter is a few hundred bytes: the pipe holds it whole
        report_read, report_write = os.pipe()
        try:
            with os.fdopen(seccomp_write, "wb") as pipe:
                pipe.write(seccomp_program())
            proc = subprocess.Popen(
                self.command(code, uid, seccomp_read, report_write),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                start_new_session=True,
                close_fds=True,
                pass_fds=(seccomp_read, report_write),
            )
        except BaseException:
            os.close(report_read)
            raise
        finally:
            os.close(seccomp_read)
            os.close(report_write)
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
        stdout, stderr = out.text(), err.text()  # each joins its reader: the counts are final
        return ExecResult(
            _status(code_, timed_out, _read_report(report_read)),
            code_,
            stdout,
            stderr,
            out.total,
            err.total,
            time.monotonic() - t0,
            truncated=out.total > len(out.kept) or err.total > len(err.kept),
        )


UID_LOCK_DIR = "/run/refiner-sandbox-uids"
UID_SEARCH_SPAN = 4096


def _claim_uids(first: int, count: int) -> tuple[tuple[int, ...], list[int]]:
    """`count` uids from `first` on that no other sandbox (of any process) holds, that are no account and own no
    process; each held by an exclusive lock on its file, released when the returned descriptors close."""
    try:
        os.makedirs(UID_LOCK_DIR, mode=0o700, exist_ok=True)
    except OSError as e:
        raise SandboxUnavailable(f"cannot keep the sandbox uids' lock files in {UID_LOCK_DIR}: {e}") from e
    uids, locks = [], []
    for uid in range(first, first + UID_SEARCH_SPAN):
        if len(uids) == count:
            break
        if _is_account(uid):
            continue
        fd = os.open(os.path.join(UID_LOCK_DIR, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another sandbox holds it
            os.close(fd)
            continue
        if _uid_has_processes(uid):  # left over from a killed stage, or someone else's
            os.close(fd)
            continue
        uids.append(uid)
        locks.append(fd)
    if len(uids) < count:
        for fd in locks:
            os.close(fd)
        raise SandboxUnavailable(
            f"no {count} free sandbox uids in {first}..{first + UID_SEARCH_SPAN - 1}: too many "
            "sandboxes run on this machine"
        )
    return tuple(uids), locks


def _is_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


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


@lru_cache(maxsize=1)
def addresses_can_be_fixed() -> bool:
    """Whether `setarch -R` may turn address randomization off here; warns once where it may not."""
    setarch = shutil.which("setarch")
    works = setarch is not None and subprocess.run([setarch, "-R", "true"], capture_output=True).returncode == 0
    if not works:
        logging.getLogger(__name__).warning(
            "the Python tool cannot turn address randomization off here (%s): tool output that prints an "
            "object's address will differ between runs of the same seed",
            "setarch is not on PATH: install util-linux" if setarch is None else "setarch -R is refused",
        )
    return works


@lru_cache(maxsize=8)
def _interpreter_roots(interpreter: str) -> tuple[str, ...]:
    """Folders the interpreter needs, outermost only: its prefix (a virtual environment, bound at its own path so
    the interpreter finds pyvenv.cfg) and the base installation it runs from."""
    probe = subprocess.run(
        [interpreter, "-I", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
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
            "kernel.unprivileged_userns_clone); the Python tool never runs code unsandboxed."
        )
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
    elif result.status == "error" and not result.stderr:  # sys.exit(3), os._exit(2): nothing says it failed
        parts.append(f"error: the code exited with status {result.exit_code}")
    elif result.status not in ("ok", "error"):
        parts.append(f"error: the code was stopped ({result.status})")
    text = "\n".join(parts) if parts else "(no output)"
    return ToolResult(
        text=text,
        status=result.status,
        exit_code=result.exit_code,
        stdout=result.stdout,
        stderr=result.stderr,
        seconds=result.seconds,
        failure=None,
    )


class PythonTool:
    """The 'python' tool: {"code": "..."} runs in the sandbox; stdout (and stderr) come back to the model."""

    name = "python"
    description = (
        "Run Python 3 code in a sandbox (no network, no files kept between calls) and return what it "
        "prints. Use print() to see results."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source"}},
        "required": ["code"],
    }

    def __init__(self, sandbox: PythonSandbox):
        self.sandbox = sandbox
        self.max_seconds = sandbox.limits.wall_seconds  # then the call's processes are killed

    def run_many(self, arguments: list[dict]) -> list[ToolResult]:
        bad = [_bad_arguments(a, self.sandbox.limits.max_code_bytes) for a in arguments]
        runnable = [a["code"] for a, why in zip(arguments, bad) if why is None]
        ran = iter(self.sandbox.run_many(runnable))
        return [
            ToolResult(f"error: {why}", "invalid_call", failure=why) if why else python_tool_result(next(ran))
            for why in bad
        ]

    def close(self) -> None:
        self.sandbox.close()


def _bad_arguments(arguments: dict, max_code_bytes: int) -> str | None:
    if "code" not in arguments:
        return f"missing_argument: 'code' (got {sorted(arguments)[:10]})"
    if not isinstance(arguments["code"], str):
        return f"wrong_type: 'code' must be a string, got {type(arguments['code']).__name__}"
    return code_problem(arguments["code"], max_code_bytes)


def make_python_tool(settings: AgentConfig) -> PythonTool:
    """The python tool with the agent section's sandbox limits and tool_concurrency."""
    check_sandbox()
    limits = SandboxLimits(
        cpu_seconds=settings.sandbox_cpu_seconds,
        wall_seconds=settings.sandbox_wall_seconds,
        memory_bytes=settings.sandbox_memory_mb << 20,
        max_processes=settings.sandbox_max_processes,
        max_file_bytes=settings.sandbox_max_file_mb << 20,
        max_output_bytes=settings.sandbox_max_output_bytes,
    )
    return PythonTool(PythonSandbox(limits, concurrency=settings.tool_concurrency))
