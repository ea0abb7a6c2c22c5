"""The math recipes end to end on the tiny model (GT-GRPO, Co-rewarding-I), and the generated data behind them."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from conftest import TINY_ON_CPU, catalog_rows
from refiner_core.config import load_recipe
from refiner_core.preflight import check_recipe
from refiner_core.reward.ground_truth import verify

REPO = Path(__file__).resolve().parents[1]
RECIPES_PAGE = (REPO / "docs" / "recipes.md").read_text()
MATH_RECIPES = ("gt-grpo-math", "co-rewarding-1", "co-rewarding-2")
# The recipes hold GPU settings; these make them run on the tiny model in seconds.
TINY = [
    *TINY_ON_CPU,
    "rollout.samples_per_prompt=4",
    "rollout.prompts_per_step=2",
    "rollout.max_new_tokens=12",
    "rollout.batch_size=16",
    "grpo.steps=2",
    "grpo.learning_rate=1e-3",
    "grpo.micro_batch_size=8",
    "eval.every=2",
    "eval.prompts=4",
    "eval.max_new_tokens=12",
    "judge.batch_size=8",
]


def _run(recipe: str, run_dir: Path, extra: list[str] = ()) -> Path:
    from flows.refiner import refiner_pipeline

    cfg = load_recipe(REPO / "recipes" / recipe, TINY + list(extra)).to_dict()
    state = refiner_pipeline(recipe=cfg, run_dir=str(run_dir), return_state=True)
    assert state.is_completed(), state.message
    return run_dir


def test_generated_math_data_is_seeded_paired_and_correct():
    from scripts.make_math_data import build_rows, chain_sum_problems

    train = [json.loads(line) for line in (REPO / "data/math/train.jsonl").read_text().splitlines()]
    twins = [json.loads(line) for line in (REPO / "data/math/twins.jsonl").read_text().splitlines()]
    again, again_twins, _ = build_rows(chain_sum_problems(len(train), 7), 7)
    assert again == train and again_twins == twins  # the committed files are what the script writes
    by_id = {r["id"]: r for r in twins}
    assert len(twins) == 2 * len(train) and all(by_id[by_id[r["id"]]["twin_id"]]["twin_id"] == r["id"] for r in twins)
    for row in twins:  # the answer is the expression's value, and both views ask for the same number
        system, question = (m["content"] for m in row["messages"])
        assert "\\boxed{}" in system and by_id[row["twin_id"]]["ground_truth"] == row["ground_truth"]
        if not row["id"].endswith("-r"):
            expr = question.replace("Compute", "").replace("What is", "").replace("Evaluate the expression", "")
            assert eval(expr.strip().rstrip("?.")) == int(row["ground_truth"])  # noqa: S307 (digits and +/- only)
    assert Counter(len(r["messages"]) for r in train) == {2: len(train)}


@pytest.fixture(scope="module")
def gt_run(prefect_server, tmp_path_factory):
    return _run("gt-grpo-math.yaml", tmp_path_factory.mktemp("gt-grpo"))


@pytest.fixture(scope="module")
def co_run(prefect_server, tmp_path_factory):
    return _run("co-rewarding-1.yaml", tmp_path_factory.mktemp("co-rewarding-1"))


def test_gt_grpo_rewards_are_verified_correctness(gt_run):
    rows = catalog_rows(
        gt_run,
        "SELECT verifier, verify_method, correct, reward, verification_reward, response_text, "
        "ground_truth FROM rewards JOIN rollouts USING (run, step, prompt_id, sample_idx) "
        "JOIN prompts USING (run, prompt_id) WHERE reward_version = 'train'",
    )
    assert len(rows) == 2 * 2 * 4  # steps x prompts x samples
    for verifier, method, correct, reward, multiplier, text, truth in rows:
        assert verifier == "ground_truth" and method in ("math_verify", "normalized_match", "no_answer")
        # reward.final_answer 'marked' (the recipe's): a response with no box and no <answer> block has no answer
        assert correct == verify(text, truth, read_unmarked=False).score and reward == pytest.approx(
            multiplier * correct
        )
    assert catalog_rows(gt_run, "SELECT count(*) FROM judge_scores") == [(0,)]
    assert catalog_rows(gt_run, "SELECT count(*) FROM rewards_recomputed WHERE abs(reward - reward_sql) > 1e-9") == [
        (0,)
    ]
    assert catalog_rows(gt_run, "SELECT count(DISTINCT step), count(*) > 0 FROM evals") == [(2, True)]


def test_co_rewarding_samples_both_views_and_records_labels(co_run):
    steps = catalog_rows(co_run, "SELECT step, list(DISTINCT prompt_id ORDER BY prompt_id) FROM rollouts GROUP BY step")
    for _, prompt_ids in steps:
        questions = {p.removesuffix("-r") for p in prompt_ids}
        assert len(questions) == 2 and sorted(prompt_ids) == sorted(q + s for q in questions for s in ("", "-r"))
    labels = catalog_rows(
        co_run,
        """
        SELECT i.step, i.prompt_id, any_value(i.label_source), any_value(i.pseudo_label), any_value(i.label_votes),
               any_value(i.label_voters), any_value(i.label_correct), count(DISTINCT coalesce(i.pseudo_label, '∅'))
        FROM reward_inputs i GROUP BY ALL""",
    )
    assert len(labels) == 2 * 4
    for step, prompt_id, source, label, votes, voters, label_correct, distinct in labels:
        assert source == "twin" and distinct == 1  # one label per view and step
        twin = prompt_id.removesuffix("-r") if prompt_id.endswith("-r") else prompt_id + "-r"
        twin_votes = catalog_rows(
            co_run,
            f"SELECT response_text FROM rollouts WHERE step = {step} AND prompt_id = '{twin}' ORDER BY sample_idx",
        )
        from refiner_core.reward.pseudo_labels import majority_vote, vote_of

        expected = majority_vote([vote_of(t) for (t,) in twin_votes])
        assert (label, votes, voters) == (expected.label, expected.votes, expected.voters)
        assert (label_correct is None) == (label is None)
    # an empty label scores 0; a non-empty one scores the match; each view is its own group
    assert catalog_rows(
        co_run,
        "SELECT count(*) FROM rewards WHERE pseudo_label IS NULL AND (reward <> 0 OR verify_method <> 'no_label')",
    ) == [(0,)]
    assert catalog_rows(co_run, "SELECT count(*) FROM rewards WHERE verifier <> 'co_rewarding' OR correct IS NULL") == [
        (0,)
    ]
    groups = catalog_rows(co_run, "SELECT step, prompt_id, round(sum(advantage), 9) FROM advantages GROUP BY ALL")
    assert len(groups) == 2 * 4 and all(abs(total) < 1e-6 for _, _, total in groups)
    assert catalog_rows(co_run, "SELECT count(*) FROM rewards_recomputed WHERE abs(reward - reward_sql) > 1e-9") == [
        (0,)
    ]
    assert catalog_rows(co_run, "SELECT count(*) > 0, count(*) FILTER (WHERE label_source <> 'twin') FROM evals") == [
        (True, 0)
    ]


def _sets(text: str) -> list[str]:
    return text.replace("--set ", "").split()


def documented_math_line(name: str) -> list[str]:
    """docs/recipes.md's scaled-down command for a math recipe: $math_cpu and the line's own --set overrides."""
    shared = re.search(r'^math_cpu="([^"]*)"$', RECIPES_PAGE, re.MULTILINE)
    line = re.search(rf"^\.venv/bin/refiner run recipes/{name}\.yaml \$math_cpu(.*)$", RECIPES_PAGE, re.MULTILINE)
    assert shared and line, f"docs/recipes.md has no math_cpu line or no scaled-down line for {name}"
    return _sets(shared.group(1)) + _sets(line.group(1))


@pytest.mark.parametrize("name", MATH_RECIPES)
def test_documented_math_recipe_lines_pass_preflight(name):
    assert check_recipe(load_recipe(REPO / "recipes" / f"{name}.yaml", documented_math_line(name))) == []


def test_the_demonstration_is_the_documented_line():
    from bench.gt_grpo_math import overrides

    assert overrides(4, 0) == documented_math_line("gt-grpo-math")


VERIFIER_OF = {
    "gt-grpo-math": "ground_truth",
    "co-rewarding-1": "co_rewarding",
    "co-rewarding-2": "co_rewarding_teacher",
}


@pytest.mark.parametrize("name, verifier", list(VERIFIER_OF.items()))
def test_math_recipes_hold_the_gpu_settings(name, verifier):
    cfg = load_recipe(REPO / "recipes" / f"{name}.yaml")
    assert cfg.reward.verifier == verifier and cfg.reward.verification_reward == 1.0 and cfg.reward.format_weight == 0
    assert (cfg.rollout.samples_per_prompt, cfg.grpo.beta, cfg.grpo.kl_estimator) == (8, 0.001, "k3")
    assert (cfg.rollout.engine, cfg.grpo.learner, cfg.grpo.deepspeed.zero_stage, cfg.grpo.advantage_std_ddof) == (
        "vllm",
        "deepspeed",
        3,
        1,
    )
    assert "knoveleng/open-rs" in (REPO / "recipes" / f"{name}.yaml").read_text() or name == "co-rewarding-2"
    problems = check_recipe(cfg)  # the 4B checkpoint is a local folder this machine does not have
    assert problems and all("Qwen3-4B-Base" in p for p in problems), problems
    if name == "co-rewarding-2":
        assert (cfg.teacher.alpha_start, cfg.teacher.alpha_end) == (0.01, 1e-5)


PSEUDO_LABEL_QUERIES = [
    "SELECT step, round(avg(label_correct), 3) AS label_accuracy, round(avg(correct), 3) AS accuracy, "
    "round(avg(reward), 3) AS reward FROM rewards WHERE reward_version = 'train' GROUP BY step ORDER BY step",
    "SELECT DISTINCT step, prompt_id, label_source, pseudo_label, label_votes, label_voters, label_tied, label_correct "
    "FROM reward_inputs ORDER BY step, prompt_id",
]


@pytest.mark.parametrize("sql", PSEUDO_LABEL_QUERIES)
def test_documented_pseudo_label_queries_run(co_run, sql):
    assert f'refiner sql RUN_DIR "{sql}"' in RECIPES_PAGE
    assert catalog_rows(co_run, sql)


def test_rephrasing_through_an_openai_compatible_server_is_cached_and_checked(tmp_path):
    """A loopback chat server rephrases: usable answers become the twins, cached per question (a second pass
    sends no request); an answer that drops a number falls back to the template and is counted."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from scripts.make_math_data import build_rows, served_rephrasing

    requests = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            question = body["messages"][0]["content"].split("Question: ")[1]
            requests.append(question)
            numbers = re.findall(r"\d+", question)
            text = (
                f"Take {numbers[0]} and combine it with {' and '.join(numbers[1:])} as asked."
                if "+" in question
                else "Some number."
            )  # differences: an unusable answer without the numbers
            reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        problems = [{"expression": "3 + 4", "answer": "7"}, {"expression": "9 - 2", "answer": "7"}]
        rephrase = lambda q: served_rephrasing(q, url, "m", tmp_path / "cache", 5.0)  # noqa: E731
        _, twins, fallbacks = build_rows(problems, 1, rephrase)
        assert len(requests) == 2 and fallbacks == 1
        assert twins[1]["messages"][-1]["content"] == "Take 3 and combine it with 4 as asked."
        assert twins[3]["messages"][-1]["content"].startswith("Start from 9")  # the template
        again = build_rows(problems, 1, rephrase)
        assert again[1] == twins and len(requests) == 2  # from the cache: no new request
    finally:
        server.shutdown()


def test_a_rephrasing_must_keep_every_number_whole():
    from scripts.make_math_data import usable_rephrasing

    assert usable_rephrasing("Take 5 and add 15 to it.", "5 + 15")
    assert usable_rephrasing("Start at 12, then add 7.", "12 + 7")
    assert not usable_rephrasing("What is 15 plus 15?", "5 + 15")  # 5 only inside 15: another question
    assert not usable_rephrasing("Add 7 to 12.5.", "12 + 7")
    assert not usable_rephrasing(None, "1 + 2") and not usable_rephrasing("", "1 + 2")
