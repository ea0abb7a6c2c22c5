"""The TRL side of bench/grpo_vs_trl.py: TRL's GRPOTrainer on CPU, one JSON line per optimizer step.

    /tmp/venv-trl/bin/python bench/peer_trl_grpo.py --model DIR --prompts prompts.json [--steps 5] [--threads 2]

Runs in its own venv (trl, transformers, accelerate; not the project's). prompts.json is a list of prompt strings
already rendered by the chat template; each step takes 4 of them x 8 samples x 64 new tokens, beta = 0, bf16=True
unless --fp32 (bench/grpo_vs_trl.py passes it where the CPU lacks native bf16: emulated bf16 is far slower).
Prints {"side": "trl", "step": k, "seconds": s, "cpu_seconds": c, "completion_tokens": n} per step; the step runs from
on_step_begin to on_step_end, so it holds generation, reward, the loss forward/backward and the optimizer step.
Named peer_*, not trl*: a script named trl*.py would shadow the trl package.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

WORD = re.compile(r"[A-Za-z0-9]+")


def reward_text(text: str) -> float:
    """Cheap reward shared by both sides: words in the completion, capped at 30, scaled to [0, 1]."""
    return min(len(WORD.findall(text)), 30) / 30.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="HF checkpoint folder")
    parser.add_argument("--prompts", required=True, help="JSON file: list of rendered prompt strings")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output-dir", default="/tmp/peer-trl-grpo-out")
    parser.add_argument("--fp32", action="store_true", help="bf16=False (for CPUs without AVX-512 BF16 or AMX)")
    parser.add_argument(
        "--grad-ckpt",
        action="store_true",
        help="keep TRL's default gradient checkpointing (off here: "
        "it recomputes activations, slower, and 135M params need no memory saving)",
    )
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    prompts = json.load(open(args.prompts))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    batch = args.prompts_per_step * args.generations
    wanted = dict(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=not args.fp32,
        fp16=False,
        beta=0.0,
        num_generations=args.generations,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        generation_batch_size=batch,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=5e-6,
        lr_scheduler_type="constant",
        warmup_ratio=0.0,
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        use_vllm=False,
        save_strategy="no",
        num_iterations=1,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
        log_completions=False,
        remove_unused_columns=False,
        gradient_checkpointing=args.grad_ckpt,
    )
    known = set(GRPOConfig.__dataclass_fields__)
    dropped = sorted(k for k in wanted if k not in known)
    config = GRPOConfig(**{k: v for k, v in wanted.items() if k in known})
    print(
        json.dumps(
            {
                "side": "trl",
                "info": f"trl {trl.__version__}, transformers {transformers.__version__}, "
                f"torch {torch.__version__} (CPU {torch.backends.cpu.get_cpu_capability()}), "
                f"threads {torch.get_num_threads()}, bf16 {config.bf16}, "
                f"gradient_checkpointing {config.gradient_checkpointing}",
                "dropped_config_keys": dropped,
            }
        ),
        flush=True,
    )

    def reward(prompts, completions, **kwargs):
        return [reward_text(c if isinstance(c, str) else c[-1]["content"]) for c in completions]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0 = self.c0 = 0.0
            self.seconds, self.cpu = {}, {}

        def on_step_begin(self, args_, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args_, state, control, **kw):
            self.seconds[state.global_step] = time.perf_counter() - self.t0
            self.cpu[state.global_step] = time.process_time() - self.c0

        def on_log(self, args_, state, control, logs=None, **kw):
            step = state.global_step
            if step not in self.seconds or logs is None or "completions/mean_length" not in logs:
                return
            print(
                json.dumps(
                    {
                        "side": "trl",
                        "step": step,
                        "seconds": round(self.seconds[step], 3),
                        "cpu_seconds": round(self.cpu[step], 3),
                        "completion_tokens": round(logs["completions/mean_length"] * batch),
                        "reward_mean": logs.get("reward"),
                    }
                ),
                flush=True,
            )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    trainer.train()


if __name__ == "__main__":
    sys.exit(main())
