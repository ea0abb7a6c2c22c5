"""packed_attention 'per_sequence': one causal SDPA per sequence of a packed row, exactly as the sequence alone; every
other input goes to transformers' SDPA unchanged."""

from __future__ import annotations

import pytest
import torch

from conftest import learner_settings
from refiner_core.algo.packing import concat_pack
from refiner_core.learners.packed_attention import (
    PER_SEQUENCE_ATTENTION,
    apply_packed_attention,
    block_causal_mask,
    sequence_bounds,
    use_per_sequence_attention,
)
from refiner_core.learners.torch_learner import load_learner_models
from refiner_core.models import load_model
from refiner_core.sft.train import SFTSettings, collate_packed, summed_loss, train_sft


def _model(path, per_sequence: bool, trainable: bool = False):
    model = load_model(path, trainable=trainable)
    if per_sequence:
        assert use_per_sequence_attention(model)
    return model


def _rows(tokenizer):
    texts = ["Who discovered penicillin, and when?", "The wall fell in 1989.", "<answer>ok</answer>", "Yes."]
    seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    # the second row is shorter: its padding tail is a sequence of its own
    return seqs, [concat_pack([(s, [True] * len(s)) for s in seqs[:3]]), concat_pack([(seqs[3], [True] * 3)])]


def _packed_inputs(batch: dict) -> dict:
    """As SFT and the learner call the model: no KV cache (with one, transformers does not split packed rows)."""
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}


def test_sequence_bounds_hand_computed():
    packed = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert sequence_bounds(packed) == [[(0, 3), (3, 5), (5, 6)], [(0, 6)]]
    # as transformers splits: any position that is not the previous one plus one starts a sequence
    assert sequence_bounds(torch.tensor([[1, 1, 0, 1, 2]])) == [[(0, 1), (1, 2), (2, 5)]]
    assert sequence_bounds(torch.tensor([[7, 8, 9]])) == [[(0, 3)]]


def test_block_causal_mask_is_the_mask_transformers_builds_for_a_packed_row(tiny_model_path):
    from transformers.masking_utils import create_causal_mask

    model = load_model(tiny_model_path)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1, 0, 1]])
    embeds = torch.zeros((2, 9, model.config.hidden_size))
    built = create_causal_mask(model.config, embeds, None, None, position_ids=position_ids)
    ours = block_causal_mask(sequence_bounds(position_ids), 9, "cpu")
    assert built.dtype == torch.bool and torch.equal(built, ours)
    assert ours[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False, False]


def test_per_sequence_packed_logits_are_those_of_each_sequence_alone_bit_for_bit(tiny_model_path, tiny_tokenizer):
    seqs, rows = _rows(tiny_tokenizer)
    masked_model, per_sequence_model = _model(tiny_model_path, False), _model(tiny_model_path, True)
    assert per_sequence_model.config._attn_implementation == PER_SEQUENCE_ATTENTION
    one_row, two_rows = (collate_packed(r, tiny_tokenizer.pad_token_id) for r in (rows[:1], rows))
    gaps = {}
    for name, model in (("mask", masked_model), ("per_sequence", per_sequence_model)):
        with torch.no_grad():
            packed = model(**_packed_inputs(one_row)).logits[0]
            alone = torch.cat([model(input_ids=torch.tensor([s])).logits[0] for s in seqs[:3]])
            gaps[name] = (packed - alone).abs().max().item()
            # a padded second row: its padding tail is a sequence of its own (other matrix shapes, so to rounding)
            batch = model(**_packed_inputs(two_rows)).logits
            torch.testing.assert_close(batch[0], packed, rtol=0, atol=1e-5)
            torch.testing.assert_close(
                batch[1, :3], model(input_ids=torch.tensor([seqs[3]])).logits[0], rtol=0, atol=1e-5
            )
    assert gaps["per_sequence"] == 0.0
    assert 0.0 < gaps["mask"] < 1e-5  # the masked kernel sums in another order: the test tells them apart


def test_per_sequence_under_bf16_autocast_equals_each_sequence_alone(tiny_model_path, tiny_tokenizer):
    seqs, rows = _rows(tiny_tokenizer)
    batch = collate_packed(rows[:1], tiny_tokenizer.pad_token_id)
    model = _model(tiny_model_path, True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        first = model(input_ids=torch.tensor([seqs[0]]), use_cache=False).logits[0]
    assert torch.equal(packed[: len(seqs[0])], first)


def test_everything_but_a_packed_row_goes_to_transformers_sdpa_unchanged(tiny_model_path, tiny_tokenizer):
    masked_model, per_sequence_model = _model(tiny_model_path, False), _model(tiny_model_path, True)
    # left-padded batch with an attention mask (a prefill): same logits, bit for bit
    prompts = [tiny_tokenizer("The wall fell in 1989.")["input_ids"], tiny_tokenizer("Yes.")["input_ids"]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        want = masked_model(input_ids=ids, attention_mask=mask).logits
        got = per_sequence_model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, want)
    # decoding with a KV cache: the same tokens and scores
    outs = [
        m.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        for m in (masked_model, per_sequence_model)
    ]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].scores, outs[1].scores, strict=True))
    # another attention implementation is left as it is
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), attn_implementation="eager")
    assert not use_per_sequence_attention(eager) and eager.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="unknown packed_attention 'varlen'"):
        apply_packed_attention([eager], "varlen")


def _sft_rows():
    """Packs of 3, 2, 3 and 1 random sequences, the first 4 tokens of each unlabelled like a prompt."""
    g = torch.Generator().manual_seed(3)
    return [
        concat_pack(
            [
                (s, [False] * 4 + [True] * (len(s) - 4))
                for s in (torch.randint(3, 2000, (n,), generator=g).tolist() for n in lengths)
            ]
        )
        for lengths in ([40, 25, 30], [60, 20], [35, 35, 10], [50])
    ]


def _sft(tiny_model_path, tiny_tokenizer, packed_attention: str):
    torch.manual_seed(0)
    model = load_model(tiny_model_path, trainable=True)
    rows = _sft_rows()
    settings = SFTSettings(learning_rate=1e-3, micro_batch_size=2, packed_attention=packed_attention)
    history = train_sft(model, rows[:3], rows[3:], tiny_tokenizer.pad_token_id, settings)
    return model, history


def test_sft_per_sequence_trains_like_the_mask_and_saves_a_plain_checkpoint(tiny_model_path, tiny_tokenizer, tmp_path):
    masked, masked_history = _sft(tiny_model_path, tiny_tokenizer, "mask")
    per_sequence, history = _sft(tiny_model_path, tiny_tokenizer, "per_sequence")
    assert masked.config._attn_implementation == "sdpa"
    assert per_sequence.config._attn_implementation == PER_SEQUENCE_ATTENTION
    assert [h["split"] for h in history] == [h["split"] for h in masked_history]
    for got, want in zip(history, masked_history, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    # the gradient of one packed micro-batch (AdamW's first steps would magnify rounding in near-zero gradients)
    grads = []
    for packed_attention in ("mask", "per_sequence"):
        model = load_model(tiny_model_path, trainable=True)
        apply_packed_attention([model], packed_attention)
        loss, tokens = summed_loss(model, collate_packed(_sft_rows()[:2], tiny_tokenizer.pad_token_id))
        (loss / tokens).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    # the checkpoint names no attention implementation: it loads on SDPA in any process
    per_sequence.save_pretrained(tmp_path)
    assert "sdpa_per_sequence" not in (tmp_path / "config.json").read_text()
    assert load_model(tmp_path).config._attn_implementation == "sdpa"


@pytest.mark.parametrize("lora", [False, True])
def test_learner_models_get_the_recipes_attention(tiny_model_path, lora):
    lora_fields = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules=("all-linear",)) if lora else {}

    def attention(settings) -> set[str]:
        policy, reference = load_learner_models(tiny_model_path, tiny_model_path, "float32", settings)
        assert reference is not None and (getattr(reference, "policy", None) is policy) == lora  # LoRA: adapters off
        return {policy.config._attn_implementation, getattr(reference, "policy", reference).config._attn_implementation}

    assert attention(learner_settings(beta=0.05, packed_attention="per_sequence", **lora_fields)) == {
        PER_SEQUENCE_ATTENTION
    }
    assert attention(learner_settings(beta=0.05, **lora_fields)) == {"sdpa"}
