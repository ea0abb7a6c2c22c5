"""What TRL's GRPOConfig and verl's PPO trainer call the settings a recipe has (leaf names: verl's
`actor_rollout_ref.rollout.n` is `n`). An unknown recipe field that is one of them is answered with ours
(config._did_you_mean), and so is a choice field given a peer's value for it (grpo.advantage: grpo); docs/recipes.md
shows the table."""

from __future__ import annotations

import difflib
from typing import NamedTuple


class PeerName(NamedTuple):
    peer: str  # "TRL", "verl" or "TRL, verl"
    ours: str  # dotted field name
    note: str = ""  # where the meaning differs


PEER_NAMES: dict[str, PeerName] = {
    # group and batch
    "num_generations": PeerName("TRL", "rollout.samples_per_prompt"),
    "n": PeerName("verl", "rollout.samples_per_prompt"),
    "train_batch_size": PeerName("verl", "rollout.prompts_per_step", "prompts, as ours"),
    "max_completion_length": PeerName("TRL", "rollout.max_new_tokens"),
    "max_response_length": PeerName("verl", "rollout.max_new_tokens"),
    "response_length": PeerName("verl", "rollout.max_new_tokens"),
    "max_prompt_length": PeerName("TRL, verl", "data.max_prompt_tokens", "longer prompts are dropped and counted"),
    "per_device_train_batch_size": PeerName("TRL", "grpo.micro_batch_size"),
    "ppo_micro_batch_size_per_gpu": PeerName("verl", "grpo.micro_batch_size"),
    "use_remove_padding": PeerName(
        "verl",
        "grpo.packed_attention",
        "True = per_sequence, with grpo.pack_length > 0 and grpo.share_prompt false: sequences packed into rows "
        "and attended one at a time (verl: flash-attention varlen over unpadded tokens); False = mask",
    ),
    "enable_gradient_checkpointing": PeerName("verl", "grpo.gradient_checkpointing"),
    "use_liger_loss": PeerName(
        "TRL",
        "grpo.logit_chunk_tokens",
        "Liger's fused linear loss never holds a whole pack's logits either; ours runs the output layer and the "
        "log-softmax N positions at a time",
    ),
    "steps_per_generation": PeerName(
        "TRL", "grpo.minibatches", "ours counts optimizer steps: steps_per_generation / gradient_accumulation_steps"
    ),
    "ppo_mini_batch_size": PeerName(
        "verl", "grpo.minibatches", "ours counts optimizer steps per batch: train_batch_size / ppo_mini_batch_size"
    ),
    "num_iterations": PeerName("TRL", "grpo.epochs"),
    "ppo_epochs": PeerName("verl", "grpo.epochs"),
    # loss
    "epsilon": PeerName("TRL", "grpo.clip_eps_low", "TRL sets epsilon_high (grpo.clip_eps_high) to it by default"),
    "epsilon_high": PeerName("TRL", "grpo.clip_eps_high"),
    "clip_ratio": PeerName("verl", "grpo.clip_eps_low", "it sets grpo.clip_eps_high too"),
    "clip_ratio_low": PeerName("verl", "grpo.clip_eps_low"),
    "clip_ratio_high": PeerName("verl", "grpo.clip_eps_high"),
    "clip_ratio_c": PeerName("verl", "grpo.dual_clip_c", "with grpo.policy_loss: dual_clip"),
    "delta": PeerName(
        "TRL", "grpo.dual_clip_c", "with grpo.policy_loss: dual_clip; the same loss where delta >= 1 + epsilon_high"
    ),
    "ppo_kl_coef": PeerName("verl", "grpo.kl_cov_coef", "with grpo.policy_loss: kl_cov"),
    "loss_type": PeerName(
        "TRL",
        "grpo.loss_aggregation",
        "dapo = token_mean, grpo = sequence_mean, dr_grpo = sum_constant, luspo = sequence_sum (with "
        "grpo.policy_loss gspo); cispo, sapo and vespo are grpo.policy_loss",
    ),
    "loss_agg_mode": PeerName(
        "verl",
        "grpo.loss_aggregation",
        "token-mean = token_mean, seq-mean-token-mean = sequence_mean, seq-mean-token-sum = sequence_sum",
    ),
    "loss_mode": PeerName("verl", "grpo.policy_loss", "vanilla = dual_clip: verl's vanilla applies clip_ratio_c"),
    "importance_sampling_level": PeerName("TRL", "grpo.policy_loss", "sequence = gspo"),
    "sapo_temperature_pos": PeerName("TRL", "grpo.sapo_tau_pos"),
    "sapo_temperature_neg": PeerName("TRL", "grpo.sapo_tau_neg"),
    "entropy_coeff": PeerName("verl", "grpo.entropy_coef"),
    "use_adaptive_entropy": PeerName(
        "TRL", "grpo.adaptive_entropy", "moves once per GRPO step, TRL's per optimizer step"
    ),
    "kl_loss_coef": PeerName("verl", "grpo.beta"),
    "kl_coef": PeerName("verl", "grpo.kl_reward_coef", "kl_ctrl.kl_coef, the KL in the reward; the loss term is beta"),
    "use_kl_in_reward": PeerName("verl", "grpo.kl_reward_coef", "> 0 turns it on"),
    "kl_penalty": PeerName("verl", "grpo.kl_reward_estimator", "kl = k1, mse = k2, low_var_kl = k3"),
    "target_kl": PeerName("verl", "grpo.kl_reward_target", "kl_ctrl.type 'adaptive'; 0 = 'fixed'"),
    "horizon": PeerName("verl", "grpo.kl_reward_horizon"),
    "use_kl_loss": PeerName("verl", "grpo.beta", "0 = no KL term and no reference model"),
    "sync_ref_model": PeerName("TRL", "grpo.ref_sync_every", "> 0 turns it on: every that many GRPO steps"),
    "ref_model_sync_steps": PeerName("TRL", "grpo.ref_sync_every", "ours counts GRPO steps, TRL optimizer steps"),
    "ref_model_mixup_alpha": PeerName("TRL", "grpo.ref_mixup_alpha"),
    "kl_loss_type": PeerName("verl", "grpo.kl_estimator", "kl = k1, mse = k2, low_var_kl = k3"),
    "use_bias_correction_kl": PeerName("TRL", "grpo.kl_estimator", "true = ratio_k3"),
    "scale_rewards": PeerName(
        "TRL",
        "grpo.advantage",
        "group = group_std, batch = batch_std, none = none; TRL's std is the sample std: grpo.advantage_std_ddof 1",
    ),
    "adv_estimator": PeerName(
        "verl",
        "grpo.advantage",
        "grpo = group_std, rloo = rloo, reinforce_plus_plus = reinforce_pp, reinforce_plus_plus_baseline = "
        "reinforce_pp_baseline; verl's std is the sample std: grpo.advantage_std_ddof 1",
    ),
    "norm_adv_by_std_in_grpo": PeerName("verl", "grpo.advantage", "false = none"),
    "multi_objective_aggregation": PeerName(
        "TRL", "grpo.reward_aggregation", "the parts are the reward's, not one per reward function"
    ),
    # correction for the rollout engine's log-probs
    "vllm_importance_sampling_cap": PeerName("TRL", "grpo.tis_cap", "TRL's older name for clip_max"),
    "vllm_importance_sampling_clip_max": PeerName("TRL", "grpo.tis_cap"),
    "vllm_importance_sampling_clip_min": PeerName("TRL", "grpo.tis_floor"),
    "vllm_importance_sampling_correction": PeerName("TRL", "grpo.tis_cap", "false = 0 (off)"),
    "vllm_importance_sampling_mode": PeerName("TRL", "grpo.tis_mode", "its token_/sequence_ part is grpo.tis_level"),
    "rollout_is_threshold": PeerName("verl", "grpo.tis_cap"),
    "rollout_is": PeerName("verl", "grpo.tis_level"),
    # optimizer
    "lr": PeerName("verl", "grpo.learning_rate"),
    "grad_clip": PeerName("verl", "grpo.max_grad_norm"),
    "warmup_ratio": PeerName("TRL", "grpo.lr_warmup_steps", "a share of the run: warmup_ratio x grpo.steps"),
    "lr_warmup_steps_ratio": PeerName("verl", "grpo.lr_warmup_steps", "a share of the run: ratio x grpo.steps"),
    "warmup_style": PeerName("verl", "grpo.lr_scheduler_type", "verl's older name for it"),
    # engine
    "vllm_gpu_memory_utilization": PeerName("TRL", "rollout.gpu_memory_utilization"),
    "vllm_tensor_parallel_size": PeerName("TRL", "rollout.tensor_parallel_size"),
    "tensor_model_parallel_size": PeerName("verl", "rollout.tensor_parallel_size"),
    "vllm_enable_sleep_mode": PeerName("TRL", "rollout.sleep_level", "0 = off"),
    "use_vllm": PeerName("TRL", "rollout.engine", "true = vllm, false = hf"),
    # dynamic sampling (DAPO)
    "filter_groups": PeerName("verl", "rollout.dynamic_sampling"),
    "max_num_gen_batches": PeerName(
        "verl", "rollout.dynamic_sampling_max_rounds", "0: verl has no limit, ours draws no extra round"
    ),
    "mask_truncated_completions": PeerName(
        "TRL",
        "grpo.mask_truncated",
        "TRL masks a completion that does not end in EOS; ours one with finish_reason 'length'",
    ),
    "penalty_factor": PeerName("verl", "reward.overlong_factor", "its buffer length is reward.overlong_buffer"),
    "max_tool_calling_iterations": PeerName("TRL", "rollout.agent.max_turns"),
    # schedule
    "max_steps": PeerName("TRL", "grpo.steps"),
    "total_training_steps": PeerName("verl", "grpo.steps"),
    "save_steps": PeerName("TRL", "run.save_every"),
    "save_freq": PeerName("verl", "run.save_every"),
    "eval_steps": PeerName("TRL", "eval.every"),
    "num_generations_eval": PeerName("TRL", "eval.samples"),
    "test_freq": PeerName("verl", "eval.every"),
    # LoRA (PEFT's LoraConfig, which TRL takes; verl's lora_rank is ours already)
    "r": PeerName("TRL", "model.lora_rank"),
    "target_modules": PeerName("TRL, verl", "model.lora_target_modules"),
}


# {a peer's setting in PEER_NAMES: {its value: ours for the field it names}}: each also in that setting's note.
PEER_VALUES: dict[str, dict[str, str]] = {
    "adv_estimator": {
        "grpo": "group_std",
        "reinforce_plus_plus": "reinforce_pp",
        "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
    },
    "scale_rewards": {"group": "group_std", "batch": "batch_std"},
    "loss_type": {"dapo": "token_mean", "grpo": "sequence_mean", "dr_grpo": "sum_constant", "luspo": "sequence_sum"},
    "loss_agg_mode": {
        "token-mean": "token_mean",
        "seq-mean-token-mean": "sequence_mean",
        "seq-mean-token-sum": "sequence_sum",
    },
    "kl_loss_type": {"kl": "k1", "mse": "k2", "low_var_kl": "k3"},
    "kl_penalty": {"kl": "k1", "mse": "k2", "low_var_kl": "k3"},
    "loss_mode": {"vanilla": "dual_clip"},
    "use_remove_padding": {"True": "per_sequence", "False": "mask"},
}


# {our choice field whose name a peer shares: (the peer, {its value: ours})}
SHARED_NAME_VALUES: dict[str, tuple[str, dict[str, str]]] = {
    "grpo.lr_scheduler_type": ("TRL", {"constant_with_warmup": "constant", "cosine_with_min_lr": "cosine"}),
}


def peer_hint(key: str) -> str | None:
    """Says which of our fields a peer's name (or a near miss of one: num_generation) is, else None."""
    close = difflib.get_close_matches(key, list(PEER_NAMES), n=1, cutoff=0.9)
    if not close:
        return None
    name = PEER_NAMES[close[0]]
    return f"{name.peer}'s {close[0]} is {name.ours} here" + (f"; {name.note}" if name.note else "")


def peer_names_of(ours: str) -> str:
    """TRL's and verl's names for our field `ours` ("TRL num_generations, verl n"), or ''."""
    return ", ".join(f"{p.peer} {name}" for name, p in PEER_NAMES.items() if p.ours == ours)


def peer_value_hint(field: str, value: object) -> str | None:
    """ "verl's adv_estimator 'grpo' is 'group_std' here" for a peer's value of our choice field, else None."""
    for setting, values in PEER_VALUES.items():
        if PEER_NAMES[setting].ours == field and str(value) in values:
            return f"{PEER_NAMES[setting].peer}'s {setting} {value!r} is {values[str(value)]!r} here"
    peer, values = SHARED_NAME_VALUES.get(field, ("", {}))
    if str(value) in values:
        return f"{peer}'s {field.rsplit('.', 1)[-1]} {value!r} is {values[str(value)]!r} here"
    return None
