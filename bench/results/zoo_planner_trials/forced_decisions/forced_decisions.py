"""In one process: HF checkpointing and the planner with forced decisions on the zoo Llama, rounds
alternated. POOL=1 installs um_alloc (budget 40GiB) first."""
import json, os, statistics, sys, time
sys.path.insert(0, "bench")
import torch
if os.environ.get("POOL") == "1":
    import um_alloc
    um_alloc.install(budget="40GiB")
import zoo_train
import um_alloc.planner as P

OUT = os.environ.get("OUT", "/tmp")
TAG = os.environ.get("TAG", "stock")
MODEL = os.environ.get("MODEL", "llama")
K = int(os.environ.get("K", "17"))
STEPS, WARM = int(os.environ.get("STEPS", "24")), 8
dev = torch.device(os.environ.get("DEV", "cuda")); TINY = dev.type == "cpu"

def forced(planner, k, rest):
    out, b = [], 0
    for u in planner.units:
        if u.kind == "block":
            out.append("recompute" if b < k else rest); b += 1
        else:
            out.append("keep")
    return out + ["keep"]

def run(mode):
    torch.manual_seed(0)
    zoo = zoo_train.MODELS[MODEL]
    model = zoo.build(TINY).to(dev).train()
    planner = None
    if mode == "hf_k":
        zoo_train.checkpointed_layers(model, str(K))
    elif mode == "hf_all":
        zoo_train.checkpointed_layers(model, "all")
    elif mode.startswith("pl"):
        planner = P.plan(model, "40GiB", lean_loss="nolean" not in mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not TINY)
    g = torch.Generator().manual_seed(0)
    batch = {k: (v if TINY else v.pin_memory()) for k, v in zoo.make_batch(2 if TINY else zoo.batch, TINY, g).items()}
    ac = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not TINY)
    walls, cpus = [], []
    extra = 4 if planner else 0
    for step in range(STEPS + extra):
        if planner is not None and step == extra:
            kind = mode.split("_")[1]
            dec = {"k": forced(planner, K, "keep"), "krebuild": forced(planner, K, "rebuild"),
                   "all": forced(planner, 99, "keep"), "keep": forced(planner, 0, "keep"),
                   "rebuild": forced(planner, 0, "rebuild")}[kind]
            pred = planner.force(dec).predicted_step_s
        t0, c0 = time.perf_counter(), time.process_time()
        inputs = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
        with ac:
            loss = model(**inputs).loss
        loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        loss.item()
        walls.append(time.perf_counter() - t0); cpus.append(time.process_time() - c0)
    if os.environ.get("PROF") == "1":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(2):
                with ac:
                    loss = model(**inputs).loss
                loss.backward(); opt.step(); opt.zero_grad(set_to_none=True); loss.item()
        ka = p.key_averages()
        with open(f"{OUT}/{TAG}_{MODEL}_{mode}_prof.txt", "w") as f:
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40)); f.write("\n\n")
            f.write(ka.table(sort_by="self_cuda_time_total", row_limit=30)); f.write("\n\n")
            f.write(ka.table(sort_by="count", row_limit=40))
    w, c = walls[extra + WARM:], cpus[extra + WARM:]
    r = dict(tag=TAG, mode=mode, wall_ms=round(statistics.median(w) * 1e3, 2), cpu_ms=round(statistics.median(c) * 1e3, 2),
             peak_gib=round((torch.cuda.max_memory_allocated() if not TINY and os.environ.get("POOL") != "1" else 0) / 2**30, 2))
    if planner is not None:
        r["predicted_ms"] = round(pred * 1e3, 1)
        planner.remove()
    print(json.dumps(r), flush=True)
    del model, opt
    if not TINY and os.environ.get("POOL") != "1": torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    return r

modes = os.environ.get("MODES", "none,hf_k,pl_k,pl_krebuild,hf_all,pl_all,pl_keep").split(",")
rows = []
for rnd in range(int(os.environ.get("ROUNDS", "3"))):
    for m in modes:
        rows.append(run(m))
with open(f"{OUT}/{TAG}_{MODEL}_ab.json", "w") as f:
    json.dump(rows, f)
