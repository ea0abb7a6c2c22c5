"""The model card (README.md, Hugging Face format) of every checkpoint a run writes: YAML metadata, then what the
checkpoint is, how it was trained, on what data, how to reproduce it, its held-out evaluation and known notes.

`model_card` is pure: plain values in (the resolved recipe as a dict, run, step, parent, metrics, evals), markdown
out. `write_model_card` gathers those values from a run folder and writes the file. The card is not part of a
checkpoint's content hash (refiner_core.store.storage.dir_hash), so it can be rewritten once the checkpoint is evaluated
without invalidating any cached stage.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from refiner_core.config import moved_to_sections

MODEL_CARD = "README.md"
RECIPE_FILE = "recipe.yaml"  # the resolved recipe a run writes into its folder (flows/run_folder.py)
# Sampling settings the card names only where the recipe sets them: their value when off.
SAMPLING_OFF = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}

# Model specs with a known Hub origin: (base_model id, license).
KNOWN_BASES = {
    "smollm2-135m-instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"),
}
KINDS = {
    "grpo": "GRPO policy checkpoint",
    "sft": "SFT warm-start checkpoint (the GRPO starting point)",
    "teacher": "EMA teacher checkpoint (Co-rewarding-II: teacher <- alpha * policy + (1 - alpha) * teacher)",
    "reference": "KL reference checkpoint (grpo.ref_sync_every: reference <- alpha * policy + (1 - alpha) * reference)",
}


def model_card(
    recipe: dict,
    *,
    kind: str,
    run: str,
    step: int | None,
    checkpoint: str,
    parent: str,
    metrics: dict | None = None,
    evals: list[dict] | None = None,
    data: dict | None = None,
    judge_cost: dict | None = None,
    fork: dict | None = None,
) -> str:
    """The markdown of a checkpoint's card. `recipe` is the resolved recipe (RecipeConfig.to_dict()); `kind` one of
    KINDS; `step` the number of updates the checkpoint holds (None for SFT); `metrics` its steps row; `evals` the
    eval summary rows of this checkpoint (refiner_core.eval.evaluate.summarize); `data` counts of the prepared
    prompts ({'train', 'validation', 'quarantined'}); `fork` the run's fork record (refiner_core.store.forks.Fork as a
    dict) when it is a fork."""
    if kind not in KINDS:
        raise ValueError(f"model card kind {kind!r}: one of {sorted(KINDS)}")
    recipe = moved_to_sections(recipe)  # a run folder's recipe.yaml from before judge.openai / grpo.deepspeed
    model, grpo = recipe["model"], recipe["grpo"]
    base_model, license_ = KNOWN_BASES.get(model["policy"], (model["policy"], "other"))
    tags = (
        ["refiner-grpo", "sft"]
        if kind == "sft"
        else ["grpo", "refiner-grpo", "reinforcement-learning", grpo["policy_loss"].replace("_", "-")]
    )
    if kind == "teacher":
        tags.append("ema-teacher")
    metadata = {
        "base_model": base_model,
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": tags,
        "datasets": [recipe["data"]["path"]],
        "license": license_,
    }
    where = f"step {step}" if step is not None else "before the first GRPO step"
    sections = [
        "---\n" + yaml.safe_dump(metadata, sort_keys=False) + "---",
        f"# {run} — {checkpoint}",
        f"{KINDS[kind]} written by refiner-grpo: run `{run}`, {where}, trained from `{parent}` "
        f"(base model `{model['policy']}`).",
        "## Training setup\n\n" + _table(_setup_rows(recipe, kind)),
    ]
    if fork:
        sections.insert(3, _lineage(fork))
    if metrics:
        sections.append(
            f"## Metrics of step {step - 1}\n\n"
            + _table([(k, _value(v)) for k, v in metrics.items() if k not in ("run", "step", "checkpoint")], "metric")
        )
    sections.append("## Data\n\n" + _table(_data_rows(recipe, data), "data"))
    if evals:
        from refiner_core.eval.evaluate import markdown_table

        sections.append("## Held-out evaluation\n\n" + markdown_table(evals))
    if judge_cost:
        prices = (recipe["judge"].get("price_per_mtok_in", 0.0), recipe["judge"].get("price_per_mtok_out", 0.0))
        sections.append("## Judge cost\n\n" + judge_cost_line(judge_cost, *prices))
    sections.append(_reproduce(recipe, kind, step, fork))
    notes = known_notes(recipe, data)
    if notes:
        sections.append("## Known notes\n\n" + "\n".join(f"- {n}" for n in notes))
    return "\n\n".join(sections) + "\n"


def judge_cost_line(cost: dict, price_in: float, price_out: float) -> str:
    """The run's judge ledger up to this checkpoint: `cost` sums the steps rows' judge_* columns ('steps' of them);
    the prices are dollars per million prompt / completion tokens, neither set: not priced."""
    tokens = (
        f"{cost['judge_requests']} requests, {cost['judge_prompt_tokens']} prompt and "
        f"{cost['judge_completion_tokens']} completion tokens over {cost['steps']} GRPO step(s): "
    )
    left_out = "the training steps' judging; held-out evaluations and judge anchors: the catalog's judge_spend"
    if cost.get("judge_cost_usd") is None or not (price_in or price_out):
        return tokens + f"not priced (judge.price_per_mtok_in / _out; {left_out})."
    return tokens + (
        f"${cost['judge_cost_usd']:.4f} at ${price_in:g} / ${price_out:g} per "
        f"million prompt / completion tokens (judge.price_per_mtok_in / _out; {left_out})."
    )


def _lineage(fork: dict) -> str:
    changed = " ".join(f"`--set {s}`" for s in fork["settings"]) or "no setting changed"
    if fork["shares_steps"]:
        origin = (
            f"Run `{fork['run']}` is a fork of run `{fork['parent_run']}` (`{fork['parent_dir']}`) at step "
            f"{fork['at']}: steps 0-{fork['at'] - 1} are that run's, with its recipe; from step {fork['at']} on it "
            f"trains with {changed}."
        )
    else:
        origin = (
            f"Run `{fork['run']}` was forked from run `{fork['parent_run']}` (`{fork['parent_dir']}`) with {changed}; "
            "it shares no step with it."
        )
    note = f" {fork['note']}." if fork.get("note") else ""
    return f"## Lineage\n\n{origin}{note} The same fork again:\n\n```bash\n{_fork_command(fork)}\n```"


def _fork_command(fork: dict, extra: str = "") -> str:
    again = " ".join(["refiner fork", fork["parent_dir"], "NEW_RUN_DIR", f"--at {fork['at']}"])
    return again + "".join(f" --set {s}" for s in fork["settings"]) + extra


def _setup_rows(recipe: dict, kind: str) -> list[tuple[str, str]]:
    model, grpo, rollout, reward, judge = (recipe[k] for k in ("model", "grpo", "rollout", "reward", "judge"))
    if kind == "sft":
        sft = recipe["sft"]
        return [
            ("method", "supervised fine-tuning on assistant tokens, packed"),
            ("data", sft["path"] or recipe["data"]["path"]),
            ("epochs", sft["epochs"]),
            ("learning rate", sft["learning_rate"]),
            ("warmup steps", sft["warmup_steps"]),
            (
                "batch",
                f"{sft['micro_batch_size']} packs x {sft['gradient_accumulation']} accumulation steps, "
                f"pack length {sft['pack_length']}",
            ),
            (
                "max prompt / response / total tokens",
                f"{sft['max_prompt_tokens']} / {sft['max_response_tokens']} / {sft['max_total_tokens']}",
            ),
            ("precision", f"{model['precision']} (weights {model['dtype']})"),
            ("seed", recipe["run"]["seed"]),
        ]
    judge_model = judge["model"] or f"{model['policy']} (the base policy model)"
    judged = (
        f"{reward['verification_reward']} x ({reward['rubric_weight']} x rubric score + "
        f"{reward['citation_weight']} x citation score [{reward['citation_score']}])"
    )
    if reward["format_weight"]:
        judged += f" + {reward['format_weight']} x format score"
    if reward.get("distractor_penalty"):
        judged += f" - {reward['distractor_penalty']} if it cites a distractor snippet"
    if reward.get("supporting_recall_weight"):
        judged += f" + {reward['supporting_recall_weight']} x the share of supporting snippets cited"
    if reward.get("gate_judge_score_with_format_bonus"):
        judged += "; the judged part is 0 when the format is broken"
    learner = grpo["learner"]
    if learner == "deepspeed":
        deepspeed = grpo["deepspeed"]
        learner += f", ZeRO stage {deepspeed['zero_stage']}, {deepspeed['world_size']} rank(s)"
        if deepspeed["offload_optimizer"]:
            learner += ", optimizer offloaded to CPU"
    algorithm = (
        f"GRPO, policy_loss {grpo['policy_loss']}, advantage {grpo['advantage']} "
        f"(std ddof {grpo['advantage_std_ddof']})"
    )
    if grpo.get("adaptive_entropy"):  # .get: a recipe saved before these settings
        algorithm += f", entropy bonus from {grpo['entropy_coef']} adapted to {grpo['entropy_target']} nats"
    elif grpo["entropy_coef"]:
        algorithm += f", entropy bonus {grpo['entropy_coef']}"
    if grpo.get("off_policy_mask_threshold"):
        algorithm += f", negative samples off-policy by more than {grpo['off_policy_mask_threshold']} masked"
    rows = [
        ("algorithm", algorithm),
        (
            "KL",
            f"kl_estimator {grpo['kl_estimator']}, beta {grpo['beta']}"
            + (f", reference {model['reference']}" if model["reference"] else ", reference = starting policy")
            + (
                f", moved toward the policy every {grpo['ref_sync_every']} steps (alpha {grpo['ref_mixup_alpha']})"
                if grpo.get("ref_sync_every")
                else ""
            )
            + (
                f"; in the reward: {grpo['kl_reward_estimator']} x {grpo['kl_reward_coef']}"
                + (f", adapted toward KL {grpo['kl_reward_target']}" if grpo.get("kl_reward_target") else "")
                if grpo.get("kl_reward_coef")
                else ""
            ),
        ),
        ("clip eps (low / high)", f"{grpo['clip_eps_low']} / {grpo['clip_eps_high']}"),
        ("loss_aggregation", grpo["loss_aggregation"]),
        ("reward (judged prompts)", judged),
        ("reward (prompts without rubrics)", f"verifier {reward['verifier']}"),
        ("judge", f"{judge['engine']}: {judge_model}, mode {judge['mode']}"),
        (
            "batch shape",
            f"{rollout['prompts_per_step']} prompts x {rollout['samples_per_prompt']} samples per step, "
            f"{grpo['minibatches']} optimizer step(s) per batch"
            + (f" x {grpo['epochs']} passes" if grpo.get("epochs", 1) > 1 else "")  # a recipe saved before epochs
            + f", micro batch {grpo['micro_batch_size']}",
        ),
        (
            "learning rate",
            f"{grpo['learning_rate']} (AdamW, {_lr_schedule(recipe)}, weight decay {grpo['weight_decay']}, "
            f"max grad norm {grpo['max_grad_norm']})",
        ),
        ("max prompt / response tokens", f"{recipe['data']['max_prompt_tokens']} / {rollout['max_new_tokens']}"),
        (
            "sampling",
            f"temperature {rollout['temperature']}, top_p {rollout['top_p']}"
            + "".join(f", {k} {rollout[k]}" for k, off in SAMPLING_OFF.items() if rollout.get(k, off) != off)
            + f", engine {rollout['engine']}",
        ),
        (
            "precision",
            f"{model['precision']} (weights {model['dtype']}"
            + ("; this average is stored in float32)" if kind in ("teacher", "reference") else ")"),
        ),
        ("learner", learner),
        ("seed", recipe["run"]["seed"]),
    ]
    if kind == "teacher":
        teacher = recipe["teacher"]
        rows.append(
            (
                "EMA teacher",
                f"alpha {teacher['alpha_start']} -> {teacher['alpha_end']} over "
                f"{teacher['schedule_steps']} steps, every {teacher['update_interval']} step(s)",
            )
        )
    return rows


def _data_rows(recipe: dict, data: dict | None) -> list[tuple[str, str]]:
    source = recipe["data"]
    rows = [
        ("source", f"{source['path']} (format {source['format']})"),
        ("held out for evaluation", f"data.validation_fraction {source['validation_fraction']}"),
    ]
    if data:
        rows.append(("prompts", f"{data['train']} train, {data['validation']} validation"))
        if data.get("quarantined") is not None:
            rows.append(("quarantined rows", data["quarantined"]))
    return rows


def _reproduce(recipe: dict, kind: str, step: int | None, fork: dict | None = None) -> str:
    steps = f" --set grpo.steps={step}" if kind != "sft" and step else ""
    grpo = recipe["grpo"]
    if steps and grpo["lr_scheduler_type"] != "constant" and not grpo["lr_decay_steps"]:
        # a decay of 0 steps ends at grpo.steps: the shorter run keeps the original's, and so its learning rates
        steps += f" --set grpo.lr_decay_steps={grpo['steps']}"
    what = (
        "this checkpoint is the SFT checkpoint of the new run"
        if kind == "sft"
        else f"the new run's checkpoint of step {step} is this one"
        if kind == "grpo"
        else f"the new run's {'KL reference' if kind == 'reference' else 'teacher'} of step {step} is this one"
    )
    resolved = f"```yaml\n{yaml.safe_dump(recipe, sort_keys=False)}```"
    if fork and fork["shares_steps"]:  # its steps before the fork step ran with the parent's recipe, not this one
        return (
            f"## Reproduce\n\nRun `{fork['run']}` is a fork: its steps before {fork['at']} ran with "
            f"`{fork['parent_run']}`'s recipe, so the recipe below (the fork's own, from step {fork['at']} on) does "
            f"not reproduce them alone. With `{fork['parent_dir']}` (or a run of its recipe that finished step "
            f"{fork['at'] - 1}), fork it again:\n\n```bash\n{_fork_command(fork, steps)}\n```\n\n"
            f"With the same seed, data and machine kind, {what}.\n\n{resolved}"
        )
    return (
        f"## Reproduce\n\nSave the resolved recipe below (every setting of the run) as `recipe.yaml`, then"
        f"\n\n```bash\nrefiner run recipe.yaml{steps} --run-dir NEW_RUN_DIR\n```\n\n"
        f"With the same seed, data and machine kind, {what}.\n\n{resolved}"
    )


def known_notes(recipe: dict, data: dict | None) -> list[str]:
    """Limits a reader of the card should know, derived from the recipe."""
    model, judge, grpo = recipe["model"], recipe["judge"], recipe["grpo"]
    notes = []
    if model["policy"] == "tiny-qwen3":
        notes.append(
            "tiny-qwen3 is a ~230k-parameter model with random initial weights, built from a config: "
            "this checkpoint exercises the pipeline; it is not a useful model."
        )
    if judge["engine"] == "transformers" and judge["model"] in ("", model["policy"]):
        notes.append(
            f"The judge is the base policy model itself ({model['policy']}), a small model: its rubric "
            "scores are weak, noisy evidence of quality"
            + (
                " (mode expected_score: a probability-weighted score, never a parse failure)."
                if judge["mode"] == "expected_score"
                else f"; unparseable judgments count as judge.on_failure '{judge['on_failure']}'."
            )
        )
    if grpo["beta"] == 0 and not grpo.get("kl_reward_coef"):
        notes.append("beta = 0: no KL penalty, nothing holds the policy near its reference.")
    if model["lora_rank"] and not model["lora_save_merged"]:
        # the adapters sit on the starting policy (preflight refuses model.reference with LoRA)
        base = (
            f"`checkpoints/sft`, this run's SFT checkpoint (trained from `{model['policy']}`)"
            if recipe["sft"]["enabled"]
            else f"`{model['policy']}` (model.policy)"
        )
        notes.append(
            f"A GRPO checkpoint holds the rank-{model['lora_rank']} LoRA adapter in adapter/, not merged weights "
            f"(model.lora_save_merged writes them too). The adapter applies to {base}: "
            "refiner_core.models.load_model(THIS_FOLDER) merges the two as the run's engines did, or load that base, "
            "then peft.PeftModel.from_pretrained(base, THIS_FOLDER, subfolder='adapter'). `refiner push` uploads "
            "the merged weights, not the adapter: the pushed model loads with "
            "transformers.AutoModelForCausalLM.from_pretrained(REPO) alone."
        )
    if data and data.get("quarantined"):
        notes.append(
            f"{data['quarantined']} input rows were quarantined (not trained on); see them with "
            'refiner sql RUN_DIR "SELECT * FROM quarantine".'
        )
    return notes


def _table(rows: list[tuple[str, object]], what: str = "setting") -> str:
    lines = [f"| {what} | value |", "|---|---|"]
    return "\n".join(lines + [f"| {k} | {_cell(v)} |" for k, v in rows])


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _value(value: object) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def prompt_counts(run_dir: Path) -> dict | None:
    """Train / validation prompts and quarantined rows of a run's prepared data; None before data is prepared."""
    import pyarrow.parquet as pq

    prompts, quarantine = Path(run_dir) / "data" / "prompts.parquet", Path(run_dir) / "data" / "quarantine.parquet"
    if not prompts.is_file():
        return None
    splits = pq.read_table(prompts, columns=["split"]).column("split").to_pylist()
    return {
        "train": splits.count("train"),
        "validation": splits.count("validation"),
        "quarantined": pq.read_metadata(quarantine).num_rows if quarantine.is_file() else None,
    }


def parent_checkpoint(recipe: dict, kind: str, step: int | None) -> str:
    """What a policy checkpoint was trained from: the previous step's checkpoint, else the SFT checkpoint when the
    run warm-starts, else the base model spec."""
    if kind == "grpo" and step and step > 1:
        return f"checkpoints/step_{step - 1:04d}"
    if kind == "grpo" and recipe["sft"]["enabled"]:
        return "checkpoints/sft"
    return recipe["model"]["policy"]


def write_model_card(
    folder: Path,
    run_dir: Path | str,
    *,
    kind: str,
    run: str,
    step: int | None,
    checkpoint: Path | str | None = None,
    parent: str | None = None,
    metrics: dict | None = None,
    evals: list[dict] | None = None,
    judge_cost: dict | None = None,
) -> Path | None:
    """Write `folder`/README.md from the run folder's resolved recipe. `checkpoint` is the folder's final path
    (default `folder`: a card written inside an atomic_dir names the folder it becomes); paths inside the run folder
    are shown relative to it. `parent` defaults to parent_checkpoint. None (nothing written) when the run folder
    holds no recipe.yaml (a stage run outside a pipeline run)."""
    from refiner_core.store.forks import read_fork
    from refiner_core.store.storage import atomic_path

    run_dir = Path(run_dir)
    recipe_path = run_dir / RECIPE_FILE
    if not recipe_path.is_file():
        return None
    recipe = yaml.safe_load(recipe_path.read_text())
    text = model_card(
        recipe,
        kind=kind,
        run=run,
        step=step,
        checkpoint=_shown(checkpoint or folder, run_dir),
        parent=_shown(parent, run_dir) if parent else parent_checkpoint(recipe, kind, step),
        metrics=metrics,
        evals=evals,
        data=prompt_counts(run_dir),
        judge_cost=judge_cost,
        fork=fork.to_dict() if (fork := read_fork(run_dir)) else None,
    )
    tmp, path = atomic_path(Path(folder) / MODEL_CARD)
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _shown(path: Path | str, run_dir: Path) -> str:
    try:
        return Path(path).resolve().relative_to(run_dir.resolve()).as_posix()
    except ValueError:
        return str(path)


def _lr_schedule(recipe: dict) -> str:
    """'constant', or 'cosine to 0.1x by step 20 after 2 warmup steps' (a recipe saved before schedules: constant)."""
    grpo = recipe["grpo"]
    kind = grpo.get("lr_scheduler_type", "constant")
    warmup = f" after {grpo['lr_warmup_steps']} warmup steps" if grpo.get("lr_warmup_steps") else ""
    if kind == "constant":
        return f"constant{warmup}"
    return f"{kind} to {grpo['min_lr_ratio']}x by step {grpo['lr_decay_steps'] or grpo['steps']}{warmup}"
