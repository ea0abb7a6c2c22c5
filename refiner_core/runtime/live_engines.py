"""Rollout engines a run keeps live across its steps: handed out holding the weights a stage's policy manifest
names (kept, or synced in place from the live learner's memory or the checkpoint files), and taken back after the
stage (kept awake, asleep, or closed to leave the learner memory).

Which weights an engine holds is tracked by the content hash of the checkpoint they came from (the policy
manifest's "hash"), and an engine is never handed out holding other weights than the hash asked for. Weights never
saved (run.save_every, unsaved_weights) can only come from the live learner.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refiner_core.config import EngineSettings
from refiner_core.models import checkpoint_weights, lora_adapter
from refiner_core.runtime.identity import model_identity
from refiner_core.runtime.live import LOCK, LiveRun, run_of
from refiner_core.runtime.live_learner import lent_learner
from refiner_core.runtime.unsaved_weights import is_unsaved, model_folder
from refiner_core.store.storage import json_hash


class StaleWeights(RuntimeError):
    """An engine was about to serve other weights than its stage's input manifest names."""


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


def rollout_engine(
    run_dir: str | Path, key: str, policy: dict, build: Callable[[str], Any], one_at_a_time: bool = False
) -> tuple[Any, Acquired]:
    """An engine holding `policy`'s weights (policy = {"path", "hash"}): the run's live engine for `key`, its
    weights synced in place when they differ, else one `build(path)` makes. Give it back with `release` (or
    `discard`). While another stage uses the key's engine a second user builds its own, unless `one_at_a_time`
    (engines that take their whole cluster, Ray's: a second set would wait for resources the first holds, and the
    first, released, would be kept holding them): then it waits for the first to come back."""
    run = run_of(run_dir)
    if run is None:
        engine = build(policy["path"])
        engine.weights_hash = policy["hash"]
        return engine, Acquired("fresh", key=key)
    with LOCK:
        if one_at_a_time:
            LOCK.wait_for(lambda: key in run.rollout or not run.in_use.get(key))
        engine = run.rollout.pop(key, None)  # in use until released
        run.in_use[key] = run.in_use.get(key, 0) + 1
    acquired = Acquired("kept", key=key)
    try:
        if engine is None:  # unsaved weights: built from the folder they were trained from, then synced
            engine, acquired = build(model_folder(policy)), Acquired("built", key=key)
            engine.weights_hash = None if is_unsaved(policy) else policy["hash"]
    except BaseException:
        _returned(run, key)
        raise
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
        discard(run_dir, engine, acquired)
        raise
    if engine.weights_hash != policy["hash"]:
        discard(run_dir, engine, acquired)
        raise StaleWeights(f"rollout engine holds weights {engine.weights_hash!r}, the stage needs {policy['hash']!r}")
    return engine, acquired


def _returned(run: LiveRun, key: str) -> None:
    """One engine of `key` is no longer in use: a stage waiting for it (one_at_a_time) looks again."""
    with LOCK:
        run.in_use[key] = max(run.in_use.get(key, 0) - 1, 0)
        LOCK.notify_all()


def discard(run_dir: str | Path, engine, acquired: Acquired) -> None:
    """Close an engine of `rollout_engine` that must not be kept (it failed mid-stage: a dead worker)."""
    run = run_of(run_dir)
    try:
        engine.close()
    finally:
        if run is not None and acquired.how != "fresh":
            _returned(run, acquired.key)


def _sync(run: LiveRun, engine, policy: dict) -> str:
    """Load `policy`'s weights into the engine in place; returns where they came from."""
    holding = engine.weights_hash
    with lent_learner(run, policy["hash"]) as learner:
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
    run = run_of(run_dir)
    if run is None or acquired.how == "fresh":
        engine.close()
        return "closed"
    try:  # kept by nobody, an engine whose state is not known for certain would hold its memory: it is closed
        how = keeping(engine)
        if how != "closed":
            with LOCK:
                free_slot = acquired.key not in run.rollout
            if free_slot and how == "asleep":
                engine.sleep()
                if engine.sleep_level >= 2:  # its weights are gone: the next stage loads them whatever it needs
                    engine.weights_hash = None
            with LOCK:
                if acquired.key not in run.rollout:
                    run.rollout[acquired.key] = engine
                    _returned(run, acquired.key)  # LOCK is reentrant: kept and returned in one step
                    return how
    except BaseException:
        discard(run_dir, engine, acquired)
        raise
    discard(run_dir, engine, acquired)
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
