"""Ground-truth verification: the final answer of a response against a reference answer.

The answer is the last `\\boxed{...}` (nested braces kept), else the text inside `<answer>...</answer>`, else the
whole response. Equivalence by math-verify where it parses both sides (`0.5` = `\\frac{1}{2}`), else by a
normalised string match; the method used is recorded with every verdict, so a fallback is never silent.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")  # `\boxed {5}` is LaTeX for the same box


@dataclass(frozen=True)
class Verdict:
    score: float  # 1.0 correct, 0.0 wrong (or undecidable: see method / detail)
    extracted: str | None  # the response's final answer; None when it has none
    method: str  # 'math_verify' | 'normalized_match' | 'no_answer'
    detail: str | None = None  # why math-verify did not decide, when it did not
    correct: float | None = None  # set by verifiers whose score is not the correctness itself (None: = score)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} with balanced braces; None when there is none (or it is unclosed)."""
    markers = list(_BOXED_RE.finditer(text))
    if not markers:
        return None
    i = markers[-1].end()
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
        i += 1
    return None


def final_answer(response: str) -> str | None:
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    blocks = _ANSWER_RE.findall(response)
    if blocks:
        return blocks[-1].strip()
    stripped = response.strip()
    return stripped or None


def normalize(text: str) -> str:
    """Case, surrounding space and punctuation, `$`, thousands separators and trailing zeros do not matter."""
    t = text.strip().lower().replace("$", "").replace("\\!", "")
    t = re.sub(r"(?<=\d),(?=\d{3}\b)", "", t)
    t = re.sub(r"\s+", " ", t).strip(string.punctuation.replace("-", "").replace("%", "") + " ")
    if re.fullmatch(r"-?\d+\.\d*", t):
        t = t.rstrip("0").rstrip(".")
    return t


def answer_text(row: dict) -> str:
    """The text a rollout row's answer is read from: its final assistant turn (`final_text`; an agent's tool
    results, which may print a \\boxed{} of their own, are not its answer), else the whole response."""
    final = row.get("final_text")
    return final if final is not None else row["response_text"]


def verify(response: str, truth: str) -> Verdict:
    answer = final_answer(response)
    if answer is None:
        return Verdict(0.0, None, "no_answer")
    decided, detail = _math_verify(answer, truth)
    if decided is not None:
        return Verdict(1.0 if decided else 0.0, answer, "math_verify")
    return Verdict(1.0 if normalize(answer) == normalize(truth) else 0.0, answer, "normalized_match", detail)


def _math_verify(answer: str, truth: str) -> tuple[bool | None, str | None]:
    """math-verify's verdict, or (None, why) when it cannot decide: not installed, or a side does not parse."""
    try:
        from math_verify import parse
        from math_verify import verify as mv_verify
    except ImportError:
        return None, "math-verify is not installed"
    try:
        # No timeouts: math-verify implements them with SIGALRM, which only works on the main thread.
        gold = parse(_as_math(truth), parsing_timeout=None)
        target = parse(_as_math(answer), parsing_timeout=None)
        if not gold or not target:
            return None, "math-verify could not parse " + ("the reference" if not gold else "the answer")
        return bool(mv_verify(gold, target, timeout_seconds=None)), None
    except Exception as e:  # a verifier bug must not decide a reward silently: fall back, say why
        return None, f"math-verify failed: {type(e).__name__}: {e}"[:200]


def _as_math(text: str) -> str:
    """math-verify reads LaTeX in $...$ or \\boxed{}; bare answers like '0.5' or '\\frac{1}{2}' need a wrapper."""
    return text if "$" in text or "\\boxed" in text else f"${text}$"
