"""Packing: efficiency on a realistic length mix, whole sequences only, no attention across sequences."""

from __future__ import annotations

import random

import pytest
import torch

from refiner_core.algo.packing import IGNORE_INDEX, PackingError, concat_pack, pack_sequences, packing_efficiency
from refiner_core.sft.data import Rendered, SFTLimits, apply_limits
from refiner_core.sft.train import collate_packed


def refiner_like_lengths(n: int, seed: int) -> list[int]:
    """Prompt (search results, long-tailed) plus a response of up to 1024 tokens, capped at 8192."""
    rng = random.Random(seed)
    return [min(8192, int(rng.lognormvariate(7.2, 0.6)) + rng.randint(100, 1024)) for _ in range(n)]


def test_first_fit_decreasing_packs_a_realistic_mix_at_95_percent_or_better():
    lengths = refiner_like_lengths(300, seed=1)
    packs = pack_sequences(lengths, 8192)
    efficiency = packing_efficiency(lengths, packs, 8192)
    assert efficiency == pytest.approx(sum(lengths) / (len(packs) * 8192))
    assert efficiency >= 0.95
    # Every sequence lands in exactly one pack, whole, and no pack overflows.
    assert sorted(i for pack in packs for i in pack) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in pack) <= 8192 for pack in packs)
    # Packing is much better than one sequence per row.
    assert efficiency > 2 * packing_efficiency(lengths, [[i] for i in range(len(lengths))], 8192)


def test_a_sequence_longer_than_the_pack_is_never_split_unless_truncated():
    with pytest.raises(PackingError, match="exceed pack_length 100"):
        pack_sequences([40, 120, 30], 100)
    long = Rendered(list(range(150)), [False] * 50 + [True] * 100)
    dropped, reason, _ = apply_limits(long, SFTLimits(max_total_tokens=100, total_policy="drop", pack_length=100))
    assert dropped is None and reason == "total_too_long"
    kept, reason, truncated = apply_limits(
        long, SFTLimits(max_total_tokens=100, total_policy="truncate", pack_length=100)
    )
    assert reason is None and truncated == ["total_truncated"] and kept.input_ids == list(range(100))
    assert pack_sequences([40, len(kept.input_ids), 30], 100) == [[1], [0, 2]]


def test_concatenated_pack_restarts_positions_and_never_labels_across_a_boundary():
    row = concat_pack([([5, 6, 7], [False, True, True]), ([8, 9], [True, True])])
    assert row.input_ids == [5, 6, 7, 8, 9]
    assert row.position_ids == [0, 1, 2, 0, 1]
    # The second sequence's first token is assistant text, but predicting it would need the first
    # sequence as context, so it carries no label.
    assert row.labels == [IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_equal_per_sequence_logits(tiny_model_path, tiny_tokenizer, attention):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), attn_implementation=attention).eval()
    texts = ["Who discovered penicillin, and when?", "The wall fell in 1989.", "<answer>ok</answer>"]
    seqs = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    rows = [concat_pack([(s, [True] * len(s)) for s in seqs]), concat_pack([(seqs[1], [True] * len(seqs[1]))])]
    batch = collate_packed(rows, tiny_tokenizer.pad_token_id)  # second row padded: padding is its own segment
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        offset = 0
        for s in seqs:
            alone = model(input_ids=torch.tensor([s]), use_cache=False).logits[0]
            assert torch.allclose(packed[0, offset : offset + len(s)], alone, atol=1e-5)
            offset += len(s)
        assert torch.allclose(packed[1, : len(seqs[1])], model(input_ids=torch.tensor([seqs[1]])).logits[0], atol=1e-5)
        # Control: the same tokens without restarted positions do attend across sequences.
        flat = model(input_ids=batch["input_ids"][:1], use_cache=False).logits[0]
        assert not torch.allclose(flat[len(seqs[0]) :], packed[0, len(seqs[0]) :], atol=1e-3)
