"""bert_example/train.py with CUDA events around the MLM head each step: prints HEADT lines."""
import sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository
import bert_example.train as train  # noqa: E402

build_step = train.build_step
NAMES = ("start", "cls_in", "cls_out", "logits_grad", "hidden_grad", "end")


def timed_build_step(args, model, *rest, **kw):
    step_fn, *others = build_step(args, model, *rest, **kw)
    marks = {}

    def ev(name):
        e = torch.cuda.Event(enable_timing=True); e.record(); marks[name] = e

    def pre(mod, inputs):
        ev("cls_in")
        h = inputs[0]
        if torch.is_tensor(h) and h.requires_grad:
            h.register_hook(lambda g: ev("hidden_grad"))

    def post(mod, inputs, out):
        ev("cls_out")
        t = out if torch.is_tensor(out) else None
        if t is not None and t.requires_grad:
            t.register_hook(lambda g: ev("logits_grad"))

    model.cls.register_forward_pre_hook(pre)
    model.cls.register_forward_hook(post)

    def timed(*a, **k):
        marks.clear(); ev("start")
        out = step_fn(*a, **k)
        ev("end"); torch.cuda.synchronize()
        have = [n for n in NAMES if n in marks]
        parts = {f"{x}->{y}": round(marks[x].elapsed_time(marks[y]), 1) for x, y in zip(have, have[1:])}
        print("HEADT", round(marks["start"].elapsed_time(marks["end"]), 1), parts, file=sys.stderr, flush=True)
        return out
    return (timed, *others)


train.build_step = timed_build_step
sys.argv = ["train.py", *sys.argv[1:]]
sys.exit(train.main())
