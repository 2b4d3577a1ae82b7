"""A user's training script for models no other benchmark names: Hugging Face models built from
their configs (no weights are downloaded), random data, a plain PyTorch loop with bf16 autocast
and AdamW. It has no um_alloc line: bench_zoo.py runs it as it is, under PyTorch's allocator or
under ``python -m um_alloc run``.

    python bench/zoo_train.py --model llama                                   # stock, in memory
    python bench/zoo_train.py --model llama --checkpoint-layers all --memory-limit 10GiB
    python -m um_alloc run --budget 10GiB bench/zoo_train.py --model llama     # the block planner

Models (MODELS): llama (a 24-layer decoder with grouped-query attention and a SwiGLU MLP, ~330M
parameters), t5 (an encoder-decoder of 12 + 12 layers, gated-GELU feed-forward as T5 v1.1 and
Flan-T5, ~250M), vit (ViT-Base/16 at 224x224, 1000 classes, ~86M). --tiny builds two-layer versions of
each for tests (on the CPU with --cpu).

--lengths MIN:MAX (the sequence models) gives each step a sequence length drawn from MIN to MAX,
rounded up to a multiple of --pad-to (default 8), as a data collator padding each batch to its
longest sequence (pad_to_multiple_of) does; samples/s is then the mean over the steps after --warmup, not the
median, since what a new length costs is the point.

No key-value cache: training needs none. --checkpoint-layers K checkpoints the first K of the model's layers in module order (Hugging
Face's own gradient checkpointing, turned off layer by layer past K); "all" checkpoints every one.
--compile trains through torch.compile(model), its default mode.
--memory-limit caps PyTorch's allocator with set_per_process_memory_fraction. The last line of
stdout is one JSON object; an out-of-memory ends the run with exit status 3.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import torch

EXIT_OOM = 3  # as bert_example/train.py, which bench/harness.py reads
BATCHES = 4   # distinct batches, used in turn


PAD_TO = 8    # --lengths: a length is rounded up to a multiple of this (--pad-to)


@dataclass(frozen=True)
class ZooModel:
    """A model, the shape of its data, and what one sample is."""
    build: Callable[[bool], torch.nn.Module]   # tiny -> the model
    batch: int                                 # the default batch
    make_batch: Callable[..., dict]            # (batch, tiny, generator) -> the model's keyword arguments
    sample: str
    sequence_key: str | None = None            # the input whose length --lengths draws


def _llama(tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    size = (dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1) if tiny else
            dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=4))
    return LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, use_cache=False, **size))


def _t5(tiny: bool):
    from transformers import T5Config, T5ForConditionalGeneration

    size = (dict(vocab_size=97, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2) if tiny else
            dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12))
    return T5ForConditionalGeneration(T5Config(feed_forward_proj="gated-gelu", decoder_start_token_id=0, use_cache=False,
                                               tie_word_embeddings=False, **size))


def _vit(tiny: bool):
    from transformers import ViTConfig, ViTForImageClassification

    size = (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                 patch_size=8, num_labels=10) if tiny else
            dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 image_size=224, patch_size=16, num_labels=1000))
    return ViTForImageClassification(ViTConfig(**size))


def _tokens(vocab: int, shape: tuple, generator) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=generator)


def _llama_batch(batch: int, tiny: bool, generator) -> dict:
    ids = _tokens(97 if tiny else 32000, (batch, 16 if tiny else 1024), generator)
    return {"input_ids": ids, "labels": ids}


def _t5_batch(batch: int, tiny: bool, generator) -> dict:
    vocab = 97 if tiny else 32128
    return {"input_ids": _tokens(vocab, (batch, 16 if tiny else 512), generator),
            "labels": _tokens(vocab, (batch, 8 if tiny else 128), generator)}


def _vit_batch(batch: int, tiny: bool, generator) -> dict:
    side = 32 if tiny else 224
    return {"pixel_values": torch.randn(batch, 3, side, side, generator=generator),
            "labels": _tokens(10 if tiny else 1000, (batch,), generator)}


MODELS = {
    "llama": ZooModel(_llama, 8, _llama_batch, "a sequence of 1024 tokens", "input_ids"),
    "t5": ZooModel(_t5, 32, _t5_batch, "512 tokens in, 128 out", "input_ids"),
    "vit": ZooModel(_vit, 128, _vit_batch, "a 224x224 image"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--batch", type=int, help="samples a step (default: the model's, see MODELS)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the median step time")
    p.add_argument("--checkpoint-layers", default=None, metavar="K|all",
                   help="checkpoint the first K layers (Hugging Face's own gradient checkpointing), or all")
    p.add_argument("--memory-limit", metavar="SIZE", help="cap PyTorch's allocator, e.g. 10GiB")
    p.add_argument("--lengths", metavar="MIN:MAX", help="a sequence length per step, drawn from MIN to MAX "
                   "(dynamic padding; llama and t5), at most the model's own length")
    p.add_argument("--pad-to", type=int, default=PAD_TO, help=f"--lengths: round each length up to a multiple of "
                   f"this (default {PAD_TO})")
    p.add_argument("--compile", action="store_true", help="train through torch.compile(model) (the default mode)")
    p.add_argument("--tiny", action="store_true", help="two-layer models (tests)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU (with --tiny, for tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    if args.checkpoint_layers not in (None, "all") and not args.checkpoint_layers.isdigit():
        p.error(f"--checkpoint-layers must be a number of layers or 'all'; got {args.checkpoint_layers!r}")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be at least 0 and below --steps ({args.steps}); got {args.warmup}")
    if args.batch is not None and args.batch < 1:
        p.error(f"--batch must be at least 1; got {args.batch}")
    if args.pad_to < 1:
        p.error(f"--pad-to must be at least 1; got {args.pad_to}")
    if args.lengths is not None:
        args.lengths = _lengths(p, args)
    return args


def _lengths(p: argparse.ArgumentParser, args) -> tuple[int, int]:
    zoo = MODELS[args.model]
    if zoo.sequence_key is None:
        p.error(f"--lengths applies to the sequence models "
                f"({', '.join(n for n, m in MODELS.items() if m.sequence_key)}), not {args.model}")
    full = zoo.make_batch(1, args.tiny, torch.Generator())[zoo.sequence_key].shape[1]
    low, _, high = args.lengths.partition(":")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high) <= full):
        p.error(f"--lengths must be MIN:MAX with 1 <= MIN <= MAX <= {full} ({args.model}'s length); "
                f"got {args.lengths!r}")
    return int(low), int(high)


def step_lengths(lengths: tuple[int, int], steps: int, seed: int, pad_to: int = PAD_TO) -> list[int]:
    """Each step's length, drawn uniformly from lengths, rounded up to a multiple of pad_to (at most the largest)."""
    low, high = lengths
    generator = torch.Generator().manual_seed(seed + 1)
    drawn = torch.randint(low, high + 1, (steps,), generator=generator).tolist()
    return [min(-(-n // pad_to) * pad_to, high) for n in drawn]


def checkpointed_layers(model: torch.nn.Module, first: str | None) -> int:
    """Turns on Hugging Face's checkpointing of the first `first` layers ("all": every one); the
    number of layers checkpointed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if first is None:
        return 0
    # transformers 5 renamed gradient_checkpointing_enable
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    count = len(layers) if first == "all" else min(int(first), len(layers))
    for layer in layers[count:]:
        layer.gradient_checkpointing = False
    return count


def limit_memory(limit: str | None, device: torch.device) -> int | None:
    if limit is None or device.type != "cuda":
        return None
    from um_alloc.sizes import parse_size

    limit_bytes = parse_size(limit, key="--memory-limit", source="command line")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if limit_bytes > total:
        sys.exit(f"zoo_train.py: --memory-limit {limit} exceeds the device's {total} bytes")
    torch.cuda.set_per_process_memory_fraction(limit_bytes / total, index)
    return limit_bytes


def used_gpu_bytes() -> int | None:
    from um_alloc.device_info import device_memory  # NVML: does not start CUDA

    memory = device_memory(0)
    return None if memory is None else memory.used_bytes


def peak_allocated(device: torch.device) -> int | None:
    """PyTorch's peak of allocated bytes; None off the GPU, or where the allocator keeps no count."""
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.max_memory_allocated(device) or None
    except RuntimeError:
        return None


def train(args, device: torch.device) -> dict:
    zoo = MODELS[args.model]
    torch.manual_seed(args.seed)
    model = zoo.build(args.tiny).to(device).train()
    layers = checkpointed_layers(model, args.checkpoint_layers)
    call = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batch_size = args.batch or (2 if args.tiny else zoo.batch)
    generator = torch.Generator().manual_seed(args.seed)
    # Made before the loop, as a data loader's workers would have them ready: drawing a batch of
    # images on the host takes longer than a step of ViT on the GPU.
    batches = [{k: v.pin_memory() if device.type == "cuda" else v
                for k, v in zoo.make_batch(batch_size, args.tiny, generator).items()} for _ in range(BATCHES)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    lengths = step_lengths(args.lengths, args.steps, args.seed, args.pad_to) if args.lengths else None
    losses, seconds = [], []
    for step in range(args.steps):
        begun = time.perf_counter()
        inputs = {k: v.to(device, non_blocking=True) for k, v in batches[step % BATCHES].items()}
        if lengths:
            inputs[zoo.sequence_key] = inputs[zoo.sequence_key][:, :lengths[step]]
            if args.model == "llama":  # its labels are its input
                inputs["labels"] = inputs[zoo.sequence_key]
        with autocast:
            loss = call(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step, as a loop that logs its loss does
        seconds.append(time.perf_counter() - begun)
    timed = seconds[args.warmup:]
    step_s = statistics.fmean(timed) if lengths else statistics.median(timed)
    return {"model": args.model, "sample": None if args.tiny else zoo.sample, "batch": batch_size,
            "checkpointed_layers": layers, "compiled": args.compile,
            "parameters": sum(p.numel() for p in model.parameters()), "steps": args.steps,
            "step_s_median": statistics.median(timed), "step_s_mean": statistics.fmean(timed),
            "samples_per_s": batch_size / step_s, "lengths": lengths, "step_seconds": seconds, "losses": losses,
            "loss_first": losses[0], "loss_last": losses[-1]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cpu" if args.cpu else "cuda")
    used_before = used_gpu_bytes() if device.type == "cuda" else None
    limit_bytes = limit_memory(args.memory_limit, device)
    result = train(args, device)
    used_after = used_gpu_bytes() if device.type == "cuda" else None
    result.update(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        workload=f"{args.model}{'-tiny' if args.tiny else ''}-bf16-adamw", memory_limit_bytes=limit_bytes,
        peak_bytes=peak_allocated(device),
        # NVML's device memory in use, end minus start: the driver keeps the pages a run used.
        device_used_delta_bytes=None if used_before is None or used_after is None else used_after - used_before)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    try:
        main()
    except torch.OutOfMemoryError as error:
        print(f"zoo_train.py: out of GPU memory: {error}", file=sys.stderr)
        sys.exit(EXIT_OOM)
