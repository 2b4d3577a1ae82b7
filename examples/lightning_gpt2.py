"""GPT-2 causal-LM training with Lightning, on um_alloc through its callback:

    python examples/lightning_gpt2.py --budget 12GiB                 # um_alloc's UMAllocCallback
    python examples/lightning_gpt2.py                                # PyTorch's own allocator
    python examples/lightning_gpt2.py --budget 12GiB --deterministic --dropout 0   # compare losses with stock

The model is built from GPT-2-medium's config (no weights are downloaded; --tiny: two layers, for
tests) and the data is random tokens. The last line of stdout is one JSON object: the losses and,
with --budget, the plan's decisions (how many units it keeps, recomputes, moves).
With --deterministic and --dropout 0 the losses under a budget are stock PyTorch's, exactly
(tests/test_gpu_lightning.py compares them).
Needs lightning and transformers.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

SIZES = {"medium": dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024),
         "tiny": dict(n_embd=64, n_layer=2, n_head=2, n_positions=128, vocab_size=1000)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", help="um_alloc's UMAllocCallback with this GPU budget (e.g. 12GiB)")
    p.add_argument("--policy", help="the callback's policy (default: planner.yaml with --budget)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels (to compare losses)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    callbacks = []
    if args.budget or args.policy:  # first: before the Trainer moves the model to the GPU
        from um_alloc.integrations.lightning import UMAllocCallback

        callbacks.append(UMAllocCallback(budget=args.budget, policy=args.policy))
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    import lightning.pytorch as pl
    from transformers import GPT2Config, GPT2LMHeadModel

    class LitGPT2(pl.LightningModule):
        def __init__(self):
            super().__init__()
            config = GPT2Config(resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
                                **SIZES["tiny" if args.tiny else "medium"])
            self.model = GPT2LMHeadModel(config)
            self.losses: list[float] = []

        def training_step(self, ids, index):
            loss = self.model(input_ids=ids, labels=ids).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    pl.seed_everything(args.seed)
    lit = LitGPT2()
    ids = torch.randint(0, lit.model.config.vocab_size, (args.steps * args.batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(args.seed))
    trainer = pl.Trainer(accelerator="cpu" if args.cpu else "gpu", devices=1, max_steps=args.steps,
                         precision="32-true" if args.cpu else "bf16-mixed", deterministic=args.deterministic,
                         callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(lit, torch.utils.data.DataLoader(ids, batch_size=args.batch_size))
    planner = callbacks[0].planner if callbacks else None
    plan = planner.plan.counts() if planner is not None and planner.plan is not None else None
    print(json.dumps({"budget": args.budget, "losses": lit.losses, "plan": plan}))
    return lit.losses


if __name__ == "__main__":
    main()
