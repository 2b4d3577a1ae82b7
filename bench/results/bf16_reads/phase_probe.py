"""Host against GPU time by phase of a GPT-2-medium step, every block forced to one decision in turn.

    python bench/results/bf16_reads/phase_probe.py 40GiB keep,rebuild,recompute,rebuild+hooks
    PROFILE=1 python bench/results/bf16_reads/phase_probe.py 40GiB keep,rebuild   # and the kernels both ways
    CPROFILE=1 python bench/results/bf16_reads/phase_probe.py 40GiB keep,rebuild,rebuild+hooks  # and the hooks' Python

The script that made phases_*.json and kernels_*.json here; bench/decision_costs.py --model gpt2
--host-lead MS measures the same phases from the repository's own tools. "+hooks" also sums the
host's time in the rebuild's pack and unpack hooks, and counts their calls. With CPROFILE set, five
more steps every block rebuilt run with each hook call under cProfile (on whichever thread autograd
calls it from), written as $OUT/cprofile_$TAG_{pack,unpack}_{tottime,cumulative}.txt. Writes
$OUT/hostprobe_$TAG.json."""
import cProfile, io, json, os, pstats, statistics, sys, time
import torch
import um_alloc
from um_alloc.sizes import parse_size
budget = parse_size(sys.argv[1] if len(sys.argv) > 1 else "40GiB", key="budget", source="argv")
um_alloc.install("planner.yaml", budget=budget)
from transformers import GPT2Config, GPT2LMHeadModel
import um_alloc.planner as planning
from um_alloc.planner import rebuilt
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, use_cache=False)).cuda().train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
um_alloc.tag_training(model, opt)
planner = planning.plan(model, budget, strategy="auto", lean_loss=True)
ids = torch.randint(0, 50257, (8, 1024), generator=torch.Generator().manual_seed(0)).pin_memory()
acc = {"pack": 0, "unpack": 0, "packs": 0, "unpacks": 0}
profs = {}
P, U = rebuilt.RebuiltSaves._pack, rebuilt._unpack
ns = time.perf_counter_ns
def pack(self, t):
    a = ns(); r = P(self, t); acc["pack"] += ns() - a; acc["packs"] += 1; return r
def unpack(p):
    a = ns(); r = U(p); acc["unpack"] += ns() - a; acc["unpacks"] += 1; return r
def profiled_pack(self, t):
    profs["pack"].enable(); r = P(self, t); profs["pack"].disable(); return r
def profiled_unpack(p):
    profs["unpack"].enable(); r = U(p); profs["unpack"].disable(); return r
def step():
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    t0 = time.perf_counter(); ev[0].record()
    x = ids.cuda(non_blocking=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss
    t1 = time.perf_counter(); ev[1].record()
    loss.backward()
    t2 = time.perf_counter(); ev[2].record()
    opt.step(); opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter(); ev[3].record()
    loss.item(); t4 = time.perf_counter()
    return dict(host_fwd=t1 - t0, host_bwd=t2 - t1, host_opt=t3 - t2, step=t4 - t0,
                gpu_fwd=ev[0].elapsed_time(ev[1]) / 1e3, gpu_bwd=ev[1].elapsed_time(ev[2]) / 1e3,
                gpu_opt=ev[2].elapsed_time(ev[3]) / 1e3)
for _ in range(4):
    step()
out = []
phases = sys.argv[2].split(",") if len(sys.argv) > 2 else ["keep", "rebuild", "recompute", "rebuild+hooks", "keep", "rebuild"]
for phase in phases:
    decision, _, instr = phase.partition("+")
    planner.force(decision)
    if instr:
        rebuilt.RebuiltSaves._pack, rebuilt._unpack = pack, unpack
    step(); step()
    acc.update(pack=0, unpack=0, packs=0, unpacks=0)
    rows = [step() for _ in range(10)]
    rebuilt.RebuiltSaves._pack, rebuilt._unpack = P, U
    med = {k: round(1e3 * statistics.median(r[k] for r in rows), 2) for k in rows[0]}
    med["min_step"] = round(1e3 * min(r["step"] for r in rows), 2)
    if instr:
        med.update(pack_ms=round(acc["pack"] / 10 / 1e6, 2), unpack_ms=round(acc["unpack"] / 10 / 1e6, 2),
                   packs=acc["packs"] // 10, unpacks=acc["unpacks"] // 10)
    med["phase"] = phase
    out.append(med); print(json.dumps(med), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"hostprobe_{os.environ.get('TAG', 'x')}.json"), "w"))

if os.environ.get("PROFILE"):
    from torch.profiler import ProfilerActivity, profile
    tables = {}
    for phase in ("keep", "rebuild"):
        planner.force(phase); step(); step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
        rows = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                r = rows.setdefault(e.name[:140], [0, 0.0]); r[0] += 1; r[1] += e.time_range.elapsed_us() / 1e3
        tables[phase] = rows
    keys = set(tables["keep"]) | set(tables["rebuild"])
    diff = sorted(((tables["rebuild"].get(k, [0, 0])[1] - tables["keep"].get(k, [0, 0])[1], tables["rebuild"].get(k, [0, 0])[0] - tables["keep"].get(k, [0, 0])[0], k) for k in keys), reverse=True)
    for d, n, k in diff[:30]:
        print(f"{d:8.3f} ms {n:+5d}  {k}")
    json.dump(tables, open(os.path.join(os.environ.get("OUT", "."), "kernels.json"), "w"))

if os.environ.get("CPROFILE"):
    planner.force("rebuild"); step(); step()
    profs.update(pack=cProfile.Profile(), unpack=cProfile.Profile())
    rebuilt.RebuiltSaves._pack, rebuilt._unpack = profiled_pack, profiled_unpack
    for _ in range(5):
        step()
    rebuilt.RebuiltSaves._pack, rebuilt._unpack = P, U
    for name, prof in profs.items():
        for key in ("tottime", "cumulative"):
            text = io.StringIO(); pstats.Stats(prof, stream=text).sort_stats(key).print_stats(35)
            open(os.path.join(os.environ.get("OUT", "."), f"cprofile_{os.environ.get('TAG', 'x')}_{name}_{key}.txt"),
                 "w").write(text.getvalue())
