"""The 'torch' learner: one process on CPU or one GPU; the clipped surrogate with KL, gradient accumulation over
padded or packed micro-batches, optional bf16 autocast, AdamW."""

from __future__ import annotations

import itertools
import math
import time
import zlib
from pathlib import Path

import torch

from refiner_core.algo.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    Sequences,
    grpo_token_loss,
    high_entropy_tokens,
    importance_weights,
    off_policy_sequences,
)
from refiner_core.learners.base import LearnerSettings, SequenceKL, TrainSample, surrogate_knobs
from refiner_core.learners.batching import collate, collate_group, collate_rows, pack_rows, prompt_groups
from refiner_core.learners.logprobs import token_logprobs, token_scores
from refiner_core.learners.lora import AdapterExports, AdaptersOff, lora_policy, merged_state_dict, save_lora
from refiner_core.learners.packed_attention import apply_packed_attention
from refiner_core.models import Adapter
from refiner_core.runtime.progress import progress_bar


def selection_seed(batch: dict[str, torch.Tensor], pass_index: int) -> int:
    """The seed of a random token choice in the loss (clip_cov): from the micro-batch's tokens and the pass over
    the rollout batch, so every rank and every rerun draws the same, and each pass draws anew."""
    return zlib.crc32(batch["input_ids"].cpu().numpy().tobytes(), pass_index)


# what a train step sums over its micro-batches (0 where a setting leaves one out)
TOTALS = (
    "loss",
    "pg_loss",
    "kl",
    "clipped",
    "entropy",
    "is_weight",
    "off_policy_masked",
    "bonus_entropy",
    "bonus_tokens",
    "tokens",
)


class DeviceSums:
    """Per-micro-batch figures summed where they were computed, in float64, and read once at the end: reading each
    (.item()) would make the host wait for the device at every micro-batch. The sums equal those of the figures
    read one at a time (float64 additions in the same order)."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def read(self) -> dict[str, float]:
        keys = list(self.sums)
        return dict(zip(keys, torch.stack([self.sums[k] for k in keys]).tolist())) if keys else {}


def grad_norm_metrics(norms: list[float]) -> dict:
    """grad_norm: the mean norm before clipping over the optimizer steps taken (None when none was);
    skipped_optimizer_steps: those skipped because their norm was NaN or inf. Stepping on such a gradient writes NaN
    into every weight (clipping by an infinite norm scales it by NaN or 0), so the learners leave the weights and the
    optimizer state as they were, as DeepSpeed's ZeRO and bf16 optimizers do (and verl's actor)."""
    taken = [n for n in norms if math.isfinite(n)]
    return {
        "grad_norm": sum(taken) / len(taken) if taken else None,
        "skipped_optimizer_steps": len(norms) - len(taken),
    }


class TorchLearner:
    def __init__(self, policy, reference, pad_id: int, settings: LearnerSettings, optimizer_state: Path | None = None):
        self.policy, self.reference, self.pad_id, self.s = policy, reference, pad_id, settings
        if settings.share_prompt and settings.gradient_checkpointing:  # transformers turns the prompt's cache off
            raise ValueError("grpo.gradient_checkpointing needs grpo.share_prompt false (preflight says why)")
        self.policy.train()
        trained = [p for p in policy.parameters() if p.requires_grad]
        # on a GPU one fused kernel updates every tensor; on CPU the per-tensor loop keeps runs' figures as they were
        fused = bool(trained) and all(p.is_cuda for p in trained)
        self.optimizer = torch.optim.AdamW(
            trained,
            lr=settings.learning_rate,
            betas=tuple(settings.adam_betas),
            weight_decay=settings.weight_decay,
            fused=fused or None,
        )
        if optimizer_state is not None and Path(optimizer_state).exists():
            state = torch.load(optimizer_state, map_location="cpu", weights_only=True)
            for group in state["param_groups"]:  # this device's kernel, before loading: the fused one keeps its
                group["fused"] = fused or None  # step counts on the GPU, where loading then moves them
            self.optimizer.load_state_dict(state)
            for group in self.optimizer.param_groups:  # the recipe's lr wins over the saved one
                group["lr"] = settings.learning_rate
        self.exports: AdapterExports | None = None  # made by the first adapter()

    def _layout(self, samples: list[TrainSample]) -> list[list[dict[str, torch.Tensor]]]:
        """Optimizer steps (`minibatches` of them), each a list of micro-batches: with share_prompt, one group
        (its prompt read once) per micro-batch; else `micro_batch_size` rows, a row being one sequence, or one pack
        of sequences when pack_length > 0 (packed within its optimizer step)."""
        s = self.s
        steps = []
        for chunk in _even_chunks(samples, s.minibatches):
            if s.share_prompt:
                batches = [collate_group([chunk[i] for i in g], self.pad_id) for g in prompt_groups(chunk)]
            else:
                rows = [[chunk[i] for i in row] for row in pack_rows(chunk, s.pack_length)]
                m = s.micro_batch_size
                batches = [collate_rows(rows[i : i + m], self.pad_id) for i in range(0, len(rows), m)]
            steps.append([{k: v.to(self.policy.device) for k, v in b.items()} for b in batches])
        return steps

    @torch.no_grad()
    def _frozen_logprobs(self, model, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        was_training = model.training
        model.eval()
        out = [
            token_logprobs(model, b, self.s.temperature, self.s.precision, self.s.logit_chunk_tokens) for b in batches
        ]
        model.train(was_training)
        return out

    def _carried_or_scored(self, key: str, model, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per micro-batch, the log-probs its samples carry under `key` (scored before the update by sequence_kl),
        else those of a forward of `model` now."""
        if model is None:
            raise ValueError(f"{key}: grpo.beta > 0 needs the reference model, and this learner holds none")
        return [b[key] if key in b else self._frozen_logprobs(model, [b])[0] for b in batches]

    @torch.no_grad()
    def sequence_kl(self, samples: list[TrainSample]) -> list[SequenceKL]:
        """Per sample: the sum over its trained response tokens of kl_reward_estimator(d), d = log pi - log pi_ref
        under the current weights (clamped to kl_clamp), the KL in the reward's measure (grpo.kl_reward_coef; verl
        apply_kl_penalty on old_log_probs and ref_log_prob), with the per-token log-probs it read. Batched as the
        update is: one group per forward, its prompt read once, under share_prompt, else micro_batch_size
        sequences; a rank of a distributed learner computes every sample, so that each runs the same forwards."""
        if self.reference is None:
            raise ValueError("sequence_kl: this learner holds no reference model (grpo.kl_reward_coef is 0)")
        s, out = self.s, [None] * len(samples)
        if s.share_prompt:
            batches = [(g, collate_group([samples[i] for i in g], self.pad_id)) for g in prompt_groups(samples)]
        else:
            chunks = [
                list(range(k, min(k + s.micro_batch_size, len(samples))))
                for k in range(0, len(samples), s.micro_batch_size)
            ]
            batches = [(c, collate([samples[i] for i in c], self.pad_id)) for c in chunks]
        for indices, rows in batches:
            batch = {k: v.to(self.policy.device) for k, v in rows.items()}
            [logp], [ref] = self._frozen_logprobs(self.policy, [batch]), self._frozen_logprobs(self.reference, [batch])
            d = torch.clamp(logp - ref, -s.kl_clamp, s.kl_clamp)
            kl = KL_ESTIMATORS[s.kl_reward_estimator](d, torch.ones_like(d)) * batch["mask"]
            # both layouts hold one sequence per row, numbered by its row, its response tokens in order
            responses = batch["sequence_index"] == torch.arange(len(indices), device=logp.device).unsqueeze(1)
            for r, (i, total) in enumerate(zip(indices, kl.sum(-1).tolist())):
                out[i] = SequenceKL(total, logp[r][responses[r]].tolist(), ref[r][responses[r]].tolist())
        return out

    def train_step(
        self, samples: list[TrainSample], learning_rate: float | None = None, entropy_coef: float | None = None
    ) -> dict:
        """One rollout batch -> `epochs` passes of `minibatches` optimizer steps, at `learning_rate` with the
        entropy bonus `entropy_coef` (None: the settings'). Returns metrics averaged over every pass; with
        adaptive_entropy also `bonus_entropy`, the mean entropy over the tokens the bonus acts on."""
        t0 = time.time()
        s = self.s
        lr = s.learning_rate if learning_rate is None else learning_rate
        bonus = s.entropy_coef if entropy_coef is None else entropy_coef
        self._set_learning_rate(lr)
        layout = self._layout(samples)
        # Aggregation normalisers span the whole optimizer step (all ranks), so accumulated micro-batch
        # gradients equal the gradient of the step's aggregate.
        normalisers = [
            (sum(b["mask"].sum().item() for b in step), sum(int(b["sequences"]) for b in step)) for step in layout
        ]
        layout = self._local_layout(layout)
        flat = [batch for step in layout for batch in step]
        ref_lp = self._carried_or_scored("reference_logprobs", self.reference, flat) if s.beta > 0 else None
        # pi_old: with a single optimizer step the policy has not moved yet, so rho = 1 exactly and the
        # detached current log-probs serve; with several, freeze them before the first step.
        old_lp = self._carried_or_scored("old_logprobs", self.policy, flat) if len(layout) * s.epochs > 1 else None
        aggregate = AGGREGATIONS[s.loss_aggregation]
        reads_entropy = bonus != 0 or s.adaptive_entropy or s.top_entropy_quantile < 1
        knobs = surrogate_knobs(s)
        sums = DeviceSums()
        grad_norms = []
        bar = progress_bar(len(flat) * s.epochs, "update", "mb")
        # (index of its first micro-batch in `flat`, micro-batches, normalisers) per optimizer step, every pass
        firsts = itertools.accumulate((len(step) for step in layout), initial=0)
        optimizer_steps = list(zip(firsts, layout, normalisers)) * s.epochs
        for n, (first, step, (step_tokens, step_sequences)) in enumerate(optimizer_steps):
            pass_index = n // len(layout)
            self._zero_grad()
            for k, batch in enumerate(step, start=first):
                # token entropies only when the loss reads them: one more reduction over the logits
                logp, entropy = token_scores(
                    self.policy, batch, s.temperature, s.precision, entropy=reads_entropy, chunk=s.logit_chunk_tokens
                )
                old = old_lp[k] if old_lp is not None else logp.detach()
                mask = batch["mask"]
                sequences = Sequences(batch["sequence_index"], mask)
                is_w = None
                if s.tis_cap > 0:
                    is_w = importance_weights(
                        old,
                        batch["rollout_logprobs"],
                        sequences,
                        level=s.tis_level,
                        mode=s.tis_mode,
                        floor=s.tis_floor,
                        cap=s.tis_cap,
                    )
                policy_tokens = None
                if s.top_entropy_quantile < 1:
                    policy_tokens = high_entropy_tokens(entropy, mask, s.top_entropy_quantile)
                kept = None
                if s.off_policy_mask_threshold > 0:
                    kept = off_policy_sequences(
                        logp, batch["rollout_logprobs"], batch["advantages"], sequences, s.off_policy_mask_threshold
                    )
                    sums.add("off_policy_masked", ((1.0 - kept) * mask).sum())
                out = grpo_token_loss(
                    logp,
                    old,
                    batch["advantages"],
                    eps_low=s.clip_eps_low,
                    eps_high=s.clip_eps_high,
                    ref_logp=ref_lp[k] if ref_lp is not None else None,
                    beta=s.beta,
                    kl_estimator=s.kl_estimator,
                    kl_clamp=s.kl_clamp,
                    is_weights=is_w,
                    policy_loss=s.policy_loss,
                    sequences=sequences,
                    entropy=entropy,
                    entropy_coef=bonus,
                    policy_tokens=policy_tokens,
                    kept_sequences=kept,
                    selection_seed=selection_seed(batch, pass_index) if s.policy_loss == "clip_cov" else None,
                    **knobs,
                )
                weights = aggregate(mask, batch["sequence_tokens"], step_tokens, step_sequences, s.loss_constant)
                loss = (out["loss"] * weights).sum()
                self._backward(loss)
                sums.add("loss", loss)
                sums.add("pg_loss", (out["pg"] * mask).sum())
                sums.add("kl", (out["kl"] * mask).sum())
                sums.add("clipped", (out["clipped"] * mask).sum())
                if entropy is not None:
                    sums.add("entropy", (entropy * mask).sum())
                if s.adaptive_entropy:  # the controller's measure, only when it reads it
                    acted_on = mask if policy_tokens is None else mask * policy_tokens
                    sums.add("bonus_entropy", (entropy * acted_on).sum())
                    sums.add("bonus_tokens", acted_on.sum())
                if is_w is not None:  # already zero off the response mask
                    sums.add("is_weight", is_w.sum())
                sums.add("tokens", mask.sum())
                bar.update(1)
            grad_norms.append(self._optimizer_step())
        bar.close()
        self._hand_back_memory()
        totals = dict.fromkeys(TOTALS, 0.0) | sums.read()
        totals["real_tokens"] = float(sum(int(b["real_tokens"]) for b in flat))
        totals["computed_tokens"] = float(sum(int(b["computed_tokens"]) for b in flat))
        totals = self._reduce(totals)
        tokens = max(totals["tokens"], 1.0)
        entropy = {"entropy": totals["entropy"] / tokens} if reads_entropy else {}
        is_weight = {"importance_weight_mean": totals["is_weight"] / tokens} if s.tis_cap > 0 else {}
        masked = {"off_policy_masked": totals["off_policy_masked"] / tokens} if s.off_policy_mask_threshold > 0 else {}
        if s.adaptive_entropy:
            entropy["bonus_entropy"] = totals["bonus_entropy"] / max(totals["bonus_tokens"], 1.0)
        return {
            "loss": totals["loss"] / len(optimizer_steps),
            "pg_loss": totals["pg_loss"] / tokens,
            "kl": totals["kl"] / tokens,
            "clip_fraction": totals["clipped"] / tokens,
            **grad_norm_metrics(grad_norms),
            "lr": lr,
            "response_tokens": sum(x.trained_tokens for x in samples),
            "packing_efficiency": totals["real_tokens"] / totals["computed_tokens"],
            "update_seconds": time.time() - t0,
            **entropy,
            **is_weight,
            **masked,
        }

    # Hooks a distributed learner overrides; here one process runs every micro-batch.
    def _local_layout(self, layout: list[list[dict[str, torch.Tensor]]]) -> list[list[dict[str, torch.Tensor]]]:
        return layout

    def _set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _optimizer_step(self) -> float:
        """One optimizer step; returns the gradient norm before clipping. A non-finite norm skips the step."""
        params = [p for p in self.policy.parameters() if p.grad is not None]
        max_norm = self.s.max_grad_norm if self.s.max_grad_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if math.isfinite(norm):
            self.optimizer.step()
        return norm

    def _reduce(self, totals: dict) -> dict:
        return totals

    def _hand_back_memory(self) -> None:
        pass  # a rollout engine in this process takes the cached blocks; one in another releases them first

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's current weights, in memory (a live rollout engine copies them instead of reading disk);
        with LoRA, base + adapters merged, under the base model's names."""
        return merged_state_dict(self.policy) if self.s.lora_rank else self.policy.state_dict()

    def adapter(self) -> Adapter:
        """The current adapters written for a rollout engine that applies them to the base (LoRA only)."""
        if self.exports is None:
            config = self.policy.peft_config["default"]
            self.exports = AdapterExports(config.base_model_name_or_path, config.r)
        self.policy.save_pretrained(str(self.exports.next_folder()))
        return self.exports.adapter()

    def close(self) -> None:
        """Nothing to stop: the model lives in this process and goes with the learner; exported adapters go."""
        if self.exports is not None:
            self.exports.close()

    def save(self, path: Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.s.lora_rank:
            save_lora(self.policy, path, merged=self.s.lora_save_merged)
        else:
            self.policy.save_pretrained(path)
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")  # with LoRA, the adapters' AdamW state


def _even_chunks(items: list, count: int) -> list[list]:
    """`items` in min(count, len(items)) consecutive chunks whose sizes differ by at most one: `count` optimizer
    steps where there are samples for them (ceil-sized chunks ran fewer, 4 of 5 for 12 samples, and could leave
    one sample a step of its own)."""
    count = max(1, min(count, len(items)))
    size, extra = divmod(len(items), count)
    bounds = [k * size + min(k, extra) for k in range(count + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def load_learner_models(policy_path, reference_path, dtype: str, settings, device: str | None = None):
    """(policy, reference or None) as a learner trains them: with LoRA, adapters on the reference (the starting
    policy, which preflight checks) and the reference that policy with its adapters off; attention per
    settings.packed_attention."""
    from refiner_core.models import load_model

    if settings.lora_rank:
        base = load_model(reference_path, dtype, device=device)
        apply_packed_attention([base], settings.packed_attention)
        recompute_activations(base, settings.gradient_checkpointing)
        # at the start the policy is the base itself: fresh adapters on it, though it may hold the adapter of an
        # earlier run (merged in by load_model; loaded again on top, it counted twice)
        starting = Path(policy_path).resolve() == Path(reference_path).resolve()
        policy = lora_policy(base, None if starting else policy_path, settings)
        return policy, (AdaptersOff(policy) if settings.reads_reference else None)
    policy = load_model(policy_path, dtype, trainable=True, device=device)
    reference = load_model(reference_path, dtype, device=device) if settings.reads_reference else None
    apply_packed_attention([policy, reference], settings.packed_attention)
    recompute_activations(policy, settings.gradient_checkpointing)
    return policy, reference


def recompute_activations(model, on: bool) -> None:
    """grpo.gradient_checkpointing: each decoder layer's activations recomputed in the backward pass (in training
    mode with gradients; the frozen passes are not affected). Non-reentrant: the gradients reach LoRA adapters on
    a frozen base and DeepSpeed's partitioned parameters alike."""
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compile_decoder_layers(model) -> int:
    """torch.compile each decoder layer of `model` in place (grpo.compile_layers); returns how many. The layers
    share one compiled code (their weights are its inputs), so a model compiles once, not once per layer."""
    count = model.config.num_hidden_layers
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if not stacks:
        raise ValueError(f"grpo.compile_layers: no list of {count} decoder layers found in {type(model).__name__}")
    for layer in stacks[0]:
        layer.compile()
    return len(stacks[0])


def make_torch_learner(policy_path, reference_path, tokenizer, settings, optimizer_state, dtype="float32"):
    policy, reference = load_learner_models(policy_path, reference_path, dtype, settings)
    if settings.compile_layers:
        compile_decoder_layers(policy)
    return TorchLearner(policy, reference, tokenizer.pad_token_id, settings, optimizer_state)
