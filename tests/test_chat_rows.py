"""Chat rows (open-instruct style): a ground truth and no rubrics trains out of the box; rubrics still judge."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import catalog_rows
from refiner_core.config import JudgeConfig, RewardConfig, load_recipe
from refiner_core.reward.score import score_rollouts

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def chat_run(prefect_server, tmp_path_factory):
    from flows.refiner import refiner_pipeline

    recipe = load_recipe(REPO / "recipes" / "tiny-chat.yaml").to_dict()
    run_dir = tmp_path_factory.mktemp("chat")
    state = refiner_pipeline(recipe=recipe, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    return run_dir


def test_ground_truth_rows_train_without_rubrics(chat_run):
    assert catalog_rows(chat_run, "SELECT count(*) FROM quarantine") == [(0,)]
    assert catalog_rows(chat_run, "SELECT count(*) FROM prompts WHERE ground_truth IS NOT NULL") == [(12,)]
    # Ground-truth prompts carry no rubrics (not even the static set); rubric rows keep theirs plus the static set.
    assert catalog_rows(chat_run, "SELECT count(*) FROM rubrics WHERE prompt_id LIKE 'chat-__'") == [(0,)]
    assert catalog_rows(chat_run, "SELECT count(DISTINCT prompt_id) FROM rubrics") == [(2,)]
    assert catalog_rows(chat_run, "SELECT count(*) FROM steps") == [(2,)]
    assert (chat_run / "checkpoints" / "step_0002" / "model.safetensors").exists()
    by_verifier = dict(catalog_rows(chat_run, "SELECT verifier, count(*) FROM rewards GROUP BY verifier"))
    assert sum(by_verifier.values()) == 2 * 4 * 4
    assert by_verifier.get("ground_truth", 0) > 0
    bad = catalog_rows(
        chat_run,
        """
        SELECT count(*) FROM rewards JOIN prompts USING (run, prompt_id)
        WHERE (prompts.ground_truth IS NOT NULL) != (verifier = 'ground_truth')
           OR (verifier = 'ground_truth' AND (correct IS NULL OR verify_method IS NULL
                                              OR abs(reward - verification_reward * correct) > 1e-9))
           OR (verifier = 'judge' AND correct IS NOT NULL)""",
    )
    assert bad == [(0,)]
    assert catalog_rows(chat_run, "SELECT count(*) FROM rewards_recomputed WHERE abs(reward - reward_sql) > 1e-9") == [
        (0,)
    ]
    judged = catalog_rows(chat_run, "SELECT count(*) FROM judge_scores WHERE prompt_id LIKE 'chat-__'")
    assert judged == [(0,)]  # verified prompts cost no judge call


def test_correct_answer_gets_the_verification_reward(tiny_model_path):
    """A right, a wrong and an answerless response to one ground-truth prompt, scored by the judge stage's code."""
    from refiner_core.judges.transformers_judge import make_transformers_judge

    prompt = {"prompt_id": "p", "question": "What is 6 times 7?", "snippet_ids": [], "ground_truth": "42"}
    rollouts = [
        {
            "run": "r",
            "step": 0,
            "prompt_id": "p",
            "sample_idx": i,
            "response_text": text,
            "finish_reason": "stop",
            "response_tokens": 8,
        }
        for i, text in enumerate([r"6*7 = \boxed{42}", r"\boxed{41}", ""])
    ]
    judge = make_transformers_judge(
        str(tiny_model_path), JudgeConfig(batch_size=4, max_new_tokens=4, mode="expected_score")
    )
    scored = score_rollouts(
        rollouts,
        {"p": prompt},
        {"p": []},
        judge,
        RewardConfig(verification_reward=10.0, format_weight=0.0),
        "zero",
        2000,
        64,
    )
    rewards = scored.rewards
    assert scored.judge_scores == []
    assert [r["reward"] for r in rewards] == [10.0, 0.0, 0.0]
    assert [r["extracted_answer"] for r in rewards] == ["42", "41", None]
    assert [r["verify_method"] for r in rewards][2] == "no_answer"
