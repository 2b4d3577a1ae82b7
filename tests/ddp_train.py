"""A tiny BERT trained with the block planner under DistributedDataParallel, one process per rank,
against one process training the same global batch; the tests read what each process saves.

    RANK=r WORLD_SIZE=2 LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=P \\
        python tests/ddp_train.py --out DIR CASE...        # each rank: DIR/rank{r}.pt
    python tests/ddp_train.py --out DIR --reference         # one process, no DDP: DIR/reference.pt
    ... --gpu --budget 2GiB                                 # NCCL, um_alloc installed with a budget per rank

Cases (the planner with decisions=["recompute"]: every block recomputed, the gaps moved):
  plan-then-wrap        the planner attached to the model, then DDP wraps it
  wrap-then-plan        DDP first, the planner given the DDP module (it plans what DDP wraps)
  static-graph          DDP(static_graph=True)
  find-unused           DDP(find_unused_parameters=True): DDP walks the graph the planner made
  no-sync               two micro-batches a step, the first under no_sync(): gradients reduced once
  static-graph-no-sync  both; the first step synchronised, since PyTorch's reducer itself asserts
                        when a static graph's first backward runs under no_sync()
  stream                um_alloc.microbatch.MicroBatchStreamer accumulates two micro-batches a step
  stream-static-graph   the same with static_graph=True (its first step reduces every micro-batch)
  fsdp-plan-then-shard  FSDP2 instead of DDP: the planner attached, then fully_shard on every layer
                        and the model (parameters, gradients and SGD's state sharded over the ranks)
  fsdp-shard-then-plan  fully_shard first, the planner given the sharded model

Every case trains STEPS steps of SGD on the same GLOBAL_BATCH sequences a step, split between the
ranks; the reference trains on the whole of each. Saved per case: the loss of the global batch each
step (the ranks' losses averaged through an all-reduce) and this rank's own, the first step's
gradients, the parameters at the end, the plan's decisions, and how many buckets DDP reduced
(a communication hook counts them). float64, dropout 0.
"""
from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
import torch  # noqa: E402

CASES = ("plan-then-wrap", "wrap-then-plan", "static-graph", "find-unused", "no-sync", "static-graph-no-sync",
         "stream", "stream-static-graph", "fsdp-plan-then-shard", "fsdp-shard-then-plan")
STEPS, GLOBAL_BATCH, SEQUENCE, VOCAB = 4, 8, 16, 97


def tiny_bert(device: torch.device):
    import transformers

    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config).double().to(device).train()


def global_batches() -> list[torch.Tensor]:
    data = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQUENCE), generator=data) for _ in range(STEPS)]


def flat(tensors) -> torch.Tensor:
    """One CPU vector of the tensors; a DTensor (FSDP2's) gathered whole from every rank."""
    whole = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors)
    return torch.cat([t.detach().flatten().cpu() for t in whole])


def reference(device: torch.device) -> dict:
    """One process, no DDP, no planner: plain autograd over each global batch."""
    model = tiny_bert(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"losses": []}
    for step, ids in enumerate(global_batches()):
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            out["first_grads"] = flat(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
    out["params"] = flat(model.parameters())
    return out


def ddp_case(case: str, rank: int, world: int, device: torch.device, budget: str | None) -> dict:
    from um_alloc.planner import BlockPlanner

    model = tiny_bert(device)
    budget = budget or "1GiB"  # on the CPU no GPU memory is counted: the decisions below set the plan
    if case in ("wrap-then-plan", "fsdp-shard-then-plan"):
        wrapped = _wrapped(case, model, device)
        planner = BlockPlanner(wrapped, budget, decisions=["recompute"])
    else:
        planner = BlockPlanner(model, budget, decisions=["recompute"])
        wrapped = _wrapped(case, model, device)
    reductions = None if case.startswith("fsdp") else _count_reductions(wrapped)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    forward_backward = _forward_backward(case, wrapped, GLOBAL_BATCH // world // 2, device)
    out = {"losses": [], "rank_losses": []}
    for step, ids in enumerate(global_batches()):
        loss = forward_backward(step, ids.chunk(world)[rank])
        if step == 0:
            out["first_grads"] = flat(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["rank_losses"].append(loss.item())
        torch.distributed.all_reduce(loss)
        out["losses"].append(loss.item() / world)
    out["params"] = flat(model.parameters())
    out["decisions"] = [d.value for d in planner.plan.decisions]
    runtime = planner._runtime
    out["one_node_blocks"] = sum(bool(ok) for ok, u in zip(runtime._reruns, runtime.units) if u.kind == "block")
    out["reductions"] = None if reductions is None else len(reductions)
    planner.remove()
    return out


def _wrapped(case: str, model, device: torch.device):
    """DDP with the case's options around `model`, or for the fsdp cases `model` sharded by FSDP2."""
    if case.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        for layer in model.bert.encoder.layer:
            fully_shard(layer)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, static_graph="static-graph" in case, find_unused_parameters=case == "find-unused",
               device_ids=[device.index] if device.type == "cuda" else None)


def _count_reductions(wrapped) -> list:
    """A communication hook that reduces as DDP's default does and notes each bucket it reduces."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    seen: list = []

    def counting(state, bucket):
        seen.append(bucket.index())
        return allreduce_hook(state, bucket)

    wrapped.register_comm_hook(None, counting)
    return seen


def _forward_backward(case: str, wrapped, micro_batch: int, device: torch.device):
    """The case's forward and backward of one step, as fn(step, host ids) -> this rank's mean loss
    (on `device`). The streamer copies the micro-batches to the device itself."""
    if case.startswith("stream"):
        from um_alloc.microbatch import MicroBatchStreamer

        streamer = MicroBatchStreamer(wrapped, None, lambda model, batch: model(input_ids=batch, labels=batch).loss,
                                      micro_batch_size=micro_batch, input_tag=None)
        return lambda step, ids: torch.tensor(streamer.accumulate(ids), dtype=torch.float64, device=device)

    def by_hand(step: int, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(device)
        synchronised_first = case == "static-graph-no-sync" and step == 0
        return _accumulate(wrapped, ids.split(micro_batch) if case.endswith("no-sync") and not synchronised_first
                           else (ids,))
    return by_hand


def _accumulate(wrapped, micro: tuple) -> torch.Tensor:
    """Forward and backward of each micro-batch, all but the last under no_sync(); the mean loss."""
    total = torch.zeros((), dtype=torch.float64, device=micro[0].device)
    for i, ids in enumerate(micro):
        last = i == len(micro) - 1
        with contextlib.nullcontext() if last else wrapped.no_sync():
            loss = wrapped(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
        total += loss.detach()
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="CUDA and NCCL (else the CPU and gloo)")
    parser.add_argument("--budget", help="with --gpu: um_alloc installed with this budget in each process")
    parser.add_argument("cases", nargs="*", metavar="CASE", help=", ".join(CASES))
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:  # checked here: argparse refuses an empty list against choices=
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.gpu and args.budget and not args.reference:
        import um_alloc

        um_alloc.install("planner", budget=args.budget)  # the device: LOCAL_RANK
    if args.gpu:
        torch.use_deterministic_algorithms(True)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if args.gpu else torch.device("cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reference:
        torch.save(reference(device), args.out / "reference.pt")
        return
    torch.distributed.init_process_group("nccl" if args.gpu else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {case: ddp_case(case, rank, world, device, args.budget) for case in args.cases}
    results["um_alloc"] = _installed()
    torch.save(results, args.out / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _installed() -> dict | None:
    """The device um_alloc manages in this process and the peak bytes its pool held (None: not installed)."""
    import um_alloc

    if not um_alloc.is_installed():
        return None
    stats = um_alloc.memory_stats()
    return {"device": um_alloc.installation().device, "peak_live_bytes": stats["peak_live_bytes"],
            "budget_bytes": stats["budget_bytes"]}


if __name__ == "__main__":
    main()
