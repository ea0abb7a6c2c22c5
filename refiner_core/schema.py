"""Every table of the pipeline, defined once. Parquet schemas and DuckDB DDL are derived from here."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from refiner_core.config import reward_weight_fields


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    doc: str


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    key: tuple[str, ...]
    columns: tuple[Column, ...]
    # Columns that record how a row was obtained (when, how long, what it cost), not what it holds: a rerun that
    # makes the same rows differs in them, so the hash later stages key on leaves them out (storage.write_rows).
    provenance: tuple[str, ...] = ()

    @property
    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(c.name, c.type, nullable=c.name not in self.key) for c in self.columns])

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]


def _c(name: str, type_: pa.DataType, doc: str) -> Column:
    return Column(name, type_, doc)


S, I, F, B = pa.string(), pa.int64(), pa.float64(), pa.bool_()  # noqa: E741  (column type shorthands)
TS = pa.timestamp("us", tz="UTC")

PROMPTS = Table(
    "prompts",
    "One row per training prompt after SFT-data preparation: rendered chat prompt and reference answer.",
    ("run", "prompt_id"),
    (
        _c("run", S, "Run name."),
        _c("prompt_id", S, "Stable row ID from the source data."),
        _c("split", S, "'train' or 'validation'."),
        _c("question", S, "The user's research question."),
        _c("reasoning", S, "The search agent's reasoning given to the refiner."),
        _c("tool_output", S, "Raw search-tool output with <snippet id=...> blocks."),
        _c("snippet_ids", pa.list_(S), "IDs of the snippets present in tool_output."),
        _c(
            "supporting_ids",
            pa.list_(S),
            "IDs of the snippets that support the reference answer (data field supporting_ids); the others are "
            "distractors. NULL when the row does not label them.",
        ),
        _c("reference_answer", S, "Reference refined answer in the target format (may be empty)."),
        _c(
            "ground_truth", S, "Chat rows: the answer a ground-truth verifier checks responses against; NULL otherwise."
        ),
        _c(
            "twin_id",
            S,
            "The prompt ID of this question's other view (its rephrased twin, Co-rewarding-I); NULL "
            "when it has none. Both views share a split and are sampled in the same step.",
        ),
        _c("prompt_text", S, "The chat-template rendering fed to the policy."),
        _c("prompt_token_ids", pa.list_(pa.int32()), "Token IDs of prompt_text."),
        _c("prompt_tokens", I, "len(prompt_token_ids)."),
        _c("reference_tokens", I, "Token count of the reference answer."),
        _c("content_hash", S, "Hash of the source row's content (dedupe key)."),
    ),
)

RUBRICS = Table(
    "rubrics",
    "Rubrics the judge scores each rollout against: per-instance positive/negative plus the static set.",
    ("run", "prompt_id", "rubric_id"),
    (
        _c("run", S, "Run name."),
        _c("prompt_id", S, "Prompt the rubric belongs to."),
        _c("rubric_id", S, "Unique within the prompt: 'pos-0', 'neg-1', 'static-citation-discipline', ..."),
        _c("kind", S, "'positive' or 'negative' (negative scores are flipped: 1 - s)."),
        _c("source", S, "'instance' or 'static'."),
        _c("title", S, "Short title."),
        _c("description", S, "The criterion the judge sees."),
        _c("weight", F, "Weight in the rubric score."),
    ),
)

ROLLOUTS = Table(
    "rollouts",
    "One row per sampled response, with everything needed to train on it without re-tokenizing.",
    ("run", "step", "prompt_id", "sample_idx"),
    (
        _c("run", S, "Run name."),
        _c("step", I, "GRPO step that sampled this rollout (0-based)."),
        _c("prompt_id", S, "Prompt ID."),
        _c("sample_idx", I, "Index within the prompt's group (0..G-1)."),
        _c("policy", S, "Checkpoint path of the sampling policy."),
        _c("policy_hash", S, "Content hash of the sampling policy's weights."),
        _c("engine", S, "Rollout engine that produced it ('hf', 'vllm', ...)."),
        _c("temperature", F, "Sampling temperature."),
        _c("seed", I, "Sampling seed of the batch."),
        _c("prompt_token_ids", pa.list_(pa.int32()), "Prompt token IDs as fed to the engine."),
        _c("response_token_ids", pa.list_(pa.int32()), "Sampled token IDs (EOS included when emitted)."),
        _c("response_logprobs", pa.list_(pa.float32()), "Engine log-probability of each sampled token."),
        _c("response_text", S, "Decoded response (special tokens removed)."),
        _c("response_tokens", I, "len(response_token_ids)."),
        _c(
            "finish_reason",
            S,
            "'stop' (EOS or stop string) or 'length'; agent rollouts also 'max_turns' (still "
            "calling tools at rollout.agent.max_turns); 'length' = out of token budget.",
        ),
        _c(
            "response_mask",
            pa.list_(B),
            "Per response token: true where the policy sampled it (the loss applies), "
            "false for tokens the agent loop inserted (tool results, template framing).",
        ),
        _c("tool_rounds", I, "Agent rollouts: assistant turns whose tool calls ran (0 without tools)."),
        _c(
            "final_text",
            S,
            "The last assistant turn's text, where the final answer is read (agent rollouts; '' when that turn "
            "called a tool: the conversation ended at max_turns or out of tokens waiting for a result); "
            "response_text otherwise.",
        ),
        _c("created_at", TS, "When the rollout was written."),
        _c(
            "round",
            I,
            "Sampling round of the step (0 = its first; rollout.dynamic_sampling adds rounds of fresh "
            "prompts in place of all-equal groups); NULL in rows written before rounds existed.",
        ),
    ),
    provenance=("created_at",),
)

JUDGE_SCORES = Table(
    "judge_scores",
    "One row per (rollout, rubric): the judge's raw output, parsed score, and failure if any.",
    ("run", "step", "prompt_id", "sample_idx", "rubric_id"),
    (
        _c("run", S, "Run name."),
        _c("step", I, "GRPO step."),
        _c("prompt_id", S, "Prompt ID."),
        _c("sample_idx", I, "Sample index."),
        _c("rubric_id", S, "Rubric ID (joins rubrics)."),
        _c("kind", S, "'positive' or 'negative'."),
        _c("weight", F, "Rubric weight."),
        _c("judge", S, "Judge engine and model."),
        _c("raw_output", S, "Verbatim judge output."),
        _c("raw_score", F, "Parsed score on the judge's 0-2 scale; NULL when parsing failed."),
        _c("score", F, "raw_score / 2: 0/1/2 map to 0/0.5/1; NULL when parsing failed."),
        _c("oriented_score", F, "score for positive rubrics, 1 - score for negative; NULL on failure."),
        _c(
            "failure",
            S,
            "NULL when parsed; otherwise why ('unparseable: ...', 'out_of_range: ...', 'non_numeric: ...', "
            "'ambiguous: ...' (several score objects that disagree), or a transport failure after retries: "
            "'timeout: ...', 'http_500: ...', 'refused: ...', 'budget_exhausted: ...').",
        ),
        _c(
            "latency_seconds",
            F,
            "Seconds the answer took (openai: the successful request, 0 on a cache hit; "
            "transformers: the batch's time / its pairs).",
        ),
        _c(
            "attempts",
            I,
            "HTTP requests made for this pair (1 + retries; 1 in-process; 0 on a cache hit, unless an earlier attempt "
            "of this same stage of the run paid for the answer: then its requests, as prompt_tokens).",
        ),
        _c("cache_hit", B, "The answer came from the judge cache (no request)."),
        _c("judge_model", S, "The judge model: the served model name (openai) or the checkpoint path (in-process)."),
        _c(
            "prompt_hash",
            S,
            "Hash of the exact judge prompt (chat messages); with the model and sampling settings "
            "it keys the judge cache.",
        ),
        _c(
            "prompt_tokens",
            I,
            "Prompt tokens the judgment cost: the server's `usage` (openai), the rendered prompt counted in-process "
            "(transformers); 0 on a cache hit (nothing paid), unless an earlier attempt of this same stage of the run "
            "paid for the answer (a retry, the rerun after a failure): then what it paid, so the run's spend counts "
            "it once; NULL when unknown (no usage sent, no answer).",
        ),
        _c("completion_tokens", I, "Completion tokens the judgment cost (as prompt_tokens; 0 for 'expected_score')."),
    ),
    provenance=("latency_seconds", "attempts", "cache_hit", "prompt_tokens", "completion_tokens"),
)

_ROLLOUT_KEY = (
    _c("run", S, "Run name."),
    _c("step", I, "GRPO step."),
    _c("prompt_id", S, "Prompt ID."),
    _c("sample_idx", I, "Sample index."),
)

# What was measured about each rollout, before any weight: the judge stage writes it once, and every reward
# version (training's and each `refiner rescore`) is computed from it by SQL without calling the judge again.
_REWARD_INPUT_COLUMNS = (
    _c(
        "verifier",
        S,
        "'judge' (rubrics judged by an LLM) or the verifier of a prompt without rubrics "
        "(reward.verifier: 'ground_truth', ...).",
    ),
    _c(
        "verifier_score",
        F,
        "Verifier prompts: the verifier's score (ground_truth: 1.0 correct, 0.0 not); NULL for the judge.",
    ),
    _c(
        "correct",
        F,
        "Verifier prompts: 1.0 when the final answer matches the ground truth, else 0.0; NULL for the judge.",
    ),
    _c(
        "extracted_answer",
        S,
        "Verifier prompts: the response's final answer (last \\boxed{}, <answer> text or the whole response).",
    ),
    _c(
        "verify_method",
        S,
        "Verifier prompts: 'math_verify', 'normalized_match' (with the reason in verify_detail) or 'no_answer'.",
    ),
    _c("verify_detail", S, "Why math-verify did not decide, when the normalised match was used instead."),
    _c(
        "label_source",
        S,
        "Pseudo-label verifiers: whose rollouts voted the label ('self', 'twin' = the question's "
        "rephrased view, 'teacher' = the EMA teacher); NULL otherwise.",
    ),
    _c(
        "pseudo_label",
        S,
        "The majority-voted \\boxed{} answer the rollout was rewarded against; NULL when no "
        "rollout of the source voted (then the reward is 0).",
    ),
    _c("label_votes", I, "Votes for the pseudo-label."),
    _c("label_voters", I, "Rollouts of the label source that voted (gave a \\boxed{} answer)."),
    _c("label_tied", B, "The label won a tie (broken by the earliest vote, i.e. the lowest sample index)."),
    _c(
        "label_correct",
        F,
        "The pseudo-label against the ground truth (1.0 / 0.0); NULL without a ground truth or label.",
    ),
    _c("has_answer", B, "Exactly one <answer>...</answer> block."),
    _c("format_ok", B, "Answer block present and snippet tags well formed."),
    _c("format_score", F, "1.0 when format_ok else 0.0."),
    _c("n_citations", I, "Cited IDs (multi-ID citations count each ID)."),
    _c("n_invalid_citations", I, "Cited IDs not present in the prompt's tool output."),
    _c("citation_valid_fraction", F, "Fraction of cited IDs that are valid (0 with no answer or no citation)."),
    _c(
        "n_distractor_citations",
        I,
        "Cited IDs present in the tool output but not among the prompt's supporting_ids (distractors); NULL when "
        "the prompt does not label its supporting snippets or the response has no answer block.",
    ),
    _c(
        "cites_distractor",
        B,
        "n_distractor_citations > 0: the answer cites a snippet that does not support it; NULL without labels or "
        "answer.",
    ),
    _c(
        "supporting_recall",
        F,
        "Share of the prompt's supporting_ids the answer cites (0 to 1); NULL without labels or answer.",
    ),
    _c(
        "claims", I, "Claims in the answer (cited spans + uncited factual sentences); NULL when claims were not judged."
    ),
    _c(
        "citation_precision",
        F,
        "Mean support of the cited claims by their cited snippets (1 / 0.5 / 0 each); "
        "NULL when claims were not judged.",
    ),
    _c(
        "citation_recall",
        F,
        "Summed support of the cited claims / all claims (uncited ones count 0); NULL when claims were not judged.",
    ),
    _c(
        "citation_f1",
        F,
        "2PR / (P + R) (0 when both are 0), a claim whose judgment failed counting 0; NULL when claims were not "
        "judged.",
    ),
    _c(
        "claims_judged",
        I,
        "Claims the judge was asked to rate (cited with an ID of the tool output; uncited claims and those citing "
        "only invented IDs need no call); NULL when claims were not judged.",
    ),
    _c(
        "claims_failed",
        I,
        "Claims whose support judgment failed (citation_claims.failure); NULL when claims were not judged.",
    ),
    _c(
        "citation_f1_judged",
        F,
        "citation_f1 with the failed claims left out: the F1 under judge.on_failure 'skip' and 'drop'; NULL when "
        "claims were not judged.",
    ),
    _c("finish_reason", S, "Rollout finish reason."),
    _c("response_tokens", I, "Response length in tokens."),
    _c("max_new_tokens", I, "The rollout's length limit (L_max of the overlong penalty)."),
)

REWARD_INPUTS = Table(
    "reward_inputs",
    "One row per rollout: format checks, citation scores and verifier results, before any weight.",
    ("run", "step", "prompt_id", "sample_idx"),
    _ROLLOUT_KEY + _REWARD_INPUT_COLUMNS,
)


def _arrow_type(python_type) -> pa.DataType:
    return {float: F, int: I, bool: B}.get(python_type, S)  # str and Literal[...] settings are strings


# Derived from RewardConfig (its fields that name a column), plus the judge's failure treatment.
_REWARD_WEIGHT_COLUMNS = tuple(
    _c(column, _arrow_type(type_), doc) for _, column, type_, doc in reward_weight_fields()
) + (
    _c(
        "on_failure",
        S,
        "Treatment of failed judgments: 'zero', 'skip', 'drop' (rollout left out of the update) or 'fail'.",
    ),
)

REWARD_WEIGHTS = Table(
    "reward_weights",
    "The weights of each reward version, one row per (step, version): 'train' is what the update used; "
    "`refiner rescore` adds versions.",
    ("run", "step", "reward_version"),
    (_c("run", S, "Run name."), _c("step", I, "GRPO step."), _c("reward_version", S, "Reward version."))
    + _REWARD_WEIGHT_COLUMNS,
)

REWARDS = Table(
    "rewards",
    "One row per (rollout, reward version): every component, the weights used, and the total, computed by SQL "
    "(refiner_core/reward/compose.py REWARD_SQL) from reward_inputs, judge_scores and reward_weights.",
    ("run", "step", "prompt_id", "sample_idx", "reward_version"),
    _ROLLOUT_KEY
    + (_c("reward_version", S, "'train' (used by the update) or a `refiner rescore` version."),)
    + _REWARD_INPUT_COLUMNS
    + _REWARD_WEIGHT_COLUMNS
    + (
        _c(
            "rubric_score",
            F,
            "Weighted mean of oriented rubric scores (failed ones: 0 under 'zero', left out under 'skip' and 'drop').",
        ),
        _c("rubrics_scored", I, "Rubrics with a usable score."),
        _c("rubrics_failed", I, "Rubrics whose judgment failed."),
        _c("citation_score", F, "The citation score that enters the reward (per citation_score_kind)."),
        _c(
            "judged_score",
            F,
            "rubric_weight * rubric_score + citation_weight * citation_score for judged "
            "prompts, verifier_score for verified ones, 0 when gated.",
        ),
        _c(
            "gated",
            B,
            "True when the judged part of a judged prompt was zeroed because format_ok is false (gating on).",
        ),
        _c("non_stop_penalized", B, "True when the reward was replaced by the non-stop penalty."),
        _c("overlong_penalty", F, "max(-f, min(0, -(L - (L_max - B)) / B * f)), 0 when the buffer is off."),
        _c("distractor_term", F, "-distractor_penalty when cites_distractor, else 0."),
        _c("recall_term", F, "supporting_recall_weight * supporting_recall (0 when it is NULL)."),
        _c(
            "dropped",
            B,
            "Left out of the update: a rubric's judgment, or a judged claim's that enters the citation score, "
            "failed under on_failure 'drop'; or under 'skip', every rubric's judgment, or every claim's, failed "
            "(nothing left to average).",
        ),
        _c(
            "reward",
            F,
            "verification_reward * judged_score + format_weight * format_score + overlong_penalty + "
            "distractor_term + recall_term, or non_stop_penalty_value when non_stop_penalized.",
        ),
    ),
)

ADVANTAGES = Table(
    "advantages",
    "One row per (rollout, reward version): the reward, its group-relative advantage, and whether the update "
    "trains on it.",
    ("run", "step", "reward_version", "prompt_id", "sample_idx"),
    (
        _c("run", S, "Run name."),
        _c("step", I, "GRPO step."),
        _c("reward_version", S, "'train' (what the update used) or a `refiner rescore` version."),
        _c("prompt_id", S, "Prompt ID."),
        _c("sample_idx", I, "Sample index."),
        _c("reward", F, "The rollout's reward in this version."),
        _c("advantage", F, "Group-relative advantage (grpo.advantage); 0 for dropped rollouts."),
        _c(
            "reward_kl",
            F,
            "The response's KL to the reference, summed over its trained tokens (grpo.kl_reward_estimator): the "
            "advantage read reward - kl_coef x reward_kl. NULL unless grpo.kl_reward_coef > 0.",
        ),
        _c("kl_coef", F, "The KL-in-reward coefficient the step applied (NULL unless grpo.kl_reward_coef > 0)."),
        _c(
            "trained",
            B,
            "False when left out of the update: dropped, an all-equal group under "
            "grpo.filter_zero_std_groups, an empty response, or one cut off by the token budget under "
            "grpo.mask_truncated.",
        ),
    ),
)

RESCORES = Table(
    "rescores",
    "One row per (step, version) that `refiner rescore` wrote: its settings, and a hash of the rows it was computed "
    "from; step_rewards.stale compares that hash with the step's current rows.",
    ("run", "step", "reward_version"),
    (
        _c("run", S, "Run name."),
        _c("step", I, "GRPO step."),
        _c("reward_version", S, "The `refiner rescore` version."),
        _c("settings", S, "The settings that differ from the run's recipe, as `--set` flags."),
        _c(
            "inputs_hash",
            S,
            "Hash of the step's reward_inputs and judge_scores rows the version was computed from "
            "(refiner_core.reward.compose.STEP_INPUTS_HASH_SQL).",
        ),
    ),
)

CITATION_CLAIMS = Table(
    "citation_claims",
    "One row per claim of a judged answer (reward.citation_score 'f1' or 'dr_tulu'): the claim, its cited IDs, "
    "and the judge's support rating.",
    ("run", "step", "prompt_id", "sample_idx", "claim_idx"),
    (
        _c("run", S, "Run name."),
        _c("step", I, "GRPO step."),
        _c("prompt_id", S, "Prompt ID."),
        _c("sample_idx", I, "Sample index."),
        _c("claim_idx", I, "Position of the claim in the answer."),
        _c("claim", S, "The claim's text."),
        _c("cited_ids", pa.list_(S), "Snippet IDs the claim cites."),
        _c("valid_ids", pa.list_(S), "Cited IDs present in the prompt's tool output."),
        _c(
            "support",
            F,
            "Judged support by the cited snippets: 1 full, 0.5 partial, 0 none (0 when it cites only "
            "invented IDs; NULL for uncited claims or a failed judgment).",
        ),
        _c("raw_output", S, "Verbatim judge output (NULL when no call was needed)."),
        _c("failure", S, "NULL when parsed; otherwise why."),
        _c("attempts", I, "Requests made for the judgment (as judge_scores.attempts; NULL without a call)."),
        _c("cache_hit", B, "The answer came from the judge cache (no request)."),
        _c("prompt_hash", S, "Hash of the exact judge prompt."),
        _c("prompt_tokens", I, "Prompt tokens the judgment cost (as judge_scores.prompt_tokens; NULL without a call)."),
        _c("completion_tokens", I, "Completion tokens the judgment cost (NULL without a call)."),
    ),
    provenance=("attempts", "cache_hit", "prompt_tokens", "completion_tokens"),
)

STEPS = Table(
    "steps",
    "One row per GRPO step: optimisation and reward metrics.",
    ("run", "step"),
    (
        _c("run", S, "Run name."),
        _c("step", I, "GRPO step."),
        _c("loss", F, "Policy loss (aggregated as configured)."),
        _c("pg_loss", F, "Clipped surrogate part of the loss."),
        _c("kl", F, "Mean per-token KL estimate against the reference."),
        _c("clip_fraction", F, "Fraction of response tokens whose ratio was clipped."),
        _c("reward_mean", F, "Mean reward over the step's rollouts."),
        _c("reward_std", F, "Std (ddof 0) of rewards over the step's rollouts."),
        _c("advantage_abs_mean", F, "Mean |advantage| over the rollouts not dropped (judge.on_failure drop)."),
        _c(
            "zero_std_group_fraction",
            F,
            "Fraction of groups whose rewards were all equal (no signal), over every sampling round of the step.",
        ),
        _c("sampling_rounds", I, "Rounds of rollout + judge the step sampled (1 without rollout.dynamic_sampling)."),
        _c(
            "informative_groups",
            I,
            "Groups whose rewards differ, over all rounds (below rollout.prompts_per_step: "
            "dynamic sampling hit its cap or ran out of fresh prompts).",
        ),
        _c(
            "dropped_groups",
            I,
            "All-equal groups left out of the update (grpo.filter_zero_std_groups or "
            "rollout.dynamic_sampling; 0 otherwise).",
        ),
        _c(
            "masked_truncated",
            I,
            "Responses cut off by the token budget and left out of the update (grpo.mask_truncated; 0 otherwise).",
        ),
        _c(
            "entropy",
            F,
            "Mean token entropy of the policy over trained tokens (NULL unless grpo.entropy_coef != 0 or "
            "grpo.top_entropy_quantile < 1).",
        ),
        _c(
            "importance_weight_mean",
            F,
            "Mean importance weight pi_old / pi_rollout over trained tokens, after "
            "truncation or masking (NULL unless grpo.tis_cap > 0).",
        ),
        _c(
            "entropy_coef",
            F,
            "The entropy bonus's coefficient this step's update applied: grpo.entropy_coef, or with "
            "grpo.adaptive_entropy the controller's (0 while the last measured entropy was above the target).",
        ),
        _c(
            "off_policy_masked",
            F,
            "Share of the trained tokens whose policy term was masked: sequences with a negative advantage that "
            "the policy had moved away from (grpo.off_policy_mask_threshold; NULL when it is 0).",
        ),
        _c(
            "kl_reward_coef",
            F,
            "The coefficient of the KL in the reward this step applied: grpo.kl_reward_coef, or with "
            "grpo.kl_reward_target the adaptive controller's (NULL when grpo.kl_reward_coef is 0).",
        ),
        _c(
            "reward_kl",
            F,
            "Mean over the step's responses of their per-token mean KL to the reference, the controller's measure "
            "(verl actor/reward_kl_penalty; NULL when grpo.kl_reward_coef is 0).",
        ),
        _c(
            "policy_lag",
            I,
            "Updates between the policy that sampled the step's rollouts and the one trained: "
            "min(step, grpo.async_steps); 0 when synchronous.",
        ),
        _c(
            "grad_norm",
            F,
            "Mean gradient norm before clipping over the update's optimizer steps taken (NULL when none was: every "
            "one skipped, or no rollout left to train on).",
        ),
        _c(
            "skipped_optimizer_steps",
            I,
            "Optimizer steps of the update skipped because the gradient norm was NaN or inf: the weights and the "
            "optimizer state were left as they were (0 = none; NULL in runs written before the column existed).",
        ),
        _c("lr", F, "Learning rate used."),
        _c("response_tokens", I, "Response tokens trained on."),
        _c("packing_efficiency", F, "Real tokens / tokens computed in the update (1.0 = no padding)."),
        _c("response_length_mean", F, "Mean response length in tokens."),
        _c("rollout_seconds", F, "Wall time of the rollout stage (summed over sampling rounds)."),
        _c(
            "weight_sync_seconds",
            F,
            "Part of rollout_seconds the kept rollout engine spent loading the policy's new "
            "weights in place (run.keep_engines); 0 when it was built or already current.",
        ),
        _c("judge_seconds", F, "Wall time of the judge stage (summed over sampling rounds)."),
        _c("update_seconds", F, "Wall time of the update stage."),
        _c(
            "checkpoint",
            S,
            "Path of the checkpoint written by this step (removed later unless run.keep_last / keep_every keep it).",
        ),
        _c("checkpoint_bytes", I, "Bytes written for this step's checkpoint (weights, tokenizer, optimizer state)."),
        _c("judge_requests", I, "Requests the step's rubric judgments made (judge_scores.attempts summed)."),
        _c("judge_prompt_tokens", I, "Prompt tokens of the step's judgments (judge_scores and citation_claims)."),
        _c("judge_completion_tokens", I, "Completion tokens of the step's judgments."),
        _c(
            "judge_cost_usd",
            F,
            "The step's judge tokens at judge.price_per_mtok_in / price_per_mtok_out of the run's recipe, priced "
            "when the catalog is built (so a price set later applies to every step); NULL in the step's own file.",
        ),
    ),
    provenance=(
        "rollout_seconds",
        "weight_sync_seconds",
        "judge_seconds",
        "update_seconds",
        "judge_requests",
        "judge_prompt_tokens",
        "judge_completion_tokens",
        "judge_cost_usd",
    ),
)

QUARANTINE = Table(
    "quarantine",
    "Rejected input rows: where they came from, which stage rejected them and why.",
    ("run", "stage", "source", "row_ref"),
    (
        _c("run", S, "Run name."),
        _c("stage", S, "Stage that rejected the row ('prepare', 'rubrics', ...)."),
        _c("source", S, "Source file or dataset."),
        _c("row_ref", S, "Row number or row ID in the source."),
        _c("reason", S, "Machine-readable reason ('missing_field', 'unknown_snippet_id', ...)."),
        _c("detail", S, "Human-readable explanation."),
        _c("raw", S, "The raw row text (truncated to 4 kB)."),
    ),
)

SFT_EXAMPLES = Table(
    "sft_examples",
    "One row per SFT example after limits and dedupe: token IDs, assistant-only loss mask and its place in a pack.",
    ("run", "example_id"),
    (
        _c("run", S, "Run name."),
        _c("example_id", S, "Content hash of the rendered conversation (dedupe key)."),
        _c("split", S, "'train' or 'validation' (seeded, by content)."),
        _c("source_ref", S, "Row number in the source ('line 3', 'row 0')."),
        _c("source_id", S, "Row ID in the source."),
        _c("input_ids", pa.list_(pa.int32()), "Token IDs of the chat-template rendering (after truncation)."),
        _c("loss_mask", pa.list_(B), "Per token: true for assistant tokens (the loss applies), false otherwise."),
        _c("prompt_tokens", I, "Tokens before the first assistant token."),
        _c("response_tokens", I, "Tokens from the first assistant token to the end."),
        _c("assistant_tokens", I, "Tokens with loss_mask true."),
        _c("total_tokens", I, "len(input_ids)."),
        _c(
            "truncated",
            S,
            "Truncations applied ('prompt_truncated', 'response_truncated', 'total_truncated'), NULL if none.",
        ),
        _c("pack_id", I, "Pack (training row) index within the split."),
        _c("pack_offset", I, "Token offset of the example inside its pack."),
    ),
)

SFT_STATS = Table(
    "sft_stats",
    "SFT preparation summary, one number per row: counts, refusals, drops and truncations per reason, packing, "
    "histograms.",
    ("run", "kind", "name"),
    (
        _c("run", S, "Run name."),
        _c(
            "kind",
            S,
            "'count', 'invalid' (rows refused before rendering, by quarantine reason), 'dropped' (examples left out "
            "after it), 'truncated', 'packing' or 'histogram'.",
        ),
        _c("name", S, "Counter, reason, packing figure or histogram name ('prompt_tokens', ...)."),
        _c("split", S, "'train' / 'validation' for packing rows, NULL otherwise."),
        _c("bin_low", F, "Histogram bin lower edge (inclusive); NULL for other kinds."),
        _c("bin_high", F, "Histogram bin upper edge; NULL for other kinds."),
        _c("value", F, "The number (a count, or the packing efficiency in [0, 1])."),
    ),
)

SFT_METRICS = Table(
    "sft_metrics",
    "SFT warm-start training curve: train loss per optimizer step, validation loss before training and per epoch.",
    ("run", "split", "step"),
    (
        _c("run", S, "Run name."),
        _c("split", S, "'train' (one optimizer step) or 'validation' (full evaluation)."),
        _c("step", I, "Optimizer steps done when measured (0 = before training)."),
        _c("epoch", F, "Epochs done when measured (fractional within an epoch)."),
        _c("loss", F, "Token-mean cross-entropy over assistant tokens."),
        _c("tokens", I, "Assistant tokens the loss averages over."),
        _c("lr", F, "Learning rate of the step (NULL for validation)."),
        _c(
            "grad_norm",
            F,
            "Gradient norm before clipping (NULL for validation). NaN or inf: the step was skipped, the weights "
            "left as they were.",
        ),
    ),
)

_EVAL_COLUMNS = (
    _c("run", S, "Run name."),
    _c("step", I, "GRPO updates applied to the evaluated policy (0 = the starting policy)."),
    _c(
        "phase",
        S,
        "'base' (the model before any training), 'sft' (after the SFT warm start) or 'grpo' (after "
        "`step` GRPO updates).",
    ),
    _c("mode", S, "'greedy' (one response at temperature 0) or 'sampled' (eval.samples responses, for pass@k)."),
    _c("prompt_id", S, "Held-out prompt ID (validation split)."),
    _c("sample_idx", I, "Index among the prompt's responses of this mode."),
    _c("policy", S, "Checkpoint path of the evaluated policy."),
    _c("policy_hash", S, "Content hash of the evaluated policy's weights."),
    _c("temperature", F, "Sampling temperature (0 for greedy)."),
    _c("response_text", S, "Decoded response."),
    _c("response_tokens", I, "Response length in tokens."),
)

EVALS = Table(
    "evals",
    "One row per held-out evaluation response: the policy evaluated, the response, and every reward part, "
    "scored by the same code as the training rewards.",
    ("run", "step", "phase", "mode", "prompt_id", "sample_idx"),
    _EVAL_COLUMNS
    + tuple(c for c in REWARDS.columns if c.name not in {e.name for e in _EVAL_COLUMNS} and c.name != "reward_version")
    + (
        _c(
            "passed",
            B,
            "A pass for pass@k: correct = 1 for verified prompts; for judged ones format_ok, at least "
            "one citation, none invalid, and rubric_score >= eval.pass_rubric_score; NULL for an answer whose "
            "judgments failed (dropped).",
        ),
        _c(
            "pass_rubric_score",
            F,
            "The eval.pass_rubric_score `passed` was decided at (`refiner compare` names a difference).",
        ),
        _c(
            "boxed",
            B,
            "Verified prompts: the final answer (an agent's last assistant turn) holds a \\boxed{}; NULL for judged.",
        ),
        _c("turns", I, "Agent evaluations: assistant turns of the conversation; NULL for single responses."),
        _c("tool_calls", I, "Agent evaluations: tool calls written (Hermes blocks), run or not."),
        _c(
            "well_formed_calls",
            I,
            "Agent evaluations: calls that parsed into a call of an offered tool with usable arguments (status "
            "other than 'invalid_call').",
        ),
        _c(
            "tool_errors",
            I,
            "Agent evaluations: calls whose result was not 'ok' (an error exit, a sandbox limit, an invalid call "
            "or a refusal).",
        ),
        _c(
            "refused_calls",
            I,
            "Agent evaluations: calls refused by rollout.agent.max_calls_per_turn or tool_seconds_per_rollout.",
        ),
        _c("tool_rounds", I, "Agent evaluations: assistant turns whose tool calls ran (what the TCR reward counts)."),
    ),
)

TURNS = Table(
    "turns",
    "Agent rollouts, one row per assistant turn and per tool call: what was said, run and answered, where its "
    "tokens lie in the rollout's response_token_ids, and what went wrong.",
    ("run", "step", "prompt_id", "sample_idx", "turn", "role", "call_idx"),
    (
        _c("run", S, "Run name."),
        _c("step", I, "GRPO step."),
        _c("prompt_id", S, "Prompt ID."),
        _c("sample_idx", I, "Sample index."),
        _c("turn", I, "Assistant turn (0-based); a tool row shares the turn of the assistant turn that called it."),
        _c("role", S, "'assistant' (sampled text) or 'tool' (one call and its result)."),
        _c("call_idx", I, "Tool rows: the call's position in its turn; 0 for assistant rows."),
        _c("text", S, "Assistant: the turn's text. Tool: the result the model was shown."),
        _c("token_start", I, "Start of the turn's tokens in response_token_ids (a turn's tool calls share one span)."),
        _c("token_end", I, "End (exclusive); equal to token_start when the result was not appended (budget)."),
        _c("tool_name", S, "Tool rows: the tool called (as written, even when unknown)."),
        _c("arguments", S, "Tool rows: the arguments as JSON, or the raw call text when it did not parse."),
        _c(
            "status",
            S,
            "Tool rows: 'ok', 'error' (non-zero exit), 'timeout', 'cpu_limit', 'file_size_limit', "
            "'killed:SIG...', 'invalid_call' or 'refused' (never ran; see failure).",
        ),
        _c("exit_code", I, "Tool rows: the process's exit code (NULL when it never ran or was timed out)."),
        _c("stdout", S, "Tool rows: stdout excerpt."),
        _c("stderr", S, "Tool rows: stderr excerpt."),
        _c("seconds", F, "Tool rows: wall time of the call."),
        _c(
            "failure",
            S,
            "Tool rows: why the call could not run ('bad_json: ...', 'unknown_tool: ...', "
            "'missing_arguments: ...', 'missing_argument: ...', 'wrong_type: ...', 'unclosed_tool_call: "
            "...', 'bad_code: ...' (a NUL or an unpaired surrogate in the code), 'code_too_long: "
            "...'), 'refused: max_calls_per_turn: ...' or 'refused: tool_seconds_per_rollout: ...' "
            "(past rollout.agent's caps); NULL if it ran.",
        ),
        _c(
            "finish_reason",
            S,
            "Assistant rows: 'tool_call', 'stop', 'length' (turn or total token budget) or "
            "'max_turns' (called a tool on the last allowed turn: not run).",
        ),
    ),
    provenance=("seconds",),
)

TEACHER_ROLLOUTS = Table(
    "teacher_rollouts",
    "Co-rewarding-II: the EMA teacher's responses to the step's prompts (columns as in rollouts; `policy` is the "
    "teacher checkpoint). Their majority-voted \\boxed{} answer is the pseudo-label of the policy's rollouts.",
    ROLLOUTS.key,
    tuple(c for c in ROLLOUTS.columns if c.name != "round"),  # the teacher samples each step once
    provenance=ROLLOUTS.provenance,
)

TEACHER_UPDATES = Table(
    "teacher_updates",
    "Co-rewarding-II: one row per GRPO step, after its update: the EMA weight alpha scheduled for it, whether the "
    "teacher was updated (every teacher.update_interval steps), and the teacher the next step samples from.",
    ("run", "step"),
    (
        _c("run", S, "Run name."),
        _c("step", I, "GRPO step whose update was just written (the teacher then follows policy step_{step+1})."),
        _c(
            "alpha",
            F,
            "Cosine-scheduled EMA weight of the policy at this step: teacher <- alpha * policy + "
            "(1 - alpha) * teacher.",
        ),
        _c("updated", B, "Whether the teacher was updated after this step (every update_interval-th step)."),
        _c("teacher", S, "The teacher checkpoint folder after this step."),
        _c("teacher_hash", S, "Content hash of its weights."),
    ),
)

REFERENCE_SYNCS = Table(
    "reference_syncs",
    "grpo.ref_sync_every: one row per move of the KL reference toward the policy, after the update of `step`.",
    ("run", "step"),
    (
        _c("run", S, "Run name."),
        _c(
            "step",
            I,
            "GRPO step whose update was just written (policy step_{step+1}); the steps after it measure their KL "
            "against the new reference.",
        ),
        _c("alpha", F, "grpo.ref_mixup_alpha: reference <- alpha * policy + (1 - alpha) * reference."),
        _c("reference", S, "The new reference's checkpoint folder."),
        _c("reference_hash", S, "Content hash of its weights."),
        _c("previous", S, "The reference it replaced (at the first sync, the starting policy or model.reference)."),
    ),
)

MONITOR_EVENTS = Table(
    "monitor_events",
    "One row per reward-hacking monitor that tripped at a step (refiner_core/publish/monitors.py; the figures of every "
    "step are in the `monitors` view): its figure, threshold, action and what was done.",
    ("run", "step", "monitor"),
    (
        _c("run", S, "Run name."),
        _c("step", I, "GRPO step whose judge and update tripped it."),
        _c("monitor", S, "The check: 'verified_drop', 'kl_jump', ... (monitors.<check> in the recipe)."),
        _c("value", F, "The step's figure (monitor_<check> view)."),
        _c("threshold", F, "monitors.<check>: the figure trips at this value or above."),
        _c("action", S, "monitors.<check>_action: 'warn', 'pause' or 'fail'."),
        _c(
            "outcome",
            S,
            "'warned'; 'resumed' (the run paused and was resumed); 'failed' (it failed the run: a run of the folder "
            "after it goes on past this event); 'inherited' (a pause or fail at a step a fork shares with its parent, "
            "which the parent ran: not acted on again); NULL while a pause waits.",
        ),
        _c("detail", S, "The figures behind the value, in words."),
        _c("created_at", TS, "When the check ran."),
    ),
)

FORKS = Table(
    "forks",
    "A fork's origin (`refiner fork`): the run it forked from, at which step, with which settings. Steps before "
    "fork_step are the parent's, reused (hard-linked) where their cache keys matched.",
    ("run", "parent_run"),
    (
        _c("run", S, "The fork's run name."),
        _c("parent_run", S, "The run it forked from."),
        _c("parent_dir", S, "The parent's run folder."),
        _c("fork_step", I, "The first step the fork computed with its own settings; steps before it ran the parent's."),
        _c("settings", S, "The settings that differ from the parent's recipe, as --set flags."),
        _c(
            "shares_steps",
            B,
            "Whether steps before fork_step are the parent's; false when a setting the stages before step 0 read "
            "changed (then every step is the fork's own).",
        ),
        _c("note", S, "Why no step is shared, or what kept stages from being reused (a code version change)."),
        _c("created_at", S, "When the fork was made (UTC, ISO 8601)."),
    ),
)

JUDGE_CHECKS = Table(
    "judge_checks",
    "One row per (rollout, rubric) of a judge check (`refiner judge agreement`): the run's judgment beside another "
    "judge's, or a person's label, of the same pair.",
    ("run", "check_name", "step", "prompt_id", "sample_idx", "rubric_id"),
    (
        _c("run", S, "Run name."),
        _c("check_name", S, "The check: 'judge-<hash>' for another judge, 'labels-<file>' for labels (or --name)."),
        _c("step", I, "GRPO step of the rollout."),
        _c("prompt_id", S, "Prompt ID."),
        _c("sample_idx", I, "Sample index."),
        _c("rubric_id", S, "Rubric ID (joins rubrics)."),
        _c("rubric_group", S, "The static rubric's title, or 'instance positive' / 'instance negative'."),
        _c("score", F, "The run's judge: oriented score (judge_scores.oriented_score); NULL when it failed."),
        _c("other_score", F, "The other judge's oriented score, or the label's; NULL when it failed or gave none."),
        _c(
            "other_passed",
            B,
            "The other judge's or the label's verdict: oriented score >= the threshold, or a label's own `passed`.",
        ),
        _c("other_failure", S, "Why the other judge gave no score; NULL otherwise."),
    ),
)

JUDGE_AGREEMENT = Table(
    "judge_agreement",
    "Per judge check and rubric group ('all' for every pair): how the run's judge agrees with another judge or "
    "with labels, and how far its own scores spread.",
    ("run", "check_name", "rubric_group"),
    (
        _c("run", S, "Run name."),
        _c("check_name", S, "The check (judge_checks.check_name)."),
        _c("other", S, "What the run's judge was checked against: the other judge's settings, or the labels file."),
        _c("rubric_group", S, "The static rubric's title, 'instance positive', 'instance negative' or 'all'."),
        _c("pairs", I, "(rollout, rubric) pairs both sides scored."),
        _c("failed", I, "Pairs the other side gave no score for (left out)."),
        _c("threshold", F, "Oriented score at or above which a judgment passes (eval.pass_rubric_score)."),
        _c("kappa", F, "Cohen's kappa of the two pass/fail verdicts; NULL when undefined (one verdict for all)."),
        _c("spearman", F, "Spearman's rank correlation of the two scores; NULL when either side is constant."),
        _c(
            "separation_auc",
            F,
            "How well the run judge's score separates the pairs the other side passes from those it fails "
            "(ROC AUC: 0.5 = not at all, 1 = perfectly); NULL when the other side passes all or none.",
        ),
        _c("pass_rate", F, "Share of pairs the run's judge passes."),
        _c("other_pass_rate", F, "Share of pairs the other side passes."),
        _c("score_mean", F, "Mean of the run judge's scores over the pairs."),
        _c("score_std", F, "Standard deviation (ddof 0) of the run judge's scores: their spread."),
        _c("score_p10", F, "10th percentile of the run judge's scores."),
        _c("score_p90", F, "90th percentile of the run judge's scores."),
        _c("other_score_std", F, "Standard deviation of the other side's scores."),
        _c("sample_rollouts", I, "Rollouts in the check's sample."),
        _c("seed", I, "Seed of the sample."),
        _c("created_at", S, "When the check ran (UTC, ISO 8601)."),
    ),
)

JUDGE_ANCHORS = Table(
    "judge_anchors",
    "judge.anchor_every: a fixed set of step 0's rollouts, re-judged every N steps by the run's judge, beside the "
    "judgment they got at step 0 (view judge_drift).",
    ("run", "step", "prompt_id", "sample_idx", "rubric_id"),
    (
        _c("run", S, "Run name."),
        _c("step", I, "The step whose judge stage re-judged the anchors."),
        _c("anchor_step", I, "The step whose rollouts are the anchors (0)."),
        _c("prompt_id", S, "Prompt ID of the anchor rollout."),
        _c("sample_idx", I, "Sample index of the anchor rollout."),
        _c("rubric_id", S, "Rubric ID."),
        _c("score", F, "Oriented score now; NULL when the judgment failed."),
        _c("first_score", F, "Oriented score the rollout got when it was judged at anchor_step."),
        _c("failure", S, "Why the judgment failed; NULL otherwise."),
    ),
)

JUDGE_SPEND = Table(
    "judge_spend",
    "What every judging stage of the run cost: each step's rollout judging (a row per sampling round), the "
    "judge's anchors and each held-out evaluation. steps.judge_* holds only the first kind; the run's total "
    "judge bill (what judge.budget_usd counts) is this table's sum.",
    ("run", "stage", "step", "round", "phase"),
    (
        _c("run", S, "Run name."),
        _c("stage", S, "'judge' (a step's rollouts), 'judge-anchors' (judge.anchor_every) or 'eval' (held-out)."),
        _c("step", I, "The step the stage ran at (eval: the policy evaluated after that many steps)."),
        _c("round", I, "'judge': the sampling round (rollout.dynamic_sampling), 0 without one; else 0."),
        _c("phase", S, "'eval': which policy was evaluated (evals.phase); else ''."),
        _c("requests", I, "Requests the stage's judgments made (attempts summed)."),
        _c("prompt_tokens", I, "Prompt tokens of its judgments (0 on a cache hit)."),
        _c("completion_tokens", I, "Completion tokens of its judgments."),
        _c(
            "unknown",
            I,
            "Answered judgments whose tokens nobody reported (the server sent no `usage`): their tokens are missing "
            "from the two columns before; NULL when the stage did not count them.",
        ),
        _c(
            "cost_usd",
            F,
            "The tokens at judge.price_per_mtok_in / price_per_mtok_out of the run's recipe, priced when the catalog "
            "is built; NULL when not priced.",
        ),
    ),
    provenance=("requests", "prompt_tokens", "completion_tokens", "unknown", "cost_usd"),
)

PROMPT_SELECTION = Table(
    "prompt_selection",
    "data.skip_solved_from / data.weights_from: each training prompt's figures in the earlier runs' difficulty "
    "ledger (view prompt_difficulty), whether it was taken out of training, and its sampling weight.",
    ("run", "prompt_id"),
    (
        _c("run", S, "Run name."),
        _c("prompt_id", S, "Training prompt ID."),
        _c("ledger_runs", S, "The run folders whose ledger was read."),
        _c("ledger_rollouts", I, "Rollouts of the prompt there (0: never sampled)."),
        _c("ledger_pass_rate", F, "Share of them that solved it; NULL when never sampled."),
        _c("skipped", S, "'always solved' or 'never solved' (data.skip_solved_from): not trained on; NULL if kept."),
        _c("weight", F, "Sampling weight (data.weights_from): 4 p (1 - p), at least 0.05, 1 if never sampled."),
    ),
)

ALL_TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        PROMPTS,
        RUBRICS,
        ROLLOUTS,
        JUDGE_SCORES,
        REWARD_INPUTS,
        REWARD_WEIGHTS,
        REWARDS,
        ADVANTAGES,
        RESCORES,
        CITATION_CLAIMS,
        STEPS,
        QUARANTINE,
        SFT_EXAMPLES,
        SFT_STATS,
        SFT_METRICS,
        EVALS,
        TURNS,
        TEACHER_ROLLOUTS,
        TEACHER_UPDATES,
        REFERENCE_SYNCS,
        MONITOR_EVENTS,
        FORKS,
        JUDGE_CHECKS,
        JUDGE_AGREEMENT,
        JUDGE_ANCHORS,
        JUDGE_SPEND,
        PROMPT_SELECTION,
    )
}

_DUCKDB_TYPES = {
    pa.string(): "VARCHAR",
    pa.int64(): "BIGINT",
    pa.int32(): "INTEGER",
    pa.float64(): "DOUBLE",
    pa.float32(): "FLOAT",
    pa.bool_(): "BOOLEAN",
    TS: "TIMESTAMPTZ",
}


def duckdb_type(type_: pa.DataType) -> str:
    if pa.types.is_list(type_):
        return duckdb_type(type_.value_type) + "[]"
    return _DUCKDB_TYPES[type_]


def duckdb_ddl(table: Table) -> str:
    cols = ",\n  ".join(f'"{c.name}" {duckdb_type(c.type)}' for c in table.columns)
    return f'CREATE TABLE "{table.name}" (\n  {cols}\n)'


def to_arrow(table: Table, rows: list[dict]) -> pa.Table:
    """Build an Arrow table with the exact schema; missing or extra keys are errors, not silent drops."""
    expected = set(table.column_names)
    for i, row in enumerate(rows):
        if set(row) != expected:
            missing, extra = expected - set(row), set(row) - expected
            raise ValueError(f"{table.name} row {i}: missing {sorted(missing)}, unexpected {sorted(extra)}")
    return pa.Table.from_pylist(rows, schema=table.arrow_schema)
