"""Faults on a GPU under um_alloc, each in a fresh process (install precedes CUDA).

    python tests/gpu_scripts/soak_check.py oom
        # a batch too large for the budget fails in the planner's calibration; the same process
        # then trains batch 16, with the losses of a model that never saw the failure
    python tests/gpu_scripts/soak_check.py pair NAME POLICY CAP BUDGET STEPS READY_DIR
        # one of two processes sharing the GPU, each under its own cap (pool.max_reserved) and
        # budget; both write READY_DIR/NAME once built and train only when both are there

Each prints a JSON line. The model is a small BERT (4 layers of 256, vocabulary 8192,
sequence 128), bf16 autocast, fused AdamW.
"""
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
import torch  # noqa: E402

import um_alloc  # noqa: E402

GiB = 1 << 30
VOCAB, SEQ = 8192, 128
OOM_BATCH = 1024      # its logits alone, 1024 x 128 x 8192 in bf16, are 2 GiB: more than the budget
WAIT_FOR_PEER_S = 300


def bert(dropout: float = 0.0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=SEQ, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout)
    with um_alloc.tag("parameter"):
        model = BertForMaskedLM(config).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    um_alloc.tag_training(model, optimizer)
    return model, optimizer


def batch(size: int, generator: torch.Generator) -> dict:
    ids = torch.randint(5, VOCAB, (size, SEQ), generator=generator)
    labels = torch.where(torch.rand(ids.shape, generator=generator) < 0.15, ids, -100)
    inputs = {"input_ids": ids.cuda(), "labels": labels.cuda()}
    um_alloc.retag(inputs, "input")
    return inputs


def step(model, optimizer, inputs: dict, offload=None) -> float:
    with offload.step() if offload is not None else torch.enable_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def train(model, optimizer, steps: int, size: int, seed: int, offload=None) -> list[float]:
    data = torch.Generator().manual_seed(seed)
    return [step(model, optimizer, batch(size, data), offload) for _ in range(steps)]


def live_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return um_alloc.memory_stats()["live_bytes"]


# --- an out-of-memory error in calibration, then a smaller batch --------------------------------

def until_refused(model, optimizer, inputs: dict, tries: int = 3) -> list[str]:
    """Steps on a batch the budget cannot hold, as a training loop that retries would: the safe
    mode runs out of memory twice, and the planner then refuses the shape (PlanInfeasible)."""
    errors = []
    for _ in range(tries):
        try:
            step(model, optimizer, inputs)
            errors.append("trained")
        except (torch.OutOfMemoryError, um_alloc.PlanInfeasible) as error:
            optimizer.zero_grad(set_to_none=True)
            errors.append(f"{type(error).__name__}: {str(error)[:400]}")
    return errors


def oom() -> dict:
    # 1.5 GiB: the planner keeps a margin (48 MiB) and 128 MiB of copy stages free of it, and the safe
    # mode of batch 16 (the logits' fp32 log-softmax and its gradient) must fit in the rest
    um_alloc.install("planner.yaml", budget="1536MiB", max_reserved="4GiB")
    model, optimizer = bert()
    planner = um_alloc.plan(model)
    first = train(model, optimizer, 1, 16, seed=1)  # cuBLAS's workspace and AdamW's state exist from here
    live_before = live_bytes()
    big = batch(OOM_BATCH, torch.Generator().manual_seed(3))
    errors = until_refused(model, optimizer, big)
    del big
    live_after = live_bytes()
    after = train(model, optimizer, 6, 16, seed=2)  # 2 calibration steps, then the plan
    plan = planner.plan.counts() if planner.plan else None
    planner.remove()
    fresh_model, fresh_optimizer = bert()            # the same seed: the same weights
    fresh_planner = um_alloc.plan(fresh_model)
    fresh = train(fresh_model, fresh_optimizer, 1, 16, seed=1) + train(fresh_model, fresh_optimizer, 6, 16, seed=2)
    fresh_planner.remove()
    stats = um_alloc.memory_stats()
    return {"errors": errors, "live_before": live_before, "live_after_failures": live_after,
            "losses": first + after, "fresh_losses": fresh, "plan": plan,
            **{key: stats[key] for key in ("num_ooms", "budget_bytes", "peak_gpu_backed_bytes", "gpu_backed_bytes",
                                           "limit_bytes", "peak_reserved_bytes")}}


# --- two processes on one GPU ---------------------------------------------------------------------

def wait_for_peer(ready: Path, name: str) -> None:
    (ready / name).write_text("built")
    deadline = time.monotonic() + WAIT_FOR_PEER_S
    while len(list(ready.iterdir())) < 2:
        if time.monotonic() > deadline:
            raise SystemExit(f"soak_check.py pair {name}: the other process was not built within {WAIT_FOR_PEER_S} s")
        time.sleep(0.05)


def nvml_process_bytes() -> int | None:
    """GPU memory NVML counts for this process (context, copy stages, what the driver backs), or
    None where NVML does not list it (a container's process ids are not the host's)."""
    from um_alloc.device_info import _nvml_handle, _with_nvml

    def query(pynvml):
        handle = _nvml_handle(pynvml, 0)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid():
                return process.usedGpuMemory
        return None
    return _with_nvml(query)


def pair(name: str, policy: str, cap: str, budget: str, steps: str, ready: str) -> dict:
    chosen = um_alloc.install(policy, max_reserved=cap, budget=budget)
    model, optimizer = bert(dropout=0.1)
    planner = offload = None
    if chosen.policy.scheduler.strategy in ("auto", "checkpoint"):
        planner = um_alloc.plan(model)
    else:
        from um_alloc.offload import from_policy

        offload = from_policy()
    wait_for_peer(Path(ready), name)
    started = time.time()
    losses = train(model, optimizer, int(steps), 16, seed=1, offload=offload)
    finished = time.time()
    stats = um_alloc.memory_stats()
    return {"name": name, "policy": chosen.policy.name, "started": started, "finished": finished,
            "losses": losses, "nvml_process_bytes": nvml_process_bytes(),
            "planned": planner is not None and planner.plan is not None, "offloaded": offload is not None,
            **{key: stats[key] for key in ("limit_bytes", "budget_bytes", "peak_reserved_bytes",
                                           "peak_gpu_backed_bytes", "num_ooms", "device_highwater_bytes")}}


if __name__ == "__main__":
    torch.use_deterministic_algorithms(True, warn_only=True)  # the oom mode compares two models' losses
    mode, arguments = sys.argv[1], sys.argv[2:]
    print(json.dumps({"oom": oom, "pair": pair}[mode](*arguments)))
