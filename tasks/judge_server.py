"""The judge server a run starts itself (judge.openai.serve): started by the first judge stage that needs it, reused
by the next steps, stopped by the flow's end hooks (success, failure, crash, cancellation) or at exit. It serves
the judge checkpoint as `PREFIX-HASH` (judge.openai.api_model or the folder's name, then the content hash): the
judge stage sends that name."""

from __future__ import annotations

import atexit
from pathlib import Path
from urllib.parse import urlsplit

from refiner_core.judges.serve import JudgeServer, start_server, stop_server

_SERVED: dict[str, JudgeServer] = {}  # base_url -> the server this process started


def with_served_judge(judge_cfg: dict, model_path: str, run_dir: str, log) -> dict:
    """The judge stage input `judge_cfg`, and when the run serves its judge (judge.openai.serve) the server started
    (ensure_judge_server) and its served name as judge.openai.api_model."""
    openai = judge_cfg["openai"]
    if not openai["serve"]:
        return judge_cfg
    return {**judge_cfg, "openai": {**openai, "api_model": ensure_judge_server(openai, model_path, run_dir, log)}}


def ensure_judge_server(openai_cfg: dict, model_path: str, run_dir: str, log) -> str:
    """Start the judge server at judge.openai.base_url unless this process already runs it; the served model name.
    `openai_cfg`: the judge.openai section."""
    url = openai_cfg["base_url"]
    running = _SERVED.get(url)
    if running is not None and running.proc.poll() is None:
        return running.model_name
    parts = urlsplit(url)
    log_path = Path(run_dir) / "logs" / f"judge-server-{parts.port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("starting the judge server for this run: %s at %s (log %s)", model_path, url, log_path)
    _SERVED[url] = start_server(
        model_path,
        host=parts.hostname,
        port=parts.port,
        served_name=openai_cfg["api_model"],
        startup_timeout=openai_cfg["serve_startup_timeout"],
        log_path=log_path,
    )
    log.info("judge server healthy: pid %d, model %s", _SERVED[url].pid, _SERVED[url].model_name)
    return _SERVED[url].model_name


def stop_judge_servers(*_hook_args) -> None:
    """Stop every judge server this process started (a Prefect flow state hook; also registered at exit)."""
    while _SERVED:
        _, server = _SERVED.popitem()
        stop_server(server)


atexit.register(stop_judge_servers)
