"""Judge throughput over the OpenAI API: concurrency 1 vs N in one run, and cached vs uncached re-scoring.

    .venv/bin/python bench/judge_concurrency.py [--pairs 96] [--latency 0.05] [--concurrency 1,4,8,16]
    .venv/bin/python bench/judge_concurrency.py --base-url http://127.0.0.1:8000/v1   # a real server

Without --base-url it starts a fault-free loopback chat-completions server that answers every request after a
fixed latency (default 50 ms, a remote judge's round trip). Each setting judges the same `--pairs` prompts
(distinct per setting, so nothing is cached), then re-scores the last set from the judge cache. Prints pairs/s
per concurrency, the ratio N / 1, and cached vs uncached; JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refiner_core.data.prompts import judge_messages  # noqa: E402
from refiner_core.judges.openai_judge import OpenAIJudge  # noqa: E402
from refiner_core.runtime.http_chat import (  # noqa: E402
    AnswerCache,  # noqa: E402
    RetryPolicy,
    list_models,
)


def loopback_server(latency: float) -> tuple[ThreadingHTTPServer, list[int]]:
    count = [0]
    reply = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "model": "bench-judge",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": '{"score": 2}'}, "finish_reason": "stop"}
            ],
        }
    ).encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real servers
        disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stalls

        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802  (GET /models: the judge cache keys answers by the listed model)
            body = json.dumps({"object": "list", "data": [{"id": "bench-judge", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            count[0] += 1
            time.sleep(latency)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    ThreadingHTTPServer.request_queue_size = 256
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, count


def conversations(n: int, tag: str) -> list[list[dict]]:
    return [
        judge_messages(
            f"Question {tag}-{i}: what happened?",
            f"A response {i} citing facts.",
            f"Criterion {i % 7}: the response is accurate.",
        )
        for i in range(n)
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=96)
    p.add_argument("--latency", type=float, default=0.05, help="loopback server: seconds per request")
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--base-url", default="", help="a real OpenAI-compatible server instead of the loopback one")
    p.add_argument("--model", default="", help="served model name ('' = the first the server lists)")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    httpd = None
    if args.base_url:
        base_url, count = args.base_url, None
        model = args.model or list_models(base_url)[0]
    else:
        httpd, count = loopback_server(args.latency)
        base_url, model = f"http://127.0.0.1:{httpd.server_address[1]}/v1", "bench-judge"
    cache = AnswerCache(Path(tempfile.mkdtemp(prefix="judge-bench-cache-")))
    results = {}
    for level in levels:
        judge = OpenAIJudge(
            base_url,
            model,
            concurrency=level,
            timeout_seconds=120.0,
            policy=RetryPolicy(2, 0.1),
            max_tokens=args.max_tokens,
            cache=cache,
            progress=False,
        )
        convs = conversations(args.pairs, f"c{level}")
        t0 = time.perf_counter()
        out = judge.complete_detailed(convs)
        seconds = time.perf_counter() - t0
        failed = sum(c.failure is not None for c in out)
        results[level] = args.pairs / seconds
        print(
            f"concurrency {level:3d}: {args.pairs} pairs in {seconds:6.2f} s = {results[level]:8.1f} pairs/s"
            f" ({failed} failed)"
        )
    before = count[0] if count else None
    t0 = time.perf_counter()
    out = judge.complete_detailed(convs)  # the last setting's pairs again: all from the cache
    cached_seconds = time.perf_counter() - t0
    cached = args.pairs / cached_seconds
    assert all(c.cache_hit for c in out)
    best = max(results, key=results.get)
    print(f"ratio concurrency {best} / 1: {results[best] / results[levels[0]]:.1f}x (best concurrency {best})")
    print(
        f"cached re-scoring: {cached:.0f} pairs/s ({cached / results[best]:.0f}x the best uncached); "
        f"requests during it: {(count[0] - before) if count else 'not counted'}"
    )
    print(
        json.dumps(
            {
                "pairs": args.pairs,
                "latency_s": args.latency if not args.base_url else None,
                "server": base_url if args.base_url else "loopback",
                "pairs_per_s": results,
                "best_concurrency": best,
                "cached_pairs_per_s": round(cached, 1),
            }
        )
    )
    if httpd:
        httpd.shutdown()


if __name__ == "__main__":
    main()
