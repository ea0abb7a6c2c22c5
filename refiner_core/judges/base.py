"""The judge interface: chat-message lists in, raw text completions out, and the parse of a score.

A judge turns chat-message lists into raw text completions. Judges register in JUDGES by "module:factory"
string: 'transformers' runs a model in-process, 'openai' calls an OpenAI-compatible server (cached, concurrent).
A judge may also offer `complete_detailed`, returning one `Completion` per conversation with its metadata
(latency, attempts, cache hit, transport failure); judges without it get defaults from `judge_completions`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Protocol

from refiner_core.config import JudgeConfig
from refiner_core.runtime.registry import Backend, Registry, backend, resolve


class Judge(Protocol):
    name: str

    def complete(self, conversations: list[list[dict]]) -> list[str]: ...


@dataclass
class Completion:
    """One judge answer and how it was obtained. `text` is None when no answer came (then `failure` says why)."""

    text: str | None
    failure: str | None = None
    latency_seconds: float | None = None
    attempts: int = 1
    cache_hit: bool = False
    judge_model: str = ""
    prompt_hash: str = ""
    prompt_tokens: int | None = None  # what the answer cost: the server's `usage`, or counted in-process;
    completion_tokens: int | None = None  # 0 on a cache hit, None when unknown (no usage sent, no answer)


JUDGES: Registry = {
    "transformers": Backend("refiner_core.judges.transformers_judge:make_transformers_judge"),
    "openai": Backend("refiner_core.judges.openai_judge:make_openai_judge", in_process=False, section="judge.openai"),
}


def judge_backend(name: str) -> Backend:
    """What judge engine `name` is: in process (a run keeps it, run.keep_engines) or a client of a server."""
    return backend(JUDGES, name)


def make_judge(model_path: str, settings: JudgeConfig, dtype: str = "float32", precision: str = "fp32") -> Judge:
    """The judge settings.engine names. `precision` is the in-process judges' compute precision (model.precision);
    a served judge ignores it."""
    judge = resolve(JUDGES, "judge engine", settings.engine)(model_path, settings, dtype, precision=precision)
    if not getattr(judge, "model_name", ""):
        try:
            judge.model_name = str(model_path)
        except AttributeError:
            pass
    return judge


def judge_completions(judge: Judge, conversations: list[list[dict]]) -> list[Completion]:
    """The judge's `complete_detailed` when it has one; otherwise `complete`, timed as a whole (each row gets
    its share of the latency), one attempt, no cache."""
    if not conversations:
        return []
    detailed = getattr(judge, "complete_detailed", None)
    if detailed is not None:
        return detailed(conversations)
    from refiner_core.judges.cache import prompt_hash

    start = time.perf_counter()
    texts = judge.complete(conversations)
    share = (time.perf_counter() - start) / len(conversations)
    model = getattr(judge, "model_name", "") or judge.name
    return [
        Completion(t, None, share, 1, False, model, prompt_hash(c)) for t, c in zip(texts, conversations, strict=True)
    ]


# a thinking judge served without a reasoning parser writes its reasoning, drafts of the score included, first
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class _JSONObject(dict):
    """A decoded JSON object that remembers every value of its 'score' key: a repeated key (`{"score": 0, "score":
    2}`) is two verdicts, where a plain dict keeps the last."""

    scores: list


def _object_with_scores(pairs: list[tuple]) -> _JSONObject:
    obj = _JSONObject(pairs)
    obj.scores = [value for key, value in pairs if key == "score"]
    return obj


_JSON_DECODER = json.JSONDecoder(object_pairs_hook=_object_with_scores)


@dataclass(frozen=True)
class JudgeParse:
    raw_score: float | None  # on the judge's 0-2 scale
    failure: str | None

    @property
    def score(self) -> float | None:
        """0/1/2 -> 0/0.5/1; fractional scores (probability-weighted judges) map linearly."""
        return None if self.raw_score is None else self.raw_score / 2.0


def parse_judge_output(text: str) -> JudgeParse:
    """The judge's verdict: the last JSON object with a 'score' key outside its `<think>` reasoning; the score must
    be a number in [0, 2]. Objects may nest and hold braces in strings. Several score objects must agree (a judge
    that restates `{"score": 0}, {"score": 1} or {"score": 2}` before answering gives no clear verdict), and a reply
    still inside an unclosed `<think>` has none."""
    # Reasoning ends at the last </think>: a judge whose chat template opens <think> in the prompt (Qwen3 thinking
    # models, DeepSeek-R1 distills) writes only the close, and its drafts before it are no verdict.
    answer = text[text.rfind(THINK_CLOSE) + len(THINK_CLOSE) :] if THINK_CLOSE in text else text
    if THINK_OPEN in answer:
        return JudgeParse(None, "unparseable: <think> reasoning never closed, no verdict after it")
    values = [value for obj in _json_objects(answer) for value in obj.scores]
    if not values:
        return JudgeParse(None, "unparseable: no JSON object with a 'score' key")
    verdicts = [_read_score(value) for value in values]
    if len(set(verdicts)) > 1:
        return JudgeParse(None, f"ambiguous: several scores disagree: {', '.join(map(repr, values))}"[:500])
    return verdicts[-1]


def _json_objects(text: str) -> list[_JSONObject]:
    """The JSON objects in `text`, in order; objects nested in one are part of it, not listed on their own, and
    so are those nested in an object that is not valid JSON."""
    objects, start = [], text.find("{")
    while start != -1:
        try:
            obj, end = _JSON_DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):  # not JSON, an integer past Python's digit limit, nested too deep
            end = _end_of_invalid_object(text, start)
        else:
            objects.append(obj)
        start = text.find("{", end)
    return objects


_OBJECT_START = re.compile(r'\{\s*"')


def _end_of_invalid_object(text: str, start: int) -> int:
    """Where the invalid JSON object opening at `start` ends. One that opens like an object (`{"`) is skipped to its
    matching brace, strings minded, or to the end of the reply when it never closes (cut off): a score object inside
    it (`{"items": {"score": 2}, "score": 0,}`) is a part of a broken verdict, not the verdict. Any other brace (prose:
    `the set {a, b}`) is skipped alone."""
    if not _OBJECT_START.match(text, start):
        return start + 1
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _read_score(value) -> JudgeParse:
    if isinstance(value, bool):
        return JudgeParse(None, f"non_numeric: score {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        return JudgeParse(None, f"non_numeric: score {value!r}"[:500])
    except OverflowError:  # an integer past float's range
        return JudgeParse(None, f"out_of_range: score {str(value)[:40]}... not in [0, 2]")
    if not 0.0 <= number <= 2.0:
        return JudgeParse(None, f"out_of_range: score {value!r} not in [0, 2]"[:500])
    return JudgeParse(number, None)
