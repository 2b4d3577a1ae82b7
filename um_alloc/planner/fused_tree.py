"""One kernel for a rebuild's tree of elementwise calls, where it gives the eager tree's bits.

GPT-2's GELU under bf16 autocast, ``0.5 * x * (1 + tanh(c * (x + k * x**3)))``, runs as eight
float32 kernels, each reading and writing a tensor four times the block's width. A block that
rebuilds the GELU's saved tensors reruns them in backward: on an H100, 1.20 ms of a GPT-2-medium
block at batch 8 x 1024 call by call, nearly the 1.70 ms of recomputing the whole block. Made as
one kernel, each rebuilt tensor reads `x` once and is written once: 0.37 ms.

The kernel is written from the tree and compiled at run time by torch.cuda.jiterator (NVRTC). Each
call becomes the float expression PyTorch's CUDA kernel computes, its basic operations rounded one
at a time (``__fmul_rn`` and the like, which the compiler never contracts into one rounding), tanh,
exp and rsqrt from CUDA's math library as ATen calls them, and its result rounded to the call's
dtype (bfloat16 to nearest even, as c10 rounds). Whether that gives PyTorch's bits is not assumed:
the first time a tree is fused, the kernel's result is compared with the eager tree's byte for
byte, and the tree runs eagerly unless they are equal. A call the table below does not know (the
linear whose output the GELU reads) is made by itself and read as one of the kernel's tensors. A
tree with a dtype other than float32 and bfloat16, or a leaf off the GPU, runs eagerly.

jiterator's kernel writes the dtype of the tensors it reads. A bfloat16 tree reading float32
copies writes float32 and is cast after; where each copy is a widening made again whose bfloat16
original backward still has (the GELU's product, rebuilt.py's _MadeAgain), the kernel reads
those and writes bfloat16 itself, again only once it gave the same bits.

**Several outputs, one kernel.** The trees and calls that read nothing but one such copy (GPT-2's
tanh, ``1 + t``, ``0.5 * x`` and the product, all of the first linear's output) each read it again
and write their own tensor, five passes with the copy itself. A FusedGroup makes them all in one
pass as the copy is made: one kernel reads the bfloat16 product once and writes the copy and each
member's output in the dtype its reader takes, which holds them until they are read. On an H200, a
GPT-2-medium block at batch 8 x 1024: 0.19 ms against 0.33 ms for the five kernels. The kernel is
compiled at run time (torch.cuda._compile_kernel, NVRTC) from the members' programs; it is used
once it gave each member's bits and the copy's, compared the first time.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import struct
import weakref
from typing import Any, Callable, Iterator

import torch

from ..byte_views import storage_bytes
from ..rebuild import Call, Param, Source, _value

__all__ = ["FusedGroup", "FusedTree", "fuse", "single_program", "tree_program"]

log = logging.getLogger(__name__)

# The dtypes a call may compute in; a bfloat16 result is rounded to it.
_DTYPES = (torch.float32, torch.bfloat16)
# Leaves the kernel reads as float32: converting them loses nothing.
_LEAF_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_LEAVES = 8  # the tensors one jiterator kernel takes
DEVICE_TYPES = ("cuda",)  # where jiterator compiles kernels

# A tree is written first as a program of float32 operations, then as CUDA C. Each node is a tuple:
# ("leaf", k), the kernel's k-th tensor; ("const", x), a float32 value; ("var", i), the program's
# i-th line; or (op, *operands), one of _C's operations, each rounded once.
_C = {"mul": "__fmul_rn({}, {})", "add": "__fadd_rn({}, {})", "sub": "__fsub_rn({}, {})",
      "div": "__fdiv_rn({}, {})", "neg": "(-{})", "tanh": "tanhf({})", "exp": "expf({})",
      "rsqrt": "rsqrtf({})", "bf16": "to_bf16({})"}
_ONE = ("const", 1.0)


def _pow(a: tuple, exponent, reduced: bool) -> tuple | None:
    # ATen's kernel multiplies for these exponents, in a reduced dtype rounding each product.
    if exponent == 2:
        return ("mul", a, a)
    if exponent == 3:
        square = ("mul", a, a)
        return ("mul", ("bf16", square) if reduced else square, a)
    return None


# Each call as ATen's CUDA kernel computes it, by the name the torch function mode saw it under;
# operands in the order of its arguments (self first), a scalar one as the float32 ATen makes of it.
_FORMS = {
    **dict.fromkeys(("mul", "__mul__", "__rmul__"), lambda a, b: ("mul", a, b)),
    **dict.fromkeys(("add", "__add__", "__radd__"), lambda a, b: ("add", a, b)),
    **dict.fromkeys(("sub", "__sub__"), lambda a, b: ("sub", a, b)),
    "__rsub__": lambda a, b: ("sub", b, a),
    # Tensor.__rtruediv__ is reciprocal(self) * other.
    **dict.fromkeys(("__rtruediv__", "__rdiv__"), lambda a, b: ("mul", ("div", _ONE, a), b)),
    **dict.fromkeys(("neg", "__neg__"), lambda a: ("neg", a)),
    "tanh": lambda a: ("tanh", a),
    "exp": lambda a: ("exp", a),
    "rsqrt": lambda a: ("rsqrt", a),
    "sigmoid": lambda a: ("div", _ONE, ("add", _ONE, ("exp", ("neg", a)))),
}
_DIVISIONS = ("div", "true_divide", "__truediv__", "__div__")
_POWERS = ("pow", "__pow__")
_WITH_ALPHA = ("add", "sub")

_PREAMBLE = """    auto to_bf16 = [](float f) -> float {  // round to nearest even, as c10::BFloat16
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(0x7fc00000u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return __uint_as_float(u & 0xffff0000u);
    };
"""


class FusedTree:
    """A tree's kernel: its program (tree_program's lines and result), its jiterator code, how many
    tensors it takes and the dtype of its output."""
    __slots__ = ("program", "name", "code", "leaves", "dtype", "device_type", "_kernel")

    def __init__(self, program: tuple, name: str, code: str, leaves: int, dtype: torch.dtype, device_type: str):
        self.program, self.name, self.code, self.leaves, self.dtype = program, name, code, leaves, dtype
        self.device_type = device_type
        self._kernel = None

    def __call__(self, call: Call, fetch: Callable[[Any], torch.Tensor],
                 dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The tree's output from its leaves, cast to `dtype` if given (the recipe's cast), or None
        where `call` reads other leaves than the tree this kernel was written for (its caller then
        runs it eagerly)."""
        dtype = dtype or self.dtype
        if dtype is not torch.float32:
            narrow = _narrow_leaf_values(call, fetch, dtype)
            if narrow is not None and len(narrow) == self.leaves and self._narrow_gives_bits(call, fetch, narrow):
                return self._launch(narrow)
        out = self._wide(call, fetch)
        return out if out is None else out.to(dtype)

    def _wide(self, call: Call, fetch) -> torch.Tensor | None:
        leaves = _leaf_values(call, fetch, self.device_type)
        if leaves is None or len(leaves) != self.leaves:
            return None
        out = self._launch(leaves)
        return out if self.dtype is torch.float32 else out.to(self.dtype)

    def _narrow_gives_bits(self, call: Call, fetch, narrow: list) -> bool:
        """Whether the kernel given its tensors in a narrower dtype (jiterator's kernel then writes
        that dtype) gives the bits of the float32 one cast to it: compared the first time, kept."""
        dtype = narrow[0].dtype
        key = (self.code, self.device_type, dtype)
        if key not in _NARROW_VERDICTS:
            wide, made = self._wide(call, fetch), self._launch(narrow)
            wide = wide if wide is None else wide.to(dtype)
            same = wide is not None and _equal(made, wide)
            log.info("planner: a rebuild's tree (%s) %s", self.name, f"writes {dtype} itself" if same else
                     f"writes float32, then a cast: given {dtype} tensors, it did not give the same bits")
            _NARROW_VERDICTS[key] = same
        return _NARROW_VERDICTS[key]

    def _launch(self, leaves: list) -> torch.Tensor:
        if self._kernel is None:
            self._kernel = torch.cuda.jiterator._create_jit_fn(self.code)
        return self._kernel(*leaves)


_VERDICTS: dict[tuple, FusedTree | None] = {}  # (code, device type) -> the kernel, if it gave the eager bits
_NARROW_VERDICTS: dict[tuple, bool] = {}  # (code, device type, dtype) -> whether narrow leaves gave its bits


def fuse(call: Call, fetch: Callable[[Any], torch.Tensor], device_type: str) -> FusedTree | None:
    """The one kernel for `call`'s tree, if it gives what the eager tree gives, bit for bit; None
    for a single call, a tree it cannot write, or one whose kernel differs. The first tree of each
    kind is run both ways and compared (which waits for the GPU); the answer is kept."""
    if device_type not in DEVICE_TYPES or not _writable(call) or not call.nested():
        return None
    dtypes: dict[int, torch.dtype] = {}
    with torch.no_grad():
        _eager(call, fetch, device_type, dtypes, first_elements=True)  # each call's dtype, at no cost
        tree = _written(call, dtypes, device_type)
        if tree is None:
            return None
        key = (tree.code, device_type)
        if key not in _VERDICTS:
            eager = _eager(call, fetch, device_type, {})
            _VERDICTS[key] = tree if _same_bits(tree, call, fetch, eager) else None
    return _VERDICTS[key]


def _same_bits(tree: FusedTree, call: Call, fetch, eager: torch.Tensor) -> bool:
    try:
        made = tree(call, fetch)
    except Exception as error:  # no runtime compiler, say: the eager tree stays, as it would anyway
        log.info("planner: a rebuild's tree of %d calls did not run as one kernel (%s: %s); it runs eagerly",
                 _count(call), type(error).__name__, error)
        return False
    same = made is not None and _equal(made, eager)
    log.info("planner: a rebuild's tree of %d calls (%s) %s", _count(call), tree.name,
             "runs as one kernel" if same else "runs eagerly: one kernel did not give its bits")
    return same


def _eager(call: Call, fetch, device_type: str, dtypes: dict, first_elements: bool = False) -> torch.Tensor:
    """The tree run call by call as Call.run runs it, noting each call's output dtype; with
    first_elements, on each tensor's first element alone (the same dtypes, for next to nothing)."""
    def value(v):
        if isinstance(v, Call) and _writable(v):
            return _eager(v, fetch, device_type, dtypes, first_elements)
        # A leaf, or a call the kernel reads as one (made whole: a linear is not elementwise).
        made = v.made_once(fetch, device_type) if isinstance(v, Call) else _value(v, fetch, device_type)
        return made[(slice(0, 1),) * made.dim()] if first_elements and isinstance(made, torch.Tensor) else made

    args = [value(v) for v in call.args]
    kwargs = {k: value(v) for k, v in call.kwargs.items()}
    enabled, dtype = call.autocast
    with torch.autocast(device_type, dtype=dtype, enabled=enabled):
        out = call.func(*args, **kwargs)
    dtypes[id(call)] = out.dtype
    return out


def _written(call: Call, dtypes: dict, device_type: str) -> FusedTree | None:
    """The kernel for `call`'s tree, not compiled yet, or None where the tree has no program."""
    program = tree_program(call, dtypes)
    if program is None:
        return None
    lines, result, leaves = program
    body = "".join(f"    float v{i} = {_c_of(line)};\n" for i, line in enumerate(lines))
    digest = hashlib.sha1(f"{body}{result}".encode()).hexdigest()[:12]
    name = f"um_alloc_rebuild_{digest}"
    params = ", ".join(f"T in{k}" for k in range(leaves))
    code = (f"template <typename T> T {name}({params}) {{\n{_PREAMBLE}"
            + "".join(f"    float in{k}f = in{k};\n" for k in range(leaves))
            + f"{body}    return {_c_of(result)};\n}}")
    return FusedTree((lines, result), name, code, leaves, dtypes[id(call)], device_type)


def tree_program(call: Call, dtypes: dict) -> tuple[list, tuple, int] | None:
    """`call`'s tree as float32 operations: (lines, result, number of leaves), each line a call's
    result rounded to its dtype (`dtypes`: id of a call -> its output dtype), leaves numbered in
    the order the kernel takes them (_leaf_values); None where a call or an operand has no form."""
    lines: list[tuple] = []
    leaves: dict[int, int] = {}
    result = _node(call, dtypes, leaves, lines, {})
    if result is None or not 0 < len(leaves) <= MAX_LEAVES:
        return None
    return lines, result, len(leaves)


def _node(call: Call, dtypes: dict, leaves: dict, lines: list, made: dict) -> tuple | None:
    """("var", i): the line holding `call`'s result, appended after the lines it reads."""
    if id(call) in made:
        return made[id(call)]
    dtype = dtypes.get(id(call))
    if dtype not in _DTYPES:
        return None
    operands = []
    for value in call.args:
        operand = _operand(value, dtypes, leaves, lines, made)
        if operand is None:
            return None
        operands.append(operand)
    operation = _operation(call, operands, dtype)
    if operation is None:
        return None
    lines.append(operation if dtype is torch.float32 else ("bf16", operation))
    made[id(call)] = ("var", len(lines) - 1)
    return made[id(call)]


def _operation(call: Call, operands: list, dtype: torch.dtype) -> tuple | None:
    name = call.func.__name__
    kwargs = dict(call.kwargs)
    if name in _WITH_ALPHA and kwargs.pop("alpha", 1) != 1:
        return None
    if kwargs or not operands or operands[0][0] == "const":
        return None
    if name in _POWERS:
        exponent = operands[1][1] if len(operands) == 2 and operands[1][0] == "const" else None
        return _pow(operands[0], exponent, dtype is not torch.float32)
    if name in _DIVISIONS:
        if len(operands) != 2:
            return None
        if operands[1][0] != "const":
            return ("div", *operands)
        # ATen divides by a scalar by multiplying by its float32 reciprocal, made on the host.
        reciprocal = _float32(1.0 / operands[1][1]) if operands[1][1] != 0 else None
        return ("mul", operands[0], ("const", reciprocal)) if reciprocal is not None else None
    form = _FORMS.get(name)
    if form is None or form.__code__.co_argcount != len(operands):
        return None
    return form(*operands)


def _operand(value, dtypes: dict, leaves: dict, lines: list, made: dict) -> tuple | None:
    if isinstance(value, Call) and _writable(value):
        return _node(value, dtypes, leaves, lines, made)
    if isinstance(value, (Source, Param, Call)):
        return ("leaf", leaves.setdefault(_leaf_key(value), len(leaves)))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    constant = _float32(value)
    return ("const", constant) if constant is not None else None


def _float32(value) -> float | None:
    """A Python number as the float32 ATen makes of it (None past float32's range). A quotient of
    float32 values rounded from double is the float32 quotient: double holds twice its precision."""
    try:
        return struct.unpack("<f", struct.pack("<f", float(value)))[0]
    except OverflowError:
        return None


def _c_of(node: tuple) -> str:
    kind = node[0]
    if kind == "leaf":
        return f"in{node[1]}f"
    if kind == "var":
        return f"v{node[1]}"
    if kind == "const":
        return f"__uint_as_float(0x{struct.unpack('<I', struct.pack('<f', node[1]))[0]:08x}u)"
    return _C[kind].format(*(_c_of(n) for n in node[1:]))


def _writable(call: Call) -> bool:
    """Whether the kernel computes `call` itself; any other call is made by itself, a leaf."""
    name = call.func.__name__
    return name in _FORMS or name in _DIVISIONS or name in _POWERS


def _tree_leaves(call: Call) -> Iterator:
    """What the kernel's calls read, depth first: plain values, held tensors, parameters, and the
    calls it does not compute."""
    for value in call.inputs:
        if isinstance(value, Call) and _writable(value):
            yield from _tree_leaves(value)
        else:
            yield value


def _leaf_key(value) -> int:
    # A held tensor read as itself or cast back from its widening is one value: one leaf.
    if isinstance(value, Source):
        return id(value.entry)
    return id(value) if isinstance(value, Call) else id(value.tensor)


def _leaf_values(call: Call, fetch, device_type: str) -> list | None:
    """The tensors the kernel takes, in the order tree_program numbered them (the first reading of
    each, depth first), as float32. A call read as a leaf is made once, its reading counted by the
    calls that read it as they skip (Call.skip)."""
    found: dict[int, torch.Tensor] = {}
    for value in _tree_leaves(call):
        if not isinstance(value, (Source, Param, Call)) or _leaf_key(value) in found:
            continue
        if isinstance(value, Call):
            tensor = value.made_once(fetch, device_type)
        else:
            tensor = fetch(value.entry) if isinstance(value, Source) else value.get()
        if tensor.dtype not in _LEAF_DTYPES:
            return None
        found[_leaf_key(value)] = tensor if tensor.dtype is torch.float32 else tensor.float()
    return list(found.values())


def _narrow_leaf_values(call: Call, fetch, dtype: torch.dtype) -> list | None:
    """The kernel's tensors in `dtype`, where each is a held tensor widened from one of `dtype` that
    its entry still has (Source.read): the kernel reads them as float32, exactly as it would the
    widened ones, and writes `dtype` itself. None where a tensor has no such form."""
    found: dict[int, torch.Tensor] = {}
    for value in _tree_leaves(call):
        if not isinstance(value, (Source, Param, Call)) or _leaf_key(value) in found:
            continue
        if not isinstance(value, Source):
            return None
        fetch(value.entry)  # made, if it is made again
        tensor = value.narrowed(dtype)
        if tensor is None:
            return None
        found[_leaf_key(value)] = tensor
    return list(found.values())


def _count(call: Call) -> int:
    return 1 + sum(_count(v) for v in call.nested())


def single_program(call: Call, dtype: torch.dtype) -> tuple | None:
    """The program of one call whose output is `dtype` (0.5 * x), for a FusedGroup: (lines, result),
    or None where the table cannot write it or it reads more than one tensor."""
    if not _writable(call) or call.nested():
        return None
    program = tree_program(call, {id(call): dtype})
    return program[:2] if program is not None and program[2] == 1 else None


def only_source(call: Call):
    """The one entry `call`'s tree reads (through Sources, cast or not), or None where it reads
    anything else: a parameter, another entry, a call the kernel does not compute."""
    entries = set()
    for value in _tree_leaves(call):
        if isinstance(value, (Param, Call)):
            return None
        if isinstance(value, Source):
            entries.add(id(value.entry))
            entry = value.entry
    return entry if len(entries) == 1 else None


# What a group's kernel reads and writes, as CUDA C: bfloat16 is the upper half of a float32.
_GROUP_TYPES = {torch.float32: "float", torch.bfloat16: "unsigned short"}
_GROUP_STORE = {torch.float32: "{}", torch.bfloat16: "(unsigned short)(__float_as_uint(to_bf16({})) >> 16)"}
GROUP_THREADS = 256
GROUP_BLOCKS_PER_SM = 16  # blocks a multiprocessor is given; each thread then strides over the rest
MAX_GROUP_NUMEL = (1 << 31) - 1  # the kernel counts elements in a C int


class _Member:
    """A call a group makes. It holds the call weakly: the call holds its group (Call.ahead), and
    a cycle would keep both, with the copy and its original, until the cycle collector ran."""
    __slots__ = ("_call", "program", "dtype", "cast", "tree")

    def __init__(self, call: Call, program: tuple, dtype: torch.dtype, cast: torch.dtype | None,
                 tree: FusedTree | None):
        self._call, self.dtype, self.cast, self.tree = weakref.ref(call), dtype, cast, tree
        self.program = (tuple(program[0]), program[1])  # hashable: the kernel's code is found by it

    @property
    def call(self) -> Call | None:
        return self._call()

    def wanted(self) -> torch.dtype | None:
        """The dtype its reader will take, None where nobody will (its output is made, or unread).
        A cast its recipe asks for is written where it is the call's only read (Call.run_cast)."""
        call = self.call
        if call is None:
            return None
        shared = call.shared
        if shared is not None and (shared.tensor is not None or shared.uses <= 0):
            return None
        if self.cast is not None and (shared is None or shared.uses == 1):
            return self.cast
        return self.dtype

    def reference(self, fetch, device_type: str, dtype: torch.dtype) -> torch.Tensor:
        """Its output as it is made alone (its verified kernel, or the call itself), cast to `dtype`."""
        with torch.no_grad():
            if self.tree is not None:
                made = self.tree._wide(self.call, fetch)
            else:
                made = self.call.eager(fetch, device_type)
        return made.to(dtype)


class FusedGroup:
    """The calls of one unit call that read nothing but one copy made again (`entry`, rebuilt.py's
    _MadeAgain), made with the copy by one kernel that reads the copy's narrower original once.
    The group holds each output until its call takes it (Call.ahead). The entry and the calls hold
    the group; it holds them weakly, so that all of it goes with the step's graph."""

    def __init__(self, entry, device_type: str):
        self._entry, self.device_type = weakref.ref(entry), device_type
        self.members: list[_Member] = []
        self._made: dict[int, tuple] = {}  # id(call) -> (its output, the call's own dtype), until taken
        self._launched = False

    def join(self, call: Call, program: tuple, dtype: torch.dtype, cast: torch.dtype | None = None,
             tree: FusedTree | None = None) -> None:
        """`call` (its program, output dtype, the cast its recipe asks for) is made by the group."""
        if call.ahead is None:
            call.ahead = self
            self.members.append(_Member(call, program, dtype, cast, tree))

    def launch(self, narrow: torch.Tensor, wide_dtype: torch.dtype, view: Callable) -> torch.Tensor | None:
        """The copy, `narrow` widened to `wide_dtype`, made with every member's output; None where
        the kernel cannot run or did not give the bits (the caller widens it, each member makes its
        own). `view` gives the copy as the members read it."""
        self._launched = True
        members = [(m, m.wanted()) for m in self.members]
        members = [(m, d) for m, d in members if d is not None]
        if not members or not self._fits(narrow, wide_dtype, view):
            return None
        code, name = _group_code(narrow.dtype, wide_dtype, tuple((m.program, d) for m, d in members))
        key = (code, self.device_type)
        if _GROUP_VERDICTS.get(key) is False:
            return None
        shape = view(narrow).shape
        wide = torch.empty_like(narrow, dtype=wide_dtype)
        outs = [torch.empty(shape, dtype=d, device=narrow.device) for _, d in members]
        try:
            self._launch(code, name, narrow, [wide, *outs], members)
        except Exception as error:  # no runtime compiler: each member makes its own, as it would anyway
            log.info("planner: %d rebuilt tensors of one copy could not be made in one kernel (%s: %s)",
                     len(members), type(error).__name__, error)
            _GROUP_VERDICTS[key] = False
            return None
        if key not in _GROUP_VERDICTS:
            _GROUP_VERDICTS[key] = self._same_bits(narrow, wide_dtype, view, wide, outs, members)
            if not _GROUP_VERDICTS[key]:
                return None
        self._made = {id(m.call): (out, m.dtype) for (m, _), out in zip(members, outs)}
        return wide

    def take(self, call: Call, fetch: Callable, dtype: torch.dtype | None) -> torch.Tensor | None:
        """`call`'s output made ahead, if it was, in `dtype` (None: the call's own dtype). Asking
        makes the copy, and with it the group's outputs, if nothing asked for the copy yet."""
        entry = self._entry()
        if not self._launched and entry is not None:
            fetch(entry)
        made, own = self._made.pop(id(call), (None, None))
        return made if made is not None and made.dtype is (dtype or own) else None

    def drop(self, call: Call) -> None:
        """`call` will not be read: its output made ahead goes."""
        self._made.pop(id(call), None)

    def _fits(self, narrow: torch.Tensor, wide_dtype: torch.dtype, view: Callable) -> bool:
        return (self.device_type in DEVICE_TYPES and narrow.device.type == self.device_type
                and narrow.dtype in _GROUP_TYPES and wide_dtype in _GROUP_TYPES
                and narrow.is_contiguous() and view(narrow).is_contiguous() and 0 < narrow.numel() <= MAX_GROUP_NUMEL)

    def _launch(self, code: str, name: str, narrow: torch.Tensor, outs: list, members: list) -> None:
        kernel = _GROUP_KERNELS.get(code)
        if kernel is None:
            kernel = _GROUP_KERNELS[code] = torch.cuda._compile_kernel(code, name)
        n = narrow.numel()
        sms = torch.cuda.get_device_properties(narrow.device).multi_processor_count
        blocks = min((n + GROUP_THREADS - 1) // GROUP_THREADS, sms * GROUP_BLOCKS_PER_SM)
        kernel(grid=(blocks, 1, 1), block=(GROUP_THREADS, 1, 1), args=[narrow, *outs, n])

    def _same_bits(self, narrow, wide_dtype, view, wide: torch.Tensor, outs: list, members: list) -> bool:
        """Whether the copy and each output are what they are made alone (compared once per kernel)."""
        copy = narrow.to(wide_dtype)
        fetch = lambda entry: view(copy)  # noqa: E731 (members read only the copy)
        same = _equal(wide, copy) and all(_equal(out, m.reference(fetch, self.device_type, d))
                                          for out, (m, d) in zip(outs, members))
        log.info("planner: %d rebuilt tensors of one copy %s", len(members), "are made with it in one kernel"
                 if same else "are made each by itself: one kernel did not give their bits")
        return same


_GROUP_KERNELS: dict[str, Any] = {}        # code -> the compiled kernel
_GROUP_VERDICTS: dict[tuple, bool] = {}    # (code, device type) -> whether it gave every output's bits


def _equal(made: torch.Tensor, expected: torch.Tensor) -> bool:
    """The same dtype, shape, strides and bytes: what a kernel must give to stand in for another."""
    return (made.dtype == expected.dtype and made.shape == expected.shape and made.stride() == expected.stride()
            and torch.equal(storage_bytes(made), storage_bytes(expected)))


@functools.lru_cache(maxsize=256)  # written once per kind of group, not at every block's backward
def _group_code(narrow: torch.dtype, wide: torch.dtype, programs: tuple) -> tuple[str, str]:
    """A kernel reading `narrow` elements, writing each widened to `wide`, then each program's
    result in its dtype (`programs`: ((lines, result), dtype) each): (code, name)."""
    body = [f"        out0[i] = {_GROUP_STORE[wide].format('in0f')};\n"]
    for k, ((lines, result), dtype) in enumerate(programs, start=1):
        values = "".join(f"            float v{j} = {_c_of(line)};\n" for j, line in enumerate(lines))
        store = _GROUP_STORE[dtype].format(_c_of(result))
        body.append(f"        {{\n{values}            out{k}[i] = {store};\n        }}\n")
    text = "".join(body)
    name = f"um_alloc_group_{hashlib.sha1(text.encode()).hexdigest()[:12]}"
    outs = [wide, *(dtype for _, dtype in programs)]
    params = ", ".join([f"const {_GROUP_TYPES[narrow]}* __restrict__ in0",
                        *(f"{_GROUP_TYPES[d]}* __restrict__ out{k}" for k, d in enumerate(outs)), "int n"])
    widen = "__uint_as_float(((unsigned int)in0[i]) << 16)" if narrow is torch.bfloat16 else "in0[i]"
    code = (f'extern "C" __global__ void {name}({params}) {{\n{_PREAMBLE}'
            "    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {\n"
            f"        float in0f = {widen};\n{text}    }}\n}}\n")
    return code, name
