"""Training batches: samples packed into rows (first-fit-decreasing), rows collated into tensors, and a prompt's
group collated to share the prompt's forward pass."""

from __future__ import annotations

import torch

from refiner_core.algo.packing import pack_sequences
from refiner_core.learners.base import TrainSample

# Per-token log-probs a sample may carry from before the update (TrainSample); a batch holds each one only when
# every sample in it does.
CARRIED_LOGPROBS = ("old_logprobs", "reference_logprobs")


def _logprob_keys(samples: list[TrainSample]) -> tuple[str, ...]:
    """The per-token log-probs a batch of `samples` lays out: the sampler's, and each carried one all of them hold."""
    return ("rollout_logprobs", *(k for k in CARRIED_LOGPROBS if all(getattr(s, k) is not None for s in samples)))


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
    numbers the sequences of the batch (prompt and padding positions: one spare index past the last). Log-probs
    the samples carry from before the update (CARRIED_LOGPROBS) are laid out like rollout_logprobs."""
    logprob_keys = _logprob_keys([s for row in rows for s in row])
    lengths = [sum(len(s.prompt_ids) + len(s.response_ids) for s in row) for row in rows]
    width = max(lengths)
    R = len(rows)
    input_ids = torch.full((R, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, width), dtype=torch.long)
    targets = torch.zeros((R, width - 1), dtype=torch.long)
    per_token = {
        k: torch.zeros((R, width - 1), dtype=torch.float32)
        for k in ("mask", "advantages", "sequence_tokens", *logprob_keys)
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
            for k in logprob_keys:
                per_token[k][r, response] = torch.tensor(getattr(s, k), dtype=torch.float32)
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
    logprob_keys = _logprob_keys(samples)
    targets = torch.full((G, width), pad_id, dtype=torch.long)
    per_token = {
        k: torch.zeros((G, width), dtype=torch.float32)
        for k in ("mask", "advantages", "sequence_tokens", *logprob_keys)
    }
    sequence_index = torch.full((G, width), G, dtype=torch.long)
    for r, s in enumerate(samples):
        n = len(s.response_ids)
        targets[r, :n] = torch.tensor(s.response_ids)
        sequence_index[r, :n] = r
        trained = torch.ones(n) if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        per_token["mask"][r, :n] = trained
        for k in logprob_keys:
            per_token[k][r, :n] = torch.tensor(getattr(s, k), dtype=torch.float32)
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
