"""Policies: the shipped files, defaults, every way a policy can be wrong, names and UM_POLICY."""

import dataclasses
import textwrap
import types

import pytest

from um_alloc.errors import PolicyError
from um_alloc.policy import (Policy, PoolSettings, SchedulerSettings, TagAdvice, load_policy,
                             packaged_policies_dir, policy_from_dict, resolve_policy_path,
                             validate_for_device)
from um_alloc.sizes import GiB, KiB, MiB
from um_alloc.tag_names import TAGS

GPU = TagAdvice(preferred_location="gpu", prefetch=True)


def write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(tmp_path, text, name="p.yaml"):
    path = write(tmp_path, text, name)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    message = str(info.value)
    assert str(path) in message, "every error names the file"
    return message


# ---------------------------------------------------------------- shipped policies
def test_packaged_dir_holds_the_shipped_policies():
    assert sorted(p.name for p in packaged_policies_dir().glob("*.yaml")) == [
        "best.yaml", "host_optimizer.yaml", "large_batch.yaml", "none.yaml", "offload.yaml", "planner.yaml",
        "worst.yaml"]


def test_host_optimizer_is_best_with_host_mapped_state_and_a_hard_budget():
    from um_alloc.policy import host_mapped

    best, host = load_policy("best"), load_policy("host_optimizer")
    assert host.scheduler.evict_live is False and best.scheduler.evict_live is False
    assert best.scheduler.strategy == "auto" and host.scheduler.strategy == "none"
    assert [t for t in TAGS if host_mapped(host.tags[t])] == ["optimizer_state", "spill"]
    assert {t: host.tags[t] for t in TAGS if t != "optimizer_state"} == \
        {t: best.tags[t] for t in TAGS if t != "optimizer_state"}


def test_large_batch_is_host_optimizer_with_the_planner_and_a_spilled_head():
    host, large = load_policy("host_optimizer"), load_policy("large_batch")
    assert dict(large.tags) == dict(host.tags)
    assert large.scheduler.strategy == "auto" and not large.scheduler.offload_activations
    assert large.scheduler.evict_live is False
    assert large.scheduler.spill_min_size == 256 * MiB and host.scheduler.spill_min_size is None


def test_none_policy_has_no_advice_and_default_settings():
    policy = load_policy("none")
    assert policy.name == "none"
    assert policy.source.endswith("none.yaml")
    assert all(advice == TagAdvice() for advice in policy.tags.values())
    assert policy.pool == PoolSettings() and policy.scheduler == SchedulerSettings()


def test_best_policy_values():
    tags = load_policy("best").tags
    assert tags["parameter"] == TagAdvice("gpu", False, ("gpu",), True)
    assert tags["gradient"] == TagAdvice(prefetch=True)  # an intermediate result, as activations
    assert tags["optimizer_state"] == GPU
    assert tags["input"] == TagAdvice(read_mostly=True, prefetch=True)
    assert tags["activation"] == TagAdvice(prefetch=True)
    assert tags["other"] == TagAdvice()


def test_worst_policy_values():
    tags = load_policy("worst").tags
    for tag in ("parameter", "gradient", "optimizer_state", "activation"):
        assert tags[tag] == TagAdvice("cpu", False, ("cpu",), False), tag
    assert tags["input"] == TagAdvice(preferred_location="cpu")
    assert tags["other"] == TagAdvice()
    assert not any(advice.prefetch for advice in tags.values())


# ---------------------------------------------------------------- defaults and shape
def test_defaults():
    policy = policy_from_dict({}, source="<dict>", name="empty")
    assert policy.pool == PoolSettings(2 * MiB, 1 * GiB, None, 2 * GiB, False)
    assert policy.scheduler == SchedulerSettings(None, None, 1 * MiB)
    assert list(policy.tags) == list(TAGS)
    assert isinstance(policy.tags, types.MappingProxyType)


def test_empty_sections_mean_defaults(tmp_path):
    assert load_policy(write(tmp_path, "{}")).pool == PoolSettings()
    policy = load_policy(write(tmp_path, "pool:\nscheduler:\ntags:\n  input:\n", "e.yaml"))
    assert policy.tags["input"] == TagAdvice() and policy.name == "e"


def test_full_policy_parses(tmp_path):
    policy = load_policy(write(tmp_path, """
        pool: {chunk_size: 64KiB, arena_size: 512MiB, max_reserved: 20GiB,
               reserve_margin: 0, oversubscribe: true}
        scheduler: {budget: 8GiB, schedule_window: 1.5GiB, min_swap_size: 4096}
        tags:
          input: {preferred_location: cpu, accessed_by: [cpu, gpu, cpu], read_mostly: true}
        """))
    assert policy.pool == PoolSettings(64 * KiB, 512 * MiB, 20 * GiB, 0, True)
    assert policy.scheduler == SchedulerSettings(8 * GiB, 3 * GiB // 2, 4096)
    assert policy.tags["input"].accessed_by == ("gpu", "cpu")   # deduplicated, gpu first


def test_auto_and_none_words_and_nulls():
    policy = load_policy({"pool": {"max_reserved": "auto"},
                          "scheduler": {"budget": "none", "schedule_window": None},
                          "tags": {"other": {"preferred_location": None, "accessed_by": None}}})
    assert policy.pool.max_reserved is None and policy.scheduler.budget is None
    assert policy.scheduler.schedule_window is None and policy.tags["other"] == TagAdvice()


def test_policy_is_frozen_and_hashable():
    policy = load_policy("best")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.pool.chunk_size = 1
    with pytest.raises(TypeError):
        policy.tags["other"] = GPU
    assert hash(policy) == hash(load_policy("best"))
    assert policy == load_policy("best")


def test_policy_built_directly_gets_all_tags():
    policy = Policy(name="x", source="code", tags={"input": GPU})
    assert list(policy.tags) == list(TAGS) and policy.tags["input"] == GPU
    with pytest.raises(PolicyError, match="unknown tag .*got 'weights'"):
        Policy(name="x", source="code", tags={"weights": GPU})


def test_budget_bytes():
    fraction = load_policy({"scheduler": {"budget": 0.25}})
    assert fraction.budget_bytes(80 * GiB) == 20 * GiB
    assert load_policy({"scheduler": {"budget": "10GiB"}}).budget_bytes(80 * GiB) == 10 * GiB
    assert load_policy({}).budget_bytes(80 * GiB) is None


# ---------------------------------------------------------------- bad input: one message each
@pytest.mark.parametrize("text, fragments", [
    ("pool: [1, 2]", ["pool: expected a mapping", "got [1, 2]"]),
    ("pools: {}", ["pools: unknown section", "allowed: pool, scheduler, tags",
                   "got 'pools'", "Did you mean 'pool'?"]),
    ("pool: {chunk_sise: 2MiB}", ["pool.chunk_sise: unknown key", "Did you mean 'chunk_size'?",
                                  "allowed: chunk_size, arena_size"]),
    ("scheduler: {window: 1GiB}", ["scheduler.window: unknown key", "min_swap_size"]),
    ("tags: {params: {}}", ["tags.params: unknown tag", "Did you mean 'parameter'?",
                            f"allowed: {', '.join(TAGS)}"]),
    ("tags: {input: {read_mostly: 'yes'}}",
     ["tags.input.read_mostly: expected a boolean", "allowed: true, false", "got 'yes'",
      "without quotes"]),
    ("tags: {input: {prefetch: 1}}", ["tags.input.prefetch: expected a boolean", "got 1"]),
    ("pool: {oversubscribe: 'false'}", ["pool.oversubscribe", "got 'false'"]),
    ("tags: {parameter: {accessed_by: gpu}}", ["tags.parameter.accessed_by: expected a list",
                                               "got 'gpu'", "Write [gpu]."]),
    ("tags: {parameter: {accessed_by: [gpu, host]}}", ["invalid entry 'host'",
                                                       "subset of [gpu, cpu]"]),
    ("tags: {parameter: {preferred_location: gpuu}}",
     ["tags.parameter.preferred_location: invalid value", "allowed: gpu, cpu, none", "got 'gpuu'"]),
    ("tags: {parameter: {preferred_location: GPU}}", ["allowed: gpu, cpu, none", "got 'GPU'"]),
    ("tags: {parameter: [gpu]}", ["tags.parameter: expected a mapping", "preferred_location"]),
    ("pool: {arena_size: lots}", ["pool.arena_size: unparsable size", "got 'lots'"]),
    ("pool: {arena_size: 0}", ["pool.arena_size: size must be > 0", "got 0", "allowed: an integer number of bytes > 0"]),
    ("pool: {reserve_margin: -1}", ["pool.reserve_margin: negative size", "got -1", "bytes >= 0"]),
    ("pool: {max_reserved: 20 GB}", ["pool.max_reserved", "write 20GiB (2**30)",
                                     "allowed: auto, or a size"]),
    ("pool: {max_reserved: 1MiB}", ["pool.max_reserved: must hold at least one chunk (2MiB, 2097152 bytes)",
                                    "allowed: auto, or a size >= 2MiB"]),
    ("scheduler: {schedule_window: 0}", ["scheduler.schedule_window: size must be > 0"]),
    ("scheduler: {min_swap_size: 1.5}", ["scheduler.min_swap_size", "Write the unit"]),
    ("pool: {chunk_size: 3MiB}", ["pool.chunk_size: 3145728 bytes is not a power of two",
                                  "64KiB", "1GiB", "got '3MiB'"]),
    ("pool: {chunk_size: 32KiB}", ["pool.chunk_size: 32768 bytes", "got '32KiB'"]),
    ("pool: {chunk_size: 2GiB}", ["pool.chunk_size: 2147483648 bytes", "got '2GiB'"]),
    ("pool: {chunk_size: 4MiB, arena_size: 6MiB}",
     ["pool.arena_size: must be a multiple of chunk_size (4194304 bytes = 4.0 MiB)",
      "2097152 bytes over", "got 6291456"]),
    ("scheduler: {budget: 1.5}", ["scheduler.budget: fraction out of range (0, 1]", "got 1.5",
                                  "0 < f <= 1"]),
    ("scheduler: {budget: 0.0}", ["fraction out of range", "got 0.0"]),
    ("scheduler: {budget: -0.5}", ["fraction out of range", "got -0.5"]),
    ("scheduler: {budget: 0}", ["scheduler.budget: budget must be > 0"]),
    ("scheduler: {budget: 1}", ["at least one chunk", "got 1", "e.g. 1.0"]),
    ("scheduler: {budget: half}", ["scheduler.budget: unparsable size", "got 'half'",
                                   "a fraction of device memory"]),
])
def test_bad_values(tmp_path, text, fragments):
    message = error_of(tmp_path, text)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("text", ["[pool, tags]", "just words", "42"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    message = error_of(tmp_path, text)
    assert "expected a mapping (a policy (sections: pool, scheduler, tags))" in message


def test_yaml_syntax_error_has_line_and_column(tmp_path):
    message = error_of(tmp_path, "pool:\n  chunk_size: 2MiB\n  arena_size: [1GiB\n")
    assert "YAML syntax error" in message
    assert "line 4, column 1" in message


def test_duplicate_keys_are_refused(tmp_path):
    message = error_of(tmp_path, "tags:\n  input: {}\n  input: {prefetch: true}\n")
    assert "duplicate key 'input'" in message and "line 3, column 3" in message


def test_missing_file_lists_packaged_names(tmp_path):
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "absent.yaml")
    message = str(info.value)
    assert "absent.yaml: policy file not found" in message
    assert "packaged policies: best, host_optimizer, large_batch, none, offload, planner, worst" in message


def test_unknown_bare_name():
    with pytest.raises(PolicyError, match="bestest: policy file not found; packaged policies: "
                                          "best, host_optimizer, large_batch, none, offload, planner, worst"):
        resolve_policy_path("bestest")


def test_load_policy_rejects_other_types():
    with pytest.raises(TypeError, match="got int"):
        load_policy(3)


def test_dict_errors_name_dict_source():
    with pytest.raises(PolicyError, match=r"^<dict>: tags\.input\.prefetch: "):
        load_policy({"tags": {"input": {"prefetch": "on"}}})


# ---------------------------------------------------------------- names, paths, env
@pytest.mark.parametrize("name", ["best", "best.yaml", "best.yml"])
def test_resolve_bare_name(name):
    assert resolve_policy_path(name) == packaged_policies_dir() / "best.yaml"


def test_existing_path_wins_over_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "best.yaml").write_text("tags: {other: {prefetch: true}}\n")
    assert resolve_policy_path("best.yaml").resolve() == (tmp_path / "best.yaml").resolve()
    assert load_policy("best.yaml").tags["other"].prefetch is True


def test_env_var_chooses_default_policy(monkeypatch, tmp_path):
    monkeypatch.setenv("UM_POLICY", "worst")
    assert load_policy().name == "worst"
    custom = write(tmp_path, "pool: {chunk_size: 1MiB}")
    monkeypatch.setenv("UM_POLICY", str(custom))
    assert load_policy().pool.chunk_size == 1 * MiB
    monkeypatch.setenv("UM_POLICY", "")
    assert load_policy().name == "none"
    monkeypatch.delenv("UM_POLICY")
    assert load_policy().name == "none"


def test_env_var_error_is_a_policy_error(monkeypatch):
    monkeypatch.setenv("UM_POLICY", "no_such_policy")
    with pytest.raises(PolicyError, match="^UM_POLICY=no_such_policy: no_such_policy: policy file not found"):
        load_policy()


def test_a_directory_is_not_a_policy_file(tmp_path):
    with pytest.raises(PolicyError, match=f"^{tmp_path}: is a directory, not a policy file; name a .yaml file in "
                                          "it, or a packaged policy: best, "):
        load_policy(tmp_path)


def test_an_empty_policy_file_is_refused(tmp_path):
    for text in ("", "# nothing yet\n"):
        message = error_of(tmp_path, text)
        assert "the policy file is empty; write `{}` for every default, or name the packaged policy none" in message


@pytest.mark.parametrize("word", ["yes", "no", "on", "Off", "YES"])
def test_yes_and_no_are_refused_where_true_and_false_are_meant(tmp_path, word):
    message = error_of(tmp_path, f"pool:\n  oversubscribe: {word}\n")
    assert f"line 2, column 18: '{word}' is read as a boolean; write true or false" in message


def test_true_and_false_and_quoted_words_still_read(tmp_path):
    policy = load_policy(write(tmp_path, "pool: {oversubscribe: True}\ntags: {input: {read_mostly: false}}\n"))
    assert policy.pool.oversubscribe is True
    message = error_of(tmp_path, "tags: {input: {preferred_location: 'no'}}\n")
    assert "preferred_location: invalid value (got 'no'; allowed: gpu, cpu, none)" in message


def test_load_policy_passes_policies_through():
    policy = load_policy("best")
    assert load_policy(policy) is policy


# ---------------------------------------------------------------- device checks
DEVICE = 24 * GiB


@pytest.mark.parametrize("data", [
    {},
    {"scheduler": {"budget": 1.0}},
    {"scheduler": {"budget": "24GiB"}},
    {"pool": {"max_reserved": "24GiB"}},
    {"pool": {"max_reserved": "64GiB", "oversubscribe": True}},
    {"pool": {"reserve_margin": "30GiB", "oversubscribe": True}},
])
def test_fits_device(data):
    validate_for_device(load_policy(data), DEVICE)   # raises nothing


@pytest.mark.parametrize("data, fragments", [
    ({"scheduler": {"budget": "25GiB"}},
     ["scheduler.budget: larger than device memory (24.0 GiB, 25769803776 bytes)",
      "got '25GiB'"]),
    ({"scheduler": {"budget": "32GiB"}, "pool": {"oversubscribe": True}}, ["scheduler.budget"]),
    ({"pool": {"max_reserved": "25GiB"}},
     ["pool.max_reserved: larger than device memory (24.0 GiB", "pool.oversubscribe: true"]),
    ({"pool": {"reserve_margin": "24GiB"}},
     ["pool.reserve_margin: leaves nothing", "max_reserved: auto"]),
])
def test_too_big_for_device(data, fragments):
    with pytest.raises(PolicyError) as info:
        validate_for_device(load_policy(data), DEVICE)
    assert str(info.value).startswith("<dict>: ")
    for fragment in fragments:
        assert fragment in str(info.value)


def test_shipped_policies_fit_a_small_gpu():
    for name in ("none", "best", "worst"):
        validate_for_device(load_policy(name), 8 * GiB)


def test_evict_live_and_host_mapped_tags():
    from um_alloc.policy import host_mapped

    assert SchedulerSettings().evict_live is False  # a budget is hard unless a policy asks otherwise
    assert policy_from_dict({"scheduler": {"evict_live": True}}, source="t.yaml", name="t").scheduler.evict_live
    policy = policy_from_dict({"scheduler": {"evict_live": False},
                               "tags": {"optimizer_state": {"preferred_location": "cpu",
                                                            "accessed_by": ["gpu"]}}},
                              source="t.yaml", name="t")
    assert policy.scheduler.evict_live is False
    assert host_mapped(policy.tags["optimizer_state"]) and not host_mapped(policy.tags["parameter"])
    with pytest.raises(PolicyError, match=r"scheduler\.evict_live: expected a boolean"):
        policy_from_dict({"scheduler": {"evict_live": "no"}}, source="t.yaml", name="t")


def test_prefetch_contradicts_a_host_mapped_tag():
    with pytest.raises(PolicyError, match=r"tags\.optimizer_state\.prefetch: contradicts preferred_location: cpu"):
        policy_from_dict({"tags": {"optimizer_state": {"preferred_location": "cpu", "accessed_by": ["gpu"],
                                                       "prefetch": True}}}, source="t.yaml", name="t")


def test_with_budget_overrides_and_checks_like_the_key():
    from um_alloc.policy import with_budget

    base = load_policy("best.yaml")
    assert with_budget(base, "16GiB", source="cli").scheduler.budget == 16 * 2**30
    assert with_budget(base, 0.5, source="cli").scheduler.budget == 0.5
    assert with_budget(base, "16GiB", source="cli").tags == base.tags
    with pytest.raises(PolicyError, match=r"cli: budget: fraction out of range"):
        with_budget(base, 1.5, source="cli")
    with pytest.raises(PolicyError, match=r"cli: budget: an absolute budget must hold at least one chunk"):
        with_budget(base, 100, source="cli")


def test_offload_activations_needs_a_hard_budget():
    with pytest.raises(PolicyError, match=r"scheduler.strategy: needs a hard budget.*"
                                          r"got 'offload'.*Drop `evict_live: true` from scheduler"):
        policy_from_dict({"scheduler": {"offload_activations": True, "evict_live": True}},
                         source="p.yaml", name="p")


@pytest.mark.parametrize("strategy", ["auto", "checkpoint", "offload"])
def test_every_strategy_needs_a_hard_budget(strategy):
    with pytest.raises(PolicyError, match=rf"scheduler.strategy: needs a hard budget.*got '{strategy}'"):
        policy_from_dict({"scheduler": {"strategy": strategy, "evict_live": True}}, source="p.yaml", name="p")


@pytest.mark.parametrize("key", ["one_node_recompute", "chains", "lean_loss"])
def test_the_planners_switches_are_on_unless_a_policy_turns_them_off(key):
    def scheduler(**keys):
        return policy_from_dict({"scheduler": keys}, source="p.yaml", name="p").scheduler

    assert getattr(scheduler(), key) is True
    assert getattr(scheduler(strategy="auto", **{key: False}), key) is False
    with pytest.raises(PolicyError, match=rf"scheduler.{key}: .*got 'no'"):
        scheduler(**{key: "no"})


def test_overflow_is_auto_a_size_or_none_at_all():
    def scheduler(**keys):
        return policy_from_dict({"scheduler": keys}, source="p.yaml", name="p").scheduler

    assert scheduler().overflow is None and scheduler(overflow="auto").overflow is None
    assert scheduler(overflow=0).overflow == 0 and scheduler(overflow="2GiB").overflow == 2 << 30
    with pytest.raises(PolicyError, match=r"scheduler.overflow: .*allowed: auto, 0 \(none\), or a size"):
        scheduler(overflow="lots")


def test_block_classes_name_the_planners_blocks_as_a_list_of_class_names():
    def scheduler(**keys):
        return policy_from_dict({"scheduler": keys}, source="p.yaml", name="p").scheduler

    assert scheduler().block_classes == ()
    assert scheduler(block_classes=["Block", "Stage", "Block"]).block_classes == ("Block", "Stage")
    with pytest.raises(PolicyError, match=r"scheduler.block_classes: expected a list.*Write \[Block\]"):
        scheduler(block_classes="Block")
    with pytest.raises(PolicyError, match=r"scheduler.block_classes: invalid entry 'my block': not a class name"):
        scheduler(block_classes=["my block"])


def test_strategy_is_checked_and_offload_activations_is_its_offload():
    def scheduler(**keys):
        return policy_from_dict({"scheduler": keys}, source="p.yaml", name="p").scheduler

    assert scheduler().strategy == "none"
    assert scheduler(offload_activations=True).strategy == "offload"
    assert scheduler(strategy="offload").offload_activations is True
    assert (scheduler(strategy="auto").strategy, scheduler(strategy="auto").offload_activations) == ("auto", False)
    with pytest.raises(PolicyError, match=r"scheduler.strategy: invalid value \(got 'fastest'; allowed: none, "
                                          r"offload, auto, checkpoint\)"):
        scheduler(strategy="fastest")
    with pytest.raises(PolicyError, match=r"scheduler.offload_activations: contradicts strategy: auto"):
        scheduler(strategy="auto", offload_activations=True)
    for hard in ({}, {"evict_live": False}):  # hard by default, or said so
        policy = policy_from_dict({"scheduler": {"offload_activations": True, **hard}},
                                  source="p.yaml", name="p")
        assert policy.scheduler.offload_activations and not policy.scheduler.evict_live


def test_best_plans_blocks_as_planner_does_and_offload_moves_activations_with_the_same_hints():
    best, planner, offload = load_policy("best.yaml"), load_policy("planner.yaml"), load_policy("offload.yaml")
    assert planner.tags == best.tags == offload.tags and planner.pool == best.pool == offload.pool
    assert planner.scheduler == best.scheduler and best.scheduler.strategy == "auto"
    assert best.scheduler.offload_activations is False
    assert offload.scheduler.strategy == "offload" and offload.scheduler.offload_activations
