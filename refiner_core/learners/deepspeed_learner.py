"""The 'deepspeed' learner: ZeRO (stage 3 by default) over `world_size` ranks, from one CPU process (gloo) to N
GPUs (nccl, bf16), with the torch learner's own loss loop on every rank.

Each train_step writes the samples and settings to a job folder and launches the ranks as a subprocess
(torch's launcher on one machine, DeepSpeed's launcher with a hostfile), so the stage process never holds a
process group. The ranks train, then write the HF checkpoint and DeepSpeed's optimizer state in the same
launch; save() moves that checkpoint into place. The next step resumes the optimizer from
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
import weakref
from pathlib import Path

from refiner_core.learners.base import LearnerSettings, TrainSample
from refiner_core.procs import die_with_parent

WORKER = "refiner_core.learners.deepspeed_worker"
STATE_DIR = "deepspeed"  # as deepspeed_worker.STATE_DIR (not imported here: that module imports torch+deepspeed)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_command(settings: LearnerSettings, job_dir: Path, port: int) -> list[str]:
    if settings.hostfile:
        return ["deepspeed", "--hostfile", settings.hostfile, "--master_port", str(port), "--module", WORKER,
                str(job_dir)]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
            str(settings.world_size), "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", WORKER,
            str(job_dir)]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class DeepSpeedLearner:
    def __init__(self, policy_path, reference_path, pad_id: int, settings: LearnerSettings, state_dir: Path | None,
                 dtype: str = "float32"):
        import torch

        if settings.world_size < 1 or settings.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"deepspeed learner: world_size must be >= 1 and zero_stage 0-3, got "
                             f"{settings.world_size} and {settings.zero_stage}")
        self.policy_path, self.reference_path = Path(policy_path), reference_path
        self.pad_id, self.s = pad_id, settings
        self.state_dir, self.dtype = state_dir, dtype
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.work = Path(tempfile.mkdtemp(prefix="refiner-deepspeed-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.work), True)
        self.out: Path | None = None  # the checkpoint the last launch wrote
        self.rank_stats: list[dict] = []
        self.launch_seconds = 0.0
        self._steps = 0

    def _job(self, samples: list[TrainSample], job_dir: Path, out: Path) -> None:
        job_dir.mkdir(parents=True)
        resume = self.out / STATE_DIR if self.out is not None else self.state_dir
        job = {
            "policy_path": str(self.out or self.policy_path), "reference_path": str(self.reference_path),
            "pad_id": self.pad_id, "dtype": self.dtype,
            "settings": {k: getattr(self.s, k) for k in LearnerSettings.__dataclass_fields__},
            "zero_stage": self.s.zero_stage, "offload_optimizer": self.s.deepspeed_offload_optimizer,
            "resume_dir": str(resume) if resume is not None and Path(resume).exists() else "",
            "save_path": str(out), "device": self.device,
            "threads": max(1, _cores() // self.s.world_size),
        }
        torch_state = Path(self.state_dir).parent / "optimizer.pt" if self.state_dir is not None else None
        if not job["resume_dir"] and torch_state is not None and torch_state.exists():
            print(f"WARNING: {Path(self.state_dir).parent} holds a torch learner's optimizer.pt, which the deepspeed "
                  "learner cannot read; starting a fresh AdamW", file=sys.stderr)
        (job_dir / "job.json").write_text(json.dumps(job, indent=1))
        (job_dir / "samples.json").write_text(json.dumps([dataclasses.asdict(x) for x in samples]))

    def _env(self) -> dict:
        from refiner_core.models import refiner_home

        env = dict(os.environ)
        if self.device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
            env["OMP_NUM_THREADS"] = str(max(1, _cores() // self.s.world_size))
        env.setdefault("TORCH_EXTENSIONS_DIR", str(refiner_home() / "torch_extensions"))
        env.setdefault("DS_BUILD_OPS", "0")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _run(self, job_dir: Path) -> None:
        """Launch the ranks; their output goes to the terminal and to JOB/launch.log. A non-zero exit raises with
        the log's tail; an interrupted stage kills the launcher's whole process group."""
        cmd = launcher_command(self.s, job_dir, free_port())
        log_path = job_dir / "launch.log"
        tail: collections.deque[str] = collections.deque(maxlen=60)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self._env(),
                                    start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))

            def pump():
                for line in proc.stdout:
                    log.write(line)
                    tail.append(line)
                    sys.stderr.write(line)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                rc = proc.wait()
            except BaseException:
                _kill_group(proc)
                raise
            finally:
                reader.join(timeout=10)
        if rc != 0:
            raise RuntimeError(f"deepspeed learner: launcher exited with {rc}: {' '.join(cmd)}\n"
                               f"--- last lines of {log_path} ---\n{''.join(tail)}")

    def train_step(self, samples: list[TrainSample]) -> dict:
        t0 = time.time()
        self._steps += 1
        job_dir = self.work / f"job_{self._steps:03d}"
        out = self.work / f"checkpoint_{self._steps:03d}"
        self._job(samples, job_dir, out)
        self._run(job_dir)
        metrics = json.loads((job_dir / "metrics.json").read_text())
        self.rank_stats = [json.loads((job_dir / f"rank{r}.json").read_text())
                           for r in range(self.s.world_size) if (job_dir / f"rank{r}.json").exists()]
        if self.out is not None:
            shutil.rmtree(self.out, ignore_errors=True)
        self.out = out
        self.launch_seconds = time.time() - t0
        metrics["update_seconds"] = self.launch_seconds  # the whole launch: process start, load, train, save
        return metrics

    def save(self, path: Path) -> None:
        """The checkpoint the last train_step wrote (HF weights + `deepspeed/` optimizer state); with no step
        yet, the policy unchanged (and its optimizer state, if any)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        source = self.out if self.out is not None else self.policy_path
        for item in source.iterdir():
            if self.out is None and item.name not in (STATE_DIR,) and not _is_model_file(item.name):
                continue
            target = path / item.name
            if target.is_dir():
                shutil.rmtree(target)
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, target)


def _is_model_file(name: str) -> bool:
    return name.endswith((".safetensors", ".bin")) or name in (
        "config.json", "generation_config.json", "model.safetensors.index.json")


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def make_deepspeed_learner(policy_path, reference_path, tokenizer, settings, optimizer_state, dtype="float32"):
    """`optimizer_state` names the policy checkpoint's training state (`<ckpt>/optimizer.pt` for the torch
    learner); this learner keeps DeepSpeed's state folder beside it, `<ckpt>/deepspeed/`."""
    state_dir = Path(optimizer_state).with_name(STATE_DIR) if optimizer_state is not None else None
    return DeepSpeedLearner(policy_path, reference_path, tokenizer.pad_token_id, settings, state_dir, dtype)
