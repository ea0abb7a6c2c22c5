from refiner_core.data.formats import check_citations, parse_answer, tool_snippet_ids

TOOL = (
    "<snippet id=a1b2c3>Title: A\nText: alpha</snippet>\n"
    "<snippet id=d4e5f6>Title: B\nText: beta</snippet>\n"
    "<snippet id=0f0f0f>Title: C\nText: gamma</snippet>"
)


def test_tool_snippet_ids_in_order_without_duplicates():
    assert tool_snippet_ids(TOOL + "<snippet id=a1b2c3>again</snippet>") == ["a1b2c3", "d4e5f6", "0f0f0f"]
    assert tool_snippet_ids("no snippets here") == []


def test_multi_id_citation_keeps_every_id():
    parsed = parse_answer(
        '<answer><snippet id=a1b2c3,d4e5f6>Both say so.</snippet> And <snippet id="0f0f0f">gamma</snippet>.</answer>'
    )
    assert parsed.has_answer and parsed.well_formed
    assert [c.ids for c in parsed.citations] == [("a1b2c3", "d4e5f6"), ("0f0f0f",)]
    assert parsed.cited_ids == ["a1b2c3", "d4e5f6", "0f0f0f"]
    check = check_citations(parsed, tool_snippet_ids(TOOL))
    assert (check.n_citations, check.n_invalid, check.score) == (3, 0, 1.0)


def test_unknown_ids_count_per_id():
    parsed = parse_answer("<answer><snippet id=a1b2c3, zzzzzz>x</snippet> <snippet id=yyyyyy>y</snippet></answer>")
    check = check_citations(parsed, tool_snippet_ids(TOOL))
    assert check.n_citations == 3 and check.n_invalid == 2
    assert check.invalid_ids == ("zzzzzz", "yyyyyy")
    assert abs(check.score - 1 / 3) < 1e-12


def test_answer_block_must_be_unique_and_closed():
    assert not parse_answer("no answer at all").has_answer
    assert not parse_answer("<answer>one</answer><answer>two</answer>").has_answer
    assert not parse_answer("<answer>unclosed").has_answer
    assert parse_answer("preamble <answer>body</answer> trailer").answer_text == "body"


def test_malformed_snippet_tags_are_not_well_formed():
    unclosed = parse_answer("<answer><snippet id=a1b2c3>claim without close</answer>")
    assert unclosed.has_answer and not unclosed.well_formed
    empty_ids = parse_answer("<answer><snippet id=>claim</snippet></answer>")
    assert not empty_ids.well_formed
    empty_claim = parse_answer("<answer><snippet id=a1b2c3> </snippet></answer>")
    assert not empty_claim.well_formed and "snippet with empty claim" in empty_claim.problems
    stray_close = parse_answer("<answer>text</snippet></answer>")
    assert not stray_close.well_formed


def test_no_citation_scores_zero():
    parsed = parse_answer("<answer>Plain text with no citations.</answer>")
    assert parsed.well_formed
    assert check_citations(parsed, ["a1b2c3"]).score == 0.0


def test_empty_id_inside_a_citation_list_is_a_format_error():
    from refiner_core.data.rows import check_row
    from refiner_core.reward.compose import format_parts

    for ids in ("P1, ,P2", "P1,,P2", "P1,", ",P1"):
        parsed = parse_answer(f"<answer><snippet id={ids}>Both say so.</snippet></answer>")
        assert not parsed.well_formed, ids
        assert parsed.problems == (f"empty id in snippet id list {ids!r}",)
    # The IDs that are there still count as citations: 2 cited, none invalid, but the format score is 0.
    assert format_parts("<answer><snippet id=P1, ,P2>Both say so.</snippet></answer>", ["P1", "P2"]) == {
        "has_answer": True,
        "format_ok": False,
        "format_score": 0.0,
        "n_citations": 2,
        "n_invalid_citations": 0,
        "citation_valid_fraction": 1.0,
        "n_distractor_citations": None,
        "cites_distractor": None,
        "supporting_recall": None,
    }
    assert parse_answer("<answer><snippet id=P1, P2>Both say so.</snippet></answer>").well_formed
    # A reference answer with an empty ID is quarantined, not trained on.
    row = {
        "id": "r1",
        "question": "q?",
        "reasoning": "r",
        "tool_output": TOOL,
        "answer": "<answer><snippet id=a1b2c3, ,d4e5f6>x</snippet></answer>",
    }
    assert check_row(row) == ("bad_answer_format", "empty id in snippet id list 'a1b2c3, ,d4e5f6'")
    assert check_row({**row, "answer": "<answer><snippet id=a1b2c3,d4e5f6>x</snippet></answer>"}) is None


def test_markup_that_only_looks_like_the_format_is_not_well_formed():
    """A policy that turned <snippet id=...> into <answer id=...> (seen on SmolLM2 after 5 GRPO steps) or any other
    tag cites nothing, so it escaped the distractor penalty while keeping the format bonus. Now a format error."""
    from refiner_core.reward.compose import format_parts

    forged = "<answer><answer id=P2>Fleming discovered penicillin in 1928.</answer>"
    parsed = parse_answer(forged)
    assert parsed.has_answer and not parsed.well_formed
    assert parsed.problems == ("stray or malformed answer tag '<answer id=P2>'",)
    parts = format_parts(forged, ["P1", "P2"], ["P1"])
    assert (parts["format_ok"], parts["format_score"], parts["n_citations"]) == (False, 0.0, 0)
    for text, tag in (
        ("<answer>Fleming <cite id=P1>found it</cite>.</answer>", "<cite id=P1>"),
        ("<answer>one<br/>two</answer>", "<br/>"),
        ("<answer>x <B>bold</B></answer>", "<B>"),
        # look-alikes the judge reads as a citation, which would cite nothing: a Cyrillic "ѕ", an invisible
        # character in the name, a namespace, full-width brackets
        ("<answer>Lyon <\u0455nippet id=D1>is large</\u0455nippet>.</answer>", "<\u0455nippet id=D1>"),
        ("<answer>Lyon <s\u200bnippet id=D1>is large</s\u200bnippet>.</answer>", "<s\u200bnippet id=D1>"),
        ("<answer>Lyon <x:snippet id=D1>is large</x:snippet>.</answer>", "<x:snippet id=D1>"),
        ("<answer>Lyon \uff1csnippet id=D1\uff1eis large\uff1c/snippet\uff1e.</answer>", "\uff1csnippet id=D1\uff1e"),
    ):
        assert parse_answer(text).problems == (f"tag {tag!r} in the answer: only <snippet id=...> tags belong there",)
    for text in ("<answer>x</answer> </answer >", "<Answer id=1> <answer>x</answer>"):
        assert not parse_answer(text).well_formed, text
    # Comparisons are text, not tags; snippet tags in every accepted spelling stay well-formed.
    for text in (
        "<answer>if a < b and c > d, then a<b and c>d; x<5</answer>",
        "<answer><snippet id=P1>c</snippet>, <snippet id=\"P1, P2\">d</snippet>, <snippet id='P2'>e</snippet></answer>",
    ):
        assert parse_answer(text).well_formed, text


def test_citations_in_another_spelling_are_format_errors_and_a_repeated_id_counts_once():
    """A citation the judge reads as one must count as one: a snippet tag in another case or with spaces would cite
    nothing (no invalid or distractor ID). An ID repeated in one list would water down an invented one."""
    for text, problem in (
        ("<answer><Snippet id=D1>Paris is the capital.</Snippet></answer>", "malformed snippet tag '<Snippet id=D1>'"),
        ("<answer><SNIPPET id=X>Paris.</SNIPPET></answer>", "malformed snippet tag '<SNIPPET id=X>'"),
        ("<answer>< snippet id=P1>Paris.</ snippet></answer>", "malformed snippet tag '< snippet id=P1>'"),
        ("<answer><snippet id=P1>Paris.</snippet ></answer>", "malformed snippet tag '</snippet >'"),
        (
            "<answer><snippet id=P1 P2>Paris.</snippet></answer>",
            "id 'P1 P2' is not one ID: IDs are separated by commas",
        ),
        (
            "<answer><snippet id=P1 x=y>Paris.</snippet></answer>",
            "id 'P1 x=y' is not one ID: IDs are separated by commas",
        ),
        ("<answer><snippet id=P1>\u200b\u2060</snippet></answer>", "snippet with empty claim"),  # invisible only
        ("<answer><snippet id=P1>...</snippet></answer>", "snippet with empty claim"),
    ):
        parsed = parse_answer(text)
        assert not parsed.well_formed and parsed.problems[0] == problem, text
    repeated = parse_answer("<answer><snippet id=P1,P1,P1,X>Paris.</snippet></answer>")
    assert repeated.well_formed and repeated.cited_ids == ["P1", "X"]  # each ID counts once
    assert check_citations(repeated, ["P1"]).score == 0.5  # not 3/4
    # the same ID in two citations is two citations, and a claim in any script is a claim
    assert parse_answer("<answer><snippet id=P1>Paris.</snippet> <snippet id=P1>Lyon.</snippet></answer>").well_formed
    assert parse_answer("<answer><snippet id=P1>東京</snippet></answer>").well_formed
