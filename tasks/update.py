from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
from prefect import get_run_logger

from refiner_core.algo.schedules import entropy_coef_at, entropy_control_after, learning_rate_at
from refiner_core.grpo import build_train_samples, kl_in_reward, learner_settings
from refiner_core.learners.base import make_learner
from refiner_core.models import load_tokenizer
from refiner_core.publish.model_card import write_model_card
from refiner_core.reward.compose import reward_parts
from refiner_core.runtime import live_learner
from refiner_core.runtime.identity import weights_hash
from refiner_core.runtime.unsaved_weights import UnsavedWeights, forget_recorded, is_unsaved, model_folder
from refiner_core.schema import ADVANTAGES, REFERENCE_SYNCS, STEPS
from refiner_core.stage_settings import stage_view
from refiner_core.store.checkpoints import (
    TRAINING_STATE_FILES,
    folder_bytes,
    forget_pruned,
    require_checkpoint,
    step_checkpoints,
)
from refiner_core.store.faults import stage_fault
from refiner_core.store.storage import atomic_dir, dir_hash, json_hash, read_rows, write_rows, write_table
from tasks.checkpoints import write_average
from tasks.stage import damaged_outputs, stage


# `save` (run.save_every) follows grpo.steps and eval.every, which a longer rerun changes: out of the key, so the
# steps that ran stay Cached (weights a step left unsaved were written as that run ended, or are recomputed).
@stage("grpo-update", unkeyed=("save",))
def grpo_update(
    *,
    run_dir: str,
    run: str,
    step: int,
    rollouts: list[dict],
    scores: list[dict],
    policy: dict,
    reference: dict,
    grpo_cfg: dict,
    temperature: float,
    dtype: str,
    precision: str,
    lora: dict | None = None,
    save: bool = True,
    policy_lag: int = 0,
    entropy_control: dict | None = None,
    kl_control: dict | None = None,
) -> dict:
    """Stage 5: advantages -> clipped surrogate + KL -> AdamW step -> HF checkpoint + steps metrics. `rollouts`
    and `scores` hold one manifest per sampling round of the step; all rounds train together. save false
    (run.save_every): the new weights stay in the live learner, and the manifest names them by content hash.
    policy_lag: updates between the policy that sampled `rollouts` and `policy` (grpo.async_steps). lora: the
    model.lora_* fields (rank 0: full weights). entropy_control: grpo.adaptive_entropy's state after the previous
    step (None at the first), the next state in the returned manifest; kl_control the same for
    grpo.kl_reward_target's coefficient. The update
    draws no random numbers (no dropout, no sampling), and leaves torch's process-wide generator alone: an hf
    rollout sampled ahead in another thread seeds it and draws from it."""
    log = get_run_logger()
    rollout_rows = [r for rolled in rollouts for r in read_rows(rolled["rollouts"]["path"])]
    reward_rows = [
        r for scored in scores for r in read_rows(scored["rewards"]["path"]) if r["reward_version"] == "train"
    ]
    grpo = stage_view("update", grpo_cfg)
    settings = learner_settings(grpo, temperature, precision, stage_view("lora", lora) if lora else None)
    if settings.hostfile:  # every host reads the ranks' job folders: the run folder is shared
        settings = dataclasses.replace(settings, work_root=str(Path(run_dir) / ".learner"))
    model = model_folder(policy)
    require_checkpoint(model, f"grpo-update step {step}")
    tokenizer = load_tokenizer(model)
    optimizer_state = Path(policy["path"]) / "optimizer.pt"
    saved_state = any((Path(policy["path"]) / name).exists() for name in TRAINING_STATE_FILES)
    if step > 0 and not is_unsaved(policy) and not saved_state:
        log.warning("grpo-update step %d: %s holds no optimizer state; AdamW starts afresh", step, policy["path"])
    learner_key = live_learner.learner_key(grpo.learner, model, reference, settings, dtype)
    attempt = json_hash(  # this update, by its inputs
        [step, rollouts, scores, policy, reference, grpo_cfg, temperature, dtype, precision, lora]
        + [save, policy_lag, entropy_control, kl_control]
    )
    done = live_learner.finished_update(run_dir, learner_key, attempt)
    if done is not None and not damaged_outputs(done, run_dir):
        log.warning(
            "grpo-update step %d: an earlier attempt finished this update and failed before its result was stored; "
            "the live learner holds its weights: its result is taken",
            step,
        )
        return done
    # the live learner, when it holds this policy, or when an earlier attempt trained this update and failed
    # writing its outputs (the weights moved on; what writing them needs is kept with it)
    kept = live_learner.take_kept(run_dir, learner_key, policy["hash"], made_by=attempt)
    learner = kept.learner if kept else None
    trained: Trained | None = kept.trained if kept else None
    if learner is None and is_unsaved(policy):
        raise FileNotFoundError(
            f"grpo-update step {step}: the weights it starts from, {policy['path']}, were never saved "
            "(run.save_every) and no live learner holds them. After a failed step, run again: they are "
            "recomputed. Where this update runs again in a later run (a setting it reads changed, or the run now "
            "needs its checkpoint written: eval.every, grpo.ref_sync_every, a shorter grpo.steps), the updates "
            "back to the last checkpoint written must run again too: rerun with --refresh, or in a new run folder"
        )
    if trained is not None:
        log.warning(
            "grpo-update step %d: an earlier attempt trained this update and failed writing its outputs; the live "
            "learner holds the trained weights: they and the step's tables are written now, without training again",
            step,
        )
    else:
        log.info(
            "grpo-update step %d: %s",
            step,
            "learner kept in memory (policy, reference, AdamW state)"
            if learner
            else f"learner loaded from {policy['path']}",
        )
    learner = learner or make_learner(
        grpo.learner, policy["path"], reference["path"], tokenizer, settings, optimizer_state, dtype
    )
    touched = False  # whether the weights may have changed
    try:
        if trained is None:
            kl, next_kl_control = {"kl_reward_coef": None, "reward_kl": None}, None
            if grpo.kl_reward_coef > 0:  # the KL under the weights before this update enters the reward
                rollout_rows, reward_rows, kl, next_kl_control = kl_in_reward(
                    rollout_rows, reward_rows, learner.sequence_kl, kl_control, grpo
                )
                log.info(
                    "grpo-update step %d: KL in the reward: coefficient %.4g, mean per-token KL %.5f over %d responses",
                    step,
                    kl["kl_reward_coef"],
                    kl["reward_kl"],
                    len(rollout_rows),
                )
            samples, advantages, adv_stats = build_train_samples(rollout_rows, reward_rows, grpo, reward_parts)
            if not samples and adv_stats["masked_truncated"]:
                log.warning(
                    "grpo-update step %d: nothing to train on: all %d responses that would be trained ran out of "
                    "tokens (grpo.mask_truncated); raise rollout.max_new_tokens, or turn grpo.mask_truncated off",
                    step,
                    adv_stats["masked_truncated"],
                )
            lr = learning_rate_at(step, grpo)
            bonus = entropy_coef_at(entropy_control, grpo)
            stage_fault("grpo-update", step, Path(run_dir) / ".faults", phase="train")
            touched = True
            metrics = learner.train_step(samples, lr, bonus["applied"]) if samples else _no_signal_metrics(lr)
            trained = Trained(rollout_rows, reward_rows, kl, next_kl_control, advantages, adv_stats, bonus, metrics)
            stage_fault("grpo-update", step, Path(run_dir) / ".faults", phase="trained")
        rollout_rows, reward_rows, kl, next_kl_control, advantages, adv_stats, bonus, metrics = trained.fields()
        saved = _save(learner, save, run_dir=run_dir, run=run, step=step, model=model, tokenizer=tokenizer)
        unsaved = UnsavedWeights.named_by(saved)
        save_at_close = (
            functools.partial(
                _write_checkpoint,
                learner,
                Path(saved["path"]),
                tokenizer,
                run_dir=run_dir,
                run=run,
                step=step,
                unsaved=unsaved,
            )
            if unsaved is not None
            else None
        )
        rewards = np.array([r["reward"] for r in reward_rows], dtype=np.float64)
        row = {
            "run": run,
            "step": step,
            **{
                k: metrics[k]
                for k in (
                    "loss",
                    "pg_loss",
                    "kl",
                    "clip_fraction",
                    "grad_norm",
                    "lr",
                    "response_tokens",
                    "packing_efficiency",
                    "update_seconds",
                )
            },
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "advantage_abs_mean": adv_stats["advantage_abs_mean"],
            "zero_std_group_fraction": adv_stats["zero_std_group_fraction"],
            "sampling_rounds": len(rollouts),
            "informative_groups": adv_stats["informative_groups"],
            "dropped_groups": adv_stats["dropped_groups"],
            "masked_truncated": adv_stats["masked_truncated"],
            "skipped_optimizer_steps": metrics.get("skipped_optimizer_steps"),
            "entropy": metrics.get("entropy"),
            "importance_weight_mean": metrics.get("importance_weight_mean"),
            "off_policy_masked": metrics.get("off_policy_masked"),
            "entropy_coef": bonus["applied"],
            "policy_lag": policy_lag,
            **kl,
            "response_length_mean": float(np.mean([r["response_tokens"] for r in rollout_rows])),
            "rollout_seconds": sum(m["seconds"] for m in rollouts),
            "weight_sync_seconds": sum(m.get("weight_sync_seconds", 0.0) for m in rollouts),
            "judge_seconds": sum(m["seconds"] for m in scores),
            "checkpoint": saved["path"],
            "checkpoint_bytes": 0 if is_unsaved(saved) else folder_bytes(Path(saved["path"])),
            **{
                f"judge_{k}": sum(m.get("judge_usage", {}).get(k, 0) for m in scores)
                for k in ("requests", "prompt_tokens", "completion_tokens")
            },
            "judge_cost_usd": None,  # priced by the catalog (judge.price_per_mtok_*), in no cache key
        }
        metrics_path = Path(run_dir) / "metrics" / f"step={step}" / "steps.parquet"
        advantages_path = metrics_path.with_name("advantages.parquet")
        advantage_rows = [{"run": run, "step": step, "reward_version": "train", **a} for a in advantages]
        log.info(
            "grpo-update step %d: loss %.4f kl %.5f clip %.3f reward %.3f±%.3f zero-std groups %.0f%% "
            "(sampling rounds %d, informative groups %d, dropped %d, truncated left out %d)",
            step,
            row["loss"],
            row["kl"],
            row["clip_fraction"],
            row["reward_mean"],
            row["reward_std"],
            100 * row["zero_std_group_fraction"],
            row["sampling_rounds"],
            row["informative_groups"],
            row["dropped_groups"],
            row["masked_truncated"],
        )
        if row["skipped_optimizer_steps"]:
            log.warning(
                "grpo-update step %d: %d optimizer step(s) skipped, their gradient norm not finite (NaN or inf): the "
                "weights were left as they were (steps.skipped_optimizer_steps; monitors.skipped_updates)",
                step,
                row["skipped_optimizer_steps"],
            )
        manifest = {
            "policy": saved,
            "steps": write_rows(STEPS, [row], metrics_path),
            "advantages": {
                "path": str(advantages_path),
                "hash": write_table(ADVANTAGES, advantage_rows, advantages_path),
            },
        }
        if grpo.adaptive_entropy:
            manifest["entropy_control"] = entropy_control_after(entropy_control, bonus, metrics)
        if grpo.kl_reward_target > 0:
            manifest["kl_control"] = next_kl_control
    except BaseException:
        # weights as they were (a failure before training, e.g. out of memory in the KL pass): back for the retry;
        # trained (a failure writing the outputs, e.g. a full disk): back, with what the retry needs to write them;
        # half-updated: no later step may use this learner (its ranks stop)
        if trained is not None:
            if live_learner.keep_learner(run_dir, learner_key, learner, "", made_by=attempt, trained=trained) is None:
                learner.close()
        elif touched or not live_learner.keep_learner(
            run_dir, learner_key, learner, policy["hash"], kept.save_at_close if kept else None
        ):
            learner.close()
        raise
    # a retry of this update, should the stage fail after it returned (its result never stored), takes this result
    if (
        live_learner.keep_learner(run_dir, learner_key, learner, saved["hash"], save_at_close, attempt, manifest)
        is None
    ):
        learner.close()
    return manifest


@dataclasses.dataclass
class Trained:
    """An update's training step done, and what writing its outputs needs: the rows it read (with the KL in the
    reward), the advantages, the entropy bonus and the step's metrics."""

    rollout_rows: list
    reward_rows: list
    kl: dict
    next_kl_control: dict | None
    advantages: list
    adv_stats: dict
    bonus: dict
    metrics: dict

    def fields(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


@stage("reference-sync")
def sync_reference(*, run_dir: str, run: str, step: int, reference: dict, policy: dict, alpha: float) -> dict:
    """grpo.ref_sync_every, after update `step` (policy: checkpoint step+1): the KL reference <- alpha * policy +
    (1 - alpha) * reference into RUN_DIR/reference/step_NNNN, the reference of the updates after it. One
    reference_syncs row."""
    moved = write_average(run_dir, run, "reference", step + 1, reference, policy, alpha)
    get_run_logger().info(
        "reference-sync step %d: KL reference <- %.3g * policy + %.3g * reference: %s",
        step,
        alpha,
        1.0 - alpha,
        moved["path"],
    )
    row = {
        "run": run,
        "step": step,
        "alpha": alpha,
        "reference": moved["path"],
        "reference_hash": moved["hash"],
        "previous": reference["path"],
    }
    path = Path(run_dir) / "reference_syncs" / f"step={step}" / "reference_syncs.parquet"
    return {
        "reference": moved,
        "reference_syncs": {"path": str(path), "hash": write_table(REFERENCE_SYNCS, [row], path)},
    }


def _save(learner, save: bool, *, run_dir: str, run: str, step: int, model: str, tokenizer) -> dict:
    """The policy manifest of the updated weights: an HF checkpoint, or (save false, run.save_every) the weights
    left in the live learner, named by content hash."""
    final = Path(run_dir) / "checkpoints" / f"step_{step + 1:04d}"
    for number, later in step_checkpoints(final.parent).items():  # an earlier run's, trained from other weights:
        if number > step + 1:  # none stands for these (UnsavedWeights.saved_later) until rewritten and recorded
            forget_recorded(later)
    if save or not live_learner.keeps_learner(run_dir, learner):  # weights nothing would hold are written
        _write_checkpoint(learner, final, tokenizer, run_dir=run_dir, run=run, step=step)
        return {"path": str(final), "hash": dir_hash(final, TRAINING_STATE_FILES)}
    return UnsavedWeights(str(final), weights_hash(learner.weights()), model).manifest()


def _write_checkpoint(
    learner, final: Path, tokenizer, *, run_dir: str, run: str, step: int, unsaved: UnsavedWeights | None = None
) -> Path:
    """HF weights + training state + tokenizer + model card, atomically. unsaved: the weights a manifest names
    as never saved, written as the run ends; the checkpoint records that it holds them."""
    forget_recorded(final)
    with atomic_dir(final) as build:
        learner.save(build)
        tokenizer.save_pretrained(build)
        write_model_card(build, run_dir, kind="grpo", run=run, step=step + 1, checkpoint=final)
        if unsaved is not None:
            unsaved.mark_written_at_close(build)
    forget_pruned(final.parent, final)  # written again: no longer a pruned checkpoint
    return final


def _no_signal_metrics(lr: float) -> dict:
    """No rollout left to train on (all-equal groups filtered out, or every response cut off under
    grpo.mask_truncated): the policy is saved unchanged, nothing was computed."""
    return {
        "loss": 0.0,
        "pg_loss": 0.0,
        "kl": 0.0,
        "clip_fraction": 0.0,
        "grad_norm": None,
        "skipped_optimizer_steps": 0,
        "lr": lr,
        "response_tokens": 0,
        "packing_efficiency": 0.0,
        "update_seconds": 0.0,
        "entropy": None,
        "importance_weight_mean": None,
        "off_policy_masked": None,
    }  # no token: no entropy or weight to average
