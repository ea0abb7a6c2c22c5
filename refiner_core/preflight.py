"""Checks of a resolved recipe that need no stage to run: impossible values, missing files and models, field
mappings against the columns the source really has. Each check returns problems as one-line sentences, so that
the CLI can report every mistake at once, before any Prefect server starts."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
from pathlib import Path

from refiner_core import REPO_ROOT
from refiner_core.algo.schedules import decays_after_warmup
from refiner_core.config import CHAT_FIELDS, REFINER_FIELDS, RUBRIC_FIELDS, GRPOConfig, RecipeConfig, checked_fields
from refiner_core.data.rows import UTF8_BOM, parse_jsonl_line
from refiner_core.data.sources import SourceError, cached_hub_columns, detect_format, hub_offline
from refiner_core.models import SMOLLM2, TINY_QWEN3, checkpoint_adapter
from refiner_core.runtime.cluster import address_problem

REQUIRED_REFINER = ("id", "question", "reasoning", "tool_output")
REQUIRED_CHAT = ("id", "messages")
JSONL_SAMPLE_LINES = 1000  # column names of a JSONL file are read from its first lines only

# Kinds of value (see value_kinds) each canonical field accepts, and how to say so; other fields accept any.
_RUBRIC_KINDS = (
    {"string", "list", "list of string", "list of object", "object"},
    "a list of rubrics (strings or {description, weight?, title?} objects), an object "
    "{positive: [...], negative: [...]}, or the JSON text of either",
)
FIELD_KINDS: dict[str, tuple[set[str], str]] = {
    "id": ({"string", "integer"}, "a string or an integer"),
    "question": ({"string"}, "a string"),
    "reasoning": ({"string"}, "a string"),
    "answer": ({"string"}, "a string"),
    "tool_output": (
        {"string", "list of object"},
        "a string with <snippet id=...> blocks or a list of snippet objects {id, text, title?, url?}",
    ),
    "messages": ({"list of object"}, "a list of {role, content} objects"),
    "ground_truth": ({"string", "integer", "number"}, "a string or a number"),
    "positive_rubrics": _RUBRIC_KINDS,
    "negative_rubrics": _RUBRIC_KINDS,
}


def check_recipe(cfg: RecipeConfig) -> list[str]:
    """Every problem of the recipe that is knowable without running a stage; [] when it looks runnable."""
    problems = check_values(cfg) + check_models(cfg)
    problems += check_source(
        "data",
        cfg.data.path,
        cfg.data.format,
        cfg.data.fields,
        cfg.data.split,
        REFINER_FIELDS + CHAT_FIELDS,
        shape=True,
        hub_config=cfg.data.hub_config,
    )
    if cfg.sft.enabled:
        where, path, fmt = (
            ("sft", cfg.sft.path, cfg.sft.format) if cfg.sft.path else ("data", cfg.data.path, cfg.data.format)
        )
        if cfg.sft.path or cfg.sft.fields:  # data.path with data's own mapping is checked above
            problems += check_source(
                where,
                path,
                fmt,
                cfg.sft.fields,
                cfg.sft.split,
                REFINER_FIELDS + CHAT_FIELDS,
                shape=True,
                fields_where="sft.fields",
                hub_config=cfg.sft.hub_config,
            )
    if cfg.rubrics.path:
        problems += check_source("rubrics", cfg.rubrics.path, "auto", cfg.rubrics.fields, "train", RUBRIC_FIELDS)
    if not cfg.rubrics.instance_rubrics_only and not resolve(cfg.rubrics.static_rubrics).is_file():
        problems.append(f"rubrics.static_rubrics: {_shown(cfg.rubrics.static_rubrics)} does not exist")
    if not any(p.startswith(("grpo.", "model.lora")) for p in problems):  # a bad value would fail it once more
        problems += variant_problems(cfg)
    from refiner_core.publish.run_sql import CatalogError, catalog_path  # DuckDB: only when a recipe is checked

    for where, folders in (
        ("data.skip_solved_from", cfg.data.skip_solved_from),
        ("data.weights_from", cfg.data.weights_from),
    ):
        for folder in folders:
            try:
                catalog_path(resolve(folder))
            except CatalogError:
                problems.append(f"{where}: {_shown(folder)} holds no catalog.duckdb (a run that finished a step)")
    return problems


def variant_problems(cfg: RecipeConfig) -> list[str]:
    """The update's settings built and its advantage and policy loss tried on a dummy batch of two groups, as the
    learner calls them: a variant added with a step missing (a knob left out of GRPOConfig, LearnerSettings or
    SurrogateParams; a wrong signature or return) fails here, not in the first update after a rollout and a judge."""
    import torch

    from refiner_core.algo.advantages import compute_advantages
    from refiner_core.algo.losses import Sequences, SurrogateParams, policy_terms
    from refiner_core.grpo import learner_settings
    from refiner_core.learners.base import surrogate_knobs

    grpo = cfg.grpo
    try:
        settings = learner_settings(grpo, cfg.rollout.temperature, "fp32", cfg.model)
        compute_advantages(
            [0.0, 1.0, 0.0, 2.0], ["a", "a", "b", "b"], grpo.advantage, grpo.advantage_eps, grpo.advantage_std_ddof
        )
        logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]])
        params = SurrogateParams(
            settings.clip_eps_low, settings.clip_eps_high, selection_seed=0, **surrogate_knobs(settings)
        )
        advantages = torch.tensor([[1.0], [-1.0]]).expand_as(logp)
        policy_terms(
            settings.policy_loss, logp, logp - 0.1, advantages, params, Sequences.one_per_row(torch.ones_like(logp))
        )
    except Exception as e:  # whatever the user's variant raises
        return [
            f"grpo: the update fails on a dummy batch (grpo.advantage {grpo.advantage!r}, grpo.policy_loss "
            f"{grpo.policy_loss!r}): {type(e).__name__}: {e}"
        ]
    return []


def check_values(cfg: RecipeConfig) -> list[str]:
    problems = [
        f"{name} = {value!r}: {check.requirement}" for name, value, check in checked_fields(cfg) if not check.ok(value)
    ]
    if cfg.eval.every and not cfg.data.validation_fraction:
        problems.append(
            "eval.every > 0 evaluates held-out prompts, and data.validation_fraction = 0 holds out none: "
            "set it, e.g. 0.2"
        )
    if cfg.eval.every and not (cfg.eval.greedy or cfg.eval.samples):
        problems.append("eval.every > 0 with eval.greedy false and eval.samples 0: nothing to evaluate")
    if cfg.eval.pass_k > cfg.eval.samples:
        problems.append(f"eval.pass_k = {cfg.eval.pass_k}: must be at most eval.samples ({cfg.eval.samples})")
    if cfg.model.dtype not in ("float32", "bfloat16"):
        problems.append(f"model.dtype = {cfg.model.dtype!r}: must be 'float32' or 'bfloat16'")
    # LoRA adapters train in fp32 on a bf16 base (PEFT casts them); full weights need an fp32 master copy.
    if cfg.model.dtype == "bfloat16" and not cfg.model.lora_rank:
        problems += bf16_weight_problems(cfg)
    if cfg.judge.openai.serve and cfg.judge.engine != "openai":
        problems.append(
            f"judge.openai.serve = true starts an OpenAI-compatible server: it needs judge.engine = 'openai', "
            f"not {cfg.judge.engine!r}"
        )
    if cfg.judge.engine == "openai" and cfg.judge.mode != "json":
        problems.append(
            f"judge.engine = 'openai' reads the verdict from the reply's text: it needs judge.mode = 'json', not "
            f"{cfg.judge.mode!r} (which reads the judge's token probabilities)"
        )
    key_env = cfg.judge.openai.api_key_env
    if cfg.judge.engine == "openai" and key_env and key_env not in os.environ:
        problems.append(
            f"judge.openai.api_key_env names {key_env!r}, but that environment variable is not set here: export it, "
            "or set judge.openai.api_key_env to '' for a server that takes no key"
        )
    if cfg.judge.openai.serve and not _loopback_port(cfg.judge.openai.base_url):
        problems.append(
            f"judge.openai.serve = true: judge.openai.base_url {cfg.judge.openai.base_url!r} must name a host and port "
            "on this machine (e.g. http://127.0.0.1:8011/v1) for the server the run starts"
        )
    problems += gpu_share_problems(cfg)
    problems += backend_problems(cfg)
    if cfg.grpo.learner == "deepspeed" and cfg.grpo.deepspeed.hostfile:
        problems += hostfile_problems(cfg)
    if not 0 <= cfg.reward.overlong_buffer <= cfg.rollout.max_new_tokens:
        problems.append(
            f"reward.overlong_buffer = {cfg.reward.overlong_buffer}: must be between 0 (off) and "
            f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens}), the length the penalty ends at"
        )
    if cfg.grpo.tis_cap > 0 and not cfg.grpo.tis_floor < cfg.grpo.tis_cap:
        problems.append(
            f"grpo.tis_floor = {cfg.grpo.tis_floor!r}: must be below grpo.tis_cap ({cfg.grpo.tis_cap}), "
            "or every importance weight is the same constant"
        )
    if cfg.grpo.policy_loss == "clip_cov" and not cfg.grpo.clip_cov_lb < cfg.grpo.clip_cov_ub:
        problems.append(
            f"grpo.clip_cov_lb = {cfg.grpo.clip_cov_lb!r}: must be below grpo.clip_cov_ub ({cfg.grpo.clip_cov_ub}), "
            "or no token's covariance lies between them and nothing is cut"
        )
    decay_steps = cfg.grpo.lr_decay_steps or cfg.grpo.steps
    if not decays_after_warmup(cfg.grpo.lr_scheduler_type, cfg.grpo.lr_warmup_steps, decay_steps):
        problems.append(
            f"grpo.lr_scheduler_type = {cfg.grpo.lr_scheduler_type!r} decays after the warmup "
            f"(grpo.lr_warmup_steps {cfg.grpo.lr_warmup_steps}) until step {decay_steps} "
            f"(grpo.lr_decay_steps, 0 = grpo.steps): the decay must end after the warmup"
        )
    if cfg.grpo.async_steps and cfg.run.save_every != 1:
        problems.append(
            f"grpo.async_steps = {cfg.grpo.async_steps} samples with policies the learner has moved "
            f"past, read from their checkpoints: run.save_every must be 1, not {cfg.run.save_every}"
        )
    if cfg.grpo.async_steps and cfg.rollout.dynamic_sampling:
        problems.append(
            "grpo.async_steps with rollout.dynamic_sampling: the extra sampling rounds wait for the "
            "judge of the step, so nothing can be sampled ahead; turn one of them off"
        )
    if (
        cfg.grpo.async_steps
        and cfg.rollout.engine == "hf"
        and cfg.grpo.learner == "torch"
        and cfg.model.lora_rank
        and cfg.model.lora_dropout > 0
    ):
        problems.append(
            "grpo.async_steps with the hf engine and model.lora_dropout > 0: the update's dropout draws from "
            "torch's process-wide generator, which the rollout sampled beside it seeds and samples from, so its "
            "samples would depend on thread timing; set model.lora_dropout=0, or rollout.engine=vllm"
        )
    if cfg.grpo.async_steps and cfg.reward.verifier == "co_rewarding_teacher":
        problems.append(
            "grpo.async_steps with reward.verifier 'co_rewarding_teacher': the EMA teacher labels each "
            "step after the previous update; turn one of them off"
        )
    if cfg.run.save_every > 1 and not cfg.run.keep_engines:
        problems.append(
            f"run.save_every = {cfg.run.save_every} keeps the weights of the steps between saves in the "
            "live learner, and run.keep_engines = false keeps no learner: set one of them back"
        )
    if cfg.model.lora_rank and cfg.reward.verifier == "co_rewarding_teacher" and not cfg.model.lora_save_merged:
        problems.append(
            "model.lora_rank with reward.verifier 'co_rewarding_teacher': the EMA teacher averages the "
            "full weights of each step's checkpoint, and LoRA checkpoints hold the adapter alone; set "
            "model.lora_save_merged=true"
        )
    if cfg.grpo.adaptive_entropy and cfg.grpo.entropy_coef_min > cfg.grpo.entropy_coef_max:
        problems.append(
            f"grpo.entropy_coef_min = {cfg.grpo.entropy_coef_min!r}: must not exceed grpo.entropy_coef_max "
            f"({cfg.grpo.entropy_coef_max})"
        )
    if cfg.grpo.reward_aggregation == "normalize_then_sum" and cfg.grpo.advantage != "group_std":
        problems.append(
            f"grpo.reward_aggregation 'normalize_then_sum' normalises each reward part by its group's std, and "
            f"grpo.advantage = {cfg.grpo.advantage!r} names another normaliser: set grpo.advantage=group_std"
        )
    if cfg.grpo.ref_sync_every and not (cfg.grpo.beta or cfg.grpo.kl_reward_coef):
        problems.append(
            f"grpo.ref_sync_every = {cfg.grpo.ref_sync_every} moves the KL reference, and with grpo.beta = 0 and "
            "grpo.kl_reward_coef = 0 nothing reads it: set one of them > 0, or grpo.ref_sync_every=0"
        )
    if cfg.grpo.kl_reward_target and not cfg.grpo.kl_reward_coef:
        problems.append(
            f"grpo.kl_reward_target = {cfg.grpo.kl_reward_target} adapts the coefficient of the KL in the reward, "
            "and grpo.kl_reward_coef = 0 turns that KL off (the controller multiplies its start value): set "
            "grpo.kl_reward_coef > 0 (verl kl_ctrl.kl_coef, e.g. 0.001), or grpo.kl_reward_target=0"
        )
    if cfg.grpo.ref_sync_every and cfg.model.lora_rank:
        problems.append(
            f"grpo.ref_sync_every = {cfg.grpo.ref_sync_every} with model.lora_rank: the KL reference is the "
            "starting policy with the adapters switched off, and a moved reference would be a second copy of the "
            "model; train full weights, or set grpo.ref_sync_every=0"
        )
    if cfg.grpo.logit_chunk_tokens and cfg.grpo.share_prompt:
        problems.append(
            f"grpo.logit_chunk_tokens = {cfg.grpo.logit_chunk_tokens} chunks the logits of training rows, and "
            "grpo.share_prompt (on by default) computes a group's logits over its shared prompt's cache instead: set "
            "grpo.share_prompt=false, or grpo.logit_chunk_tokens=0"
        )
    if cfg.grpo.gradient_checkpointing and cfg.grpo.share_prompt:
        problems.append(
            "grpo.gradient_checkpointing recomputes each layer in the backward pass, and grpo.share_prompt (on by "
            "default) keeps the shared prompt's key/value cache, which recomputation would drop: set "
            "grpo.share_prompt=false"
        )
    if cfg.grpo.compile_layers and (cfg.grpo.learner != "torch" or cfg.model.lora_rank):
        problems.append(
            "grpo.compile_layers compiles the torch learner's full-weight policy: set grpo.learner=torch and "
            "model.lora_rank=0, or grpo.compile_layers=false"
        )
    embedding_targets = [m for m in cfg.model.lora_target_modules if m in ("embed_tokens", "lm_head", "wte")]
    if cfg.model.lora_rank and embedding_targets:
        problems.append(
            f"model.lora_target_modules {embedding_targets}: adapters on the embeddings or the output layer (tied to "
            "each other in these models) are not merged or exported correctly; target linear layers: "
            "['all-linear'] or names such as [q_proj, v_proj]"
        )
    if cfg.model.lora_rank and cfg.model.reference:
        problems.append(
            "model.lora_rank with model.reference set: the adapters sit on the starting policy, which "
            "is also the KL reference; leave model.reference ''"
        )
    if cfg.rollout.agent.scripted_path and cfg.run.save_every > 1:
        problems.append(
            f"rollout.agent.scripted_path with run.save_every = {cfg.run.save_every}: scripted turns are "
            "scored by the policy's checkpoint, which is not written between saves; set run.save_every=1"
        )
    if cfg.rollout.num_engines > 1 and not cfg.run.ray_address:
        problems.append(
            f"rollout.num_engines = {cfg.rollout.num_engines} places its engines with Ray, and "
            "run.ray_address is '': set it ('local' for this machine, or a cluster's address)"
        )
    if trouble := address_problem(cfg.run.ray_address):
        problems.append(f"run.ray_address = {cfg.run.ray_address!r}: {trouble}")
    elif cfg.run.ray_address and importlib.util.find_spec("ray") is None:
        problems.append(f"run.ray_address = {cfg.run.ray_address!r} needs the ray package, which is not installed")
    if cfg.rollout.dynamic_sampling and cfg.reward.verifier == "co_rewarding_teacher":
        problems.append(
            "rollout.dynamic_sampling with reward.verifier 'co_rewarding_teacher': the EMA teacher "
            "samples only the step's first prompts, so fresh prompts would have no pseudo-label; turn "
            "one of them off"
        )
    if cfg.rollout.agent.enabled and cfg.reward.verifier == "co_rewarding_teacher":
        problems.append(
            "rollout.agent.enabled with reward.verifier 'co_rewarding_teacher': the EMA teacher samples single "
            "turns without tools, so its labels would come from another way of answering than the conversations "
            "they reward; turn one of them off"
        )
    if cfg.rollout.agent.enabled:
        from refiner_core.agent.rollout import agent_problems

        problems += agent_problems(cfg.rollout.agent)
    from refiner_core.publish.tracking import tracker_problems

    problems += tracker_problems(cfg.run.report_to)
    return problems


def bf16_weight_problems(cfg: RecipeConfig) -> list[str]:
    """Full bf16 weights (model.dtype bfloat16, no LoRA) that the learner's AdamW would step with no fp32 master
    copy: at GRPO's learning rates (1e-6) most updates are below half a bf16 unit and round away."""
    rounded_away = (
        "runs AdamW on the bf16 weights themselves (no fp32 master copy): at GRPO's learning rates (1e-6) most "
        "updates are below half a bf16 unit and round away. Set model.dtype=float32 with model.precision=bf16 (bf16 "
        "compute, fp32 weights and AdamW state)"
    )
    if cfg.grpo.learner == "torch":
        return [
            f"grpo.learner 'torch' with model.dtype = 'bfloat16' {rounded_away}, or grpo.learner=deepspeed with "
            "grpo.deepspeed.zero_stage 1-3 (ZeRO keeps fp32 master weights)"
        ]
    if cfg.grpo.learner != "deepspeed" or cfg.grpo.deepspeed.zero_stage != 0:
        return []
    from refiner_core.learners.deepspeed_learner import bf16_mode
    from refiner_core.models import default_device
    from refiner_core.runtime.hardware import resolve_precision

    device, precision = default_device(), cfg.model.precision
    if bf16_mode(device, resolve_precision(precision, device) if precision == "auto" else precision):
        return []
    return [
        f"grpo.learner 'deepspeed' with grpo.deepspeed.zero_stage = 0 and model.dtype = 'bfloat16' {rounded_away}, "
        "or grpo.deepspeed.zero_stage 1-3 (ZeRO keeps fp32 master weights; at stage 0 only DeepSpeed's bf16 mode "
        "does, on GPUs with model.precision bf16)"
    ]


def hostfile_problems(cfg: RecipeConfig) -> list[str]:
    """The deepspeed learner's hostfile can be read and its slots add up to grpo.deepspeed.world_size, as the
    learner requires when the first update launches it."""
    from refiner_core.learners.deepspeed_learner import launch_hosts

    hostfile = cfg.grpo.deepspeed.hostfile
    try:
        launch_hosts(hostfile, cfg.grpo.deepspeed.world_size)
    except OSError as e:
        return [f"grpo.deepspeed.hostfile: {hostfile!r} cannot be read ({e.strerror or e})"]
    except ValueError as e:
        return [f"grpo.deepspeed.hostfile: {e}"]
    return []


def recipe_warnings(cfg: RecipeConfig) -> list[str]:
    """Settings that run, but not as a user likely means: printed before the run, not refused."""
    return reward_warnings(cfg) + update_layout_warnings(cfg) + context_warnings(cfg)


def context_warnings(cfg: RecipeConfig) -> list[str]:
    """A prompt of data.max_prompt_tokens and a response of the longest length limit past the policy's context: the
    engines end such a response at the context, recorded as cut off ('length') before its limit."""
    context = _policy_context(cfg)
    longest = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    if context is None or cfg.data.max_prompt_tokens + longest <= context:
        return []
    return [
        f"data.max_prompt_tokens {cfg.data.max_prompt_tokens} + responses of up to {longest} tokens "
        f"(rollout.max_new_tokens, eval.max_new_tokens) is past model.policy's context of {context} tokens: a "
        f"response to a prompt over {max(context - longest, 0)} tokens ends at the context, recorded as cut off "
        "('length') before its limit"
    ]


def _policy_context(cfg: RecipeConfig) -> int | None:
    """The policy's context length: the tiny model's setting, a local checkpoint's config.json; None where it is
    not known without building or converting a model."""
    from refiner_core.models import context_length

    if cfg.model.policy == TINY_QWEN3:
        return cfg.model.max_position_embeddings
    return context_length(_model_folder(cfg.model.policy))


def _model_folder(spec: str) -> Path:
    """A model spec that names a folder, as models.resolve_model finds it: from the repo when it is there, else from
    here."""
    path = Path(spec)
    if path.is_absolute():
        return path
    return (REPO_ROOT / path) if (REPO_ROOT / path).exists() else path.resolve()


def update_layout_warnings(cfg: RecipeConfig) -> list[str]:
    """grpo.pack_length and grpo.micro_batch_size shape the update's micro-batches only with grpo.share_prompt off,
    and compiled layers share one compiled code only with it off."""
    grpo, defaults = cfg.grpo, GRPOConfig()
    if not grpo.share_prompt:
        return []
    ignored = [
        f"grpo.{name} = {getattr(grpo, name)}"
        for name in ("pack_length", "micro_batch_size")
        if getattr(grpo, name) != getattr(defaults, name)
    ]
    found = []
    if ignored:
        found.append(
            f"grpo.share_prompt (on by default) makes each micro-batch of the update one prompt's group, so it "
            f"ignores {' and '.join(ignored)}: set grpo.share_prompt=false for them to apply, or leave them at their "
            "defaults"
        )
    if grpo.compile_layers:
        found.append(
            "grpo.compile_layers with grpo.share_prompt: the prompt's cache is read by each layer's number, so each "
            "layer compiles code of its own (8 graphs for 2 layers of the tiny model, against 1 without), and past "
            "torch's limit of 8 recompilations the remaining layers run uncompiled: set grpo.share_prompt=false"
        )
    return found


def reward_warnings(cfg: RecipeConfig) -> list[str]:
    """Settings that run, but whose reward pays for what a user hardly wants: printed before the run, not refused."""
    reward = cfg.reward
    # What an answer without a block gives up against a well-formed one with the same judge score and valid IDs.
    given_up = reward.format_weight + reward.verification_reward * reward.citation_weight
    gated = reward.gate_judge_score_with_format_bonus
    if gated or not reward.distractor_penalty or reward.distractor_penalty < given_up:
        return []
    return [
        f"reward.distractor_penalty = {reward.distractor_penalty:g}, and an answer with no answer block cites "
        f"nothing, so it escapes the penalty and gives up at most {given_up:g} (reward.format_weight + "
        "verification_reward x citation_weight): it scores at least what a well-formed answer citing a "
        "distractor scores, and GRPO can learn to break the format; set reward.gate_judge_score_with_format_bonus=true"
    ]


def gpu_share_problems(cfg: RecipeConfig) -> list[str]:
    """On a GPU, a judge server the run starts holds its share for the whole run, and the vllm rollout engine
    wakes into its own beside it: together they cannot take more than the GPU (vLLM refuses to start short of its
    share). CPU runs ignore both shares."""
    from refiner_core.judges.serve import on_gpu

    serve, rollout = cfg.judge.openai, cfg.rollout
    if not (serve.serve and rollout.engine == "vllm" and on_gpu()):
        return []
    total = serve.serve_gpu_memory_utilization + rollout.gpu_memory_utilization
    if total <= 1:
        return []
    return [
        f"judge.openai.serve_gpu_memory_utilization ({serve.serve_gpu_memory_utilization}) + "
        f"rollout.gpu_memory_utilization ({rollout.gpu_memory_utilization}) = {total:.2f}: the judge server and the "
        "rollout engine share this GPU and together may take at most 1 of it (and should leave the learner room)"
    ]


def backend_problems(cfg: RecipeConfig) -> list[str]:
    """Every backend name of the recipe, checked against its table (or imported, for an import path), so a typo
    fails before anything runs, with the closest name."""
    from refiner_core.agent.tools.base import TOOLS
    from refiner_core.judges.base import JUDGES
    from refiner_core.learners.base import LEARNERS
    from refiner_core.reward.verifiers import VERIFIERS
    from refiner_core.rollout.base import ENGINES
    from refiner_core.runtime.registry import problem

    names = [
        ("rollout.engine", ENGINES, "rollout engine", cfg.rollout.engine),
        ("judge.engine", JUDGES, "judge engine", cfg.judge.engine),
        ("grpo.learner", LEARNERS, "learner", cfg.grpo.learner),
        ("reward.verifier", VERIFIERS, "verifier", cfg.reward.verifier),
    ]
    if cfg.rollout.agent.enabled:
        names += [("rollout.agent.tools", TOOLS, "tool", tool) for tool in cfg.rollout.agent.tools]
    return [
        f"{where} = {name!r}: {trouble}"
        for where, table, kind, name in names
        if (trouble := problem(table, kind, name) or (name not in table and _call_problem(table, kind, name)))
    ]


# How each table's factory is called (refiner_core/*/base.py, reward/verifiers.py): an outside factory must take it.
FACTORY_CALLS = {
    "rollout engine": ("model_path", "settings", "dtype", "precision"),
    "judge engine": ("model_path", "settings", "dtype", "precision="),
    "learner": ("policy_path", "reference_path", "tokenizer", "settings", "optimizer_state", "dtype"),
    "verifier": (),  # or (final_answer=...), when its signature names it
    "tool": ("settings",),
}


def _call_problem(table, kind: str, name: str) -> str | None:
    """Why the outside factory `name` cannot be called as its table calls its own, or None."""
    import inspect

    from refiner_core.runtime.registry import resolve

    factory = resolve(table, kind, name)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: left to the call
        return None
    call = FACTORY_CALLS[kind]
    positional = [a for a in call if not a.endswith("=")]
    keywords = {a[:-1]: None for a in call if a.endswith("=")}
    if kind == "verifier" and "final_answer" in signature.parameters:
        keywords["final_answer"] = None
    try:
        signature.bind(*positional, **keywords)
    except TypeError as e:
        shown = ", ".join([*positional, *(f"{k}=..." for k in keywords)])
        return f"its factory cannot be called as {kind} factories are, with ({shown}): {e}"
    return None


def _loopback_port(base_url: str) -> bool:
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    return parts.hostname in ("127.0.0.1", "localhost", "0.0.0.0") and parts.port is not None


def check_models(cfg: RecipeConfig) -> list[str]:
    problems = []
    for where, spec in (
        ("model.policy", cfg.model.policy),
        ("model.reference", cfg.model.reference),
        ("judge.model", cfg.judge.model),
    ):
        if not spec or spec in (TINY_QWEN3, SMOLLM2):
            continue
        path = _model_folder(spec)
        if not (path / "config.json").is_file():
            why = f"{path} has no config.json" if path.is_dir() else f"there is no folder {path}"
            problems.append(f"{where}: {spec!r} is not {TINY_QWEN3!r} or {SMOLLM2!r}, and {why}")
        elif where == "model.policy" and cfg.model.lora_rank and checkpoint_adapter(path) is not None:
            problems.append(
                f"model.policy: {spec!r} holds LoRA adapters and no merged weights, and model.lora_rank trains new "
                "adapters on the policy's own weights: start from a checkpoint saved with model.lora_save_merged=true"
            )
    return problems


def resolve(path: str) -> Path:
    """Local source paths resolve from the repo, as the flow resolves them."""
    p = Path(path)
    return p if p.is_absolute() else (REPO_ROOT / p).resolve()


def _shown(path: str) -> str:
    return path if Path(path).is_absolute() else f"{path} (resolved to {resolve(path)})"


def check_source(
    where: str,
    path: str,
    fmt: str,
    fields: dict,
    split: str,
    canonical: tuple[str, ...],
    shape: bool = False,
    fields_where: str = "",
    hub_config: str = "",
) -> list[str]:
    """The source exists, its mapping names canonical fields and existing columns, and (with `shape`) its rows
    will have the fields a refiner or chat row needs. A hub dataset is checked offline only, in the local cache."""
    fields_where = fields_where or f"{where}.fields"
    problems = check_mapping_keys(fields_where, fields, canonical)
    if fmt == "hub":
        if not hub_offline():  # with network only the hub knows; loading it is the stage's job
            return problems
        try:
            found = ({column: set() for column in cached_hub_columns(path, split, hub_config)}, "")
        except SourceError as e:
            return problems + [f"{where}.path: {e}"]
    else:
        local = resolve(path)
        if not local.exists():
            return problems + [f"{where}.path: {_shown(path)} does not exist"]
        try:
            kind = detect_format(str(local), fmt)
        except SourceError as e:
            return problems + [f"{where}.path: {e}"]
        found = source_columns(local, kind, split)
    if isinstance(found, str):
        return problems + [f"{where}.path: {found}"]
    if found is None:
        return problems
    kinds, sample = found
    columns = list(kinds)
    listing = f"its columns{sample}: {', '.join(columns) or 'none'}"
    # the columns of the well-formed entries are checked beside a misspelt key's problem: all reported at once
    named = {k: v for k, v in fields.items() if k in canonical and isinstance(v, str)}
    absent = {k: v for k, v in named.items() if v not in columns}
    for canonical_name, column in absent.items():
        close = difflib.get_close_matches(column, columns, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"{fields_where}: {canonical_name} -> {column!r}: no such column in {path}{hint}; {listing}")
    if problems:  # the kinds and the rows' shape follow from a mapping that is whole
        return problems
    problems += _check_kinds(where, path, kinds, sample, fields, canonical, fields_where)
    if shape:
        problems += _check_shape(where, path, columns, fields, listing, fields_where)
    return problems


def _check_kinds(
    where: str,
    path: str,
    kinds: dict[str, set[str]],
    sample: str,
    fields: dict,
    canonical: tuple[str, ...],
    fields_where: str,
) -> list[str]:
    """Columns the rows will read a canonical field from hold values of a kind that field accepts. A JSONL
    column is reported only when none of its sampled values fits (single bad rows are the quarantine's)."""
    problems = []
    for name in dict.fromkeys(canonical):
        column = fields.get(name, name)
        if name not in FIELD_KINDS or column not in kinds:
            continue
        found = kinds[column] - {"null"}
        accepted, wanted = FIELD_KINDS[name]
        if found and not found & accepted:
            where_from = f"{fields_where}: {name} -> {column!r}" if name in fields else f"{where}.path"
            problems.append(
                f"{where_from}: column {column!r} of {path} holds {' / '.join(sorted(found))}"
                f"{sample}; {name} must be {wanted}"
            )
    return problems


def check_mapping_keys(where: str, fields: dict, canonical: tuple[str, ...]) -> list[str]:
    names = list(dict.fromkeys(canonical))
    problems = []
    for key, column in fields.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{where}: {key!r} is not a field name{hint}; names: {', '.join(names)}")
        elif not isinstance(column, str):
            problems.append(f"{where}.{key}: expected a column name, got {column!r}")
    return problems


def _check_shape(where: str, path: str, columns: list[str], fields: dict, listing: str, fields_where: str) -> list[str]:
    """Mirror of sources.apply_field_mapping: which canonical names the mapped rows will carry."""
    have = {c for c in columns if c not in fields or fields[c] == c} | set(fields)
    required = REQUIRED_CHAT if "messages" in have and "question" not in have else REQUIRED_REFINER
    missing = [n for n in required if n not in have]
    if not missing:
        return []
    return [
        f"{where}.path: rows of {path} have no {', '.join(map(repr, missing))} (refiner rows need "
        f"{', '.join(REQUIRED_REFINER)}; chat rows need {', '.join(REQUIRED_CHAT)}); {listing}; map them with "
        f"{fields_where}, e.g. {{{missing[0]}: <column>}}"
    ]


def source_columns(path: Path, kind: str, split: str) -> tuple[dict[str, set[str]], str] | str | None:
    """({column name: the kinds of value it holds (see value_kind)}, how they were sampled) read cheaply, a
    problem sentence, or None when not knowable."""
    if kind == "jsonl":
        return _jsonl_columns(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            schema, rows = pq.read_schema(path), pq.read_metadata(path).num_rows
        except Exception as e:  # noqa: BLE001 - any unreadable file is reported, not raised
            return f"{path} is not a readable Parquet file ({e})"
        if not rows:
            return f"{path} has no rows"
        return {field.name: {arrow_kind(field.type)} for field in schema}, ""
    if kind == "disk":
        return _saved_dataset_columns(path, split)
    return None


def _jsonl_columns(path: Path) -> tuple[dict[str, set[str]], str] | str:
    columns: dict[str, set[str]] = {}
    seen_text = False
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            if n > JSONL_SAMPLE_LINES:
                return columns, f" (in its first {JSONL_SAMPLE_LINES} lines)"
            line = line.removeprefix(UTF8_BOM) if n == 1 else line
            seen_text = seen_text or bool(line.strip())
            row = parse_jsonl_line(n, line)  # unreadable lines are the quarantine's business
            for column, value in (row.data or {}).items():
                columns.setdefault(column, set()).update(value_kinds(value))
    return (columns, "") if seen_text else f"{path} is an empty file (no rows)"


def value_kinds(value) -> set[str]:
    """The kinds of a JSON value, as arrow_kind names column types: 'string', 'list of object', ... A list of
    mixed items has one kind per item kind."""
    if isinstance(value, list):
        items = set().union(*(value_kinds(v) for v in value if v is not None))
        return {f"list of {k}" for k in items} if items else {"list"}
    kinds = (
        (type(None), "null"),
        (bool, "bool"),
        (int, "integer"),
        (float, "number"),
        (str, "string"),
        (dict, "object"),
    )
    return {next((name for t, name in kinds if isinstance(value, t)), type(value).__name__)}


def arrow_kind(data_type) -> str:
    """A column type in value_kinds' words; binary columns count as strings (sources decode them as UTF-8)."""
    import pyarrow as pa

    t = pa.types
    if (
        t.is_string(data_type)
        or t.is_large_string(data_type)
        or t.is_binary(data_type)
        or t.is_large_binary(data_type)
        or t.is_string_view(data_type)
    ):
        return "string"
    if t.is_list(data_type) or t.is_large_list(data_type) or t.is_fixed_size_list(data_type):
        inner = arrow_kind(data_type.value_type)
        return "list" if inner == "null" else f"list of {inner}"
    checks = (
        (t.is_null, "null"),
        (t.is_boolean, "bool"),
        (t.is_integer, "integer"),
        (t.is_floating, "number"),
        (t.is_struct, "object"),
    )
    return next((name for check, name in checks if check(data_type)), str(data_type))


def _saved_dataset_columns(path: Path, split: str) -> tuple[dict[str, set[str]], str] | str | None:
    """Column names and kinds of a datasets.save_to_disk folder from its JSON metadata, without loading the data."""
    splits_file = path / "dataset_dict.json"
    if splits_file.is_file():
        splits = json.loads(splits_file.read_text()).get("splits", [])
        if split not in splits:
            return f"{path} has no split {split!r}; its splits: {', '.join(splits)}"
        path = path / split
    info = path / "dataset_info.json"
    if not info.is_file():
        return None
    features = json.loads(info.read_text()).get("features") or {}
    from datasets import Features

    schema = Features.from_dict(features).arrow_schema
    return {field.name: {arrow_kind(field.type)} for field in schema}, ""
