"""The learner interface: train samples, settings, batching and per-token log-probs shared by every learner.

Learners register in LEARNERS by "module:factory" string: 'torch' runs one process on CPU or one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from refiner_core.registry import resolve


@dataclass
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    rollout_logprobs: list[float]


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
    temperature: float


class Learner(Protocol):
    def train_step(self, samples: list[TrainSample]) -> dict: ...

    def save(self, path: Path) -> None: ...


def collate(samples: list[TrainSample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded [prompt | response] rows. `response_mask[b, t]` marks positions whose *next* token is a
    response token, so logits[:, t] score token t+1 and the prompt and padding never enter the loss."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = max(lengths)
    B = len(samples)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention = torch.zeros((B, width), dtype=torch.long)
    targets = torch.zeros((B, width - 1), dtype=torch.long)
    mask = torch.zeros((B, width - 1), dtype=torch.float32)
    rollout_lp = torch.zeros((B, width - 1), dtype=torch.float32)
    for b, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        input_ids[b, : len(seq)] = torch.tensor(seq)
        attention[b, : len(seq)] = 1
        targets[b, : len(seq) - 1] = torch.tensor(seq[1:])
        start, end = len(s.prompt_ids) - 1, len(seq) - 1
        mask[b, start:end] = 1.0
        rollout_lp[b, start:end] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention, "targets": targets, "mask": mask,
            "rollout_logprobs": rollout_lp, "advantages": advantages}


def token_logprobs(model, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """log pi(token_{t+1} | <= t) under the same temperature the sampler used; [B, T-1]."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


LEARNERS: dict[str, str] = {"torch": "refiner_core.learners.torch_learner:make_torch_learner"}


def make_learner(kind: str, policy_path, reference_path, tokenizer, settings: LearnerSettings, optimizer_state,
                 dtype: str = "float32") -> Learner:
    return resolve(LEARNERS, "learner", kind)(policy_path, reference_path, tokenizer, settings, optimizer_state, dtype)
