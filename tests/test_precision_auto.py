"""model.precision 'auto': bf16 only where the hardware computes it natively, resolved once per run, so stage tasks
and their cache keys only ever see 'bf16' or 'fp32'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, run_cli
from refiner_core.config import ConfigError, EngineSettings, load_recipe
from refiner_core.runtime import hardware
from refiner_core.runtime.hardware import (
    cpu_bf16_features,
    cpuinfo_flags,
    native_bf16,
    resolve_precision,
    resolved_recipe,
)

AVX2_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx avx2\n"
ZEN4_CPUINFO = "processor\t: 0\nflags\t\t: fpu avx avx2 avx512f avx512_bf16 avx512_vnni\nbugs\t\t: spectre_v1\n"


@pytest.fixture
def cpu(monkeypatch):
    """Sets what torch's CPU probes answer (avx512_bf16, amx_tile); in-process models compute on the CPU."""
    monkeypatch.setattr("refiner_core.models.default_device", lambda: "cpu")

    def answer(avx512_bf16: bool, amx: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)

    return answer


def test_auto_is_fp32_without_native_bf16(cpu):
    cpu(avx512_bf16=False, amx=False)
    assert resolve_precision("auto") == "fp32"
    native, why = native_bf16()
    assert not native and why.startswith("CPU (") and "has neither AVX-512 BF16 nor AMX" in why


@pytest.mark.parametrize(
    "avx512_bf16,amx,why",
    [(True, False, "CPU has AVX-512 BF16"), (False, True, "CPU has AMX"), (True, True, "CPU has AVX-512 BF16 and AMX")],
)
def test_auto_is_bf16_with_native_bf16(cpu, avx512_bf16, amx, why):
    cpu(avx512_bf16, amx)
    assert resolve_precision("auto") == "bf16"
    assert native_bf16() == (True, why)


@pytest.mark.parametrize("native", [False, True])
def test_explicit_precision_passes_through(cpu, native):
    cpu(avx512_bf16=native, amx=False)
    assert resolve_precision("fp32") == "fp32" and resolve_precision("bf16") == "bf16"
    _, note = hardware.precision_note("bf16")
    assert note.startswith("precision: bf16 (set by the recipe; ")
    assert ("emulated here, far slower than fp32" in note) is not native


def test_cpuinfo_flags_fallback(monkeypatch):
    """Without torch's probes the /proc/cpuinfo flags decide, and they agree with torch's answer on this machine."""
    assert {"avx2", "fma"} <= cpuinfo_flags(AVX2_CPUINFO) and "avx512_bf16" not in cpuinfo_flags(AVX2_CPUINFO)
    assert "avx512_bf16" in cpuinfo_flags(ZEN4_CPUINFO) and "spectre_v1" not in cpuinfo_flags(ZEN4_CPUINFO)
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo")
    from_torch = cpu_bf16_features()
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    from_cpuinfo = cpu_bf16_features()
    assert from_cpuinfo == from_torch
    assert ("AVX-512 BF16" in from_cpuinfo) == ("avx512_bf16" in cpuinfo_flags(Path("/proc/cpuinfo").read_text()))


@pytest.mark.parametrize("native,expected", [(False, "fp32"), (True, "bf16")])
def test_recipe_resolves_auto_for_stage_tasks(cpu, native, expected):
    """The default is 'auto'; the resolved recipe (what the pipeline builds stage inputs and cache keys from, and
    what the CLI records in recipe.yaml) holds the hardware's answer, an explicit setting is kept."""
    cpu(avx512_bf16=native, amx=False)
    cfg = load_recipe(REPO / "recipes" / "tiny.yaml")
    assert cfg.model.precision == "auto"
    resolved, note = resolved_recipe(cfg)
    assert resolved.to_dict()["model"]["precision"] == expected and cfg.model.precision == "auto"
    assert note.startswith(f"precision: {expected} (auto: CPU ")
    assert {k: v for k, v in resolved.to_dict().items() if k != "model"} == {
        k: v for k, v in cfg.to_dict().items() if k != "model"
    }
    other = "bf16" if expected == "fp32" else "fp32"
    explicit, _ = resolved_recipe(load_recipe(REPO / "recipes" / "tiny.yaml", [f"model.precision={other}"]))
    assert explicit.model.precision == other


def test_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.precision: 'fp16' is not one of \['auto', 'fp32', 'bf16'\]"):
        load_recipe(REPO / "recipes" / "tiny.yaml", ["model.precision=fp16"])
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        resolve_precision("fp16")


def test_vllm_engine_refuses_an_unresolved_precision(tiny_model_path):
    from refiner_core.rollout.vllm_engine import make_vllm_engine

    with pytest.raises(ValueError, match="unknown precision 'auto'"):
        make_vllm_engine(
            str(tiny_model_path), EngineSettings.of(engine="vllm", batch_size=4), precision="auto", progress=False
        )


def test_recipes_keep_their_explicit_precision():
    """Recipes with the published GPU settings keep bf16; the others leave it to 'auto'."""
    explicit = {path.stem: load_recipe(path).model.precision for path in (REPO / "recipes").glob("*.yaml")}
    assert {name for name, p in explicit.items() if p != "auto"} == {
        "grpo-tcr",
        "refiner-answer-only",
        "refiner-instance-rubric",
    }
    assert explicit["grpo-tcr"] == explicit["refiner-answer-only"] == explicit["refiner-instance-rubric"] == "bf16"


def test_pipeline_resolves_auto_and_caches_under_the_resolved_value(prefect_server, tiny_recipe, tmp_path, monkeypatch):
    """A run of an 'auto' recipe on a CPU forced to lack bf16 computes in fp32 (autocast refuses 'auto', so the
    stages saw a resolved value); the same run with an explicit fp32 on the real CPU finds every stage cached."""
    from test_pipeline import _run

    recipe = {**tiny_recipe, "grpo": {**tiny_recipe["grpo"], "steps": 1}}
    assert recipe["model"]["precision"] == "auto"
    monkeypatch.setattr(hardware, "cpu_bf16_features", lambda: [])
    state, tasks = _run(recipe, tmp_path)
    assert state.is_completed(), state.message
    assert {tasks[n][0] for n in ("rollout[step=0]", "judge[step=0]", "grpo-update[step=0]")} == {"Completed"}
    monkeypatch.undo()
    state, tasks = _run({**recipe, "model": {**recipe["model"], "precision": "fp32"}}, tmp_path)
    assert state.is_completed(), state.message
    assert {tasks[n][0] for n in ("rollout[step=0]", "judge[step=0]", "grpo-update[step=0]")} == {"Cached"}


def test_cli_logs_and_records_the_resolved_precision(tmp_path):
    """`refiner run` logs the precision and why at the start, and a warning about its reward settings, and records
    the resolved value in recipe.yaml (the run is stopped by an injected fault in its first rollout)."""
    run_dir = tmp_path / "run"
    args = ["run", str(REPO / "recipes" / "tiny.yaml"), "--run-dir", str(run_dir), "--set", "run.retries=0"]
    args += ["--set", "reward.distractor_penalty=100"]  # more than a missing answer block gives up: warned of
    code, _, err, _ = run_cli(args, tmp_path, env={"REFINER_FAIL_ONCE": "rollout@0"})
    assert code == 1, err[-3000:]
    expected = resolve_precision("auto")
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["model"]["precision"] == expected
    assert f"precision: {expected} (auto: {native_bf16()[1]})" in err
    assert "WARNING | Flow run" in err and "reward.distractor_penalty = 100, and an answer with no answer block" in err


@pytest.mark.parametrize("gpu, major, expected", [("Tesla T4", 7, "fp32"), ("NVIDIA H100 80GB HBM3", 9, "bf16")])
def test_auto_on_a_gpu_is_bf16_only_from_compute_capability_8(monkeypatch, gpu, major, expected):
    """torch's bf16 check counts a GPU that can merely hold bf16 tensors (emulated, slow; vLLM refuses bf16 there)."""
    import types

    monkeypatch.setattr("refiner_core.models.default_device", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(major=major))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # a bf16 tensor can be made
    assert resolve_precision("auto") == expected
    assert native_bf16()[1].startswith(f"GPU {gpu}")
