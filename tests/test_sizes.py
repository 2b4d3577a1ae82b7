"""parse_size / format_size: the size syntax every policy key and size argument uses."""

import pytest

from um_alloc.errors import PolicyError
from um_alloc.sizes import GiB, KiB, MiB, TiB, format_size, parse_size, positive_size_arg, size_arg

GOOD = [
    (0, 0),
    (4096, 4096),
    (2**40, TiB),
    ("0B", 0),
    ("512B", 512),
    ("64KiB", 64 * KiB),
    ("2MiB", 2 * MiB),
    ("2 MiB", 2 * MiB),
    ("  4GiB ", 4 * GiB),
    ("1TiB", TiB),
    ("1.5GiB", 3 * GiB // 2),
    (".5MiB", MiB // 2),
    ("2.MiB", 2 * MiB),
    ("0.1KiB", 102),             # 102.4 rounds to 102
    ("1.5B", 2),                 # rounded to whole bytes
    ("2gib", 2 * GiB),           # binary units are unambiguous in any case
    ("3Mib", 3 * MiB),
]


@pytest.mark.parametrize("value, expected", GOOD)
def test_parse_size_accepts(value, expected):
    assert parse_size(value, key="pool.chunk_size", source="t.yaml") == expected


BAD = [
    # value, a fragment the message must contain
    (-1, ">= 0"),
    ("-2MiB", ">= 0"),
    (True, "not a size"),
    (None, "not a size"),
    ([1], "not a size"),
    (1.5, "Write the unit, e.g. '1.5GiB'"),
    ("12 GB", "'12 GB' is ambiguous: write 12GiB (2**30)"),
    ("12GB", "write 12GiB (2**30)"),
    ("4MB", "write 4MiB (2**20)"),
    ("8KB", "write 8KiB (2**10)"),
    ("1TB", "write 1TiB (2**40)"),
    ("16G", "write 16GiB (2**30)"),
    ("1024", "needs a unit"),
    ("2 parsecs", "unknown size unit"),
    ("MiB", "unparsable size"),
    ("1e9B", "unparsable size"),
    ("1,5GiB", "unparsable size"),
    ("", "unparsable size"),
    ("nan GiB", "unparsable size"),
]


@pytest.mark.parametrize("value, fragment", BAD)
def test_parse_size_rejects_with_reason(value, fragment):
    with pytest.raises(PolicyError) as info:
        parse_size(value, key="scheduler.min_swap_size", source="my.yaml")
    message = str(info.value)
    assert fragment in message
    assert message.startswith("my.yaml: scheduler.min_swap_size: ")
    assert f"got {value!r}" in message
    assert "KiB, MiB, GiB, TiB" in message           # the allowed units are listed
    assert info.value.key == "scheduler.min_swap_size"
    assert info.value.source == "my.yaml"


def test_policy_error_is_a_value_error():
    with pytest.raises(ValueError):
        parse_size("x", key="k", source="s")


@pytest.mark.parametrize("n, text", [
    (0, "0 B"),
    (512, "512 B"),
    (1023, "1023 B"),
    (KiB, "1.0 KiB"),
    (1536, "1.5 KiB"),
    (2 * MiB, "2.0 MiB"),
    (2097152, "2.0 MiB"),
    (3 * GiB // 2, "1.5 GiB"),
    (80 * GiB, "80.0 GiB"),
    (2 * TiB, "2.0 TiB"),
])
def test_format_size(n, text):
    assert format_size(n) == text


@pytest.mark.parametrize("n", [1, 64 * KiB, 2 * MiB, 3 * GiB, 5 * TiB])
def test_format_size_round_trips_for_whole_units(n):
    assert parse_size(format_size(n).replace(" ", ""), key="k", source="s") == n


def test_size_arguments_take_bytes_or_sizes_and_say_where_they_failed():
    assert size_arg("1GiB", "window", "ActivationOffload") == GiB and size_arg(0, "window", "x") == 0
    with pytest.raises(ValueError, match=r"ActivationOffload: window: negative size \(got -1; allowed: an integer "
                                         r"number of bytes >= 0, or a string like 512KiB"):
        size_arg(-1, "window", "ActivationOffload")
    with pytest.raises(PolicyError, match=r"ActivationOffload: window: .*ambiguous"):
        size_arg("1 GB", "window", "ActivationOffload")
    assert positive_size_arg("256MiB", "min_size", "um_alloc.tag") == 256 * MiB
    with pytest.raises(ValueError, match=r"um_alloc.tag: min_size: size must be > 0 \(got 0; allowed: an integer "
                                         r"number of bytes > 0"):
        positive_size_arg(0, "min_size", "um_alloc.tag")


def test_sizes_are_also_reached_where_they_were_published():
    import um_alloc
    import um_alloc.policy as policy

    assert um_alloc.parse_size is policy.parse_size is parse_size
    assert um_alloc.format_size is policy.format_size is format_size
    assert policy.size_arg is size_arg and (policy.KiB, policy.MiB, policy.GiB, policy.TiB) == (KiB, MiB, GiB, TiB)
    assert um_alloc.PolicyError is policy.PolicyError is PolicyError
