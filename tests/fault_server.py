"""A fault-injecting OpenAI-compatible chat server on 127.0.0.1 that counts every request it receives."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CLIENT_TIMEOUT = 0.5
FAULTS = 25  # the prompt's hash mod FAULTS picks its behaviour: 6 of 25 (24 %) misbehave


class LoopbackServer:
    """A threaded HTTP server on 127.0.0.1 serving `handler`, started and stopped as a context manager."""

    def listen(self, handler, port: int = 0) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        getattr(self, "closing", threading.Event()).set()
        self.httpd.shutdown()
        self.httpd.server_close()


class FaultServer(LoopbackServer):
    """Chat-completions on loopback. Per prompt (hash of the messages), deterministically:
    0 sleeps past the client timeout once, 1 answers 500 once, 2 answers 429 once, 3 answers a junk body once,
    4 answers 503 while `permanent_faults` is on, 5 always answers prose (not score JSON); others a score, or
    `answer` when given.
    `latency` is added to every reply (a remote judge). Counts every request it receives. Every reply reports its
    `usage` (prompt tokens: the messages' JSON characters / 4; completion: the content's characters / 4 + 1), kept
    in `usage` by prompt hash. While `stopped` is set, chat completions get no answer (GET /models still does): a
    server whose model died behind its API."""

    def __init__(self, latency: float = 0.0, faults: bool = True, root: str = "", answer: str = ""):
        self.latency, self.faults, self.permanent_faults, self.answer = latency, faults, True, answer
        self.card = {"id": "fault-judge", "object": "model", **({"root": root} if root else {})}
        self.requests, self.seen, self.auth, self.usage = 0, {}, set(), {}
        self.lock = threading.Lock()
        self.stopped, self.closing = threading.Event(), threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                self._send(200, {"object": "list", "data": [outer.card]})

            def _send(self, code, obj=None, raw=None):
                body = raw if raw is not None else json.dumps(obj).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = hashlib.sha256(json.dumps(body["messages"], sort_keys=True).encode()).hexdigest()
                with outer.lock:
                    outer.requests += 1
                    n = outer.seen[key] = outer.seen.get(key, 0) + 1
                    outer.auth.add(self.headers.get("Authorization", ""))
                kind = int(key, 16) % FAULTS if outer.faults else -1
                if outer.stopped.is_set():
                    outer.closing.wait(60)  # no answer, until the server closes
                    return
                if outer.latency:
                    time.sleep(outer.latency)
                if kind == 0 and n == 1:
                    time.sleep(CLIENT_TIMEOUT * 3)
                    return self._send(200, _reply('{"score": 2}'))
                if kind == 1 and n == 1:
                    return self._send(500, {"error": "internal"})
                if kind == 2 and n == 1:
                    return self._send(429, {"error": "slow down"})
                if kind == 3 and n == 1:
                    return self._send(200, raw=b"<html>not json")
                if kind == 4 and outer.permanent_faults:
                    return self._send(503, {"error": "overloaded"})
                if kind == 5:
                    content = "The response is good, I would say."
                else:
                    content = outer.answer or json.dumps({"score": int(key, 16) % 3})
                usage = {
                    "prompt_tokens": len(json.dumps(body["messages"])) // 4,
                    "completion_tokens": len(content) // 4 + 1,
                }
                with outer.lock:
                    outer.usage[key] = usage
                return self._send(200, {**_reply(content), "usage": usage})

        ThreadingHTTPServer.request_queue_size = 128  # accept every concurrent connection at once
        self.listen(Handler)


def _reply(content: str) -> dict:
    return {
        "id": "x",
        "object": "chat.completion",
        "model": "fault-judge",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
    }
