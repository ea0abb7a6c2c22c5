"""The rollout engine's records must be trainable as they are: logprobs agree with the learner's."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from conftest import sampling_gaps
from refiner_core.config import JudgeConfig
from refiner_core.learners.base import TrainSample
from refiner_core.learners.batching import collate
from refiner_core.learners.logprobs import token_logprobs
from refiner_core.models import load_model
from refiner_core.rollout.base import SamplingParams, first_stop, left_padded
from refiner_core.rollout.hf_engine import HFRolloutEngine, RepetitionPenalty


def short_and_long_prompts(tokenizer) -> list[list[int]]:
    """Two chat prompts of different lengths: batched together, the short one is left-padded."""
    return [
        tokenizer(t, add_special_tokens=False)["input_ids"]
        for t in (
            "<|im_start|>user\nshort<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user\na much longer question about rivers and bridges<|im_end|>\n<|im_start|>assistant\n",
        )
    ]


def test_sampled_logprobs_match_learner_logprobs(tiny_model_path, tiny_tokenizer):
    model = load_model(tiny_model_path)
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=8)
    prompts = short_and_long_prompts(tiny_tokenizer)
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=5)
    gens = engine.generate(prompts, params)
    assert [(g.prompt_index, g.sample_idx) for g in gens] == [(p, s) for p in range(2) for s in range(3)]
    samples = [TrainSample(prompts[g.prompt_index], g.token_ids, 0.0, g.logprobs) for g in gens]
    batch = collate(samples, tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        learner_lp = token_logprobs(model, batch, temperature=0.7)
    mask = batch["mask"].bool()
    torch.testing.assert_close(learner_lp[mask], batch["rollout_logprobs"][mask], atol=2e-4, rtol=1e-4)
    # and a different temperature would not match: the learner really uses the sampler's temperature
    with torch.no_grad():
        other = token_logprobs(model, batch, temperature=1.0)
    assert (other[mask] - batch["rollout_logprobs"][mask]).abs().max() > 1e-2


def test_sampling_settings_in_the_checkpoint_do_not_reach_the_samples(tiny_model_path, tiny_tokenizer):
    """A generation_config.json that ships a repetition penalty or an n-gram ban (Qwen2.5-Instruct: 1.05) shaped the
    samples and their log-probs although SamplingParams said neither: the learner's log-probs no longer matched."""
    model = load_model(tiny_model_path)
    with torch.no_grad():
        model.model.norm.weight.mul_(40)  # sharp logits: the penalty moves them visibly
    plain = HFRolloutEngine(copy.deepcopy(model), tiny_tokenizer, batch_size=8)
    model.generation_config.repetition_penalty = 1.05
    model.generation_config.no_repeat_ngram_size = 2
    shipped = HFRolloutEngine(model, tiny_tokenizer, batch_size=8)
    prompts = short_and_long_prompts(tiny_tokenizer)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=3)
    gens = shipped.generate(prompts, params)
    assert [(g.token_ids, g.logprobs) for g in gens] == [
        (g.token_ids, g.logprobs) for g in plain.generate(prompts, params)
    ]
    batch = collate(
        [TrainSample(prompts[g.prompt_index], g.token_ids, 0.0, g.logprobs) for g in gens], tiny_tokenizer.pad_token_id
    )
    with torch.no_grad():
        learner_lp = token_logprobs(model, batch, temperature=1.0)
    mask = batch["mask"].bool()
    torch.testing.assert_close(learner_lp[mask], batch["rollout_logprobs"][mask], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "truncation",
    [{"top_k": 5}, {"min_p": 0.3}, {"min_p": 0.5, "top_p": 0.3}],
    ids=["top_k", "min_p", "min_p_then_top_p"],
)
def test_top_k_and_min_p_sample_inside_the_truncated_distribution_and_report_its_logprobs(
    tiny_model_path, tiny_tokenizer, truncation
):
    """As vLLM samples: min_p and top_k, then top_p over what they kept (transformers' own warpers ran top_p first,
    so the two engines sampled other distributions with both set)."""
    model = load_model(tiny_model_path)
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=8)
    prompts = [tiny_tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]]
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=12, seed=5)
    gens = engine.generate(prompts, dataclasses.replace(params, **truncation))
    outside, gap = sampling_gaps(model, prompts, gens, 0.7, **truncation)
    assert outside == 0 and gap < 2e-4, (outside, gap)
    if "top_p" in truncation:  # vLLM's order (min_p, then top_p over what it kept), not transformers' own
        assert sampling_gaps(model, prompts, gens, 0.7, top_p_first=True, **truncation)[1] > 0.1
    # the random model's flat distribution: untruncated samples fall outside it
    assert sampling_gaps(model, prompts, engine.generate(prompts, params), 0.7, **truncation)[0] > 0


def test_repetition_penalty_reports_the_penalised_logprobs_and_ignores_left_padding(tiny_model_path, tiny_tokenizer):
    model = load_model(tiny_model_path)
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=8)
    short = tiny_tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    prompts = [short, short[:2] + short]  # batched together: the shorter one is left-padded
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=5, repetition_penalty=3.0)
    gens = engine.generate(prompts, params)
    outside, gap = sampling_gaps(model, prompts, gens, 0.7, repetition_penalty=3.0)
    assert outside == 0 and gap < 2e-4, gap
    assert sampling_gaps(model, prompts, gens, 0.7)[1] > 10 * 2e-4  # the penalty changed the distribution
    # transformers' own penalty, on the padded row, would also count the pad tokens
    scores = torch.randn(2, 50)
    ids, attention = left_padded([[7, 3, 7], [5, 9, 3, 1]], pad_id=1)
    ours = RepetitionPenalty(1.5, attention)(ids, scores.clone())
    for row, real in enumerate([[7, 3, 7], [5, 9, 3, 1]]):
        theirs = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([real]), scores[row : row + 1].clone())
        assert torch.equal(ours[row : row + 1], theirs)


def test_same_seed_same_samples(tiny_model_path, tiny_tokenizer):
    engine = HFRolloutEngine(load_model(tiny_model_path), tiny_tokenizer, batch_size=4)
    prompt = [tiny_tokenizer("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]]
    a = engine.generate(prompt, SamplingParams(n=4, max_new_tokens=8, seed=11))
    b = engine.generate(prompt, SamplingParams(n=4, max_new_tokens=8, seed=11))
    c = engine.generate(prompt, SamplingParams(n=4, max_new_tokens=8, seed=12))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_first_stop_keeps_eos_and_cuts_at_stop_string():
    decode = lambda ids: "".join(chr(96 + i) for i in ids)  # noqa: E731  1->a, 2->b, ...
    assert first_stop([1, 2, 9, 3], {9}, (), decode) == (3, True)
    assert first_stop([1, 2, 3, 4, 5], set(), ("cd",), decode) == (4, True)  # 'abcd' is the shortest prefix
    assert first_stop([1, 2, 3], set(), ("zz",), decode) == (3, False)
    # an EOS after the stop string is generate's padding of a stopped row, not a sampled token
    assert first_stop([1, 2, 3, 4, 9, 9], {9}, ("cd",), decode) == (4, True)
    assert first_stop([1, 2, 9, 3, 4], {9}, ("cd",), decode) == (3, True)  # a sampled EOS before it still ends it


def test_a_row_stopped_by_a_stop_string_ends_with_the_token_that_completed_it(tiny_model_path, tiny_tokenizer):
    """generate fills a row that met a stop string with the pad token while the rest of its batch samples on; with
    pad = EOS (SmolLM2, Qwen3) that padding must not be kept as a sampled EOS, with the log-prob the policy gives
    EOS there (on SmolLM2 as low as -22 after '</answer></', which made the step's k3 KL jump from 0.17 to 4.5)."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    engine = HFRolloutEngine(load_model(tiny_model_path), tokenizer, batch_size=8)
    assert tokenizer.pad_token_id in engine.eos_ids
    prompts = short_and_long_prompts(tokenizer)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3)
    free = engine.generate(prompts, params)
    stop = engine._decode(free[0].token_ids[:4])  # the first sample's text after 4 tokens, which no other sample has
    stopped = engine.generate(prompts, dataclasses.replace(params, stop=(stop,)))
    assert [len(g.token_ids) for g in stopped] == [4] + [12] * 7  # the other rows sampled on in the same batch
    assert stopped[0].token_ids == free[0].token_ids[:4] and stopped[0].finish_reason == "stop"
    assert stopped[0].logprobs == free[0].logprobs[:4]


@pytest.mark.parametrize(
    ("stop", "likely", "prompt_end"),
    [
        ("<|im_start|>", "<|im_start|>", ""),  # a special token's text: no response text holds it
        ("</answer>", ">", "</answer"),  # completed by the first sampled token, but begun in the prompt
    ],
)
def test_a_stop_string_only_the_tokens_or_the_prompt_hold_is_no_stop(
    tiny_model_path, tiny_tokenizer, stop, likely, prompt_end
):
    """transformers' stop strings match token strings, special tokens included, over prompt and response; neither
    vLLM nor first_stop (the response's text, special tokens skipped) sees a stop there, so the row's padding after
    it was kept as sampled tokens (finish_reason 'length', log-probs of about -7.7 each). With the stop token made
    likely, the rows sample exactly as with no stop string."""
    model = load_model(tiny_model_path)
    token = (
        tiny_tokenizer.convert_tokens_to_ids(likely)
        if likely.startswith("<|")
        else tiny_tokenizer(likely)["input_ids"][-1]
    )
    bias = torch.nn.functional.one_hot(torch.tensor(token), model.config.vocab_size) * 5.0
    hook = model.lm_head.register_forward_hook(lambda module, inputs, out: out + bias)
    try:
        engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=8)
        prompts = [
            p + tiny_tokenizer(prompt_end, add_special_tokens=False)["input_ids"] if prompt_end else p
            for p in short_and_long_prompts(tiny_tokenizer)
        ]
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=5)
        free = engine.generate(prompts, params)
        stopped = engine.generate(prompts, dataclasses.replace(params, stop=(stop,)))
    finally:
        hook.remove()
    assert sum(token in g.token_ids for g in free) >= 4  # the stop token is sampled where the old criterion stopped
    assert [(g.token_ids, g.logprobs, g.finish_reason) for g in stopped] == [
        (g.token_ids, g.logprobs, g.finish_reason) for g in free
    ]


def test_a_rollout_sampled_beside_greedy_generation_samples_what_it_would_alone(tiny_model_path, tiny_tokenizer):
    """grpo.async_steps samples a step's rollout on another thread while the in-process judge generates greedily on
    this one: each greedy batch seeded torch's process-wide generator, so the rollout's samples changed with the
    timing (all 16 of a step's responses in the tiny recipe). Greedy batches now leave the generator alone, and
    sampled batches take it one at a time."""
    import threading

    engine = HFRolloutEngine(load_model(tiny_model_path), tiny_tokenizer, batch_size=2)
    judge = HFRolloutEngine(load_model(tiny_model_path), tiny_tokenizer, batch_size=2)
    prompts = short_and_long_prompts(tiny_tokenizer)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=11)
    alone = engine.generate(prompts, params)
    beside: list = []
    sampler = threading.Thread(target=lambda: beside.extend(engine.generate(prompts, params)))
    sampler.start()
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=2, seed=0)
    rounds = 0
    while sampler.is_alive() or rounds == 0:
        judge.generate(prompts, greedy)
        rounds += 1
    sampler.join()
    assert rounds > 1
    assert [g.token_ids for g in beside] == [g.token_ids for g in alone]


def test_shared_prefix_judge_equals_plain_batches(tiny_model_path):
    """Reusing the KV cache of a response's shared prompt prefix must not change any rubric's score."""
    from refiner_core.data.prompts import judge_messages
    from refiner_core.judges.transformers_judge import make_transformers_judge, prefix_groups

    judge = make_transformers_judge(
        str(tiny_model_path), JudgeConfig(batch_size=3, max_new_tokens=4, mode="expected_score")
    )
    conversations = [
        judge_messages(q, r, c)
        for q, r in (
            ("Who built it?", "Eiffel's company built it."),
            ("When?", "In 1889, for the fair, after two years."),
        )
        for c in ("Names the builder.", "Gives a date.", "Avoids padding and tangents entirely.", "Cites snippets.")
    ]
    judge.share_prefix = True
    shared = judge.complete(conversations)
    judge.share_prefix = False
    plain = judge.complete(conversations)
    import json

    for a, b in zip(shared, plain):
        assert abs(json.loads(a)["score"] - json.loads(b)["score"]) < 1e-3, (a, b)
    head_a, head_b = list(range(100, 140)), list(range(200, 240))
    tokens = [head_a + [1, 2], head_a + [3], head_b + [4, 5], head_b + [6], head_a + [7]]
    assert prefix_groups(tokens) == [[0, 1], [2, 3], [4]]


def test_the_memory_an_engine_holds_counts_tied_weights_once(tiny_model_path, tiny_tokenizer):
    """The tiny model's output layer is its embedding: summed per name, it was counted twice (about a quarter too
    much for a tied model such as Qwen3-0.6B), and live engines were closed where they fitted."""
    model = load_model(tiny_model_path)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    held, _ = HFRolloutEngine(model, tiny_tokenizer, batch_size=2).memory_bytes()
    assert held == sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_sample_ends_at_the_chat_templates_end_of_turn_even_when_the_checkpoint_names_another_eos(
    tiny_model_path, tiny_tokenizer
):
    """A base model under a chat template (its EOS <|endoftext|>, the template's turns ending in <|im_end|>): the
    engine stops at the template's end of turn, where it ran on to the token limit. Emulated on the tiny model with
    a template whose turns end in the token its greedy answer starts with, and <|endoftext|> as the only EOS."""
    from refiner_core.rollout.base import chat_turn_end_id

    model = load_model(tiny_model_path)
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=False
    )
    ids = tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    first = HFRolloutEngine(model, tiny_tokenizer, batch_size=2).generate([ids], greedy)[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 12
    assert chat_turn_end_id(tiny_tokenizer) == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")

    ends_turns = tiny_tokenizer.convert_ids_to_tokens(first.token_ids[0])
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [ends_turns]})
    tokenizer.chat_template = tiny_tokenizer.chat_template.replace("<|im_end|>", ends_turns)
    tokenizer.eos_token = "<|endoftext|>"
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    engine = HFRolloutEngine(model, tokenizer, batch_size=2)
    assert engine.eos_ids == {tokenizer.eos_token_id, first.token_ids[0]}
    ended = engine.generate([ids], greedy)[0]
    assert (ended.token_ids, ended.finish_reason) == ([first.token_ids[0]], "stop")

    tokenizer.chat_template = None
    assert chat_turn_end_id(tokenizer) is None


def test_a_response_ends_at_the_models_context_as_vllms_does(tiny_model_path, tiny_tokenizer):
    """A prompt with less room left in the context than max_new_tokens: the response ends at the context, cut off
    ('length'), as vLLM ends it; the hf engine sampled on at positions past the model's (40 tokens where vLLM gave
    4)."""
    model = load_model(tiny_model_path)
    prompt = short_and_long_prompts(tiny_tokenizer)[1]
    model.config.max_position_embeddings = len(prompt) + 4
    engine = HFRolloutEngine(model, tiny_tokenizer, batch_size=2)
    [cut] = engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_new_tokens=40))
    assert (len(cut.token_ids), len(cut.logprobs), cut.finish_reason) == (4, 4, "length")
    model.config.max_position_embeddings = 2048
    [whole] = engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_new_tokens=40))
    assert whole.token_ids[:4] == cut.token_ids and len(whole.token_ids) > 4
