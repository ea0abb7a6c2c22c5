"""Claim-level citation scoring (DR Tulu's citation reward, with its multi-ID and precision bugs fixed).

Claims: every `<snippet id=…>` span of the answer (all of its IDs kept), plus every uncited factual sentence
outside the spans (a claim with no IDs). The judge rates how well each cited claim is supported by the text of
its cited snippets: full 1 / partial 0.5 / none 0; a claim whose IDs are all invented, or that says nothing (no
letter or digit), is unsupported without a judge call. Nested or unclosed tags cut the answer at every tag, so each
cited ID counts with the text after its own tag (formats.snippet_spans). Then

    precision = mean support over the cited claims       (are the citations right?)
    recall    = summed support / all claims              (is what the answer says backed by a citation?)
    F1        = 2PR / (P + R), 0 when both are 0; a response without an answer block scores 0.

One judge call per cited claim rates support, which here stands for both DR Tulu's support (recall) and
relevance (precision) questions: the precision of a citation is whether its text supports its claim.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from refiner_core.data.formats import has_words, parse_answer, read_tool_output, snippet_spans, split_ids

# A sentence ends at . ! or ? before a space or the end, at a full-width 。！？ (no space follows those), or at a
# line break: "2.5 mg" and "e.g.," do not end one.
_SENTENCE_END_RE = re.compile(r"(?<=[.!?])\s+|(?<=[\u3002\uff01\uff1f])\s*|\n+")
_MIN_CLAIM_WIDTH = 12  # shorter leftovers ("and", "In short,") are connectives, not claims; a wide (CJK) char is 2


@dataclass(frozen=True)
class Claim:
    text: str
    cited_ids: tuple[str, ...]
    valid_ids: tuple[str, ...]


def extract_claims(response_text: str, snippet_ids: list[str]) -> list[Claim] | None:
    """The claims of a response, in order; None when it has no answer block."""
    parsed = parse_answer(response_text)
    if not parsed.has_answer:
        return None
    valid = set(snippet_ids)
    claims = []
    for raw, text in snippet_spans(parsed.answer_text)[0]:
        if raw is None:
            claims += _uncited(text)
            continue
        ids = split_ids(raw)
        claims.append(Claim(text.strip(), ids, tuple(i for i in ids if i in valid)))
    return claims


def _uncited(text: str) -> list[Claim]:
    return [
        Claim(s.strip(), (), ())
        for s in _SENTENCE_END_RE.split(text)
        if _width(s.strip()) >= _MIN_CLAIM_WIDTH and has_words(s)
    ]


def _width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def snippet_texts(tool_output: str) -> dict[str, str]:
    """Snippet ID -> its text in the raw tool output (a multi-ID block maps each of its IDs), as the citation
    checks read it: the IDs of the prompt's snippet_ids."""
    return read_tool_output(tool_output)[0]


def citation_scores(
    supports: list[float | None], cited: list[bool], failed: list[bool] | None = None, asked: list[bool] | None = None
) -> dict:
    """Precision, recall and F1 from per-claim supports and whether each claim is cited: a failed judgment
    (`failed`, support None) counts 0, and `citation_f1_judged` is the F1 with those claims left out (what
    judge.on_failure 'skip' and 'drop' read). `asked`: the claims the judge was asked about (default: the cited
    ones; uncited claims and those citing only invented IDs need no call). No claims at all (an empty answer)
    scores 0."""
    failed = failed or [False] * len(supports)
    precision, recall, f1 = _precision_recall_f1(supports, cited)
    judged = [(s, c) for s, c, f in zip(supports, cited, failed, strict=True) if not f]
    return {
        "claims": len(supports),
        "citation_precision": precision,
        "citation_recall": recall,
        "citation_f1": f1,
        "claims_judged": sum(cited if asked is None else asked),
        "claims_failed": sum(failed),
        "citation_f1_judged": _precision_recall_f1([s for s, _ in judged], [c for _, c in judged])[2],
    }


def _precision_recall_f1(supports: list[float | None], cited: list[bool]) -> tuple[float, float, float]:
    cited_support = [s or 0.0 for s, c in zip(supports, cited, strict=True) if c]
    precision = sum(cited_support) / len(cited_support) if cited_support else 0.0
    recall = sum(cited_support) / len(supports) if supports else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return precision, recall, f1


NO_ANSWER_SCORES = citation_scores([], [])
NOT_JUDGED_SCORES = dict.fromkeys(NO_ANSWER_SCORES)
