"""Allocation policies: YAML file -> dict -> frozen dataclasses, validated in one function.

A policy says how the managed pool reserves memory (``pool``), how a GPU memory budget is kept
(``scheduler``) and which ``cudaMemAdvise`` hints and prefetches apply to each
allocation tag (``tags``). Every key is optional; its default is the dataclass field default
below and is written nowhere else. ``policy_from_dict`` is the only validator: whatever the
source (file, dict, ``UM_POLICY``), a policy goes through it, and every mistake comes back as
one ``PolicyError`` naming the file, the dotted key, the allowed values and the value received.

Nothing here touches CUDA; ``validate_for_device`` takes the device size as a plain number.
"""

from __future__ import annotations

import difflib
import os
import types
from dataclasses import dataclass, field, fields, replace
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping

import yaml

from . import arguments
from .errors import At, PolicyError
# The sizes are also reached as um_alloc.policy.parse_size etc.; they are defined in sizes.py.
from .sizes import GiB, KiB, MiB, TiB, format_size, parse_size, parse_size_at, size_arg, size_text
from .tag_names import TAGS

__all__ = ["KiB", "MiB", "GiB", "TiB", "PolicyError", "TagAdvice", "PoolSettings",
           "SchedulerSettings", "Policy", "parse_size", "size_arg", "format_size", "packaged_policies_dir",
           "resolve_policy_path", "load_policy", "policy_from_dict", "validate_for_device", "with_budget",
           "with_max_reserved"]

LOCATIONS = ("gpu", "cpu", "none")
# none: as autograd keeps them; offload: what does not fit moves to host memory (um_alloc.offload);
# auto: the block planner keeps, recomputes or moves each block (um_alloc.planner); checkpoint:
# the planner recomputing every block (an ablation).
STRATEGIES = ("none", "offload", "auto", "checkpoint")
ACCESSORS = ("gpu", "cpu")          # also the canonical order of TagAdvice.accessed_by
CHUNK_MIN, CHUNK_MAX = 64 * KiB, 1 * GiB
ENV_VAR = "UM_POLICY"
DEFAULT_POLICY = "none"


# ---------------------------------------------------------------- dataclasses (the defaults)
@dataclass(frozen=True)
class TagAdvice:
    """Hints for one tag; mirrors ``um::TagPolicy`` in csrc/advice.hpp."""
    preferred_location: str = "none"          # "gpu" | "cpu" | "none"
    read_mostly: bool = False
    accessed_by: tuple[str, ...] = ()         # subset of ACCESSORS, deduplicated, gpu first
    prefetch: bool = False                    # prefetch to the GPU when allocated or retagged


@dataclass(frozen=True)
class PoolSettings:
    chunk_size: int = 2 * MiB                 # bytes; power of two in [CHUNK_MIN, CHUNK_MAX]
    arena_size: int = 1 * GiB                 # bytes per cudaMallocManaged; multiple of chunk_size
    max_reserved: int | None = None           # bytes; None = auto (free at install - margin)
    reserve_margin: int = 2 * GiB             # bytes left free by auto
    oversubscribe: bool = False               # lift the cap derived from free device memory


@dataclass(frozen=True)
class SchedulerSettings:
    budget: int | float | None = None         # int bytes, float fraction in (0, 1], None = none
    schedule_window: int | None = None        # bytes; None = auto
    min_swap_size: int = 1 * MiB              # bytes; smaller allocations are never swapped
    evict_live: bool = False                  # over budget: only free chunks leave, then out of
                                              # memory (hard); true: live blocks are evicted and
                                              # faulted back (reactive, which does not keep the
                                              # budget at scale; the page-fault baseline)
    offload_activations: bool = False         # saved tensors beyond the budget go to pinned host
                                              # memory (um_alloc.offload); needs a hard budget;
                                              # the same as strategy: offload
    strategy: str = "none"                    # under a budget, how activations survive until
                                              # backward: one of STRATEGIES (below)
    spill_min_size: int | None = None         # bytes; allocations this large in a spill_from
                                              # region get the spill tag (um_alloc.spill); None = off
    one_node_recompute: bool = True           # the block planner recomputes a block as one node
                                              # of the graph where it may; false: through
                                              # torch.utils.checkpoint (um_alloc.planner.rerun)
    chains: bool = True                       # the block planner may rerun units whose calls
                                              # follow one another in chains (um_alloc.planner.chain)
    lean_loss: bool = True                    # the block planner computes a large cross-entropy
                                              # inside the model's forward in row chunks
                                              # (um_alloc.planner.lean_loss)
    recompute_logits: bool = False            # that cross-entropy makes a linear head's logits
                                              # again in backward, a chunk at a time, and gives the
                                              # head its gradients: the same to rounding, not bit
                                              # for bit (um_alloc.planner.lean_loss)
    block_classes: tuple[str, ...] = ()       # class names of the block planner's blocks, where
                                              # its search finds none or the wrong ones; empty:
                                              # the search (um_alloc.planner.blocks)
    overflow: int | None = None               # bytes of a step's requests the hard budget
                                              # refuses that go to host memory instead of failing
                                              # the step; None = auto (a quarter of the budget, at
                                              # least 1 GiB), 0 = none (um_alloc.planner.director)


@dataclass(frozen=True)
class Policy:
    name: str                                  # file stem, e.g. "best"
    source: str                                # path it came from, or "<dict>"
    pool: PoolSettings = field(default_factory=PoolSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    # hash=False: a mappingproxy is unhashable, and the other fields identify a policy anyway.
    tags: Mapping[str, TagAdvice] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        # Consumers index tags[tag] for every tag, so fill the gaps here, once, in TAGS order.
        unknown = sorted(set(self.tags) - set(TAGS))
        if unknown:
            raise At(self.source, "tags").error("unknown tag", allowed=", ".join(TAGS),
                                                 received=unknown[0])
        full = {tag: self.tags.get(tag, TagAdvice()) for tag in TAGS}
        object.__setattr__(self, "tags", types.MappingProxyType(full))

    def budget_bytes(self, device_total_bytes: int) -> int | None:
        """The GPU residency budget in bytes (a fraction resolved against the device), or None."""
        budget = self.scheduler.budget
        if isinstance(budget, float):
            return int(budget * device_total_bytes)
        return budget


# ---------------------------------------------------------------- value converters
Converter = Callable[[Any, At], Any]


_bool = arguments.flag


def _choice(choices: tuple[str, ...], null: str | None = None) -> Converter:
    def convert(value: Any, at: At) -> str:
        if value is None and null is not None:   # YAML `~` or an empty value
            return null
        return arguments.one_of(value, at, choices)
    return convert


def _accessors(value: Any, at: At) -> tuple[str, ...]:
    allowed = f"a list, subset of [{', '.join(ACCESSORS)}]"
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise at.error("expected a list", allowed=allowed, received=value,
                       hint=f"Write [{value}]." if value in ACCESSORS else None)
    bad = [v for v in value if v not in ACCESSORS]
    if bad:
        raise at.error(f"invalid entry {bad[0]!r}", allowed=allowed, received=value)
    return tuple(a for a in ACCESSORS if a in value)   # deduplicated, canonical order


def _class_names(value: Any, at: At) -> tuple[str, ...]:
    allowed = "a list of class names, like [BertLayer], or [] for the planner's own search"
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise at.error("expected a list", allowed=allowed, received=value,
                       hint=f"Write [{value}]." if isinstance(value, str) else None)
    bad = [v for v in value if not isinstance(v, str) or not v.isidentifier()]
    if bad:
        raise at.error(f"invalid entry {bad[0]!r}: not a class name", allowed=allowed, received=value)
    return tuple(dict.fromkeys(value))  # deduplicated, in the order given


def _size(minimum: int = 0) -> Converter:
    return lambda value, at: arguments.size(value, at, minimum=minimum)


def _size_or(word: str, zero_is_none: bool = False) -> Converter:
    """A size > 0 (or 0, meaning none, where `zero_is_none`), or `word` / null meaning None (auto)."""
    allowed = (f"{word}, 0 (none), or a size like 512MiB or 4GiB" if zero_is_none
               else f"{word}, or a size > 0 like 512MiB or 4GiB")

    def convert(value: Any, at: At) -> int | None:
        if value is None or (isinstance(value, str) and value.strip() == word):
            return None
        n = parse_size_at(value, at, allowed)
        if n == 0 and not zero_is_none:
            raise at.error("size must be > 0", allowed=allowed, received=value)
        return n
    return convert


def _chunk_size(value: Any, at: At) -> int:
    allowed = "a power of two from 64KiB to 1GiB (64KiB, 128KiB, ..., 2MiB, ..., 1GiB)"
    n = parse_size_at(value, at, allowed)
    if n & (n - 1) or not CHUNK_MIN <= n <= CHUNK_MAX:
        raise at.error(f"{n} bytes is not a power of two in range", allowed=allowed,
                       received=value)
    return n


_BUDGET_ALLOWED = "none, a size > 0 like 8GiB, or a fraction of device memory 0 < f <= 1 like 0.5"


def _budget(value: Any, at: At) -> int | float | None:
    if value is None or value == "none":
        return None
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise at.error("fraction out of range (0, 1]", allowed=_BUDGET_ALLOWED,
                           received=value)
        return value
    n = parse_size_at(value, at, _BUDGET_ALLOWED)
    if n == 0:
        raise at.error("budget must be > 0", allowed=_BUDGET_ALLOWED, received=value)
    return n


_CONVERTERS: dict[type, dict[str, Converter]] = {
    PoolSettings: {
        "chunk_size": _chunk_size, "arena_size": _size(1), "max_reserved": _size_or("auto"),
        "reserve_margin": _size(), "oversubscribe": _bool,
    },
    SchedulerSettings: {
        "budget": _budget, "schedule_window": _size_or("auto"), "min_swap_size": _size(),
        "evict_live": _bool, "offload_activations": _bool, "spill_min_size": _size_or("none"),
        "strategy": _choice(STRATEGIES), "one_node_recompute": _bool, "chains": _bool, "lean_loss": _bool,
        "recompute_logits": _bool,
        "block_classes": _class_names, "overflow": _size_or("auto", zero_is_none=True),
    },
    TagAdvice: {
        "preferred_location": _choice(LOCATIONS, null="none"), "read_mostly": _bool,
        "accessed_by": _accessors, "prefetch": _bool,
    },
}
_SECTIONS = ("pool", "scheduler", "tags")


# ---------------------------------------------------------------- the one validation function
def policy_from_dict(data: Mapping | None, *, source: str, name: str) -> Policy:
    """Validate an already-parsed policy and build it. The only place policies are checked."""
    at = At(source)
    top = _mapping(data, at, what="a policy (sections: pool, scheduler, tags)")
    _reject_unknown(top, _SECTIONS, at, what="section")
    pool = _section(PoolSettings, top.get("pool"), at.child("pool"))
    if pool.arena_size % pool.chunk_size:
        raise at.child("pool.arena_size").error(
            f"must be a multiple of chunk_size ({pool.chunk_size} bytes = "
            f"{format_size(pool.chunk_size)}); it is "
            f"{pool.arena_size % pool.chunk_size} bytes over", received=pool.arena_size)
    _check_cap_holds_a_chunk(pool.max_reserved, pool.chunk_size, at.child("pool.max_reserved"))
    scheduler = _strategy(_section(SchedulerSettings, top.get("scheduler"), at.child("scheduler")),
                          at.child("scheduler"))
    _check_budget_holds_a_chunk(scheduler.budget, pool.chunk_size, at.child("scheduler.budget"))
    tags = _tags(top.get("tags"), at.child("tags"))
    if scheduler.spill_min_size is not None and not host_mapped(tags.get("spill", TagAdvice())):
        raise at.child("scheduler.spill_min_size").error(
            "spills to the spill tag, which this policy does not place in host memory: spilled "
            "allocations would stay on the GPU", received=scheduler.spill_min_size,
            hint="Add under tags: `spill: {preferred_location: cpu, accessed_by: [gpu]}`, or drop spill_min_size.")
    return Policy(name=name, source=source, pool=pool, scheduler=scheduler, tags=tags)


def _strategy(scheduler: SchedulerSettings, at: At) -> SchedulerSettings:
    """offload_activations: true is strategy: offload; both keys end up saying the same thing.
    Every strategy but none needs a hard budget."""
    if scheduler.offload_activations and scheduler.strategy not in ("none", "offload"):
        raise at.child("offload_activations").error(
            f"contradicts strategy: {scheduler.strategy} (offload_activations: true means strategy: offload)",
            allowed="one of the two keys", received=True, hint="Drop offload_activations.")
    if scheduler.offload_activations or scheduler.strategy == "offload":
        scheduler = replace(scheduler, offload_activations=True, strategy="offload")
    if scheduler.strategy != "none" and scheduler.evict_live:
        raise at.child("strategy").error(
            "needs a hard budget: with evict_live: true the pool would also evict the activations the "
            "strategy keeps on the GPU, and the driver keeps the GPU memory of evicted pages anyway",
            allowed="none with evict_live: true", received=scheduler.strategy,
            hint="Drop `evict_live: true` from scheduler: the budget is then hard.")
    return scheduler


def _mapping(value: Any, at: At, *, what: str) -> Mapping:
    if value is None:                 # `pool:` with nothing under it (an empty file is refused before)
        return {}
    if not isinstance(value, Mapping):
        raise at.error(f"expected a mapping ({what})", received=value)
    return value


def _reject_unknown(raw: Mapping, known: tuple[str, ...], at: At, *, what: str) -> None:
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            raise at.child(key).error(
                f"unknown {what}", allowed=", ".join(known), received=key,
                hint=f"Did you mean {close[0]!r}?" if close else None)


def _section(cls: type, raw: Any, at: At) -> Any:
    raw = _mapping(raw, at, what=f"keys: {', '.join(f.name for f in fields(cls))}")
    convert = _CONVERTERS[cls]
    _reject_unknown(raw, tuple(convert), at, what="key")
    return cls(**{key: convert[key](value, at.child(key)) for key, value in raw.items()})


def _tags(raw: Any, at: At) -> dict[str, TagAdvice]:
    raw = _mapping(raw, at, what=f"tag names: {', '.join(TAGS)}")
    _reject_unknown(raw, TAGS, at, what="tag")
    tags = {tag: _section(TagAdvice, value, at.child(tag)) for tag, value in raw.items()}
    for tag, advice in tags.items():
        if advice.prefetch and host_mapped(advice):
            raise at.child(tag).child("prefetch").error(
                "contradicts preferred_location: cpu with accessed_by: [gpu] (a host-mapped tag stays in "
                "host memory and is read over the link; prefetching would pull it onto the GPU)",
                allowed="false here, or drop gpu from accessed_by", received=True)
    return tags


def host_mapped(advice: TagAdvice) -> bool:
    """A tag whose memory stays on the host, mapped for the GPU: it never counts against the budget."""
    return advice.preferred_location == "cpu" and "gpu" in advice.accessed_by


def with_budget(policy: Policy, budget: Any, *, source: str, key: str = "budget") -> Policy:
    """The policy with scheduler.budget replaced by `budget`, checked as the key would be; errors
    name `source` and `key` (an argument or a command-line flag)."""
    at = At(source, key)
    value = _budget(budget, at)
    _check_budget_holds_a_chunk(value, policy.pool.chunk_size, at)
    return replace(policy, scheduler=replace(policy.scheduler, budget=value))


def with_max_reserved(policy: Policy, max_reserved: Any, *, source: str, key: str = "max_reserved") -> Policy:
    """The policy with pool.max_reserved replaced by `max_reserved`, checked as the key would be."""
    at = At(source, key)
    value = _size_or("auto")(max_reserved, at)
    _check_cap_holds_a_chunk(value, policy.pool.chunk_size, at, written=max_reserved)
    return replace(policy, pool=replace(policy.pool, max_reserved=value))


def _check_cap_holds_a_chunk(cap: int | None, chunk_size: int, at: At, *, written: Any = None) -> None:
    """`written`: the value as the caller wrote it, where there is one; else the cap as a size."""
    if cap is not None and cap < chunk_size:
        raise at.error(f"must hold at least one chunk ({size_text(chunk_size)}, {chunk_size} bytes)",
                       allowed=f"auto, or a size >= {size_text(chunk_size)}",
                       received=_written(cap) if written is None else written)


def _check_budget_holds_a_chunk(budget: int | float | None, chunk_size: int, at: At) -> None:
    if isinstance(budget, int) and budget < chunk_size:
        # Usually `budget: 1` meant "all of the device"; as an int it is one byte.
        raise at.error(f"an absolute budget must hold at least one chunk ({chunk_size} bytes)",
                       allowed=_BUDGET_ALLOWED, received=budget,
                       hint="An integer is bytes; a fraction needs a decimal point, e.g. 1.0.")


# ---------------------------------------------------------------- device checks
def validate_for_device(policy: Policy, device_total_bytes: int) -> None:
    """Refuse settings that cannot fit a device of `device_total_bytes`. Raises PolicyError."""
    at, total = At(policy.source), device_total_bytes
    device = f"device memory ({format_size(total)}, {total} bytes)"
    budget = policy.budget_bytes(total)
    if budget is not None and budget > total:
        raise at.child("scheduler.budget").error(
            f"larger than {device}", received=_written(policy.scheduler.budget),
            hint="A budget emulates a smaller GPU; it cannot exceed the real one.")
    pool = policy.pool
    if pool.oversubscribe:
        return
    if pool.max_reserved is not None and pool.max_reserved > total:
        raise at.child("pool.max_reserved").error(
            f"larger than {device} without pool.oversubscribe: true", received=_written(pool.max_reserved))
    if pool.max_reserved is None and pool.reserve_margin >= total:
        raise at.child("pool.reserve_margin").error(
            f"leaves nothing of {device} for max_reserved: auto", received=_written(pool.reserve_margin))


def _written(value: int | float) -> str | float:
    """A size as the policy may have written it (32GiB, not 34359738368); a fraction as it is."""
    return size_text(value) if isinstance(value, int) else value


# ---------------------------------------------------------------- files and names
def packaged_policies_dir() -> Path:
    """The shipped policies: `um_alloc.policies` when installed, else the checkout's policies/."""
    try:
        packaged = files("um_alloc.policies")
        # Only a real directory will do; a zip or a namespace MultiplexedPath falls through.
        if isinstance(packaged, Path) and packaged.is_dir():
            return packaged
    except (ImportError, TypeError):
        pass
    here = Path(__file__).resolve().parent
    installed = here / "policies"          # setuptools package_dir maps policies/ here
    return installed if installed.is_dir() else here.parent / "policies"


def _packaged_names() -> list[str]:
    folder = packaged_policies_dir()
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def resolve_policy_path(name_or_path: str | os.PathLike) -> Path:
    """An existing file as given; else a bare name ("best", "best.yaml") among packaged ones."""
    path = Path(os.fspath(name_or_path)).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise PolicyError(f"{path}: is a directory, not a policy file; name a .yaml file in it, or a "
                          f"packaged policy: {', '.join(_packaged_names()) or '(none found)'}", source=str(path))
    if path.parent == Path(".") and path.suffix in ("", ".yaml", ".yml"):
        candidate = packaged_policies_dir() / f"{path.stem}.yaml"
        if candidate.is_file():
            return candidate
    raise PolicyError(f"{path}: policy file not found; packaged policies: "
                      f"{', '.join(_packaged_names()) or '(none found)'}", source=str(path))


def load_policy(source: Any = None) -> Policy:
    """A Policy from None (env UM_POLICY, else packaged "none"), a path or bare name, a dict
    (source "<dict>"), or a Policy (returned as is). Raises PolicyError for any bad input."""
    if isinstance(source, Policy):
        return source
    if source is None:
        return _policy_from_environment()
    if isinstance(source, Mapping):
        return policy_from_dict(source, source="<dict>", name="<dict>")
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_policy: expected a path, name, mapping or Policy, "
                        f"got {type(source).__name__} {source!r}")
    path = resolve_policy_path(source)
    return policy_from_dict(_read_policy_file(path), source=str(path), name=path.stem)


def _policy_from_environment() -> Policy:
    """UM_POLICY's policy, else the default; a mistake there says it came from UM_POLICY."""
    named = os.environ.get(ENV_VAR)
    if not named:
        return load_policy(DEFAULT_POLICY)
    try:
        return load_policy(named)
    except PolicyError as error:
        raise PolicyError(f"{ENV_VAR}={named}: {error}", source=error.source, key=error.key) from error


def _read_policy_file(path: Path) -> Any:
    data = _read_yaml(path)
    if data is None:
        # An empty file is more often a mistake (a wrong or truncated file) than a wish for the
        # defaults, and those have a name.
        raise PolicyError(f"{path}: the policy file is empty; write `{{}}` for every default, or name "
                          f"the packaged policy {DEFAULT_POLICY}", source=str(path))
    return data


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (silently keeping the last one hides mistakes) and
    booleans written other than true or false: YAML 1.1 reads an unquoted yes, no, on or off as
    one, which in a value such as `preferred_location: no` is never what was meant."""

    def construct_yaml_bool(self, node):
        if node.value.lower() not in ("true", "false"):
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} is read as a boolean; write true or false (or quote it "
                "for a string)", node.start_mark)
        return super().construct_yaml_bool(node)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue                   # SafeLoader's own check reports unhashable keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor("tag:yaml.org,2002:bool", _StrictLoader.construct_yaml_bool)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"{path}: cannot read policy file: {exc}", source=str(path)) from exc
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        # A constructor error (a duplicate key, yes for true) is well-formed YAML a policy refuses.
        kind = "" if isinstance(exc, yaml.constructor.ConstructorError) else "YAML syntax error: "
        raise PolicyError(f"{path}: {where}{kind}{problem}", source=str(path)) from exc
