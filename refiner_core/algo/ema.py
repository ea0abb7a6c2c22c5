"""The EMA teacher of Co-rewarding-II: `teacher <- alpha * policy + (1 - alpha) * teacher`.

The teacher starts as the starting policy and is updated every `update_interval` GRPO steps from the policy
checkpoint just written, with alpha on a cosine schedule from alpha_start (step 0) to alpha_end (step
`schedule_steps`, constant after). Each teacher is an HF checkpoint folder of its own (same files as the policy's,
weights averaged), so any rollout engine samples from it and a resumed run continues from the folder on disk.

The same average moves the KL reference (grpo.ref_sync_every). Both are stored in fp32 whatever the policy's dtype:
in bf16, alpha * (policy - teacher) at alpha 0.01 is far below half a unit in the last place of most weights, so a
teacher rounded to bf16 after each update would never move. The config keeps the policy's dtype: engines and
learners load the folder in the run's dtype, cast on load.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

# Training state a policy checkpoint may carry that a teacher does not need.
SKIPPED = ("optimizer.pt", "deepspeed", "launch.log")


def alpha_at(step: int, alpha_start: float, alpha_end: float, schedule_steps: int) -> float:
    """Cosine from alpha_start at step 0 to alpha_end at schedule_steps (and after):
    alpha_end + (alpha_start - alpha_end) * (1 + cos(pi * min(step, T) / T)) / 2."""
    if schedule_steps <= 0:
        return alpha_end
    t = min(max(step, 0), schedule_steps) / schedule_steps
    return alpha_end + (alpha_start - alpha_end) * (1.0 + math.cos(math.pi * t)) / 2.0


def is_update_step(steps_done: int, update_interval: int) -> bool:
    """The teacher is updated after every `update_interval`-th policy update (steps_done counts them, from 1)."""
    return steps_done > 0 and steps_done % update_interval == 0


def _weights(folder: Path) -> dict[str, Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights (an HF checkpoint folder is needed)")
    return {f.name: f for f in files}


def ema_checkpoint(teacher_dir: Path, policy_dir: Path, alpha: float, out_dir: Path) -> None:
    """Write alpha * policy + (1 - alpha) * teacher into out_dir (an existing, empty folder), tensor by tensor in
    fp32, stored in fp32 in the policy's file layout; the policy's config and tokenizer files are copied."""
    import torch
    from safetensors.torch import load_file, save_file

    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"EMA alpha must be in [0, 1], got {alpha}")
    teacher: dict[str, torch.Tensor] = {}
    for path in _weights(Path(teacher_dir)).values():
        teacher.update(load_file(path))
    for name, path in _weights(Path(policy_dir)).items():
        policy = load_file(path)
        missing = sorted(set(policy) - set(teacher))
        if missing:
            raise ValueError(
                f"teacher {teacher_dir} lacks tensors of the policy, e.g. {missing[:3]}: not the same model"
            )
        averaged = {k: (alpha * v.float() + (1.0 - alpha) * teacher[k].float()).contiguous() for k, v in policy.items()}
        save_file(averaged, str(Path(out_dir) / name), metadata={"format": "pt"})
    for item in Path(policy_dir).iterdir():
        # nor the policy's LoRA adapter (a folder with PEFT's adapter_config.json): the average is in the merged
        # weights, and an engine taking adapters would serve the policy's adapter for the teacher
        if item.suffix == ".safetensors" or item.name in SKIPPED or (item / "adapter_config.json").is_file():
            continue
        if item.is_dir():
            shutil.copytree(item, Path(out_dir) / item.name)
        else:
            shutil.copy2(item, Path(out_dir) / item.name)
