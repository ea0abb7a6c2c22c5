"""How `refiner run` supervises a run in its folder: the Prefect server's life (a temporary one started beside
the imports, stopped with the run), signals (SIGTERM handled like Ctrl-C; neither ever lost inside a finalizer),
Prefect's failure reports kept off the terminal, and the one-line cause and exit code of a failed run."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import typer

from refiner_core.data.text_safety import visible

EXAMPLE_SQL = [
    "SELECT step, round(reward_mean, 3) AS reward, round(kl, 5) AS kl, round(loss, 4) AS loss FROM steps ORDER BY step",
    "SELECT r.source, r.title, round(avg(s.oriented_score), 3) AS mean, count(*) FILTER (WHERE s.failure IS NOT "
    "NULL) AS failures FROM judge_scores s JOIN rubrics r USING (run, prompt_id, rubric_id) GROUP BY ALL ORDER BY 1, 2",
    "SELECT prompt_id, sample_idx, reward, left(response_text, 60) AS response FROM rewards JOIN rollouts "
    "USING (run, step, prompt_id, sample_idx) WHERE step = 0 AND reward_version = 'train' ORDER BY reward DESC LIMIT 5",
]


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C so the run cleans up: its server stops, its lock is released."""


def _terminate(signum, frame) -> None:
    raise Terminated()


REDELIVERY_DELAY = 0.05  # seconds: the finalizer that dropped a signal's exception has returned by then


@contextlib.contextmanager
def interrupts_never_lost() -> Iterator[None]:
    """While inside, SIGTERM raises Terminated and SIGINT KeyboardInterrupt in the main thread, and neither signal
    is ever lost.

    CPython drops an exception that a signal handler raises while a finalizer, `__del__` or weakref callback runs
    (garbage collection runs them anywhere): it only reaches `sys.unraisablehook`. There a dropped Terminated or
    KeyboardInterrupt, or Prefect's TerminationSignal (its handler stands in for ours while a flow runs, then
    chains to it), has its signal sent again a moment later from a thread, so that it lands outside the callback.
    An exception that propagates never reaches the hook, so the cleanup it starts is not interrupted by a second
    one. A signal still awaiting redelivery when the block ends is raised there."""
    redelivery: dict[int, threading.Timer] = {}  # signal -> the timer sending it again; whoever pops it owns it

    def redeliver(sig: int) -> None:
        if redelivery.pop(sig, None) is not None:  # else the block ended first and raises it itself
            os.kill(os.getpid(), sig)

    def hook(unraisable) -> None:
        sig = _dropped_signal(unraisable.exc_value)
        if sig is None:
            previous_hook(unraisable)
        elif sig not in redelivery:
            timer = threading.Timer(REDELIVERY_DELAY, redeliver, args=(sig,))
            timer.daemon = True
            redelivery[sig] = timer
            timer.start()

    previous_hook = sys.unraisablehook
    previous_handler = signal.signal(signal.SIGTERM, _terminate)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGTERM, previous_handler)
        undelivered = {sig: redelivery.pop(sig) for sig in list(redelivery)}
        for timer in undelivered.values():
            timer.cancel()
    if signal.SIGTERM in undelivered:
        raise Terminated()
    if signal.SIGINT in undelivered:
        raise KeyboardInterrupt()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM are recorded while inside and delivered, each once, to the handlers in place as it ends.

    For imports of native modules whose initialisation calls back into Python: an exception a handler raises there
    cannot unwind through their C++ frames and the process aborts. Seen with triton, which torch._dynamo imports
    (SIGTERM in that window: "terminate called after throwing an instance of 'nanobind::python_error'", exit -6
    instead of 143, without the cleanup)."""
    received: list[int] = []
    watched = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda sig, frame: received.append(sig)) for sig in watched}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for sig in dict.fromkeys(received):
        signal.raise_signal(sig)


def _dropped_signal(exc: BaseException | None) -> int | None:
    """The signal whose handler raised `exc`: Terminated (SIGTERM), Prefect's TerminationSignal (that class exists
    only once prefect is imported) or KeyboardInterrupt (SIGINT); None for any other exception."""
    termination_signal = getattr(sys.modules.get("prefect.exceptions"), "TerminationSignal", ())
    if isinstance(exc, Terminated):
        return signal.SIGTERM
    if isinstance(exc, termination_signal):
        return exc.signal
    return signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None


def run_in_folder(cfg, folder: Path, refresh: bool, debug: bool, warn: Callable[[str], None]) -> None:
    """Run the flow for `cfg` in `folder` (its lock already held) and print its held-out table and catalog; a failed
    run prints its cause and exits 1, Ctrl-C exits 130, SIGTERM raises Terminated."""
    if cfg.run.prefect_home == "run":  # read by prefect at import time, below
        os.environ["PREFECT_HOME"] = str(folder / ".prefect")
    prefect_home_ready()
    if refresh:
        os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"
    from flows.prefect_server import launch_temporary_server, start_temporary_server, stop_temporary_server
    from flows.run_folder import PROCS_SUBDIR, start_run_log, stop_children_left_behind
    from refiner_core.runtime.heap import freeze_heap

    # Prefect's temporary server takes seconds to start: it does while this process imports torch and prefect.
    launched = None if "PREFECT_API_URL" in os.environ else launch_temporary_server(folder / PROCS_SUBDIR)
    with signals_deferred():  # the stages would import torch._dynamo (and so triton) under Prefect's handler
        import torch
        import torch._dynamo  # noqa: F401
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from flows.refiner import refiner_pipeline
    freeze_heap()  # the libraries just imported live as long as the run

    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    stop_children_left_behind(folder, warn)

    log_file = start_run_log(folder)  # the flow writes into it too, and writes recipe.yaml (flows/run_folder.py)
    failures = _route_logs(debug)
    typer.echo(f"run folder: {folder}\nlog: {log_file}", err=True)
    server = None
    try:
        api_url = PREFECT_API_URL.value()
        if not api_url:  # Prefect's temporary server, but one that cannot outlive this process
            server, api_url = start_temporary_server(folder / PROCS_SUBDIR, launched=launched)
        elif launched:  # the API URL came from a Prefect profile
            stop_temporary_server(launched[0], folder / PROCS_SUBDIR)
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            state = refiner_pipeline(recipe=cfg.to_dict(), run_dir=str(folder), return_state=True)
    except Terminated:
        raise
    except KeyboardInterrupt:
        typer.secho("interrupted: run the same command again to resume from the unfinished stage", err=True)
        raise typer.Exit(130) from None
    except Exception as e:  # the flow did not get to run (e.g. Prefect's server did not start)
        logging.getLogger("refiner").error("run failed", exc_info=True)
        _run_failed(_describe(e), failures, log_file, debug)
    finally:
        if server is not None:
            stop_temporary_server(server, folder / PROCS_SUBDIR)
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        _run_failed(
            _describe(error) if isinstance(error, BaseException) else f"{state.name}: {state.message}",
            failures,
            log_file,
            debug,
        )
    db = folder / "catalog.duckdb"
    if state.result().get("evals"):
        from refiner_core.eval.evaluate import format_table

        typer.echo(f"\nheld-out evaluation (SELECT * FROM evals):\n{visible(format_table(state.result()['evals']))}")
    typer.echo(f"\ncatalog: {db}\nexample queries:")
    for command in example_commands(folder):
        typer.echo(f"  {command}")
    typer.echo(f"or from Python: duckdb.connect({str(db)!r}, read_only=True)")


def example_commands(folder: Path) -> list[str]:
    """The example queries as shell commands that can be copied as they are: every word quoted where the shell
    would split or expand it (a run folder with a space or a quote in its name)."""
    me = sys.argv[0] if Path(sys.argv[0]).name == "refiner" else "refiner"
    return [shlex.join([me, "sql", str(folder), sql]) for sql in EXAMPLE_SQL[:2]]


def prefect_home_ready() -> None:
    """PREFECT_HOME (default ~/.prefect) exists, and the server keeps its memo store there: it would otherwise look
    for ~/.prefect/memo_store.toml even when PREFECT_HOME is elsewhere, and warn on a first run in a fresh home
    ('Unable to write to memo_store.toml ... FileNotFoundError')."""
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    if not ({"PREFECT_SERVER_MEMO_STORE_PATH", "PREFECT_MEMO_STORE_PATH"} & set(os.environ)):
        os.environ["PREFECT_SERVER_MEMO_STORE_PATH"] = str(home / "memo_store.toml")


_FAILED_STATE = re.compile(r"Finished in state (Failed|Crashed)")


class _Failures(logging.Filter):
    """Remembers which task runs failed; unless `show`, keeps Prefect's failure reports (tracebacks, failed-state
    lines) off the terminal, since the CLI states the cause once."""

    def __init__(self, show: bool) -> None:
        super().__init__()
        self.show = show
        self.task_runs: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        failed_state = bool(_FAILED_STATE.search(record.getMessage()))
        if failed_state and hasattr(record, "task_run_name"):
            self.task_runs.append(record.task_run_name)
        return self.show or not (record.exc_info or failed_state)


def _route_logs(debug: bool) -> _Failures:
    """The terminal gets progress, and failure details only with --debug (the run log has every line)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    failures = _Failures(show=debug)
    for console in consoles:
        console.addFilter(failures)
    return failures


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def _run_failed(cause: str, failures: _Failures, log_file: Path, debug: bool) -> None:
    where = f" in {failures.task_runs[0]}" if failures.task_runs else ""
    typer.secho(f"error: run failed{where}: {visible(cause)}", fg="red", err=True)
    if not debug:
        typer.secho(f"traceback and full log: {log_file} (or rerun with --debug)", err=True)
    typer.secho("fix the cause and run the same command again: finished stages are cached", err=True)
    raise typer.Exit(1)
