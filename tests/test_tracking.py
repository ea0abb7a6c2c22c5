"""run.report_to: steps rows, eval results and rollout samples reach TensorBoard and MLflow with the catalog's
values, once per step across reruns; a tracker that fails is a warning, not a failed run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import pytest

from refiner_core.config import RunConfig, load_recipe
from refiner_core.preflight import check_values
from refiner_core.publish.tracking import TRACKERS, close_trackers, report

STEPS = [
    {
        "run": "r",
        "step": s,
        "loss": 0.5 - 0.1 * s,
        "kl": 0.001 * s,
        "reward_mean": 1.25 + s,
        "response_tokens": 40 + s,
        "entropy": None,
        "checkpoint": f"checkpoints/step_{s + 1:04d}",
    }
    for s in range(3)
]
EVALS = [
    {
        "step": 2,
        "phase": "grpo",
        "mode": "sampled",
        "format_valid": 0.5,
        "citation_valid": 0.25,
        "judge_score": None,
        "reward": 3.5,
        "stopped": 1.0,
        "pass_at_1": 0.5,
        "k": 2,
        "pass_at_k": 0.75,
    }
]


@pytest.fixture(autouse=True)
def closed_at_the_end(tmp_path):
    yield
    close_trackers(tmp_path)  # as a run's end does


def _report(run_dir, backends, steps=STEPS, evals=EVALS, rollouts=None):
    warnings = []
    sent = report(
        run_dir,
        "r",
        RunConfig(report_to=backends),
        steps=steps,
        evals=evals,
        rollouts=rollouts or {2: "**best**: reward 3"},
        warn=warnings.append,
    )
    return sent, warnings


def test_tensorboard_event_files_hold_the_steps_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sent, warnings = _report(tmp_path, ["tensorboard"])
    assert warnings == [] and sent == {"tensorboard": 5}
    _report(tmp_path, ["tensorboard"], steps=STEPS + [{**STEPS[0], "step": 3, "loss": 0.125}])  # the next step
    # one event file for the run, readable while it is open
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("steps/loss")] == [
        (0, pytest.approx(0.5)),
        (1, pytest.approx(0.4)),
        (2, pytest.approx(0.3)),
        (3, pytest.approx(0.125)),
    ]
    assert [e.value for e in events.Scalars("steps/response_tokens")] == [40, 41, 42, 40]
    assert "steps/entropy" not in events.Tags()["scalars"]  # NULL columns are not logged
    assert [(e.step, e.value) for e in events.Scalars("eval/grpo/sampled/pass_at_k")] == [(2, 0.75)]
    assert "rollouts/text_summary" in events.Tags()["tensors"]


def test_mlflow_run_holds_the_steps_values_once_across_reruns(tmp_path):
    from mlflow.tracking import MlflowClient

    assert _report(tmp_path, ["mlflow"]) == ({"mlflow": 5}, [])
    assert _report(tmp_path, ["mlflow"]) == ({}, [])  # a cached rerun: nothing new is sent
    ledger = json.loads((tmp_path / "tracking" / "mlflow.json").read_text())
    client = MlflowClient(tracking_uri=ledger["tracking_uri"])
    history = client.get_metric_history(ledger["id"], "steps/reward_mean")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(0, 1.25), (1, 2.25), (2, 3.25)]
    assert [(m.step, m.value) for m in client.get_metric_history(ledger["id"], "eval/grpo/sampled/reward")] == [
        (2, 3.5)
    ]
    assert client.get_run(ledger["id"]).info.run_name == "r"
    artifacts = [a.path for a in client.list_artifacts(ledger["id"], "rollouts")]
    assert artifacts == ["rollouts/step_0002.md"]


def test_wandb_offline_run_holds_the_steps_values(tmp_path):
    """No network: the W&B run is written offline under RUN_DIR/wandb (`wandb sync` uploads it later); its history
    records, read back from the run file, hold the steps values."""
    assert _report(tmp_path, ["wandb"]) == ({"wandb": 5}, [])
    history = [h for h in _wandb_history(tmp_path) if "steps/loss" in h]
    assert [(h["train_step"], h["steps/loss"], h["steps/reward_mean"]) for h in history] == [
        (0, 0.5, 1.25),
        (1, 0.4, 2.25),
        (2, pytest.approx(0.3), 3.25),
    ]
    assert not any("steps/entropy" in h for h in history)  # NULL columns are not logged
    [table] = next((tmp_path / "wandb").glob("offline-run-*/files/media/table")).glob("rollouts_*.table.json")
    assert json.loads(table.read_text())["data"] == [[2, "**best**: reward 3"]]


def test_wandb_keeps_every_training_step_logged_after_evals_and_rollouts(tmp_path):
    """A report after each step, as a run sends them: an eval at step 0 and a rollouts table with every step come
    between the training steps, and W&B still keeps each step's metrics, on its own step axis."""
    steps = [{"run": "r", "step": s, "loss": 0.5 - 0.1 * s} for s in range(4)]
    evals = [
        {"step": 0, "phase": "base", "mode": "greedy", "reward": 1.0},
        {"step": 2, "phase": "grpo", "mode": "greedy", "reward": 2.0},
    ]
    for s in range(4):
        sent, warnings = _report(
            tmp_path, ["wandb"], steps=steps[: s + 1], evals=[e for e in evals if e["step"] <= s], rollouts={s: f"{s}"}
        )
        assert warnings == [] and sent["wandb"] >= 2
    history = _wandb_history(tmp_path)
    assert [(h["train_step"], h["steps/loss"]) for h in history if "steps/loss" in h] == [
        (0, 0.5),
        (1, 0.4),
        (2, pytest.approx(0.3)),
        (3, pytest.approx(0.2)),
    ]
    assert [(h["eval_step"], h[k]) for h in history for k in h if k.startswith("eval/")] == [
        (0, 1.0),
        (2, 2.0),
    ]
    assert [h["rollouts_step"] for h in history if "rollouts_step" in h] == [0, 1, 2, 3]


def _wandb_history(run_dir) -> list[dict]:
    """The history rows of the run's W&B run file, once the run is finished and the file complete."""
    close_trackers(run_dir)  # the run's end: the W&B run is finished
    ledger = json.loads((run_dir / "tracking" / "wandb.json").read_text())
    [run_file] = (run_dir / "wandb").glob(f"offline-run-*-{ledger['id']}/run-{ledger['id']}.wandb")
    # W&B's writer keeps the file's last 32 KiB block in memory until its stream closes, which happens in its service
    # process shortly after finish() returns (later still on a loaded machine): read the file once it holds the exit
    records = _wandb_records(run_file)
    deadline = time.monotonic() + 120
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)
        records = _wandb_records(run_file)
    assert any(r.WhichOneof("record_type") == "exit" for r in records), "the W&B run file was never completed"
    return [h for h in map(_history_row, records) if h]


def _wandb_records(run_file) -> list:
    """The records of a W&B run file: LevelDB-log blocks of 32 KiB (after a 7-byte ':W&B' header), each chunk a
    7-byte header (CRC, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) + protobuf bytes."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, block, chunks, records = run_file.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            records.append(record)
    return records


def _history_row(record) -> dict | None:
    """A history record's values by name; None for other records."""
    if record.WhichOneof("record_type") != "history":
        return None
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}


def test_a_failing_tracker_is_a_warning_and_is_retried_later(tmp_path, monkeypatch):
    class Broken(TRACKERS["tensorboard"]):
        def log_metrics(self, step, metrics):
            raise OSError("disk full")

    monkeypatch.setitem(TRACKERS, "tensorboard", Broken)
    sent, warnings = _report(tmp_path, ["tensorboard", "mlflow"])
    assert sent == {"mlflow": 5}  # the other tracker still gets everything
    assert len(warnings) == 1 and "'tensorboard'" in warnings[0] and "disk full" in warnings[0]
    monkeypatch.undo()
    assert _report(tmp_path, ["tensorboard", "mlflow"]) == ({"tensorboard": 5}, [])  # caught up, no duplicate


def test_preflight_refuses_unknown_or_missing_trackers():
    cfg = load_recipe(None, ["run.report_to=[tensorboard, neptune]"])
    assert any("'neptune' is not a tracker" in p for p in check_values(cfg))
    assert not any("report_to" in p for p in check_values(load_recipe(None, ["run.report_to=[mlflow]"])))
    wandb = check_values(load_recipe(None, ["run.report_to=[wandb]"]))
    if importlib.util.find_spec("wandb") is None:  # refused with the way out where it is not installed
        assert any("'wandb' needs the wandb package" in p and "pip install wandb" in p for p in wandb), wandb
    else:
        assert not any("report_to" in p for p in wandb)


def test_importing_refiner_core_imports_no_tracker_package():
    code = (
        "import sys, refiner_core.publish.tracking, refiner_core.preflight, refiner_core.publish.model_card; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'tensorboard', 'wandb')))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_a_tracker_failing_midway_keeps_what_it_took_and_a_recomputed_step_is_sent_again(tmp_path, monkeypatch):
    """A backend that failed on its third item had taken two, which were sent again (twice in the tracker); a
    step recomputed with other values (a rerun with another setting) was never sent again, so the tracker kept the
    old ones."""
    from mlflow.tracking import MlflowClient

    taken = []

    class FailsOnce(TRACKERS["mlflow"]):
        def log_metrics(self, step, metrics):
            if step == 2 and not taken:
                taken.append(step)
                raise OSError("connection reset")
            super().log_metrics(step, metrics)

    monkeypatch.setitem(TRACKERS, "mlflow", FailsOnce)
    sent, warnings = _report(tmp_path, ["mlflow"])
    assert sent == {} and "the 3 items it did not take are sent again" in warnings[0]
    assert _report(tmp_path, ["mlflow"]) == ({"mlflow": 3}, [])
    ledger = json.loads((tmp_path / "tracking" / "mlflow.json").read_text())
    history = MlflowClient(tracking_uri=ledger["tracking_uri"]).get_metric_history(ledger["id"], "steps/loss")
    assert sorted(m.step for m in history) == [0, 1, 2]  # each once

    recomputed = [STEPS[0], {**STEPS[1], "loss": 0.75}, STEPS[2]]
    sent, warnings = _report(tmp_path, ["mlflow"], steps=recomputed)
    assert sent == {"mlflow": 1} and "step 1 recomputed with other values" in warnings[0]
    history = MlflowClient(tracking_uri=ledger["tracking_uri"]).get_metric_history(ledger["id"], "steps/loss")
    assert [m.value for m in history if m.step == 1][-1] == 0.75
    assert _report(tmp_path, ["mlflow"], steps=recomputed) == ({}, [])
    timed = [{**row, "update_seconds": 9.5, "checkpoint_bytes": 1024} for row in recomputed]  # recomputed alike
    assert _report(tmp_path, ["mlflow"], steps=timed) == ({}, [])
