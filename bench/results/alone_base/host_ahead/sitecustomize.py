"""Diagnosis, not product code: each unit timed by itself twice over, from an idle GPU (as alone.py does) and with
the GPU kept busy while the host issues the call (the host ahead). UM_AHEAD_MODE=ahead|idle picks
which goes into the calibration; both go to UM_AHEAD_DIR/alone_<pid>.jsonl."""
import os

if os.environ.get("UM_AHEAD_DIR"):
    import json
    import time

    import torch
    from um_alloc.planner import alone

    _orig_timed, _orig_run = alone.AloneCalls._timed, alone.AloneCalls._run
    _path = os.path.join(os.environ["UM_AHEAD_DIR"], f"alone_{os.getpid()}.jsonl")
    _mode = os.environ.get("UM_AHEAD_MODE", "ahead")

    def _run(self, call):
        if getattr(self, "_ahead", False) and self.device.type == "cuda":
            host = getattr(call, "_host_s", 2e-3)
            torch.cuda._sleep(int(max(2e6, 1.5 * host * 2e9)))
        t0 = time.perf_counter()
        out = _orig_run(self, call)
        call._host_s = time.perf_counter() - t0
        return out

    def _timed(self, call):
        self._ahead = False
        idle = _orig_timed(self, call)
        host = getattr(call, "_host_s", None)
        self._ahead = True
        ahead = _orig_timed(self, call)
        self._ahead = False
        with open(_path, "a") as f:
            f.write(json.dumps({"name": call.name, "host_s": host,
                                "idle": None if idle is None else [idle.forward_s, idle.backward_s],
                                "ahead": None if ahead is None else [ahead.forward_s, ahead.backward_s]}) + "\n")
        return ahead if _mode == "ahead" else idle

    alone.AloneCalls._run, alone.AloneCalls._timed = _run, _timed
