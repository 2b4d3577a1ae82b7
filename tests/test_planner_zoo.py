"""The planner on models it was not written for: tiny Hugging Face models built from their configs
(no downloads): decoder-only, encoder-decoder (text and speech), mixture-of-experts, a state-space
scan, a layer shared across depth, two towers in one model, vision transformers and convolutional
networks.
For each: the blocks it finds; every decision forced on every block trains as plain autograd
does, bit for bit, in float64 and under bf16 autocast (where casts, autocast's cache and the
rebuilds meet); and the planner itself, calibrating two steps and then rebuilding under bf16
autocast, trains as plain autograd does and rebuilds what is cheap.

The reference is plain autograd with every config's cache off, as under the planner and under
Hugging Face's own gradient checkpointing: a cache changes the rounding of training (GPT-2 and T5
differ by 1e-16 in float64 with it on), since the attention reads keys and values through it.
"""
import copy
import functools

import pytest
import torch

from um_alloc.planner import BlockPlanner, Decision, find_units
from um_alloc.planner import rebuilt as rebuilt_module
from um_alloc.planner.replay import Runtime
from planner_helpers import Fixed, decisions_for

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, IMAGE = 97, 16, 16
DECODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def _make(config_class, model_class, **config):
    def make():
        torch.manual_seed(0)
        return model_class(config_class(**config)).train()
    return make


# name -> (model factory, input kind, the blocks find_units must find by class, block_classes,
#          the cheap functions whose outputs (or their casts) a planned rebuild makes again)
ZOO = {
    "llama": (_make(transformers.LlamaConfig, transformers.LlamaForCausalLM, num_key_value_heads=1, **DECODER),
              "text", {"LlamaDecoderLayer": 2}, None, {"mul", "silu"}),
    "mistral": (_make(transformers.MistralConfig, transformers.MistralForCausalLM, num_key_value_heads=1,
                      sliding_window=8, **DECODER), "text", {"MistralDecoderLayer": 2}, None, {"mul", "silu"}),
    "qwen2": (_make(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, num_key_value_heads=1, **DECODER),
              "text", {"Qwen2DecoderLayer": 2}, None, {"mul", "silu"}),
    "mixtral": (_make(transformers.MixtralConfig, transformers.MixtralForCausalLM, num_key_value_heads=1,
                      num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager", **DECODER),
                "text", {"MixtralDecoderLayer": 2}, None, {"mul", "silu"}),
    "gpt_neox": (_make(transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, **DECODER),
                 "text", {"GPTNeoXLayer": 2}, None, {"gelu", "layer_norm"}),
    "falcon": (_make(transformers.FalconConfig, transformers.FalconForCausalLM, vocab_size=VOCAB, hidden_size=32,
                     num_hidden_layers=2, num_attention_heads=2), "text", {"FalconDecoderLayer": 2}, None,
               {"gelu", "layer_norm"}),
    "t5": (_make(transformers.T5Config, transformers.T5ForConditionalGeneration, vocab_size=VOCAB, d_model=32,
                 d_kv=16, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0),
           "text", {"T5Block": 4}, None, {"mul"}),  # RMS norm by hand: its scaling by the weight
    "bart": (_make(transformers.BartConfig, transformers.BartForConditionalGeneration, vocab_size=VOCAB, d_model=32,
                   encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                   encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64),
             "text", {"BartEncoderLayer": 2, "BartDecoderLayer": 2}, None, {"gelu", "layer_norm"}),
    "deberta_v2": (_make(transformers.DebertaV2Config, transformers.DebertaV2ForMaskedLM, vocab_size=VOCAB,
                         hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]),
                   "text", {"DebertaV2Layer": 2}, None, {"gelu", "layer_norm"}),
    "albert": (_make(transformers.AlbertConfig, transformers.AlbertForMaskedLM, vocab_size=VOCAB, embedding_size=16,
                     hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64),
               "text", {"AlbertLayer": 1}, ["AlbertLayer"], {"add", "layer_norm", "mul", "tanh"}),  # one layer, called at every depth
    "whisper": (_make(transformers.WhisperConfig, transformers.WhisperForConditionalGeneration, vocab_size=VOCAB,
                      num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
                      max_target_positions=32, decoder_start_token_id=0, pad_token_id=0, bos_token_id=0,
                      eos_token_id=1), "speech", {"WhisperEncoderLayer": 2, "WhisperDecoderLayer": 2}, None,
                {"gelu", "layer_norm"}),
    "clip": (_make(transformers.CLIPConfig, transformers.CLIPModel, projection_dim=16,
                   text_config=dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64),
                   vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                      image_size=IMAGE, patch_size=4)),
             "text and image", {"CLIPEncoderLayer": 4}, None, {"layer_norm", "mul"}),  # two towers; quick GELU by hand
    "gpt2": (_make(transformers.GPT2Config, transformers.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=32, n_layer=2,
                   n_head=2, n_positions=64), "text", {"GPT2Block": 2}, None, {"add", "layer_norm", "mul", "tanh"}),  # GELU by hand: a tree over its input
    "gemma2": (_make(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, num_key_value_heads=1, head_dim=16,
                     sliding_window=8, **DECODER), "text", {"Gemma2DecoderLayer": 2}, None,
               {"add", "gelu", "mul", "linear"}),  # its norms after the linears read float32 copies of their outputs
    "phi": (_make(transformers.PhiConfig, transformers.PhiForCausalLM, **DECODER),  # attention beside the MLP
            "text", {"PhiDecoderLayer": 2}, None, {"add", "layer_norm", "mul", "tanh"}),
    "opt": (_make(transformers.OPTConfig, transformers.OPTForCausalLM, vocab_size=VOCAB, hidden_size=32,
                  num_hidden_layers=2, num_attention_heads=2, ffn_dim=64, word_embed_proj_dim=32,
                  max_position_embeddings=64), "text", {"OPTDecoderLayer": 2}, None, {"layer_norm"}),
    "bloom": (_make(transformers.BloomConfig, transformers.BloomForCausalLM, vocab_size=VOCAB, hidden_size=32,
                    n_layer=2, n_head=2), "text", {"BloomBlock": 2}, None, {"layer_norm"}),  # ALiBi
    "gptj": (_make(transformers.GPTJConfig, transformers.GPTJForCausalLM, vocab_size=VOCAB, n_embd=32, n_layer=2,
                   n_head=2, rotary_dim=8, n_positions=64), "text", {"GPTJBlock": 2}, None, {"add", "layer_norm", "mul", "tanh"}),
    "distilbert": (_make(transformers.DistilBertConfig, transformers.DistilBertForMaskedLM, vocab_size=VOCAB, dim=32,
                         n_layers=2, n_heads=2, hidden_dim=64),
                   "text", {"TransformerBlock": 2}, None, {"gelu", "layer_norm"}),
    "qwen2_moe": (_make(transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, num_key_value_heads=1,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, experts_implementation="eager", **DECODER),
                  "text", {"Qwen2MoeDecoderLayer": 2}, None, {"mul", "silu"}),  # a shared expert beside the routed
    "mamba": (_make(transformers.MambaConfig, transformers.MambaForCausalLM, vocab_size=VOCAB, hidden_size=32,
                    num_hidden_layers=2, state_size=4, expand=2, conv_kernel=4),  # a selective scan, no attention:
              "text", {"MambaBlock": 2}, None, {"exp", "mul", "neg", "silu"}),  # it saves slices of larger tensors, which move as laid out
    "vit": (_make(transformers.ViTConfig, transformers.ViTForImageClassification, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=64, image_size=IMAGE, patch_size=4, num_labels=3),
            "image", {"ViTLayer": 2}, None, {"gelu", "layer_norm"}),
    "dinov2": (_make(transformers.Dinov2Config, transformers.Dinov2ForImageClassification, hidden_size=32,
                     num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=IMAGE, patch_size=4,
                     num_labels=3), "image", {"Dinov2Layer": 2}, None, {"add", "gelu", "layer_norm"}),  # layer scale
    "beit": (_make(transformers.BeitConfig, transformers.BeitForImageClassification, hidden_size=32,
                   num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=IMAGE, patch_size=4,
                   num_labels=3), "image", {"BeitLayer": 2}, None, {"add", "gelu", "layer_norm"}),
    "mobilevit": (_make(transformers.MobileViTConfig, transformers.MobileViTForImageClassification, image_size=IMAGE,
                        patch_size=2, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 8, 8, 8, 8, 16],
                        num_labels=3),  # convolutions and transformer layers, three classes of block
                  "image", {"MobileViTMobileNetLayer": 1, "MobileViTInvertedResidual": 3,
                            "MobileViTTransformerLayer": 9}, None, {"layer_norm", "silu"}),
    "swin": (_make(transformers.SwinConfig, transformers.SwinForImageClassification, image_size=IMAGE, patch_size=2,
                   embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=2, num_labels=3),
             "image", {"SwinLayer": 4}, None, {"gelu", "layer_norm"}),
    "convnext": (_make(transformers.ConvNextConfig, transformers.ConvNextForImageClassification, num_stages=2,
                       hidden_sizes=[8, 16], depths=[2, 2], num_labels=3, image_size=IMAGE),
                 "image", {"ConvNextLayer": 4}, None, {"gelu", "layer_norm"}),
    "resnet": (_make(transformers.ResNetConfig, transformers.ResNetForImageClassification, embedding_size=8,
                     hidden_sizes=[8, 16], depths=[2, 2], num_labels=3),  # four bottlenecks: one level in
               "image", {"ResNetConvLayer": 12}, None, set()),  # convolutions read bf16 already
}


def batch_of(kind: str, dtype: torch.dtype) -> dict:
    data = torch.Generator().manual_seed(2)
    if kind == "speech":  # eight mel bins, sixteen frames
        return {"input_features": torch.randn(2, 8, SEQ, generator=data, dtype=dtype),
                "labels": torch.randint(2, VOCAB, (2, 8), generator=data)}
    if kind == "text and image":  # a contrastive loss over the batch's pairs
        return {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=data), "return_loss": True,
                "pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=data, dtype=dtype)}
    if kind == "image":
        return {"pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=data, dtype=dtype),
                "labels": torch.randint(0, 3, (2,), generator=data)}
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=data)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, -5:] = 0  # padding: a mask for every block
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def without_caches(model):
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False
    return model


def step(model, batch, autocast: bool = False):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def same(a, b) -> bool:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return torch.equal(loss_a, loss_b) and len(grads_a) == len(grads_b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(grads_a, grads_b))


@functools.cache
def float64_reference(name: str):
    """The model in float64 as built (caches on), its batch, and plain autograd's loss and gradients."""
    make, kind, _, _, _ = ZOO[name]
    model = make().double()
    batch = batch_of(kind, torch.float64)
    return model, batch, step(without_caches(copy.deepcopy(model)), batch)


@pytest.mark.parametrize("name", ZOO)
def test_the_blocks_are_found(name):
    make, _, expected, block_classes, _ = ZOO[name]
    units = find_units(make(), block_classes)
    found: dict[str, int] = {}
    for unit in units:
        if unit.kind == "block":
            found[unit.class_name] = found.get(unit.class_name, 0) + 1
    assert found == expected
    assert len({id(u.module) for u in units}) == len(units)
    assert not any(isinstance(u.module, (torch.nn.ModuleList, torch.nn.ModuleDict)) for u in units)  # never called


def test_the_layers_of_a_module_list_between_blocks_are_gaps_not_the_list():
    """ConvNeXt's stages call their downsampling layers from a ModuleList, which is never called
    itself: a unit of it would see nothing of the step."""
    make = ZOO["convnext"][0]
    gaps = [u.name for u in find_units(make()) if u.kind == "gap"]
    assert "convnext.encoder.stages.1.downsampling_layer.0" in gaps
    assert "convnext.encoder.stages.1.downsampling_layer.1" in gaps
    assert "convnext.encoder.stages.1.downsampling_layer" not in gaps


@pytest.mark.parametrize("decision", list(Decision), ids=lambda d: d.value)
@pytest.mark.parametrize("name", ZOO)
def test_every_decision_trains_as_plain_autograd_in_float64(name, decision):
    model, batch, plain = float64_reference(name)
    units = find_units(model, ZOO[name][3])
    director = Fixed(decisions_for(units, decision))
    runtime = Runtime(model, units, torch.device("cpu"), director, window=1 << 20, min_bytes=1)
    runtime.attach()
    try:
        planned = step(model, batch)
        moved = runtime.transfers.stats.out_bytes
    finally:
        runtime.detach()
    assert same(planned, plain)  # dropout masks and expert routing replayed exactly
    assert director.ended == [True]
    assert (moved > 0) == (decision is not Decision.KEEP)


class RebuiltPerCall:
    """Per call of a rebuilt unit: the places calibration found, and the saves replay rebuilt."""

    def __init__(self, monkeypatch):
        self.calls: dict[int, list] = {}
        pack = rebuilt_module.RebuiltSaves._pack

        def counting(saves, tensor):
            out = pack(saves, tensor)
            seen = self.calls.setdefault(id(saves), [len(saves._recipes.places), 0, saves])
            seen[1] += type(out) in (rebuilt_module._Rebuilt, rebuilt_module._MadeAgain)
            return out
        monkeypatch.setattr(rebuilt_module.RebuiltSaves, "_pack", counting)


@pytest.mark.parametrize("name", ZOO)
def test_the_planner_rebuilds_under_autocast_as_plain_autograd_trains(name, monkeypatch):
    make, kind, _, block_classes, calls = ZOO[name]
    model = make()
    plain = without_caches(copy.deepcopy(model))
    batch = batch_of(kind, torch.float32)
    planner = BlockPlanner(model, "1GiB", decisions=["rebuild"], block_classes=block_classes, lean_loss=False)
    planner._runtime.min_bytes = 1  # the tiny models' tensors are far below 1 MiB
    try:
        for _ in range(2):
            step(model, batch, autocast=True)
        counter = RebuiltPerCall(monkeypatch)
        planned = step(model, batch, autocast=True)  # its start closed the calibration: the plan's step
        assert planner.plan.counts()["rebuild"] == sum(u.kind == "block" for u in planner.units)
        assert same(planned, step(plain, batch, autocast=True))
        places = next(iter(planner._shapes.values())).recipes
    finally:
        planner.remove()
    rebuilt = sum(n for _, n, _ in counter.calls.values())
    roots = {r.func.__name__ for unit in places.values() for r in unit.places.values() if r.root == "call"}
    print(f"{name}: {rebuilt} saved tensors rebuilt in {len(counter.calls)} calls of {len(places)} blocks; "
          f"calls rebuilt: {', '.join(sorted(roots)) or 'none (weight casts only)'}")
    assert rebuilt > 0 and roots == calls  # at the least, each block's weights' casts
    assert all(found == done for found, done, _ in counter.calls.values())  # every place calibration found


@functools.cache
def autocast_reference(name: str):
    """The model in float32 as built, its batch, and plain autograd's loss and gradients under autocast."""
    make, kind, _, _, _ = ZOO[name]
    model = make()
    batch = batch_of(kind, torch.float32)
    return model, batch, step(without_caches(copy.deepcopy(model)), batch, autocast=True)


@pytest.mark.parametrize("decision", list(Decision), ids=lambda d: d.value)
@pytest.mark.parametrize("name", ZOO)
def test_every_decision_trains_as_plain_autograd_under_autocast(name, decision):
    model, batch, plain = autocast_reference(name)
    units = find_units(model, ZOO[name][3])
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, decision)), 1 << 20, min_bytes=1)
    runtime.attach()
    try:
        planned = step(model, batch, autocast=True)
    finally:
        runtime.detach()
    assert same(planned, plain)


# A tensor several units read (an encoder's output in every decoder block, T5's position bias,
# ALBERT's one layer and its weights' casts) takes a share of its gradient from each. Recomputed
# as one node, a unit's shares are summed before they meet the others': the same sum, added in
# another order, equal to rounding.
SHARED_BY_UNITS = {"t5", "bart", "whisper", "albert"}


@pytest.mark.parametrize("autocast", [False, True], ids=["float64", "autocast"])
@pytest.mark.parametrize("decision", [Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED], ids=lambda d: d.value)
@pytest.mark.parametrize("name", ZOO)
def test_a_unit_recomputed_as_one_node_trains_as_plain_autograd(name, decision, autocast):
    """The first step recomputes through torch.utils.checkpoint and finds that every block reaches
    only its arguments and parameters; the second recomputes each as one node (rerun.py)."""
    model, batch, plain = autocast_reference(name) if autocast else float64_reference(name)
    units = find_units(model, ZOO[name][3])
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, decision)), 1 << 20, min_bytes=1)
    runtime.attach()
    try:
        assert same(step(model, batch, autocast), plain)
        assert all(runtime._shown[j] for j, u in enumerate(units) if u.kind == "block")
        second = step(model, batch, autocast)
    finally:
        runtime.detach()
    if name not in SHARED_BY_UNITS:
        assert same(second, plain)
        return
    (loss, grads), (plain_loss, plain_grads) = second, plain
    rtol = 2e-2 if autocast else 1e-12  # bfloat16's rounding; float64's
    scale = max(p.abs().max() for p in plain_grads if p is not None)  # a zero sum may round to 1e-20
    assert torch.allclose(loss, plain_loss, rtol=rtol)
    assert all(torch.allclose(g, p, rtol=rtol, atol=rtol * scale) for g, p in zip(grads, plain_grads)
               if p is not None)


def test_a_model_that_checkpoints_its_own_layers_trains_as_it_does_alone():
    """um_alloc.plan on a model whose layers Hugging Face already checkpoints (the launcher and the
    callbacks leave such a model alone; a script may not): the planner's recomputation, as one
    node from the second step, nests around the model's own, and dropout's masks and the
    gradients are what the model computes alone."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=3, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    model.train().config.use_cache = False
    alone = copy.deepcopy(model)
    for m in (model, alone):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = batch_of("text", torch.float32)
    planner = BlockPlanner(model, "1GiB", decisions=["recompute"], lean_loss=False)
    planner._runtime.min_bytes = 1
    try:
        for _ in range(3):
            assert same(step(model, batch), step(alone, batch))
        assert [planner._runtime._reruns[j] for j, u in enumerate(planner.units) if u.kind == "block"] == [True] * 3
    finally:
        planner.remove()


def test_a_mixture_of_experts_with_its_balancing_loss_stays_with_checkpoint():
    """Mixtral's router logits, caught by Hugging Face's hooks inside each layer, feed the
    balancing loss: they leave the layers other than among their outputs, so the layers stay
    with torch.utils.checkpoint, which keeps their graph."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                                        experts_implementation="eager", output_router_logits=True,
                                        router_aux_loss_coef=0.5, **DECODER)
    model = transformers.MixtralForCausalLM(config).train().double()
    batch = batch_of("text", torch.float64)
    plain = step(without_caches(copy.deepcopy(model)), batch)
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, Decision.RECOMPUTE)), 1 << 20,
                      min_bytes=1)
    runtime.attach()
    try:
        for _ in range(2):
            assert same(step(model, batch), plain)
    finally:
        runtime.detach()
    assert [runtime._reruns[j] for j, u in enumerate(units) if u.kind == "block"] == [False, False]


class LowRankAdapted(torch.nn.Module):
    """A frozen projection plus a trainable low-rank update (LoRA's shape, without the library)."""

    def __init__(self, base: torch.nn.Module, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        inputs, outputs = base.weight.shape  # GPT-2's Conv1D: (in, out)
        self.down = torch.nn.Parameter(0.1 * torch.randn(inputs, rank))
        self.up = torch.nn.Parameter(0.1 * torch.randn(rank, outputs))

    def forward(self, x):
        return self.base(x) + (x @ self.down) @ self.up


@pytest.mark.parametrize("decision", list(Decision), ids=lambda d: d.value)
def test_a_frozen_model_with_low_rank_adapters_trains_as_plain_autograd(decision):
    """A fine-tune of adapters alone: every weight of the model frozen, a trainable low-rank
    update beside each attention projection. The blocks' own parameters need no gradient, their
    adapters do, and the embeddings' output needs none: every decision gives plain autograd's
    loss and adapter gradients, bit for bit in float64, in three steps."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=2, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train().requires_grad_(False)
    for block in model.transformer.h:
        block.attn.c_attn = LowRankAdapted(block.attn.c_attn)
    model = without_caches(model.double())
    batch = batch_of("text", torch.float64)
    plain = step(copy.deepcopy(model), batch)
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, decision)), 1 << 20, min_bytes=1)
    runtime.attach()
    try:
        for _ in range(3):  # the second and third recompute as one node where the first showed they may
            assert same(step(model, batch), plain)
    finally:
        runtime.detach()
    assert sum(g is not None for g in plain[1]) == 2 * 3  # the adapters' gradients, and only theirs
