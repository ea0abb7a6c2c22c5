"""Ground-truth verification: the final answer of a response against a reference answer.

The answer is the last `\\boxed{...}` (nested braces kept), else the text inside `<answer>...</answer>`, else
(reward.final_answer 'last_expression', for a response that stopped on its own) the whole response, read for its
last expression and as one expression (`match`); a response whose last box is unclosed has no answer, not an
earlier box's. Equivalence by math-verify where it parses both sides (`0.5` =
`\\frac{1}{2}`) within its time limit (math_verify_worker), else by a normalised string match; the method used is
recorded with every verdict, so a fallback is never silent. Both sides are read as a person writes numbers: digit
groups (`1\\,000`, `1 000`) and scientific notation (`1e-05`: a JSON number's text) as the number they stand for.
"""

from __future__ import annotations

import atexit
import re
import string
from dataclasses import dataclass
from decimal import Decimal

from refiner_core.reward.math_verify_worker import MathVerifier

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
    return _final_answer(response)[0]


def _final_answer(response: str) -> tuple[str | None, bool]:
    """(the answer, whether it is the whole response: no box and no <answer> block)."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed, False
    blocks = _ANSWER_RE.findall(response)
    if blocks:
        return blocks[-1].strip(), False
    if _BOXED_RE.search(response):  # its last box is unclosed (cut off): an earlier box is not its answer
        return None, False
    stripped = response.strip()
    return stripped or None, True


def normalize(text: str) -> str:
    """Case, surrounding space and punctuation, `$`, thousands separators and trailing zeros do not matter."""
    t = _as_written(text).strip().lower().replace("\\$", "").replace("$", "").replace("\\!", "")
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


def verify(response: str, truth: str, read_unmarked: bool = True) -> Verdict:
    """A response's final answer against the truth; `read_unmarked`: a response with no box and no <answer> block
    is read whole (else it has no answer)."""
    answer, whole = _final_answer(response)
    if answer is None:
        return Verdict(0.0, None, "no_answer")
    if whole and not read_unmarked:
        return Verdict(0.0, None, "no_answer", "no \\boxed{} or <answer> block to read the answer from")
    return match(answer, truth, whole)


def verify_row(row: dict, truth: str, final_answer: str) -> Verdict:
    """A rollout's (or evaluation's) final answer against the truth under reward.final_answer: unmarked text is
    read only under 'last_expression' and only from a response that stopped on its own."""
    return verify(answer_text(row), truth, final_answer == "last_expression" and row["finish_reason"] == "stop")


def match(answer: str, truth: str, sentence: bool = False) -> Verdict:
    """An answer (a box's content, a label) against the truth. A bare answer is read as math; a `sentence` (a whole
    response: no box, no <answer>) also as it is, for math-verify to find its last expression (read as math alone,
    "ends with 14" is one product of letters, and differs from "ends with 14."), and it is right when either
    reading is."""
    written, gold = _as_written(answer), _as_math(_as_written(truth))
    decided = False  # some reading parsed and differs
    for target in ([written] if sentence else []) + [_as_math(written)]:
        verdict, detail = _MATH_VERIFY.decide(target, gold)
        if verdict:  # one reading right is enough: the other is not asked
            return Verdict(1.0, answer, "math_verify")
        decided |= verdict is not None
    if decided:
        return Verdict(0.0, answer, "math_verify")
    return Verdict(1.0 if normalize(answer) == normalize(truth) else 0.0, answer, "normalized_match", detail)


_MATH_VERIFY = MathVerifier()
atexit.register(_MATH_VERIFY.close)

_SEPARATOR = r"(?:\\,|\\ |\\;|\\!|~| |\u2009|\u202f)"
# A number written in groups of three (`1\\,000`, `12 345 678`; math-verify reads `1\\,000` as 1 x 0), not part of
# a longer list of numbers (`10 20 300`), a subscript (`a_1 100`) or a decimal
_DIGIT_GROUPS = re.compile(rf"(?<![\w.,])(?<!\d )(?<!\d,)\d{{1,3}}(?:{_SEPARATOR}\d{{3}})+(?!\d)")
# 1e-05, 2.5E+3 (a JSON number's text): math-verify reads the e as Euler's number; exponents a float can hold
_SCIENTIFIC = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d{1,3})(?!\w|\.\d)")


def _as_written(text: str) -> str:
    """Numbers as a person reads them: digit groups joined, scientific notation as the decimal it stands for."""
    text = _DIGIT_GROUPS.sub(lambda m: re.sub(_SEPARATOR, "", m.group(0)), text)
    return _SCIENTIFIC.sub(lambda m: format(Decimal(m.group(0)), "f"), text)


def _as_math(text: str) -> str:
    """math-verify reads LaTeX in $...$ or \\boxed{}; bare answers like '0.5' or '\\frac{1}{2}' need a wrapper."""
    return text if "$" in text or "\\boxed" in text else f"${text}$"
