"""The 'torch' learner: one process on CPU or one GPU; the clipped surrogate with KL, gradient accumulation, AdamW."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from refiner_core.learners.base import LearnerSettings, TrainSample, collate, token_logprobs
from refiner_core.losses import AGGREGATIONS, grpo_token_loss


class TorchLearner:
    def __init__(self, policy, reference, pad_id: int, settings: LearnerSettings, optimizer_state: Path | None = None):
        self.policy, self.reference, self.pad_id, self.s = policy, reference, pad_id, settings
        self.policy.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in policy.parameters() if p.requires_grad],
            lr=settings.learning_rate,
            betas=tuple(settings.adam_betas),
            weight_decay=settings.weight_decay,
        )
        if optimizer_state is not None and Path(optimizer_state).exists():
            self.optimizer.load_state_dict(torch.load(optimizer_state, weights_only=True))
            for group in self.optimizer.param_groups:  # the recipe's lr wins over the saved one
                group["lr"] = settings.learning_rate

    def _micro_batches(self, samples: list[TrainSample]):
        m = self.s.micro_batch_size
        for i in range(0, len(samples), m):
            yield i, collate(samples[i : i + m], self.pad_id)

    @torch.no_grad()
    def _frozen_logprobs(self, model, samples: list[TrainSample]) -> list[torch.Tensor]:
        was_training = model.training
        model.eval()
        out = [token_logprobs(model, b, self.s.temperature) for _, b in self._micro_batches(samples)]
        model.train(was_training)
        return out

    def train_step(self, samples: list[TrainSample]) -> dict:
        """One rollout batch -> `minibatches` optimizer steps. Returns aggregated metrics."""
        t0 = time.time()
        s = self.s
        ref_lp = self._frozen_logprobs(self.reference, samples) if s.beta > 0 and self.reference is not None else None
        # pi_old: with a single optimizer step the policy has not moved yet, so rho = 1 exactly and the
        # detached current log-probs serve; with several, freeze them before the first step.
        old_lp = self._frozen_logprobs(self.policy, samples) if s.minibatches > 1 else None
        n_tokens = sum(len(x.response_ids) for x in samples)
        aggregate = AGGREGATIONS[s.loss_aggregation]
        micro = list(self._micro_batches(samples))
        per_mb = math.ceil(len(micro) / s.minibatches)
        totals = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clipped": 0.0, "tokens": 0.0}
        grad_norms = []
        bar = tqdm(total=len(micro), desc="update", unit="mb", disable=None, leave=False)
        for group_start in range(0, len(micro), per_mb):
            group = list(range(group_start, min(group_start + per_mb, len(micro))))
            group_tokens = sum(micro[k][1]["mask"].sum().item() for k in group)
            group_seqs = sum(micro[k][1]["mask"].shape[0] for k in group)
            self.optimizer.zero_grad(set_to_none=True)
            for k in group:
                _, batch = micro[k]
                logp = token_logprobs(self.policy, batch, s.temperature)
                old = old_lp[k] if old_lp is not None else logp.detach()
                is_w = None
                if s.tis_cap > 0:
                    is_w = torch.clamp(torch.exp(old - batch["rollout_logprobs"]), max=s.tis_cap) * batch["mask"]
                out = grpo_token_loss(
                    logp, old, batch["advantages"], eps_low=s.clip_eps_low, eps_high=s.clip_eps_high,
                    ref_logp=ref_lp[k] if ref_lp is not None else None, beta=s.beta,
                    kl_estimator=s.kl_estimator, kl_clamp=s.kl_clamp, is_weights=is_w,
                )
                mask = batch["mask"]
                # Scale each micro-batch so the accumulated gradient equals the aggregation over the whole group.
                loss = aggregate(out["loss"], mask, s.loss_constant) * self._share(mask, group_tokens, group_seqs)
                loss.backward()
                totals["loss"] += loss.item()
                totals["pg_loss"] += (out["pg"] * mask).sum().item()
                totals["kl"] += (out["kl"] * mask).sum().item()
                totals["clipped"] += (out["clipped"] * mask).sum().item()
                totals["tokens"] += mask.sum().item()
                bar.update(1)
            params = [p for p in self.policy.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm if s.max_grad_norm > 0 else float("inf"))
            grad_norms.append(float(norm))
            self.optimizer.step()
        bar.close()
        tokens = max(totals["tokens"], 1.0)
        return {
            "loss": totals["loss"] / s.minibatches,
            "pg_loss": totals["pg_loss"] / tokens,
            "kl": totals["kl"] / tokens,
            "clip_fraction": totals["clipped"] / tokens,
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": s.learning_rate,
            "response_tokens": n_tokens,
            "update_seconds": time.time() - t0,
        }

    def _share(self, mask: torch.Tensor, group_tokens: float, group_seqs: int) -> float:
        """Fraction of the group's aggregate this micro-batch's own aggregate represents."""
        agg = self.s.loss_aggregation
        if agg == "token_mean":
            return mask.sum().item() / max(group_tokens, 1.0)
        if agg == "sequence_mean":
            return mask.shape[0] / group_seqs
        return 1.0  # sum_constant is already additive

    def save(self, path: Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(path)
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")


def make_torch_learner(policy_path, reference_path, tokenizer, settings, optimizer_state, dtype="float32"):
    from refiner_core.models import load_model

    policy = load_model(policy_path, dtype, trainable=True)
    reference = load_model(reference_path, dtype) if settings.beta > 0 else None
    return TorchLearner(policy, reference, tokenizer.pad_token_id, settings, optimizer_state)

