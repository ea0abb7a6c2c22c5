"""LoRA (model.lora_rank > 0) for the torch learner, with PEFT: only the adapters train; the KL reference is the
same model with its adapters switched off (no second copy); checkpoints hold the merged weights (what every engine,
eval and `refiner push` load) and the adapter itself in `adapter/` (what a resumed update trains on).

The adapters sit on the reference model (model.reference, or the starting policy): a checkpoint's `adapter/` is
loaded on top of that base, never on the checkpoint's merged weights, so the base under the adapters never moves.
"""

from __future__ import annotations

from pathlib import Path

import torch

ADAPTER_DIR = "adapter"  # in a LoRA checkpoint: PEFT's adapter_config.json + adapter_model.safetensors


def lora_policy(base, checkpoint: str | Path, settings):
    """The PEFT model training `settings.lora_*` adapters on `base` (loaded trainable=False): the adapter of
    `checkpoint` when it holds one, else fresh adapters (B = 0: the policy starts equal to the base)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    saved = Path(checkpoint) / ADAPTER_DIR
    if saved.is_dir():
        return PeftModel.from_pretrained(base, str(saved), is_trainable=True)
    config = LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                        target_modules=_targets(settings.lora_target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def _targets(names) -> str | list[str]:
    names = list(names)
    return names[0] if names == ["all-linear"] else names  # PEFT's shorthand: every linear layer but the output


def merged_state_dict(policy) -> dict[str, torch.Tensor]:
    """The weights of base + adapters under the base model's own (HF) names, computed beside the model: merging
    in place and back would leave rounding in the base weights, which are also the KL reference."""
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                delta = module.get_delta_weight(adapter).detach()
                deltas[f"{name}.weight"] = deltas.get(f"{name}.weight", 0) + delta
    merged = {}
    for key, tensor in base.state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        merged[key] = (tensor + deltas[key].to(tensor.dtype)) if key in deltas else tensor.detach()
    return merged


def save_lora(policy, path: Path) -> None:
    """Merged weights (an HF model any loader reads) + the adapter in `adapter/`."""
    base = policy.get_base_model()
    base.save_pretrained(path, state_dict=merged_state_dict(policy))
    policy.save_pretrained(str(Path(path) / ADAPTER_DIR))


class AdaptersOff(torch.nn.Module):
    """The base model under a PEFT policy, as a model: its forward runs with the adapters disabled."""

    def __init__(self, policy):
        super().__init__()
        self.__dict__["policy"] = policy  # not a submodule: its parameters are the policy's, not a copy
        self.train(False)

    @property
    def device(self) -> torch.device:
        return self.policy.device

    def train(self, mode: bool = True):
        self.training = mode
        return self

    def forward(self, *args, **kwargs):
        was_training = self.policy.training
        self.policy.train(self.training)
        try:
            with self.policy.disable_adapter():
                return self.policy(*args, **kwargs)
        finally:
            self.policy.train(was_training)
