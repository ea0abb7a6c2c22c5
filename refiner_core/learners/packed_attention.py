"""Attention over packed rows one sequence at a time (`sft.packed_attention` / `grpo.packed_attention`:
'per_sequence').

A packed row (position IDs restarting at 0 for every sequence, no attention mask) is isolated by transformers with
a block-diagonal causal mask over the whole row: SDPA then scores every query against every key of the row and
masks all but its own sequence's, W^2 scores where the sequences need the sum of their n^2 (an SFT pack of 2048
tokens holding 4 sequences of ~500: about a quarter), and the masked kernel cannot skip the blocks that are masked
whole. This variant runs transformers' own causal SDPA on each sequence's slice of the row instead, which is
exactly how each sequence would be attended unpacked. Same attention up to rounding; the summation order differs
from the masked kernel's, so a bf16 run samples differently from the same seed (bench/packed_attention.py).

Anything else (decode steps, a padding mask, a mask that is not exactly the packing mask, dropout, sliding
windows) goes to transformers' SDPA unchanged.
"""

from __future__ import annotations

import weakref

PER_SEQUENCE_ATTENTION = "sdpa_per_sequence"
PACKED_ATTENTION = ("mask", "per_sequence")


def sequence_bounds(position_ids) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) of each sequence: a new one starts wherever a position is not the previous plus
    one (transformers' rule for packed rows, masking_utils.find_packed_sequence_indices)."""
    import torch

    width = position_ids.shape[1]
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    bounds = []
    for row in starts.cpu():
        cuts = row.nonzero().flatten().tolist()
        bounds.append(list(zip(cuts, [*cuts[1:], width], strict=True)))
    return bounds


def block_causal_mask(bounds: list[list[tuple[int, int]]], width: int, device) -> object:
    """[R, 1, W, W] bool, True where a query may attend a key: earlier or same position, same sequence."""
    import torch

    segment = torch.zeros((len(bounds), width), dtype=torch.long, device=device)
    for r, row in enumerate(bounds):
        for k, (start, end) in enumerate(row):
            segment[r, start:end] = k
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    return ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]


# The mask transformers built for one forward is handed to every layer: read once, by identity.
_last: tuple[weakref.ref, list | None] | None = None


def _packing_bounds(mask, position_ids) -> list[list[tuple[int, int]]] | None:
    """The sequences of each row when `mask` is exactly the packing mask of `position_ids`, else None."""
    global _last
    if _last is not None and _last[0]() is mask:
        return _last[1]
    bounds = sequence_bounds(position_ids.expand(mask.shape[0], -1))
    if not (mask.shape[1] == 1 and mask.equal(block_causal_mask(bounds, mask.shape[-1], mask.device))):
        bounds = None
    _last = (weakref.ref(mask), bounds)
    return bounds


def _sdpa_per_sequence(module, query, key, value, attention_mask, **kwargs):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    width = query.shape[2]
    applies = (
        width > 1
        and key.shape[2] == width
        and position_ids is not None
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4
        and attention_mask.shape[0] == query.shape[0]
        and getattr(module, "is_causal", True)
        and getattr(module, "sliding_window", None) is None
        and kwargs.get("dropout", 0.0) == 0.0
        and kwargs.get("position_bias") is None
    )
    bounds = _packing_bounds(attention_mask, position_ids) if applies else None
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = []
    for r, row in enumerate(bounds):
        pieces = [
            sdpa_attention_forward(
                module, query[r : r + 1, :, a:b], key[r : r + 1, :, a:b], value[r : r + 1, :, a:b], None, **kwargs
            )[0]
            for a, b in row
        ]
        rows.append(torch.cat(pieces, dim=1))  # [1, W, H, D]: sdpa_attention_forward's layout
    return torch.cat(rows, dim=0), None


def use_per_sequence_attention(model) -> bool:
    """Switch a model on transformers' SDPA attention to the per-sequence variant; False (and nothing changed) for
    any other attention implementation (eager, flash attention, which isolates packed sequences itself)."""
    from refiner_core.models import use_sdpa_variant

    return use_sdpa_variant(model, PER_SEQUENCE_ATTENTION, _sdpa_per_sequence)


def apply_packed_attention(models, choice: str) -> None:
    """`choice` from the recipe ('mask' keeps transformers' masked SDPA) on every model that reads packed rows."""
    if choice not in PACKED_ATTENTION:
        raise ValueError(f"unknown packed_attention {choice!r}; choose from {list(PACKED_ATTENTION)}")
    if choice == "per_sequence":
        for model in models:
            if model is not None:
                use_per_sequence_attention(model)
