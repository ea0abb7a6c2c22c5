"""The judge's cost ledger: the tokens of every judgment (the server's `usage`, or counted in-process), 0 for a cache
hit; pacing to judge.openai.max_requests_per_minute / max_tokens_per_minute, checked by counting admissions on a
simulated clock; dollars and judge.budget_usd against hand-computed figures."""

from __future__ import annotations

import pytest

from fault_server import FaultServer
from refiner_core.config import JudgeConfig, RewardConfig
from refiner_core.judges.cost import JudgeBudgetExceeded, check_budget, likely_step_cost, usage_cost
from refiner_core.judges.openai_judge import OpenAIJudge
from refiner_core.reward.score import score_rollouts
from refiner_core.runtime.http_chat import AnswerCache, Pacer, RetryPolicy
from tasks.judge import judge_usage
from test_openai_judge import make_batch


class SimulatedClock:
    """A clock that only moves when someone sleeps."""

    def __init__(self):
        self.now, self.sleeps = 0.0, 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


def _most_in_a_minute(times: list[float]) -> int:
    return max(sum(1 for t in times if start <= t < start + 60.0) for start in times)


def test_requests_per_minute_are_paced():
    clock = SimulatedClock()
    pacer = Pacer(requests_per_minute=10, clock=clock, sleep=clock.sleep)
    admitted = [pacer.admit(100)[0] for _ in range(35)]
    assert _most_in_a_minute(admitted) == 10
    assert admitted[:10] == [0.0] * 10 and admitted[10] == 60.0 and admitted[30] == 180.0  # 4 minutes for 35
    assert clock.sleeps == 3 and pacer.waited == 180.0


def test_tokens_per_minute_are_paced_and_settled_with_the_real_count():
    clock = SimulatedClock()
    pacer = Pacer(tokens_per_minute=2500, clock=clock, sleep=clock.sleep)
    first = [pacer.admit(1000)[0] for _ in range(4)]  # estimated 1000 each: 2 per minute
    assert first == [0.0, 0.0, 60.0, 60.0]
    entry = pacer.admit(1000)  # at 120 s
    pacer.settle(entry, 100)  # it took 100 tokens: room for two more of 1000 at once
    assert [pacer.admit(1000)[0] for _ in range(3)] == [120.0, 120.0, 180.0]
    huge = pacer.admit(10_000)  # larger than the limit: waits for an empty window, then goes alone
    assert huge[0] == 240.0
    unlimited = Pacer(clock=clock, sleep=clock.sleep)
    assert not unlimited.limited


def _judge(server: FaultServer, cache) -> OpenAIJudge:
    return OpenAIJudge(
        base_url=server.base_url,
        model="fault-judge",
        concurrency=4,
        timeout_seconds=10.0,
        policy=RetryPolicy(0, 0.0, 0.0),
        cache=AnswerCache(cache),
        progress=False,
    )


def test_the_judge_paces_its_requests_and_records_the_servers_usage(tmp_path):
    """Against a real loopback server: 12 judgments at 5 requests per minute are admitted 5, 5 and 2 per simulated
    minute; each row holds the usage the server reported; a second pass is all cache hits and costs 0 tokens."""
    rollouts, prompts, rubrics = make_batch(n_prompts=2, samples=2, n_rubrics=3)
    clock = SimulatedClock()
    with FaultServer(faults=False) as server:
        judge = _judge(server, tmp_path / "cache")
        judge.pacer = Pacer(requests_per_minute=5, clock=clock, sleep=clock.sleep)
        scored = score_rollouts(rollouts, prompts, rubrics, judge, RewardConfig(), "zero", 2000, 64)
        assert server.requests == 12
        assert _most_in_a_minute([when for when, _ in judge.pacer.admitted]) <= 5 and clock.now == 120.0
        served = sorted(server.usage.values(), key=lambda u: (u["prompt_tokens"], u["completion_tokens"]))
        rows = scored.judge_scores
        assert (
            sorted(
                ({"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"]} for r in rows),
                key=lambda u: (u["prompt_tokens"], u["completion_tokens"]),
            )
            == served
        )
        usage = judge_usage(rows)
        assert usage == {
            "requests": 12,
            "prompt_tokens": sum(u["prompt_tokens"] for u in served),
            "completion_tokens": sum(u["completion_tokens"] for u in served),
            "unknown": 0,
        }
        assert judge.tokens_used == [usage["prompt_tokens"], usage["completion_tokens"]]
        again = score_rollouts(rollouts, prompts, rubrics, judge, RewardConfig(), "zero", 2000, 64)
        assert server.requests == 12
        assert judge_usage(again.judge_scores) == {
            "requests": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "unknown": 0,
        }


def test_a_cache_hit_on_an_answer_an_earlier_attempt_paid_for_counts_what_it_paid_once(tmp_path):
    """An attempt of a judging stage that failed after its requests were answered paid for them; the retry finds
    the answers in the cache. Counted as 0 there, that spend was in no stage's usage and judge.budget_usd never saw
    it: a hit on an answer an earlier attempt of the same stage paid for counts what was paid, once per answer
    (rollouts judged twice in it, as an evaluation's greedy and sampled answers may be, count it once); a hit on
    one the same attempt paid for, or another stage's, counts 0."""
    from refiner_core.judges.cost import paying

    rollouts, prompts, rubrics = make_batch(n_prompts=2, samples=1, n_rubrics=3)

    def usage() -> dict:
        return judge_usage(
            score_rollouts(rollouts, prompts, rubrics, judge, RewardConfig(), "zero", 2000, 64).judge_scores
        )

    nothing = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "unknown": 0}
    with FaultServer(faults=False) as server:
        judge = _judge(server, tmp_path / "cache")
        with paying("run-a judge step 0"):  # the attempt that failed after judging
            first = usage()
            assert usage() == nothing  # judged again in the same attempt: paid once, counted once
        with paying("run-a judge step 0"):  # its retry
            retried = [usage(), usage()]
        with paying("run-b judge step 0"):
            other = usage()
        assert server.requests == 6  # the retry and the other run asked nothing
    paid = {
        "requests": 6,
        "prompt_tokens": sum(u["prompt_tokens"] for u in server.usage.values()),
        "completion_tokens": sum(u["completion_tokens"] for u in server.usage.values()),
        "unknown": 0,
    }
    assert first == retried[0] == paid and retried[1] == nothing and other == nothing
    assert judge.tokens_used == [2 * paid["prompt_tokens"], 2 * paid["completion_tokens"]]


def test_a_judge_stage_retried_after_it_judged_counts_its_spend_once(
    prefect_server, tiny_recipe, tmp_path, monkeypatch
):
    """A real run against a loopback judge whose judge stage fails at its end, after every request was answered:
    the retry's answers all come from the cache, and judge_spend (what judge.budget_usd counts) holds what the
    server was asked, once."""
    from conftest import catalog_rows
    from flows.refiner import refiner_pipeline

    monkeypatch.setenv("REFINER_FAIL_ONCE", "judge@0:end")
    with FaultServer(faults=False) as server:
        judge = {
            **tiny_recipe["judge"],
            "engine": "openai",
            "mode": "json",
            "openai": {
                **tiny_recipe["judge"]["openai"],
                "base_url": server.base_url,
                "cache_path": str(tmp_path / "c"),
            },
        }
        recipe = {**tiny_recipe, "judge": judge, "grpo": {**tiny_recipe["grpo"], "steps": 1}}
        state = refiner_pipeline(recipe=recipe, run_dir=str(tmp_path / "run"), return_state=True)
        assert state.is_completed(), state.message
        asked = server.requests
        billed = sum(u["prompt_tokens"] for u in server.usage.values())
    assert (tmp_path / "run" / ".faults" / "raise-judge@0:end").exists()  # the first attempt failed after judging
    [(requests, prompt_tokens)] = catalog_rows(
        tmp_path / "run", "SELECT requests, prompt_tokens FROM judge_spend WHERE stage = 'judge'"
    )
    assert catalog_rows(tmp_path / "run", "SELECT bool_and(cache_hit) FROM judge_scores") == [(True,)]
    assert (requests, prompt_tokens) == (asked, billed) and asked > 0


def test_claim_judgments_count_among_the_steps_requests(tmp_path):
    """reward.citation_score f1: each answer's cited claim is judged too. Their requests were left out of
    judge_usage (8 of 12 counted: the claim rows had no attempts), and so of steps.judge_requests."""
    rollouts, prompts, rubrics = make_batch(n_prompts=2, samples=2, n_rubrics=2)
    for prompt in prompts.values():
        prompt["tool_output"] = "<snippet id=a1>Fact text.</snippet>\n<snippet id=b2>Other text.</snippet>"
    with FaultServer(faults=False) as server:
        judge = _judge(server, tmp_path / "cache")
        scored = score_rollouts(rollouts, prompts, rubrics, judge, RewardConfig(citation_score="f1"), "zero", 2000, 64)
        claims_judged = sum(c["raw_output"] is not None for c in scored.citation_claims)
        assert claims_judged == 4 and server.requests == 8 + 4
        usage = judge_usage(scored.judge_scores + scored.citation_claims)
        assert usage["requests"] == server.requests
        assert usage["prompt_tokens"] == sum(u["prompt_tokens"] for u in server.usage.values())


@pytest.mark.parametrize("mode", ["expected_score", "json"])
def test_the_in_process_judge_counts_its_tokens(tiny_model_path, tiny_tokenizer, mode):
    from refiner_core.data.prompts import render_prompt
    from refiner_core.judges.transformers_judge import SCORE_PREFIX, make_transformers_judge

    judge = make_transformers_judge(str(tiny_model_path), JudgeConfig(mode=mode, max_new_tokens=4, batch_size=8))
    conversations = [[{"role": "user", "content": f"Rate answer {i}: " + "word " * i}] for i in range(3)]
    done = judge.complete_detailed(conversations)
    rendered = [len(render_prompt(tiny_tokenizer, c)[1]) for c in conversations]
    prefix = len(tiny_tokenizer(SCORE_PREFIX, add_special_tokens=False)["input_ids"])
    if mode == "expected_score":  # the prompt and the score prefix are read; nothing is written
        context, _ = judge._score_tokens()
        assert [c.prompt_tokens for c in done] == [n + len(context) for n in rendered]
        assert [c.completion_tokens for c in done] == [0, 0, 0]
    else:  # prefilled with '{"score":', then at most max_new_tokens written
        assert [c.prompt_tokens for c in done] == [n + prefix for n in rendered]
        assert all(1 <= c.completion_tokens <= 4 for c in done)
    assert judge.tokens_used == [sum(c.prompt_tokens for c in done), sum(c.completion_tokens for c in done)]


def test_dollars_and_the_budget_by_hand():
    judge = JudgeConfig(price_per_mtok_in=3.0, price_per_mtok_out=15.0, budget_usd=0.05)
    usage = {"prompt_tokens": 10_000, "completion_tokens": 1_000}
    assert usage_cost(usage, judge) == pytest.approx(0.03 + 0.015)  # 0.01 M x $3 + 0.001 M x $15
    check_budget(judge, [], 0, likely_step_cost([], [], [], anchors_due=True, eval_due=True))  # nothing known yet
    small = {"prompt_tokens": 1000, "completion_tokens": 0}
    check_budget(judge, [small], 1, {"rollouts": 0.003})  # 0.003 + 0.003 <= 0.05
    with pytest.raises(JudgeBudgetExceeded, match=r"\$0\.0450 of judge.budget_usd \$0\.05 spent .* step 1 would cost"):
        check_budget(judge, [usage], 1, {"rollouts": 0.045})  # 0.045 + 0.045 > 0.05: stop before step 1
    check_budget(JudgeConfig(price_per_mtok_in=3.0), [usage] * 100, 5, {"rollouts": 1.0})  # budget 0: none
    # the held-out evaluation after a step and its anchors count where due: the run stopped only before a step
    # whose rollouts' judging would pass the budget, so the evaluation after the last step took it past
    upcoming = likely_step_cost([0.003, 0.004], [0.002], [0.02, 0.03], anchors_due=False, eval_due=True)
    assert upcoming == {"rollouts": 0.004, "held-out evaluation": 0.03}
    check_budget(judge, [usage], 2, {"rollouts": 0.004})  # 0.045 + 0.004 <= 0.05: the rollouts alone fit
    with pytest.raises(JudgeBudgetExceeded, match=r"\(rollouts \$0\.0040, held-out evaluation \$0\.0300: the dearest"):
        check_budget(judge, [usage], 2, upcoming)  # 0.045 + 0.034 > 0.05 with the evaluation after the step
    assert likely_step_cost([0.003], [0.002], [], anchors_due=True, eval_due=False) == {
        "rollouts": 0.003,
        "anchors": 0.002,
    }
