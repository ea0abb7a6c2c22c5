"""The 'openai' judge against a real fault-injecting OpenAI-compatible HTTP server on 127.0.0.1: timeouts, 500s,
429s, junk bodies and non-score replies are retried or recorded as failure rows, retries are counted, answers
are cached (a second pass makes no request), the request budget and on_failure='fail' hold, the key stays secret."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest

from fault_server import CLIENT_TIMEOUT, FaultServer, LoopbackServer
from refiner_core.config import JudgeConfig, OpenAIJudgeConfig, RewardConfig
from refiner_core.eval.judge_checks import rejudge
from refiner_core.judges.cache import fresh_answers
from refiner_core.judges.openai_judge import OpenAIJudge, make_openai_judge
from refiner_core.reward.score import JudgeFailed, score_rollouts
from refiner_core.runtime.http_chat import AnswerCache, RetryPolicy
from refiner_core.schema import JUDGE_SCORES
from refiner_core.store.storage import read_rows, write_table


def make_batch(n_prompts: int = 10, samples: int = 4, n_rubrics: int = 3, step: int = 0):
    prompts, rubrics, rollouts = {}, {}, []
    for p in range(n_prompts):
        pid = f"p{p}"
        prompts[pid] = {
            "prompt_id": pid,
            "question": f"What is fact {p}?",
            "snippet_ids": ["a1", "b2"],
            "ground_truth": None,
        }
        rubrics[pid] = [
            {
                "rubric_id": f"{pid}-r{k}",
                "kind": "negative" if k == 2 else "positive",
                "weight": 1.0,
                "description": f"Criterion {k} for {pid}",
            }
            for k in range(n_rubrics)
        ]
        for s in range(samples):
            rollouts.append(
                {
                    "run": "t",
                    "step": step,
                    "prompt_id": pid,
                    "sample_idx": s,
                    "finish_reason": "stop",
                    "response_tokens": 12,
                    "response_text": f"<answer><snippet id=a1>Fact {p} variant {s}.</snippet></answer>",
                }
            )
    return rollouts, prompts, rubrics


def _judge(server: FaultServer, cache_dir, **kw) -> OpenAIJudge:
    args = dict(
        base_url=server.base_url,
        model="fault-judge",
        concurrency=8,
        timeout_seconds=CLIENT_TIMEOUT,
        policy=RetryPolicy(max_retries=2, backoff_seconds=0.01, backoff_max_seconds=0.05),
        cache=AnswerCache(cache_dir),
        progress=False,
    )
    return OpenAIJudge(**{**args, **kw})


def _score(judge, batch, on_failure="zero"):
    scored = score_rollouts(*batch, judge, RewardConfig(), on_failure, 2000, 64)
    return scored.judge_scores, scored.rewards


def test_faults_become_rows_retries_are_counted_and_rescoring_makes_no_request(tmp_path):
    batch = make_batch()
    pairs = 10 * 4 * 3
    with FaultServer() as server:
        scores, rewards = _score(_judge(server, tmp_path / "cache"), batch)
        assert len(scores) == pairs and len(rewards) == 40
        first_pass = server.requests
        kinds = {}
        for s in scores:
            kinds.setdefault(s["failure"].split(":")[0] if s["failure"] else "ok", []).append(s)
        # 503 forever -> failure rows after 1 + 2 attempts; prose -> a parse failure from one request
        assert kinds["http_503"] and all(s["attempts"] == 3 and s["raw_output"] is None for s in kinds["http_503"])
        assert kinds["unparseable"] and all(s["attempts"] == 1 and s["raw_output"] for s in kinds["unparseable"])
        retried = [s for s in kinds["ok"] if s["attempts"] > 1]
        assert len(retried) >= 4  # the one-off timeout / 500 / 429 / junk-body prompts recovered on a retry
        assert all(s["attempts"] in (2, 3) for s in retried)  # 3: a busy machine slowed a retry past the timeout
        assert first_pass == sum(s["attempts"] for s in scores)
        failed = len(kinds["http_503"])
        assert 0.1 < (failed + len(kinds["unparseable"]) + len(retried)) / pairs < 0.45
        assert all(
            s["judge_model"] == "fault-judge" and len(s["prompt_hash"]) == 32 and not s["cache_hit"] for s in scores
        )
        assert all(s["latency_seconds"] is not None for s in scores if s["failure"] is None or s["raw_output"])
        timed_out = [s for s in retried if s["latency_seconds"] >= CLIENT_TIMEOUT]
        assert timed_out, "a timed-out first attempt shows in the latency of its pair"
        assert all(r["rubrics_failed"] >= 0 for r in rewards)
        write_table(JUDGE_SCORES, scores, tmp_path / "judge_scores.parquet")  # the schema holds every column
        assert read_rows(tmp_path / "judge_scores.parquet")[0].keys() >= {"latency_seconds", "attempts", "cache_hit"}

        # second pass, the server healthy again: only the pairs that got no answer are asked again (failures are
        # never cached); parse failures and answers come from the cache
        server.permanent_faults = False
        scores2, rewards2 = _score(_judge(server, tmp_path / "cache"), batch)
        assert server.requests - first_pass == failed
        assert sum(s["cache_hit"] for s in scores2) == pairs - failed
        assert all(s["attempts"] == 0 and s["latency_seconds"] == 0.0 for s in scores2 if s["cache_hit"])
        for a, b in zip(scores, scores2):
            if a["raw_output"] is not None:
                assert (a["raw_output"], a["score"], a["failure"]) == (b["raw_output"], b["score"], b["failure"])

        # third pass (a rerun, or another run sharing the cache): zero requests reach the server
        before = server.requests
        scores3, rewards3 = _score(_judge(server, tmp_path / "cache"), batch)
        assert server.requests == before
        assert all(s["cache_hit"] for s in scores3)
        assert [r["reward"] for r in rewards3] == [r["reward"] for r in rewards2]


def test_request_budget_and_on_failure_fail(tmp_path):
    batch = make_batch(n_prompts=5, samples=2, n_rubrics=2)
    with FaultServer(faults=False) as server:
        scores, _ = _score(_judge(server, tmp_path / "c1", request_budget=5, concurrency=2), batch)
        assert server.requests == 5
        over = [s for s in scores if s["failure"] and s["failure"].startswith("budget_exhausted")]
        assert len(over) == 20 - 5 and all(s["attempts"] == 0 for s in over)
        with pytest.raises(JudgeFailed, match="15 of 20 judgments failed"):
            _score(_judge(server, tmp_path / "c2", request_budget=5, concurrency=2), batch, on_failure="fail")


def test_refused_connection_is_retried_then_recorded(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    judge = OpenAIJudge(
        base_url=f"http://127.0.0.1:{port}/v1",
        model="m",
        timeout_seconds=1.0,
        policy=RetryPolicy(max_retries=2, backoff_seconds=0.01),
        cache=AnswerCache(tmp_path),
        progress=False,
    )
    scores, rewards = _score(judge, make_batch(n_prompts=1, samples=2, n_rubrics=2))
    assert all(s["failure"].startswith("refused") and s["attempts"] == 3 for s in scores)
    assert all(r["rubric_score"] == 0.0 and r["rubrics_failed"] == 2 for r in rewards)
    assert len(AnswerCache(tmp_path)) == 0  # failures are not cached


def test_a_thinking_judges_verdict_is_the_score_after_its_reasoning(tmp_path):
    """A thinking judge served without a reasoning parser restates the allowed scores while it reasons; the score
    after its reasoning is the verdict, also for negative rubrics (flipped once). The cache keeps the reply as
    written, so a rerun parses it again."""
    reply = (
        '<think>\nReply with JSON only: {"score": 0}, {"score": 1} or {"score": 2}. The response fully meets '
        'the criterion, so {"score": 2}.\n</think>\n\n{"score": 2}'
    )
    batch = make_batch(n_prompts=2, samples=1, n_rubrics=3)
    with FaultServer(faults=False, answer=reply) as server:
        scores, _ = _score(_judge(server, tmp_path / "cache"), batch)
        cached, _ = _score(_judge(server, tmp_path / "cache"), batch)
    assert len(scores) == 6 and all(s["cache_hit"] for s in cached)
    for s in scores + cached:
        assert (s["raw_output"], s["raw_score"], s["failure"]) == (reply, 2.0, None)
        assert s["oriented_score"] == (0.0 if s["kind"] == "negative" else 1.0)
    assert {json.loads(f.read_text())["content"] for f in (tmp_path / "cache").glob("*/*.json")} == {reply}


def _config(**openai) -> JudgeConfig:
    """An 'openai' judge in json mode, 8 tokens, with these judge.openai settings."""
    return JudgeConfig(engine="openai", mode="json", max_new_tokens=8, openai=OpenAIJudgeConfig(**openai))


def test_factory_reads_key_from_env_lists_model_and_never_stores_key(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-secret-123")
    with FaultServer(faults=False) as server:
        cfg = {
            "base_url": server.base_url,
            "api_key_env": "MY_JUDGE_KEY",
            "cache_path": str(tmp_path / "cache"),
            "concurrency": 2,
        }
        judge = make_openai_judge("", _config(**cfg))
        judge.progress = False
        assert judge.model == "fault-judge"  # from GET /v1/models
        assert "sk-secret" not in repr(judge)
        scores, _ = _score(judge, make_batch(n_prompts=1, samples=1, n_rubrics=2))
        assert server.auth == {"Bearer sk-secret-123"}
        assert "sk-secret" not in json.dumps(scores, default=str)
        assert not any("sk-secret" in p.read_text() for p in (tmp_path / "cache").rglob("*.json"))
    monkeypatch.delenv("MY_JUDGE_KEY")
    with pytest.raises(ValueError, match="MY_JUDGE_KEY"):
        make_openai_judge("", _config(**{**cfg, "api_model": "x"}))
    with pytest.raises(ValueError, match="json"):
        make_openai_judge("", dataclasses.replace(_config(**cfg), mode="expected_score"))


def test_pairs_spread_over_several_servers_each_pair_to_one_and_cached_once(tmp_path):
    """judge.openai.more_base_urls: every pair is asked of exactly one server, the same one on a rerun, both servers get
    work, and the cache answers a rescore for all of them."""
    batch = make_batch()
    pairs = 10 * 4 * 3
    with FaultServer(faults=False) as first, FaultServer(faults=False) as second:
        cfg = {
            "base_url": first.base_url,
            "more_base_urls": [second.base_url],
            "api_model": "fault-judge",
            "cache_path": str(tmp_path / "cache"),
            "concurrency": 4,
        }
        judge = make_openai_judge("", _config(**cfg))
        scores, _ = _score(judge, batch)
        assert len(scores) == pairs and not [s for s in scores if s["failure"]]
        assert first.requests + second.requests == pairs and first.requests > 0 and second.requests > 0
        assert not set(first.seen) & set(second.seen), "a pair went to one server only"
        rescored, _ = _score(make_openai_judge("", _config(**cfg)), batch)
        assert all(r["cache_hit"] for r in rescored) and first.requests + second.requests == pairs
        assert [r["raw_output"] for r in rescored] == [r["raw_output"] for r in scores]
        uncached = make_openai_judge("", _config(**{**cfg, "cache": False}))
        _score(uncached, batch)
        assert all(n == 2 for n in first.seen.values()) and all(n == 2 for n in second.seen.values())


def test_servers_of_other_weights_are_refused(tmp_path):
    with FaultServer(faults=False, root="/models/a") as first, FaultServer(faults=False, root="/models/b") as second:
        cfg = {"base_url": first.base_url, "more_base_urls": [second.base_url], "api_model": "fault-judge"}
        with pytest.raises(ValueError, match="judge servers report different weights for 'fault-judge'"):
            make_openai_judge("", _config(**cfg))
        with pytest.raises(ValueError, match="does not list 'other'"):
            make_openai_judge("", _config(**{**cfg, "api_model": "other"}))


def test_transformers_judge_fills_the_new_columns(tiny_model_path):
    from refiner_core.judges.base import make_judge

    cfg = {"mode": "expected_score", "max_new_tokens": 4, "batch_size": 8, "share_prefix": True, "prefill": True}
    judge = make_judge(str(tiny_model_path), JudgeConfig(engine="transformers", **cfg))
    scores = score_rollouts(
        *make_batch(n_prompts=1, samples=2, n_rubrics=2), judge, RewardConfig(), "zero", 2000, 64
    ).judge_scores
    assert all(
        s["attempts"] == 1
        and s["cache_hit"] is False
        and s["judge_model"] == str(tiny_model_path)
        and s["latency_seconds"] > 0
        and len(s["prompt_hash"]) == 32
        for s in scores
    )


def test_the_judges_bar_is_drawn_only_on_a_terminal(monkeypatch):
    """Redirected to a log, the judge's progress comes as plain lines, not carriage-returned bars."""
    import io

    from refiner_core.judges.openai_judge import _progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, drawn in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr("sys.stderr", stream)
        bar = _progress(10, enabled=True)
        assert bar.disable is not drawn
        bar.close()
    assert _progress(10, enabled=False).disable and _progress(0, enabled=True).disable


class OddServer(LoopbackServer):
    """Chat completions that trickle in (a byte every 0.1 s, each gap well inside the client's timeout), or are
    far larger than max_tokens allows, or are answered twice with usage but no choices before a real answer; or,
    before a real answer, a 503 with a 2 MB page, or a body its gzip Content-Encoding does not decode; or UTF-8
    JSON whose header names another charset."""

    def __init__(self, mode: str):
        import time
        from http.server import BaseHTTPRequestHandler

        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests += 1
                usage = {"prompt_tokens": 100, "completion_tokens": 6}
                reply = {"choices": [{"message": {"role": "assistant", "content": '{"score": 2}'}}], "usage": usage}
                if mode == "huge":
                    reply["choices"][0]["message"]["content"] = "x" * 2_000_000 + '{"score": 2}'
                if mode == "no_choices" and outer.requests <= 2:
                    reply = {"choices": [], "usage": usage}
                if mode == "latin1_label":
                    reply["choices"][0]["message"]["content"] = '{"score": 2, "reason": "Straße café"}'
                body = json.dumps(reply, ensure_ascii=False).encode()
                first = outer.requests == 1
                status = 503 if mode == "big_503" and first else 200
                if mode == "big_503" and first:
                    body = b"<html>" + b"x" * 2_000_000 + b"</html>"
                self.send_response(status)
                charset = "; charset=iso-8859-1" if mode == "latin1_label" else ""
                self.send_header("Content-Type", "application/json" + charset)
                if mode == "bad_gzip" and first:
                    self.send_header("Content-Encoding", "gzip")
                    body = b"not gzip at all"
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    if mode == "trickle":
                        for k in range(len(body)):
                            self.wfile.write(body[k : k + 1])
                            self.wfile.flush()
                            time.sleep(0.1)
                    else:
                        self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.listen(Handler)


def test_a_reply_that_trickles_past_the_timeout_or_outgrows_max_tokens_is_a_recorded_failure(tmp_path):
    """judge.openai.timeout_seconds bounds the whole request (httpx's timeout bounds each read: a reply sent a byte
    at a time never tripped it); a reply far past what max_tokens allows is no answer, and is neither scored nor
    stored (a 2 MB reply to max_tokens 16 was scored and cached whole)."""
    for mode, failure in (("trickle", "timeout: no whole answer from "), ("huge", "oversized: ")):
        with OddServer(mode) as server:
            judge = _judge(server, tmp_path / mode, timeout_seconds=1.0, max_tokens=16, policy=RetryPolicy(0))
            rows, _ = _score(judge, make_batch(1, 1, 1))
        assert [(r["score"], r["failure"].split("http")[0]) for r in rows] == [(None, failure)], mode
        assert len(AnswerCache(tmp_path / mode)) == 0


def test_a_large_error_page_is_retried_a_bad_encoding_is_retried_and_json_is_read_as_utf8(tmp_path):
    """An error reply's status decides its retry whatever its size (a 503 with a 2 MB page was 'oversized', not
    retried); a body its gzip encoding does not decode is a retried failure (it escaped the judge as DecodingError);
    JSON is UTF-8 whatever charset the header names (a UTF-8 reply labelled iso-8859-1 was read garbled)."""
    for mode in ("big_503", "bad_gzip"):
        with OddServer(mode) as server:
            rows, _ = _score(_judge(server, tmp_path / mode, concurrency=1), make_batch(1, 1, 1))
        assert [(r["score"], r["attempts"], r["failure"]) for r in rows] == [(1.0, 2, None)], mode
    with OddServer("latin1_label") as server:
        rows, _ = _score(_judge(server, tmp_path / "latin1"), make_batch(1, 1, 1))
    assert rows[0]["score"] == 1.0 and "Straße café" in rows[0]["raw_output"]


def test_usage_of_replies_that_carried_no_answer_is_counted(tmp_path):
    """Two replies with usage but no choices, retried, then the answer: the tokens of all three are what the
    judgment cost (the first two were dropped)."""
    with OddServer("no_choices") as server:
        judge = _judge(server, tmp_path, concurrency=1)
        rows, _ = _score(judge, make_batch(1, 1, 1))
    assert [(r["score"], r["attempts"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        (1.0, 3, 300, 18)
    ]


def test_anchor_rejudging_asks_the_judge_and_leaves_the_cache_as_the_run_left_it(tmp_path):
    """judge.anchor_every measures the judge as it answers now: under fresh_answers (tasks/anchors.py) the server
    is asked again and its new verdicts are seen, where the cache answered step 0's verdicts back (drift 0 by
    construction); the cache keeps the answers the run trained on, for a rescore."""
    batch = make_batch(2, 2, 2)
    with FaultServer(faults=False, answer='{"score": 2}') as server:
        first, _ = _score(_judge(server, tmp_path), batch)
        server.answer = '{"score": 0}'  # the same name now answers otherwise
        asked = server.requests
        with fresh_answers():
            again = rejudge(*batch, _judge(server, tmp_path), 2000)
        assert server.requests - asked == len(first) == len(again) == 8
        assert {a["raw_score"] for a in again} == {0.0} and not any(a["cache_hit"] for a in again)
        rescored, _ = _score(_judge(server, tmp_path), batch)
        assert server.requests - asked == 8 and [r["raw_score"] for r in rescored] == [r["raw_score"] for r in first]
