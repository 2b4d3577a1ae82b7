"""Host against GPU time by phase of a GPT-2-medium step (batch 8 x 1024, bf16, fused AdamW, a plain
loop that reads each loss), every block forced to one decision in turn, with the rebuild's hooks
timed and profiled.

    CPROFILE=1 TAG=x python bench/results/host_pace/phase_hooks_probe.py keep,rebuild,rebuild+hooks,keep,rebuild

Each phase: two steps to settle, then the medians of ten. "+hooks" also sums the host's time in
the rebuild's pack and unpack hooks (pack_ms, unpack_ms, and their counts a step). With CPROFILE
set, five more steps every block rebuilt run with each hook call under cProfile (on whichever
thread autograd calls it from), written as cprofile_$TAG_{pack,unpack}_{tottime,cumulative}.txt.
Writes $OUT/hostcost_$TAG.json."""
import cProfile, io, json, os, pstats, statistics, sys, time
import torch
import um_alloc
from um_alloc.sizes import parse_size
budget = parse_size("40GiB", key="budget", source="argv")
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
P, U = rebuilt.RebuiltSaves._pack, rebuilt._unpack
ns = time.perf_counter_ns
acc = {"pack": 0, "unpack": 0, "npack": 0, "nunpack": 0}
profs = {}
def timed_pack(self, t):
    a = ns(); r = P(self, t); acc["pack"] += ns() - a; acc["npack"] += 1; return r
def timed_unpack(p):
    a = ns(); r = U(p); acc["unpack"] += ns() - a; acc["nunpack"] += 1; return r
def prof_pack(self, t):
    pr = profs["pack"]; pr.enable(); r = P(self, t); pr.disable(); return r
def prof_unpack(p):
    pr = profs["unpack"]; pr.enable(); r = U(p); pr.disable(); return r
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
for phase in sys.argv[1].split(","):
    decision, _, instr = phase.partition("+")
    planner.force(decision)
    step(); step()
    if instr == "hooks":
        rebuilt.RebuiltSaves._pack, rebuilt._unpack = timed_pack, timed_unpack
    acc.update(pack=0, unpack=0, npack=0, nunpack=0)
    rows = [step() for _ in range(10)]
    rebuilt.RebuiltSaves._pack, rebuilt._unpack = P, U
    med = {k: round(1e3 * statistics.median(r[k] for r in rows), 2) for k in rows[0]}
    med["min_step"] = round(1e3 * min(r["step"] for r in rows), 2)
    if instr == "hooks":
        med.update(pack_ms=round(acc["pack"] / 10 / 1e6, 2), unpack_ms=round(acc["unpack"] / 10 / 1e6, 2),
                   packs=acc["npack"] // 10, unpacks=acc["nunpack"] // 10)
    med["phase"] = phase
    out.append(med); print(json.dumps(med), flush=True)
tag = os.environ.get("TAG", "x")
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"hostcost_{tag}.json"), "w"))
if os.environ.get("CPROFILE"):
    planner.force("rebuild"); step(); step()
    profs.update(pack=cProfile.Profile(), unpack=cProfile.Profile())
    rebuilt.RebuiltSaves._pack, rebuilt._unpack = prof_pack, prof_unpack
    for _ in range(5):
        step()
    rebuilt.RebuiltSaves._pack, rebuilt._unpack = P, U
    for name, pr in profs.items():
        for key in ("tottime", "cumulative"):
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(35)
            text = s.getvalue()
            open(os.path.join(os.environ.get("OUT", "."), f"cprofile_{tag}_{name}_{key}.txt"), "w").write(text)
            print(f"==== {name} by {key} (5 steps)\n" + "\n".join(text.splitlines()[:50]), flush=True)
