"""One rank of the 'deepspeed' learner: `python -m torch.distributed.run ... -m refiner_core.learners.deepspeed_worker
WORK_DIR` (or DeepSpeed's `deepspeed --module` launcher with a hostfile). Reads WORK_DIR/launch.json, loads the
policy, reference and optimizer state once, then serves jobs WORK_DIR/job_0001, job_0002, ... in order, each
taken when its `ready` file appears: 'train' (one train step with the torch learner's own loop on this rank's
share of the micro-batches; metrics from rank 0), 'save' (HF checkpoint + DeepSpeed optimizer state), 'export'
(HF weights only, for a rollout engine), 'export_adapter' (the LoRA adapter alone, for an engine that applies it)
and 'stop'. Rank 0 marks each finished job `done` after every rank did it. With model.lora_rank the ranks train
PEFT adapters on the base, and the reference is the policy with its adapters off.

Launched by refiner_core.learners.deepspeed_learner; not meant to be run by hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

from refiner_core.learners.base import LearnerSettings, TrainSample
from refiner_core.learners.deepspeed_learner import PROGRESS, bf16_mode, record_rank
from refiner_core.learners.lora import save_lora
from refiner_core.learners.torch_learner import TorchLearner, load_learner_models
from refiner_core.models import release_gpu_cache
from refiner_core.runtime.heap import freeze_heap
from refiner_core.runtime.progress import listening

STATE_DIR = "deepspeed"  # DeepSpeed's save_checkpoint folder inside an HF checkpoint
STATE_TAG = "state"
STATE_INFO = "refiner.json"  # {"world_size": ..., "zero_stage": ...} of the run that wrote the state
SHARED_MEMORY_OP = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME


def ds_config(settings: LearnerSettings, zero_stage: int, offload_optimizer: bool, bf16: bool) -> dict:
    """DeepSpeed config for one GRPO update: AdamW from torch (no compiled op), gradient clipping by DeepSpeed,
    and unmanaged gradient accumulation: backward() only accumulates, each step() is one optimizer step, so the
    variable number of micro-batches per optimizer step is the learner's business, as in the torch learner."""
    zero: dict = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    clipped_by_deepspeed = settings.max_grad_norm > 0 and not steps_torch_optimizer(zero_stage, bf16)
    return {
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": settings.max_grad_norm if clipped_by_deepspeed else 0.0,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": settings.learning_rate,
                "betas": list(settings.adam_betas),
                "eps": 1e-8,
                "weight_decay": settings.weight_decay,
                "torch_adam": True,
            },
        },
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def steps_torch_optimizer(zero_stage: int, bf16: bool) -> bool:
    """Whether DeepSpeed steps torch's AdamW itself (ZeRO stage 0 outside its bf16 mode): its clipping then keeps no
    norm (get_global_grad_norm() is None), so the ranks clip themselves (ClipBeforeStep)."""
    return zero_stage == 0 and not bf16


class ClipBeforeStep:
    """Clips the gradients as the torch learner does, in a hook that runs when DeepSpeed steps torch's AdamW, after
    its all-reduce (every rank holds the averaged gradients), and keeps the norm before clipping. A non-finite norm
    skips the step as the torch learner does: AdamW passes over parameters without a gradient."""

    def __init__(self, engine, max_grad_norm: float):
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
        self.norm = float("nan")
        engine.optimizer.register_step_pre_hook(self._clip)

    def _clip(self, optimizer, args, kwargs) -> None:
        grads = [p for p in self.params if p.grad is not None]
        self.norm = float(torch.nn.utils.clip_grad_norm_(grads, self.max_norm))
        if not math.isfinite(self.norm):
            for p in grads:
                p.grad = None


def _zero_weight(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of a micro-batch that contributes nothing: every aggregation weight is a multiple of the mask."""
    out = dict(batch)
    out["mask"] = torch.zeros_like(batch["mask"])
    out["sequences"] = torch.tensor(0)
    out["real_tokens"] = torch.tensor(0)
    return out


class DeepSpeedRankLearner(TorchLearner):
    """The torch learner's train step on one rank: this rank's share of every optimizer step's micro-batches,
    DeepSpeed's backward/step, totals summed over ranks. The aggregation normalisers are computed by the torch
    learner over the whole optimizer step; DeepSpeed averages gradients over ranks, so each rank's loss is
    scaled by the world size and the update equals the one-process one."""

    def __init__(
        self,
        engine,
        reference,
        pad_id: int,
        settings: LearnerSettings,
        rank: int,
        world: int,
        clipping: ClipBeforeStep | None = None,
    ):
        self.engine, self.policy, self.reference, self.pad_id, self.s = engine, engine, reference, pad_id, settings
        self.rank, self.world, self.clipping = rank, world, clipping
        self.local_batches = 0
        self.padding_tokens = 0  # positions computed for zero-weight copies: not the torch learner's work
        self.engine.train()

    def _local_layout(self, layout):
        # ZeRO-3 gathers parameters collectively in every forward and backward: all ranks must run the same
        # number of passes, so a short share is padded with zero-weight copies.
        local = []
        for step in layout:
            mine = step[self.rank :: self.world]
            self.local_batches += len(mine)
            need = math.ceil(len(step) / self.world)
            pads = [_zero_weight(step[0]) for _ in range(need - len(mine))]
            self.padding_tokens += sum(int(b["computed_tokens"]) for b in pads)
            mine = mine + pads
            local.append(mine)
        return local

    def _set_learning_rate(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def _zero_grad(self) -> None:
        pass  # the engine zeroes its (partitioned) gradients after every step()

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss * self.world, scale_wrt_gas=False)

    def _optimizer_step(self) -> float:
        self.engine.step()  # ZeRO's and the bf16 optimizer skip a step whose norm is not finite and report inf
        return self.clipping.norm if self.clipping is not None else float(self.engine.get_global_grad_norm())

    def _hand_back_memory(self) -> None:
        release_gpu_cache()  # a rank is its own process: a rollout engine on its GPU can take only what it hands back

    def _reduce(self, totals: dict) -> dict:
        import torch.distributed as dist

        totals = {**totals, "computed_tokens": totals["computed_tokens"] - self.padding_tokens}
        keys = sorted(totals)
        # on the engine's device: an NCCL group (GPU) has no backend for CPU tensors; gloo (CPU) takes CPU ones
        t = torch.tensor([float(totals[k]) for k in keys], dtype=torch.float64, device=self.engine.device)
        self.rank_totals = dict(totals)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))


def _progress_file(path: Path):
    """A progress listener that writes the micro-batches rank 0 has done to `path`: the learner's process moves its
    own bar by it, so the run's stall watchdog sees ranks that stopped moving."""

    def tell(bar) -> None:
        if bar.label == "update":
            scratch = path.with_suffix(".tmp")
            scratch.write_text(str(int(bar.done)))
            scratch.replace(path)

    return tell


def _log(rank: int, world: int, msg: str) -> None:
    print(f"[deepspeed rank {rank}/{world}] {msg}", file=sys.stderr, flush=True)


def save_checkpoint(engine, zero_stage: int, save_path: Path, rank: int, world: int, settings: LearnerSettings) -> None:
    """HF weights (ZeRO-3 partitions gathered; with LoRA the adapter, and the merged weights when
    lora_save_merged) + DeepSpeed's own optimizer-state folder for resume."""
    import torch.distributed as dist

    export_weights(engine, zero_stage, save_path, rank, settings, merged=settings.lora_save_merged)
    dist.barrier()
    engine.save_checkpoint(str(save_path / STATE_DIR), tag=STATE_TAG)
    if rank == 0:
        (save_path / STATE_DIR / STATE_INFO).write_text(json.dumps({"world_size": world, "zero_stage": zero_stage}))
    dist.barrier()


def export_weights(
    engine, zero_stage: int, path: Path, rank: int, settings: LearnerSettings, merged: bool = True
) -> None:
    """The HF weights alone (ZeRO-3 partitions gathered on every rank, written by rank 0); with LoRA, the adapter
    and, when `merged`, base + adapters merged."""
    state = engine._zero3_consolidated_16bit_state_dict() if zero_stage == 3 else engine.module.state_dict()
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        if settings.lora_rank:
            save_lora(engine.module, path, merged=merged, state=state)
        else:
            engine.module.save_pretrained(path, state_dict=state)


def export_adapter(engine, zero_stage: int, path: Path, rank: int) -> None:
    """The LoRA adapter alone: only its parameters are gathered (megabytes, where the model is gigabytes)."""
    import deepspeed

    adapters = [p for name, p in engine.module.named_parameters() if ".lora_" in name]
    gathered = deepspeed.zero.GatheredParameters(adapters) if zero_stage == 3 else nullcontext()
    with gathered:
        if rank == 0:
            engine.module.save_pretrained(str(path))


class WeightSender:
    """This rank's part in sending the weights to a vLLM engine (refiner_core.runtime.weight_transfer): every rank
    gathers each bucket of ZeRO-3 parameters (a collective); a rank whose GPU the engine uses packs it in the
    engine's dtype and offers CUDA IPC handles, merged on rank 0, or rank 0 broadcasts it over NCCL (whole, or
    as a delta against what it sent last). Rank 0 writes each bucket's update_info to the job folder and waits
    for the flow process's acknowledgement: the engine has loaded it, its buffer can go."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.group = None  # rank 0's NCCL communicator with the engine's workers
        self.sent: dict[str, torch.Tensor] = {}  # delta: the tensors last sent, as the engine holds them

    def init(self, init: dict) -> None:
        """Rank 0 opens the NCCL group the engine joins (vLLM's nccl_common.trainer_init, in 0.26 and 0.32)."""
        if self.rank == 0:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            self.group = trainer_init({k: init[k] for k in ("master_address", "master_port", "world_size")})
        self.sent = {}

    def send(self, engine, zero_stage: int, job_dir: Path, job: dict) -> None:
        import deepspeed
        import torch.distributed as dist

        from refiner_core.runtime import weight_transfer as wt

        dtype = wt.torch_dtype(job["dtype"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        params = list(engine.module.named_parameters())
        shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in params}
        # the output layer's alias goes with the embeddings; in place (deltas) the engine's tied layer is the same
        aliases = {} if job["transport"] == "delta" else wt.output_alias(shapes, job["tied"])
        local_gpu = torch.cuda.current_device()
        packs = self.rank == 0 or (job["transport"] == "ipc" and local_gpu < job["engine_gpus"])
        sizes = [math.prod(shapes[name]) * itemsize for name, _ in params]
        for number, bucket in enumerate(wt.plan_buckets(sizes, job["bucket_bytes"]), 1):
            names = [params[i][0] for i in bucket]
            members = [params[i][1] for i in bucket]
            gathered = deepspeed.zero.GatheredParameters(members) if zero_stage == 3 else nullcontext()
            with gathered:  # the full parameters exist on every rank only inside this block
                buffer, views = wt.pack([p.data for p in members], dtype) if packs else (None, [])
            torch.cuda.synchronize()
            for alias, source in aliases.items():
                if source in names and packs:
                    names, views = [*names, alias], [*views, views[names.index(source)]]
            info = self._offer(job, names, views, shapes) if packs else None
            if job["transport"] == "ipc" and self.world > 1:
                offered = [None] * self.world
                dist.all_gather_object(offered, info["handles"] if info else None)
                if self.rank == 0:
                    info = wt.ipc_update_info(names, views, wt.merge_handles(offered))
            elif info is not None and job["transport"] == "ipc":
                info = wt.ipc_update_info(names, views, info["handles"])
            if self.rank == 0:
                _offer_bucket(job_dir, number, info, self._broadcast if job["transport"] != "ipc" else None)
            if self.world > 1:
                dist.barrier()  # the engine holds the bucket: every rank frees its buffer
            del buffer, views
        torch.cuda.ipc_collect()

    def _offer(self, job: dict, names: list[str], views: list, shapes: dict) -> dict | None:
        """This rank's part of a bucket's update_info: IPC handles, or (rank 0) what NCCL will broadcast."""
        from refiner_core.runtime import weight_transfer as wt

        if job["transport"] == "ipc":
            return {"handles": wt.ipc_handles(views)}
        if job["transport"] == "nccl":
            self._pending = list(views)
            return wt.update_info(names, views)
        patches = {}
        for name, view in zip(names, views):
            old = self.sent.get(name)
            patches[name] = wt.sparse_patch(old, view) if job["delta"] and old is not None else wt.full_patch(view)
            self.sent[name] = view.clone()
        if not wt.sparse_patches_use_checkpoint_names():  # vLLM 0.26 indexes its fused runtime parameters
            patches, shapes = wt.runtime_patches(patches, shapes), wt.runtime_shapes(shapes)
        self._pending = [t for indices, values in patches.values() for t in (indices, values)]
        return wt.sparse_update_info(patches, shapes)

    def _broadcast(self) -> None:
        stream = torch.cuda.current_stream()
        for tensor in self._pending:
            self.group.broadcast(tensor, src=0, stream=stream)
        torch.cuda.synchronize()
        self._pending = []


def _offer_bucket(job_dir: Path, number: int, info: dict, broadcast=None, poll: float = 0.001) -> None:
    """Rank 0: write the bucket's update_info for the flow process (which hands it to the engine), broadcast its
    tensors when the transport is NCCL (the engine receives while the flow process's update_weights waits), then
    wait until the flow process acknowledges that the engine loaded it."""
    offered = job_dir / f"bucket_{number:04d}.json"
    partial = offered.with_suffix(".part")
    partial.write_text(json.dumps(info))
    partial.rename(offered)  # whole or not at all
    if broadcast is not None:
        broadcast()
    _wait_for(offered.with_suffix(".ack"), poll)


def try_resume(engine, state_dir: str, zero_stage: int, world: int, lr: float, rank: int) -> int:
    """Load the previous step's optimizer state when it exists and was written by the same layout; returns
    the Adam step count found (0 = fresh)."""
    info = Path(state_dir) / STATE_INFO if state_dir else None
    if not info or not info.exists():
        if rank == 0 and state_dir:
            _log(rank, world, f"WARNING: no DeepSpeed optimizer state in {state_dir}; starting a fresh AdamW")
        return 0
    saved = json.loads(info.read_text())
    if saved != {"world_size": world, "zero_stage": zero_stage}:
        if rank == 0:
            _log(
                rank,
                world,
                f"WARNING: optimizer state in {state_dir} was written with {saved}, this run has "
                f"world_size {world}, zero_stage {zero_stage}; starting a fresh AdamW",
            )
        return 0
    engine.load_checkpoint(state_dir, tag=STATE_TAG, load_optimizer_states=True, load_lr_scheduler_states=False)
    for group in engine.optimizer.param_groups:  # the recipe's lr wins over the saved one
        group["lr"] = lr
    return adam_steps(engine)


def adam_steps(engine) -> int:
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = [int(torch.as_tensor(st["step"]).item()) for st in opt.state.values() if "step" in st]
    return max(steps, default=0)


def _wait_for(path: Path, poll: float = 0.01) -> None:
    while not path.exists():
        time.sleep(poll)


def main(work_dir: str) -> None:
    work_dir = Path(work_dir)
    record_rank(work_dir, int(os.environ["RANK"]))
    launch = json.loads((work_dir / "launch.json").read_text())
    on_gpu = launch["device"] == "cuda"
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(launch["threads"])
    import deepspeed
    import torch.distributed as dist

    # DeepSpeed's ZeRO-3 calls collectives torch has renamed: one warning per call, to the run's terminal
    warnings.filterwarnings(
        "ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning
    )

    if on_gpu:  # before the process group: NCCL binds each rank's communicator to its current device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        # DeepSpeed's CPU backend compiles a shared-memory all-reduce when its process group opens (1-2 min on two
        # cores, again in every new environment) that only inference_all_reduce calls; training's collectives use
        # gloo. Marked incompatible, it is not built (DeepSpeed's own fallback where the op cannot be).
        deepspeed.ops.__compatible_ops__[SHARED_MEMORY_OP] = False
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.time()
    settings = LearnerSettings(**{**launch["settings"], "adam_betas": tuple(launch["settings"]["adam_betas"])})
    policy, reference = load_learner_models(
        launch["policy_path"], launch["reference_path"], launch["dtype"], settings, device="cpu"
    )
    if on_gpu:
        policy.to("cuda")
        reference = reference.to("cuda") if reference is not None else None
    bf16 = bf16_mode(launch["device"], settings.precision)
    config = ds_config(settings, launch["zero_stage"], launch["offload_optimizer"], bf16=bf16)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=trainable, config=config)
    clipping = None
    if steps_torch_optimizer(launch["zero_stage"], bf16):
        clipping = ClipBeforeStep(engine, settings.max_grad_norm)
    resumed = try_resume(engine, launch["resume_dir"], launch["zero_stage"], world, settings.learning_rate, rank)
    freeze_heap()  # the engine and the libraries live as long as the rank: out of every full collection
    if rank == 0:
        (work_dir / "ready.json").write_text(json.dumps({"start_seconds": time.time() - t0, "adam_steps": resumed}))
    sender = WeightSender(rank, world)
    number = 0
    while True:
        number += 1
        job_dir = work_dir / f"job_{number:04d}"
        _wait_for(job_dir / "ready")
        job = json.loads((job_dir / "job.json").read_text())
        if job["kind"] == "stop":
            break
        if job["kind"] == "train":  # the step empties the cache
            lr, bonus = job["learning_rate"], job["entropy_coef"]
            _train(job_dir, lr, bonus, engine, reference, launch, settings, resumed, rank, world, clipping)
        elif job["kind"] == "sequence_kl":  # every rank scores every sample: ZeRO-3 gathers in each forward
            samples = [TrainSample(**x) for x in json.loads((job_dir / "samples.json").read_text())]
            kl = DeepSpeedRankLearner(engine, reference, launch["pad_id"], settings, rank, world).sequence_kl(samples)
            if rank == 0:
                (job_dir / "sequence_kl.json").write_text(json.dumps([dataclasses.asdict(k) for k in kl]))
        elif job["kind"] == "save":
            save_checkpoint(engine, launch["zero_stage"], Path(job["path"]), rank, world, settings)
        elif job["kind"] == "export":
            export_weights(engine, launch["zero_stage"], Path(job["path"]), rank, settings)
        elif job["kind"] == "export_adapter":
            export_adapter(engine, launch["zero_stage"], Path(job["path"]), rank)
        elif job["kind"] == "transfer_init":
            sender.init(job["init"])
        elif job["kind"] == "send_weights":
            sender.send(engine, launch["zero_stage"], job_dir, job)
        else:
            raise ValueError(f"unknown job kind {job['kind']!r} in {job_dir}")
        dist.barrier()
        if rank == 0:
            (job_dir / "done").touch()
    dist.barrier()
    dist.destroy_process_group()


def _train(
    job_dir: Path,
    learning_rate: float | None,
    entropy_coef: float | None,
    engine,
    reference,
    launch: dict,
    settings: LearnerSettings,
    resumed: int,
    rank: int,
    world: int,
    clipping: ClipBeforeStep | None,
) -> None:
    t0 = time.time()
    samples = [TrainSample(**s) for s in json.loads((job_dir / "samples.json").read_text())]
    learner = DeepSpeedRankLearner(engine, reference, launch["pad_id"], settings, rank, world, clipping)
    with listening(_progress_file(job_dir / PROGRESS) if rank == 0 else lambda bar: None):
        metrics = learner.train_step(samples, learning_rate, entropy_coef)
    steps_after = adam_steps(engine)
    rank_stats = {
        "rank": rank,
        "world_size": world,
        "micro_batches": learner.local_batches,
        "tokens": learner.rank_totals["tokens"],
        "loss": learner.rank_totals["loss"],
        "adam_steps_resumed": resumed,
        "adam_steps": steps_after,
        "threads": torch.get_num_threads(),
    }
    _log(
        rank,
        world,
        f"trained {learner.local_batches} micro-batches, {rank_stats['tokens']:.0f} response tokens, "
        f"loss share {rank_stats['loss']:.6f}, Adam step {steps_after}",
    )
    (job_dir / f"rank{rank}.json").write_text(json.dumps(rank_stats))
    if rank == 0:
        metrics["update_seconds"] = time.time() - t0
        (job_dir / "metrics.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    main(sys.argv[-1])
