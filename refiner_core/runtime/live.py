"""Engines that live for a run: the rollout engine, the torch learner and the in-process judge are built once and
kept across the run's steps, the rollout engine's weights synced in place when the policy changes.

A run opens its registry (`open_run`, keyed by run folder) and closes it at its end (`close_owned`, the flow's end
hooks): every engine is closed then, and nothing is shared between two runs of one process. A stage of a run with
no open registry (run.keep_engines false, or a stage called outside a flow) builds its engines and closes them
as before. Which weights an engine holds is tracked by the content hash of the checkpoint they came from (the
policy manifest's "hash"), and an engine is never handed out holding other weights than the hash asked for. The
registry is only memory: a new process starts empty and rebuilds from the checkpoints on disk. With
run.save_every > 1 the steps between saves exist only in the live learner (an "unsaved" policy manifest, named by
`weights_hash` of its state dict): a new process cannot have them, and recomputes them (tasks.stage).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refiner_core.config import EngineSettings, JudgeConfig
from refiner_core.models import Adapter, adapter_weights, checkpoint_adapter, lora_adapter
from refiner_core.store.storage import file_hash, json_hash

IN_PROCESS_JUDGES = ("transformers",)  # judges that hold a model in this process; a served judge holds a client


class StaleWeights(RuntimeError):
    """An engine was about to serve other weights than its stage's input manifest names."""


@dataclass
class _Learner:
    key: str
    learner: Any
    weights_hash: str  # the checkpoint its in-memory weights were saved as
    # For weights never written (run.save_every): writes them to the checkpoint their manifest names, with
    # WRITTEN_AT_CLOSE, when the run ends before a save (SIGTERM, Ctrl-C, a failed stage).
    save_at_close: Callable[[], Any] | None = None


@dataclass
class _Run:
    owner: str
    rollout: dict[str, Any] = field(default_factory=dict)  # key -> engine not in use (its .weights_hash says what)
    learner: _Learner | None = None
    judges: dict[str, Any] = field(default_factory=dict)
    lending: int = 0  # rollout engines copying the learner's weights now: the learner is not taken meanwhile


_RUNS: dict[str, _Run] = {}
# A rollout (grpo.async_steps) may run in a worker thread beside an update: every registry change holds this, and
# taking the learner waits on it while an engine copies the learner's weights.
_LOCK = threading.Condition()


def _folder(run_dir: str | Path) -> str:
    return str(Path(run_dir).resolve())


def open_run(run_dir: str | Path, owner: str = "") -> None:
    """Keep engines for the run in `run_dir` from now on (an earlier registry of that folder is closed first)."""
    close_run(run_dir)
    with _LOCK:
        _RUNS[_folder(run_dir)] = _Run(owner)


def _run(run_dir: str | Path) -> _Run | None:
    with _LOCK:
        return _RUNS.get(_folder(run_dir))


def close_run(run_dir: str | Path) -> None:
    with _LOCK:
        run = _RUNS.pop(_folder(run_dir), None)
    if run is not None:
        _close(run)


def close_owned(owner: str) -> None:
    """Close the registries opened by `owner` (a flow run id)."""
    with _LOCK:
        folders = [folder for folder, run in _RUNS.items() if run.owner == owner]
    for folder in folders:
        close_run(folder)


def close_all() -> None:
    with _LOCK:
        folders = list(_RUNS)
    for folder in folders:
        close_run(folder)


atexit.register(close_all)


def _close(run: _Run) -> None:
    for engine in run.rollout.values():
        engine.close()
    for judge in run.judges.values():
        _close_judge(judge)
    if run.learner is not None:
        _save_unsaved(run.learner)
        run.learner.learner.close()
    run.rollout.clear()
    run.judges.clear()
    run.learner = None


def _close_judge(judge) -> None:
    engine = getattr(judge, "engine", None)
    if engine is not None:
        engine.close()


def open_runs() -> list[str]:
    """Run folders with a registry open in this process."""
    with _LOCK:
        return list(_RUNS)


# ---- policies not written to disk (run.save_every) ----

WRITTEN_AT_CLOSE = "weights_hash.txt"  # in a checkpoint written when the run ended: the unsaved hash it holds
log = logging.getLogger(__name__)


def written_at_close(policy: dict) -> bool:
    """Whether weights a manifest names as never saved were written to its checkpoint when the run ended."""
    marker = Path(policy["path"]) / WRITTEN_AT_CLOSE
    return bool(policy.get("unsaved")) and marker.is_file() and marker.read_text().strip() == policy["hash"]


def _save_unsaved(live: _Learner) -> None:
    """The run ends holding weights no checkpoint has: write them, so a rerun resumes from them rather than
    recomputing the updates since the last save. A failure here is logged, not raised: the run is ending anyway,
    and the rerun recomputes."""
    if live.save_at_close is None:
        return
    try:
        path = live.save_at_close()
        log.warning("run ended between saves (run.save_every): weights %s written to %s", live.weights_hash[:20], path)
    except Exception as e:  # logged, not raised: the rerun recomputes those steps
        log.warning(
            "run ended between saves and its unsaved weights could not be written (%s: %s); a rerun "
            "recomputes the steps since the last checkpoint",
            type(e).__name__,
            e,
        )


def model_folder(policy: dict) -> str:
    """The folder holding the policy's architecture and tokenizer: its checkpoint, or for weights never saved
    the checkpoint (or base model) they were trained from."""
    return policy["model"] if is_unsaved(policy) else policy["path"]


def is_unsaved(policy: dict) -> bool:
    """Weights that live only in the run's learner: `path` names the checkpoint they were not written to
    (unless the run wrote them there as it ended)."""
    return bool(policy.get("unsaved")) and not written_at_close(policy)


def weights_hash(state_dict: dict) -> str:
    """A content hash of a state dict (names, dtypes, shapes and bytes): what an unsaved policy is known by."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())  # bfloat16 has no numpy dtype
    return f"weights-{digest.hexdigest()}"


def learner_holds(run_dir: str | Path, weights_hash: str) -> bool:
    """Whether the run's live learner holds these weights (the learner is out of the registry while it trains)."""
    run = _run(run_dir)
    with _LOCK:
        return run is not None and run.learner is not None and run.learner.weights_hash == weights_hash


def keeps_learner(run_dir: str | Path, learner) -> bool:
    """Whether `keep_learner` would keep this learner: the run keeps engines and the learner's weights live here."""
    return _run(run_dir) is not None and hasattr(learner, "weights")


# ---- rollout engines ----

# The files of a checkpoint folder that make the model what it is, weights aside: the architecture, generation
# config and tokenizer (not a model card or training state, which change every step).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


# Keys that record where and with which library version a file was saved, not what the model is.
SAVE_NOTES = ("transformers_version", "_name_or_path", "name_or_path", "is_local", "local_files_only")


def model_identity(model_path: str | Path) -> str:
    """The architecture, generation config and tokenizer of a checkpoint folder: engines built from folders that
    agree here can take each other's weights. JSON files count by content, less the save notes (a tokenizer saved
    again records that it was loaded from a local folder)."""
    root = Path(model_path)
    files = sorted(
        p for p in root.iterdir() if p.is_file() and (p.name in MODEL_FILES or p.name.startswith("tokenizer"))
    )
    return json_hash({p.name: _content(p) for p in files})


def _content(path: Path):
    if path.suffix != ".json" or path.name == "tokenizer.json":  # tokenizer.json: the vocabulary, large
        return file_hash(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if k not in SAVE_NOTES} if isinstance(data, dict) else data


def engine_key(engine: EngineSettings, model_path: str | Path, dtype: str, precision: str) -> str:
    return json_hash([dataclasses.asdict(engine), model_identity(model_path), dtype, precision])


@dataclass
class Acquired:
    """How a stage got its engine: 'built' from the checkpoint ('fresh' where the run keeps no engines), 'kept'
    (it already held these weights) or 'synced' (weights loaded in place from `source`, the learner's memory or the
    checkpoint files, in `sync_seconds`); `wake_seconds` > 0 when it slept since its last stage (sleep mode)."""

    how: str
    source: str = ""
    sync_seconds: float = 0.0
    key: str = ""  # the registry slot the engine goes back to
    wake_seconds: float = 0.0

    def describe(self) -> str:
        kept = f"engine woken from sleep in {self.wake_seconds:.3f} s" if self.wake_seconds else "engine kept"
        if self.how == "synced":
            return f"{kept}, weights synced in place from the {self.source} in {self.sync_seconds:.3f} s"
        if self.how == "kept":
            return f"{kept}, weights already current"
        return {
            "built": "engine built from the checkpoint",
            "fresh": "engine built from the checkpoint (run.keep_engines false)",
        }[self.how]


def rollout_engine(run_dir: str | Path, key: str, policy: dict, build: Callable[[str], Any]) -> tuple[Any, Acquired]:
    """An engine holding `policy`'s weights (policy = {"path", "hash"}): the run's live engine for `key`, its
    weights synced in place when they differ, else one `build(path)` makes. Give it back with `release`."""
    run = _run(run_dir)
    if run is None:
        engine = build(policy["path"])
        engine.weights_hash = policy["hash"]
        return engine, Acquired("fresh", key=key)
    with _LOCK:
        engine = run.rollout.pop(key, None)  # in use until released: a second user builds its own
    acquired = Acquired("kept", key=key)
    if engine is None:  # unsaved weights: built from the folder they were trained from, then synced
        engine, acquired = build(model_folder(policy)), Acquired("built", key=key)
        engine.weights_hash = None if is_unsaved(policy) else policy["hash"]
    try:
        if is_asleep(engine):  # memory for the weights first, written over by a sync, then for the KV cache
            start = time.perf_counter()
            engine.wake_up(("weights",))
            acquired.wake_seconds = time.perf_counter() - start
        if engine.weights_hash != policy["hash"]:
            start = time.perf_counter()
            source = _sync(run, engine, policy)
            engine.weights_hash = policy["hash"]
            acquired = Acquired("synced", source, time.perf_counter() - start, key, acquired.wake_seconds)
        if is_asleep(engine):
            start = time.perf_counter()
            engine.wake_up(("kv_cache",))
            acquired.wake_seconds += time.perf_counter() - start
    except BaseException:  # half-loaded weights are neither the old nor the new: the engine goes
        engine.close()
        raise
    if engine.weights_hash != policy["hash"]:
        raise StaleWeights(f"rollout engine holds weights {engine.weights_hash!r}, the stage needs {policy['hash']!r}")
    return engine, acquired


def _sync(run: _Run, engine, policy: dict) -> str:
    """Load `policy`'s weights into the engine in place; returns where they came from."""
    holding = engine.weights_hash
    with _lent_learner(run, policy["hash"]) as learner:
        if learner is not None:
            if takes_adapters(engine) and learner.s.lora_rank:  # an engine with LoRA kernels takes the adapter alone
                engine.load_weights(learner.adapter())
            elif streams(engine, learner):  # the learner's ranks send to the engine (vLLM's weight transfer)
                learner.send_weights(engine, holding=holding, sending=policy["hash"])
            else:
                engine.load_weights(learner.weights())
            return "learner's memory"
    if is_unsaved(policy):
        raise StaleWeights(
            f"the weights of {policy['path']} were never saved (run.save_every) and the live "
            "learner no longer holds them: run again to recompute them"
        )
    if hasattr(engine, "load_checkpoint") and lora_adapter(policy["path"]) is None:
        engine.load_checkpoint(policy["path"])  # read a tensor at a time where the engine streams
    else:
        engine.load_weights(checkpoint_weights(policy["path"], adapters=takes_adapters(engine)))
    return "checkpoint files"


def streams(engine, learner) -> bool:
    """Whether the learner's own processes send weights to the engine over vLLM's weight-transfer API (an engine
    built for IPC, NCCL or deltas, a learner with ranks that send), rather than handing over a state dict."""
    return getattr(engine, "transport", "host") != "host" and getattr(learner, "sends_weights", False)


def is_asleep(engine) -> bool:
    return bool(getattr(engine, "asleep", False))


def release(run_dir: str | Path, engine, acquired: Acquired) -> str:
    """Done with an engine of `rollout_engine`: kept for the run's next stages when the run keeps engines, awake
    when it leaves its device enough memory (`fits`), else asleep when it can sleep (sleep mode frees its device
    memory until the next stage wakes it), else closed. Returns 'kept', 'asleep' or 'closed'."""
    run = _run(run_dir)
    how = keeping(engine) if run is not None else "closed"
    if how != "closed":
        with _LOCK:
            free_slot = acquired.key not in run.rollout
        if free_slot and how == "asleep":
            engine.sleep()
            if engine.sleep_level >= 2:  # its weights are gone: the next stage loads them whatever it needs
                engine.weights_hash = None
        with _LOCK:
            if acquired.key not in run.rollout:
                run.rollout[acquired.key] = engine
                return how
    engine.close()
    return "closed"


def keeping(engine) -> str:
    """How `release` keeps an engine: 'kept' awake when that leaves its device as much free memory as it holds
    (`fits`), 'asleep' when it does not but the engine can sleep, else 'closed'."""
    if fits(engine):
        return "kept"
    return "asleep" if getattr(engine, "sleep_level", 0) else "closed"


def fits(engine) -> bool:
    """Whether keeping the engine awake still leaves its device at least as much free memory as it holds: an
    engine that reserved most of a GPU (vLLM's gpu_memory_utilization 0.9) does not, and sleeps (or, unable to
    sleep, is closed) before the learner runs. An engine asleep holds nothing."""
    held, free = engine.memory_bytes()
    return free >= held


def takes_adapters(engine) -> bool:
    """Whether the engine applies LoRA adapters itself (vLLM built with adapter_rank) rather than merged weights."""
    return getattr(engine, "takes_adapters", False)


def checkpoint_weights(model_path: str | Path, adapters: bool = False) -> dict | Adapter:
    """The state dict of a checkpoint folder's safetensors files (HF names, as `model.state_dict()` gives them).
    A LoRA checkpoint gives its adapter when `adapters` (an engine with LoRA kernels), else merged weights: its own
    when it holds them, else base and adapter merged here."""
    from safetensors.torch import load_file

    adapter = lora_adapter(model_path)
    if adapter is not None and adapters:
        return adapter
    if checkpoint_adapter(model_path) is not None:  # nothing merged on disk: merged here
        return adapter_weights(adapter)
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path} holds no *.safetensors weights to sync a live engine from")
    weights: dict = {}
    for path in files:
        weights.update(load_file(str(path)))
    return weights


@contextmanager
def _lent_learner(run: _Run, weights_hash: str):
    """The live learner when it holds exactly the checkpoint `weights_hash` names, else None. Until the block
    ends no update takes it (`take_learner` waits), so its weights are not changed while they are copied."""
    with _LOCK:
        live = run.learner
        if live is None or live.weights_hash != weights_hash:
            live = None
        else:
            run.lending += 1
    try:
        yield live.learner if live else None
    finally:
        if live:
            with _LOCK:
                run.lending -= 1
                _LOCK.notify_all()


# ---- learner ----


def learner_key(kind: str, policy_path: str | Path, reference: dict, settings, dtype: str) -> str:
    return json_hash(
        [
            kind,
            model_identity(policy_path),
            reference["path"],
            reference["hash"],
            json.loads(json.dumps(dataclasses.asdict(settings), default=list)),
            dtype,
        ]
    )


def take_learner(run_dir: str | Path, key: str, policy_hash: str):
    """The run's live learner when it was built with `key` and its weights are the checkpoint `policy_hash`
    names, else None (build one). It leaves the registry until `keep_learner` puts it back, so a step that fails
    halfway (weights half-updated) is never reused: its retry loads from disk."""
    run = _run(run_dir)
    if run is None:
        return None
    with _LOCK:
        _LOCK.wait_for(lambda: not run.lending)
        live, run.learner = run.learner, None
    if live is not None and live.key == key and live.weights_hash == policy_hash:
        return live.learner
    if live is not None:  # other settings or other weights: never used again
        live.learner.close()
    return None


def keep_learner(
    run_dir: str | Path, key: str, learner, weights_hash: str, save_at_close: Callable[[], Any] | None = None
) -> bool:
    """After the learner's weights were saved as the checkpoint `weights_hash` names: keep it for the next step
    (learners that hold their weights in this process, i.e. offer `weights()`). Returns whether it was kept.
    `save_at_close` writes weights that no checkpoint holds yet, should the run end first."""
    run = _run(run_dir)
    if run is None or not hasattr(learner, "weights"):
        return False
    with _LOCK:
        run.learner = _Learner(key, learner, weights_hash, save_at_close)
    return True


# ---- judge ----


def judge(
    run_dir: str | Path,
    model: dict,
    settings: JudgeConfig,
    dtype: str,
    precision: str,
    build: Callable[[], Any],
) -> Any:
    """The judge `build()` makes, kept for the run when it holds its model in this process: keyed by the judge
    model's path and content hash, its settings, dtype and precision."""
    run = _run(run_dir)
    if run is None or settings.engine not in IN_PROCESS_JUDGES:
        return build()
    key = json_hash([model["path"], model["hash"], dataclasses.asdict(settings), dtype, precision])
    with _LOCK:
        kept = run.judges.get(key)
    if kept is None:
        kept = build()
        with _LOCK:
            run.judges[key] = kept
    return kept
