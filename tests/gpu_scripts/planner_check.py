"""The block planner on a GPU under um_alloc, in a fresh process (install precedes CUDA).

    python tests/gpu_scripts/planner_check.py equal   # prints a JSON line: planned vs plain losses
    python tests/gpu_scripts/planner_check.py rebuild # the same, every block kept with its casts and GELU rebuilt
    python tests/gpu_scripts/planner_check.py oom     # a planned step runs out of memory, is replanned, trains
    python tests/gpu_scripts/planner_check.py overflow  # more than the budget: host memory, plain's losses
    python tests/gpu_scripts/planner_check.py past_budget  # the safe mode itself passes the budget: it trains
    python tests/gpu_scripts/planner_check.py compiled # a ViT through torch.compile (inductor): plain's losses, closely
    python tests/gpu_scripts/planner_check.py lean    # the chunked cross-entropy against PyTorch's, bit for bit
    python tests/gpu_scripts/planner_check.py gpt2    # a loss of upcast logits, taken narrow: plain's losses
    python tests/gpu_scripts/planner_check.py lengths # a sequence length per step: borrowed plans, plain's losses
    python tests/gpu_scripts/planner_check.py arenas  # between steps the step arenas are wholly free
    python tests/gpu_scripts/planner_check.py large_batch  # large_batch.yaml: host optimizer state, spilled head
    python tests/gpu_scripts/planner_check.py failed  # what a step that ran out of memory leaves live, per decision
    python tests/gpu_scripts/planner_check.py pairs   # two forwards before each backward: one step, plain's losses
    python tests/gpu_scripts/planner_check.py penalty # a critic with a gradient penalty (create_graph): plain's losses
    python tests/gpu_scripts/planner_check.py attributes  # a U-Net's blocks held as attributes, and a model
                                                          # with no blocks, its layers moved: plain's losses

Two identical small BERT models see the same batches and seeds; one trains plainly, the other
with the planner attached (two measured steps in the safe mode, then the plan).
"""
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
import torch

import um_alloc
from um_alloc.planner import fused_tree
from um_alloc.rebuild import MATMUL_FUNCTIONS

MiB = 1 << 20


def bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                        intermediate_size=1024, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    with um_alloc.tag("parameter"):
        model = BertForMaskedLM(config).cuda().train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, optimizer, inputs: dict) -> float:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**inputs).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def step(model, optimizer, ids, seed):
    torch.manual_seed(seed)
    return train_step(model, optimizer, {"input_ids": ids, "labels": ids})


def side_by_side(make, batch, decisions=None, **options) -> tuple[dict, object]:
    """Two models from `make` see the same six batches (`batch(generator)`) and seeds, one plain,
    one planned (with the planner's `options`), its loss chunked however small; their losses, and
    the planner."""
    plain, plain_opt = make()
    planned, planned_opt = make()
    planner = um_alloc.plan(planned, budget="2GiB", decisions=decisions, **options)
    planner._runtime.lean_loss.min_bytes = 0  # the loss is small here: chunk it anyway, to compare
    data = torch.Generator().manual_seed(1)
    losses = {"plain": [], "planned": []}
    for i in range(6):
        ids = batch(data).cuda()
        losses["plain"].append(step(plain, plain_opt, ids, i))
        losses["planned"].append(step(planned, planned_opt, ids, i))
    return losses, planner


def equal(decisions=None) -> dict:
    losses, planner = side_by_side(bert, lambda data: torch.randint(5, 1024, (16, 128), generator=data), decisions)
    return {**losses, "plan": made_plan(planner).counts(), "moved": made_plan(planner).moved_bytes,
            "lean_loss_calls": planner.to_dict()["lean_loss_calls"],
            "rebuildable_bytes": sum(u.rebuildable_bytes for u in planner.calibration.units)}


def lengths() -> dict:
    """A length per step, as dynamic padding gives them, every block rebuilt where the input has a
    plan of its own: shorter inputs run 128's best plan without rebuilds, which with nothing else
    allowed is the safe mode's (recomputed from copies in host memory), 144 runs 160's."""
    plain, plain_opt = bert()
    planned, planned_opt = bert()
    planner = um_alloc.plan(planned, budget="2GiB", decisions=["rebuild"])
    data = torch.Generator().manual_seed(1)
    losses, borrowed = {"plain": [], "planned": []}, []
    for i, length in enumerate([128, 128, 128, 96, 128, 64, 112, 160, 144, 160, 80, 128]):
        ids = torch.randint(5, 1024, (16, length), generator=data).cuda()
        losses["plain"].append(step(plain, plain_opt, ids, i))
        losses["planned"].append(step(planned, planned_opt, ids, i))
        if "last_step_ran_plan_of" in planner.to_dict()["inputs"]:
            borrowed.append((length, planner.plan.counts()))
    return {**losses, "safe_steps": planner.safe_steps, "inputs": planner.to_dict()["inputs"], "borrowed": borrowed}


def pairs() -> dict:
    """Two batches a step, one loss over both (a pair loss's shape): plain's losses, and the
    blocks' kept bytes measured for both forwards, against a planner of one batch a step. (In one
    autocast region the two forwards would share each weight's bf16 cast, whose gradient a block
    recomputed as one node sums in another order: docs/planner.md.)"""
    plain, plain_opt = bert()
    planned, planned_opt = bert()
    planner = um_alloc.plan(planned, budget="2GiB")
    data = torch.Generator().manual_seed(1)
    losses = {"plain": [], "planned": []}
    for i in range(6):
        first, second = (torch.randint(5, 1024, (16, 128), generator=data).cuda() for _ in range(2))
        for name, model, optimizer in (("plain", plain, plain_opt), ("planned", planned, planned_opt)):
            torch.manual_seed(i)
            loss = 0.0
            for ids in (first, second):  # an autocast region each: no weight's cast is read by both
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = loss + model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    pair_kept = _blocks_kept_bytes(planner)
    result = {**losses, "safe_steps": planner.safe_steps, "plan": made_plan(planner).counts()}
    planner.remove()
    single, single_opt = bert()
    planner = um_alloc.plan(single, budget="2GiB")
    for i in range(3):
        step(single, single_opt, torch.randint(5, 1024, (16, 128), generator=data).cuda(), i)
    return {**result, "pair_kept_bytes": pair_kept, "single_kept_bytes": _blocks_kept_bytes(planner)}


def _blocks_kept_bytes(planner) -> int:
    """What the measured step found its blocks save when kept, over all their calls."""
    return sum(u.saved_bytes for u in planner.calibration.units if u.kind == "block")


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512,
                       image_size=64, patch_size=8, num_labels=10, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    with um_alloc.tag("parameter"):
        model = ViTForImageClassification(config).cuda().train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def compiled() -> dict:
    """A small ViT through torch.compile (inductor) under the planner, beside the same model plain
    and eager. Compiled, transformers materialises an attention mask expanded to the batch, which
    every layer takes; every input is parked however small, so the mask would move if it could.
    The safe steps move the loss outside the units, whose saved-tensor hooks are traced into the
    compiled graph of what lies between the units."""
    plain, plain_opt = vit()
    model, optimizer = vit()
    planner = um_alloc.plan(model, budget="2GiB")
    planner._runtime.lean_loss.min_bytes = 0
    planner._runtime.min_bytes = 0
    call = torch.compile(model)
    data = torch.Generator().manual_seed(1)
    losses = {"plain": [], "planned": []}
    for _ in range(6):
        batch = {"pixel_values": torch.randn(16, 3, 64, 64, generator=data).cuda(),
                 "labels": torch.randint(0, 10, (16,), generator=data).cuda()}
        losses["plain"].append(train_step(plain, plain_opt, batch))
        losses["planned"].append(train_step(call, optimizer, batch))
    return {**losses, "plan": made_plan(planner).counts(), "safe_steps": planner.safe_steps}


class CriticLayer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x)) + x


def critic(width: int = 1024):
    torch.manual_seed(0)
    with um_alloc.tag("parameter"):
        model = torch.nn.Sequential(*[CriticLayer(width) for _ in range(4)], torch.nn.Linear(width, 1)).cuda()
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def penalty() -> dict:
    """WGAN-GP's critic, plain and planned, on the same batches: three forwards before each
    backward, one differentiated with create_graph=True. The safe mode recomputes from inputs in
    host memory (1 MiB each here), which one node cannot differentiate twice: from the first
    penalty on they go through torch.utils.checkpoint."""
    plain, plain_opt = critic()
    planned, planned_opt = critic()
    planner = um_alloc.plan(planned, budget="2GiB", block_classes=["CriticLayer"])
    data = torch.Generator().manual_seed(1)
    losses = {"plain": [], "planned": []}
    for i in range(6):
        real, fake = (torch.randn(256, 1024, generator=data).cuda() for _ in range(2))
        alpha = torch.rand(256, 1, generator=data).cuda()
        for name, model, optimizer in (("plain", plain, plain_opt), ("planned", planned, planned_opt)):
            between = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            grad, = torch.autograd.grad(model(between).sum(), between, create_graph=True)
            loss = model(fake).mean() - model(real).mean() + 10 * ((grad.norm(dim=1) - 1) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    return {**losses, "safe_steps": planner.safe_steps, "plan": made_plan(planner).counts(),
            "second_derivatives": planner._runtime.second_derivatives}


class Down(torch.nn.Module):
    def __init__(self, into: int, out: int):
        super().__init__()
        self.conv, self.norm = torch.nn.Conv2d(into, out, 3, padding=1), torch.nn.BatchNorm2d(out)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


class Up(torch.nn.Module):
    def __init__(self, into: int, out: int):
        super().__init__()
        self.conv = torch.nn.Conv2d(into, out, 3, padding=1)

    def forward(self, x, skip):
        return torch.relu(self.conv(torch.cat([torch.nn.functional.interpolate(x, scale_factor=2.0), skip], dim=1)))


class UNet(torch.nn.Module):
    """Its blocks held one by one as attributes, in no ModuleList or Sequential."""

    def __init__(self):
        super().__init__()
        self.down1, self.down2, self.down3 = Down(3, 32), Down(32, 64), Down(64, 128)
        self.up2, self.up1 = Up(128 + 64, 64), Up(64 + 32, 32)
        self.out = torch.nn.Conv2d(32, 1, 1)

    def forward(self, x):
        a = self.down1(x)
        b = self.down2(torch.nn.functional.max_pool2d(a, 2))
        c = self.down3(torch.nn.functional.max_pool2d(b, 2))
        return self.out(self.up1(self.up2(c, b), a))


def layers_in_sequentials() -> torch.nn.Module:
    """A VGG's shape: no blocks, its layers gaps."""
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(64 * 16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))


def image_losses(build, moved_from: int | None = None, chained_from: int | None = None) -> dict:
    """Plain and planned training of `build()` on the same six batches of 64x64 images; with
    `moved_from`, every unit forced to move from that step on; with `chained_from`, every unit
    rerun in backward as one chain from the first one's input (chain.py)."""
    models = {}
    for name in ("plain", "planned"):
        torch.manual_seed(0)
        with um_alloc.tag("parameter"):
            model = build().cuda().train()
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    planner = um_alloc.plan(models["planned"][0], budget="2GiB")
    data = torch.Generator().manual_seed(1)
    losses = {"plain": [], "planned": []}
    for i in range(6):
        if i == moved_from:
            planner.force(["move"] * (len(planner.units) + 1))
        if i == chained_from:
            planner.force(["recompute"] + ["chained"] * (len(planner.units) - 1) + ["keep"])
        images = torch.randn(16, 3, 64, 64, generator=data).cuda()
        for name, (model, optimizer) in models.items():
            torch.manual_seed(i)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(images).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    blocks = sum(u.kind == "block" for u in planner.units)
    return {**losses, "blocks": blocks, "gaps": len(planner.units) - blocks, "plan": made_plan(planner).counts(),
            "moved_out_bytes": planner._runtime.transfers.stats.out_bytes}


def attributes() -> dict:
    return {"unet": image_losses(UNet), "sequential": image_losses(layers_in_sequentials, moved_from=3)}


def chain() -> dict:
    """A VGG's layers, gaps, rerun in backward as one chain from the fourth step on (BatchNorm,
    in-place ReLUs, a dropout of 0.1, bf16 autocast)."""
    return image_losses(layers_in_sequentials, chained_from=3)


def rebuild() -> dict:
    """Every block kept with its cheap saves rebuilt in backward (dropout 0.1, bf16 autocast)."""
    return equal(decisions=["rebuild"])


def one_node() -> dict:
    """Every block recomputed, from the second step as one node of the graph (rerun.py): the
    dropout masks drawn again from the GPU's RNG state, under bf16 autocast."""
    losses, planner = side_by_side(bert, lambda data: torch.randint(5, 1024, (16, 128), generator=data),
                                   ["recompute"])
    runtime = planner._runtime
    return {**losses, "plan": made_plan(planner).counts(),
            "one_node_blocks": sum(bool(ok) for ok, u in zip(runtime._reruns, runtime.units) if u.kind == "block")}


def oom() -> dict:
    model, optimizer = bert()
    planner = um_alloc.plan(model, budget="2GiB", margin=0, overflow=0)  # the out-of-memory path itself
    hog = {"left": 1}

    def eat(module, args):  # once, in a planned step: more than the budget leaves
        if hog["left"] and planner.plan is not None:
            hog["left"] = 0
            torch.empty(4 << 30, dtype=torch.uint8, device="cuda")

    handle = model.bert.encoder.layer[3].register_forward_pre_hook(eat)
    data = torch.Generator().manual_seed(1)
    losses, retried, margin = [], 0, planner.margin
    for i in range(6):
        ids = torch.randint(5, 1024, (16, 128), generator=data).cuda()
        while True:
            try:
                losses.append(step(model, optimizer, ids, i))
                break
            except torch.OutOfMemoryError:
                optimizer.zero_grad(set_to_none=True)
                retried += 1
    handle.remove()
    return {"losses": losses, "retried": retried, "margin_before": margin, "margin_after": planner.margin}


def past_the_budget(pool, budget: int) -> tuple:
    """All the backing the hard budget has left, then more than any free run holds: a request
    whose new chunks the budget refuses. Both tensors, the second partly in host memory."""
    hold = torch.ones((budget - pool.device_backed()[0]) // (2 * MiB) * (2 * MiB), dtype=torch.uint8, device="cuda")
    over = torch.full((pool.raw_stats()["largest_free_run_bytes"] + 2 * MiB,), 7, dtype=torch.uint8, device="cuda")
    return hold, over


def made_plan(planner):
    """The plan the planner made for the current input: while it is tried against its runners-up
    (three steps at a time, in turn and back), a check's last step may run a runner-up."""
    shape = planner._current_shape()
    trials = shape.trials if shape is not None else None
    return trials.tried[0].plan if trials else planner.plan


def six_steps_each(plain, planned) -> dict:
    """Six steps of the same batches and seeds for each (model, optimizer) pair: their losses."""
    data = torch.Generator().manual_seed(1)
    losses = {"plain": [], "planned": []}
    for i in range(6):
        ids = torch.randint(5, 1024, (16, 128), generator=data).cuda()
        losses["plain"].append(step(*plain, ids, i))
        losses["planned"].append(step(*planned, ids, i))
    return losses


def overflow() -> dict:
    """A planned step needs more than the 4 GiB hard budget holds: the pool puts the excess in host
    memory the GPU maps, kernels write and read it there, the step trains as plain training does,
    and the planner plans again with the margin grown by it."""
    plain, plain_opt = bert()
    model, optimizer = bert()
    planner = um_alloc.plan(model, budget="4GiB", overflow="2GiB")
    pool = um_alloc.ChunkPool.for_device(0)
    budget, hog = 4 << 30, {"left": 1}

    def need_more_than_the_budget(module, args):  # once, in the first planned step
        if not hog["left"] or planner.plan is None:
            return
        hog["left"] = 0
        hold, over = past_the_budget(pool, budget)
        hog["over_bytes"] = pool.raw_stats()["overflow_bytes"]  # its chunks the budget could not back
        hog["over_host"] = pool.block_at(over.data_ptr() + over.numel() - 1).residency == "host"
        hog["over_ok"] = bool((over[:: 1 << 16] == 7).all()) and bool((hold[:: 1 << 16] == 1).all())

    handle = model.bert.encoder.layer[3].register_forward_pre_hook(need_more_than_the_budget)
    margin = planner.margin
    losses = six_steps_each((plain, plain_opt), (model, optimizer))
    handle.remove()
    stats = um_alloc.memory_stats()
    return {**losses, **{k: hog.get(k) for k in ("over_ok", "over_host", "over_bytes")}, "margin_before": margin,
            "margin_after": planner.margin, "overflowed_steps": planner.overflowed_steps,
            "overflow_allocations": stats["overflow_allocations"], "num_ooms": stats["num_ooms"],
            "peak_gpu_backed_bytes": stats["peak_gpu_backed_bytes"], "budget_bytes": budget}


def past_budget() -> dict:
    """The measuring steps themselves need more than the 4 GiB hard budget holds: they overflow to
    host memory instead of failing, their calibration counts what overflowed, and plans no larger
    than the plan that keeps least then run past the budget (the excess within the overflow) with
    plain training's losses, where the input would have been refused before."""
    plain, plain_opt = bert()
    model, optimizer = bert()
    planner = um_alloc.plan(model, budget="4GiB", overflow="2GiB")
    pool = um_alloc.ChunkPool.for_device(0)
    budget = 4 << 30

    def need_more_than_the_budget(module, args):  # in every measuring step
        if planner.plan is None:
            past_the_budget(pool, budget)

    handle = model.bert.encoder.layer[3].register_forward_pre_hook(need_more_than_the_budget)
    losses = six_steps_each((plain, plain_opt), (model, optimizer))
    handle.remove()
    stats = um_alloc.memory_stats()
    trials = planner._current_shape().trials
    return {**losses, "made": made_plan(planner).made, "tried": [t.plan.made for t in trials.tried] if trials else [],
            "plan": made_plan(planner).counts(), "safe_steps": planner.safe_steps,
            "smallest_budget_bytes": planner.calibration.smallest_budget(0), "margin": planner.margin,
            "overflowed_steps": planner.overflowed_steps, "overflow_allocations": stats["overflow_allocations"],
            "num_ooms": stats["num_ooms"], "peak_gpu_backed_bytes": stats["peak_gpu_backed_bytes"],
            "budget_bytes": budget}


def failed() -> dict:
    """Per decision, the pool's live bytes between planned steps, after a step that ran out of
    memory (a real CUDA error: 1 TiB asked for) at the head, after the blocks' forward, or in
    backward between two blocks, once its partial gradients are dropped, and after the next step."""
    out = {}
    for decision in ("keep", "rebuild", "move", "recompute"):
        for where in ("forward", "backward"):
            model, optimizer = bert()
            planner = um_alloc.plan(model, budget="2GiB", decisions=[decision])
            data = torch.Generator().manual_seed(1)
            for i in range(3):  # two measured steps, then the plan
                step(model, optimizer, torch.randint(5, 1024, (16, 128), generator=data).cuda(), i)
            between = _live()

            def ask_too_much(*_):
                torch.empty(1 << 40, dtype=torch.uint8, device="cuda")

            def in_backward(module, args, output):
                (output[0] if isinstance(output, tuple) else output).register_hook(ask_too_much)

            module = model.cls if where == "forward" else model.bert.encoder.layer[1]
            handle = (module.register_forward_pre_hook(ask_too_much) if where == "forward"
                      else module.register_forward_hook(in_backward))
            try:
                step(model, optimizer, torch.randint(5, 1024, (16, 128), generator=data).cuda(), 3)
                failed_as_asked = False
            except torch.OutOfMemoryError:
                failed_as_asked = True
            handle.remove()
            optimizer.zero_grad(set_to_none=True)
            after_failure = _live()
            step(model, optimizer, torch.randint(5, 1024, (16, 128), generator=data).cuda(), 4)
            out[f"{decision} {where}"] = {"plan": made_plan(planner).counts(), "failed": failed_as_asked,
                                           "between_steps": between, "after_failure": after_failure,
                                           "after_next_step": _live()}
            planner.remove()
            del model, optimizer, planner
    return out


def _live() -> int:
    torch.cuda.synchronize()
    return um_alloc.ChunkPool.for_device(0).device_live()[0]


def arenas() -> dict:
    """What the steps allocate comes from a step arena of its own, and the step arenas are closed
    between steps; training goes on after they are given back."""
    from um_alloc.pool import ChunkPool

    model, optimizer = bert()
    um_alloc.plan(model, budget="2GiB")
    pool = ChunkPool.for_device(torch.cuda.current_device())
    data = torch.Generator().manual_seed(1)
    batches = [torch.randint(5, 1024, (16, 128), generator=data).cuda() for _ in range(6)]
    before = pool.raw_stats()
    losses, open_between, loss = [], [], None
    for i, ids in enumerate(batches[:5]):
        # As most loops do, the last step's loss tensor is still held while the next forward
        # begins, where the planner gives the step arenas back for a new layout.
        torch.manual_seed(i)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        open_between.append(pool.step_arenas())
    after = pool.raw_stats()
    torch.cuda.synchronize()
    released = pool.empty_cache()
    losses.append(step(model, optimizer, batches[5], 5))
    return {"losses": losses, "open_between": open_between, "released": released,
            "arenas": [before["arena_count"], after["arena_count"]],
            "reserved": [before["reserved_bytes"], after["reserved_bytes"]],
            "given_back_in_steps": after["arena_releases"] - before["arena_releases"]}


def lean() -> dict:
    import torch.nn.functional as F

    from um_alloc.planner.lean_loss import chunked_cross_entropy

    out = {}
    cases = [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
    for (dtype, autocast), reduction in [(c, r) for c in cases for r in ("mean", "sum")]:
        torch.manual_seed(0)
        logits = (4 * torch.randn(4096, 30522, device="cuda")).to(dtype).requires_grad_()
        target = torch.randint(0, 30522, (4096,), device="cuda")
        target[::5] = -100
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            plain = F.cross_entropy(logits, target, reduction=reduction)
            chunked = chunked_cross_entropy(logits, target, reduction=reduction, chunk_bytes=32 * MiB)
        plain_grad, = torch.autograd.grad(plain, logits)
        chunked_grad, = torch.autograd.grad(chunked, logits)
        out[f"{dtype}_autocast{autocast}_{reduction}"] = {
            "loss_equal": torch.equal(plain, chunked), "grad_equal": torch.equal(plain_grad, chunked_grad),
            "grad_max_diff": (plain_grad.float() - chunked_grad.float()).abs().max().item()}
    for dtype, autocast in [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)]:
        out[f"upcast_{dtype}_autocast{autocast}"] = _upcast_case(dtype, autocast)
    out["biased_upcast_bfloat16_autocastTrue"] = _upcast_case(torch.bfloat16, True, biased=True)
    from um_alloc.planner import lean_loss
    return {"cases": out, "subtracted": [str(k) for k, v in lean_loss._SUBTRACTION_MATCHES.items() if v],
            "fused": [str(k) for k, v in lean_loss._FUSED.items() if v is not None],
            "compared_fused": [str(k) for k in lean_loss._FUSED]}


def _upcast_case(dtype, autocast: bool, biased: bool = False) -> dict:
    """transformers' loss: narrow logits upcast, flattened, then cross_entropy; under LeanLoss the
    chunked version takes the narrow logits. `biased`: the upcast is BART's, the logits plus an
    fp32 bias over the vocabulary."""
    import torch.nn.functional as F

    from um_alloc.planner.lean_loss import LeanLoss

    # GPT-2's vocabulary: fp32 rows of 50,257 start 4 bytes further each row; two chunks of 1,335 rows.
    torch.manual_seed(0)
    logits = (4 * torch.randn(2, 1024, 50257, device="cuda")).to(dtype).requires_grad_()
    target = torch.randint(0, 50257, (2048,), device="cuda")
    target[::5] = -100
    bias = torch.randn(1, 50257, device="cuda")
    results = []
    for mode in (None, LeanLoss(min_bytes=0)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            if mode is not None:
                mode.__enter__()
            upcast = logits + bias if biased else logits.float()
            loss = F.cross_entropy(upcast.view(-1, 50257), target)
            if mode is not None:
                mode.__exit__(None, None, None)
        results.append((loss, torch.autograd.grad(loss, logits)[0]))
    (plain, plain_grad), (lean, lean_grad) = results
    return {"loss_equal": torch.equal(plain, lean), "grad_equal": torch.equal(plain_grad, lean_grad),
            "took_narrow": mode.upcast_calls == 1}


def small_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=4096, n_embd=256, n_layer=6, n_head=4, n_positions=256)
    with um_alloc.tag("parameter"):
        model = GPT2LMHeadModel(config).cuda().train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def gpt2() -> dict:
    """A small GPT-2, whose loss upcasts its logits (transformers' ForCausalLMLoss), planned and
    plain: the same losses, the loss computed from the bf16 logits."""
    losses, planner = side_by_side(small_gpt2, lambda data: torch.randint(0, 4096, (16, 256), generator=data))
    summary = planner.to_dict()
    return {**losses, "plan": made_plan(planner).counts(), "lean_loss_calls": summary["lean_loss_calls"],
            "lean_loss_upcasts": summary["lean_loss_upcasts"]}


def rebuild_gpt2() -> dict:
    """A small GPT-2 (dropout 0.1, bf16 autocast), every block kept with its cheap saves rebuilt:
    its GELU is a chain of elementwise calls (transformers' NewGELUActivation), whose saves
    backward makes again from the first linear's output. The same losses as plain training, the
    share of a block's saved bytes rebuilt, the places whose tree ran as one kernel, those made
    again from a linear's product (autocast's float32 copy of x, which pow saves), and the kernels
    that made the copy with its readers' tensors (FusedGroup): their members, and their verdicts."""
    groups, launch = [], fused_tree.FusedGroup.launch

    def counted(group, narrow, wide_dtype, view):
        made = launch(group, narrow, wide_dtype, view)
        groups.append(len(group.members) if made is not None else 0)
        return made
    fused_tree.FusedGroup.launch = counted
    try:
        losses, planner = side_by_side(small_gpt2, lambda data: torch.randint(0, 4096, (16, 256), generator=data),
                                       decisions=["rebuild"])
    finally:
        fused_tree.FusedGroup.launch = launch
    blocks = [u for u in planner.calibration.units if u.kind == "block"]
    recipes = next(iter(planner._shapes.values())).recipes
    return {**losses, "plan": made_plan(planner).counts(),
            "rebuilt_share": sum(u.rebuildable_bytes for u in blocks) / sum(u.saved_bytes for u in blocks),
            "fused_places": sum(len(unit.fused) for unit in recipes.values()),
            "product_places": sum(r.root == "call" and r.func in MATMUL_FUNCTIONS
                                  for unit in recipes.values() for r in unit.places.values()),
            "group_members": sorted(set(groups)), "group_launches": sum(n > 0 for n in groups),
            "group_verdicts": list(fused_tree._GROUP_VERDICTS.values())}


def spilled_bert():
    """bert() with large_batch.yaml's parts: AdamW's moments in host memory mapped for the GPU,
    and the MLM head's large allocations spilled to host memory (here those of at least 1 MiB, so
    that the small model's logits spill)."""
    model, optimizer = bert()
    um_alloc.tag_training(model, optimizer)
    um_alloc.spill_from(model.cls, min_size="1MiB")
    return model, optimizer


def large_batch() -> dict:
    """large_batch.yaml's three parts at once: the planner, and spilled_bert()'s two."""
    losses, planner = side_by_side(spilled_bert, lambda data: torch.randint(5, 1024, (16, 128), generator=data))
    tags = um_alloc.memory_stats()["tags"]
    return {**losses, "plan": made_plan(planner).counts(), "spill_peak_bytes": tags["spill"]["peak_bytes"],
            "spill_resident_bytes": tags["spill"]["resident_bytes"]}


def projected() -> dict:
    """The logits made again in backward from the head's input (recompute_logits): spilled_bert()'s
    MLM head, and a small GPT-2's lm_head (tied to its embeddings, its logits upcast by the loss)."""
    out = {}
    for name, make, batch in (("bert_spilled", spilled_bert, lambda data: torch.randint(5, 1024, (16, 128), generator=data)),
                              ("gpt2", small_gpt2, lambda data: torch.randint(0, 4096, (16, 256), generator=data))):
        losses, planner = side_by_side(make, batch, recompute_logits=True)
        summary = planner.to_dict()
        out[name] = {**losses, "lean_loss_calls": summary["lean_loss_calls"],
                     "lean_loss_projected": summary["lean_loss_projected"]}
    return out


MODES = {"equal": equal, "projected": projected, "compiled": compiled, "rebuild": rebuild, "one_node": one_node, "oom": oom,
         "overflow": overflow, "past_budget": past_budget, "lean": lean, "lengths": lengths, "arenas": arenas, "gpt2": gpt2,
         "large_batch": large_batch, "failed": failed, "pairs": pairs, "penalty": penalty, "attributes": attributes,
         "chain": chain, "rebuild_gpt2": rebuild_gpt2}

if __name__ == "__main__":
    torch.use_deterministic_algorithms(True, warn_only=True)  # the two runs compared bit for bit
    um_alloc.install("large_batch.yaml" if sys.argv[1] == "large_batch" else "best.yaml", budget="4GiB")
    print(json.dumps(MODES[sys.argv[1]]()))
