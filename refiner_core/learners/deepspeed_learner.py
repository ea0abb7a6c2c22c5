"""The 'deepspeed' learner: ZeRO (stage 3 by default) over `world_size` ranks, from one CPU process (gloo) to N
GPUs (nccl, bf16), with the torch learner's own loss loop on every rank.

The ranks are launched once (torch's launcher on one machine, DeepSpeed's launcher with a hostfile) and stay up:
they load policy, reference and the optimizer state when they start, then take jobs, one folder each, in order:
train on a step's samples, save an HF checkpoint with DeepSpeed's optimizer state, export the weights (to shared
memory where there is /dev/shm) for a rollout engine, stop. The stage process never holds a process group. A run
that keeps its engines (run.keep_engines) keeps the ranks for all its steps, so the optimizer state never leaves
memory between saves; otherwise the stage closes them after its one step. A new launch resumes the optimizer from
`<policy checkpoint>/deepspeed/` when it was written with the same world size and ZeRO stage.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path

from refiner_core.learners.base import LearnerSettings, SequenceKL, TrainSample
from refiner_core.learners.lora import AdapterExports
from refiner_core.models import Adapter, checkpoint_weights
from refiner_core.runtime.procs import (
    PROCS_DIR_ENV,
    forget_child,
    free_port,
    is_running,
    process_identity,
    record_child,
    spawn,
    stop_group,
)
from refiner_core.runtime.progress import progress_bar
from refiner_core.runtime.scratch import ram_dir

WORKER = "refiner_core.learners.deepspeed_worker"
STATE_DIR = "deepspeed"  # as deepspeed_worker.STATE_DIR (not imported here: that module imports torch+deepspeed)
POLL_SECONDS = 0.01  # how often a waiting side looks for the other's file: small next to any job
PROGRESS = "progress"  # in a train job's folder: the micro-batches rank 0 has done
RANKS = "ranks"  # in the work folder: one record per rank process ({pid, identity, host}), written as it starts


def _follow(bar, path: Path) -> None:
    """Move `bar` to the count rank 0 last wrote to `path` (absent or mid-write: no move)."""
    try:
        done = int(path.read_text())
    except (OSError, ValueError):
        return
    if done > bar.done:
        bar.update(done - bar.done)


class LearnerDied(RuntimeError):
    """The ranks exited or were stopped: their optimizer state is gone, the learner cannot be used again."""


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """(host, slots) per line of a DeepSpeed hostfile (`host slots=N`; '#' starts a comment)."""
    hosts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.split("#")[0].split()
        if not words:
            continue
        slots = [w.removeprefix("slots=") for w in words[1:] if w.startswith("slots=")]
        if len(words) != 2 or len(slots) != 1 or not slots[0].isdigit() or int(slots[0]) < 1:
            raise ValueError(f"{path}:{number}: expected 'HOST slots=N', got {line.strip()!r}")
        hosts.append((words[0], int(slots[0])))
    if not hosts:
        raise ValueError(f"{path}: the hostfile names no host")
    return hosts


def launch_hosts(hostfile: str, world_size: int) -> list[tuple[str, int]]:
    """(host, slots) the ranks are launched on: the hostfile's, whose slots must add up to `world_size`, or this
    machine's. Raises OSError for a hostfile that cannot be read, ValueError for one that does not fit."""
    if not hostfile:
        return [("127.0.0.1", world_size)]
    hosts = read_hostfile(hostfile)
    if sum(slots for _, slots in hosts) != world_size:
        raise ValueError(
            f"{hostfile} has {sum(s for _, s in hosts)} slots over {len(hosts)} host(s); "
            f"grpo.deepspeed.world_size is {world_size}: set them equal"
        )
    return hosts


def bf16_mode(device: str, precision: str) -> bool:
    """Whether the ranks run DeepSpeed's bf16 mode (on GPUs under model.precision 'bf16'), whose optimizer keeps
    fp32 master weights whatever model.dtype is; outside it only ZeRO stages 1-3 keep fp32 copies, and stage 0
    steps the weights in model.dtype."""
    return device == "cuda" and precision == "bf16"


def launcher_command(
    settings: LearnerSettings, work_dir: Path, port: int | None = None, node_rank: int = 0
) -> list[str]:
    """The command that starts the ranks (of host `node_rank` when the run does not reach the hosts over ssh).
    `port`: the rendezvous port on the first host of a hostfile. On one machine torchrun's standalone rendezvous
    binds a free port itself and the ranks share its store: no port found free here and bound a moment later,
    which another process could take in between."""
    if not settings.hostfile:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--local-addr",
            "127.0.0.1",
            "--nproc_per_node",
            str(settings.world_size),
            "-m",
            WORKER,
            str(work_dir),
        ]
    hosts = read_hostfile(settings.hostfile)
    # DeepSpeed's launcher, from this interpreter (no PATH lookup); one host, or hosts this run does not reach
    # over ssh, start their own ranks (--no_ssh --node_rank K), the first host being the rendezvous
    per_host = (
        ["--no_ssh", "--node_rank", str(node_rank), "--master_addr", hosts[0][0]]
        if len(hosts) == 1 or not settings.launch_over_ssh
        else []
    )
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        settings.hostfile,
        *per_host,
        "--master_port",
        str(port),
        "--module",
        WORKER,
        str(work_dir),
    ]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class DeepSpeedLearner:
    def __init__(
        self,
        policy_path,
        reference_path,
        pad_id: int,
        settings: LearnerSettings,
        state_dir: Path | None,
        dtype: str = "float32",
    ):
        import torch

        if settings.world_size < 1 or settings.zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"deepspeed learner: world_size must be >= 1 and zero_stage 0-3, got "
                f"{settings.world_size} and {settings.zero_stage}"
            )
        self.hosts = launch_hosts(settings.hostfile, settings.world_size)
        self.policy_path, self.reference_path = Path(policy_path), reference_path
        self.pad_id, self.s = pad_id, settings
        self.state_dir, self.dtype = state_dir, dtype
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if settings.work_root:
            Path(settings.work_root).mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="refiner-deepspeed-", dir=settings.work_root or None))
        self.other_hosts: list[list[str]] = []  # commands each other host runs (launch_over_ssh false)
        # rank 0 may run on another host (a hostfile): then the weights it exports go to the shared work root
        self.export = Path(
            tempfile.mkdtemp(prefix="refiner-weights-", dir=settings.work_root if settings.hostfile else ram_dir())
        )
        self.exports: AdapterExports | None = None  # LoRA adapters exported for engines (adapter())
        self.rank_stats: list[dict] = []
        self.start_seconds = 0.0  # launch to ready: process start, model load, DeepSpeed init, optimizer resume
        self.updates = 0  # train steps since launch
        self._jobs = 0
        self._exported_at = -1  # `updates` when the weights in self.export were written
        self._sent: str | None = None  # the weights last sent to an engine over vLLM's weight transfer
        self._group = ""  # the NCCL group rank 0 holds with an engine's workers (one at a time); '' none
        self._proc = None
        self._dead = ""  # why the ranks are gone, once they are
        self._tail: collections.deque[str] = collections.deque(maxlen=60)
        self._cleanup = weakref.finalize(self, _shut_down, None, str(self.work), str(self.export))

    # ---- the ranks' life ----

    def _launch_job(self) -> dict:
        resume = self.state_dir if self.state_dir is not None and Path(self.state_dir).exists() else None
        torch_state = Path(self.state_dir).parent / "optimizer.pt" if self.state_dir is not None else None
        if resume is None and torch_state is not None and torch_state.exists():
            print(
                f"WARNING: {Path(self.state_dir).parent} holds a torch learner's optimizer.pt, which the deepspeed "
                "learner cannot read; starting a fresh AdamW",
                file=sys.stderr,
            )
        return {
            "policy_path": str(self.policy_path),
            "reference_path": str(self.reference_path),
            "pad_id": self.pad_id,
            "dtype": self.dtype,
            "settings": {k: getattr(self.s, k) for k in LearnerSettings.__dataclass_fields__},
            "zero_stage": self.s.zero_stage,
            "offload_optimizer": self.s.deepspeed_offload_optimizer,
            "resume_dir": str(resume or ""),
            "device": self.device,
            "threads": self._threads(),
        }

    def _threads(self) -> int:
        return max(1, _cores() // max(slots for _, slots in self.hosts))  # this host's cores over its ranks

    def _env(self) -> dict:
        from refiner_core.models import refiner_home

        env = dict(os.environ)
        if self.device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
            env["OMP_NUM_THREADS"] = str(self._threads())
        env.setdefault("TORCH_EXTENSIONS_DIR", str(refiner_home() / "torch_extensions"))
        env.setdefault("DS_BUILD_OPS", "0")
        env["PYTHONUNBUFFERED"] = "1"
        if not self.s.hostfile:  # torch elastic's folders go with the work folder (on a shared disk with a hostfile)
            env["TMPDIR"] = str(self.work)
        return env

    def start(self) -> None:
        """Launch the ranks (the first train step does when nobody did); their output goes to the terminal and to
        WORK/launch.log. They end with this process (parent-death signal) and are recorded in the run folder's
        process list."""
        if self._dead:
            raise LearnerDied(self._dead)
        if self._proc is not None:
            return
        (self.work / "launch.json").write_text(json.dumps(self._launch_job(), indent=1))
        port = free_port() if self.s.hostfile else None
        cmd = launcher_command(self.s, self.work, port)
        if len(self.hosts) > 1 and not self.s.launch_over_ssh:
            self.other_hosts = [launcher_command(self.s, self.work, port, rank) for rank in range(1, len(self.hosts))]
            for (host, _), other in zip(self.hosts[1:], self.other_hosts):
                print(
                    f"deepspeed learner: start the ranks of {host} there with (DS_ACCELERATOR=cpu on CPUs): "
                    f"{' '.join(other)}",
                    file=sys.stderr,
                )
        log = open(self.work / "launch.log", "w")
        self._proc = spawn(
            cmd,
            death_signal=signal.SIGTERM,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self._env(),
        )
        self._cleanup.detach()
        self._cleanup = weakref.finalize(self, _shut_down, self._proc, str(self.work), str(self.export))
        self._cmd = cmd

        def pump(proc=self._proc, tail=self._tail):
            with log:
                for line in proc.stdout:
                    log.write(line)
                    tail.append(line)
                    sys.stderr.write(line)

        threading.Thread(target=pump, daemon=True).start()

    def _call(
        self,
        kind: str,
        samples: list[TrainSample] | None = None,
        serve: Callable[[dict], None] | None = None,
        meanwhile: Callable[[], None] | None = None,
        **payload,
    ) -> Path:
        """Hand the ranks one job and wait until every rank has done it; returns the job's folder. `meanwhile` runs
        once the job is posted (a call that needs the ranks at the same time); `serve` takes each bucket rank 0
        offers (bucket_NNNN.json), acknowledged once it returns (bucket_NNNN.ack)."""
        started = self._proc is None
        self.start()
        job_dir = self._post(kind, samples, payload)
        served = 0
        # a train job's bar moves with rank 0's micro-batches: the run's stall watchdog sees ranks that stopped
        bar = progress_bar(None, "update", "mb") if kind == "train" else None
        try:
            if meanwhile is not None:
                meanwhile()
            while not (job_dir / "done").exists():
                if bar is not None:
                    _follow(bar, job_dir / PROGRESS)
                offered = job_dir / f"bucket_{served + 1:04d}.json"
                if serve is not None and offered.exists():
                    serve(json.loads(offered.read_text()))
                    served += 1
                    offered.with_suffix(".ack").touch()
                    continue
                if self._proc.poll() is not None:
                    self._died(
                        f"deepspeed learner: the ranks exited with {self._proc.returncode} during a "
                        f"{kind!r} job: {' '.join(self._cmd)}\n--- last lines of {self.work / 'launch.log'} "
                        f"---\n{''.join(self._tail)}"
                    )
                time.sleep(POLL_SECONDS)
        except BaseException as e:  # interrupted or failed mid-job: the ranks' state is no longer known
            if not isinstance(e, LearnerDied):
                self._died(
                    f"deepspeed learner: a {kind!r} job was interrupted ({type(e).__name__}); the ranks were stopped",
                    raise_=False,
                )
            raise
        finally:
            if bar is not None:
                bar.close()
        if started:
            if os.environ.get(PROCS_DIR_ENV):  # the next run on the folder stops any that outlive a killed run
                cmd = [sys.executable, "-m", WORKER, str(self.work)]
                for rank in local_ranks(self.work):
                    record_child(os.environ[PROCS_DIR_ENV], rank["pid"], cmd, group=rank["group"])
            ready = json.loads((self.work / "ready.json").read_text())
            self.start_seconds = ready["start_seconds"]
            print(
                f"deepspeed learner: {self.s.world_size} rank(s) up in {self.start_seconds:.1f} s "
                f"(kept until the run ends when it keeps its engines)",
                file=sys.stderr,
            )
        return job_dir

    def _post(self, kind: str, samples: list[TrainSample] | None, payload: dict) -> Path:
        self._jobs += 1
        job_dir = self.work / f"job_{self._jobs:04d}"
        job_dir.mkdir()
        if samples is not None:
            (job_dir / "samples.json").write_text(json.dumps([dataclasses.asdict(x) for x in samples]))
        (job_dir / "job.json").write_text(json.dumps({"kind": kind, **payload}))
        (job_dir / "ready").touch()  # last: a rank reads the job only once this exists
        return job_dir

    @property
    def alive(self) -> bool:
        """False once its ranks are gone (a job failed, they were killed, or it was closed): of no use to a retry."""
        return not self._dead

    def _died(self, why: str, raise_: bool = True) -> None:
        self._dead = why
        self.close()
        if raise_:
            raise LearnerDied(why)

    def close(self) -> None:
        """Stop the ranks (a 'stop' job, then SIGTERM/SIGKILL to what is left) and delete the job folders."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None and not self._dead:
            self._post("stop", None, {})
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass  # stopped by signal below
        self._dead = self._dead or "deepspeed learner: closed"
        self._cleanup()
        if self.exports is not None:
            self.exports.close()

    # ---- the learner interface ----

    def train_step(
        self, samples: list[TrainSample], learning_rate: float | None = None, entropy_coef: float | None = None
    ) -> dict:
        t0 = time.perf_counter()
        job_dir = self._call("train", samples, learning_rate=learning_rate, entropy_coef=entropy_coef)
        self.updates += 1
        metrics = json.loads((job_dir / "metrics.json").read_text())
        self.rank_stats = [
            json.loads((job_dir / f"rank{r}.json").read_text())
            for r in range(self.s.world_size)
            if (job_dir / f"rank{r}.json").exists()
        ]
        metrics["update_seconds"] = time.perf_counter() - t0  # with the ranks' start-up on their first step
        return metrics

    def sequence_kl(self, samples: list[TrainSample]) -> list[SequenceKL]:
        """TorchLearner.sequence_kl on the ranks (each scores every sample)."""
        job_dir = self._call("sequence_kl", samples)
        return [SequenceKL(**k) for k in json.loads((job_dir / "sequence_kl.json").read_text())]

    def save(self, path: Path) -> None:
        """HF weights and tokenizer-free config + DeepSpeed's optimizer state (`deepspeed/`), written by the ranks."""
        Path(path).mkdir(parents=True, exist_ok=True)
        self._call("save", path=str(Path(path).resolve()))

    def weights(self) -> dict:
        """The ranks' current weights (HF names), exported once per update through shared memory."""
        if self._exported_at != self.updates:
            shutil.rmtree(self.export, ignore_errors=True)
            self._call("export", path=str(self.export))
            self._exported_at = self.updates
        return checkpoint_weights(self.export)

    @property
    def sends_weights(self) -> bool:
        """Whether the ranks send their weights to a vLLM engine themselves (GPU, full weights; a LoRA learner
        hands over its adapter or merged weights instead)."""
        return self.device == "cuda" and not self.s.lora_rank

    def send_weights(self, engine, holding: str | None = None, sending: str = "") -> None:
        """Stream the ranks' current weights into a vLLM engine built for vLLM's weight transfer
        (refiner_core.runtime.weight_transfer): ZeRO-3 parameters gathered a bucket at a time and packed in the
        engine's dtype, handed over by CUDA IPC (a handle from each rank on an engine GPU) or broadcast by rank 0
        over NCCL, whole or as a delta. Nothing is written and no state dict reaches this process. `holding`
        names the weights the engine holds: a delta is sent only against the weights these ranks sent it last
        (`sending` names them), else every element goes."""
        from refiner_core.runtime import weight_transfer as wt

        # A group is rank 0's and one engine's: an engine that joined another learner's (this one's ranks were
        # relaunched) or that this learner left for another engine's joins a new one.
        if engine.transport in ("nccl", "delta") and (not self._group or engine.transfer_group != self._group):
            init = wt.nccl_init_info(self.hosts[0][0], free_port(), engine.workers)
            group = uuid.uuid4().hex
            self._group = ""
            self._call("transfer_init", init=init, meanwhile=lambda: engine.init_transfer(init, group))
            self._group = group
            self._sent = None  # a new group: whatever the engine holds, it did not get it from this one
        delta = engine.transport == "delta" and holding is not None and holding == self._sent
        engine.start_update()
        self._call(
            "send_weights",
            serve=engine.apply_update,
            transport=engine.transport,
            dtype=wt.dtype_name(engine.dtype),
            bucket_bytes=engine.bucket_bytes,
            tied=engine.tied,
            engine_gpus=engine.workers,
            delta=delta,
        )
        engine.finish_update()
        self._sent = sending

    def adapter(self) -> Adapter:
        """The ranks' current LoRA adapter, exported for a rollout engine that applies it to the base."""
        if self.exports is None:
            self.exports = AdapterExports(
                str(Path(self.reference_path).resolve()),
                self.s.lora_rank,
                root=self.s.work_root if self.s.hostfile else None,
            )
        self._call("export_adapter", path=str(self.exports.next_folder()))
        return self.exports.adapter()


def record_rank(work_dir: Path, rank: int) -> None:
    """A rank's own record of its process, for the learner that stops it (called by the rank as it starts)."""
    folder = Path(work_dir) / RANKS
    folder.mkdir(exist_ok=True)
    pid = os.getpid()
    entry = {
        "pid": pid,
        "identity": process_identity(pid),
        "host": socket.gethostname(),
        "group": os.getpgid(0) == pid,  # torch elastic starts each rank in a session of its own; others do not
    }
    (folder / f"{rank}.tmp").write_text(json.dumps(entry))
    os.replace(folder / f"{rank}.tmp", folder / f"{rank}.json")


def local_ranks(work_dir: Path) -> list[dict]:
    """The records of the ranks on this host that have started."""
    entries = []
    for path in sorted((Path(work_dir) / RANKS).glob("*.json")):
        entry = json.loads(path.read_text())
        if entry["host"] == socket.gethostname():
            entries.append(entry)
    return entries


def _shut_down(proc, work: str, export: str) -> None:
    """The learner's end however it comes (closed, collected, the process exiting): no rank and no folder left.
    The ranks run in sessions of their own (torch elastic starts them so), outside the launcher's group: one that
    outlived the launcher's own stopping of them (it ignored or never got SIGTERM; a stopped process only holds
    it) is stopped by its record."""
    if proc is not None:
        if proc.poll() is None:
            stop_group(proc.pid, group=True)
        forget_child(proc.pid)
    for rank in local_ranks(work):  # read once the launcher is stopped: no rank records itself after it
        if is_running(rank["pid"], rank["identity"]):
            stop_group(rank["pid"], group=rank["group"], grace=2.0)
        forget_child(rank["pid"])
    for folder in (work, export):
        shutil.rmtree(folder, ignore_errors=True)


def make_deepspeed_learner(policy_path, reference_path, tokenizer, settings, optimizer_state, dtype="float32"):
    """`optimizer_state` names the policy checkpoint's training state (`<ckpt>/optimizer.pt` for the torch
    learner); this learner keeps DeepSpeed's state folder beside it, `<ckpt>/deepspeed/`."""
    state_dir = Path(optimizer_state).with_name(STATE_DIR) if optimizer_state is not None else None
    return DeepSpeedLearner(policy_path, reference_path, tokenizer.pad_token_id, settings, state_dir, dtype)
