"""The learner interface: train samples, settings, batching and per-token log-probs shared by every learner.

Learners register in LEARNERS by "module:factory" string: 'torch' runs one process on CPU or one GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from refiner_core.algo.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, TIS_LEVELS, TIS_MODES
from refiner_core.algo.packing import pack_sequences
from refiner_core.runtime.registry import resolve


@dataclass
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    rollout_logprobs: list[float]
    # Per response token: True where the policy sampled it. Tokens a tool-calling loop inserted (tool output,
    # template framing) are False and carry no loss. None: every response token was sampled.
    loss_mask: list[bool] | None = None


@dataclass(frozen=True)
class LearnerSettings:
    learning_rate: float
    weight_decay: float
    adam_betas: tuple[float, float]
    max_grad_norm: float
    beta: float
    kl_estimator: str
    kl_clamp: float
    clip_eps_low: float
    clip_eps_high: float
    loss_aggregation: str
    loss_constant: float
    micro_batch_size: int
    minibatches: int
    tis_cap: float
    pack_length: int
    precision: str
    temperature: float
    # How the 'deepspeed' learner launches its ranks; the one-process learners ignore them.
    world_size: int = 1
    zero_stage: int = 3
    hostfile: str = ""
    launch_over_ssh: bool = True
    deepspeed_offload_optimizer: bool = False
    # Set by the update stage, not the recipe: where the deepspeed learner's job folders go ('' = the system's
    # temporary folder; with a hostfile, the run folder, which every host shares).
    work_root: str = ""
    # LoRA (model.lora_*; refiner_core/learners/lora.py): rank 0 trains the full weights.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: tuple = ("all-linear",)
    lora_save_merged: bool = False  # checkpoints also hold base + adapters merged
    # One forward of each group's shared prompt, its keys/values reused by all of the group's responses.
    share_prompt: bool = False
    # Loss variants (refiner_core/algo/losses.py): by default the clipped surrogate, no entropy bonus, and per-token
    # truncation of the rollout importance weights when tis_cap > 0.
    policy_loss: str = "ppo_clip"
    dual_clip_c: float = 3.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    entropy_coef: float = 0.0
    tis_level: str = "token"
    tis_mode: str = "truncate"
    tis_floor: float = 0.0

    def __post_init__(self):
        for field, value, table in (
            ("policy_loss", self.policy_loss, POLICY_LOSSES),
            ("kl_estimator", self.kl_estimator, KL_ESTIMATORS),
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
        if self.tis_floor < 0 or (self.tis_cap > 0 and self.tis_floor > self.tis_cap):
            raise ValueError(f"tis_floor must be in [0, tis_cap], got {self.tis_floor} (tis_cap {self.tis_cap})")


class Learner(Protocol):
    def train_step(self, samples: list[TrainSample]) -> dict: ...

    def save(self, path: Path) -> None: ...

    def close(self) -> None: ...  # stop what the learner started (processes); it cannot be used afterwards


def pack_rows(samples: list[TrainSample], pack_length: int) -> list[list[int]]:
    """Sample indices per training row: one sequence per row when pack_length is 0, else first-fit-decreasing
    packs of at most pack_length tokens; a longer sequence gets a row of its own rather than failing the step."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    if pack_length <= 0:
        return [[i] for i in range(len(samples))]
    fits = [i for i, n in enumerate(lengths) if n <= pack_length]
    alone = [[i] for i, n in enumerate(lengths) if n > pack_length]
    return alone + [[fits[k] for k in pack] for pack in pack_sequences([lengths[i] for i in fits], pack_length)]


def collate_rows(rows: list[list[TrainSample]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of concatenated [prompt | response] sequences. Position IDs restart at 0 for every
    sequence and for the padding tail, which is how transformers isolates packed sequences (block-diagonal
    causal mask, no attention_mask passed). `mask[r, t]` marks positions whose *next* token is a sampled response
    token (the sample's loss_mask), so logits[:, t] score token t+1 and prompts, tool output, padding and sequence
    boundaries never enter the loss. Every
    position carries its own sequence's advantage, rollout logprob and response length, and `sequence_index`
    numbers the sequences of the batch (prompt and padding positions: one spare index past the last)."""
    lengths = [sum(len(s.prompt_ids) + len(s.response_ids) for s in row) for row in rows]
    width = max(lengths)
    R = len(rows)
    input_ids = torch.full((R, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, width), dtype=torch.long)
    targets = torch.zeros((R, width - 1), dtype=torch.long)
    per_token = {
        k: torch.zeros((R, width - 1), dtype=torch.float32)
        for k in ("mask", "rollout_logprobs", "advantages", "sequence_tokens")
    }
    sequence_index = torch.full((R, width - 1), sum(len(row) for row in rows), dtype=torch.long)
    sequence = 0
    for r, row in enumerate(rows):
        offset = 0
        for s in row:
            seq = s.prompt_ids + s.response_ids
            end = offset + len(seq)
            input_ids[r, offset:end] = torch.tensor(seq)
            position_ids[r, offset:end] = torch.arange(len(seq))
            targets[r, offset : end - 1] = torch.tensor(seq[1:])
            response = slice(offset + len(s.prompt_ids) - 1, end - 1)
            trained = (
                torch.ones(len(s.response_ids))
                if s.loss_mask is None
                else torch.tensor(s.loss_mask, dtype=torch.float32)
            )
            per_token["mask"][r, response] = trained
            per_token["rollout_logprobs"][r, response] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
            per_token["advantages"][r, response] = s.advantage
            per_token["sequence_tokens"][r, response] = float(trained.sum())
            sequence_index[r, response] = sequence
            sequence += 1
            offset = end
        position_ids[r, offset:] = torch.arange(width - offset)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "targets": targets,
        **per_token,
        "sequence_index": sequence_index,
        "sequences": torch.tensor(sum(len(row) for row in rows)),
        "real_tokens": torch.tensor(sum(lengths)),
        "computed_tokens": torch.tensor(R * width),
    }


def prompt_groups(samples: list[TrainSample]) -> list[list[int]]:
    """Sample indices per group of consecutive samples with the same prompt (a GRPO group, as rollouts are
    stored), in order."""
    groups: list[list[int]] = []
    for i, s in enumerate(samples):
        if groups and samples[groups[-1][0]].prompt_ids == s.prompt_ids:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def collate_group(samples: list[TrainSample], pad_id: int) -> dict[str, torch.Tensor]:
    """A group sharing one prompt, laid out to read the prompt once: `prefix_ids` [1, P] is the prompt, whose
    last position scores each response's first token; `input_ids` [G, W-1] are the responses right-padded to W
    without their last column (position t scores token t+1), at positions P, P+1, ... All per-token tensors are
    [G, W], aligned with the response tokens (`targets`), so losses and aggregations are those of collate_rows:
    right padding needs no attention mask, as causal attention never looks ahead."""
    prompt = samples[0].prompt_ids
    if any(s.prompt_ids != prompt for s in samples):
        raise ValueError("collate_group: samples of one group must share their prompt")
    width = max(len(s.response_ids) for s in samples)
    G = len(samples)
    targets = torch.full((G, width), pad_id, dtype=torch.long)
    per_token = {
        k: torch.zeros((G, width), dtype=torch.float32)
        for k in ("mask", "rollout_logprobs", "advantages", "sequence_tokens")
    }
    sequence_index = torch.full((G, width), G, dtype=torch.long)
    for r, s in enumerate(samples):
        n = len(s.response_ids)
        targets[r, :n] = torch.tensor(s.response_ids)
        sequence_index[r, :n] = r
        trained = torch.ones(n) if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        per_token["mask"][r, :n] = trained
        per_token["rollout_logprobs"][r, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        per_token["advantages"][r, :n] = s.advantage
        per_token["sequence_tokens"][r, :n] = float(trained.sum())
    P = len(prompt)
    return {
        "prefix_ids": torch.tensor([prompt]),
        "input_ids": targets[:, :-1].clone(),
        "position_ids": torch.arange(P, P + width - 1).expand(G, -1).clone(),
        "targets": targets,
        **per_token,
        "sequence_index": sequence_index,
        "sequences": torch.tensor(G),
        "real_tokens": torch.tensor(G * P + sum(len(s.response_ids) for s in samples)),
        "computed_tokens": torch.tensor(P + G * (width - 1)),
    }


def collate(samples: list[TrainSample], pad_id: int) -> dict[str, torch.Tensor]:
    """One sequence per row, right-padded."""
    return collate_rows([[s] for s in samples], pad_id)


def autocast(precision: str, device: torch.device):
    """'bf16': bfloat16 autocast over the forward pass; weights, gradients and optimizer state stay as loaded."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"unknown precision {precision!r}; choose from ['bf16', 'fp32']")


def token_logprobs(model, batch: dict[str, torch.Tensor], temperature: float, precision: str = "fp32") -> torch.Tensor:
    """log pi(token_{t+1} | <= t) under the same temperature the sampler used; [R, T-1], computed in fp32.

    Logits are computed only from the first position any row scores (`logits_to_keep`): the vocabulary
    projection and log-softmax over the prompt part of padded rows would be thrown away. Positions before it are
    0 and carry no mask."""
    return token_scores(model, batch, temperature, precision)[0]


def token_scores(
    model, batch: dict[str, torch.Tensor], temperature: float, precision: str = "fp32", entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token_logprobs, and with `entropy` the entropy of every scored position's next-token distribution,
    H = logsumexp(z) - sum softmax(z) z over the same temperature-scaled fp32 logits z, else None). The entropy
    costs one more pass over the logits already computed, no extra forward."""
    if "prefix_ids" in batch:
        logits, start = _group_logits(model, batch, precision), 0
    else:
        logits, start = _row_logits(model, batch, precision)
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    normaliser = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, batch["targets"][:, start:].unsqueeze(-1)).squeeze(-1)
    logp = _from_start(picked - normaliser, batch["targets"].shape, start)
    if not entropy:
        return logp, None
    probs = torch.exp(logits - normaliser.unsqueeze(-1))
    return logp, _from_start(normaliser - (probs * logits).sum(-1), batch["targets"].shape, start)


def _from_start(scored: torch.Tensor, shape: torch.Size, start: int) -> torch.Tensor:
    """[R, T-1] with `scored` from column `start` on and 0 before it."""
    if start == 0:
        return scored
    out = torch.zeros(shape, dtype=scored.dtype, device=scored.device)
    out[:, start:] = scored
    return out


def _row_logits(model, batch: dict[str, torch.Tensor], precision: str) -> tuple[torch.Tensor, int]:
    """Logits of a collate_rows batch from the first scored position on, and that position."""
    width = batch["targets"].shape[1]
    scored = batch["mask"].any(0).nonzero()
    start = int(scored[0]) if len(scored) else width
    with autocast(precision, model.device):
        logits = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            use_cache=False,
            logits_to_keep=width + 1 - start,
        ).logits
    return logits[:, :-1], start


def _group_logits(model, batch: dict[str, torch.Tensor], precision: str) -> torch.Tensor:
    """Logits of a collate_group batch, [G, W, V]: the prompt's forward runs once and its cached keys and
    values (repeated per response, still part of the graph) serve every response's forward, so the prompt's
    gradient is the sum over the group, as if it were computed G times."""
    G = batch["targets"].shape[0]
    with autocast(precision, model.device):
        prefix = model(input_ids=batch["prefix_ids"], use_cache=True, logits_to_keep=1)
        logits = prefix.logits.expand(G, -1, -1)
        if batch["input_ids"].shape[1] > 0:
            cache = prefix.past_key_values
            cache.batch_repeat_interleave(G)
            rest = model(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], past_key_values=cache, use_cache=True
            ).logits
            logits = torch.cat([logits, rest], dim=1)
    return logits


LEARNERS: dict[str, str] = {
    "torch": "refiner_core.learners.torch_learner:make_torch_learner",
    "deepspeed": "refiner_core.learners.deepspeed_learner:make_deepspeed_learner",
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
