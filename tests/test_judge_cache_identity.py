"""The judge cache keys answers by who answers, not by the served name alone: two loopback OpenAI-compatible
judges serving the same name with different answers never share entries (another URL, or the same URL with
another reported root), judge.openai.cache_namespace invalidates, the same judge twice (in another process too) hits,
a server that does not list its model gets no caching, and `refiner judge serve` names a checkpoint after its
content hash."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from fault_server import LoopbackServer
from refiner_core.config import JudgeConfig, OpenAIJudgeConfig, RewardConfig
from refiner_core.judges.openai_judge import make_openai_judge
from refiner_core.reward.score import score_rollouts
from test_openai_judge import make_batch

REPO = Path(__file__).resolve().parents[1]
PAIRS = 8 * 4 * 3  # make_batch(8, 4, 3)


class ConstantJudge(LoopbackServer):
    """A judge on loopback that answers every pair with one score and lists one model at GET /v1/models the way
    vLLM does: its `root` (the folder it loaded), and `created` / `permission` ids that change on every listing.
    `lists_models=False` answers that listing with 404. Counts chat requests and listings."""

    def __init__(
        self,
        score: int,
        model: str = "step_0002",
        root: str = "/runs/a/checkpoints/step_0002",
        port: int = 0,
        lists_models: bool = True,
    ):
        self.score, self.model, self.root, self.lists_models = score, model, root, lists_models
        self.requests = self.listings = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                with outer.lock:
                    outer.listings += 1
                if not outer.lists_models:
                    return self._send(404, {"error": "not found"})
                card = {
                    "id": outer.model,
                    "object": "model",
                    "created": time.time_ns(),
                    "owned_by": "vllm",
                    "root": outer.root,
                    "parent": None,
                    "max_model_len": 4096,
                    "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "created": time.time_ns()}],
                }
                self._send(200, {"object": "list", "data": [card]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests += 1
                if body["model"] != outer.model:
                    return self._send(404, {"error": f"The model `{body['model']}` does not exist."})
                self._send(
                    200,
                    {
                        "object": "chat.completion",
                        "model": outer.model,
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": json.dumps({"score": outer.score})},
                                "finish_reason": "stop",
                            }
                        ],
                    },
                )

        self.listen(Handler, port)


def _judge(server: ConstantJudge, cache_dir: Path, **cfg):
    judge = make_openai_judge(
        "",
        JudgeConfig(
            mode="json",
            max_new_tokens=8,
            openai=OpenAIJudgeConfig(
                **{"base_url": server.base_url, "concurrency": 4, "cache_path": str(cache_dir), **cfg}
            ),
        ),
    )
    judge.progress = False
    return judge


def _scores(judge) -> list[dict]:
    return score_rollouts(*make_batch(8, 4, 3), judge, RewardConfig(), "zero", 2000, 64).judge_scores


def _mean(scores: list[dict]) -> float:
    return sum(s["raw_score"] for s in scores) / len(scores)


def test_two_judges_serving_one_name_keep_their_own_answers(tmp_path):
    """Two checkpoints both served as `step_0002` (as `refiner judge serve FOLDER` used to name them): the second
    judge is asked every pair and its own answers are recorded."""
    with ConstantJudge(score=2) as first, ConstantJudge(score=0, root="/runs/b/checkpoints/step_0002") as second:
        scores = _scores(_judge(first, tmp_path))
        assert first.requests == PAIRS and _mean(scores) == 2.0
        scores = _scores(_judge(second, tmp_path))
        assert second.requests == PAIRS, "the second judge got the first judge's cached answers"
        assert not any(s["cache_hit"] for s in scores) and _mean(scores) == 0.0
        assert all(s["judge_model"] == "step_0002" for s in scores)


def test_same_url_and_name_but_another_root_is_not_shared(tmp_path):
    """One address, one served name, different weights behind it (the server restarted on another folder)."""
    with ConstantJudge(score=2, root="/runs/a/checkpoints/step_0002") as first:
        assert _mean(_scores(_judge(first, tmp_path))) == 2.0
        port = first.httpd.server_address[1]
    with ConstantJudge(score=0, root="/runs/b/checkpoints/step_0002", port=port) as second:
        assert second.base_url == first.base_url
        scores = _scores(_judge(second, tmp_path))
        assert second.requests == PAIRS and _mean(scores) == 0.0 and not any(s["cache_hit"] for s in scores)


def test_cache_namespace_invalidates_and_the_same_judge_hits(tmp_path):
    with ConstantJudge(score=1) as server:
        judge = _judge(server, tmp_path, cache_namespace="rev-1")
        _scores(judge)
        assert server.requests == PAIRS
        again = _scores(judge)  # the same judge instance: hits, and its server identity was read once
        assert server.requests == PAIRS and all(s["cache_hit"] for s in again) and server.listings == 1
        again = _scores(_judge(server, tmp_path, cache_namespace="rev-1"))  # a new judge, the same identity
        assert server.requests == PAIRS and all(s["cache_hit"] for s in again)
        scores = _scores(_judge(server, tmp_path, cache_namespace="rev-2"))
        assert server.requests == 2 * PAIRS and not any(s["cache_hit"] for s in scores)
        assert _mean(scores) == 1.0


def test_the_key_is_the_same_in_another_process(tmp_path):
    """vLLM's listing changes on every call (`created`, permission ids): none of that may enter the key, and
    nothing process-specific either: a fresh interpreter judging the same pairs makes no request."""
    with ConstantJudge(score=2) as server:
        _scores(_judge(server, tmp_path))
        code = (
            "import json, sys; sys.path.insert(0, 'tests'); from test_judge_cache_identity import "
            "_judge_in_child; print(json.dumps(_judge_in_child(*sys.argv[1:])))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, server.base_url, str(tmp_path)],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        assert json.loads(out.splitlines()[-1]) == {"pairs": PAIRS, "cache_hits": PAIRS}
        assert server.requests == PAIRS and server.listings == 2


def _judge_in_child(base_url: str, cache_dir: str) -> dict:
    judge = make_openai_judge(
        "",
        JudgeConfig(
            mode="json",
            max_new_tokens=8,
            openai=OpenAIJudgeConfig(base_url=base_url, concurrency=4, cache_path=cache_dir),
        ),
    )
    judge.progress = False
    scores = _scores(judge)
    return {"pairs": len(scores), "cache_hits": sum(s["cache_hit"] for s in scores)}


def test_a_server_that_does_not_list_its_model_is_not_cached(tmp_path):
    with ConstantJudge(score=2, lists_models=False) as server:
        judge = _judge(server, tmp_path, api_model="step_0002")
        scores = _scores(judge)
        assert server.requests == PAIRS and _mean(scores) == 2.0
        assert "GET /models" in judge.cache_off_reason
        assert not list(tmp_path.rglob("*.json"))  # nothing written under a key that cannot name the judge
        _scores(_judge(server, tmp_path, api_model="step_0002"))
        assert server.requests == 2 * PAIRS
    with ConstantJudge(score=2) as server:
        judge = _judge(server, tmp_path, api_model="another-name")  # listed models do not include it
        _scores(judge)
        assert "another-name" in judge.cache_off_reason and not list(tmp_path.rglob("*.json"))


def _checkpoint(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_served_name_carries_the_checkpoint_content_hash(tmp_path):
    from refiner_core.judges.serve import served_model_name
    from refiner_core.store.checkpoints import TRAINING_STATE_FILES
    from refiner_core.store.storage import dir_hash

    a = _checkpoint(tmp_path / "run-a" / "step_0002", b"weights of run a")
    b = _checkpoint(tmp_path / "run-b" / "step_0002", b"weights of run b")
    same_as_a = _checkpoint(tmp_path / "copy" / "step_0002", b"weights of run a")
    name_a = served_model_name(a)
    assert name_a == f"step_0002-{dir_hash(a, TRAINING_STATE_FILES)[:12]}"
    assert served_model_name(b).startswith("step_0002-") and served_model_name(b) != name_a
    assert served_model_name(same_as_a) == name_a  # the name follows the content, not the folder
    (a / "optimizer.pt").write_bytes(b"training state")  # not part of the weights the server loads
    assert served_model_name(a) == name_a
    assert served_model_name(a, "judge") == f"judge-{name_a.rsplit('-', 1)[1]}"
    assert served_model_name(a, name_a) == name_a  # a name that already carries the hash is kept
    # a server started with other arguments (judge.openai.serve_args) may reply otherwise: another name, another
    # cache identity (it was the same name, and the replies cached without a reasoning parser were served again)
    parsed = served_model_name(a, "judge", ["--reasoning-parser", "qwen3"])
    assert parsed.startswith("judge-") and parsed != served_model_name(a, "judge")
    assert parsed != served_model_name(a, "judge", ["--reasoning-parser", "deepseek_r1"])
    assert served_model_name(a, "judge", []) == served_model_name(a, "judge")
    # how much it serves at once changes no reply: the name, and the cached replies, stay
    for throughput in (["--max-num-seqs", "8"], ["--max-num-batched-tokens=4096", "--disable-log-requests"]):
        assert served_model_name(a, "judge", throughput) == served_model_name(a, "judge")
    assert served_model_name(a, "judge", ["--max-num-seqs", "8", "--reasoning-parser", "qwen3"]) == parsed
    assert served_model_name(a, "judge", ["--disable-log-stats", "-q"]) != served_model_name(a, "judge")  # -q counts
