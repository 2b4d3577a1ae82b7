"""Where does an offload step's time go? torch.profiler over one BERT-Large b32 step after 6 warm-up steps.

    cd bench && python profile_offload.py offload 16GiB OUTDIR    (METHOD: stock or one of budget_run.OFFLOAD)

Prints a JSON summary (busy time and rate of kernels and copies each way, compute-stream gaps over
1 ms) and writes the trace to OUTDIR/trace_METHOD.json.gz for chrome://tracing or Perfetto.
"""
import gzip, json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import budget_run as br


def main():
    method, budget_s, outdir = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(outdir, exist_ok=True)
    import torch
    import um_alloc
    args = br.parse_args([method, "--budget", budget_s, "--batch", "32", "--window", os.environ.get("WINDOW", "1GiB")])
    budget = um_alloc.parse_size(budget_s, key="budget", source="cli")
    device = br.setup(args, budget)
    model, opt, config = br.build(args, device)
    off = br.make_offload(args, budget) if method in br.OFFLOAD else None
    rates = br.link_rates(device)
    data = br.batches(args, config.vocab_size)

    def step(ids, labels):
        loss, phases = br.run_step(args, model, opt, ids, labels, off)
        torch.cuda.synchronize()
        return loss, phases

    times = []
    for i in range(6):
        ids, labels = next(data)
        torch.cuda.synchronize(); t = time.perf_counter()
        loss, ph = step(ids, labels)
        times.append((time.perf_counter() - t, ph))
    from torch.profiler import profile, ProfilerActivity
    ids, labels = next(data)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(ids, labels)
    trace = os.path.join(outdir, f"trace_{method}.json")
    prof.export_chrome_trace(trace)
    ev = json.load(open(trace))["traceEvents"]
    gpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    t0 = min(e["ts"] for e in gpu); t1 = max(e["ts"] + e["dur"] for e in gpu)
    summ = {"method": method, "budget": budget_s, "rates_GBps": rates, "steps": times,
            "span_s": (t1 - t0) / 1e6, "stats": off.stats.__dict__ if off else None}
    by = {}
    for e in gpu:
        name = e["name"]
        kind = "kernel" if e["cat"] == "kernel" else ("DtoH" if "DtoH" in name else "HtoD" if "HtoD" in name else name[:30])
        b = by.setdefault(kind, {"n": 0, "dur_s": 0.0, "bytes": 0, "first": 1e30, "last": 0, "streams": set()})
        b["n"] += 1; b["dur_s"] += e["dur"] / 1e6
        b["bytes"] += int(e.get("args", {}).get("bytes", 0) or 0)
        b["first"] = min(b["first"], (e["ts"] - t0) / 1e6); b["last"] = max(b["last"], (e["ts"] + e["dur"] - t0) / 1e6)
        b["streams"].add(e.get("args", {}).get("stream"))
    for b in by.values():
        b["streams"] = sorted(map(str, b["streams"]))
        if b["bytes"] and b["dur_s"]:
            b["rate_GBps"] = b["bytes"] / b["dur_s"] / 1e9
    summ["by_kind"] = by
    # kernel-idle gaps > 1 ms on the compute stream
    ks = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu if e["cat"] == "kernel")
    gaps, end = [], ks[0][1]
    for s, e in ks[1:]:
        if s - end > 1000:
            gaps.append(((end - t0) / 1e6, (s - end) / 1e6))
        end = max(end, e)
    summ["kernel_gaps"] = gaps[:40]
    summ["kernel_idle_s"] = sum(g[1] for g in gaps)
    with gzip.open(trace + ".gz", "wt") as f:
        json.dump(ev, f)
    os.remove(trace)
    print(json.dumps(summ, default=str))


if __name__ == "__main__":
    main()
