"""Which compute precision this machine runs fast: `model.precision: auto` resolves here, once at the start of a run.

bf16 autocast is about 3x faster than fp32 where the hardware computes bfloat16 natively (GPUs with bf16, x86 CPUs
with AVX-512 BF16 or AMX) and far slower where it is emulated (matmuls about 100x slower on an AVX2-only CPU). The
answer depends only on the machine, so cache keys built from the resolved precision stay stable across runs on it.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from refiner_core.config import ModelConfig, RecipeConfig

PRECISIONS = typing.get_args(typing.get_type_hints(ModelConfig)["precision"])  # ('auto', 'fp32', 'bf16')
CPU_FLAGS = {"avx512_bf16": "AVX-512 BF16", "amx_bf16": "AMX"}  # /proc/cpuinfo flags of native bf16 arithmetic


def cpuinfo_flags(text: str) -> set[str]:
    """The CPU feature flags named in /proc/cpuinfo text (x86 'flags' lines)."""
    return {
        flag
        for line in text.splitlines()
        if line.startswith("flags") and ":" in line
        for flag in line.split(":", 1)[1].split()
    }


def cpu_bf16_features() -> list[str]:
    """Native bf16 features of this CPU, as names ('AVX-512 BF16', 'AMX'): torch's own probes where it has them
    (torch 2.13 does), else the /proc/cpuinfo flags."""
    import torch

    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if avx512_bf16 is not None and amx is not None:
        return [name for name, has in (("AVX-512 BF16", avx512_bf16()), ("AMX", amx())) if has]
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo_flags(cpuinfo.read_text()) if cpuinfo.exists() else set()
    return [name for flag, name in CPU_FLAGS.items() if flag in flags]


def native_bf16(device: str | None = None) -> tuple[bool, str]:
    """Whether `device` ('cuda' or 'cpu'; default: where in-process models compute) computes bfloat16 natively,
    and why, e.g. (True, 'CPU has AVX-512 BF16')."""
    import torch

    from refiner_core.models import default_device

    if (device or default_device()) == "cuda":
        name = torch.cuda.get_device_name()
        # not emulated: a GPU before compute capability 8.0 (T4, V100) can hold bf16 tensors, but computes them
        # slowly, and vLLM refuses bf16 there
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"GPU {name} has bf16"
        return False, f"GPU {name} lacks native bf16 (compute capability below 8.0)"
    features = cpu_bf16_features()
    if features:
        return True, f"CPU has {' and '.join(features)}"
    return False, f"CPU ({torch.backends.cpu.get_cpu_capability()}) has neither AVX-512 BF16 nor AMX"


def resolve_precision(requested: str, device: str | None = None) -> str:
    """'auto' -> 'bf16' where `device` computes bf16 natively, else 'fp32'; 'bf16' and 'fp32' pass through."""
    return precision_note(requested, device)[0]


def precision_note(requested: str, device: str | None = None) -> tuple[str, str]:
    """(resolved precision, the line that says what and why), e.g. 'precision: bf16 (auto: CPU has AVX-512 BF16)';
    an explicit bf16 without native support says that it is slow here."""
    if requested not in PRECISIONS:
        raise ValueError(f"unknown precision {requested!r}; choose from {list(PRECISIONS)}")
    native, why = native_bf16(device)
    if requested == "auto":
        resolved = "bf16" if native else "fp32"
        return resolved, f"precision: {resolved} (auto: {why})"
    slow = "; bf16 is emulated here, far slower than fp32" if requested == "bf16" and not native else ""
    return requested, f"precision: {requested} (set by the recipe; {why}{slow})"


def resolve_lora_sync(requested: str, device: str | None = None) -> str:
    """model.lora_sync 'auto': LoRA adapters synced as adapters where vLLM runs on a GPU; merged weights on a CPU,
    where vLLM's LoRA kernels sampled 2.6x slower than merged weights (bench/lora_sync.py)."""
    from refiner_core.models import default_device

    if requested != "auto":
        return requested
    return "adapter" if (device or default_device()) == "cuda" else "merged"


def resolved_recipe(cfg: RecipeConfig) -> tuple[RecipeConfig, str]:
    """`cfg` with model.precision resolved to 'bf16' or 'fp32' and model.lora_sync to 'adapter' or 'merged' (what
    stage tasks and their cache keys see), and the line that says which precision and why."""
    precision, note = precision_note(cfg.model.precision)
    model = dataclasses.replace(cfg.model, precision=precision, lora_sync=resolve_lora_sync(cfg.model.lora_sync))
    return dataclasses.replace(cfg, model=model), note
