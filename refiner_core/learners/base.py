"""The learner interface: train samples, settings, batching and per-token log-probs shared by every learner.

Learners register in LEARNERS by "module:factory" string: 'torch' runs one process on CPU or one GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from refiner_core.packing import pack_sequences
from refiner_core.registry import resolve


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
    deepspeed_offload_optimizer: bool = False
    # One forward of each group's shared prompt, its keys/values reused by all of the group's responses.
    share_prompt: bool = False


class Learner(Protocol):
    def train_step(self, samples: list[TrainSample]) -> dict: ...

    def save(self, path: Path) -> None: ...


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
    position carries its own sequence's advantage, rollout logprob and response length."""
    lengths = [sum(len(s.prompt_ids) + len(s.response_ids) for s in row) for row in rows]
    width = max(lengths)
    R = len(rows)
    input_ids = torch.full((R, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, width), dtype=torch.long)
    targets = torch.zeros((R, width - 1), dtype=torch.long)
    per_token = {k: torch.zeros((R, width - 1), dtype=torch.float32)
                 for k in ("mask", "rollout_logprobs", "advantages", "sequence_tokens")}
    for r, row in enumerate(rows):
        offset = 0
        for s in row:
            seq = s.prompt_ids + s.response_ids
            end = offset + len(seq)
            input_ids[r, offset:end] = torch.tensor(seq)
            position_ids[r, offset:end] = torch.arange(len(seq))
            targets[r, offset : end - 1] = torch.tensor(seq[1:])
            response = slice(offset + len(s.prompt_ids) - 1, end - 1)
            trained = (torch.ones(len(s.response_ids)) if s.loss_mask is None
                       else torch.tensor(s.loss_mask, dtype=torch.float32))
            per_token["mask"][r, response] = trained
            per_token["rollout_logprobs"][r, response] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
            per_token["advantages"][r, response] = s.advantage
            per_token["sequence_tokens"][r, response] = float(trained.sum())
            offset = end
        position_ids[r, offset:] = torch.arange(width - offset)
    return {"input_ids": input_ids, "position_ids": position_ids, "targets": targets, **per_token,
            "sequences": torch.tensor(sum(len(row) for row in rows)), "real_tokens": torch.tensor(sum(lengths)),
            "computed_tokens": torch.tensor(R * width)}


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
    per_token = {k: torch.zeros((G, width), dtype=torch.float32)
                 for k in ("mask", "rollout_logprobs", "advantages", "sequence_tokens")}
    for r, s in enumerate(samples):
        n = len(s.response_ids)
        targets[r, :n] = torch.tensor(s.response_ids)
        trained = torch.ones(n) if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        per_token["mask"][r, :n] = trained
        per_token["rollout_logprobs"][r, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        per_token["advantages"][r, :n] = s.advantage
        per_token["sequence_tokens"][r, :n] = float(trained.sum())
    P = len(prompt)
    return {"prefix_ids": torch.tensor([prompt]), "input_ids": targets[:, :-1].clone(),
            "position_ids": torch.arange(P, P + width - 1).expand(G, -1).clone(), "targets": targets, **per_token,
            "sequences": torch.tensor(G), "real_tokens": torch.tensor(G * P + sum(len(s.response_ids) for s in samples)),
            "computed_tokens": torch.tensor(P + G * (width - 1))}


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
    if "prefix_ids" in batch:
        return _group_logprobs(model, batch, temperature, precision)
    width = batch["targets"].shape[1]
    scored = batch["mask"].any(0).nonzero()
    start = int(scored[0]) if len(scored) else width
    with autocast(precision, model.device):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                       logits_to_keep=width + 1 - start).logits
    logits = logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, batch["targets"][:, start:].unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(batch["targets"].shape, dtype=logits.dtype, device=logits.device)
    out[:, start:] = picked - torch.logsumexp(logits, dim=-1)
    return out


def _group_logprobs(model, batch: dict[str, torch.Tensor], temperature: float, precision: str) -> torch.Tensor:
    """token_logprobs of a collate_group batch, [G, W]: the prompt's forward runs once and its cached keys and
    values (repeated per response, still part of the graph) serve every response's forward, so the prompt's
    gradient is the sum over the group, as if it were computed G times."""
    G = batch["targets"].shape[0]
    with autocast(precision, model.device):
        prefix = model(input_ids=batch["prefix_ids"], use_cache=True, logits_to_keep=1)
        logits = prefix.logits.expand(G, -1, -1)
        if batch["input_ids"].shape[1] > 0:
            cache = prefix.past_key_values
            cache.batch_repeat_interleave(G)
            rest = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], past_key_values=cache,
                         use_cache=True).logits
            logits = torch.cat([logits, rest], dim=1)
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


LEARNERS: dict[str, str] = {"torch": "refiner_core.learners.torch_learner:make_torch_learner",
                             "deepspeed": "refiner_core.learners.deepspeed_learner:make_deepspeed_learner"}


def make_learner(kind: str, policy_path, reference_path, tokenizer, settings: LearnerSettings, optimizer_state,
                 dtype: str = "float32") -> Learner:
    return resolve(LEARNERS, "learner", kind)(policy_path, reference_path, tokenizer, settings, optimizer_state, dtype)
