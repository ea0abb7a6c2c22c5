"""The learner interface: train samples, settings and the Learner protocol (batching.py packs and collates
samples, logprobs.py scores them).

Learners register in LEARNERS by "module:factory" string: 'torch' runs one process on CPU or one GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from refiner_core.algo.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    TIS_LEVELS,
    TIS_MODES,
    SurrogateParams,
)
from refiner_core.runtime.registry import Backend, Registry, resolve


@dataclass
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    rollout_logprobs: list[float]
    # Per response token: True where the policy sampled it. Tokens a tool-calling loop inserted (tool output,
    # template framing) are False and carry no loss. None: every response token was sampled.
    loss_mask: list[bool] | None = None
    # Per response token, under the weights before this update, where the KL in the reward already scored the
    # response (SequenceKL): pi_old and pi_ref, which the update then reads instead of running those forwards
    # again (verl's old_log_prob and ref_log_prob serve its KL penalty and its loss alike). None: the update
    # scores them itself.
    old_logprobs: list[float] | None = None
    reference_logprobs: list[float] | None = None

    @property
    def trained_tokens(self) -> int:
        """Response tokens that carry a loss (all of them without a loss_mask)."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)


@dataclass
class SequenceKL:
    """One response scored under the weights before an update (grpo.kl_reward_coef's measure): `total`, the sum
    over its trained tokens of kl_reward_estimator(log pi - log pi_ref), d clamped to kl_clamp; and per response
    token the two log-probs it came from, which the update reuses (TrainSample.old_logprobs, reference_logprobs);
    a token that carries no loss (loss_mask False) may read 0 there."""

    total: float
    old_logprobs: list[float]
    reference_logprobs: list[float]

    def carried(self) -> dict[str, list[float]]:
        """The log-probs under the names a TrainSample (and a rollout row bound for one) carries them by."""
        return {"old_logprobs": self.old_logprobs, "reference_logprobs": self.reference_logprobs}


@dataclass(frozen=True)
class LearnerSettings:
    learning_rate: float
    weight_decay: float
    adam_betas: tuple[float, float]
    max_grad_norm: float
    beta: float
    kl_estimator: str
    kl_clamp: float
    kl_reward_coef: float  # > 0: the reference is loaded for sequence_kl (grpo.kl_reward_coef)
    kl_reward_estimator: str
    clip_eps_low: float
    clip_eps_high: float
    loss_aggregation: str
    loss_constant: float
    micro_batch_size: int
    minibatches: int
    epochs: int
    tis_cap: float
    pack_length: int
    packed_attention: str  # 'mask' or 'per_sequence' (refiner_core/learners/packed_attention.py)
    compile_layers: bool  # torch.compile the policy's decoder layers (torch learner)
    gradient_checkpointing: bool  # recompute the policy's layer activations in the backward pass
    logit_chunk_tokens: int  # > 0: the output layer and log-softmax that many positions at a time (logprobs.py)
    precision: str
    temperature: float
    # How the 'deepspeed' learner launches its ranks; the one-process learners ignore them.
    world_size: int
    zero_stage: int
    hostfile: str
    launch_over_ssh: bool
    deepspeed_offload_optimizer: bool
    # LoRA (model.lora_*; refiner_core/learners/lora.py): rank 0 trains the full weights.
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: tuple
    lora_save_merged: bool  # checkpoints also hold base + adapters merged
    # One forward of each group's shared prompt, its keys/values reused by all of the group's responses.
    share_prompt: bool
    # Loss variants (refiner_core/algo/losses.py).
    policy_loss: str
    dual_clip_c: float
    sapo_tau_pos: float
    sapo_tau_neg: float
    entropy_coef: float
    adaptive_entropy: bool  # the coefficient comes with each step (train_step's entropy_coef); entropy is measured
    kl_cov_ratio: float
    kl_cov_coef: float
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float
    off_policy_mask_threshold: float
    top_entropy_quantile: float
    tis_level: str
    tis_mode: str
    tis_floor: float
    # Set by the update stage, not the recipe: where the deepspeed learner's job folders go ('' = the system's
    # temporary folder; with a hostfile, the run folder, which every host shares).
    work_root: str = ""

    def __post_init__(self):
        for field, value, table in (
            ("policy_loss", self.policy_loss, POLICY_LOSSES),
            ("kl_estimator", self.kl_estimator, KL_ESTIMATORS),
            ("kl_reward_estimator", self.kl_reward_estimator, KL_ESTIMATORS),
            ("loss_aggregation", self.loss_aggregation, AGGREGATIONS),
            ("tis_level", self.tis_level, TIS_LEVELS),
            ("tis_mode", self.tis_mode, TIS_MODES),
        ):
            if value not in table:
                raise ValueError(f"unknown {field} {value!r}; choose from {sorted(table)}")
        if self.policy_loss == "dual_clip" and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (the bound is -A * c for A < 0), got {self.dual_clip_c}")
        if self.policy_loss == "sapo" and min(self.sapo_tau_pos, self.sapo_tau_neg) <= 0:
            raise ValueError(f"sapo temperatures must be > 0, got {self.sapo_tau_pos}, {self.sapo_tau_neg}")
        if self.policy_loss == "kl_cov" and not 0 < self.kl_cov_ratio <= 1:
            raise ValueError(f"kl_cov_ratio must be in (0, 1], got {self.kl_cov_ratio}")
        if self.policy_loss == "clip_cov" and not 0 < self.clip_cov_ratio <= 1:
            raise ValueError(f"clip_cov_ratio must be in (0, 1], got {self.clip_cov_ratio}")
        if self.policy_loss == "clip_cov" and self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb must be below clip_cov_ub, got {self.clip_cov_lb} >= {self.clip_cov_ub}")
        if self.policy_loss == "vespo" and (
            min(self.vespo_k_pos, self.vespo_k_neg) < 0 or min(self.vespo_lambda_pos, self.vespo_lambda_neg) <= 0
        ):
            raise ValueError("vespo exponents k must be >= 0 and decay rates lambda > 0")
        if self.off_policy_mask_threshold < 0:
            raise ValueError(f"off_policy_mask_threshold must be >= 0, got {self.off_policy_mask_threshold}")
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        if self.tis_floor < 0 or (self.tis_cap > 0 and self.tis_floor > self.tis_cap):
            raise ValueError(f"tis_floor must be in [0, tis_cap], got {self.tis_floor} (tis_cap {self.tis_cap})")

    @property
    def reads_reference(self) -> bool:
        """Whether the learner holds the reference model: for the KL loss term (beta) or the KL in the reward."""
        return self.beta > 0 or self.kl_reward_coef > 0


# SurrogateParams' fields the learner does not take from the settings by name
_NOT_KNOBS = {"eps_low", "eps_high", "selection_seed"}


def surrogate_knobs(settings: LearnerSettings) -> dict:
    """The policy losses' own knobs (SurrogateParams), each read from the settings field of its name."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(SurrogateParams) if f.name not in _NOT_KNOBS}


class Learner(Protocol):
    def train_step(
        self, samples: list[TrainSample], learning_rate: float | None = None, entropy_coef: float | None = None
    ) -> dict:
        """One update; returns its metrics under the steps table's names (refiner_core/schema.py STEPS): loss,
        pg_loss, kl, clip_fraction, grad_norm, lr, response_tokens, packing_efficiency, update_seconds; optionally
        skipped_optimizer_steps, entropy, importance_weight_mean, off_policy_masked (NULL when left out)."""
        ...

    def save(self, path: Path) -> None: ...

    def sequence_kl(self, samples: list[TrainSample]) -> list[SequenceKL]: ...  # grpo.kl_reward_coef's measure

    def close(self) -> None: ...  # stop what the learner started (processes); it cannot be used afterwards


LEARNERS: Registry = {
    "torch": "refiner_core.learners.torch_learner:make_torch_learner",
    # ranks launched as processes of their own, with the settings of grpo.deepspeed
    "deepspeed": Backend("refiner_core.learners.deepspeed_learner:make_deepspeed_learner", section="grpo.deepspeed"),
}


def make_learner(
    kind: str,
    policy_path,
    reference_path,
    tokenizer,
    settings: LearnerSettings,
    optimizer_state,
    dtype: str = "float32",
) -> Learner:
    return resolve(LEARNERS, "learner", kind)(policy_path, reference_path, tokenizer, settings, optimizer_state, dtype)
