"""Trains a small BERT masked-LM for N steps with a fixed seed and prints the losses as JSON.

Deterministic algorithms and fp32, so the stock allocator and um_alloc must give the same
losses: the allocator changes where tensors live, never what is computed.
Run: python tests/gpu_scripts/train_tiny.py {stock|um} POLICY STEPS [MAX_RESERVED|none] [BUDGET] [reactive]
With BUDGET, the policy's scheduler.budget is set to it; with reactive, the policy also asks for
evict_live: true, and least recently used chunks leave the GPU to keep residency under it.
"""
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

import um_alloc  # noqa: E402


def main(allocator: str, policy: str, steps: int, max_reserved: str | None, budget: str | None,
         reactive: bool = False) -> dict:
    if allocator == "um":
        if budget is not None:
            import yaml

            settings = yaml.safe_load(um_alloc.policy.resolve_policy_path(policy).read_text()) or {}
            scheduler = settings.setdefault("scheduler", {})
            scheduler["budget"] = budget
            if reactive:
                scheduler.update(evict_live=True, offload_activations=False)
            policy = settings
        um_alloc.install(policy, max_reserved=max_reserved)
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    config = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, vocab_size=8192, max_position_embeddings=128)
    with um_alloc.tag("parameter"):
        model = BertForMaskedLM(config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if allocator == "um":
        um_alloc.tag_training(model, opt)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(5, config.vocab_size, (16, 128), generator=gen)
        labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.15, ids, -100)
        ids, labels = ids.cuda(), labels.cuda()
        if allocator == "um":
            um_alloc.retag((ids, labels), "input")
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses}
    if allocator == "um":
        stats = um_alloc.memory_stats()
        out.update(reserved=stats["reserved_bytes"], peak_reserved=stats["peak_reserved_bytes"],
                   tags={t: v["live_bytes"] for t, v in stats["tags"].items()},
                   backend_errors=stats["backend_errors"], evictions=stats["evictions"],
                   evicted_bytes=stats["evicted_bytes"], peak_resident=stats["peak_resident_bytes"],
                   highwater=stats["device_highwater_bytes"], budget=stats["budget_bytes"],
                   over_budget_allocations=stats["over_budget_allocations"],
                   evicts_live=um_alloc.ChunkPool.for_device(0).budget_evicts_live())
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    max_reserved = args[3] if len(args) > 3 and args[3] != "none" else None
    print(json.dumps(main(args[0], args[1], int(args[2]), max_reserved, args[4] if len(args) > 4 else None,
                          len(args) > 5 and args[5] == "reactive")))
