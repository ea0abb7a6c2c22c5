"""Several rollout engines as one (rollout.num_engines): the step's prompts are split into contiguous shards, one
per engine, sampled at once, and put back in prompt order, so the rollouts' order and Parquet layout are the same
whatever the number of engines. Each engine is a Ray actor (run.ray_address; refiner_core.runtime.cluster), placed
by Ray with `num_gpus` = its tensor-parallel size where the cluster has GPUs, built once and given new weights in place
like a single engine (one copy of the weights in Ray's object store, read by every actor).

The vllm engine seeds every prompt by its index in the whole step, so its samples do not depend on the number of
engines; the hf engine seeds each batch, so other shards give other (equally valid) samples.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from refiner_core.config import ConfigError, EngineSettings
from refiner_core.models import Adapter
from refiner_core.rollout.base import Generation, SamplingParams, make_engine
from refiner_core.store.faults import stage_fault

REPORT_SECONDS = 1.0  # how often an engine tells the board how far it got: often for the watchdog, few calls
POLL_SECONDS = 0.5  # how often the driver looks at the board while the engines sample


class ProgressBoard:
    """How far each engine got (the units its bars count, sequences), for the driver's bar and so the run's stall
    watchdog: an engine actor runs one call at a time, so it cannot be asked while it samples; it tells this one."""

    def __init__(self, engines: int):
        self.done = [0.0] * engines

    def report(self, engine: int, done: float) -> None:
        self.done[engine] = max(self.done[engine], done)

    def read(self) -> float:
        return sum(self.done)


class EngineActor:
    """One rollout engine in a Ray worker process, telling `board` how far its bars got."""

    def __init__(
        self, model_path: str, settings: EngineSettings, dtype: str, precision: str, markers: str, board, index: int
    ):
        if markers:  # REFINER_FAIL_ONCE=rollout-engine-build: this engine fails to build (out of memory, say)
            stage_fault("rollout-engine-build", None, Path(markers))
        self.engine = make_engine(model_path, settings, dtype, precision)
        self.markers = markers
        self.board, self.index = board, index
        self.moved, self.told_at, self.seen = 0.0, 0.0, {}

    def generate(self, prompts: list[list[int]], params: SamplingParams, desc: str) -> list[Generation]:
        from refiner_core.runtime.progress import listening

        if self.markers:  # REFINER_KILL_ONCE=rollout-engine: this worker dies mid-rollout
            stage_fault("rollout-engine", None, Path(self.markers))
        with listening(self._heard):
            return self.engine.generate(prompts, params, desc)

    def _heard(self, bar) -> None:
        """A bar moved: add what it moved by to this engine's count, told to the board at most every
        REPORT_SECONDS (and as a bar closes)."""
        self.moved += bar.done - self.seen.get(id(bar), 0.0)
        self.seen[id(bar)] = bar.done
        now = time.monotonic()
        if bar.closed_at is not None:
            self.seen.pop(id(bar), None)
        if bar.closed_at is not None or now - self.told_at >= REPORT_SECONDS:
            self.board.report.remote(self.index, self.moved)
            self.told_at = now

    def load_weights(self, weights) -> None:
        self.engine.load_weights(weights)

    def memory_bytes(self) -> tuple[int, int]:
        return self.engine.memory_bytes()

    def takes_adapters(self) -> bool:
        return getattr(self.engine, "takes_adapters", False)

    def eos_ids(self):
        return getattr(self.engine, "eos_ids", None)

    def sleep_level(self) -> int:
        return self.engine.sleep_level

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        self.engine.wake_up(tags)

    def pid(self) -> int:
        return os.getpid()

    def placement(self) -> tuple[str, list]:
        """The node's address and the GPUs Ray gave this actor (CUDA_VISIBLE_DEVICES is set to them)."""
        import ray

        return ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]


class ShardedEngine:
    """N engines (Ray actor handles) behind the one-engine interface."""

    def __init__(self, model_path: str, settings: EngineSettings, dtype: str, precision: str, markers: str = ""):
        """settings.num_engines actors, each an engine built with `settings` (settings.tensor_parallel_size GPUs
        each where the cluster has GPUs)."""
        import ray

        from refiner_core.runtime.cluster import gpus_available

        gpus = settings.tensor_parallel_size if gpus_available() else 0
        refuse_unplaceable(settings.num_engines, gpus, node_resources())
        actor = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0)(EngineActor)
        self.board = ray.remote(num_cpus=0, max_restarts=0)(ProgressBoard).remote(settings.num_engines)
        self.actors = [
            actor.remote(model_path, settings, dtype, precision, markers, self.board, k)
            for k in range(settings.num_engines)
        ]
        self.name, self.weights_hash = settings.engine, ""
        try:
            _wait_built(self.actors, gpus)  # built (or failed) before the stage goes on
        except BaseException:  # the engines built so far hold their CPUs/GPUs until killed: a retry would wait
            for a in [*self.actors, self.board]:
                ray.kill(a)
            raise
        self.places = [tuple(place) for place in ray.get([a.placement.remote() for a in self.actors])]
        self.placement = "; ".join(
            f"engine {k}/{len(self.places)} on {node}" + (f" GPU {','.join(ids)}" if ids else "")
            for k, (node, ids) in enumerate(self.places, 1)
        )
        self.takes_adapters = ray.get(self.actors[0].takes_adapters.remote())
        self.eos_ids = ray.get(self.actors[0].eos_ids.remote())  # the agent loop ends turns at them
        self.sleep_level = min(ray.get([a.sleep_level.remote() for a in self.actors]))
        self.asleep = False

    def generate(self, prompts: list[list[int]], params: SamplingParams, desc: str = "") -> list[Generation]:
        shards = _shards(len(prompts), len(self.actors))
        busy = [(k, start, end) for k, (start, end) in enumerate(shards) if end > start]
        pending = [
            self.actors[k].generate.remote(
                prompts[start:end],
                replace(params, prompt_offset=params.prompt_offset + start),
                f"{desc} [engine {k + 1}/{len(self.actors)}]",
            )
            for k, start, end in busy
        ]
        out = []
        for (_, start, _), generations in zip(busy, self._wait_sampled(pending, desc)):
            out += [replace(g, prompt_index=g.prompt_index + start) for g in generations]
        return sorted(out, key=lambda g: (g.prompt_index, g.sample_idx))

    def _wait_sampled(self, pending: list, desc: str) -> list:
        """The shards' generations, waited for under a bar that moves with the engines' own (drawn by each engine;
        this one is for the run's stall watchdog, which fails the stage when no engine moves). A shard that failed
        fails the call at once."""
        import ray

        from refiner_core.runtime.progress import check_stalled, progress_bar

        start = ray.get(self.board.read.remote())
        bar = progress_bar(None, desc or "rollout", "seq", disable=True)
        try:
            waiting = pending
            while waiting:
                ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=POLL_SECONDS)
                ray.get(ready)
                moved = ray.get(self.board.read.remote()) - start
                if moved > bar.done:
                    bar.update(moved - bar.done)
                check_stalled()
            return ray.get(pending)
        finally:
            bar.close()

    def load_weights(self, weights) -> None:
        import ray

        if isinstance(weights, Adapter):  # a folder every actor reads (one machine, or a shared file system)
            ray.get([a.load_weights.remote(weights) for a in self.actors])
            return
        state = weights.state_dict() if hasattr(weights, "state_dict") else weights
        shared = ray.put({k: v.detach().cpu() for k, v in state.items()})  # one copy, read by every actor
        ray.get([a.load_weights.remote(shared) for a in self.actors])

    def memory_bytes(self) -> tuple[int, int]:
        """(held, free) of the device that has least room to spare: engines on one node's CPU share its memory,
        an engine on GPUs has them to itself."""
        import ray

        return tightest(self.places, ray.get([a.memory_bytes.remote() for a in self.actors]))

    def sleep(self) -> None:
        import ray

        if self.sleep_level and not self.asleep:
            ray.get([a.sleep.remote() for a in self.actors])
            self.asleep = True

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        import ray

        if self.asleep:
            ray.get([a.wake_up.remote(tags) for a in self.actors])
            self.asleep = tags is not None and "kv_cache" not in tags

    def close(self) -> None:
        import ray

        if self.actors:
            for actor in [*self.actors, self.board]:
                ray.kill(actor, no_restart=True)
        self.actors = []


def _shards(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges splitting `count` items over `parts`, the first ones one longer."""
    size, extra = divmod(count, parts)
    bounds, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        bounds.append((start, end))
        start = end
    return bounds


def tightest(places: list[tuple[str, list]], sizes: list[tuple[int, int]]) -> tuple[int, int]:
    """Of the engines' (held, free) bytes, those of the device with the least free beyond what is held there,
    engines placed alike (`places`: node, GPU ids) sharing a device: their held bytes add up, its free bytes are
    counted once."""
    devices: dict[tuple, tuple[int, int]] = {}
    for (node, gpus), (held, free) in zip(places, sizes, strict=True):
        key = (node, tuple(gpus))
        before = devices.get(key, (0, free))
        devices[key] = (before[0] + held, min(before[1], free))
    return min(devices.values(), key=lambda device: device[1] - device[0])


def node_resources() -> list[tuple[str, float, float]]:
    """(address, CPUs, GPUs) of each live node of the Ray cluster (nodes may share an address)."""
    import ray

    return [
        (n["NodeManagerAddress"], n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0))
        for n in ray.nodes()
        if n["Alive"]
    ]


def refuse_unplaceable(engines: int, gpus_each: int, nodes: list[tuple[str, float, float]]) -> None:
    """Raise where `engines` engines of one CPU and `gpus_each` GPUs each (one engine's GPUs on one node) can
    never fit the cluster's nodes: Ray would keep them pending and the stage would wait forever. Not retried: a
    setting."""
    fits = sum(min(int(cpus), int(gpus // gpus_each)) if gpus_each else int(cpus) for _, cpus, gpus in nodes)
    if fits < engines:
        held = ", ".join(f"{node}: {cpus:g} CPUs, {gpus:g} GPUs" for node, cpus, gpus in nodes) or "none"
        each = (
            f" with rollout.tensor_parallel_size = {gpus_each} needs {engines} groups of {gpus_each} GPU(s) and 1 CPU, "
            "each on one node"
            if gpus_each
            else f" needs {engines} CPUs, one per engine"
        )
        raise ConfigError(
            f"rollout.num_engines = {engines}{each}; the Ray cluster's nodes have {{{held}}}, room for {fits}. Lower "
            "rollout.num_engines" + (" or rollout.tensor_parallel_size" if gpus_each else "") + ", or add nodes"
        )


WAIT_LINE_SECONDS = 60.0


def _wait_built(actors: list, gpus_each: int) -> None:
    """Wait until every actor is built (an error raised in one is raised here), with a line every
    WAIT_LINE_SECONDS while some wait for resources that other work holds (a shared cluster)."""
    import ray

    pending = [a.pid.remote() for a in actors]
    while True:
        ready, waiting = ray.wait(pending, num_returns=len(pending), timeout=WAIT_LINE_SECONDS)
        ray.get(ready)  # an engine that failed to build fails the stage now, not once the others are placed
        if not waiting:
            return
        free = ray.available_resources()
        logging.getLogger(__name__).warning(
            "rollout engines: %d of %d built; the others wait for the Ray cluster's resources (each asks for 1 CPU "
            "and %d GPU(s); free now: %g CPUs, %g GPUs)",
            len(ready),
            len(pending),
            gpus_each,
            free.get("CPU", 0.0),
            free.get("GPU", 0.0),
        )
