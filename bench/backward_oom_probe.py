"""After an out-of-memory error in backward, what of the failed step is still on the GPU?

A small BERT (8 layers of 512, batch 32 of 512 tokens, bf16 autocast, fused AdamW) trains three
steps; the fourth fails in backward where the gradient reaches layer 1's output, by a hook that
raises (``python``) or that asks the GPU for 1 TiB (``cuda``). Prints the live bytes (MiB) between
steps, after the failure, after Python's cycle collector, after a tiny backward, and after the
next step's forward, as one JSON line.

    python bench/backward_oom_probe.py cuda                # stock PyTorch
    python bench/backward_oom_probe.py cuda rebuild        # um_alloc, the planner forcing a decision
"""
from __future__ import annotations

import argparse
import gc
import json

import torch

MiB = 1 << 20
DECISIONS = ("keep", "rebuild", "recompute", "recompute_moved", "move")


def small_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=1024, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                        intermediate_size=2048)
    return BertForMaskedLM(config).cuda().train()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("error", choices=("python", "cuda"))
    p.add_argument("decision", nargs="?", choices=DECISIONS, help="under um_alloc, every block forced to it")
    args = p.parse_args()
    um_alloc = None
    if args.decision:
        import um_alloc

        um_alloc.install("best.yaml", budget="30GiB")  # before CUDA starts
    model = small_bert()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    planner = um_alloc.plan(model) if um_alloc else None
    layer_output = {}
    model.bert.encoder.layer[1].register_forward_hook(
        lambda module, inputs, out: layer_output.__setitem__("tensor", out[0] if isinstance(out, tuple) else out))

    def fail(grad):
        if args.error == "python":
            raise torch.OutOfMemoryError("raised by a hook")
        torch.empty(1 << 40, dtype=torch.uint8, device="cuda")

    def step(ids, failing: bool) -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        if failing:
            layer_output["tensor"].register_hook(fail)
        layer_output.clear()
        loss.backward()
        optimizer.step()

    def live() -> float:
        torch.cuda.synchronize()
        if planner is None:
            return torch.cuda.memory_allocated() / MiB
        from um_alloc.pool import ChunkPool
        return ChunkPool.for_device(0).device_live()[0] / MiB

    ids = torch.randint(0, 1024, (32, 512), device="cuda")
    for i in range(4):  # the planner measures in two, plans from the third
        if planner is not None and i == 3:
            planner.force(args.decision)
        step(ids, failing=False)
    report = {"between_steps": live()}
    try:
        step(ids, failing=True)
    except torch.OutOfMemoryError:
        pass
    report["after_failure"] = live()
    gc.collect()
    report["after_gc"] = live()
    x = torch.ones(1, device="cuda", requires_grad=True)
    (2 * x).sum().backward()
    report["after_a_tiny_backward"] = live()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids)
    report["after_next_forward"] = live()
    name = args.error + (f" planner {args.decision}" if args.decision else "")
    print(json.dumps({name: {k: round(v) for k, v in report.items()}}))


if __name__ == "__main__":
    main()
