"""Tracked Python objects alive from forward to backward, and cycle collections a step, on a
24-block GPT-2 on the CPU: plain autograd, Hugging Face's gradient checkpointing (PyTorch's
non-reentrant checkpoint), and the planner with every block forced to a decision.

    python bench/results/host_pace/gc_objects.py plain|checkpointing|keep|rebuild|recompute

Prints, for the last steps, the objects gc tracks in forward beyond those before it, and the
collections of each generation the step ran. On the CPU, calibration finds nothing to rebuild in
this model, so `rebuild` runs as `keep` here (the rebuilt count is in NOTE.md, from the GPU).
"""
import gc
import sys

import torch
import transformers

from um_alloc.planner import BlockPlanner

method = sys.argv[1]
config = transformers.GPT2Config(n_embd=64, n_layer=24, n_head=4, vocab_size=97, n_positions=64,
                                 resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(config).train()
if method == "checkpointing":
    model.gradient_checkpointing_enable({"use_reentrant": False})
planner = BlockPlanner(model, "1GiB") if method in ("keep", "rebuild", "recompute") else None
optimizer = torch.optim.AdamW(model.parameters())
ids = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(1))
collections = [0, 0, 0]
gc.callbacks.append(lambda phase, info: phase == "start" and collections.__setitem__(
    info["generation"], collections[info["generation"]] + 1))
for step in range(12):
    if planner is not None and step == 4:
        planner.force(method)
    if step == 6:
        gc.collect()
    before, counted = len(gc.get_objects()), list(collections)
    loss = model(input_ids=ids, labels=ids).loss
    alive = len(gc.get_objects()) - before
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step >= 9:
        print(f"{method}: step {step}, {alive} more objects alive in forward, "
              f"collections by generation {[a - b for a, b in zip(collections, counted)]}")
