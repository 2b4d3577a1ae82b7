"""CUDA graphs and torch.compile under um_alloc, one check per fresh process.

    python tests/gpu_scripts/graphs_check.py capture|reduce_overhead|compile_um|compile_stock

Prints one JSON line; tests/test_gpu_graphs.py asserts on it.
"""
import json
import sys

import torch


def refused(run) -> dict:
    import um_alloc
    from um_alloc.graphs import CudaGraphsUnsupported

    um_alloc.install("none")
    try:
        run()
    except CudaGraphsUnsupported as error:
        return {"refused": True, "message": str(error)}
    return {"refused": False, "message": ""}


def capture():
    x = torch.ones(4, device="cuda")
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        x * 2


def reduce_overhead():
    model = torch.nn.Linear(8, 8).cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    for _ in range(3):
        compiled(torch.ones(4, 8, device="cuda")).sum().backward()


def compiled_losses(install: bool) -> dict:
    """torch.compile's default mode trains a small MLP; the losses, for comparison with stock."""
    if install:
        import um_alloc

        um_alloc.install("best")
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    step = torch.compile(lambda x: (model(x) - x).pow(2).mean())
    losses = []
    for i in range(6):
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        loss = step(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses}


if __name__ == "__main__":
    check = sys.argv[1]
    result = {"capture": lambda: refused(capture), "reduce_overhead": lambda: refused(reduce_overhead),
              "compile_um": lambda: compiled_losses(True), "compile_stock": lambda: compiled_losses(False)}[check]()
    print(json.dumps(result))
