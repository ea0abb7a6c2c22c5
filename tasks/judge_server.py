"""The judge a judging stage (judge, evaluate, judge-anchors) scores with, and the judge server a run starts
itself (judge.openai.serve): started by the first judge stage that needs it, reused by the next steps, stopped by the
flow's end hooks (success, failure, crash, cancellation) or at exit. It serves the judge checkpoint as
`PREFIX-HASH` (judge.openai.api_model or the folder's name, then the content hash): the judge stage sends that name."""

from __future__ import annotations

import atexit
from pathlib import Path
from urllib.parse import urlsplit

from refiner_core.judges.base import judge_backend, make_judge
from refiner_core.judges.serve import JudgeServer, start_server, stop_server
from refiner_core.runtime import live_judges
from refiner_core.stage_settings import stage_view
from refiner_core.store.storage import read_rows

_SERVED: dict[str, JudgeServer] = {}  # base_url -> the server this process started


def stage_judge(run_dir: str, judge_model: dict, judge_cfg: dict, dtype: str, precision: str, log):
    """(settings, judge) of a judging stage: with judge.openai.serve the run's own server, asked by the name it serves
    the checkpoint under; the in-process judge the run keeps (run.keep_engines), else a new one."""
    settings = stage_view("judge", with_served_judge(judge_cfg, judge_model["path"], run_dir, log))
    build = lambda: make_judge(judge_model["path"], settings, dtype, precision)  # noqa: E731
    kept = judge_backend(settings.engine).in_process
    return settings, live_judges.judge(run_dir, judge_model, settings, dtype, precision, build, kept)


def rubrics_by_prompt(rubrics: dict) -> dict[str, list[dict]]:
    """The rubric rows of an ingest-rubrics manifest, by prompt."""
    by_prompt: dict[str, list[dict]] = {}
    for r in read_rows(rubrics["rubrics"]["path"]):
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    return by_prompt


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
        gpu_memory_utilization=openai_cfg["serve_gpu_memory_utilization"],
        extra_args=[str(arg) for arg in openai_cfg["serve_args"]],
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
