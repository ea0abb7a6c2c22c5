"""Per-token log-probs (and entropies) of a collated batch under the sampler's temperature, in fp32, with the
forward pass in the learner's precision."""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint


def autocast(precision: str, device: torch.device):
    """'bf16': bfloat16 autocast over the forward pass; weights, gradients and optimizer state stay as loaded."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"unknown precision {precision!r}; choose from ['bf16', 'fp32']")


def token_logprobs(
    model, batch: dict[str, torch.Tensor], temperature: float, precision: str = "fp32", chunk: int = 0
) -> torch.Tensor:
    """log pi(token_{t+1} | <= t) under the same temperature the sampler used; [R, T-1], computed in fp32.

    Logits are computed only from the first position any row scores (`logits_to_keep`): the vocabulary
    projection and log-softmax over the prompt part of padded rows would be thrown away. Positions before it are
    0 and carry no mask. `chunk` > 0: `chunk` positions of logits at a time (chunked_scores)."""
    return token_scores(model, batch, temperature, precision, chunk=chunk)[0]


def token_scores(
    model,
    batch: dict[str, torch.Tensor],
    temperature: float,
    precision: str = "fp32",
    entropy: bool = False,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token_logprobs, and with `entropy` the entropy of every scored position's next-token distribution,
    H = logsumexp(z) - sum softmax(z) z over the same temperature-scaled fp32 logits z, else None). The entropy
    costs one more pass over the logits already computed, no extra forward. `chunk` > 0 (rows, not shared
    prompts): the output layer and the log-softmax run `chunk` positions at a time (chunked_scores)."""
    if "prefix_ids" in batch:
        logits, start = _group_logits(model, batch, precision), 0
    elif chunk:
        return chunked_scores(model, batch, temperature, precision, entropy, chunk)
    else:
        logits, start = _row_logits(model, batch, precision)
    logp, ent = _scores(logits, batch["targets"][:, start:], temperature, entropy)
    shape = batch["targets"].shape
    return _from_start(logp, shape, start), (_from_start(ent, shape, start) if entropy else None)


def _scores(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    """(log-prob of each target, entropy or None) from logits [..., V], in fp32 at the sampler's temperature."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    normaliser = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return picked - normaliser, None
    probs = torch.exp(logits - normaliser.unsqueeze(-1))
    return picked - normaliser, normaliser - (probs * logits).sum(-1)


# Causal LMs whose logits are the output layer applied to the decoder's last hidden state, nothing after it
# (no soft-capping or scaling), so the output layer can run a chunk of positions at a time.
PLAIN_OUTPUT_LAYER = ("llama", "mistral", "qwen2", "qwen3")


def chunked_scores(
    model, batch: dict[str, torch.Tensor], temperature: float, precision: str, entropy: bool, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_scores of a collate_rows batch with the output layer and the log-softmax run `chunk` positions at a
    time, each chunk's logits recomputed in the backward pass rather than kept (grpo.logit_chunk_tokens): the fp32
    logits of every scored position (V = 151936 for Qwen3: 0.6 MB a position, about 5 GB for an 8192-token pack,
    held several times over by the log-softmax and its gradient) never exist at once. The same values as
    computing them whole, up to rounding."""
    model = getattr(model, "module", model)  # a DeepSpeed engine's model (ZeRO-3 gathers on each submodule's call)
    kind = model.config.model_type
    if kind not in PLAIN_OUTPUT_LAYER:
        raise ValueError(
            f"grpo.logit_chunk_tokens: the output layer of a {kind!r} model may do more than a projection; "
            f"chunked log-probs are for {', '.join(PLAIN_OUTPUT_LAYER)} (set grpo.logit_chunk_tokens=0)"
        )
    width, start = batch["targets"].shape[1], _first_scored(batch)
    if start == width:  # nothing scored (a zero-weight pass): one position's logits, still in the graph
        return token_scores(model, batch, temperature, precision, entropy)
    with autocast(precision, model.device):
        hidden = model.get_decoder()(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).last_hidden_state[:, start:width]
    head = model.get_output_embeddings()

    def scores(h: torch.Tensor, targets: torch.Tensor):
        with autocast(precision, model.device):
            logits = head(h)
        return _scores(logits, targets, temperature, entropy)

    parts = []
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    for a in range(0, width - start, chunk):
        args = (hidden[:, a : a + chunk], batch["targets"][:, start + a : start + a + chunk])
        parts.append(
            torch.utils.checkpoint.checkpoint(scores, *args, use_reentrant=False) if recompute else scores(*args)
        )
    shape = batch["targets"].shape
    logp = _from_start(torch.cat([p[0] for p in parts], dim=1), shape, start)
    return logp, (_from_start(torch.cat([p[1] for p in parts], dim=1), shape, start) if entropy else None)


def _first_scored(batch: dict[str, torch.Tensor]) -> int:
    """The first position any row of a collate_rows batch scores (the width when none does)."""
    scored = batch["mask"].any(0).nonzero()
    return int(scored[0]) if len(scored) else batch["targets"].shape[1]


def _from_start(scored: torch.Tensor, shape: torch.Size, start: int) -> torch.Tensor:
    """[R, T-1] with `scored` from column `start` on and 0 before it."""
    if start == 0:
        return scored
    out = torch.zeros(shape, dtype=scored.dtype, device=scored.device)
    out[:, start:] = scored
    return out


def _row_logits(model, batch: dict[str, torch.Tensor], precision: str) -> tuple[torch.Tensor, int]:
    """Logits of a collate_rows batch from the first scored position on, and that position."""
    width, start = batch["targets"].shape[1], _first_scored(batch)
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
