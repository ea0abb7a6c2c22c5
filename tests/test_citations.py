"""Claim-level citation scoring: claims and their IDs, hand-computed precision/recall/F1, and the judge stage's
claim judgments (a rule-based judge: a claim is fully supported when its text appears in the cited sources)."""

import math

from refiner_core.config import RewardConfig
from refiner_core.reward.citations import citation_scores, extract_claims, snippet_texts
from refiner_core.reward.score import score_rollouts

TOOL = (
    "<snippet id=s1>Title: A\nText: Fleming found penicillin in 1928.</snippet>\n"
    "<snippet id=s2>Title: B\nText: The prize came in 1945.</snippet>\n"
    "<snippet id=s3>Title: C\nText: Unrelated engineering news.</snippet>"
)
IDS = ["s1", "s2", "s3"]


class SourceMatchJudge:
    """Rates a claim 2 when its text is in the cited sources, 1 when its first word is, else 0; rubrics 2."""

    name = "source-match"
    model_name = "source-match"

    def __init__(self):
        self.calls = 0

    def complete(self, conversations):
        self.calls += len(conversations)
        out = []
        for messages in conversations:
            user = messages[-1]["content"]
            if not user.startswith("Sources:"):
                out.append('{"score": 2}')
                continue
            sources, claim = user.split("\n\nClaim:\n")
            claim = claim.removesuffix("\n\nJSON:").rstrip(".")
            score = 2 if claim in sources else 1 if claim.split()[0] in sources else 0
            out.append(f'{{"score": {score}}}')
        return out


def test_claims_keep_every_id_of_a_multi_id_citation_and_uncited_sentences():
    text = (
        "<answer>Some context sentence here. <snippet id=s1, s2>Fleming found penicillin in 1928</snippet> "
        "and <snippet id=zz9>an invented fact</snippet>. A final uncited remark.</answer>"
    )
    claims = extract_claims(text, IDS)
    assert [(c.text, c.cited_ids, c.valid_ids) for c in claims] == [
        ("Some context sentence here.", (), ()),
        ("Fleming found penicillin in 1928", ("s1", "s2"), ("s1", "s2")),
        ("an invented fact", ("zz9",), ()),
        ("A final uncited remark.", (), ()),
    ]
    assert extract_claims("no answer block", IDS) is None
    # a sentence ends at . ! ? before a space or the end, or at a line break; not inside "2.5" or "e.g.,"
    decimals = extract_claims(
        "<answer>The dose was 2.5 mg per kg, e.g., for adults! Next line here\nhas more words.</answer>", IDS
    )
    assert [c.text for c in decimals] == [
        "The dose was 2.5 mg per kg, e.g., for adults!",
        "Next line here",
        "has more words.",
    ]
    # uncited sentences in any script are claims, CJK ones ending at a full-width stop with no space after it
    foreign = extract_claims("<answer>Франция находится в Европе. 法国位于欧洲。巴黎是首都。ok.</answer>", IDS)
    assert [c.text for c in foreign] == ["Франция находится в Европе.", "法国位于欧洲。", "巴黎是首都。"]
    assert snippet_texts(TOOL)["s2"] == "Title: B\nText: The prize came in 1945."


def test_precision_recall_f1_hand_computed():
    # cited supports 1, 0.5, 0 and one uncited claim: P = 1.5/3, R = 1.5/4, F1 = 2PR/(P+R)
    out = citation_scores([1.0, 0.5, 0.0, None], [True, True, True, False])
    p, r = 0.5, 0.375
    assert math.isclose(out["citation_precision"], p) and math.isclose(out["citation_recall"], r)
    assert math.isclose(out["citation_f1"], 2 * p * r / (p + r)) and out["claims"] == 4
    assert citation_scores([None, None], [False, False])["citation_f1"] == 0.0  # nothing cited
    assert citation_scores([], [])["citation_f1"] == 0.0  # empty answer
    assert citation_scores([None], [True])["citation_precision"] == 0.0  # a failed judgment counts 0


def _rollout(i, text):
    return {
        "run": "r",
        "step": 0,
        "prompt_id": "p",
        "sample_idx": i,
        "response_text": text,
        "finish_reason": "stop",
        "response_tokens": 20,
    }


def test_judge_stage_scores_claims_and_the_reward_uses_f1():
    prompt = {
        "prompt_id": "p",
        "question": "Who found penicillin?",
        "snippet_ids": IDS,
        "tool_output": TOOL,
        "ground_truth": None,
    }
    rubrics = {"p": [{"rubric_id": "pos-0", "kind": "positive", "weight": 1.0, "description": "Names Fleming."}]}
    texts = [
        "<answer><snippet id=s1>Fleming found penicillin in 1928</snippet></answer>",  # supported: P = R = 1
        "<answer><snippet id=s3,s1>Fleming won a prize</snippet>. Penicillin changed medicine forever.</answer>",
        "<answer><snippet id=bad1>Fleming found penicillin in 1928</snippet></answer>",  # invented ID: no call
        "no answer at all",
    ]
    judge = SourceMatchJudge()
    scored = score_rollouts(
        [_rollout(i, t) for i, t in enumerate(texts)],
        {"p": prompt},
        rubrics,
        judge,
        RewardConfig(citation_score="f1", citation_weight=1.0, rubric_weight=0.0, verification_reward=1.0),
        "zero",
        2000,
        64,
    )
    assert judge.calls == 4 + 2  # 4 rubric pairs + 2 cited claims with a valid ID
    f1 = [r["citation_f1"] for r in scored.reward_inputs]
    # second: one cited claim half supported ('Fleming' is in s1), one uncited: P = 0.5, R = 0.25
    assert f1 == [1.0, 2 * 0.5 * 0.25 / 0.75, 0.0, 0.0]
    assert [r["reward"] for r in scored.rewards] == f1
    claims = [(c["sample_idx"], c["cited_ids"], c["support"]) for c in scored.citation_claims]
    assert claims == [(0, ["s1"], 1.0), (1, ["s3", "s1"], 0.5), (1, [], None), (2, ["bad1"], 0.0)]
    assert scored.citation_claims[3]["raw_output"] is None  # decided without a judge call


def test_valid_ids_makes_no_claim_calls():
    prompt = {"prompt_id": "p", "question": "Q?", "snippet_ids": IDS, "tool_output": TOOL, "ground_truth": None}
    rubrics = {"p": [{"rubric_id": "pos-0", "kind": "positive", "weight": 1.0, "description": "C."}]}
    judge = SourceMatchJudge()
    scored = score_rollouts(
        [_rollout(0, "<answer><snippet id=s1>x y z</snippet></answer>")],
        {"p": prompt},
        rubrics,
        judge,
        RewardConfig(),
        "zero",
        2000,
        64,
    )
    assert judge.calls == 1 and scored.citation_claims == [] and scored.reward_inputs[0]["citation_f1"] is None


class JunkOnPrizeJudge(SourceMatchJudge):
    """SourceMatchJudge, except that a claim about a prize gets an answer with no score in it."""

    def complete(self, conversations):
        out = super().complete(conversations)
        claims = [m[-1]["content"].startswith("Sources:") and "prize" in m[-1]["content"] for m in conversations]
        return ["no idea" if junk else o for junk, o in zip(claims, out)]


def test_a_failed_claim_judgment_follows_judge_on_failure():
    prompt = {"prompt_id": "p", "question": "Q?", "snippet_ids": IDS, "tool_output": TOOL, "ground_truth": None}
    rubrics = {"p": [{"rubric_id": "pos-0", "kind": "positive", "weight": 1.0, "description": "C."}]}
    text = (
        "<answer><snippet id=s2>Fleming won a prize</snippet> and <snippet id=s1>Fleming found penicillin in 1928"
        "</snippet>. Penicillin changed medicine forever.</answer>"
    )

    def scored(on_failure, kind="f1"):
        reward = RewardConfig(citation_score=kind, citation_weight=1.0, rubric_weight=0.0, verification_reward=1.0)
        return score_rollouts(
            [_rollout(0, text)], {"p": prompt}, rubrics, JunkOnPrizeJudge(), reward, on_failure, 2000, 64
        )

    zero = scored("zero")
    assert [c["failure"] is not None for c in zero.citation_claims] == [True, False, False]
    (inputs,) = zero.reward_inputs
    # zero: the failed claim counts 0: P = 1/2, R = 1/3, F1 = 0.4; judged only: P = 1, R = 1/2, F1 = 2/3
    assert math.isclose(inputs["citation_f1"], 0.4) and math.isclose(inputs["citation_f1_judged"], 2 / 3)
    assert inputs["claims_failed"] == 1
    assert math.isclose(zero.rewards[0]["reward"], 0.4) and not zero.rewards[0]["dropped"]
    (skip,) = scored("skip").rewards
    assert math.isclose(skip["citation_score"], 2 / 3) and not skip["dropped"]
    (drop,) = scored("drop").rewards
    assert drop["dropped"] and math.isclose(drop["citation_score"], 2 / 3)
    (dr_tulu,) = scored("skip", "dr_tulu").rewards  # 0.6 F1 + 0.4 valid-ID fraction (both IDs valid)
    assert math.isclose(dr_tulu["citation_score"], 0.6 * 2 / 3 + 0.4)
    # a claim that no setting reads does not drop the rollout: valid_ids makes no claim calls at all
    (valid_ids,) = scored("drop", "valid_ids").rewards
    assert not valid_ids["dropped"] and valid_ids["claims_failed"] is None


def test_an_id_inside_nested_or_misspelt_tags_still_counts():
    """Every opening tag's IDs count: an invented ID or a distractor nested inside another citation, or after a
    misspelt closing tag, is as visible to the valid-ID fraction, the distractor count and the claims as in
    well-formed markup, so broken markup never scores above the well-formed answer citing the same IDs."""
    from refiner_core.reward.compose import format_parts

    ids = ["S1", "S2"]
    flat = "<answer><snippet id=S1,FAKE>Paris is the capital of France</snippet></answer>"
    nested = (
        "<answer><snippet id=S1>Paris is the capital of France <snippet id=FAKE>and of Spain</snippet></snippet>"
        "</answer>"
    )
    assert (
        format_parts(flat, ids)["citation_valid_fraction"],
        format_parts(nested, ids)["citation_valid_fraction"],
    ) == (
        0.5,
        0.5,
    )
    parts = format_parts(nested.replace("FAKE", "S2"), ids, supporting_ids=["S1"])
    assert parts["cites_distractor"] and not parts["format_ok"]
    assert [(c.cited_ids, c.valid_ids, c.text) for c in extract_claims(nested, ids)] == [
        (("S1",), ("S1",), "Paris is the capital of France"),
        (("FAKE",), (), "and of Spain"),
    ]
    misspelt = (
        "<answer><snippet id=S1>Paris is the capital of France</snippet > Rome is the capital of Spain. "
        "<snippet id=S2>Berlin is the capital of Germany</snippet></answer>"
    )
    assert [(c.cited_ids, c.text) for c in extract_claims(misspelt, ids)] == [
        (("S1",), "Paris is the capital of France"),
        ((), "Rome is the capital of Spain."),  # uncited: it counts against recall
        (("S2",), "Berlin is the capital of Germany"),
    ]


def test_a_claim_that_says_nothing_is_unsupported_without_a_judge_call():
    prompt = {"prompt_id": "p", "question": "Q?", "snippet_ids": IDS, "tool_output": TOOL, "ground_truth": None}
    rubrics = {"p": [{"rubric_id": "pos-0", "kind": "positive", "weight": 1.0, "description": "C."}]}
    judge = SourceMatchJudge()
    scored = score_rollouts(
        [_rollout(0, "<answer><snippet id=s1> ... </snippet> Fleming found penicillin in 1928.</answer>")],
        {"p": prompt},
        rubrics,
        judge,
        RewardConfig(citation_score="f1", citation_weight=1.0),
        "zero",
        2000,
        64,
    )
    assert judge.calls == 1  # the rubric only
    assert [(c["cited_ids"], c["support"], c["raw_output"]) for c in scored.citation_claims] == [
        (["s1"], 0.0, None),
        ([], None, None),
    ]
    assert scored.reward_inputs[0]["citation_f1"] == 0.0
