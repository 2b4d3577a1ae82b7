"""A training step as the scheduler sees it: functions in execution order, and the variables each
one touches (Hayakawa & Narihira §3's function-sequence and variable-sequence).

A variable is one allocation, named by the order it first appeared in the step (not by its
address, which can change from step to step). The trace is plain data and round-trips through
JSON, so plans are built and tested from saved traces on machines without a GPU.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    id: int
    bytes: int
    tag: str = "activation"


@dataclass(frozen=True)
class Function:
    name: str                  # e.g. "forward:encoder.layer.3.attention"
    uses: tuple[int, ...]      # variable ids, in the order the function touched them


@dataclass
class Trace:
    functions: list[Function] = field(default_factory=list)
    variables: dict[int, Variable] = field(default_factory=dict)
    compute_s: float | None = None  # the traced step's time without transfers, when measured

    def variable_sequence(self) -> list[tuple[int, int]]:
        """(function index, variable id) for every use, in execution order."""
        return [(i, v) for i, f in enumerate(self.functions) for v in f.uses]

    def to_json(self) -> str:
        return json.dumps({"functions": [asdict(f) for f in self.functions],
                           "variables": [asdict(v) for v in self.variables.values()],
                           "compute_s": self.compute_s})

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        data = json.loads(text)
        variables = {v["id"]: Variable(**v) for v in data["variables"]}
        functions = [Function(f["name"], tuple(f["uses"])) for f in data["functions"]]
        trace = cls(functions, variables, data.get("compute_s"))
        trace.validate()
        return trace

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_json(Path(path).read_text())

    def validate(self) -> None:
        for i, f in enumerate(self.functions):
            unknown = [v for v in f.uses if v not in self.variables]
            if unknown:
                raise ValueError(f"trace function {i} ({f.name}) uses unknown variables {unknown[:5]}")


class TraceRecorder:
    """Records a Trace while one training step runs.

    Functions are the forward and backward of every leaf module (module hooks); variables are
    the storages autograd saves for backward (saved-tensor pack hooks) plus each leaf module's
    parameters. Use it around exactly one step:

        recorder = TraceRecorder(model)
        with recorder:
            loss = model(batch).loss; loss.backward(); optimizer.step()
        trace = recorder.trace
    """

    def __init__(self, model, tag_of=None):
        self.model = model
        self.trace = Trace()
        self._ids: dict[int, int] = {}   # storage address -> variable id, for this step
        self._current: list[int] | None = None
        self._handles = []
        self._saved_hooks = None
        self._tag_of = tag_of or (lambda ptr: "activation")

    def __enter__(self):
        import torch

        for name, module in self.model.named_modules():
            if next(module.children(), None) is not None:
                continue  # leaf modules only: containers would repeat their children's work
            self._handles += [
                module.register_forward_pre_hook(self._opener(f"forward:{name}", module)),
                module.register_forward_hook(self._closer()),
                module.register_full_backward_pre_hook(self._opener(f"backward:{name}", module)),
                module.register_full_backward_hook(self._closer()),
            ]
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._saved_hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _opener(self, name, module):
        def hook(*args):
            self._current = []
            for p in module.parameters(recurse=False):
                self._use(p)
            self._name = name
            self._before_function(len(self.trace.functions))
        return hook

    def _closer(self):
        def hook(*args):
            if self._current is not None:
                self.trace.functions.append(Function(self._name, tuple(dict.fromkeys(self._current))))
                self._after_function(len(self.trace.functions) - 1)
            self._current = None
        return hook

    # Subclasses act at function boundaries (the executor replays a plan there).
    def _before_function(self, index: int) -> None:
        pass

    def _after_function(self, index: int) -> None:
        pass

    def _use(self, tensor) -> int | None:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        ptr = storage.data_ptr()
        vid = self._ids.get(ptr)
        if vid is None:
            vid = self._ids[ptr] = len(self._ids)
            self.trace.variables[vid] = Variable(vid, storage.nbytes(), self._tag_of(ptr))
        if self._current is not None:
            self._current.append(vid)
        return vid

    def _pack(self, tensor):
        self._use(tensor)
        return tensor

    def _unpack(self, tensor):
        self._use(tensor)
        return tensor
