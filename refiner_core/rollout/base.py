"""The rollout interface: batched sampling that keeps token ids, sampled-token log-probs and finish reasons.

An engine maps token-id prompts to Generations. Backends register in ENGINES by "module:factory" string, so
only the chosen one is imported: 'hf' (transformers generate) runs anywhere.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

from refiner_core.config import EngineSettings
from refiner_core.runtime.registry import resolve


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int = 0
    # Index of the first prompt in the whole step: an engine sampling a shard of the step (rollout.num_engines)
    # seeds each prompt as one engine sampling the whole step would.
    prompt_offset: int = 0


def request_seed(seed: int, place: int) -> int:
    """A well-mixed 31-bit seed per (step seed, place in the step): prompts never share samples, reruns reproduce
    them."""
    digest = hashlib.blake2b(f"{seed}:{place}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 2**16)  # room for vLLM's seed + sample_idx


def part_ranges(prompts: int, per_part: int) -> list[tuple[int, int]]:
    """[start, end) of each part of a step's prompts, `per_part` prompts each (the last may hold fewer)."""
    per_part = max(1, per_part)
    return [(start, min(start + per_part, prompts)) for start in range(0, prompts, per_part)]


@dataclass
class Generation:
    prompt_index: int
    sample_idx: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # 'stop' | 'length'


class RolloutEngine(Protocol):
    name: str
    weights_hash: str  # content hash of the checkpoint whose weights it holds ('' = unknown)

    def generate(self, prompts: list[list[int]], params: SamplingParams, desc: str = "") -> list[Generation]: ...

    def load_weights(self, weights) -> None:
        """Replace the weights in place: a state dict with the checkpoint's tensor names, or a model."""

    def memory_bytes(self) -> tuple[int, int]:
        """(bytes the engine holds, bytes still free on its device)."""

    def close(self) -> None:
        """Free the engine's memory before the next stage needs it."""

    # Sleep mode: an engine with sleep_level > 0 frees its device memory between rollouts instead of being closed
    # (refiner_core.runtime.live_engines). Engines that cannot sleep have sleep_level 0, and both methods do nothing.
    sleep_level: int  # 0: cannot sleep; 1: its weights wait in host memory; 2: they are dropped

    def sleep(self) -> None:
        """Free the device memory the engine holds (KV cache; weights as sleep_level says) until `wake_up`."""

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Take the memory back: ('weights',) first when new weights are about to be loaded, then ('kv_cache',);
        None for everything."""


def free_bytes(device_type: str) -> int:
    """Memory still available on a device: the GPU's free memory plus the blocks this process's PyTorch holds cached
    but unused (its own models take them; another process's engine gets them from release_gpu_cache, which runs
    before one is built or woken), or the machine's available RAM."""
    if device_type == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    import psutil

    return psutil.virtual_memory().available


def stop_token_ids(tokenizer, checkpoint_eos: list[int | None]) -> set[int]:
    """The tokens a sample ends at: the checkpoint's EOS ids, the tokenizer's, and the special token the chat
    template ends an assistant turn with. Prompts are rendered with the template, so an answer ends there even where
    the checkpoint's EOS is another token (a base model's `<|endoftext|>` under ChatML's `<|im_end|>`), which
    would leave every sample running on into a turn of its own making, to the token limit."""
    return {i for i in [*checkpoint_eos, tokenizer.eos_token_id, chat_turn_end_id(tokenizer)] if i is not None}


def chat_turn_end_id(tokenizer) -> int | None:
    """The special token right after an assistant turn's text in the tokenizer's chat template, or None (no
    template, or plain text there)."""
    from jinja2 import TemplateError

    marker = "Fin de la réponse"
    conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except (TemplateError, ValueError):  # no template, or one that refuses this conversation
        return None
    if not isinstance(text, str) or marker not in text:
        return None
    after = tokenizer(text[text.rindex(marker) + len(marker) :], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {
        i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special
    }
    return after[0] if after and after[0] in special else None


def first_stop(token_ids: list[int], eos_ids: set[int], stop: tuple[str, ...], decode) -> tuple[int, bool]:
    """Length to keep and whether a stop condition was met: the shortest prefix whose text contains a stop string
    (found by bisection: containment is monotone in the prefix), else the first EOS (kept). The stop string is
    looked for first because transformers' generate fills a row it stopped at one with the pad token, which is an
    EOS id for SmolLM2 and Qwen3: an EOS after a stop string was never sampled."""
    eos_at = next((i for i, t in enumerate(token_ids) if t in eos_ids), None)
    head = token_ids if eos_at is None else token_ids[:eos_at]
    if stop and any(s in decode(head) for s in stop):
        lo, hi = 1, len(head)
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(head[:mid]) for s in stop):
                hi = mid
            else:
                lo = mid + 1
        return lo, True
    if eos_at is not None:
        return eos_at + 1, True
    return len(token_ids), False


def left_padded(sequences: list[list[int]], pad_id: int):
    """[B, max_len] input ids and attention mask, left-padded so every row's next token is at the last column."""
    import torch

    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq)
        attention[row, width - len(seq) :] = 1
    return ids, attention


ENGINES: dict[str, str] = {
    "hf": "refiner_core.rollout.hf_engine:make_hf_engine",
    "vllm": "refiner_core.rollout.vllm_engine:make_vllm_engine",
}


def make_engine(
    model_path: str, settings: EngineSettings, dtype: str = "float32", precision: str = "fp32"
) -> RolloutEngine:
    """The engine `settings.engine` over a checkpoint folder. Every factory (ENGINES, or an import path) takes
    these four: the GPU settings (memory share, sleep level, how weights arrive) matter to engines that manage GPU
    memory, and adapter_rank (LoRA adapters of up to that rank taken as adapters) to engines with LoRA kernels."""
    return resolve(ENGINES, "rollout engine", settings.engine)(model_path, settings, dtype, precision)
