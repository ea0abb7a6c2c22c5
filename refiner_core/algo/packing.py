"""Packing token sequences into fixed-length training rows (first-fit decreasing).

A pack concatenates whole sequences; position IDs restart at 0 for each one, which is what lets the model
build a block-diagonal causal mask (see sft_train), so attention never crosses sequences. A sequence is never
split across packs: anything longer than the pack length must be truncated or dropped before packing.
"""

from __future__ import annotations

from dataclasses import dataclass

IGNORE_INDEX = -100


class PackingError(ValueError):
    pass


def pack_sequences(lengths: list[int], pack_length: int) -> list[list[int]]:
    """Indices of the sequences in each pack, by first-fit decreasing (ties broken by index: deterministic)."""
    if pack_length <= 0:
        raise PackingError(f"pack_length must be positive, got {pack_length}")
    too_long = [i for i, n in enumerate(lengths) if n > pack_length]
    if too_long:
        raise PackingError(
            f"{len(too_long)} sequences exceed pack_length {pack_length} (e.g. index {too_long[0]}, "
            f"{lengths[too_long[0]]} tokens); truncate or drop them first"
        )
    packs: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        for p, room in enumerate(free):
            if n <= room:
                packs[p].append(i)
                free[p] -= n
                break
        else:
            packs.append([i])
            free.append(pack_length - n)
    return packs


def packing_efficiency(lengths: list[int], packs: list[list[int]], pack_length: int) -> float:
    """Real tokens / (packs x pack_length): 1.0 means no padding at all."""
    if not packs:
        return 0.0
    return sum(lengths[i] for pack in packs for i in pack) / (len(packs) * pack_length)


@dataclass
class PackedRow:
    input_ids: list[int]
    position_ids: list[int]  # restart at 0 for every sequence
    labels: list[int]  # token ID where the loss applies (assistant tokens), IGNORE_INDEX elsewhere
    sequence_lengths: list[int]


def concat_pack(sequences: list[tuple[list[int], list[bool]]]) -> PackedRow:
    """Concatenate (token IDs, loss mask) pairs. The first token of each sequence never carries a label, so
    no loss term ever predicts one sequence's token from another's context."""
    ids: list[int] = []
    pos: list[int] = []
    labels: list[int] = []
    for tokens, mask in sequences:
        if len(tokens) != len(mask):
            raise PackingError("token IDs and loss mask differ in length")
        ids.extend(tokens)
        pos.extend(range(len(tokens)))
        labels.extend(t if m and k > 0 else IGNORE_INDEX for k, (t, m) in enumerate(zip(tokens, mask)))
    return PackedRow(ids, pos, labels, [len(t) for t, _ in sequences])
