"""bench/main_margin.py's SFT-vs-GRPO comparison on hand-made eval rows (answers without an answer block are left out
of the distractor counts, not counted as fixed); its McNemar test is refiner_core.eval.stats's (tests/test_stats.py)."""

from __future__ import annotations

from bench.main_margin import compare, mcnemar_p


def _rows(cites: dict[str, bool | None], recall: float = 1.0) -> dict[str, dict]:
    """Eval rows: an answer citing `recall` of 2 supporting snippets (and the distractor where cites is True)."""
    return {
        p: {
            "cites_distractor": v,
            "supporting_recall": None if v is None else recall,
            "n_citations": 0 if v is None else 2 * recall + v,
            "format_ok": v is not None,
            "passed": False,
        }
        for p, v in cites.items()
    }


def test_compare_counts_fixed_and_broken_over_labelled_pairs():
    sft = _rows({"a": True, "b": True, "c": False, "d": True, "e": False, "only-sft": True})
    grpo = _rows({"a": False, "b": True, "c": True, "d": None, "e": False}, recall=0.5)  # d lost its answer block
    got = compare(sft, grpo)
    assert (got["prompts"], got["labelled"]) == (5, 4)  # d is answered by both, but not labelled after GRPO
    assert (got["fixed"], got["broken"]) == (1, 1)  # a stopped citing a distractor, c started; d is neither
    assert (got["distractor_before"], got["distractor_after"]) == (0.5, 0.5)  # of a, b, c, e
    assert (got["format_before"], got["format_after"]) == (1.0, 0.8)  # over all 5: d's answer is not format-valid
    assert (got["recall_before"], got["recall_after"]) == (1.0, 0.5)
    assert (got["citations_before"], got["citations_after"]) == (2.5, 1.5)  # 2 * recall + distractor: a b c e


def test_the_bench_uses_the_product_mcnemar_test():
    from refiner_core.eval import stats

    assert mcnemar_p is stats.mcnemar_p
    assert mcnemar_p(12, 2) == stats.mcnemar_p(12, 2)
