"""Escapes tried against the Python sandbox; each test fails if the escape succeeds."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from refiner_core.agent.tools.python_sandbox import (
    PythonSandbox,
    PythonTool,
    SandboxLimits,
    SandboxUnavailable,
    addresses_can_be_fixed,
    check_sandbox,
)

LIMITS = SandboxLimits(
    cpu_seconds=2,
    wall_seconds=5.0,
    memory_bytes=512 << 20,
    max_processes=16,
    max_file_bytes=1 << 20,
    tmp_bytes=8 << 20,
    tmp_inodes=1000,
    max_output_bytes=2048,
)
# Syscall numbers the probes call through ctypes: add_key, request_key, keyctl, shmget, msgget, unshare, clone.
SYSCALLS = {"x86_64": (248, 249, 250, 29, 68, 272, 56), "aarch64": (217, 218, 219, 194, 186, 97, 220)}


@pytest.fixture(scope="module")
def box():
    check_sandbox()
    sandbox = PythonSandbox(LIMITS, concurrency=2)
    yield sandbox
    sandbox.close()


def processes_matching(marker: str) -> list[int]:
    """Host PIDs whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def processes_of_uid(uids: set[int]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            real_uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
            if real_uid in uids:
                found.append(int(entry.name))
    return found


def test_runs_code_and_returns_output(box):
    result = box.run("print(6 * 7)")
    assert (result.status, result.exit_code, result.stdout) == ("ok", 0, "42\n")
    failed = box.run("raise ValueError('bad input')")
    assert failed.status == "error" and failed.exit_code == 1 and "ValueError: bad input" in failed.stderr


def test_the_same_code_prints_the_same_in_every_call(box):
    """A seeded run repeats its conversations only if the tool does: set order and object addresses held fixed."""
    code = "print(list({f'name-{i}' for i in range(40)}))\nprint((n for n in ()))\nprint(object())"
    outputs = [box.run(code).stdout for _ in range(3)]
    sets, reprs = zip(*((out.splitlines()[0], out.splitlines()[1:]) for out in outputs))
    assert len(set(sets)) == 1, sets  # 40 strings in one order by chance: about 1 in 40!
    assert "<generator object" in reprs[0][0] and " at 0x" in reprs[0][1]
    if box.fixed_addresses:
        assert len(set(map(tuple, reprs))) == 1, reprs
    else:  # a machine that refuses `setarch -R`: the addresses vary, as the warning said
        assert len(set(map(tuple, reprs))) > 1, reprs


def test_a_machine_that_cannot_fix_addresses_is_warned(monkeypatch, caplog):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert addresses_can_be_fixed.__wrapped__() is False
    assert "address randomization" in caplog.text and "install util-linux" in caplog.text


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    # A generous wall clock: on a busy machine one CPU second can take several seconds of wall time.
    sandbox = PythonSandbox(SandboxLimits(cpu_seconds=1, wall_seconds=60.0), concurrency=1)
    try:
        result = sandbox.run("while True:\n    pass")
    finally:
        sandbox.close()
    assert result.status == "cpu_limit" and result.exit_code == 128 + 24  # SIGXCPU


def test_an_exit_code_above_128_is_the_codes_own_and_a_signal_is_named(box):
    """bwrap reports a child killed by signal N as 128 + N; the launcher reports the code's wait status beside it, so
    sys.exit(152) is an exit code (it read as SIGXCPU's cpu_limit) and a signal is still named. The report's file
    descriptor is closed before the code starts."""
    exited, signalled, plain, fds = box.run_many(
        [
            "import sys\nsys.exit(152)",
            "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)",
            "import sys\nsys.exit(3)",
            "import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')))",
        ]
    )
    assert (exited.status, exited.exit_code) == ("error", 152)
    assert (signalled.status, signalled.exit_code) == ("killed:SIGTERM", 128 + 15)
    assert (plain.status, plain.exit_code) == ("error", 3)
    assert fds.status == "ok" and json.loads(fds.stdout) == [0, 1, 2, 3]  # 3: the listing's own


def test_sleeping_code_is_stopped_by_the_wall_clock(box):
    t0 = time.monotonic()
    result = box.run("import time\ntime.sleep(60)")
    assert result.status == "timeout" and result.exit_code is None
    assert time.monotonic() - t0 < LIMITS.wall_seconds + 3


def test_fork_bomb_is_contained(box):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    t0 = time.monotonic()
    result = box.run(code)
    assert result.status in ("timeout", "cpu_limit")
    assert time.monotonic() - t0 < LIMITS.wall_seconds + 5
    if os.geteuid() == 0:  # the sandbox uids own no process once the call returned
        assert processes_of_uid(set(box.uids)) == []
    # The limit held: the sandbox can still run code, and this process can still fork.
    assert box.run("print('alive')").stdout == "alive\n"


def test_process_limit_refuses_forks_past_the_limit(box):
    code = (
        "import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
        "            time.sleep(5)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
        "    print('refused after', n, type(e).__name__)"
    )
    result = box.run(code)
    assert "refused after" in result.stdout, result
    assert int(result.stdout.split()[2]) < LIMITS.max_processes


def test_memory_bomb_gets_memory_error(box):
    result = box.run("chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))")
    assert result.status == "error" and "MemoryError" in result.stderr
    big = box.run("x = bytearray(4 << 30)")
    assert big.status == "error" and "MemoryError" in big.stderr


def test_no_connection_to_host_loopback(box):
    """The sandboxed code connects to a loopback listener and, were it to get through, sends a token. Other
    processes on this host (servers' health checks) may knock on the same port: only the token counts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    token = uuid.uuid4().hex
    received = []

    def accept():
        deadline = time.monotonic() + LIMITS.wall_seconds
        while time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    received.append(conn.recv(1024))
                except OSError:
                    received.append(b"")

    thread = threading.Thread(target=accept)
    thread.start()
    code = (
        f"import socket\ns = socket.socket()\ns.settimeout(2)\ntry:\n    s.connect(('127.0.0.1', {port}))\n"
        f"    s.sendall(b'{token}')\n    print('CONNECTED')\nexcept OSError as e:\n    print('blocked', e)"
    )
    result = box.run(code)
    thread.join()
    server.close()
    assert "blocked" in result.stdout and "CONNECTED" not in result.stdout
    assert not any(token.encode() in data for data in received), received


def test_no_connection_to_outside_addresses(box):
    code = (
        "import socket\nfor host in ('1.1.1.1', '8.8.8.8'):\n    s = socket.socket()\n    s.settimeout(2)\n"
        "    try:\n        s.connect((host, 53))\n        print('CONNECTED', host)\n    except OSError as e:\n"
        "        print('blocked', host, e.errno)\ntry:\n    socket.getaddrinfo('pypi.org', 443)\n"
        "    print('RESOLVED')\nexcept OSError:\n    print('no dns')"
    )
    result = box.run(code)
    assert result.stdout.count("blocked") == 2 and "no dns" in result.stdout
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout


def test_writes_outside_tmp_fail_and_tmp_is_private(box, tmp_path):
    target = tmp_path / "escaped.txt"
    code = (
        "import os, sys\nfor path in ['/usr/escaped', '/escaped', sys.prefix + '/escaped', "
        + repr(str(target))
        + "]:\n    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
        "    except OSError as e:\n        print('refused', path)\nopen('/tmp/scratch', 'w').write('kept?')\n"
        "print('tmp ok', sorted(os.listdir('/tmp')))"
    )
    result = box.run(code)
    assert "WROTE" not in result.stdout and result.stdout.count("refused") == 4
    # The private /tmp holds only what the code wrote, plus the read-only interpreter folders of a checkout that
    # lives under /tmp itself (bound there so the interpreter runs).
    interpreter_dirs = sorted(
        {p.parts[2] for p in map(Path, {sys.prefix, sys.base_prefix}) if p.parts[1:2] == ("tmp",)}
    )
    assert f"tmp ok {sorted(['scratch'] + interpreter_dirs)}" in result.stdout
    assert not target.exists() and not Path(sys.prefix, "escaped").exists() and not Path("/escaped").exists()
    # A fresh call starts from an empty /tmp.
    assert box.run("import os\nprint(sorted(os.listdir('/tmp')))").stdout == f"{sorted(interpreter_dirs)}\n"


def test_file_size_limit(box):
    result = box.run("f = open('/tmp/big', 'wb')\nfor _ in range(64):\n    f.write(b'x' * (1 << 20))\n    f.flush()")
    assert result.status in ("file_size_limit", "error")
    assert result.status == "file_size_limit" or "File too large" in result.stderr or "No space" in result.stderr


def test_environment_secrets_and_home_are_not_visible(box, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("REFINER_TEST_API_KEY", secret)
    home = Path.home()
    probe = home / f".refiner-sandbox-probe-{uuid.uuid4().hex}"
    probe.write_text(secret)
    try:
        code = (
            "import os, glob\nprint(dict(os.environ))\nfor pid in os.listdir('/proc'):\n"
            "    if pid.isdigit():\n        try:\n            print(open(f'/proc/{pid}/environ').read())\n"
            "        except OSError:\n            pass\n"
            f"for path in [{str(probe)!r}, '/etc/shadow', '/proc/1/root/etc/hostname']:\n    try:\n"
            "        print(open(path).read())\n    except OSError as e:\n        print('refused', path)\n"
            f"print('home', sorted(os.listdir({str(home)!r})) if os.path.isdir({str(home)!r}) else None)"
        )
        result = box.run(code)
    finally:
        probe.unlink()
    assert result.status == "ok", result
    assert secret not in result.stdout and secret not in result.stderr
    assert "REFINER_TEST_API_KEY" not in result.stdout
    assert f"refused {probe}" in result.stdout and "refused /etc/shadow" in result.stdout
    listing = next(line for line in result.stdout.splitlines() if line.startswith("home "))
    assert probe.name not in listing  # the home folder's files are not there


def test_huge_output_is_truncated(box):
    result = box.run("import sys\nsys.stdout.write('x' * 10_000_000)\nsys.stderr.write('e' * 100_000)")
    assert result.status == "ok"
    assert result.stdout_bytes == 10_000_000 and result.stderr_bytes == 100_000 and result.truncated
    assert len(result.stdout) < LIMITS.max_output_bytes + 200 and "output truncated" in result.stdout
    # a little over the limit is truncated too (the note and U+FFFD replacements made the text look longer)
    over = box.run(f"import sys\nsys.stdout.buffer.write(b'\\xff' * {LIMITS.max_output_bytes + 4})")
    assert over.stdout_bytes == LIMITS.max_output_bytes + 4 and over.truncated
    assert not box.run("print('short')").truncated
    flood = box.run("while True:\n    print('y' * 1000)")
    assert flood.status in ("timeout", "cpu_limit") and len(flood.stdout) < LIMITS.max_output_bytes + 200


def test_killing_the_parent_fails(box):
    me = os.getpid()
    code = (
        f"import os, signal\nfor pid in [{me}, os.getppid(), 1]:\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
        "        print('sent', pid)\n    except OSError as e:\n        print('refused', pid, type(e).__name__)\n"
        "try:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    print('broadcast refused')"
    )
    box.run(code)
    # This process (the stage) survived, and the sandbox still works.
    assert os.getpid() == me
    assert box.run("print('still here')").stdout == "still here\n"


def test_child_left_running_is_killed_with_the_call(box):
    marker = f"sandbox-leftover-{uuid.uuid4().hex}"
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)  # {marker}'], "
        "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\nprint('spawned')"
    )
    result = box.run(code)
    assert result.stdout == "spawned\n"
    time.sleep(0.5)
    assert processes_matching(marker) == []
    sleeper = f"sandbox-timeout-{uuid.uuid4().hex}"
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)  # {sleeper}'], "
        "start_new_session=True)\ntime.sleep(300)"
    )
    assert box.run(code).status == "timeout"
    time.sleep(0.5)
    assert processes_matching(sleeper) == []


def test_calls_run_concurrently_and_bounded():
    sandbox = PythonSandbox(SandboxLimits(wall_seconds=10.0), concurrency=2)
    try:
        t0 = time.monotonic()
        results = sandbox.run_many([f"import time\ntime.sleep(1.5)\nprint({i})" for i in range(4)])
        elapsed = time.monotonic() - t0
    finally:
        sandbox.close()
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]  # input order
    assert 3.0 <= elapsed < 5.5  # two at a time: two rounds of 1.5 s, not one and not four


def test_what_the_code_printed_before_it_was_stopped_or_exited_reaches_the_model(box):
    """The interpreter writes unbuffered: a pipe would hold what it printed until an exit that never comes (a
    timeout, a signal, os._exit). A failing exit with nothing on stderr says so: '(no output)' read as success."""
    from refiner_core.agent.tools.python_sandbox import python_tool_result

    stopped, killed, hard_exit, quiet_exit = (
        python_tool_result(r)
        for r in box.run_many(
            [
                "print('partial result: 42')\nimport time\ntime.sleep(60)",
                "import os, signal\nprint('before')\nos.kill(os.getpid(), signal.SIGKILL)",
                "import os\nprint('written')\nos._exit(2)",
                "import sys\nsys.exit(3)",
            ]
        )
    )
    assert stopped.text == "partial result: 42\nerror: the code ran out of time and was stopped"
    assert killed.text == "before\nerror: the code was stopped (killed:SIGKILL)"
    assert hard_exit.text == "written\nerror: the code exited with status 2"
    assert quiet_exit.text == "error: the code exited with status 3"


def test_python_tool_reports_bad_arguments_without_running():
    tool = PythonTool(PythonSandbox(LIMITS, concurrency=1))
    try:
        results = tool.run_many([{"code": "print(2 ** 10)"}, {"source": "print(1)"}, {"code": 5}])
    finally:
        tool.close()
    assert results[0].status == "ok" and results[0].text == "1024"
    assert results[1].status == "invalid_call" and results[1].failure.startswith("missing_argument")
    assert results[2].status == "invalid_call" and results[2].failure.startswith("wrong_type")


def test_missing_bubblewrap_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox = PythonSandbox(LIMITS, concurrency=1)
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
            sandbox.run("print(1)")
    finally:
        sandbox.close()


def test_recipe_with_the_python_tool_is_refused_before_running_without_bubblewrap(monkeypatch):
    from refiner_core.config import load_recipe
    from refiner_core.preflight import check_values

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "grpo-tcr.yaml"
    cfg = load_recipe(recipe, ["model.policy=tiny-qwen3", "rollout.agent.tools=[python, browser]"])
    assert [p for p in check_values(cfg) if "rollout.agent" in p] == [
        "rollout.agent.tools = 'browser': unknown tool; choose from ['python'] or give an import path "
        "'package.module:factory'"
    ]
    monkeypatch.setenv("PATH", "/nonexistent")
    problems = [p for p in check_values(load_recipe(recipe)) if "rollout.agent" in p]
    assert len(problems) == 1 and "bubblewrap" in problems[0] and "apt-get install -y bubblewrap" in problems[0]


def test_code_the_interpreter_cannot_be_given_is_an_invalid_call():
    tool = PythonTool(PythonSandbox(LIMITS, concurrency=1))
    try:
        results = tool.run_many(
            [
                {"code": "print('a\x00b')"},
                {"code": "x = '\ud800'"},
                {"code": "#" * (LIMITS.max_code_bytes + 1)},
                {"code": "print('still runs')"},
            ]
        )
    finally:
        tool.close()
    assert [r.status for r in results] == ["invalid_call"] * 3 + ["ok"]
    assert results[0].failure == "bad_code: the code holds a NUL character (at index 8)"
    assert results[1].failure.startswith("bad_code: the code holds '\\ud800'")
    limit = LIMITS.max_code_bytes
    assert results[2].failure == f"code_too_long: {limit + 1} bytes, the limit is {limit}"
    assert all(r.text == f"error: {r.failure}" for r in results[:3])
    assert all(r.text.encode() for r in results)  # what the model is shown encodes: no NUL, no lone surrogate
    assert "\x00" not in results[0].text and results[3].text == "still runs"


# ctypes calls of the raw syscalls; each prints '<name> <result or -errno>'.
SYSCALL_PROBE = (
    "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
    f"ADD_KEY, REQUEST_KEY, KEYCTL, SHMGET, MSGGET, UNSHARE, CLONE = {SYSCALLS!r}[os.uname().machine]\n"
    "def call(name, nr, *args):\n"
    "    ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a "
    "for a in args])\n"
    "    print(name, ret if ret >= 0 else -ctypes.get_errno())\n    return ret\n"
)
KEY_USER_KEYRING, KEYCTL_GET_KEYRING_ID, KEYCTL_READ = -4, 0, 11
STORE_KEY = SYSCALL_PROBE + (
    f"call('add_key', ADD_KEY, b'user', b'refiner-probe', b'secret-payload', 14, {KEY_USER_KEYRING})"
)
READ_KEY = SYSCALL_PROBE + (
    f"call('keyctl', KEYCTL, {KEYCTL_GET_KEYRING_ID}, {KEY_USER_KEYRING}, 0)\n"
    "key = call('request_key', REQUEST_KEY, b'user', b'refiner-probe', None, 0)\n"
    f"if key > 0:\n    buf = ctypes.create_string_buffer(64)\n    call('read', KEYCTL, {KEYCTL_READ}, key, buf, 64)\n"
    "    print(buf.value)"
)
HOLD_MEMORY = SYSCALL_PROBE + (
    "def attempt(name, action):\n    try:\n        action()\n        print(name, 'held')\n"
    "    except OSError as e:\n        print(name, 'refused', e.errno)\n"
    "attempt('memfd', lambda: os.memfd_create('held'))\n"
    "ipc_private, create = 0, 0o1600  # IPC_CREAT | 0600\n"
    "call('shmget', SHMGET, ipc_private, 1 << 20, create)\ncall('msgget', MSGGET, ipc_private, create)\n"
    "attempt('dev_shm', lambda: open('/dev/shm/held', 'wb').write(b'x'))\n"
    "attempt('dev', lambda: open('/dev/held', 'wb').write(b'x'))\n"
    "attempt('root', lambda: open('/held', 'wb').write(b'x'))\n"
    "from multiprocessing import shared_memory\n"
    "attempt('posix_shm', lambda: shared_memory.SharedMemory(create=True, size=1 << 20))"
)
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
# A user namespace of its own would give the code the capabilities to mount a tmpfs of any size.
NEW_USER_NAMESPACE = SYSCALL_PROBE + (
    f"call('unshare', UNSHARE, {CLONE_NEWUSER})\nif call('clone', CLONE, {CLONE_NEWUSER | SIGCHLD}, 0, 0, 0, 0) == 0:\n"
    "    os._exit(0)\nimport subprocess\n"
    "print('unshare_tool', subprocess.run(['unshare', '-Urm', 'true'], stderr=subprocess.DEVNULL).returncode)"
)
FILL_TMP = (
    "import os\nn = 0\ntry:\n    while n < 20000:\n        open(f'/tmp/f{n}', 'w').close()\n        n += 1\n"
    "    print('created', n)\nexcept OSError as e:\n    print('created', n, 'then errno', e.errno)"
)
EPERM, ENOSPC = 1, 28


def probe_results(stdout: str) -> dict[str, str]:
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in stdout.splitlines() if " " in line}


def test_kernel_keyring_is_closed(box):
    stored, read = box.run(STORE_KEY), box.run(READ_KEY)
    assert probe_results(stored.stdout) == {"add_key": f"-{EPERM}"}, stored
    assert probe_results(read.stdout) == {"keyctl": f"-{EPERM}", "request_key": f"-{EPERM}"}, read
    assert "secret-payload" not in read.stdout


def test_memory_outside_the_address_space_limit_cannot_be_held(box):
    result = box.run(HOLD_MEMORY)
    found = probe_results(result.stdout)
    assert found["shmget"] == found["msgget"] == f"-{EPERM}", result
    assert [name for name, outcome in found.items() if outcome == "held"] == [], result
    assert set(found) == {"memfd", "shmget", "msgget", "dev_shm", "dev", "root", "posix_shm"}


def test_no_user_namespace_of_its_own(box):
    result = box.run(NEW_USER_NAMESPACE)
    assert probe_results(result.stdout) == {"unshare": f"-{EPERM}", "clone": f"-{EPERM}", "unshare_tool": "1"}, result


def test_tmp_inodes_are_capped(box):
    t0 = time.monotonic()
    result = box.run(FILL_TMP)
    created = result.stdout.split()
    assert created[2:] == ["then", "errno", str(ENOSPC)], result
    assert int(created[1]) < LIMITS.tmp_inodes and time.monotonic() - t0 < LIMITS.wall_seconds
    assert box.run(FILL_TMP).stdout == result.stdout  # each call starts with a whole budget


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox uids are assigned only when the stage runs as root")
def test_another_runs_processes_do_not_use_up_this_runs_process_limit(box):
    """Two sandboxes stand for two runs on one machine: each has its own uids, so one filling its process limit
    leaves the other's forks alone."""
    other_run = PythonSandbox(LIMITS, concurrency=2)
    marker = f"fill-{uuid.uuid4().hex}"
    fill = (
        f"import os, time  # {marker}\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError:\n"
        "    print('full at', n)\n"
        "while True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        break"
    )
    filled = []
    try:
        filler = threading.Thread(target=lambda: filled.append(other_run.run(fill)))
        filler.start()
        deadline = time.monotonic() + 3
        while len(processes_matching(marker)) < LIMITS.max_processes and time.monotonic() < deadline:
            time.sleep(0.05)
        forked = box.run(
            "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('forked')"
        )
        filler.join()
    finally:
        other_run.close()
    assert filled[0].stdout.startswith("full at"), filled
    assert forked.stdout == "forked\n", forked
    assert set(box.uids).isdisjoint(other_run.uids)


def readable_by_everyone(path: Path) -> bool:
    return all(p.stat().st_mode & 0o005 == 0o005 for p in [path, *path.parents] if p.is_dir()) and (
        path.is_dir() or path.stat().st_mode & 0o004
    )


NOBODY = 65534
SYSTEM_PYTHON = Path("/usr/bin/python3")
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    os.geteuid() != 0 or not SYSTEM_PYTHON.exists() or not readable_by_everyone(REPO),
    reason="runs the sandbox as an unprivileged user: needs root to switch, a system Python and a "
    "repository every user can read",
)
def test_without_root_dev_is_read_only_and_the_limits_hold():
    """The stage run as an ordinary user: bwrap makes its own user namespace, and the code keeps that uid."""
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    if subprocess.run([*as_nobody, "bwrap", "--unshare-user", "--ro-bind", "/", "/", "true"]).returncode != 0:
        pytest.skip("unprivileged user namespaces are disabled here")
    script = (
        "import json, sys\nsys.path.insert(0, sys.argv[1])\n"
        "from refiner_core.agent.tools.python_sandbox import PythonSandbox, SandboxLimits\n"
        "box = PythonSandbox(SandboxLimits(tmp_inodes=500), interpreter=sys.executable, concurrency=1)\n"
        "print(json.dumps([box.as_root] + [box.run(code).stdout for code in sys.argv[2:]]))"
    )
    done = subprocess.run(
        [
            *as_nobody,
            str(SYSTEM_PYTHON),
            "-I",
            "-B",
            "-c",
            script,
            str(REPO),
            HOLD_MEMORY,
            STORE_KEY,
            FILL_TMP,
            NEW_USER_NAMESPACE,
            "import os\nprint(os.getuid())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    as_root, memory, key, tmp, namespace, uid = json.loads(done.stdout)
    assert (as_root, uid) == (False, f"{NOBODY}\n")
    assert [name for name, outcome in probe_results(memory).items() if outcome == "held"] == [], memory
    assert probe_results(memory)["dev"].startswith("refused") and len(probe_results(memory)) == 7
    assert probe_results(key) == {"add_key": f"-{EPERM}"}
    assert tmp.split()[2:] == ["then", "errno", str(ENOSPC)] and int(tmp.split()[1]) < 500
    assert probe_results(namespace) == {"unshare": f"-{EPERM}", "clone": f"-{EPERM}", "unshare_tool": "1"}
