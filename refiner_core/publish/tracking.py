"""Experiment trackers (run.report_to): each step's metrics (the steps row), eval results and a sample of rollouts
go to TensorBoard, MLflow or Weights & Biases as well as to the catalog.

One small class per backend; a backend's package is imported only when the backend is chosen, so importing
refiner_core never imports tensorboard, mlflow or wandb. What each backend was sent is recorded in
RUN_DIR/tracking/<backend>.json (a ledger of items and their values' hashes): a resumed or cached rerun sends only
what is new, so no step is logged twice, a step recomputed with other values is sent again, and a step a failed
backend missed is sent with the next one. A backend that fails is a warning, never a
failed run. A backend stays open from one step to the next (one TensorBoard event file, one W&B run session per
run process) until `close_trackers` at the run's end.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from refiner_core.config import RunConfig

LEDGER_DIR = "tracking"
_OPEN: dict[tuple[str, str], object] = {}  # (run folder, backend) -> its tracker, open until close_trackers
SKIPPED_COLUMNS = ("run", "step", "checkpoint")
EVAL_METRICS = (
    "format_valid",
    "citation_valid",
    "cites_distractor",
    "supporting_recall",
    "judge_score",
    "reward",
    "stopped",
    "pass_at_1",
    "pass_at_k",
    "accuracy",
    "boxed",
    "mean_tokens",
    "tool_call_rate",
    "well_formed_calls",
    "tool_errors",
    "turns",
)


class TensorBoardTracker:
    """Event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR/tensorboard`)."""

    def __init__(self, run_dir: Path, run: str, settings: RunConfig, ledger: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def log_text(self, step: int, name: str, markdown: str) -> None:
        self.writer.add_text(name, markdown, step)

    def flush(self) -> None:
        self.writer.flush()  # readable by TensorBoard now, not only when the run ends

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    """One MLflow run per refiner run, in the experiment named after the run, at run.mlflow_tracking_uri or in
    RUN_DIR/mlruns (mlflow.db, artifacts/: `mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlruns/mlflow.db`); its
    ID and store are kept in the ledger, so a resumed run continues the same MLflow run."""

    def __init__(self, run_dir: Path, run: str, settings: RunConfig, ledger: dict) -> None:
        from mlflow.tracking import MlflowClient

        store = (run_dir / "mlruns").resolve()  # the default: an SQLite store (MLflow 3 refuses a plain folder)
        uri = settings.mlflow_tracking_uri or ledger.get("tracking_uri") or f"sqlite:///{store / 'mlflow.db'}"
        if uri.startswith(f"sqlite:///{store}"):
            store.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        if not ledger.get("id"):
            experiment = self.client.get_experiment_by_name(run)
            experiment_id = (
                experiment.experiment_id
                if experiment
                else self.client.create_experiment(
                    run,
                    artifact_location=None if settings.mlflow_tracking_uri else (store / "artifacts").as_uri(),
                )
            )
            ledger["id"] = self.client.create_run(experiment_id, run_name=run).info.run_id
            ledger["tracking_uri"] = uri
        self.run_id = ledger["id"]

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_text(self, step: int, name: str, markdown: str) -> None:
        self.client.log_text(self.run_id, markdown, f"{name}/step_{step:04d}.md")

    def flush(self) -> None:
        pass  # every call above is already stored

    def close(self) -> None:
        pass  # the MLflow run stays open for a resume; every call above is already stored


class WandbTracker:
    """A Weights & Biases run in RUN_DIR/wandb, offline unless WANDB_MODE says otherwise (`wandb sync` uploads it);
    resumed by the ID kept in the ledger."""

    def __init__(self, run_dir: Path, run: str, settings: RunConfig, ledger: dict) -> None:
        import wandb

        ledger.setdefault("id", secrets.token_hex(4))  # any string names a W&B run; kept for a resume
        self.run = wandb.init(
            project=run,
            name=run,
            id=ledger["id"],
            resume="allow",
            dir=str(run_dir),
            mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(silent=True, console="off"),
        )  # the run's own output stays ours
        # Each kind of item has its own step axis and no log() call passes step=: W&B drops a log(step=N) below its
        # own step counter, which every log() call advances, so explicit steps would lose the training steps
        # logged after an eval or a rollouts table.
        self.run.define_metric("train_step")
        self.run.define_metric("steps/*", step_metric="train_step")
        self.run.define_metric("eval_step")
        self.run.define_metric("eval/*", step_metric="eval_step")  # eval steps may lie behind the training step
        self.text_axes: set[str] = set()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        axis = "eval_step" if any(name.startswith("eval/") for name in metrics) else "train_step"
        self.run.log({**metrics, axis: step})

    def log_text(self, step: int, name: str, markdown: str) -> None:
        import wandb

        if name not in self.text_axes:
            self.run.define_metric(f"{name}_step")
            self.run.define_metric(name, step_metric=f"{name}_step")
            self.text_axes.add(name)
        self.run.log({name: wandb.Table(columns=["step", "markdown"], data=[[step, markdown]]), f"{name}_step": step})

    def flush(self) -> None:
        pass  # the run's writer process stores what it is sent

    def close(self) -> None:
        self.run.finish()


TRACKERS: dict[str, type] = {"tensorboard": TensorBoardTracker, "mlflow": MLflowTracker, "wandb": WandbTracker}
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "wandb": ("wandb", "wandb"),
}  # (module imported, package to install)


def tracker_problems(report_to: list) -> list[str]:
    """Preflight: unknown backends, and chosen ones whose package is not installed."""
    import importlib.util

    problems = []
    for name in report_to:
        if name not in TRACKERS:
            problems.append(f"run.report_to: {name!r} is not a tracker; choose from {sorted(TRACKERS)} ([] = none)")
        elif importlib.util.find_spec(PACKAGES[name][0]) is None:
            problems.append(
                f"run.report_to: {name!r} needs the {PACKAGES[name][1]} package, which is not installed "
                f"(pip install {PACKAGES[name][1]}), or leave {name!r} out of run.report_to"
            )
    return problems


def step_metrics(row: dict) -> dict[str, float]:
    """The numeric columns of a steps row, named steps/<column>."""
    return {
        f"steps/{k}": float(v)
        for k, v in row.items()
        if k not in SKIPPED_COLUMNS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def eval_metrics(summary: dict) -> dict[str, float]:
    """An eval summary row (refiner_core.eval.evaluate.summarize) as eval/<phase>/<mode>/<metric>."""
    prefix = f"eval/{summary['phase']}/{summary['mode']}"
    return {f"{prefix}/{m}": float(summary[m]) for m in EVAL_METRICS if summary.get(m) is not None}


def report(
    run_dir: Path | str,
    run: str,
    settings: RunConfig,
    *,
    steps: list[dict],
    evals: list[dict],
    rollouts: dict[int, str],
    warn: Callable[[str], None],
) -> dict[str, int]:
    """Send what each backend of settings.report_to has not been sent yet, or was sent with other values (a step
    recomputed, e.g. a rerun of the folder with another setting: sent again, with a warning, so the tracker's latest
    point is the catalog's): steps rows, eval summary rows and rollout samples ({step: markdown}). Returns {backend:
    items sent}; a backend that fails is reported to `warn` and skipped (what it took before failing is recorded,
    the rest is sent again next time)."""
    run_dir = Path(run_dir)
    items = (
        [(f"step {r['step']}", "metrics", r["step"], step_metrics(r)) for r in steps]
        + [(f"eval {e['step']} {e['phase']} {e['mode']}", "metrics", e["step"], eval_metrics(e)) for e in evals]
        + [(f"rollouts {step}", "text", step, markdown) for step, markdown in sorted(rollouts.items())]
    )
    sent = {}
    for name in settings.report_to:
        ledger_path = run_dir / LEDGER_DIR / f"{name}.json"
        ledger = json.loads(ledger_path.read_text()) if ledger_path.is_file() else {"sent": {}}
        if isinstance(ledger["sent"], list):  # a ledger of names alone: their values are taken as sent
            ledger["sent"] = {item: None for item in ledger["sent"]}
        done = ledger["sent"]  # item -> hash of the values sent (None: unknown, taken as current)
        pending = []
        for item in items:
            digest = _digest(item[3])
            if item[0] not in done or done[item[0]] not in (None, digest):
                pending.append((item, digest))
        if not pending:
            continue
        changed = [item[0] for item, _ in pending if item[0] in done]
        if changed:
            warn(
                f"run.report_to {name!r}: {', '.join(changed)} recomputed with other values since they were sent; "
                "sent again, so the tracker holds both (the catalog holds the current ones)"
            )
        key = (str(run_dir.resolve()), name)
        logged = 0
        try:
            if key not in _OPEN:
                _OPEN[key] = TRACKERS[name](run_dir, run, settings, ledger)
            tracker = _OPEN[key]
            for (label, what, step, value), digest in pending:
                if what == "metrics":
                    tracker.log_metrics(step, value)
                else:
                    tracker.log_text(step, "rollouts", value)
                done[label] = digest
                logged += 1
            tracker.flush()
        except Exception as e:  # noqa: BLE001 - a tracker never fails the run
            _close(key)  # the next attempt starts it afresh
            warn(
                f"run.report_to {name!r}: logging failed ({type(e).__name__}: {e}); the run goes on, and the "
                f"{len(pending) - logged} items it did not take are sent again with the next step"
            )
            if ledger.get("id") or logged:  # the tracker's run was created, or took items: the next attempt goes on
                _write_ledger(ledger, ledger_path)
            continue
        _write_ledger(ledger, ledger_path)
        sent[name] = len(pending)
    return sent


def _digest(value) -> str:
    """What an item holds, hashed: a step recomputed with other values is sent again. How long it took and what
    its checkpoint weighs are left out: a step recomputed alike (a damaged file, a checkpoint now written) is not."""
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if not k.endswith(("_seconds", "checkpoint_bytes"))}
    return hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=8).hexdigest()


def close_trackers(run_dir: Path | str) -> None:
    """Close the run's open trackers (its end: TensorBoard's file closed, the W&B run finished)."""
    folder = str(Path(run_dir).resolve())
    for key in [k for k in _OPEN if k[0] == folder]:
        _close(key)


def _close(key: tuple[str, str]) -> None:
    tracker = _OPEN.pop(key, None)
    try:
        if tracker is not None:
            tracker.close()
    except Exception:  # noqa: BLE001 - closing a broken tracker must not fail the run either
        pass


def _write_ledger(ledger: dict, path: Path) -> None:
    from refiner_core.store.storage import write_json

    write_json(ledger, path)
