"""The 'transformers' judge: the judge model in-process, generating JSON or reading score probabilities."""

from __future__ import annotations

import time
from dataclasses import dataclass

from refiner_core.config import ConfigError, JudgeConfig
from refiner_core.data.prompts import render_prompt
from refiner_core.judges.base import Completion
from refiner_core.judges.cache import prompt_hash
from refiner_core.learners.logprobs import autocast
from refiner_core.rollout.base import SamplingParams, left_padded
from refiner_core.rollout.hf_engine import HFRolloutEngine
from refiner_core.runtime.progress import progress_bar

SCORE_PREFIX = '{"score":'


@dataclass
class TransformersJudge:
    """In-process judge.

    'json' generates greedily and the reply is parsed; with `prefill` the reply is started as '{"score":' so
    small models stay in the format. 'expected_score' reads the next-token probabilities of 0/1/2 after
    '{"score":' in one forward pass (never unparseable) and reports the probability-weighted score as JSON with
    the distribution; with `share_prefix` the prompt part shared by one response's rubrics is read once."""

    engine: HFRolloutEngine
    max_new_tokens: int
    mode: str = "json"
    prefill: bool = True
    share_prefix: bool = True
    name: str = "transformers"

    def __post_init__(self):
        self.model_name = ""  # make_judge names the checkpoint
        self.tokens_used = [0, 0]  # prompt and completion tokens of every judgment so far
        self.requests_made = 0  # judgments so far: one attempt each, as judge_scores.attempts says

    def complete(self, conversations: list[list[dict]]) -> list[str]:
        return [c.text or "" for c in self.complete_detailed(conversations)]

    def complete_detailed(self, conversations: list[list[dict]]) -> list[Completion]:
        """One Completion per conversation, its tokens counted here: the rendered prompt (with the score prefix;
        a prefix shared by several rubrics counts for each, as a served judge would bill it) and the tokens
        written ('expected_score' writes none: it reads one position's probabilities)."""
        if not conversations:
            return []
        start = time.perf_counter()
        prompts = [render_prompt(self.engine.tokenizer, msgs)[1] for msgs in conversations]
        if self.mode == "expected_score":
            context, _ = self._score_tokens()
            texts, read, written = self._expected_scores(prompts), [len(p) + len(context) for p in prompts], None
        else:
            prefix = SCORE_PREFIX if self.prefill else ""
            prefix_ids = self.engine.tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
            params = SamplingParams(n=1, temperature=0.0, max_new_tokens=self.max_new_tokens, stop=("}",))
            gens = self.engine.generate([p + prefix_ids for p in prompts], params, desc="judge")
            texts = [prefix + g.text for g in gens]
            read, written = [len(p) + len(prefix_ids) for p in prompts], [len(g.token_ids) for g in gens]
        written = written or [0] * len(prompts)
        self.tokens_used = [self.tokens_used[0] + sum(read), self.tokens_used[1] + sum(written)]
        self.requests_made += len(conversations)
        share = (time.perf_counter() - start) / len(conversations)
        return [
            Completion(text, None, share, 1, False, self.model_name or self.name, prompt_hash(c), n_in, n_out)
            for text, c, n_in, n_out in zip(texts, conversations, read, written, strict=True)
        ]

    def _score_tokens(self) -> tuple[list[int], list[int]]:
        """Context tokens to append and the token id of each digit after them (tokenizer-agnostic)."""
        tok = self.engine.tokenizer
        base = tok(SCORE_PREFIX, add_special_tokens=False)["input_ids"]
        tails = []
        for digit in "012":
            ids = tok(SCORE_PREFIX + " " + digit, add_special_tokens=False)["input_ids"]
            if ids[: len(base)] != base:
                raise ConfigError("judge tokenizer merges the score prefix with the digit; use judge.mode 'json'")
            tails.append(ids[len(base) :])
        if all(len(t) == 1 for t in tails):
            return base, [t[0] for t in tails]
        if all(len(t) == 2 and t[0] == tails[0][0] for t in tails):
            return base + [tails[0][0]], [t[1] for t in tails]
        raise ConfigError(
            f"digits 0/1/2 are not single tokens for this judge tokenizer ({tails}): judge.mode 'expected_score' "
            "reads their probabilities at one position; use judge.mode 'json'"
        )

    def _expected_scores(self, prompts: list[list[int]]) -> list[str]:
        context, digits = self._score_tokens()
        full = [p + context for p in prompts]
        bar = progress_bar(len(full), "judge", "pair")
        if self.share_prefix:
            probs = self._digit_probs_shared_prefix(full, digits, bar)
        else:
            probs = self._digit_probs_batched(full, digits, bar)
        bar.close()
        return [_expected_json(p) for p in probs]

    def _digit_probs_batched(self, prompts: list[list[int]], digits: list[int], bar) -> list[list[float]]:
        import torch

        model, pad = self.engine.model, self.engine.tokenizer.pad_token_id
        order = self.engine.batch_order(prompts)
        out: list[list[float]] = [[] for _ in prompts]
        for start in range(0, len(order), self.engine.batch_size):
            rows = order[start : start + self.engine.batch_size]
            ids, attention = (t.to(model.device) for t in left_padded([prompts[i] for i in rows], pad))
            with torch.no_grad(), autocast(self.engine.precision, model.device):
                logits = model(input_ids=ids, attention_mask=attention).logits[:, -1].float()
            for i, p in zip(rows, torch.softmax(logits[:, digits], dim=-1).tolist()):
                out[i] = p
            bar.update(len(rows))
        return out

    def _digit_probs_shared_prefix(self, prompts: list[list[int]], digits: list[int], bar) -> list[list[float]]:
        """The rubrics of one response share everything up to the criterion: read that prefix once, then
        score every rubric's suffix against a copy of its KV cache (right-padded, last real token read)."""
        import torch

        model, pad = self.engine.model, self.engine.tokenizer.pad_token_id
        out: list[list[float]] = [[] for _ in prompts]
        for group in prefix_groups(prompts):
            members = [prompts[i] for i in group]
            shared = common_prefix_length(members) - 1  # every suffix keeps at least one token
            for start in range(0, len(group), self.engine.batch_size):
                rows = group[start : start + self.engine.batch_size]
                suffixes = [prompts[i][shared:] for i in rows]
                width = max(map(len, suffixes))
                ids = torch.full((len(rows), width), pad, dtype=torch.long)
                attention = torch.zeros((len(rows), shared + width), dtype=torch.long)
                attention[:, :shared] = 1
                for row, suffix in enumerate(suffixes):
                    ids[row, : len(suffix)] = torch.tensor(suffix)
                    attention[row, shared : shared + len(suffix)] = 1
                ids, attention = ids.to(model.device), attention.to(model.device)
                with torch.no_grad(), autocast(self.engine.precision, model.device):
                    prefix = torch.tensor([members[0][:shared]], device=model.device)
                    cache = model(input_ids=prefix, use_cache=True).past_key_values
                    cache.batch_repeat_interleave(len(rows))
                    positions = (
                        torch.arange(shared, shared + width, device=model.device).unsqueeze(0).expand(len(rows), -1)
                    )
                    logits = model(
                        input_ids=ids,
                        attention_mask=attention,
                        position_ids=positions,
                        past_key_values=cache,
                        use_cache=True,
                    ).logits.float()
                last = torch.tensor([len(s) - 1 for s in suffixes], device=model.device)
                picked = logits[torch.arange(len(rows), device=model.device), last][:, digits]
                for i, p in zip(rows, torch.softmax(picked, dim=-1).tolist()):
                    out[i] = p
                bar.update(len(rows))
        return out


def _expected_json(p: list[float]) -> str:
    import json

    expected = 2 * (0.5 * p[1] + 1.0 * p[2])  # on the judge's 0-2 scale
    return json.dumps({"score": round(expected, 4), "p": [round(x, 4) for x in p]})


def common_prefix_length(sequences: list[list[int]]) -> int:
    first = sequences[0]
    n = min(map(len, sequences))
    for k in range(n):
        if any(seq[k] != first[k] for seq in sequences[1:]):
            return k
    return n


def prefix_groups(prompts: list[list[int]], min_shared: float = 0.5) -> list[list[int]]:
    """Consecutive prompts that share at least `min_shared` of their tokens with the group's first one."""
    groups: list[list[int]] = []
    for i, p in enumerate(prompts):
        if groups:
            head = prompts[groups[-1][0]]
            if common_prefix_length([head, p]) >= min_shared * len(p):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def make_transformers_judge(
    model_path: str, judge: JudgeConfig, dtype: str = "float32", precision: str = "fp32"
) -> TransformersJudge:
    from refiner_core.models import load_model, load_tokenizer

    engine = HFRolloutEngine(
        load_model(model_path, dtype), load_tokenizer(model_path), batch_size=judge.batch_size, precision=precision
    )
    return TransformersJudge(
        engine,
        judge.max_new_tokens,
        mode=judge.mode,
        prefill=judge.prefill,
        share_prefix=judge.share_prefix,
        name=f"transformers:{judge.mode}",
    )
