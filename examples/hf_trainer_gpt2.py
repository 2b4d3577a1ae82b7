"""GPT-2-medium causal-LM training with Hugging Face's Trainer, on um_alloc three ways:

    python examples/hf_trainer_gpt2.py --budget 12GiB                       # the callback, explicitly
    python -m um_alloc run --budget 12GiB examples/hf_trainer_gpt2.py       # the launcher, no um_alloc call
    python examples/hf_trainer_gpt2.py                                      # PyTorch's own allocator
    python -m um_alloc run --budget 12GiB examples/hf_trainer_gpt2.py --gradient-checkpointing

The model is built from GPT-2-medium's config (no weights are downloaded) and the data is random
tokens, so the run needs no network. --tiny builds a two-layer model for tests (runs on the CPU
with --cpu). The last line of stdout is one JSON object: losses, median step time, samples/s,
and the GPU memory NVML saw in use at the end beyond the start (the high-water mark: the driver
keeps pages once used), and with --budget the callback's plan. Needs transformers and accelerate.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SIZES = {"medium": dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024),
         "tiny": dict(n_embd=64, n_layer=2, n_head=2, n_positions=128, vocab_size=1000)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", help="um_alloc's UMAllocCallback with this GPU budget (e.g. 12GiB)")
    p.add_argument("--policy", help="the callback's policy (default: planner.yaml with --budget)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="Trainer's own per-layer checkpointing")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the median step time")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--tiny", action="store_true", help="a two-layer model (tests)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU (with --tiny, for tests)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the result here")
    return p.parse_args(argv)


def used_gpu_bytes() -> int | None:
    from um_alloc.device_info import device_memory  # NVML: does not start CUDA

    memory = device_memory(0)
    return None if memory is None else memory.used_bytes


class StepTimes:
    """The time of each optimizer step, end to end (Trainer logs every step, which synchronises)."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self
        self.ends: list[float] = []

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                outer.ends.append(time.perf_counter())

        self.callback = Callback()

    def each(self) -> list[float]:
        """Each step's time but the first's, end to end."""
        return [b - a for a, b in zip(self.ends, self.ends[1:])]

    def median(self, warmup: int) -> float | None:
        steps = self.each()[max(warmup - 1, 0):]
        return statistics.median(steps) if steps else None


def dataset(args, vocab_size: int) -> list[dict]:
    generator = torch.Generator().manual_seed(args.seed)
    samples = args.steps * args.batch_size
    ids = torch.randint(0, vocab_size, (samples, args.seq_len), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def checkpointing(training_arguments, args) -> dict:
    """Trainer's own checkpointing switch, under the name this transformers gives it: transformers 5
    calls gradient_checkpointing activation_checkpointing, and warns at the old name."""
    fields = getattr(training_arguments, "__dataclass_fields__", {})
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: args.gradient_checkpointing}


def main(argv=None) -> dict:
    args = parse_args(argv)
    used_before = used_gpu_bytes()
    callbacks = []
    if args.budget or args.policy:  # first: TrainingArguments picks the device, which starts CUDA
        from um_alloc.integrations.huggingface import UMAllocCallback

        callbacks.append(UMAllocCallback(budget=args.budget, policy=args.policy))
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    config = GPT2Config(resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
                        **SIZES["tiny" if args.tiny else "medium"])
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    timer = StepTimes()
    training = TrainingArguments(
        output_dir="/tmp/hf_trainer_gpt2", per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        learning_rate=1e-4, bf16=not args.cpu, use_cpu=args.cpu, **checkpointing(TrainingArguments, args),
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=args.seed, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=training, train_dataset=dataset(args, config.vocab_size),
                      callbacks=callbacks + [timer.callback])
    trainer.train()
    step_s = timer.median(args.warmup_steps)
    used_after = used_gpu_bytes()
    result = {"budget": args.budget, "gradient_checkpointing": args.gradient_checkpointing, "batch": args.batch_size,
              "seq_len": args.seq_len, "steps": args.steps, "step_s_median": step_s,
              "step_s_each": [round(t, 5) for t in timer.each()],
              "samples_per_s": args.batch_size / step_s if step_s else None,
              "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
              "nvml_highwater_bytes": None if used_before is None or used_after is None else used_after - used_before}
    planner = callbacks[0].planner if callbacks else None
    if planner is not None and planner.plan is not None:
        summary = planner.to_dict()  # the plan, the calibration it was made from, the plans tried
        result.update({key: summary.get(key) for key in ("plan", "calibration", "trials", "measured_step_s",
                                                          "margin_bytes", "overflowed_steps")})
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
