"""A small language-model step with its head spilled (um_alloc.spill_from) or not, on the GPU.

Run: python tests/gpu_scripts/spill_check.py spill|plain. Prints one JSON line: losses, where the
head's logits and their gradient were placed, the pool's GPU-backed peak and what the activation
offload saw. tests/test_gpu_offload.py compares the two modes (each needs a fresh process).
"""
import json
import sys

import torch

import um_alloc
from um_alloc import _lib
from um_alloc.offload import ActivationOffload

MiB = 1 << 20
TOKENS, WIDTH, VOCAB = 4096, 512, 8192  # logits: 64 MiB in bf16, 128 MiB in fp32
HOST = {"preferred_location": "cpu", "accessed_by": ["gpu"]}
POLICY = {"scheduler": {"evict_live": False, "offload_activations": True, "budget": "4GiB",
                        "spill_min_size": "16MiB"},
          "tags": {"parameter": {"preferred_location": "gpu", "accessed_by": ["gpu"]}, "spill": HOST}}


def placement(tensor: torch.Tensor) -> list:
    block = um_alloc.block_at(tensor.untyped_storage().data_ptr())
    return [block.tag, block.residency]


def main(mode: str) -> dict:
    um_alloc.install(POLICY)
    torch.manual_seed(0)
    with um_alloc.tag("parameter"):
        trunk = torch.nn.Sequential(torch.nn.Linear(256, WIDTH), torch.nn.GELU()).cuda()
        head = torch.nn.Linear(WIDTH, VOCAB).cuda()
    params = list(trunk.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    um_alloc.tag_training(torch.nn.ModuleList([trunk, head]), optimizer)
    if mode == "spill":
        um_alloc.spill_from(head)
    offload = ActivationOffload(budget="4GiB", min_bytes=MiB)
    lib, found, losses = _lib.load(), {}, []
    x = torch.randn(TOKENS, 256, device="cuda")
    labels = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        with offload.step():
            inputs = x.clone().requires_grad_()  # its gradient comes after the head's backward
            inputs.register_hook(lambda g: found.__setitem__("scope_at_trunk_input", lib.um_large_tag_min()))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = head(trunk(inputs))
                found["logits"] = placement(logits)
                logits.register_hook(lambda g: found.update(logits_grad=placement(g),
                                                            scope_at_logits=lib.um_large_tag_min()))
                loss = torch.nn.functional.cross_entropy(logits, labels)
            del logits
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    stats = um_alloc.memory_stats()
    return {**found, "losses": losses, "scope_after_step": lib.um_large_tag_min(),
            "peak_gpu_backed_bytes": stats["peak_gpu_backed_bytes"],
            "saved_bytes": offload.stats.saved_bytes, "backend_errors": stats["backend_errors"]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
