"""A user's training script for models no other benchmark names: Hugging Face models built from
their configs (no weights are downloaded), random data, a plain PyTorch loop with bf16 autocast
and AdamW. It has no um_alloc line: bench_zoo.py runs it as it is, under PyTorch's allocator or
under ``python -m um_alloc run``.

    python bench/zoo_train.py --model llama                                   # stock, in memory
    python bench/zoo_train.py --model llama --checkpoint-layers all --memory-limit 10GiB
    python -m um_alloc run --budget 10GiB bench/zoo_train.py --model llama     # the block planner

Models (MODELS): llama (a 24-layer decoder with grouped-query attention and a SwiGLU MLP, ~330M
parameters), t5 (an encoder-decoder of 12 + 12 layers, gated-GELU feed-forward as T5 v1.1 and
Flan-T5, ~250M), vit (ViT-Base/16 at 224x224, 1000 classes, ~86M), gpt2 (GPT-2-medium, ~355M), opt
(OPT-350M's shape), neox (GPT-NeoX's parallel attention and MLP at 24 layers of width 1024), qwen2 (a
24-layer Qwen2 with a 151,936-token vocabulary, tied embeddings), bloom (BLOOM's ALiBi at 24 layers of
width 1024, a 250,880-token vocabulary), bart (BART-base: 6 + 6 layers, 512 tokens in, 256 out), and
models that are not Hugging Face's, whose loss the loop computes: encoder (a language model on
PyTorch's own nn.TransformerEncoder, 24 pre-norm layers of width 1024, its cross-entropy taken over
fp32 logits, ~370M), convnext and swin (torchvision's ConvNeXt-T, with stochastic depth, and
Swin-T, at 224x224), densenet, efficientnet, mobilenet and regnet (torchvision's DenseNet-121,
EfficientNetV2-S, MobileNetV3-Large and RegNetY-1.6GF, at 224x224), googlenet and inception
(torchvision's GoogLeNet and Inception v3 without their auxiliary heads, at 224x224; Inception v3
holds its blocks as attributes, in no ModuleList or Sequential), and vgg (torchvision's VGG-16 with
BatchNorm, at 224x224: layers in Sequentials and no blocks, so nothing to checkpoint block by
block; --save-on-cpu is its peer). --tiny builds two-layer
versions of the Hugging Face and PyTorch models for tests (on the CPU with --cpu); torchvision's
have no tiny version.

Loops as users write them: --accumulate N accumulates gradients over N micro-batches of --batch
(the optimizer's state is then made after N forwards and backwards); --fp16 trains in float16
autocast with a GradScaler instead of bfloat16; --freeze-layers K freezes the embeddings and the
first K layers (a partial fine-tune: the optimizer holds state for the rest only); --loop-loss
(the decoders) takes the loss in the loop from the model's logits instead of passing labels;
--pairs calls the model on two batches and takes one backward over the sum of their losses (the
shape of a pair or contrastive loss's step, or a discriminator's real and generated batches), so
that a step trains twice --batch.

--lengths MIN:MAX (the sequence models) gives each step a sequence length drawn from MIN to MAX,
rounded up to a multiple of --pad-to (default 8), as a data collator padding each batch to its
longest sequence (pad_to_multiple_of) does; samples/s is then the mean over the steps after --warmup, not the
median, since what a new length costs is the point.

No key-value cache: training needs none. --checkpoint-layers K checkpoints the first K of the
model's layers in module order (Hugging Face's own gradient checkpointing, turned off layer by
layer past K; torch.utils.checkpoint around each of the first K blocks of the other models, but
DenseNet's own memory_efficient checkpointing in its layers); "all" checkpoints every one.
--compile trains through torch.compile(model), its default mode.
--memory-limit caps PyTorch's allocator with set_per_process_memory_fraction. The last line of
stdout is one JSON object; an out-of-memory ends the run with exit status 3.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
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
    loss: Callable[..., torch.Tensor] | None = None  # (model, inputs) -> loss, where the loop computes it
    layers: Callable[..., list] | None = None  # model -> its blocks, where checkpointing is not Hugging Face's
    checkpointable: bool = True                # whether it has blocks to checkpoint at all


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


def _gpt2(tiny: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    size = (dict(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0) if tiny else
            dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024))
    return GPT2LMHeadModel(GPT2Config(use_cache=False, **size))


def _opt(tiny: bool):
    from transformers import OPTConfig, OPTForCausalLM

    size = (dict(vocab_size=97, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2,
                 num_attention_heads=2, max_position_embeddings=16) if tiny else
            dict(hidden_size=1024, word_embed_proj_dim=1024, ffn_dim=4096, num_hidden_layers=24,
                 num_attention_heads=16, max_position_embeddings=2048))
    return OPTForCausalLM(OPTConfig(use_cache=False, **size))


def _neox(tiny: bool):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    size = (dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=16) if tiny else
            dict(vocab_size=50432, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                 num_attention_heads=16, max_position_embeddings=2048))
    return GPTNeoXForCausalLM(GPTNeoXConfig(use_cache=False, **size))


def _qwen2(tiny: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    size = (dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1) if tiny else
            dict(vocab_size=151936, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=4))
    return Qwen2ForCausalLM(Qwen2Config(max_position_embeddings=2048, tie_word_embeddings=True, use_cache=False,
                                        **size))


def _bloom(tiny: bool):
    from transformers import BloomConfig, BloomForCausalLM

    size = (dict(vocab_size=97, hidden_size=32, n_layer=2, n_head=2) if tiny else
            dict(vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16))
    return BloomForCausalLM(BloomConfig(use_cache=False, **size))


def _bart(tiny: bool):
    from transformers import BartConfig, BartForConditionalGeneration

    size = (dict(vocab_size=97, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16)
            if tiny else
            dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                 decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072))
    return BartForConditionalGeneration(BartConfig(use_cache=False, **size))


class TokenEncoder(torch.nn.Module):
    """A language model as PyTorch alone builds it: embeddings, nn.TransformerEncoder (pre-norm,
    GELU, dropout 0.1), a head; the loop takes the loss."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.zeros(1, length, width))
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, activation="gelu",
                                                 batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position[:, :tokens.shape[1]]
        return self.head(self.norm(self.encoder(hidden)))


def _encoder(tiny: bool):
    return TokenEncoder(97, 32, 2, 2, 16) if tiny else TokenEncoder(32000, 1024, 24, 16, 512)


def _next_token_loss(model, inputs: dict) -> torch.Tensor:
    """As a user's loop writes it: the logits upcast to fp32, then cross-entropy."""
    tokens = inputs["tokens"]
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _loop_next_token_loss(model, inputs: dict) -> torch.Tensor:
    """A decoder's loss as a PyTorch loop takes it: logits without labels, shifted, flattened and
    upcast, then cross-entropy (what transformers' ForCausalLMLoss computes inside the model)."""
    labels = inputs["labels"]
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


DECODERS = ("llama", "gpt2", "opt", "neox", "qwen2", "bloom")  # their batches: input_ids, labels the same


def _torchvision(name: str, **options):
    def build(tiny: bool):
        if tiny:
            raise SystemExit(f"zoo_train.py: {name} has no --tiny version")
        try:
            import torchvision
        except ImportError:
            raise SystemExit(f"zoo_train.py: {name} is torchvision's; install torchvision") from None
        return getattr(torchvision.models, name)(**options)
    return build


def _image_loss(model, inputs: dict) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(inputs["pixel_values"]), inputs["labels"])


def _blocks_named(*names: str) -> Callable[[torch.nn.Module], list]:
    """A torchvision model's blocks, by class name, in module order (their order in the forward)."""
    return lambda model: [m for m in model.modules() if type(m).__name__ in names]


# ConvNeXt's and Swin's: the blocks of their stages, whatever lies between (Swin's PatchMerging).
_stage_blocks = _blocks_named("CNBlock", "SwinTransformerBlock", "SwinTransformerBlockV2")


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


def _gpt2_batch(batch: int, tiny: bool, generator) -> dict:
    ids = _tokens(97 if tiny else 50257, (batch, 16 if tiny else 1024), generator)
    return {"input_ids": ids, "labels": ids}


def _causal_batch(vocab: int) -> Callable[..., dict]:
    """A decoder's batch of 1024 tokens (16 tiny), its labels the tokens themselves."""
    def make(batch: int, tiny: bool, generator) -> dict:
        ids = _tokens(97 if tiny else vocab, (batch, 16 if tiny else 1024), generator)
        return {"input_ids": ids, "labels": ids}
    return make


def _bart_batch(batch: int, tiny: bool, generator) -> dict:
    vocab = 97 if tiny else 50265
    return {"input_ids": _tokens(vocab, (batch, 16 if tiny else 512), generator),
            "labels": _tokens(vocab, (batch, 8 if tiny else 256), generator)}


def _encoder_batch(batch: int, tiny: bool, generator) -> dict:
    return {"tokens": _tokens(97 if tiny else 32000, (batch, 16 if tiny else 512), generator)}


def _image_batch(batch: int, tiny: bool, generator) -> dict:
    return {"pixel_values": torch.randn(batch, 3, 224, 224, generator=generator),
            "labels": _tokens(1000, (batch,), generator)}


MODELS = {
    "llama": ZooModel(_llama, 8, _llama_batch, "a sequence of 1024 tokens", "input_ids"),
    "t5": ZooModel(_t5, 32, _t5_batch, "512 tokens in, 128 out", "input_ids"),
    "vit": ZooModel(_vit, 128, _vit_batch, "a 224x224 image"),
    "gpt2": ZooModel(_gpt2, 8, _gpt2_batch, "a sequence of 1024 tokens", "input_ids"),
    "opt": ZooModel(_opt, 8, _causal_batch(50272), "a sequence of 1024 tokens", "input_ids"),
    "neox": ZooModel(_neox, 8, _causal_batch(50432), "a sequence of 1024 tokens", "input_ids"),
    "qwen2": ZooModel(_qwen2, 8, _causal_batch(151936), "a sequence of 1024 tokens", "input_ids"),
    "bloom": ZooModel(_bloom, 4, _causal_batch(250880), "a sequence of 1024 tokens", "input_ids"),
    "bart": ZooModel(_bart, 24, _bart_batch, "512 tokens in, 256 out", "input_ids"),
    "encoder": ZooModel(_encoder, 16, _encoder_batch, "a sequence of 512 tokens", "tokens", loss=_next_token_loss,
                        layers=lambda model: list(model.encoder.layers)),
    "convnext": ZooModel(_torchvision("convnext_tiny"), 192, _image_batch, "a 224x224 image", loss=_image_loss,
                         layers=_stage_blocks),
    "swin": ZooModel(_torchvision("swin_t"), 128, _image_batch, "a 224x224 image", loss=_image_loss,
                     layers=_stage_blocks),
    "densenet": ZooModel(_torchvision("densenet121"), 128, _image_batch, "a 224x224 image", loss=_image_loss,
                         layers=_blocks_named("_DenseLayer")),
    "efficientnet": ZooModel(_torchvision("efficientnet_v2_s"), 128, _image_batch, "a 224x224 image",
                             loss=_image_loss, layers=_blocks_named("MBConv", "FusedMBConv")),
    "mobilenet": ZooModel(_torchvision("mobilenet_v3_large"), 256, _image_batch, "a 224x224 image",
                          loss=_image_loss, layers=_blocks_named("InvertedResidual")),
    "regnet": ZooModel(_torchvision("regnet_y_1_6gf"), 192, _image_batch, "a 224x224 image", loss=_image_loss,
                       layers=_blocks_named("ResBottleneckBlock")),
    "googlenet": ZooModel(_torchvision("googlenet", aux_logits=False, init_weights=True), 256, _image_batch,
                          "a 224x224 image", loss=_image_loss, layers=_blocks_named("Inception")),
    "inception": ZooModel(_torchvision("inception_v3", aux_logits=False, init_weights=True), 192, _image_batch,
                          "a 224x224 image", loss=_image_loss,
                          layers=_blocks_named(*(f"Inception{kind}" for kind in "ABCDE"))),
    "vgg": ZooModel(_torchvision("vgg16_bn"), 128, _image_batch, "a 224x224 image", loss=_image_loss,
                    checkpointable=False),
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
    p.add_argument("--accumulate", type=int, default=1, metavar="N",
                   help="micro-batches of --batch whose gradients one optimizer step takes (default 1)")
    p.add_argument("--fp16", action="store_true", help="float16 autocast with a GradScaler (default: bfloat16)")
    p.add_argument("--freeze-layers", type=int, default=0, metavar="K",
                   help="freeze the input embeddings and the first K layers")
    p.add_argument("--loop-loss", action="store_true", help=f"the loss taken in the loop from the logits "
                   f"({', '.join(DECODERS)})")
    p.add_argument("--pairs", action="store_true", help="two forwards, of two batches, before each backward")
    p.add_argument("--save-on-cpu", action="store_true", help="every forward and backward inside "
                   "torch.autograd.graph.save_on_cpu(pin_memory=True): saved activations wait in host memory")
    p.add_argument("--tiny", action="store_true", help="two-layer models (tests)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU (with --tiny, for tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    if args.checkpoint_layers not in (None, "all") and not args.checkpoint_layers.isdigit():
        p.error(f"--checkpoint-layers must be a number of layers or 'all'; got {args.checkpoint_layers!r}")
    if args.checkpoint_layers is not None and not MODELS[args.model].checkpointable:
        p.error(f"--checkpoint-layers: {args.model} has no blocks to checkpoint; --save-on-cpu is its peer")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be at least 0 and below --steps ({args.steps}); got {args.warmup}")
    if args.batch is not None and args.batch < 1:
        p.error(f"--batch must be at least 1; got {args.batch}")
    if args.accumulate < 1:
        p.error(f"--accumulate must be at least 1; got {args.accumulate}")
    if args.freeze_layers < 0:
        p.error(f"--freeze-layers must be at least 0; got {args.freeze_layers}")
    if args.pad_to < 1:
        p.error(f"--pad-to must be at least 1; got {args.pad_to}")
    if args.loop_loss and args.model not in DECODERS:
        p.error(f"--loop-loss applies to the decoders ({', '.join(DECODERS)}), not {args.model}")
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


def checkpointed_layers(model: torch.nn.Module, first: str | None, zoo: ZooModel | None = None) -> int:
    """Turns on Hugging Face's checkpointing of the first `first` layers ("all": every one), or
    for a model that names its blocks (`zoo.layers`), wraps each of the first in
    torch.utils.checkpoint; the number of layers checkpointed."""
    if first is None:
        return 0
    if zoo is not None and zoo.layers is not None:
        return _checkpoint_blocks(zoo.layers(model), first)
    from transformers.modeling_layers import GradientCheckpointingLayer

    # transformers 5 renamed gradient_checkpointing_enable
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    layers = _hugging_face_layers(model)
    count = len(layers) if first == "all" else min(int(first), len(layers))
    for layer in layers[count:]:
        layer.gradient_checkpointing = False
    return count


def _checkpoint_blocks(blocks: list, first: str) -> int:
    from torch.utils.checkpoint import checkpoint

    count = len(blocks) if first == "all" else min(int(first), len(blocks))
    for block in blocks[:count]:
        if hasattr(block, "memory_efficient"):
            # torchvision's DenseNet layer checkpoints itself (memory_efficient=True), as its users
            # do: each layer takes the list of every feature so far, which its block goes on
            # appending to, so checkpoint around the whole layer would rerun it on the longer list.
            block.memory_efficient = True
        else:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return count


def frozen_layers(model: torch.nn.Module, first: int, zoo: ZooModel) -> int:
    """Freezes the input embeddings and the first `first` layers (a partial fine-tune); how many."""
    if not first:
        return 0
    blocks = zoo.layers(model) if zoo.layers is not None else _hugging_face_layers(model)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for module in [embeddings, *blocks[:first]]:
        for parameter in ([] if module is None else module.parameters()):
            parameter.requires_grad_(False)
    return min(first, len(blocks))


def _hugging_face_layers(model: torch.nn.Module) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


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


def gpu_clocks(device: torch.device) -> dict | None:
    """The GPU's SM clock, temperature, power and what holds its clocks back (NVML), off the GPU None:
    steps on these hosts drift by a third within a run, and the clocks say whether the GPU did."""
    if device.type != "cuda":
        return None
    from um_alloc.device_info import device_clocks  # NVML: does not start CUDA

    return device_clocks(device.index or 0)


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
    layers = checkpointed_layers(model, args.checkpoint_layers, zoo)
    frozen = frozen_layers(model, args.freeze_layers, zoo)
    call = torch.compile(model) if args.compile else model
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=device.type == "cuda")
    batch_size = args.batch or (2 if args.tiny else zoo.batch)
    generator = torch.Generator().manual_seed(args.seed)
    # Made before the loop, as a data loader's workers would have them ready: drawing a batch of
    # images on the host takes longer than a step of ViT on the GPU.
    batches = [{k: v.pin_memory() if device.type == "cuda" else v
                for k, v in zoo.make_batch(batch_size, args.tiny, generator).items()} for _ in range(BATCHES)]
    precision = torch.float16 if args.fp16 else torch.bfloat16
    autocast = torch.autocast(device.type, dtype=precision, enabled=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=args.fp16 and device.type == "cuda")
    lengths = step_lengths(args.lengths, args.steps, args.seed, args.pad_to) if args.lengths else None
    calls = 2 if args.pairs else 1   # forwards before each backward
    pinned = device.type == "cuda"
    saved_on_host = (lambda: torch.autograd.graph.save_on_cpu(pin_memory=pinned)) if args.save_on_cpu \
        else contextlib.nullcontext
    losses, seconds, clocks = [], [], {}
    for step in range(args.steps):
        if step == args.warmup:
            clocks["timed_start"] = gpu_clocks(device)  # between steps: no step's time holds the query
        begun = time.perf_counter()
        total = 0.0
        for micro in range(args.accumulate):
            first = (step * args.accumulate + micro) * calls
            with saved_on_host():
                with autocast:  # every forward of the micro-batch before its one backward
                    loss = sum(_loss(args, zoo, call, _on_device(batches[(first + k) % BATCHES], device, zoo, lengths,
                                                                 step, args.model))
                               for k in range(calls))
                if args.accumulate > 1:
                    loss = loss / args.accumulate
                scaler.scale(loss).backward()
            total += loss.detach()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))  # waits for the step, as a loop that logs its loss does
        seconds.append(time.perf_counter() - begun)
    clocks["end"] = gpu_clocks(device)
    timed = seconds[args.warmup:]
    step_s = statistics.fmean(timed) if lengths else statistics.median(timed)
    samples = batch_size * args.accumulate * calls
    return {"model": args.model, "sample": None if args.tiny else zoo.sample, "batch": samples,
            "micro_batch": batch_size, "accumulate": args.accumulate, "fp16": args.fp16, "loop_loss": args.loop_loss,
            "forwards_per_backward": calls, "save_on_cpu": args.save_on_cpu,
            "checkpointed_layers": layers, "frozen_layers": frozen, "compiled": args.compile,
            "parameters": sum(p.numel() for p in model.parameters()),
            "trained_parameters": sum(p.numel() for p in trained), "steps": args.steps,
            "step_s_median": statistics.median(timed), "step_s_mean": statistics.fmean(timed),
            "samples_per_s": samples / step_s, "lengths": lengths, "step_seconds": seconds, "losses": losses,
            "gpu_clocks": clocks,
            "loss_first": losses[0], "loss_last": losses[-1]}


def _on_device(batch: dict, device: torch.device, zoo: ZooModel, lengths: list | None, step: int, model: str) -> dict:
    inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if lengths:
        inputs[zoo.sequence_key] = inputs[zoo.sequence_key][:, :lengths[step]]
        if model == "llama":  # its labels are its input
            inputs["labels"] = inputs[zoo.sequence_key]
    return inputs


def _loss(args, zoo: ZooModel, call, inputs: dict) -> torch.Tensor:
    if args.loop_loss:
        return _loop_next_token_loss(call, inputs)
    return zoo.loss(call, inputs) if zoo.loss is not None else call(**inputs).loss


def workload_name(args) -> str:
    """The model and how the loop trains it: gpt2-accumulate4-bf16-adamw, encoder-fp16-adamw, ..."""
    loop = [f"accumulate{args.accumulate}"] if args.accumulate > 1 else []
    loop += [f"freeze{args.freeze_layers}"] if args.freeze_layers else []
    loop += ["looploss"] if args.loop_loss else []
    loop += ["pairs"] if args.pairs else []
    return "-".join([args.model + ("-tiny" if args.tiny else ""), *loop, "fp16" if args.fp16 else "bf16", "adamw"])


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
        workload=workload_name(args), memory_limit_bytes=limit_bytes,
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
