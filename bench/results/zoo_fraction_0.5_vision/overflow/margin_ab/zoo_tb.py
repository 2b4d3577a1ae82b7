"""zoo_train under the launcher, with the OOM's traceback; SCRATCH_NOPROBE=1 turns the rebuild probe off,
SCRATCH_WINDOW=<bytes> sets the planner's window."""
import os, sys, traceback
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
if os.environ.get("SCRATCH_NOPROBE"):
    import contextlib
    from um_alloc.planner import rebuilt
    @contextlib.contextmanager
    def around(self, values):
        yield
    rebuilt.RebuildProbe.around = around
    print("scratch: rebuild probe off", file=sys.stderr)
if os.environ.get("SCRATCH_WINDOW"):
    from um_alloc.planner import director
    init = director.BlockPlanner.__init__
    def patched(self, *a, **k):
        k["window"] = int(os.environ["SCRATCH_WINDOW"])
        init(self, *a, **k)
    director.BlockPlanner.__init__ = patched
    print("scratch: window", os.environ["SCRATCH_WINDOW"], file=sys.stderr)
if os.environ.get("SCRATCH_MARGIN16"):
    from um_alloc.planner import director as _d
    _init = _d.BlockPlanner.__init__
    def _patched(self, model, budget=None, **k):
        _init(self, model, budget, **k)
        self.margin = min(512 << 20, self.budget // 16)
        print("scratch: margin", self.margin, file=sys.stderr)
    _d.BlockPlanner.__init__ = _patched
if os.environ.get("SCRATCH_MARGIN"):
    from um_alloc.planner import director as _d2
    _init2 = _d2.BlockPlanner.__init__
    def _patched2(self, model, budget=None, **k):
        k["margin"] = int(os.environ["SCRATCH_MARGIN"])
        _init2(self, model, budget, **k)
        print("scratch: margin", self.margin, file=sys.stderr)
    _d2.BlockPlanner.__init__ = _patched2
import zoo_train
try:
    zoo_train.main()
except torch.OutOfMemoryError:
    traceback.print_exc()
    print("live", torch.cuda.memory_allocated() if False else "", file=sys.stderr)
    sys.exit(3)
