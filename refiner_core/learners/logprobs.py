"""Per-token log-probs (and entropies) of a collated batch under the sampler's temperature, in fp32, with the
forward pass in the learner's precision."""

from __future__ import annotations

import contextlib

import torch


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
