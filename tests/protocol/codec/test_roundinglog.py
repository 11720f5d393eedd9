"""Tests of protocol.codec.roundinglog: round trips, golden bytes, corrupt inputs."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec.roundinglog import (
    EMPTY_LOG_DIGEST,
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


def site(numel, indices=(), up=None):
    indices = np.asarray(indices, dtype=np.int64)
    up = np.zeros(indices.size, dtype=bool) if up is None else np.asarray(up, dtype=bool)
    return SiteLog(numel, indices, up)


def random_log(rng: np.random.Generator, n_sites: int) -> RoundingLog:
    sites = []
    for _ in range(n_sites):
        numel = int(rng.choice([0, 1, 5, 127, 128, 1000, 2**20, 2**40]))
        count = int(rng.integers(0, min(numel, 40) + 1)) if rng.random() < 0.5 else 0
        if numel <= 2**20:
            indices = np.sort(rng.choice(numel, size=count, replace=False)) if count else []
        else:
            indices = np.unique(rng.integers(0, numel, size=count))
        sites.append(site(numel, indices, rng.random(len(indices)) < 0.5))
    return RoundingLog(tuple(sites))


# Hand-encoded: magic, version 1, 3 sites;
# site 0: numel 5, 2 entries, deltas 0 3, directions (up, down) -> 0b01;
# site 1: numel 0, no entries;
# site 2: numel 300 (ac 02), 2 entries, deltas 129 (81 01) and 71 (47),
#   directions (down, up) -> 0b10.
GOLDEN_LOG = RoundingLog((
    site(5, [0, 3], [True, False]),
    site(0),
    site(300, [129, 200], [False, True]),
))
GOLDEN_BYTES = bytes.fromhex("4f56544c01" "03" "05020003" "01" "0000" "ac02" "02" "810147" "02")


def test_golden_bytes():
    assert encode_log(GOLDEN_LOG) == GOLDEN_BYTES
    assert decode_log(GOLDEN_BYTES) == GOLDEN_LOG


def test_empty_log():
    data = encode_log(RoundingLog(()))
    assert data == b"OVTL\x01\x00"
    assert decode_log(data) == RoundingLog(())
    assert EMPTY_LOG_DIGEST == hashlib.sha256(data).digest() == log_digest(data)


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
    assert decoded == log
    assert hash(decoded) == hash(log)


def naive_encode(log: RoundingLog) -> bytes:
    """Reference encoder, one element at a time, straight from the format description."""
    def varint(value: int) -> bytes:
        out = b""
        while value >= 0x80:
            out += bytes([(value & 0x7F) | 0x80])
            value >>= 7
        return out + bytes([value])

    out = b"OVTL\x01" + varint(len(log.sites))
    for s in log.sites:
        indices, up = [int(i) for i in s.indices], [bool(u) for u in s.up]
        out += varint(s.numel) + varint(len(indices))
        out += b"".join(varint(i - p) for i, p in zip(indices, [0, *indices][:-1], strict=True))
        for byte in range(0, len(up), 8):
            out += bytes([sum(1 << b for b, u in enumerate(up[byte:byte + 8]) if u)])
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


# Golden set of corrupted encodings, each a variation of GOLDEN_BYTES (or a minimal log).
CORRUPT = {
    "trailing_byte": GOLDEN_BYTES + b"\x00",
    "bad_magic": b"OVTX" + GOLDEN_BYTES[4:],
    "bad_version": b"OVTL\x02" + GOLDEN_BYTES[5:],
    "non_minimal_site_count": b"OVTL\x01\x80\x00",
    "non_minimal_numel": b"OVTL\x01\x01\x85\x00\x00",
    "non_minimal_delta": b"OVTL\x01\x01\x05\x01\x83\x00\x00",
    "varint_over_2_63": b"OVTL\x01\x01" + b"\xff" * 9 + b"\x01" + b"\x00",
    "varint_ten_bytes_zero_end": b"OVTL\x01\x01" + b"\xff" * 9 + b"\x00" + b"\x00",
    "delta_over_2_63": b"OVTL\x01\x01\x05\x01" + b"\xff" * 9 + b"\x01" + b"\x00",
    "count_over_numel": b"OVTL\x01\x01\x02\x03\x00\x01\x01\x00",
    "index_equals_numel": b"OVTL\x01\x01\x05\x01\x05\x00",
    "index_sum_beyond_numel": b"OVTL\x01\x01\x05\x02\x02\x03\x00",
    "duplicate_index": b"OVTL\x01\x01\x05\x02\x02\x00\x00",
    "nonzero_padding": b"OVTL\x01\x01\x05\x01\x02\x02",
    "too_many_sites_for_bytes": b"OVTL\x01\x05\x00\x00",
    "truncated_directions": b"OVTL\x01\x01\x05\x01\x02",
}


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_corrupt_inputs_raise(name):
    with pytest.raises(LogFormatError, match="byte offset"):
        decode_log(CORRUPT[name])


def test_error_names_site_and_offset():
    with pytest.raises(LogFormatError, match=r"site 1: entry 0 index out of range.*byte offset 10"):
        decode_log(b"OVTL\x01\x02\x00\x00\x05\x01\x05\x00")


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
    with pytest.raises(LogFormatError):
        encode_log(RoundingLog((site(3), bad)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_decode_random_bytes_only_raises_log_format_error(data):
    for candidate in (data, b"OVTL\x01" + data):
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
    candidate = b"OVTL\x01" + bytes([len(parts)]) + body
    try:
        log = decode_log(candidate, max_numel=2**63 - 1)
    except LogFormatError:
        return
    assert encode_log(log) == candidate


def test_size_report_on_known_log():
    report = size_report(GOLDEN_LOG)
    assert report == size_report(GOLDEN_BYTES)
    assert report == LogSize(encoded_bytes=20, entries=4, elements=305)
    assert report.bytes_per_element == pytest.approx(20 / 305)
    assert report.bits_per_entry == pytest.approx(40.0)
    assert report.dense_ternary_bytes == 61  # ceil(305 * 1.6 / 8)
    assert report.ratio_to_dense == pytest.approx(20 / 61)


def test_size_report_empty():
    report = size_report(RoundingLog(()))
    assert (report.encoded_bytes, report.entries, report.elements) == (6, 0, 0)
    assert report.bits_per_entry == report.bytes_per_element == report.ratio_to_dense == 0.0
