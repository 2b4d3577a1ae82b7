"""One BERT-Large MLM training run under a GPU memory budget, by one method; prints a JSON line.

Methods: stock (in memory, no budget), save_on_cpu and checkpointing (stock PyTorch limited to
the budget by set_per_process_memory_fraction), reactive (um_alloc none.yaml + scheduler.budget:
LRU eviction, faults bring data back), planned (um_alloc best.yaml + budget + the trace/plan/
replay scheduler), offload (um_alloc best.yaml, the budget hard, + ActivationOffload sized to it),
offload_hostopt (the same with host_optimizer.yaml: AdamW's moments in host memory),
offload_moveall (offload with rebuild=False: every saved tensor moves, nothing is rebuilt in
backward: what rebuilding adds) and offload_stock (ActivationOffload over stock PyTorch limited like
save_on_cpu: what the pool adds).
All use fused AdamW. Run by bench/bench_budget.py, one process per method.

Besides throughput, each run reports the median time of its phases (forward, backward, optimizer
step; CUDA events on the compute stream) and the pinned-host copy rate each way between host
memory and memory from this run's allocator, measured before training, so that bench_budget.py
can bound the step time by the bytes the link must carry.

    python bench/budget_run.py planned --budget 16GiB --batch 32 --steps 8
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

METHODS = ("stock", "save_on_cpu", "checkpointing", "reactive", "planned", "offload", "offload_hostopt",
           "offload_moveall", "offload_stock")
OFFLOAD = ("offload", "offload_hostopt", "offload_moveall", "offload_stock")  # driven by ActivationOffload
HARD = {"offload": "best.yaml", "offload_hostopt": "host_optimizer.yaml",  # policies under a hard budget
        "offload_moveall": "best.yaml"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("method", choices=METHODS)
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--window", default="1GiB", help="offload methods: bytes copied back ahead of backward")
    return p.parse_args(argv)


def setup(args, budget: int):
    import torch

    import um_alloc

    if args.method in ("reactive", "planned"):
        policy = "none.yaml" if args.method == "reactive" else "best.yaml"
        um_alloc.install({**_policy_dict(policy), "scheduler": {"budget": budget}})
    elif args.method in HARD:
        um_alloc.install({**_policy_dict(HARD[args.method]), "scheduler": {"budget": budget, "evict_live": False}})
    elif args.method != "stock":  # stock PyTorch limited to the budget (offload_stock too)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(budget / total)
    return torch.device("cuda", 0)


def _policy_dict(name: str) -> dict:
    import yaml

    from um_alloc.policy import resolve_policy_path

    return yaml.safe_load(resolve_policy_path(name).read_text()) or {}


def build(args, device):
    import torch
    from transformers import BertConfig, BertForMaskedLM

    import um_alloc

    torch.manual_seed(0)
    config = BertConfig(hidden_size=1024, num_hidden_layers=args.layers, num_attention_heads=16,
                        intermediate_size=4096, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    um = um_alloc.is_installed()
    with um_alloc.tag("parameter") if um else _null():
        model = BertForMaskedLM(config).to(device)
    if args.method == "checkpointing":
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if um:
        um_alloc.tag_training(model, opt)
    return model, opt, config


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def batches(args, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(1)
    while True:
        ids = torch.randint(5, vocab, (args.batch, args.seq_len), generator=gen)
        labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.15, ids, -100)
        yield ids, labels


def run_step(args, model, opt, ids, labels, scheduler):
    import torch

    import um_alloc

    ids, labels = ids.cuda(non_blocking=True), labels.cuda(non_blocking=True)
    if um_alloc.is_installed():
        um_alloc.retag((ids, labels), "input")
    if args.method == "save_on_cpu":
        offload = torch.autograd.graph.save_on_cpu(pin_memory=True)
    elif args.method in OFFLOAD:
        offload = scheduler.step()  # an ActivationOffload
        scheduler = None
    else:
        offload = _null()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    marks[0].record()
    with scheduler.step() if scheduler else _null(), offload:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        marks[1].record()
        loss.backward()
    marks[2].record()
    opt.step()
    opt.zero_grad(set_to_none=True)
    marks[3].record()
    loss = loss.item()
    return loss, [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(3)]


def make_offload(args, budget: int):
    """The ActivationOffload an offload method runs with."""
    from um_alloc.offload import ActivationOffload

    return ActivationOffload(budget, window=args.window, rebuild=args.method != "offload_moveall")


def link_rates(device, nbytes: int = 256 << 20, repeats: int = 4) -> dict:
    """GB/s of pinned-host copies each way, to and from memory of this run's allocator."""
    import torch

    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.ones(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    for name, copy in (("d2h", lambda: host.copy_(gpu, non_blocking=True)),
                       ("h2d", lambda: gpu.copy_(host, non_blocking=True))):
        copy()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            copy()
        end.record()
        end.synchronize()
        rates[f"link_{name}_GBps"] = repeats * nbytes / (start.elapsed_time(end) / 1e3) / 1e9
    return rates


def main():
    args = parse_args()
    import torch

    import um_alloc
    from um_alloc.device_info import device_memory

    budget = um_alloc.parse_size(args.budget, key="--budget", source="command line")
    used_before = (device_memory(0) or type("M", (), {"used_bytes": 0})).used_bytes
    device = setup(args, budget)
    model, opt, config = build(args, device)
    scheduler = None
    if args.method == "planned":
        from um_alloc.scheduler.execute import OutOfCoreScheduler

        scheduler = OutOfCoreScheduler(model, budget)
    elif args.method in OFFLOAD:
        scheduler = make_offload(args, budget)
    rates = link_rates(device)
    losses, times, phases = [], [], []
    data = batches(args, config.vocab_size)
    for _ in range(args.steps):
        ids, labels = next(data)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss, phase_s = run_step(args, model, opt, ids, labels, scheduler)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss)
        phases.append(phase_s)
    step_s = statistics.median(times[args.warmup:] or times)
    timed = phases[args.warmup:] or phases
    out = {"method": args.method, "batch": args.batch, "budget_bytes": budget if args.method != "stock" else None,
           "device": torch.cuda.get_device_name(0), "step_s": times, "step_s_median": step_s,
           "samples_per_s": args.batch / step_s, "losses": losses,
           "highwater_bytes": (device_memory(0).used_bytes - used_before) if device_memory(0) else None,
           **{f"{name}_s_median": statistics.median(p[i] for p in timed)
              for i, name in enumerate(("forward", "backward", "optimizer"))}, **rates}
    if um_alloc.is_installed():
        s = um_alloc.memory_stats()
        out.update({k: s[k] for k in ("evictions", "evicted_bytes", "prefetch_bytes", "peak_resident_bytes",
                                      "over_budget_allocations", "peak_reserved_bytes", "peak_gpu_backed_bytes")})
    else:
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(0)
    if args.method in OFFLOAD:
        st = scheduler.stats
        out.update(saved_bytes=st.saved_bytes, kept_bytes=st.kept_bytes, rebuilt_bytes=st.rebuilt_bytes,
                   last_bytes_out=st.out_bytes,
                   last_bytes_in=st.in_bytes, on_demand=st.on_demand, offload_all=st.offload_all)
    elif scheduler is not None and scheduler.plan is not None:
        last = scheduler.last
        out.update(plan_out_bytes=scheduler.plan.swap_out_bytes, plan_in_bytes=scheduler.plan.swap_in_bytes,
                   plan_peak=scheduler.plan.peak_bytes, plan_budget=scheduler.plan.budget,
                   functions=len(scheduler.trace.functions), diverged=getattr(last, "diverged", None),
                   last_bytes_out=getattr(last, "bytes_out", None), last_bytes_in=getattr(last, "bytes_in", None))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
