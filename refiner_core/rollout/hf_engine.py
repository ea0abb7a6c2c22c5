"""The 'hf' rollout engine: transformers `generate` on CPU or one GPU."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

from refiner_core.config import EngineSettings
from refiner_core.learners.logprobs import autocast
from refiner_core.models import Adapter, adapter_weights, release_gpu_cache, use_sdpa_variant
from refiner_core.rollout.base import (
    Generation,
    SamplingParams,
    first_stop,
    free_bytes,
    left_padded,
    request_seed,
    stop_token_ids,
)
from refiner_core.runtime.progress import progress_bar

# transformers' SDPA attention, except where one query token attends under CPU bf16 autocast (every decode step):
# torch's bf16 kernel for a single query is several times slower on CPUs than its fp32 one (SmolLM2's shape, 16
# left-padded sequences of 520 tokens: 4.7 against 0.6 ms a layer), so that step runs in fp32 on the same
# bf16-rounded inputs (bench/hf_decode.py). Passes over more than one query token and GPUs are left as they were.
CPU_DECODE_ATTENTION = "sdpa_cpu_decode_fp32"


def _sdpa_cpu_decode_fp32(module, query, key, value, attention_mask, **kwargs):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = kwargs.get("dropout", 0.0) == 0.0 and kwargs.get("position_bias") is None
    if query.shape[2] != 1 or query.device.type != "cpu" or not torch.is_autocast_enabled("cpu") or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    low = torch.get_autocast_dtype("cpu")
    query, key, value = (t.to(low).float() for t in (query, key, value))  # what the bf16 kernel would read
    groups = getattr(module, "num_key_value_groups", 1)
    with torch.autocast("cpu", enabled=False):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=groups > 1
        )
    return out.transpose(1, 2).contiguous().to(low), None


def use_cpu_decode_attention(model) -> None:
    """Switch a CPU model on transformers' SDPA attention to the variant above (a no-op elsewhere)."""
    if model.device.type == "cpu":
        use_sdpa_variant(model, CPU_DECODE_ATTENTION, _sdpa_cpu_decode_fp32)


@contextlib.contextmanager
def cached_weight_casts(model, precision: str):
    """Within it, CPU bf16 autocast casts each frozen fp32 weight to bf16 once per autocast context instead of at
    every decode step: autocast keeps a cast only for leaf tensors that require grad, so the frozen ones are marked
    so for the call (under no_grad nothing records a graph) and unmarked after. Bit-identical; 1.10x on the
    main job's rollout shape (bench/hf_decode.py). Costs a bf16 copy of the weights while a batch generates (half their
    fp32 bytes), so it stays off GPUs, where it was not measured."""
    import torch

    device = next(model.parameters()).device
    frozen = []
    if precision == "bf16" and device.type == "cpu":
        frozen = [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32]
    for param in frozen:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for param in frozen:
            param.requires_grad_(False)


class RepetitionPenalty:
    """A logits processor: the logit of every token already in the sequence (prompt and response so far) divided
    by `penalty` where positive, multiplied where negative, as transformers' `repetition_penalty` and vLLM's. Unlike
    transformers' own, the left padding of a batch is not counted: a row's penalties do not depend on the rows
    batched with it (the pad token may be the end-of-sequence token)."""

    def __init__(self, penalty: float, attention):
        self.penalty = penalty
        self.pads = (attention == 0).sum(1, keepdim=True)  # left padding per row

    def __call__(self, input_ids, scores):
        import torch

        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        # a padded position stands for the row's first real token: already counted, it adds nothing
        ids = torch.where(positions < self.pads, input_ids.gather(1, self.pads), input_ids)
        seen = scores.gather(1, ids)
        return scores.scatter(1, ids, torch.where(seen < 0, seen * self.penalty, seen / self.penalty))


def sampling_processors(params: SamplingParams, attention) -> list:
    """The logits processors of a request in the order vLLM's sampler applies them: the repetition penalty, the
    temperature, min_p, then top_k and top_p on what is left (transformers' own warpers run top_p before min_p:
    another distribution where both are set). Greedy requests take the penalty alone."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    processors: list = []
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenalty(params.repetition_penalty, attention))
    if params.temperature <= 0:
        return processors
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.min_p > 0:
        processors.append(MinPLogitsWarper(params.min_p))
    if params.top_k > 0:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    return processors


def response_stop_strings(stop: tuple[str, ...], start: int, decode):
    """A stopping criterion: a row stops once its response's text (from column `start`, decoded as `first_stop`
    decodes it, special tokens skipped) holds a stop string, where vLLM stops and `first_stop` cuts. transformers'
    own stop strings also match inside a special token and across the prompt's end, where `first_stop` finds none,
    and the padding generate put after such a stop was kept as sampled tokens. Only the last tokens are decoded at
    each step: a stop string can only have been completed by the newest one."""
    import torch
    from transformers import StoppingCriteria

    window = 2 * max(len(s) for s in stop) + 4  # tokens: at least one character each but special ones

    class ResponseStopStrings(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            tails = input_ids[:, max(start, input_ids.shape[1] - window) :].tolist()
            found = [any(s in decode(tail) for s in stop) for tail in tails]
            return torch.tensor(found, dtype=torch.bool, device=input_ids.device)

    return ResponseStopStrings()


# generate samples from torch's process-wide generator: one sampled batch at a time in the process, or a rollout
# sampled ahead on another thread (grpo.async_steps) would draw from the stream another one seeded
_SAMPLING = threading.Lock()


@contextlib.contextmanager
def _seeded(params: SamplingParams, start: int):
    """The process's generator seeded for one sampled batch, held while it samples. One seed per batch, from its
    first sample's place in the step (prompt_offset: where this call's prompts start): reruns of a step, and of a
    part of it, reproduce its samples. Step seeds are consecutive, so a later batch's seed is mixed (seed + place
    would be another step's first batch's seed). Greedy batches draw nothing and neither seed nor wait."""
    import torch

    place = params.prompt_offset * params.n + start
    with _SAMPLING:
        torch.manual_seed(params.seed if place == 0 else request_seed(params.seed, place))
        yield


@dataclass
class HFRolloutEngine:
    """transformers `generate`, left-padded batches; log-probs come from the processed (tempered) scores."""

    model: object
    tokenizer: object
    batch_size: int = 16
    sort_by_length: bool = True
    precision: str = "fp32"  # 'bf16': generate under bfloat16 autocast; log-probs still from fp32 scores
    cache_weight_casts: bool = True  # see cached_weight_casts; False: cast at every step (the bench's baseline)
    name: str = "hf"
    eos_ids: set[int] = field(default_factory=set)
    weights_hash: str = ""

    def __post_init__(self) -> None:
        from transformers import GenerationConfig

        own = self.model.generation_config
        ids = own.eos_token_id if isinstance(own.eos_token_id, list) else [own.eos_token_id]
        self.eos_ids = stop_token_ids(self.tokenizer, ids)
        # Only the token ids: `generate` fills every setting it is not passed from the model's generation config,
        # so one that generation_config.json ships (Qwen2.5-Instruct's repetition_penalty 1.05,
        # no_repeat_ngram_size) would shape every sample behind SamplingParams' back, and the log-probs trained on.
        self.model.generation_config = GenerationConfig(
            bos_token_id=own.bos_token_id, eos_token_id=sorted(self.eos_ids), pad_token_id=own.pad_token_id
        )
        use_cpu_decode_attention(self.model)

    def generate(self, prompts: list[list[int]], params: SamplingParams, desc: str = "") -> list[Generation]:
        import torch

        jobs = [(p, s) for p in self.batch_order(prompts) for s in range(params.n)]
        context = getattr(self.model.config, "max_position_embeddings", None)
        out: list[Generation] = []
        pad = self.tokenizer.pad_token_id
        bar = progress_bar(len(jobs), desc or "rollout", "seq")
        self.model.eval()
        for start in range(0, len(jobs), self.batch_size):
            chunk = jobs[start : start + self.batch_size]
            input_ids, attention = (t.to(self.model.device) for t in left_padded([prompts[p] for p, _ in chunk], pad))
            sample = params.temperature > 0
            casts = (
                cached_weight_casts(self.model, self.precision) if self.cache_weight_casts else contextlib.nullcontext()
            )
            with (
                _seeded(params, start) if sample else contextlib.nullcontext(),
                torch.no_grad(),
                casts,
                autocast(self.precision, self.model.device),
            ):
                result = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention,
                    do_sample=sample,
                    # transformers' own warpers are off (they run min_p after top_p): ours run in vLLM's order
                    temperature=1.0 if sample else None,
                    top_p=1.0 if sample else None,
                    top_k=0 if sample else None,  # transformers' default would be 50
                    logits_processor=sampling_processors(params, attention) or None,
                    max_new_tokens=params.max_new_tokens,
                    stopping_criteria=[response_stop_strings(params.stop, input_ids.shape[1], self._decode)]
                    if params.stop
                    else None,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=pad,
                )
            new_tokens = result.sequences[:, input_ids.shape[1] :]
            logprobs = torch.stack(
                [
                    torch.log_softmax(s.float(), -1).gather(-1, new_tokens[:, t : t + 1]).squeeze(-1)
                    for t, s in enumerate(result.scores)
                ],
                dim=1,
            )
            for row, (p, s) in enumerate(chunk):
                ids = new_tokens[row].tolist()
                keep, stopped = first_stop(ids, self.eos_ids, params.stop, self._decode)
                if context is not None and len(prompts[p]) + keep > context:  # as vLLM: a response ends there
                    keep, stopped = max(context - len(prompts[p]), 0), False
                ids = ids[:keep]
                out.append(
                    Generation(
                        prompt_index=p,
                        sample_idx=s,
                        token_ids=ids,
                        logprobs=logprobs[row, :keep].tolist(),
                        text=self._decode(ids),
                        finish_reason="stop" if stopped else "length",
                    )
                )
            bar.update(len(chunk))
        bar.close()
        return sorted(out, key=lambda g: (g.prompt_index, g.sample_idx))

    def load_weights(self, weights) -> None:
        """Copy new weights into the model in place (same names as its state dict). A checkpoint leaves out tied
        tensors (the output layer sharing the embeddings); any other missing or extra name is an error."""
        import torch

        if isinstance(weights, Adapter):  # no LoRA kernels here: base and adapter merged
            weights = adapter_weights(weights, str(next(self.model.parameters()).dtype).removeprefix("torch."))
        state = weights.state_dict() if hasattr(weights, "state_dict") else weights
        with torch.no_grad():
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        own = self.model.state_dict()
        loaded = {own[name].data_ptr() for name in own if name in state}
        untied = [name for name in missing if own[name].data_ptr() not in loaded]
        if untied or unexpected:
            raise ValueError(
                f"hf engine: weights do not fit the model: missing {untied[:3]}, unexpected {unexpected[:3]}"
            )

    def memory_bytes(self) -> tuple[int, int]:
        # tied weights (an output layer sharing the embedding) are one tensor under two names: counted once
        tensors = {t.data_ptr(): t.numel() * t.element_size() for t in self.model.state_dict().values()}
        return sum(tensors.values()), free_bytes(self.model.device.type)

    def close(self) -> None:
        """Drop the model; on a GPU its memory goes back to the device (the learner or a vLLM engine needs it)."""
        self.model = None
        release_gpu_cache()

    sleep_level = 0  # no sleep mode: kept or closed by memory alone

    def sleep(self) -> None:
        pass

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        pass

    def batch_order(self, prompts: list[list[int]]) -> list[int]:
        """Longest prompts first: batches then hold similar lengths, so little compute goes to padding."""
        if not self.sort_by_length:
            return list(range(len(prompts)))
        return sorted(range(len(prompts)), key=lambda p: -len(prompts[p]))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def make_hf_engine(
    model_path: str, settings: EngineSettings, dtype: str = "float32", precision: str = "fp32"
) -> HFRolloutEngine:
    """One device, memory as the model needs: the parallelism, GPU-memory, sleep and weight-transfer settings do
    not apply (new weights are copied into its parameters), and LoRA adapters are merged into the weights
    (adapter_rank does not apply)."""
    from refiner_core.models import load_model, load_tokenizer

    return HFRolloutEngine(
        load_model(model_path, dtype), load_tokenizer(model_path), batch_size=settings.batch_size, precision=precision
    )
