"""LoRA (model.lora_rank > 0) for the torch and DeepSpeed learners, with PEFT: only the adapters train; the KL
reference is the same model with its adapters switched off (no second copy); checkpoints hold the adapter in
`adapter/` (what a resumed update trains on, what a vLLM engine applies to the base) and, with
model.lora_save_merged, the merged weights too (a plain HF model; refiner_core.models.load_model merges an
adapter-only checkpoint itself).

The adapters sit on the reference model (model.reference, or the starting policy): a checkpoint's `adapter/` is
loaded on top of that base, never on the checkpoint's merged weights, so the base under the adapters never moves.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from refiner_core.models import ADAPTER_DIR, LOADING_MODELS, Adapter, recorded_base
from refiner_core.runtime.scratch import ram_dir

ADAPTER_SEED = 0


def lora_policy(base, checkpoint: str | Path | None, settings):
    """The PEFT model training `settings.lora_*` adapters on `base` (loaded trainable=False): the adapter of
    `checkpoint` (a later step of the run) when it holds one, else fresh adapters (B = 0: the policy starts equal
    to the base)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    saved = Path(checkpoint) / ADAPTER_DIR if checkpoint is not None else None
    if saved is not None and saved.is_dir():
        with LOADING_MODELS:  # one model load at a time (refiner_core.models)
            policy = PeftModel.from_pretrained(base, str(saved), is_trainable=True)
    else:
        config = LoraConfig(
            r=settings.lora_rank,
            lora_alpha=settings.lora_alpha,
            lora_dropout=settings.lora_dropout,
            target_modules=_targets(settings.lora_target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        # A's random start from a fixed seed: every process (the torch learner, each DeepSpeed rank, a rerun)
        # starts the same adapters, without touching the global RNG the run's sampling uses.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ADAPTER_SEED)
            policy = get_peft_model(base, config)
    # The base loaded here, found from any folder: PEFT records the path as given, and a loaded adapter the base of
    # the run that saved it (a fork's parent).
    policy.peft_config["default"].base_model_name_or_path = str(Path(base.name_or_path).resolve())
    return policy


def _targets(names) -> str | list[str]:
    names = list(names)
    return names[0] if names == ["all-linear"] else names  # PEFT's shorthand: every linear layer but the output


def merged_state_dict(policy, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The weights of base + adapters under the base model's own (HF) names, computed beside the model: merging
    in place and back would leave rounding in the base weights, which are also the KL reference. `state`: the
    PEFT model's full state dict when its parameters live elsewhere (gathered ZeRO-3 partitions)."""
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                if state is None:
                    delta = module.get_delta_weight(adapter).detach()
                else:  # the same product, from the gathered tensors
                    key = f"base_model.model.{name}.lora_%s.{adapter}.weight"
                    b, a = state[key % "B"].float(), state[key % "A"].float()
                    delta = (b @ a) * module.scaling[adapter]
                    delta = delta.T if module.fan_in_fan_out else delta
                deltas[f"{name}.weight"] = deltas.get(f"{name}.weight", 0) + delta
    if state is None:
        state = base.state_dict()
    else:  # the PEFT model's names, less its wrapper prefix
        state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    merged = {}
    for key, tensor in state.items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        # summed in fp32 and rounded once, as PEFT's merge: a bf16 delta added in bf16 rounded twice (1 ulp off)
        merged[key] = (tensor.float() + deltas[key].float()).to(tensor.dtype) if key in deltas else tensor.detach()
    return merged


def save_lora(policy, path: Path, merged: bool, state: dict | None = None) -> None:
    """The adapter in `adapter/` and, when `merged`, the merged weights (an HF model any loader reads), else the
    base's config and generation config only (the folder still names the architecture). The adapter records its
    base as refiner_core.models.recorded_base gives it. `state`: the full state dict of the PEFT model when its
    parameters live elsewhere (gathered from ZeRO-3 partitions)."""
    base = policy.get_base_model()
    if merged:
        base.save_pretrained(path, state_dict=merged_state_dict(policy, state))
    else:
        base.config.save_pretrained(path)
        if base.generation_config is not None:
            base.generation_config.save_pretrained(path)
    adapter = Path(path) / ADAPTER_DIR
    policy.save_pretrained(str(adapter), state_dict=_adapter_state(state))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = recorded_base(config["base_model_name_or_path"], path)
    (adapter / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def _adapter_state(state: dict | None) -> dict | None:
    """The adapter part of a full PEFT state dict, under the names PEFT's save_pretrained expects."""
    return None if state is None else {k: v for k, v in state.items() if ".lora_" in k}


class AdapterExports:
    """Where a learner writes its adapters for rollout engines (model.lora_sync 'adapter'): a new folder per export,
    since an engine reads the folder it is handed when it next samples; the one before is deleted."""

    def __init__(self, base: str, rank: int, root: str | None = None):
        self.base, self.rank = base, rank
        self.root = Path(tempfile.mkdtemp(prefix="refiner-adapter-", dir=root or ram_dir()))
        self.count = 0
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)

    def next_folder(self) -> Path:
        shutil.rmtree(self.root / str(self.count), ignore_errors=True)
        self.count += 1
        return self.root / str(self.count)

    def adapter(self) -> Adapter:
        return Adapter(str(self.root / str(self.count)), self.base, self.rank)

    def close(self) -> None:
        self._cleanup()


class AdaptersOff(torch.nn.Module):
    """The base model under a PEFT policy, as a model: its forward runs with the adapters disabled."""

    def __init__(self, policy):
        super().__init__()
        self.__dict__["policy"] = policy  # not a submodule: its parameters are the policy's, not a copy
        self.train(False)

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def config(self):
        return self.policy.config

    def get_output_embeddings(self):  # the base's: adapters leave the output layer alone ("all-linear" skips it)
        return self.policy.get_output_embeddings()

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
