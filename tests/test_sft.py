"""SFT preparation (assistant-only masks, limits, dedupe, split, stats) and the SFT warm-start stage."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from refiner_core.data.prompts import render_chat, render_prompt
from refiner_core.data.rows import validate_rows
from refiner_core.data.sources import load_rows
from refiner_core.models import SMOLLM2, load_tokenizer, resolve_model
from refiner_core.sft.data import (
    SFTLimits,
    TemplateError,
    assistant_char_spans,
    normalise_tool_rows,
    prepare_sft,
    render_with_mask,
    sft_messages,
    stats_rows,
)

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "data" / "refiner" / "samples.jsonl"

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Who discovered penicillin?"},
    {"role": "assistant", "content": "<answer>Alexander Fleming, in 1928.</answer>"},
    {"role": "user", "content": "And the Nobel Prize?"},
    {"role": "assistant", "content": "In 1945, shared with Chain and Florey."},
]


def test_loss_mask_covers_exactly_the_assistant_tokens(tiny_tokenizer):
    # The expected rendering, built piece by piece: template text (no loss) and assistant text + end-of-turn (loss).
    pieces = [
        (
            "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWho discovered penicillin?<|im_end|>\n"
            "<|im_start|>assistant\n",
            False,
        ),
        ("<answer>Alexander Fleming, in 1928.</answer><|im_end|>", True),
        ("\n<|im_start|>user\nAnd the Nobel Prize?<|im_end|>\n<|im_start|>assistant\n", False),
        ("In 1945, shared with Chain and Florey.<|im_end|>", True),
        ("\n", False),
    ]
    expected_ids, expected_mask = [], []
    for text, is_assistant in pieces:
        ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        expected_ids += ids
        expected_mask += [is_assistant] * len(ids)
    rendered = render_with_mask(tiny_tokenizer, CONVERSATION)
    assert rendered.input_ids == expected_ids
    for k, (token, got, want) in enumerate(zip(rendered.input_ids, rendered.loss_mask, expected_mask)):
        assert got == want, f"token {k} {tiny_tokenizer.decode([token])!r}: mask {got}, expected {want}"
    masked = tiny_tokenizer.decode([t for t, m in zip(rendered.input_ids, rendered.loss_mask) if m])
    assert (
        masked
        == "<answer>Alexander Fleming, in 1928.</answer><|im_end|>In 1945, shared with Chain and Florey.<|im_end|>"
    )


def test_a_template_that_rewrites_earlier_turns_is_reported_not_mismasked(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    # Renders the turn count first, so a shorter conversation is not a prefix of the longer one.
    tokenizer.chat_template = "{{ messages | length }}" + tiny_tokenizer.chat_template
    with pytest.raises(TemplateError, match="prefix"):
        render_with_mask(tokenizer, CONVERSATION)


def _rows():
    return validate_rows(load_rows(str(SAMPLES))).rows


@pytest.fixture(scope="module", params=["tiny-qwen3", "smollm2"])
def tokenizer(request, tiny_tokenizer):
    return tiny_tokenizer if request.param == "tiny-qwen3" else load_tokenizer(resolve_model(SMOLLM2))


def _trained_text(tokenizer, rendered) -> str:
    return tokenizer.decode([t for t, m in zip(rendered.input_ids, rendered.loss_mask) if m])


@pytest.mark.parametrize("answer", ["\n\nHello", "  indented", "\nHello", " Hello world", "Hello world"])
def test_an_answer_starting_with_whitespace_keeps_it_and_the_prompt_keeps_rollouts_tokens(tokenizer, answer):
    """SmolLM2's tokenizer merges '\n\n' or '\n ' across the template's 'assistant\n' and the answer: SFT's prompt
    would end in another token than the one rollout's prompt ends in, and the answer's first whitespace get no loss."""
    messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": answer}]
    rendered = render_with_mask(tokenizer, messages)
    _, prompt_ids = render_prompt(tokenizer, messages[:1])
    assert rendered.input_ids[: rendered.prompt_tokens] == prompt_ids
    assert _trained_text(tokenizer, rendered) == answer + "<|im_end|>"


def test_answers_that_start_with_text_keep_their_tokens_and_mask(tokenizer):
    """Over the shipped SFT rows (the refiner samples; the tool-calling cold start's multi-turn conversations, which
    prepare-sft renders as the agent loop does): the same ids and mask as tokenizing the whole rendering at once,
    as before the text before each answer was tokenized on its own."""
    cold_start, _ = normalise_tool_rows(load_rows(str(REPO / "data" / "math-tools" / "cold-start.jsonl")))
    for row in _rows() + validate_rows(cold_start[:40]).rows:
        messages = sft_messages(row)
        _, spans = assistant_char_spans(tokenizer, messages)
        whole = render_chat(tokenizer, messages, add_generation_prompt=False)
        mask = [any(s <= start < e for s, e in spans) for start, _ in whole.offsets]
        rendered = render_with_mask(tokenizer, messages)
        assert (rendered.input_ids, rendered.loss_mask) == (whole.input_ids, mask), row["id"]


def test_a_conversation_opening_with_an_assistant_turn_learns_only_its_text(tokenizer):
    """Before its content lie the template's header and (SmolLM2) a default system prompt: not the assistant's."""
    messages = [
        {"role": "assistant", "content": "Hi! Ask me anything."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    rendered = render_with_mask(tokenizer, messages)
    assert _trained_text(tokenizer, rendered) == "Hi! Ask me anything.<|im_end|>4<|im_end|>"


def test_limits_drop_or_truncate_with_counts_per_reason(tiny_tokenizer):
    rows = _rows()
    limits = SFTLimits(max_prompt_tokens=600, max_response_tokens=60, max_total_tokens=650, pack_length=2048)
    dropped = prepare_sft(rows, tiny_tokenizer, "t", limits, 0.0, 0)
    kept = prepare_sft(
        rows,
        tiny_tokenizer,
        "t",
        SFTLimits(
            **{
                **limits.__dict__,
                "prompt_policy": "truncate",
                "response_policy": "truncate",
                "total_policy": "truncate",
            }
        ),
        0.0,
        0,
    )
    assert sum(dropped.stats["dropped"].values()) == len(dropped.rejected) > 0
    assert set(dropped.stats["dropped"]) <= {"prompt_too_long", "response_too_long", "total_too_long"}
    assert kept.rejected == [] and len(kept.examples) == len(rows)
    assert sum(kept.stats["truncated"].values()) >= len(dropped.rejected)
    for e in kept.examples:
        assert e["prompt_tokens"] <= 600 and e["response_tokens"] <= 60 and e["total_tokens"] <= 650
        assert any(e["loss_mask"]) and e["assistant_tokens"] == sum(e["loss_mask"])
    for e in dropped.examples:
        assert e["truncated"] is None


def test_dedupe_split_packing_and_stats(tiny_tokenizer):
    rows = _rows()
    duplicate = {**rows[0], "id": "copy-of-first", "row_ref": "line 99"}
    limits = SFTLimits(max_prompt_tokens=2000, max_response_tokens=1024, max_total_tokens=2048, pack_length=2048)
    out = prepare_sft(rows + [duplicate], tiny_tokenizer, "t", limits, 0.25, seed=3, histogram_bins=5)
    assert [(r.row_ref, r.reason) for r in out.rejected] == [("line 99", "duplicate_example")]
    assert len(out.examples) == len(rows)
    splits = {e["source_id"]: e["split"] for e in out.examples}
    again = prepare_sft(list(reversed(rows)), tiny_tokenizer, "t", limits, 0.25, seed=3)
    assert {e["source_id"]: e["split"] for e in again.examples} == splits  # seeded and order-independent
    other_seed = prepare_sft(rows, tiny_tokenizer, "t", limits, 0.25, seed=4)
    assert {e["source_id"]: e["split"] for e in other_seed.examples} != splits
    assert 0 < sum(s == "validation" for s in splits.values()) < len(rows)

    stats = out.stats
    assert stats["train_examples"] + stats["validation_examples"] == len(out.examples)
    for name in ("prompt_tokens", "response_tokens", "total_tokens"):
        hist = stats["histograms"][name]
        assert sum(hist["counts"]) == len(out.examples) and len(hist["edges"]) == 6
    for split in ("train", "validation"):
        members = [e for e in out.examples if e["split"] == split]
        packs = {e["pack_id"] for e in members}
        assert stats["packing"][split]["packs"] == len(packs)
        used = sum(e["total_tokens"] for e in members)
        assert stats["packing"][split]["efficiency"] == pytest.approx(used / (len(packs) * 2048))
        for p in packs:  # offsets tile each pack without overlap
            inside = sorted((e["pack_offset"], e["total_tokens"]) for e in members if e["pack_id"] == p)
            assert all(a + n == b for (a, n), (b, _) in zip(inside, inside[1:])) and inside[0][0] == 0
    rows_out = stats_rows("t", stats)
    assert {"count", "packing", "histogram", "dropped"} <= {r["kind"] for r in rows_out}


def _task_states(flow_state) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id])),
            sort=TaskRunSort.EXPECTED_START_TIME_DESC,
            limit=200,
        )
    return {r.name: r.state.name for r in runs}


def test_sft_stage_lowers_validation_loss_and_a_rerun_is_cached(prefect_server, tiny_model_path, tmp_path):
    from flows.refiner import refiner_pipeline
    from refiner_core.config import load_recipe
    from refiner_core.store.storage import query

    recipe = load_recipe(REPO / "recipes" / "tiny-sft.yaml", ["run.retries=0"]).to_dict()
    run_dir = str(tmp_path / "run")
    first = refiner_pipeline(recipe=recipe, run_dir=run_dir, return_state=True)
    assert first.is_completed(), first.message
    states = _task_states(first)
    assert states["prepare-sft"] == "Completed" and states["sft-train"] == "Completed"

    db = Path(run_dir) / "catalog.duckdb"
    _, val = query(db, "SELECT step, loss FROM sft_metrics WHERE split = 'validation' ORDER BY step")
    assert len(val) == recipe["sft"]["epochs"] + 1
    assert val[-1][1] < val[0][1] - 0.5, f"validation loss did not drop: {val}"
    _, train_tokens = query(db, "SELECT min(tokens) FROM sft_metrics WHERE split = 'train'")
    assert train_tokens[0][0] > 0
    # GRPO sampled from the SFT checkpoint.
    _, policies = query(db, "SELECT DISTINCT policy FROM rollouts")
    assert policies == [(str(Path(run_dir) / "checkpoints" / "sft"),)]
    assert (Path(run_dir) / "checkpoints" / "sft" / "config.json").exists()
    # The KL reference is the SFT checkpoint too: before the first update policy == reference, so KL is 0
    # (against the untrained base it would be large after a 3-epoch warm start).
    _, kl = query(db, "SELECT kl FROM steps WHERE step = 0")
    assert kl[0][0] == pytest.approx(0.0, abs=1e-6)
    _, efficiency = query(
        db, "SELECT value FROM sft_stats WHERE kind = 'packing' AND name = 'efficiency' AND split = 'train'"
    )
    assert 0 < efficiency[0][0] <= 1
    stats = json.loads((Path(run_dir) / "sft" / "stats.json").read_text())
    assert stats["examples_out"] == stats["train_examples"] + stats["validation_examples"] > 0

    second = refiner_pipeline(recipe=recipe, run_dir=run_dir, return_state=True)
    assert second.is_completed()
    states = _task_states(second)
    assert states["prepare-sft"] == "Cached" and states["sft-train"] == "Cached"
    assert states["ingest-rubrics"] == "Cached"  # re-ingesting the same file is a no-op

    # Training settings are not read by prepare-sft: a longer warm start reuses the prepared packs.
    longer = {**recipe, "sft": {**recipe["sft"], "epochs": recipe["sft"]["epochs"] + 1}}
    third = refiner_pipeline(recipe=longer, run_dir=run_dir, return_state=True)
    assert third.is_completed()
    states = _task_states(third)
    assert states["prepare-sft"] == "Cached" and states["sft-train"] == "Completed"

    # A setting of the statistics only: prepare-sft runs again, its examples are the same, nothing is retrained
    # (the whole manifest, stats and quarantine hashes included, was sft-train's input).
    binned = {**longer, "sft": {**longer["sft"], "histogram_bins": 5}}
    fourth = refiner_pipeline(recipe=binned, run_dir=run_dir, return_state=True)
    assert fourth.is_completed()
    states = _task_states(fourth)
    assert states["prepare-sft"] == "Completed" and states["sft-train"] == "Cached"


def test_open_instruct_chat_rows_become_sft_examples(tiny_tokenizer):
    blank = [*CONVERSATION[:2], {"role": "assistant", "content": " \n"}]  # would teach ending the turn at once
    rows = [
        {"id": "c1", "messages": CONVERSATION, "row_ref": "line 1", "content_hash": "h1"},
        {"id": "c2", "messages": CONVERSATION[:2], "row_ref": "line 2", "content_hash": "h2"},  # no answer
        {"id": "c3", "messages": blank, "row_ref": "line 3", "content_hash": "h3"},
    ]
    out = prepare_sft(rows, tiny_tokenizer, "t", SFTLimits(pack_length=2048), 0.0, 0)
    assert out.stats["skipped_no_answer"] == 2 and out.rejected == []
    [example] = out.examples
    assert example["input_ids"] == render_with_mask(tiny_tokenizer, CONVERSATION).input_ids
    assert example["assistant_tokens"] == sum(render_with_mask(tiny_tokenizer, CONVERSATION).loss_mask)
    assert example["split"] == "train" and example["source_ref"] == "line 1"


def test_a_bf16_model_trains_fp32_weights_and_comes_back_in_bf16(tiny_model_path, tiny_tokenizer):
    """AdamW on the bf16 weights themselves rounded most steps away (15 % of the weights moved in four steps at lr
    1e-5, against all of them in fp32). A bf16 model now trains as an fp32 one starting from the same (bf16) values
    does, and is cast back to bf16 at the end: bit for bit that fp32 run rounded."""
    import torch

    from refiner_core.models import load_model
    from refiner_core.sft.train import SFTSettings, packed_rows, train_sft

    limits = SFTLimits(max_prompt_tokens=2000, max_response_tokens=1024, max_total_tokens=2048, pack_length=2048)
    examples = prepare_sft(_rows(), tiny_tokenizer, "t", limits, 0.0, seed=3).examples
    packs = packed_rows([e for e in examples if e["split"] == "train"])[:4]
    settings = SFTSettings(learning_rate=1e-5, max_grad_norm=0.0)
    bf16 = load_model(tiny_model_path, "bfloat16", trainable=True)
    fp32 = load_model(tiny_model_path, "float32", trainable=True)
    with torch.no_grad():
        for weight in fp32.parameters():  # the bf16 values; buffers (rotary frequencies) stay fp32 as in bf16 loads
            weight.copy_(weight.bfloat16())
    start = {k: v.clone() for k, v in fp32.state_dict().items()}
    for model in (bf16, fp32):
        train_sft(model, packs, [], tiny_tokenizer.pad_token_id, settings)
    assert all(v.dtype == torch.bfloat16 for v in bf16.state_dict().values())
    moved = sum(int((fp32.state_dict()[k] != v).sum()) for k, v in start.items())
    assert moved > 0.99 * sum(v.numel() for v in start.values())
    for name, weight in bf16.state_dict().items():
        assert torch.equal(weight, fp32.state_dict()[name].bfloat16()), name


def test_conversations_opening_with_a_greeting_are_split_by_what_they_ask(tiny_tokenizer):
    """Every conversation opening with an assistant greeting shared the empty opening, so all took one split: with
    40 of them and two other rows at fraction 0.1, some seeds trained on 2 of 42. The greeting now belongs to the
    opening, so they split one by one (a question asked after the same greeting still groups)."""
    from refiner_core.data.rows import RawRow

    def chat(i: int, greeting: bool) -> dict:
        opening = [{"role": "assistant", "content": f"Welcome! I am bot {i}."}] if greeting else []
        asked = [{"role": "user", "content": f"Tell me fact {i}"}, {"role": "assistant", "content": f"{i * i}."}]
        return {"id": f"r{i:02d}", "messages": opening + asked}

    raw = [chat(i, greeting=i < 40) for i in range(42)]
    rows = validate_rows([RawRow(f"line {i}", json.dumps(r), r, None) for i, r in enumerate(raw)]).rows
    for seed in range(8):
        stats = prepare_sft(rows, tiny_tokenizer, "t", SFTLimits(), 0.25, seed).stats
        assert 20 <= stats["train_examples"] <= 40 and stats["validation_examples"] >= 2, (seed, stats)


def test_a_held_out_question_answered_in_a_later_turn_is_left_out_of_sft():
    """A held-out prompt [q1, a1, q2] asks q2; an SFT row [q1, a1', q2, a2] answers it in its second turn and was
    kept, since only its first question was compared."""
    from refiner_core.data.prepare import prompt_fields
    from refiner_core.data.rows import prompt_hash
    from refiner_core.sft.data import without_held_out

    prime, product = {"role": "user", "content": "Name a prime."}, {"role": "user", "content": "What is 7 * 13?"}
    held = {"id": "p1", "messages": [prime, {"role": "assistant", "content": "7"}, product], "ground_truth": "91"}
    asked = ["Name a prime.", "What is 7 * 13?"]  # the prepare-data manifest's held_out_asked
    held_out = [
        {
            "prompt_id": "p1",
            "prompt_hash": prompt_hash(held),
            "question": prompt_fields(held)["question"],
            "asked": asked,
        }
    ]
    answers = {"id": "s9", "messages": [prime, {"role": "assistant", "content": "Seven."}, product,
                                        {"role": "assistant", "content": "91"}]}  # fmt: skip
    other = {"id": "s10", "messages": [prime, {"role": "assistant", "content": "Seven."}]}
    # the same follow-up after another question is another prompt: kept
    elsewhere = {"id": "s11", "messages": [{"role": "user", "content": "Name an even number."},
                                           {"role": "assistant", "content": "8"}, product,
                                           {"role": "assistant", "content": "91"}]}  # fmt: skip
    alone = {"id": "s12", "messages": [product, {"role": "assistant", "content": "91"}]}  # first question: as before
    kept, left_out = without_held_out([answers, other, elsewhere, alone], held_out, same_source=False)
    assert kept == [other, elsewhere] and left_out == {"prompt_id": 0, "prompt": 0, "question": 2}


def test_a_tool_conversation_opening_with_an_assistant_turn_is_quarantined_by_name(tiny_tokenizer):
    from refiner_core.agent.hermes import hermes_block
    from refiner_core.data.rows import RawRow

    row = {
        "id": "t0",
        "tools": ["python"],
        "messages": [
            {"role": "assistant", "content": hermes_block("python", {"code": "print(1)"})},
            {"role": "tool", "content": "1"},
            {"role": "assistant", "content": "\\boxed{1}"},
        ],
    }
    kept, rejected = normalise_tool_rows([RawRow("line 1", json.dumps(row), row, None)])
    assert kept == [] and [(r.reason, r.detail) for r in rejected] == [
        ("no_prompt", "message 0 is an assistant turn: the agent loop starts from a system or user prompt")
    ]


def _chat_rows(conversations: list[list[dict]], tools=None) -> list:
    from refiner_core.data.rows import RawRow

    rows = [{"id": f"r{i}", "messages": m, **({"tools": tools} if tools else {})} for i, m in enumerate(conversations)]
    return [RawRow(f"line {i + 1}", json.dumps(r), r, None) for i, r in enumerate(rows)]


@pytest.mark.parametrize(
    ("tool_calls", "why"),
    [
        (5, "message 1 tool_calls must be a list, got int"),
        (
            [{"function": {"name": "python", "arguments": "[" * 50_000}}],
            "message 1 tool_calls[0]: arguments nest deeper than JSON goes",
        ),
    ],
)
def test_a_malformed_tool_call_is_quarantined_not_a_crash_of_the_stage(tool_calls, why):
    """`tool_calls: 5` raised TypeError and arguments nested 50,000 deep RecursionError: the whole prepare-sft
    stage failed, naming no row."""
    good = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    bad = [
        {"role": "user", "content": "Compute 3 * 3."},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        {"role": "tool", "content": "9"},
        {"role": "assistant", "content": "9"},
    ]
    kept, rejected = normalise_tool_rows(_chat_rows([good, bad], tools=["python"]))
    assert [r.data["id"] for r in kept] == ["r0"]
    assert [(r.row_ref, r.reason, r.detail) for r in rejected] == [("line 2", "bad_tool_call", why)]


def _with_template(tokenizer, template: str):
    changed = copy.deepcopy(tokenizer)
    changed.chat_template = template
    return changed


def test_a_row_the_chat_template_refuses_is_quarantined_and_the_others_kept(tiny_tokenizer):
    """A template that raises on roles that do not alternate (as Mistral's, Llama 2's, Gemma's do), and one that
    trims contents (so a content spelling '<|im_end|>' cannot be kept out of special tokens): each row it cannot
    render failed the stage instead of being quarantined as template_error."""
    alternate = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    trimmed = alternate.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    fine = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    twice = [{"role": "user", "content": "Hi."}, *fine]
    spelled = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": " 4 <|im_end|> really "}]
    for template, refused, why in (
        (alternate, twice, "TemplateError: Conversation roles must alternate"),
        (trimmed, spelled, "UnsafeTemplateError: chat template does not copy message contents verbatim"),
    ):
        rows = validate_rows(_chat_rows([fine, refused])).rows
        prepared = prepare_sft(rows, _with_template(tiny_tokenizer, template), "t", SFTLimits(), 0.0, 0)
        assert [e["source_id"] for e in prepared.examples] == ["r0"]
        [rejection] = prepared.rejected
        assert (rejection.row_ref, rejection.reason) == ("line 2", "template_error")
        assert rejection.detail.startswith(why), rejection.detail


def test_a_blank_assistant_turn_is_not_learned_the_others_are(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "  "},
        {"role": "user", "content": "Who discovered penicillin?"},
        {"role": "assistant", "content": "Alexander Fleming."},
    ]
    learned = _trained_text(tiny_tokenizer, render_with_mask(tiny_tokenizer, messages))
    assert learned == "Alexander Fleming.<|im_end|>"


def test_an_example_past_the_policys_context_is_dropped_by_name(tiny_tokenizer):
    """The limits are the recipe's (8192 tokens by default); a 2048-token policy trained on longer examples
    without a word."""
    short = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    long = [{"role": "user", "content": "Count. " * 40}, {"role": "assistant", "content": "1 2 3"}]
    rows = validate_rows(_chat_rows([short, long])).rows
    prepared = prepare_sft(rows, tiny_tokenizer, "t", SFTLimits(), 0.0, 0, context=64)
    assert [e["source_id"] for e in prepared.examples] == ["r0"]
    [rejection] = prepared.rejected
    assert rejection.reason == "past_model_context" and rejection.detail.endswith(
        "> the policy's context of 64 (max_position_embeddings)"
    )
    assert prepared.stats["dropped"] == {"past_model_context": 1}


def test_sft_stats_count_the_rows_refused_as_invalid():
    stats = {
        "rows_in": 25,
        "examples_out": 20,
        "skipped_no_answer": 0,
        "train_examples": 18,
        "validation_examples": 2,
        "invalid_rows": 5,
        "invalid": {"invalid_messages": 3, "bad_tool_call": 2},
        "dropped": {},
        "truncated": {},
        "packing": {s: {"packs": 1, "tokens": 10, "efficiency": 0.5} for s in ("train", "validation")},
        "histograms": {},
    }
    rows = {(r["kind"], r["name"]): r["value"] for r in stats_rows("t", stats)}
    assert rows[("count", "invalid_rows")] == 5
    assert (rows[("invalid", "invalid_messages")], rows[("invalid", "bad_tool_call")]) == (3, 2)
