"""SFT warm start: AdamW on packed rows, loss on assistant tokens only.

Packed rows are fed as `input_ids` + `position_ids` with no attention mask and no KV cache. transformers then
detects the sequence boundaries from the position IDs (they restart at 0) and builds a block-diagonal causal
mask for the eager and SDPA attention paths, so a token never attends to another sequence of its pack; the test
suite checks that packed logits equal per-sequence logits. Padding added to make a micro-batch rectangular is its
own segment (positions restart) and carries no label. sft.packed_attention 'per_sequence' attends each sequence on
its own instead of through that mask (refiner_core/learners/packed_attention.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from refiner_core.algo.packing import IGNORE_INDEX, PackedRow, concat_pack
from refiner_core.config import SFTConfig
from refiner_core.learners.logprobs import autocast
from refiner_core.learners.packed_attention import apply_packed_attention
from refiner_core.runtime.progress import progress_bar


@dataclass(frozen=True)
class SFTSettings:
    epochs: int = 1
    learning_rate: float = 1e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 1
    gradient_accumulation: int = 1
    packed_attention: str = "mask"
    seed: int = 0

    @classmethod
    def from_config(cls, sft: SFTConfig, seed: int) -> SFTSettings:
        return cls(**{k: getattr(sft, k) for k in cls.__dataclass_fields__ if k != "seed"}, seed=seed)


def packed_rows(examples: list[dict]) -> list[PackedRow]:
    """sft_examples rows of one split -> one PackedRow per pack_id, sequences in pack_offset order."""
    packs: dict[int, list[dict]] = {}
    for e in examples:
        packs.setdefault(e["pack_id"], []).append(e)
    return [
        concat_pack(
            [(list(e["input_ids"]), list(e["loss_mask"])) for e in sorted(packs[p], key=lambda e: e["pack_offset"])]
        )
        for p in sorted(packs)
    ]


def collate_packed(rows: list[PackedRow], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r.input_ids)
        ids[b, :n] = torch.tensor(r.input_ids)
        pos[b, :n] = torch.tensor(r.position_ids)
        pos[b, n:] = torch.arange(width - n)  # padding: a separate segment
        labels[b, :n] = torch.tensor(r.labels)
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def summed_loss(model, batch: dict[str, torch.Tensor], precision: str = "fp32") -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over labelled positions, and their count. Under 'bf16' the forward pass
    runs in bfloat16 autocast; the cross-entropy is computed in fp32."""
    batch = {k: v.to(model.device) for k, v in batch.items()}
    with autocast(precision, model.device):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    targets = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss, int((targets != IGNORE_INDEX).sum())


@torch.no_grad()
def evaluate(
    model, rows: list[PackedRow], pad_id: int, micro_batch_size: int, precision: str = "fp32"
) -> tuple[float, int]:
    """Token-mean loss over every assistant token of `rows`."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for i in range(0, len(rows), micro_batch_size):
        loss, n = summed_loss(model, collate_packed(rows[i : i + micro_batch_size], pad_id), precision)
        total, tokens = total + loss.item(), tokens + n
    model.train(was_training)
    return (total / tokens if tokens else float("nan")), tokens


def train_sft(
    model,
    train: list[PackedRow],
    validation: list[PackedRow],
    pad_id: int,
    settings: SFTSettings,
    on_step=None,
    precision: str = "fp32",
) -> list[dict]:
    """Train in place; returns metric rows (split, step, epoch, loss, tokens, lr, grad_norm). `precision` as
    model.precision: 'bf16' autocasts forward passes. Weights and AdamW state are fp32 while training, whatever
    the model was loaded in (a bf16 model is cast back at the end): AdamW steps on bf16 weights at SFT's learning
    rates are mostly below half a bf16 unit and round away. The model's attention becomes
    settings.packed_attention's."""
    loaded_dtype = next(model.parameters()).dtype
    model.float()
    apply_packed_attention([model], settings.packed_attention)
    torch.manual_seed(settings.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=settings.weight_decay)
    history: list[dict] = []

    def validate(step: int, epoch: float) -> None:
        if validation:
            loss, tokens = evaluate(model, validation, pad_id, settings.micro_batch_size, precision)
            history.append(
                {
                    "split": "validation",
                    "step": step,
                    "epoch": epoch,
                    "loss": loss,
                    "tokens": tokens,
                    "lr": None,
                    "grad_norm": None,
                }
            )

    validate(0, 0.0)
    m = settings.micro_batch_size
    per_step = m * settings.gradient_accumulation
    steps_per_epoch = math.ceil(len(train) / per_step) if train else 0
    step = 0
    generator = torch.Generator().manual_seed(settings.seed)
    bar = progress_bar(steps_per_epoch * settings.epochs, "sft", "step")
    for epoch in range(settings.epochs):
        order = torch.randperm(len(train), generator=generator).tolist()
        for s in range(steps_per_epoch):
            chunk = [train[i] for i in order[s * per_step : (s + 1) * per_step]]
            micro = [collate_packed(chunk[i : i + m], pad_id) for i in range(0, len(chunk), m)]
            tokens = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro)
            if tokens == 0:
                bar.update(1)
                continue
            lr = (
                settings.learning_rate * min(1.0, (step + 1) / settings.warmup_steps)
                if settings.warmup_steps
                else settings.learning_rate
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for batch in micro:
                loss, _ = summed_loss(model, batch, precision)
                (loss / tokens).backward()  # token-mean over the whole optimizer step
                total += loss.item()
            clip = settings.max_grad_norm if settings.max_grad_norm > 0 else float("inf")
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
            if math.isfinite(norm):  # NaN or inf: the step would write NaN into the weights; recorded, not taken
                optimizer.step()
            step += 1
            bar.set_postfix(loss=f"{total / tokens:.3f}", refresh=False)
            bar.update(1)
            record = {
                "split": "train",
                "step": step,
                "epoch": epoch + (s + 1) / steps_per_epoch,
                "loss": total / tokens,
                "tokens": tokens,
                "lr": lr,
                "grad_norm": norm,
            }
            history.append(record)
            if on_step:
                on_step(record)
        validate(step, float(epoch + 1))
    bar.close()
    model.to(loaded_dtype)
    return history
