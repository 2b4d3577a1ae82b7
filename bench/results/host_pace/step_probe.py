"""Each step's host and GPU times, by phase, of GPT-2-medium (batch 8 x 1024, bf16, fused AdamW) in
a plain loop that reads each loss, with the cycle collector's runs in the step.

    python bench/results/host_pace/step_probe.py 40GiB                        # keep, rebuild x60, keep, rebuild
    PHASES=rebuild:30 WARM=8 python bench/results/host_pace/step_probe.py 12GiB
    PHASES=auto:30 WARM=12 python bench/results/host_pace/step_probe.py 12GiB  # the planner's own plan
    GCMODE=off python bench/results/host_pace/step_probe.py 40GiB             # the cycle collector off

PHASES: decision:steps, comma separated (a decision forced on every block, or auto). Each row:
host_fwd/host_bwd (the host's clock around forward and backward), step (start to the loss read),
gpu_fwd/gpu_bwd (CUDA events), live_gib (the pool's live bytes), gc (the generation of each
collection that ran in the step) and gc_ms (their time); every tenth row also counts the objects
the cycle collector tracks. Writes $OUT/steps_$TAG_$GCMODE.json and prints each phase's medians."""
import gc, json, os, statistics, sys, time
import torch
import um_alloc
from um_alloc.sizes import parse_size
from um_alloc.pool import ChunkPool
budget = parse_size(sys.argv[1] if len(sys.argv) > 1 else "40GiB", key="budget", source="argv")
um_alloc.install("planner.yaml", budget=budget)
from transformers import GPT2Config, GPT2LMHeadModel
import um_alloc.planner as planning
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, use_cache=False)).cuda().train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
um_alloc.tag_training(model, opt)
planner = planning.plan(model, budget, strategy="auto", lean_loss=True)
pool = ChunkPool.for_device(0)
ids = torch.randint(0, 50257, (8, 1024), generator=torch.Generator().manual_seed(0)).pin_memory()
gcs = []
gc.callbacks.append(lambda phase, info: gcs.append((phase, info["generation"], time.perf_counter())))
def step():
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    gcs.clear()
    t0 = time.perf_counter(); ev[0].record()
    x = ids.cuda(non_blocking=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss
    t1 = time.perf_counter(); ev[1].record()
    loss.backward()
    t2 = time.perf_counter(); ev[2].record()
    opt.step(); opt.zero_grad(set_to_none=True)
    loss.item(); t4 = time.perf_counter()
    gct = sum(b[2] - a[2] for a, b in zip(gcs[::2], gcs[1::2]))
    return dict(host_fwd=round((t1 - t0) * 1e3, 2), host_bwd=round((t2 - t1) * 1e3, 2), step=round((t4 - t0) * 1e3, 2),
                gpu_fwd=round(ev[0].elapsed_time(ev[1]), 2), gpu_bwd=round(ev[1].elapsed_time(ev[2]), 2),
                live_gib=round(pool.device_live()[0] / 2**30, 3), gc=[g[1] for g in gcs[::2]], gc_ms=round(gct * 1e3, 2))
for _ in range(int(os.environ.get("WARM", "4"))):
    step()
rows = []
mode = os.environ.get("GCMODE", "on")
if mode == "off":
    gc.disable()
plan = [(p.split(":")[0], int(p.split(":")[1])) for p in os.environ.get("PHASES", "keep:6,rebuild:60,keep:6,rebuild:10").split(",")]
for phase, n in plan:
    if phase != "auto":
        planner.force(phase)
    for i in range(n):
        r = step(); r["phase"] = phase; r["i"] = i
        if i % 10 == 0:
            r["objects"] = len(gc.get_objects())
        rows.append(r); print(json.dumps(r), flush=True)
print("summary", os.environ.get("TAG"), sys.argv[1], {p: {k: round(statistics.median(r[k] for r in rows if r["phase"] == p), 2) for k in ("step", "host_fwd", "host_bwd", "gpu_fwd", "gpu_bwd")} for p in set(r["phase"] for r in rows)})
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"steps_{os.environ.get('TAG', 'x')}_{mode}.json"), "w"))
