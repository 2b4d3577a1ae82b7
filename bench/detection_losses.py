"""Plain against planned training of torchvision's detection models, loss by loss.

    python bench/detection_losses.py fasterrcnn_mobilenet_v3_large_fpn@10.5GiB maskrcnn_resnet50_fpn@14GiB
    python bench/detection_losses.py fasterrcnn_mobilenet_v3_large_fpn@none      # the control: both plain
    python bench/detection_losses.py maskrcnn_resnet50_fpn@14GiB --no-one-node   # checkpoint's recomputation only
    python bench/detection_losses.py fasterrcnn_mobilenet_v3_large_fpn@10.5GiB --float64 --steps 4

Each MODEL@BUDGET builds two copies of the model (no weights, 5 classes) and trains them side by
side for --steps steps on the same batches (four random 480x640 images, three random boxes each,
and masks for Mask R-CNN), each step seeded alike: one copy plainly, the other with the block
planner at BUDGET (`none`: plainly too, which shows what the model's own kernels vary by). um_alloc
is installed with a budget that holds plain training (--pool-budget), so only the plan keeps to
BUDGET. Deterministic algorithms are asked for, with warnings where an op has none. Prints, per
model, whether the two copies' losses are equal, their largest relative difference, both lists,
and the plan.

Recomputation as one node sums a tensor's gradient shares in another order than plain autograd
(docs/planner.md); these models read a backbone layer's output both in the next layer and in the
feature pyramid. --no-one-node recomputes through torch.utils.checkpoint only. --float64 asks
whether the other order is any less right: for --steps steps on the same parameters (no optimizer
steps), it compares the gradients of plain and planned training in float32 with those of plain
training in float64 (the reference), and planned with plain training in float64, each as the
largest difference over the model relative to the reference's largest gradient (the planned
float64 copy's budget is twice BUDGET).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import um_alloc  # noqa: E402
from um_alloc.sizes import positive_size_arg  # noqa: E402

IMAGES, BOXES, CLASSES, HEIGHT, WIDTH = 4, 3, 5, 480, 640


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="MODEL@BUDGET",
                   help="a torchvision.models.detection builder and the planner's budget, or @none")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--pool-budget", default="40GiB", help="um_alloc's own budget (default 40GiB)")
    p.add_argument("--no-one-node", action="store_true",
                   help="recompute through torch.utils.checkpoint only (one_node_recompute=False)")
    p.add_argument("--float64", action="store_true",
                   help="compare gradients with float64 plain training's instead of training (see above)")
    args = p.parse_args(argv)
    bad = [run for run in args.runs if run.count("@") != 1]
    if bad:
        p.error(f"each run is MODEL@BUDGET (a size, or none); got {', '.join(bad)}")
    if args.steps < 3:
        p.error(f"--steps must be at least 3 (two measure, then the plan runs); got {args.steps}")
    for run in args.runs:
        if not run.endswith("@none"):
            try:
                positive_size_arg(run.split("@")[1], f"the budget of {run}", "detection_losses.py")
            except ValueError as error:
                p.error(str(error))
    if args.float64 and any(run.endswith("@none") for run in args.runs):
        p.error("--float64 compares planned training with plain: give each run a budget, not none")
    return args


def build(name: str, dtype: torch.dtype = torch.float32):
    try:
        import torchvision
    except ImportError:
        raise SystemExit("detection_losses.py: the models are torchvision's; install torchvision") from None
    torch.manual_seed(0)
    with um_alloc.tag("parameter"):
        model = getattr(torchvision.models.detection, name)(weights=None, weights_backbone=None,
                                                            num_classes=CLASSES).to("cuda", dtype).train()
    return model, torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9)


def batch(generator: torch.Generator, masks: bool) -> tuple[list, list]:
    images = [torch.rand(3, HEIGHT, WIDTH, generator=generator).cuda() for _ in range(IMAGES)]
    targets = []
    for _ in range(IMAGES):
        corner = torch.rand(BOXES, 2, generator=generator) * 300
        boxes = torch.cat([corner, corner + 40 + torch.rand(BOXES, 2, generator=generator) * 100], dim=1)
        target = {"boxes": boxes.cuda(), "labels": torch.randint(1, CLASSES, (BOXES,), generator=generator).cuda()}
        if masks:
            target["masks"] = (torch.rand(BOXES, HEIGHT, WIDTH, generator=generator) > 0.5).to(torch.uint8).cuda()
        targets.append(target)
    return images, targets


def side_by_side(name: str, budget: str, steps: int, one_node: bool) -> dict:
    copies = {"plain": build(name), "planned": build(name)}
    planner = None if budget == "none" else um_alloc.plan(copies["planned"][0], budget=budget,
                                                          one_node_recompute=one_node)
    generator = torch.Generator().manual_seed(1)
    losses = {"plain": [], "planned": []}
    try:
        for step in range(steps):
            images, targets = batch(generator, masks="mask" in name)
            for which, (model, optimizer) in copies.items():
                torch.manual_seed(step)
                loss = sum(model(images, targets).values())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses[which].append(loss.item())
        plan = None if planner is None or planner.plan is None else planner.table().splitlines()[-1]
        return {**losses, "plan": plan}
    finally:
        if planner is not None:
            planner.remove()


def against_float64(name: str, budget: str, steps: int, one_node: bool) -> list[dict]:
    """Per step, each copy's largest gradient difference from plain float64 training's, relative
    to the largest gradient of that reference; the parameters stay as built. The planned float64
    copy's budget is twice `budget`: its tensors are twice as large."""
    models = {which: build(name, torch.float64 if which.endswith("64") else torch.float32)[0]
              for which in ("plain64", "plain32", "planned32", "planned64")}
    float32_budget = positive_size_arg(budget, "a run's budget", "detection_losses.py")
    planners = [um_alloc.plan(models[which], budget=float32_budget * (2 if which.endswith("64") else 1),
                              one_node_recompute=one_node) for which in ("planned32", "planned64")]
    generator = torch.Generator().manual_seed(1)
    rows = []
    try:
        for step in range(steps):
            images, targets = batch(generator, masks="mask" in name)
            grads = {which: _gradients(model, images, targets, step) for which, model in models.items()}
            scale = max(float(g.abs().max()) for g in grads["plain64"].values())
            row = {which: _largest_difference(grads[which], grads["plain64"]) / scale
                   for which in ("plain32", "planned32", "planned64")}
            row["planned32 vs plain32"] = _largest_difference(grads["planned32"], grads["plain32"]) / scale
            rows.append(row)
        return rows
    finally:
        for planner in planners:
            planner.remove()


def _largest_difference(grads: dict, reference: dict) -> float:
    return max(float((g - reference[name]).abs().max()) for name, g in grads.items())


def _gradients(model, images: list, targets: list, step: int) -> dict:
    """The step's gradients in float64, the model's own cleared."""
    dtype = next(model.parameters()).dtype
    images = [image.to(dtype) for image in images]
    targets = [{k: v.to(dtype) if v.is_floating_point() else v for k, v in target.items()} for target in targets]
    torch.manual_seed(step)
    sum(model(images, targets).values()).backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def report_float64(name: str, rows: list[dict]) -> None:
    print(f"{name}: largest gradient difference from plain float64 training, relative to its largest gradient")
    print(f"  {'step':>4} {'plain float32':>14} {'planned float32':>16} {'planned float64':>16} {'planned-plain float32':>22}")
    for step, row in enumerate(rows, 1):
        print(f"  {step:>4} {row['plain32']:>14.3g} {row['planned32']:>16.3g} {row['planned64']:>16.3g} "
              f"{row['planned32 vs plain32']:>22.3g}")


def report(name: str, result: dict) -> None:
    plain, planned = result["plain"], result["planned"]
    differs = max(abs(a - b) / abs(a) for a, b in zip(plain, planned))
    print(f"{name}: losses equal: {plain == planned}; largest relative difference {differs:.3g}")
    print(f"  plain   {[round(x, 5) for x in plain]}")
    print(f"  planned {[round(x, 5) for x in planned]}")
    print(f"  plan: {result['plan']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("detection_losses.py: needs a CUDA device", file=sys.stderr)
        return 2
    um_alloc.install("best.yaml", budget=args.pool_budget)
    torch.use_deterministic_algorithms(True, warn_only=True)
    for run in args.runs:
        name, budget = run.split("@")
        if args.float64:
            report_float64(name, against_float64(name, budget, args.steps, not args.no_one_node))
        else:
            report(name, side_by_side(name, budget, args.steps, not args.no_one_node))
    return 0


if __name__ == "__main__":
    sys.exit(main())
