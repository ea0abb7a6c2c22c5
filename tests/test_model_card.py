"""Model cards: every checkpoint a run writes holds a README.md in the Hugging Face format that names the run's
actual settings, its held-out evaluation once evaluated, and how to reproduce it; the card is not part of the
checkpoint's content hash, so rewriting it keeps cached reruns cached."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard

from conftest import catalog_rows
from refiner_core.config import load_recipe
from refiner_core.publish.model_card import model_card
from refiner_core.store.storage import dir_hash

REPO = Path(__file__).resolve().parents[1]
EVAL_OVERRIDES = [
    "data.validation_fraction=0.25",
    "grpo.steps=2",
    "eval.every=2",
    "eval.prompts=3",
    "eval.samples=2",
    "eval.max_new_tokens=16",
    "grpo.learning_rate=0.0007",
    "run.report_to=[tensorboard, mlflow]",
]


def _card(overrides: list[str], **kw) -> str:
    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", overrides).to_dict()
    return model_card(
        recipe,
        **{
            "kind": "grpo",
            "run": "r",
            "step": 2,
            "checkpoint": "checkpoints/step_0002",
            "parent": "checkpoints/step_0001",
            **kw,
        },
    )


def test_card_names_the_recipe_settings_and_parses_as_hf_metadata():
    card = _card([])
    data = ModelCard(card).data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.base_model == "tiny-qwen3" and data.datasets == ["data/refiner/samples.jsonl"]
    assert {"grpo", "refiner-grpo"} <= set(data.tags)
    assert "| KL | kl_estimator k3, beta 0.001" in card
    assert "| learning rate | 0.001 (AdamW, constant, weight decay" in card
    assert "| batch shape | 4 prompts x 4 samples per step" in card
    assert "refiner run recipe.yaml --set grpo.steps=2 --run-dir NEW_RUN_DIR" in card
    assert "The judge is the base policy model itself (tiny-qwen3)" in card
    changed = _card(
        ["grpo.beta=0.05", "grpo.learning_rate=3e-6", "grpo.learner=deepspeed", "grpo.deepspeed.zero_stage=2"]
    )
    assert "| KL | kl_estimator k3, beta 0.05" in changed and "| learning rate | 3e-06 (AdamW" in changed
    assert "| learner | deepspeed, ZeRO stage 2, 1 rank(s) |" in changed
    scheduled = _card(["grpo.lr_scheduler_type=cosine", "grpo.lr_warmup_steps=1", "grpo.min_lr_ratio=0.1"])
    assert "(AdamW, cosine to 0.1x by step 2 after 1 warmup steps, weight decay" in scheduled
    assert "| sampling | temperature 1.0, top_p 1.0, engine hf |" in card
    assert "| sampling | temperature 1.0, top_p 1.0, top_k 20, engine hf |" in _card(["rollout.top_k=20"])
    controlled = _card(["grpo.adaptive_entropy=true", "grpo.off_policy_mask_threshold=0.5"])
    assert (
        "| algorithm | GRPO, policy_loss ppo_clip, advantage group_std (std ddof 0), entropy bonus from 0.0 adapted to "
        "0.2 nats, negative samples off-policy by more than 0.5 masked |" in controlled
    )
    moving = _card(["grpo.ref_sync_every=4"])
    assert (
        "| KL | kl_estimator k3, beta 0.001, reference = starting policy, moved toward the policy every 4 steps "
        "(alpha 0.6) |" in moving
    )
    penalised = _card(["rollout.repetition_penalty=1.1", "rollout.min_p=0.05"])
    assert "| sampling | temperature 1.0, top_p 1.0, min_p 0.05, repetition_penalty 1.1, engine hf |" in penalised
    gated = _card(["reward.format_weight=1", "reward.gate_judge_score_with_format_bonus=true"])
    assert "+ 1.0 x format score; the judged part is 0 when the format is broken |" in gated
    assert "format is broken" not in card
    embedded = yaml.safe_load(changed.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert embedded["grpo"]["beta"] == 0.05  # the reproduce section's recipe is the resolved one


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_the_reproduce_command_trains_the_checkpoints_steps_at_their_learning_rates(schedule):
    """A checkpoint of step 10 of a 20-step run: the command the card gives stops at step 10 with the learning rates
    steps 0-9 had (a decay over grpo.steps would otherwise end at step 10)."""
    import re

    from refiner_core.algo.schedules import learning_rate_at
    from refiner_core.preflight import check_values
    from refiner_core.stage_settings import stage_settings, stage_view

    overrides = [
        "model.lora_sync=merged",
        f"grpo.lr_scheduler_type={schedule}",
        "grpo.lr_warmup_steps=3",
        "grpo.min_lr_ratio=0.1",
    ]
    original = load_recipe(REPO / "recipes" / "tiny.yaml", [*overrides, "grpo.steps=20"])
    card = model_card(original.to_dict(), kind="grpo", run="r", step=10, checkpoint="c", parent="p")
    command = re.search(r"```bash\n(.*)\n```", card).group(1)
    again = load_recipe(
        REPO / "recipes" / "tiny.yaml", [*overrides, "grpo.steps=20", *re.findall(r"--set (\S+)", command)]
    )
    assert again.grpo.steps == 10 and not [p for p in check_values(again) if "lr_" in p]

    def rates(cfg):
        update = stage_view("update", stage_settings(cfg).update)
        return [learning_rate_at(s, update) for s in range(10)]

    assert rates(again) == rates(original)
    assert ("lr_decay_steps" in command) == (schedule != "constant")


def test_the_judge_cost_section_says_not_priced_without_prices():
    cost = {"steps": 2, "judge_requests": 8, "judge_prompt_tokens": 1000, "judge_completion_tokens": 10}
    priced = _card(
        ["judge.price_per_mtok_in=2", "judge.price_per_mtok_out=8"], judge_cost=cost | {"judge_cost_usd": 0.00208}
    )
    assert "over 2 GRPO step(s): $0.0021 at $2 / $8 per million" in priced
    for unpriced in (cost | {"judge_cost_usd": None}, cost | {"judge_cost_usd": 0}):  # a NULL or unpriced ledger
        card = _card([], judge_cost=unpriced)
        assert "8 requests, 1000 prompt and 10 completion tokens over 2 GRPO step(s): not priced (judge." in card
        assert "$0" not in card


def test_smollm2_card_names_its_hub_base_model_and_license():
    data = ModelCard(_card(["model.policy=smollm2-135m-instruct"])).data
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and data.license == "apache-2.0"


def test_a_lora_card_names_the_base_its_adapter_applies_to_and_what_push_uploads():
    """An adapter-only checkpoint of a run that warm-starts with SFT applies to the run's checkpoints/sft: the card
    told readers to put it on model.policy (log-probs 8.2 nats from the run's policy on the tiny model)."""
    on_sft = _card(["model.lora_rank=4", "sft.enabled=true"])
    assert "The adapter applies to `checkpoints/sft`, this run's SFT checkpoint (trained from `tiny-qwen3`)" in on_sft
    assert "load the base model" not in on_sft
    on_policy = _card(["model.lora_rank=4"])
    assert "The adapter applies to `tiny-qwen3` (model.policy)" in on_policy
    for card in (on_sft, on_policy):
        assert "A GRPO checkpoint holds the rank-4 LoRA adapter in adapter/, not merged weights" in card
        assert "peft.PeftModel.from_pretrained(base, THIS_FOLDER, subfolder='adapter')" in card
        assert "`refiner push` uploads the merged weights, not the adapter" in card
        assert "AutoModelForCausalLM.from_pretrained(REPO) alone" in card
    assert "LoRA adapter" not in _card(["model.lora_rank=4", "model.lora_save_merged=true"])


def test_readme_does_not_change_a_checkpoint_hash(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    before = dir_hash(tmp_path)
    (tmp_path / "README.md").write_text("a card")
    assert dir_hash(tmp_path) == before
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert dir_hash(tmp_path) != before


@pytest.fixture(scope="module")
def evaluated_run(prefect_server, tiny_model_path, tmp_path_factory):
    from flows.refiner import refiner_pipeline

    recipe = load_recipe(REPO / "recipes" / "tiny.yaml", EVAL_OVERRIDES).to_dict()
    run_dir = tmp_path_factory.mktemp("card")
    state = refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    return recipe, run_dir


def test_every_checkpoint_of_a_run_has_a_card_with_its_settings_and_eval(evaluated_run):
    recipe, run_dir = evaluated_run
    first = ModelCard.load(run_dir / "checkpoints" / "step_0001" / "README.md")
    last = ModelCard.load(run_dir / "checkpoints" / "step_0002" / "README.md")
    assert last.data.library_name == "transformers" and "grpo" in last.data.tags
    for card in (first.text, last.text):
        assert "| learning rate | 0.0007 (AdamW" in card  # this run's override, not the recipe file's 1e-3
    assert "trained from `tiny-qwen3`" in first.text and "trained from `checkpoints/step_0001`" in last.text
    assert "## Metrics of step 1" in last.text
    loss = catalog_rows(run_dir, "SELECT loss FROM steps WHERE step = 1")[0][0]
    assert f"| loss | {loss:.6g} |" in last.text
    # evaluated at step 2 only (eval.every=2): the table is on that checkpoint's card
    assert "## Held-out evaluation" in last.text and "## Held-out evaluation" not in first.text
    prompts = catalog_rows(run_dir, "SELECT count(DISTINCT prompt_id) FROM evals WHERE step = 2")[0][0]
    assert f"| 2 | grpo | sampled | {prompts} |" in last.text
    train, validation = catalog_rows(
        run_dir, "SELECT count(*) FILTER (split = 'train'), count(*) FILTER (split = 'validation') FROM prompts"
    )[0]
    assert f"| prompts | {train} train, {validation} validation |" in last.text


def test_cached_rerun_stays_cached_and_keeps_the_cards(evaluated_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.refiner import refiner_pipeline

    recipe, run_dir = evaluated_run
    card = (run_dir / "checkpoints" / "step_0002" / "README.md").read_text()
    state = refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])), limit=200
        )
    stages = [
        (r.name, r.state.name)
        for r in runs
        if r.name.split("[")[0] in ("prepare-data", "ingest-rubrics", "rollout", "judge", "grpo-update", "eval")
    ]
    # a recomputed stage (a checkpoint whose hash changed with its card) would be a second, Completed task run
    assert stages and {state for _, state in stages} == {"Cached"}, stages
    assert len(stages) == len({name for name, _ in stages}), stages
    assert (run_dir / "checkpoints" / "step_0002" / "README.md").read_text() == card


def test_tensorboard_and_mlflow_hold_the_steps_table(evaluated_run):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = evaluated_run
    steps = catalog_rows(run_dir, "SELECT step, reward_mean, kl FROM steps ORDER BY step")
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("steps/reward_mean")] == [
        (s, pytest.approx(r, rel=1e-6, abs=1e-7)) for s, r, _ in steps
    ]
    ledger = yaml.safe_load((run_dir / "tracking" / "mlflow.json").read_text())
    client, run_id = MlflowClient(tracking_uri=ledger["tracking_uri"]), ledger["id"]
    history = client.get_metric_history(run_id, "steps/kl")
    assert sorted((m.step, m.value) for m in history) == [(s, pytest.approx(k)) for s, _, k in steps]
    assert client.get_metric_history(run_id, "eval/grpo/sampled/reward")[0].step == 2


def test_sft_and_teacher_checkpoints_get_their_own_cards(tmp_path):
    from refiner_core.publish.model_card import write_model_card

    recipe = load_recipe(REPO / "recipes" / "co-rewarding-2.yaml", ["sft.enabled=true", "sft.epochs=3"]).to_dict()
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    teacher, sft = tmp_path / "teacher" / "step_0002", tmp_path / "checkpoints" / "sft"
    for folder in (teacher, sft):
        folder.mkdir(parents=True)
    write_model_card(
        teacher, tmp_path, kind="teacher", run="co2", step=2, parent=str(tmp_path / "teacher" / "step_0001")
    )
    write_model_card(sft, tmp_path, kind="sft", run="co2", step=None)
    card = ModelCard.load(teacher / "README.md")
    assert "ema-teacher" in card.data.tags and "trained from `teacher/step_0001`" in card.text
    assert "the new run's teacher of step 2 is this one" in card.text
    reference = model_card(
        recipe, kind="reference", run="co2", step=2, checkpoint="RUN/reference/step_0002", parent="RUN/base"
    )
    assert "the new run's KL reference of step 2 is this one" in reference and "teacher of step" not in reference
    assert f"| EMA teacher | alpha {recipe['teacher']['alpha_start']} -> " in card.text
    card = ModelCard.load(sft / "README.md")
    assert "sft" in card.data.tags and "| epochs | 3 |" in card.text and "--set grpo.steps" not in card.text
    assert write_model_card(sft, tmp_path / "elsewhere", kind="sft", run="x", step=None) is None  # no recipe.yaml


def test_a_forks_card_reproduces_it_as_a_fork():
    """Its steps before the fork step ran with the parent's recipe: `refiner run` of its own recipe would train
    them with the fork's settings and give other weights."""
    fork = {
        "run": "lr",
        "parent_run": "base",
        "parent_dir": "/runs/base",
        "at": 1,
        "settings": ["grpo.learning_rate=0.01"],
        "shares_steps": True,
        "note": "",
    }
    card = _card(["grpo.learning_rate=0.01"], run="lr", fork=fork)
    reproduce = card[card.index("## Reproduce") :]
    assert "refiner fork /runs/base NEW_RUN_DIR --at 1 --set grpo.learning_rate=0.01 --set grpo.steps=2" in reproduce
    assert "refiner run recipe.yaml" not in reproduce and "its steps before 1 ran with `base`'s recipe" in reproduce
    own = _card(["grpo.learning_rate=0.01"], run="lr", fork={**fork, "shares_steps": False})  # every step its own
    assert "refiner run recipe.yaml --set grpo.steps=2 --run-dir NEW_RUN_DIR" in own
