"""Tests of protocol.codec.roundinglog: round trips, golden bytes, corrupt inputs."""

from __future__ import annotations

import doctest
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import roundinglog
from protocol.codec.roundinglog import (
    EMPTY_LOG_DIGEST,
    VERSION,
    LogSize,
    RoundingLog,
    SiteLog,
    _encode_varints,
    decode_log,
    encode_log,
    log_digest,
    size_report,
)
from protocol.errors import ConfigError, LogFormatError

V = b"OVTL" + bytes([VERSION, 0])  # magic, version of the current format, no parts


def site(numel, indices=(), up=None, value_indices=(), values=None):
    indices = np.asarray(indices, dtype=np.int64)
    up = np.zeros(indices.size, dtype=bool) if up is None else np.asarray(up, dtype=bool)
    value_indices = np.asarray(value_indices, dtype=np.int64)
    values = (np.zeros(value_indices.size, dtype=np.uint32) if values is None
              else np.asarray(values, dtype=np.uint32))
    return SiteLog(numel, indices, up, value_indices, values)


def random_log(rng: np.random.Generator, n_sites: int, value_rate: float = 0.3) -> RoundingLog:
    """Random valid sites; about `value_rate` of them also get value entries (at indices without
    a direction entry), with bits anywhere in [0, 2**32)."""
    sites = []
    for _ in range(n_sites):
        numel = int(rng.choice([0, 1, 5, 127, 128, 1000, 2**20, 2**40]))
        count = int(rng.integers(0, min(numel, 40) + 1)) if rng.random() < 0.5 else 0
        room = min(numel - count, 6)
        n_values = int(rng.integers(0, room + 1)) if rng.random() < value_rate else 0
        if numel <= 2**20:
            chosen = rng.choice(numel, size=count + n_values, replace=False)
        else:
            chosen = np.unique(rng.integers(0, numel, size=count + n_values))
        # Any split of distinct indices into the two kinds is a valid site.
        rng.shuffle(chosen)
        indices, value_indices = np.sort(chosen[:count]), np.sort(chosen[count:])
        bits = rng.integers(0, 2**32, size=value_indices.size, dtype=np.uint64)
        sites.append(site(numel, indices, rng.random(len(indices)) < 0.5, value_indices, bits))
    return RoundingLog(tuple(sites))


# Hand-encoded: magic, version 3, no parts, 3 sites;
# site 0: numel 5, 2 entries, deltas 0 3, directions (up, down) -> 0b01;
# site 1: numel 0, no entries;
# site 2: numel 300 (ac 02), 2 entries, deltas 129 (81 01) and 71 (47),
#   directions (down, up) -> 0b10;
# no value entries.
GOLDEN_LOG = RoundingLog((
    site(5, [0, 3], [True, False]),
    site(0),
    site(300, [129, 200], [False, True]),
))
GOLDEN_BYTES = bytes.fromhex("4f56544c03" "00" "03" "05020003" "01" "0000" "ac02" "02" "810147" "02"
                             "00")

# GOLDEN_LOG plus value entries in the first and the last site; the same site section, then
# 4 value entries as (site, index, bits) varints:
#   site 0, index 1, bits 0x3f80 (80 7f);
#   same site (0), index 4 -> 4 - 1 - 1 = 2, bits 0;
#   site + 2, index 0, bits 2**32 - 1 (ff ff ff ff 0f);
#   same site, index 299 -> 298 (aa 02), bits 0x7fc0 (c0 ff 01).
GOLDEN_VALUES_LOG = RoundingLog((
    site(5, [0, 3], [True, False], [1, 4], [0x3F80, 0]),
    site(0),
    site(300, [129, 200], [False, True], [0, 299], [2**32 - 1, 0x7FC0]),
))
GOLDEN_VALUES_BYTES = GOLDEN_BYTES[:-1] + bytes.fromhex(
    "04" "00" "01" "807f" "00" "02" "00" "02" "00" "ffffffff0f" "00" "aa02" "c0ff01")


def test_golden_bytes():
    assert VERSION == 3
    assert encode_log(GOLDEN_LOG) == GOLDEN_BYTES
    assert decode_log(GOLDEN_BYTES) == GOLDEN_LOG


def test_golden_bytes_with_value_entries():
    assert encode_log(GOLDEN_VALUES_LOG) == GOLDEN_VALUES_BYTES
    decoded = decode_log(GOLDEN_VALUES_BYTES)
    assert decoded == GOLDEN_VALUES_LOG
    assert decoded.sites[2].values.dtype == np.uint32
    assert decoded.sites[2].value_indices.dtype == np.int64
    assert (decoded.n_entries, decoded.n_directions, decoded.n_values) == (8, 4, 4)


def test_module_docstring_example_runs():
    result = doctest.testmod(roundinglog)
    assert result.attempted > 0 and result.failed == 0


def test_empty_log():
    data = encode_log(RoundingLog(()))
    assert data == b"OVTL\x03\x00\x00\x00"
    assert decode_log(data) == RoundingLog(())
    assert EMPTY_LOG_DIGEST == hashlib.sha256(data).digest() == log_digest(data)


def test_v1_log_is_rejected():
    v1 = bytes.fromhex("4f56544c01" "03" "05020003" "01" "0000" "ac02" "02" "810147" "02")
    with pytest.raises(LogFormatError, match="unsupported version 1, expected 3.*byte offset 4"):
        decode_log(v1)


def test_site_log_defaults_and_positional_construction():
    plain = SiteLog(5, np.array([1]), np.array([True]))
    assert plain.value_indices.size == 0 and plain.value_indices.dtype == np.int64
    assert plain.values.size == 0 and plain.values.dtype == np.uint32
    assert not plain.value_indices.flags.writeable and not plain.values.flags.writeable
    assert plain == site(5, [1], [True])
    assert plain != site(5, [1], [True], [2], [7])
    assert site(5, [1], [True], [2], [7]) != site(5, [1], [True], [2], [8])
    assert site(5, [1], [True], [2], [7]) != site(5, [1], [True], [3], [7])


def test_equal_sites_hash_equally_whatever_the_dtypes():
    a = SiteLog(9, np.array([1], np.int32), np.array([True]), np.array([2, 5], np.uint16),
                np.array([7, 2**32 - 1], np.uint64))
    b = SiteLog(9, np.array([1], np.int64), np.array([True]), np.array([2, 5], np.int64),
                np.array([7, 2**32 - 1], np.uint32))
    assert a == b and hash(a) == hash(b)
    assert encode_log(RoundingLog((a,))) == encode_log(RoundingLog((b,)))


def test_entry_counts():
    log = RoundingLog((site(5, [0], [True], [1, 2]), site(3), site(4, [], [], [3])))
    assert (log.n_entries, log.n_directions, log.n_values, log.n_elements) == (4, 1, 3, 12)


def test_empty_site_costs_two_bytes():
    one = encode_log(RoundingLog((site(127),)))
    two = encode_log(RoundingLog((site(127), site(127))))
    assert len(two) - len(one) == 2


@pytest.mark.parametrize("seed", range(20))
def test_round_trip_random_logs(seed):
    rng = np.random.default_rng(seed)
    log = random_log(rng, int(rng.integers(0, 60)))
    decoded = decode_log(encode_log(log))
    assert len(decoded.sites) == len(log.sites)
    for got, want in zip(decoded.sites, log.sites, strict=True):
        assert got.numel == want.numel
        assert got.indices.dtype == np.int64 and np.array_equal(got.indices, want.indices)
        assert got.up.dtype == np.bool_ and np.array_equal(got.up, want.up)
        assert got.value_indices.dtype == np.int64
        assert np.array_equal(got.value_indices, want.value_indices)
        assert got.values.dtype == np.uint32 and np.array_equal(got.values, want.values)
    assert decoded == log
    assert hash(decoded) == hash(log)
    assert encode_log(decoded) == encode_log(log)


@pytest.mark.parametrize("sites", [
    [site(4, [], [], [0], [1])],                                      # the only site, index 0
    [site(4, [0, 1], [True, True], [3], [2**32 - 1])],                # after directions
    [site(4, [], [], [0, 1, 2, 3], [0, 1, 2**16, 2**32 - 1])],        # a whole site
    [site(3, [1]), site(0), site(7), site(9, [], [], [8], [5])],      # only the last site
    [site(9, [], [], [8], [5]), site(0), site(7), site(3, [1])],      # only the first site
    [site(6, [2], [True], [0, 5], [1, 2]), site(1), site(0), site(6, [], [], [1]),
     site(6, [0, 1, 2], [False] * 3, [3, 4], [2**32 - 1] * 2)],       # several, with empty ones
    [site(2**40, [2**39], [True], [0, 2**40 - 1], [3, 4])],           # multi-byte index fields
    [site(200, [], [], range(0, 200, 3), [2**32 - 1 - 64_019_963 * i for i in range(67)])],
])
def test_round_trip_value_entries(sites):
    log = RoundingLog(tuple(sites))
    data = encode_log(log)
    assert data == naive_encode(log)
    decoded = decode_log(data)
    assert decoded == log and hash(decoded) == hash(log)
    assert decoded.n_values == sum(s.value_indices.size for s in sites)


def naive_encode(log: RoundingLog) -> bytes:
    """Reference encoder, one element at a time, straight from the format description."""
    def varint(value: int) -> bytes:
        out = b""
        while value >= 0x80:
            out += bytes([(value & 0x7F) | 0x80])
            value >>= 7
        return out + bytes([value])

    out = V + varint(len(log.sites))
    for s in log.sites:
        indices, up = [int(i) for i in s.indices], [bool(u) for u in s.up]
        out += varint(s.numel) + varint(len(indices))
        out += b"".join(varint(i - p) for i, p in zip(indices, [0, *indices][:-1], strict=True))
        for byte in range(0, len(up), 8):
            out += bytes([sum(1 << b for b, u in enumerate(up[byte:byte + 8]) if u)])
    entries = [(k, int(i), int(v)) for k, s in enumerate(log.sites)
               for i, v in zip(s.value_indices, s.values, strict=True)]
    out += varint(len(entries))
    previous: tuple[int, int] | None = None
    for k, i, v in entries:
        if previous is None:
            out += varint(k) + varint(i)
        elif k != previous[0]:
            out += varint(k - previous[0]) + varint(i)
        else:
            out += varint(0) + varint(i - previous[1] - 1)
        out += varint(v)
        previous = (k, i)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_encoder_matches_naive_reference(seed):
    log = random_log(np.random.default_rng(100 + seed), 40)
    assert encode_log(log) == naive_encode(log)


def test_round_trip_huge_indices_and_full_site():
    log = RoundingLog((
        site(2**40, [0, 2**39, 2**40 - 1], [True, True, False]),
        site(9, range(9), [True] * 9),  # count == numel; 9 directions -> one padding byte
    ))
    assert decode_log(encode_log(log)) == log


def test_varints_match_a_naive_encoder():
    values = np.array([0, 1, 127, 128, 255, 16383, 16384, 2**35 + 7, 2**63 - 1], dtype=np.uint64)
    naive = b""
    for value in (int(v) for v in values):
        while value >= 0x80:
            naive += bytes([(value & 0x7F) | 0x80])
            value >>= 7
        naive += bytes([value])
    assert _encode_varints(values) == naive
    assert _encode_varints(np.zeros(0, dtype=np.uint64)) == b""


def test_every_truncation_raises():
    data = encode_log(random_log(np.random.default_rng(99), 12))
    for n in range(len(data)):
        with pytest.raises(LogFormatError):
            decode_log(data[:n])


# Golden set of corrupted encodings, each a variation of GOLDEN_BYTES (or a minimal log), with
# the error each must raise (every site section ends in a valid empty value section, b"\x00").
CORRUPT = {
    "trailing_byte": (GOLDEN_BYTES + b"\x00", "1 trailing bytes.*offset 22"),
    "bad_magic": (b"OVTX" + GOLDEN_BYTES[4:], "bad magic.*offset 0"),
    "bad_version": (b"OVTL\x04" + GOLDEN_BYTES[5:], "unsupported version 4.*offset 4"),
    "v1": (b"OVTL\x01" + GOLDEN_BYTES[5:-1], "unsupported version 1, expected 3.*offset 4"),
    "non_minimal_site_count": (V + b"\x80\x00\x00", "non-minimal varint.*offset 6"),
    "non_minimal_numel": (V + b"\x01\x85\x00\x00\x00", "non-minimal varint.*offset 7"),
    "non_minimal_delta": (V + b"\x01\x05\x01\x83\x00\x00\x00",
                          "site 0: non-minimal varint in index delta 0.*offset 9"),
    "varint_over_2_63": (V + b"\x01" + b"\xff" * 9 + b"\x01" + b"\x00\x00", "longer|exceeds"),
    "varint_ten_bytes_zero_end": (V + b"\x01" + b"\xff" * 9 + b"\x00" + b"\x00\x00",
                                  "longer|non-minimal"),
    "delta_over_2_63": (V + b"\x01\x05\x01" + b"\xff" * 9 + b"\x01" + b"\x00\x00",
                        "site 0: varint exceeds"),
    "count_over_numel": (V + b"\x01\x02\x03\x00\x01\x01\x00\x00", "3 entries for 2"),
    "index_equals_numel": (V + b"\x01\x05\x01\x05\x00\x00", "site 0: entry 0 index out"),
    "index_sum_beyond_numel": (V + b"\x01\x05\x02\x02\x03\x00\x00",
                               "site 0: entry 1 index out"),
    "duplicate_index": (V + b"\x01\x05\x02\x02\x00\x00\x00", "site 0: entry 1 repeats"),
    "nonzero_padding": (V + b"\x01\x05\x01\x02\x02\x00", "site 0: nonzero padding"),
    "too_many_sites_for_bytes": (V + b"\x05\x00\x00", "5 sites need"),
    "truncated_directions": (V + b"\x01\x05\x01\x02", "truncated site 0 direction"),
    "missing_value_section": (GOLDEN_BYTES[:-1], "truncated varint \\(value count\\).*offset 21"),
}


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_corrupt_inputs_raise(name):
    data, message = CORRUPT[name]
    with pytest.raises(LogFormatError, match=message) as err:
        decode_log(data)
    assert "byte offset" in str(err.value)


def test_error_names_site_and_offset():
    with pytest.raises(LogFormatError, match=r"site 1: entry 0 index out of range.*byte offset 11"):
        decode_log(V + b"\x02\x00\x00\x05\x01\x05\x00\x00")


# A site section for the value-section cases: 2 sites; site 0 has numel 5 and one direction
# entry at index 2 (delta 02, direction byte 01); site 1 has numel 3 and none. Offset 12 is the
# value count, offset 14 the first value entry.
SITES = V + b"\x02" + b"\x05\x01\x02\x01" + b"\x03\x00"
VALID_VALUES = SITES + b"\x02" + b"\x00\x00\x07" + b"\x01\x01\xff\x01"
BIG = b"\xff" * 8 + b"\x7f"  # 2**63 - 1, the largest varint
CORRUPT_VALUES = {
    "non_minimal_site": (b"\x01\x80\x00\x00\x07", r"value entry 0: non-minimal varint \(site\)"
                         r".*offset 14"),
    "non_minimal_index": (b"\x01\x00\x80\x00\x07", r"value entry 0: non-minimal varint "
                          r"\(index\).*offset 15"),
    "non_minimal_bits": (b"\x01\x00\x00\x87\x00", r"value entry 0: non-minimal varint "
                         r"\(bits\).*offset 16"),
    "non_minimal_later_bits": (b"\x02\x00\x00\x07\x01\x01\xff\x81\x00",
                               r"value entry 1: non-minimal varint \(bits\).*offset 19"),
    "ten_byte_varint": (b"\x01\x00\x00" + b"\xff" * 9 + b"\x01",
                        r"value entry 0: varint exceeds 2\*\*63 - 1 \(bits\).*offset 16"),
    "site_equals_n_sites": (b"\x01\x02\x00\x07", r"value entry 0: site 2 out of range \[0, 2\)"
                            r".*offset 14"),
    "site_delta_beyond_n_sites": (b"\x02\x01\x00\x07\x01\x00\x07",
                                  r"value entry 1: site 2 out of range.*offset 17"),
    "site_delta_huge": (b"\x02\x00\x00\x07" + BIG + b"\x00\x07",
                        r"value entry 1: site 9223372036854775807 out of range.*offset 17"),
    # Deltas summing to 2**64 would bring the site back to 0 (out of order) if they wrapped.
    "site_wraps_around": (b"\x04\x00\x00\x07\x01\x00\x07" + BIG + b"\x00\x07"
                          + b"\x81\x80\x80\x80\x80\x80\x80\x80\x7f\x00\x07",
                          r"value entry 2: site 9223372036854775808 out of range.*offset 20"),
    "index_equals_numel": (b"\x01\x00\x05\x07",
                           r"site 0: value entry 0 index 5 out of range \[0, 5\).*offset 15"),
    "index_beyond_numel_later_site": (b"\x02\x00\x00\x07\x01\x03\x07",
                                      r"site 1: value entry 1 index 3 out of range \[0, 3\)"
                                      r".*offset 18"),
    "later_index_beyond_numel": (b"\x02\x00\x00\x07\x00\x04\x07",
                                 r"site 0: value entry 1 index 5 out of range.*offset 18"),
    # Gaps summing to 2**64 would repeat index 0 if they wrapped.
    "index_wraps_around": (b"\x03\x00\x00\x07\x00" + BIG + b"\x07\x00" + BIG + b"\x07",
                           r"site 0: value entry 1 index 9223372036854775808 out of range"),
    "index_is_a_direction_entry": (b"\x01\x00\x02\x07",
                                   r"site 0: value entry 0 index 2 is also a direction entry"
                                   r".*offset 15"),
    "later_index_is_a_direction_entry": (b"\x02\x00\x00\x07\x00\x01\x07",
                                         r"site 0: value entry 1 index 2 is also a direction"
                                         r".*offset 18"),
    "bits_2_32": (b"\x01\x00\x00\x80\x80\x80\x80\x10",
                  r"site 0: value entry 0 bits 4294967296 exceed 2\*\*32 - 1.*offset 16"),
    "bits_2_63": (b"\x01\x00\x00" + BIG, r"site 0: value entry 0 bits .* exceed"),
    "trailing_byte": (VALID_VALUES[len(SITES):] + b"\x00", r"1 trailing bytes.*offset 21"),
    "trailing_entry": (b"\x01\x00\x00\x07\x01\x01\x07", r"3 trailing bytes.*offset 17"),
    "count_too_large_for_bytes": (b"\x03\x00\x00\x07\x01\x01\x07\x00",
                                  r"truncated: 3 value entries need >= 9 bytes, 7 left.*offset 13"),
    "count_huge": (BIG + b"\x00\x00\x07", r"entries exceed the limit.*offset 13"),
    "count_over_free_elements": (b"\x08" + b"\x00\x00\x00" + b"\x00\x00\x00" * 7,
                                 r"8 value entries for 7 elements.*offset 13"),
    "count_of_varints_short": (b"\x02\x00\x00\x07\x01\x81\x81",
                               r"truncated value entries \(needs 6 varints\).*offset 14"),
}


def test_valid_value_section_decodes():
    log = decode_log(VALID_VALUES)
    assert log == RoundingLog((site(5, [2], [True], [0], [7]), site(3, [], [], [1], [255])))
    assert encode_log(log) == VALID_VALUES


@pytest.mark.parametrize("name", sorted(CORRUPT_VALUES))
def test_corrupt_value_sections_raise(name):
    section, message = CORRUPT_VALUES[name]
    with pytest.raises(LogFormatError, match=message) as err:
        decode_log(SITES + section)
    assert "byte offset" in str(err.value)


def test_unordered_or_repeated_value_entries_are_unrepresentable():
    """The delta forms cannot express a lower site or a repeated index: the same bytes with a
    site or index field "one lower" mean a different, valid, increasing log."""
    # Entry 1 as close as the format gets to entry 0's (site 0, index 0): the next index.
    log = decode_log(SITES + b"\x02\x00\x00\x07\x00\x00\x07")
    assert np.array_equal(log.sites[0].value_indices, [0, 1])


def test_every_truncation_of_the_value_section_raises():
    data = encode_log(GOLDEN_VALUES_LOG)
    start = len(GOLDEN_BYTES) - 1  # the value count's offset
    for n in range(start, len(data)):
        with pytest.raises(LogFormatError, match="truncated"):
            decode_log(data[:n])


def test_limits():
    data = encode_log(RoundingLog((site(2**40), site(1))))
    with pytest.raises(LogFormatError, match="limit"):
        decode_log(data, max_numel=2**39)
    with pytest.raises(LogFormatError, match="limit"):
        decode_log(data, max_sites=1)
    with pytest.raises(ConfigError):
        decode_log(data, max_sites=-1)
    with pytest.raises(ConfigError):
        decode_log(data, max_numel=2**63)
    with pytest.raises(ConfigError):
        decode_log(data, max_values=True)


def test_value_limit():
    data = encode_log(RoundingLog((site(9, [], [], [1, 2, 3]),)))
    assert decode_log(data, max_values=3).n_values == 3
    with pytest.raises(LogFormatError, match="3 value entries exceed the limit of 2"):
        decode_log(data, max_values=2)


def test_decode_rejects_non_bytes():
    with pytest.raises(LogFormatError):
        decode_log("OVTL")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [
    site(5, [3, 1]),                                   # unsorted
    site(5, [1, 1]),                                   # duplicate
    site(5, [5]),                                      # == numel
    site(5, [-1, 2]),                                  # negative
    SiteLog(5, np.array([1, 2]), np.array([True])),    # direction length
    SiteLog(5, np.array([1.0]), np.array([True])),     # float indices
    SiteLog(5, np.array([1]), np.array([1])),          # int directions
    SiteLog(-1, np.zeros(0, np.int64), np.zeros(0, bool)),
    SiteLog(2**63, np.zeros(0, np.int64), np.zeros(0, bool)),
    SiteLog(5.0, np.zeros(0, np.int64), np.zeros(0, bool)),
    SiteLog(2, np.arange(3), np.zeros(3, bool)),       # count > numel
])
def test_encode_rejects_invalid_sites(bad):
    with pytest.raises(LogFormatError, match="site 1"):
        encode_log(RoundingLog((site(3), bad)))


E, B = np.zeros(0, np.int64), np.zeros(0, bool)


@pytest.mark.parametrize(("bad", "message"), [
    (site(5, [], [], [3, 1]), "value entry 1 index 1 is not strictly increasing"),   # unsorted
    (site(5, [], [], [1, 1]), "value entry 1 index 1 is not strictly increasing"),   # repeated
    (site(5, [], [], [5]), "value entry 0 index 5 is not strictly increasing within \\[0, 5\\)"),
    (SiteLog(5, E, B, np.array([-1]), np.array([0], np.uint32)), "value entry 0 index -1"),
    (site(5, [2], [True], [0, 2]), "value entry 1 index 2 is also a direction entry"),
    (site(5, [0, 1, 2, 4], [True] * 4, [3]), None),  # valid: fills the site exactly
    (SiteLog(5, E, B, np.array([1]), np.array([2**32])), "value entry 0 bits 4294967296"),
    (SiteLog(5, E, B, np.array([1]), np.array([-1])), "value entry 0 bits -1"),
    (SiteLog(5, E, B, np.array([1, 2]), np.array([1], np.uint32)), "values must be"),
    (SiteLog(5, E, B, np.array([1]), np.array([1.0])), "values must be"),
    (SiteLog(5, E, B, np.array([1]), np.array([True])), "values must be"),
    (SiteLog(5, E, B, np.array([1.0]), np.array([1], np.uint32)), "value_indices must be"),
    (SiteLog(5, E, B, np.array([[1]]), np.array([[1]], np.uint32)), "value_indices must be"),
    (SiteLog(2, np.array([0]), np.array([True]), np.array([1, 2]), np.zeros(2, np.uint32)),
     "1 direction and 2 value entries for 2 elements"),
])
def test_encode_rejects_invalid_value_entries(bad, message):
    log = RoundingLog((site(3, [], [], [0]), bad, site(4, [], [], [3])))
    if message is None:
        assert decode_log(encode_log(log)) == log
        return
    with pytest.raises(LogFormatError, match=f"site 1: {message}"):
        encode_log(log)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_decode_random_bytes_only_raises_log_format_error(data):
    for candidate in (data, V + data):
        try:
            log = decode_log(candidate)
        except LogFormatError:
            continue
        assert encode_log(log) == candidate  # anything accepted is canonical


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**63 - 1), st.binary(max_size=16)), max_size=8))
def test_decode_plausible_sites_only_raises_log_format_error(parts):
    """Random sites behind a correct site count reach the per-site checks more often."""
    body = b"".join(_encode_varints(np.array([n], dtype=np.uint64)) + tail for n, tail in parts)
    candidate = V + bytes([len(parts)]) + body
    try:
        log = decode_log(candidate, max_numel=2**63 - 1)
    except LogFormatError:
        return
    assert encode_log(log) == candidate


def test_size_report_on_known_log():
    report = size_report(GOLDEN_LOG)
    assert report == size_report(GOLDEN_BYTES)
    assert report == LogSize(encoded_bytes=22, entries=4, elements=305)
    assert report.bytes_per_element == pytest.approx(22 / 305)
    assert report.bits_per_entry == pytest.approx(44.0)
    assert report.dense_ternary_bytes == 61  # ceil(305 * 1.6 / 8)
    assert report.ratio_to_dense == pytest.approx(22 / 61)


def test_size_report_counts_value_entries():
    report = size_report(GOLDEN_VALUES_LOG)
    assert report == size_report(GOLDEN_VALUES_BYTES)
    assert report == LogSize(encoded_bytes=len(GOLDEN_VALUES_BYTES), entries=8, elements=305)


def test_size_report_empty():
    report = size_report(RoundingLog(()))
    assert (report.encoded_bytes, report.entries, report.elements) == (8, 0, 0)
    assert report.bits_per_entry == report.bytes_per_element == report.ratio_to_dense == 0.0


# ---- canonicality under single-byte mutations -------------------------------------------------

def assert_refused_or_canonical(mutated: bytes) -> None:
    """`mutated` either fails with LogFormatError or decodes to a log whose encoding is exactly
    `mutated` (so no two byte strings mean one log)."""
    try:
        log = decode_log(mutated, max_numel=2**63 - 1)
    except LogFormatError:
        return
    assert encode_log(log) == mutated, mutated.hex()


def byte_mutations(data: bytes, choices=None):
    """`data` with one byte replaced, at every position, by every other byte value (or, given
    `choices(original)`, by those), and with each byte deleted."""
    for position, original in enumerate(data):
        for byte in range(256) if choices is None else choices(original):
            if byte != original:
                yield data[:position] + bytes([byte]) + data[position + 1:]
        yield data[:position] + data[position + 1:]


@pytest.mark.parametrize("data", [GOLDEN_VALUES_BYTES, VALID_VALUES], ids=["golden", "small"])
def test_every_byte_mutation_of_known_logs(data):
    for mutated in byte_mutations(data):
        assert_refused_or_canonical(mutated)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_random_logs_round_trip_and_mutations_are_canonical(seed, n_sites):
    """Random valid logs (most with value entries) round-trip, and every single-byte mutation is
    refused or canonical. Exhaustive over positions; over byte values, the varint-relevant ones
    (0, 1, 0x7f, 0x80, 0xff, the continuation bit and the low bit flipped) and a few random."""
    rng = np.random.default_rng(seed)
    log = random_log(rng, n_sites, value_rate=0.7)
    data = encode_log(log)
    assert data == naive_encode(log)
    assert decode_log(data) == log

    def choices(original):
        return {0, 1, 0x7F, 0x80, 0xFF, original ^ 0x80, original ^ 1,
                *rng.integers(0, 256, 3).tolist()}

    for mutated in byte_mutations(data, choices):
        assert_refused_or_canonical(mutated)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=40))
def test_decode_random_value_sections_only_raises_log_format_error(section):
    """Random bytes after a valid site section reach the value-section checks."""
    candidate = SITES + section
    try:
        log = decode_log(candidate)
    except LogFormatError:
        return
    assert encode_log(log) == candidate


# ---- micro-batch parts (format v3, SPEC §3.5) ---------------------------------------------------

PARTS_LOG = RoundingLog(GOLDEN_LOG.sites, (1, 1))
# magic, version 3, 2 parts of 1 site each, then GOLDEN_LOG's sites and value section
PARTS_BYTES = bytes.fromhex("4f56544c03" "02" "01" "01") + GOLDEN_BYTES[6:]


def test_golden_bytes_with_parts():
    assert encode_log(PARTS_LOG) == PARTS_BYTES
    assert decode_log(PARTS_BYTES) == PARTS_LOG
    assert decode_log(PARTS_BYTES) != GOLDEN_LOG  # the parts are part of the log (and of ℓ_t)


def test_a_log_splits_into_its_parts_and_tail():
    log = RoundingLog(GOLDEN_LOG.sites, (2, 1))
    assert log.part(0) == RoundingLog(GOLDEN_LOG.sites[:2], (2,))
    assert log.part(1) == RoundingLog(GOLDEN_LOG.sites[2:], (1,))
    assert log.part(2) == RoundingLog(())  # the tail: nothing after the parts here
    assert [log.first_site(i) for i in range(3)] == [0, 2, 3]
    assert RoundingLog(GOLDEN_LOG.sites, (1,)).part(1) == RoundingLog(GOLDEN_LOG.sites[1:])
    with pytest.raises(IndexError):
        log.part(3)


@pytest.mark.parametrize("parts, message", [
    ((0, 1), "must each be >= 1"), ((2, 2), "sum to at most the 3 sites"),
    ([1], "must be a tuple of ints"), ((1.0,), "must be a tuple of ints"),
    ((True,), "must be a tuple of ints")])
def test_bad_parts_do_not_encode(parts, message):
    with pytest.raises(LogFormatError, match=message):
        encode_log(RoundingLog(GOLDEN_LOG.sites, parts))


CORRUPT_PARTS = {
    "zero_part": (b"\x01\x00", "part 0 has no site.*offset 6"),
    "parts_past_the_sites": (b"\x02\x02\x02", "parts of 4 sites in all for 3 sites"),
    "non_minimal_part": (b"\x01\x81\x00", "non-minimal varint \\(part 0 site count\\).*offset 6"),
    "part_count_beyond_the_bytes": (b"\x7f", "truncated: 127 parts need >= 127 bytes"),
    "huge_part_count": (b"\xff" * 8 + b"\x7f", "parts exceed the limit of 10000000 sites"),
}


@pytest.mark.parametrize("name", sorted(CORRUPT_PARTS))
def test_corrupt_parts_raise(name):
    section, message = CORRUPT_PARTS[name]
    with pytest.raises(LogFormatError, match=message):
        decode_log(b"OVTL\x03" + section + GOLDEN_BYTES[6:])


def test_truncated_parts_raise():
    with pytest.raises(LogFormatError, match="truncated: 3 parts need >= 3 bytes, 1 left"):
        decode_log(b"OVTL\x03\x03\x01")
    with pytest.raises(LogFormatError, match="truncated varint \\(part 1 site count\\)"):
        decode_log(b"OVTL\x03\x02\x01\x81")


def test_a_part_count_over_the_site_limit_is_refused_before_the_parts_are_read():
    many = b"OVTL\x03" + bytes([0xE8, 0x07]) + b"\x01" * 1000 + GOLDEN_BYTES[6:]  # 1000
    with pytest.raises(LogFormatError, match="1000 parts exceed the limit of 10 sites"):
        decode_log(many, max_sites=10)
