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
    time, forward and backward (grpo.logit_chunk_tokens, ChunkedOutputScores): the fp32 logits of every scored
    position (V = 151936 for Qwen3: 0.6 MB a position, about 5 GB for an 8192-token pack, held several times over
    by the log-softmax and its gradient) never exist at once. The same values as computing them whole, up to
    rounding."""
    unwrapped = getattr(model, "module", model)  # a DeepSpeed engine's model
    kind = unwrapped.config.model_type
    if kind not in PLAIN_OUTPUT_LAYER:
        raise ValueError(
            f"grpo.logit_chunk_tokens: the output layer of a {kind!r} model may do more than a projection; "
            f"chunked log-probs are for {', '.join(PLAIN_OUTPUT_LAYER)} (set grpo.logit_chunk_tokens=0)"
        )
    head = unwrapped.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(
            f"grpo.logit_chunk_tokens: the output layer is a {type(head).__name__}, not a plain Linear (an adapter on "
            "it?); chunked log-probs need the plain projection (set grpo.logit_chunk_tokens=0)"
        )
    width, start = batch["targets"].shape[1], _first_scored(batch)
    # Nothing scored (a rank's zero-weight pass): the last position, through the same function as every other
    # micro-batch; ZeRO-3 ranks running other code for one micro-batch wait on each other's collectives for ever.
    start = min(start, width - 1)
    dtype = torch.bfloat16 if precision == "bf16" else head.weight.dtype  # what autocast's linear computes in
    targets = batch["targets"][:, start:]

    def scores(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the positions from start to width: the last has no target
        args = (hidden[:, :-1], head.weight, head.bias, targets, temperature, entropy, chunk, dtype)
        return ChunkedOutputScores.apply(*args)

    # The whole model's forward with the output layer's own forward computing the scores: ZeRO-3 gathers a weight
    # around its module's call and again before the backward of what the call returned, and its gradients
    # accumulate over micro-batches only through the top module's forward (submodules called apart lost all but
    # the last micro-batch's, measured).
    with _forward_as(head, scores), autocast(precision, unwrapped.device):
        logp, ent = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            use_cache=False,
            logits_to_keep=width + 1 - start,
        ).logits
    shape = batch["targets"].shape
    return _from_start(logp, shape, start), (_from_start(ent, shape, start) if entropy else None)


@contextlib.contextmanager
def _forward_as(module: torch.nn.Module, forward):
    """`module` computes `forward` when called (its hooks still run around it); a forward set on the instance
    before (a wrapper of accelerate's, say) comes back after."""
    before = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if before is None:
            del module.forward
        else:
            module.forward = before


class ChunkedOutputScores(torch.autograd.Function):
    """(log-prob of each target, entropy) of softmax((hidden W^T + b) / temperature), computed `chunk` positions
    at a time in fp32 (float64 for float64 inputs) from `dtype` logits, as autocast's linear gives them. Only each
    position's log-normaliser is kept for the backward pass, which computes each chunk's logits again and from
    them the gradients of the hidden states, the weight (summed over chunks in fp32) and the bias. The weight
    enters the graph once, so hooks on its gradient (DeepSpeed's) fire once."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, entropy, chunk, dtype):
        divisor = temperature if temperature > 0 else 1.0
        w, b = weight.to(dtype), (bias.to(dtype) if bias is not None else None)
        logp = torch.empty(targets.shape, dtype=_scores_dtype(dtype), device=hidden.device)
        ent, normaliser = torch.zeros_like(logp), torch.empty_like(logp)
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, targets.shape[1], chunk):
                z = _chunk_logits(hidden[:, a : a + chunk], w, b, dtype, divisor)
                lse = normaliser[:, a : a + chunk] = torch.logsumexp(z, dim=-1)
                logp[:, a : a + chunk] = z.gather(-1, targets[:, a : a + chunk].unsqueeze(-1)).squeeze(-1) - lse
                if entropy:  # H = lse - sum p z, p made in place: two chunk-sized tensors at most
                    ent[:, a : a + chunk] = lse - (z - lse.unsqueeze(-1)).exp_().mul_(z).sum(-1)
                del z
        ctx.save_for_backward(hidden, weight, bias, targets, normaliser, ent)
        ctx.settings = divisor, chunk, dtype
        ctx.set_materialize_grads(False)  # an output the loss does not read gets None, not zeros to multiply by
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, bias, targets, normaliser, ent = ctx.saved_tensors
        divisor, chunk, dtype = ctx.settings
        w, b = weight.to(dtype), (bias.to(dtype) if bias is not None else None)
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        acc = _scores_dtype(dtype)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if wants_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if wants_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, targets.shape[1], chunk):
                h = hidden[:, a : a + chunk].to(dtype)
                g_logp = grad_logp[:, a : a + chunk].unsqueeze(-1) if grad_logp is not None else None
                # dL/dz = g_logp (onehot(t) - p) - g_H p (log p + H), built in place in the logits' own tensor
                dz = _chunk_logits(h, w, b, dtype, divisor).sub_(normaliser[:, a : a + chunk].unsqueeze(-1))
                p = dz.exp()
                if grad_ent is not None:
                    dz.add_(ent[:, a : a + chunk].unsqueeze(-1)).mul_(grad_ent[:, a : a + chunk].unsqueeze(-1))
                    if g_logp is not None:
                        dz.add_(g_logp)
                elif g_logp is not None:
                    dz.copy_(g_logp.expand_as(dz))
                else:
                    dz.zero_()
                dz.mul_(p).neg_()
                del p
                if g_logp is not None:
                    dz.scatter_add_(-1, targets[:, a : a + chunk].unsqueeze(-1), g_logp)
                dlogits = (dz.div_(divisor) if divisor != 1.0 else dz).to(dtype)
                del dz
                if wants_hidden:
                    grad_hidden[:, a : a + chunk] = dlogits @ w
                if wants_weight:  # the bf16 product added into the fp32 sum without an fp32 copy of it
                    grad_weight.add_(dlogits.flatten(0, 1).T @ h.flatten(0, 1))
                if wants_bias:
                    grad_bias.add_(dlogits.sum((0, 1), dtype=acc))
        grad_weight = grad_weight.to(weight.dtype) if wants_weight else None
        grad_bias = grad_bias.to(bias.dtype) if wants_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _chunk_logits(hidden, w, b, dtype, divisor) -> torch.Tensor:
    """fp32 logits of `dtype` hidden states and weights, divided by the sampler's temperature."""
    z = torch.nn.functional.linear(hidden.to(dtype), w, b).to(_scores_dtype(dtype))
    return z / divisor if divisor != 1.0 else z


def _scores_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or float64 where the inputs are (a reference computation)."""
    return torch.promote_types(dtype, torch.float32)


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
