"""The rounding-log codec (SPEC §2 "Rounding log", §3.2, §3.3).

A rounding log L_t lists, for each rounding site of step t in execution order, the site's element
count and the sparse entries the trainer recorded, of two kinds:

- *direction entries* (flat index, direction): the element's target value is its compute-dtype
  result rounded toward the logged direction; True means the magnitude was rounded up (away from
  zero). These are the common kind.
- *value entries* (flat index, bits): the element's target value is the logged one, given as the
  bit pattern of a target-dtype value. The trainer logs these, rarely, for elements whose
  certified error bound is large against the target ULP (heavy cancellation), where two honest
  machines' compute-dtype results may lie several target ULPs apart and a direction would be
  ambiguous. The codec does not know the target dtype, so it only requires bits < 2**32 (a
  bfloat16 value's bits are < 2**16).

A step of a job with k > 1 micro-batches (SPEC §3.5) also lists its *parts*: the site count of
each micro-batch's segment (its forward and backward), in micro-batch order; the step's first
sites are micro-batch 0's, then micro-batch 1's, and so on, and the sites after the last part are
the step's tail (the gradient sum and the update). That is what lets a worker replay one
micro-batch alone, at any world size. A step without micro-batches has no parts.

An element has at most one entry. `encode_log` is the one canonical encoding: its SHA-256 is the
ℓ_t committed in leaf t, so a log has exactly one byte string and the decoder rejects every other
(non-minimal varints, nonzero padding, out-of-range or colliding entries, trailing bytes).

Format v3, byte layout (varint = unsigned LEB128, minimal, at most 2**63 - 1):

    magic      4 bytes   b"OVTL"
    version    u8        3
    n_parts    varint    micro-batch parts (0 without micro-batches)
    parts      n_parts varints, each part's site count: each >= 1, their sum <= n_sites
    n_sites    varint
    per site, in execution order (the site section, unchanged from v1):
      numel    varint    elements in the site (all its floating outputs concatenated)
      count    varint    direction entries, <= numel
      deltas   count varints: first index, then idx[i] - idx[i-1] (>= 1: strictly increasing)
      dirs     ceil(count / 8) bytes, bit i of entry i at byte i // 8, bit i % 8 (LSB first);
               padding bits zero
    n_values   varint    value entries over all sites
    per value entry, in strictly increasing (site, index) order, three varints:
      site     the site number for the first entry, else site - previous entry's site
               (0 = the same site); the site is < n_sites
      index    for a site's first value entry the flat index itself, else
               index - previous index - 1; the index is < the site's numel and is not one of the
               site's direction indices
      bits     the target value's bit pattern, < 2**32

The delta forms make unordered or repeated value entries unrepresentable. Nothing may follow the
last value entry. An empty site costs 2 bytes while numel < 128; a log without value entries
ends in one 0 byte. (v3 added the parts; v2 logs are refused, not read as v3.)

    >>> log = RoundingLog((SiteLog(5, np.array([0, 3]), np.array([True, False])),))
    >>> encode_log(log).hex()
    '4f56544c030001050200030100'
    >>> decode_log(encode_log(log)) == log
    True
    >>> log = RoundingLog((SiteLog(5, np.array([0, 3]), np.array([True, False]),
    ...                            np.array([4]), np.array([0x3F80], dtype=np.uint32)),))
    >>> encode_log(log).hex()
    '4f56544c0300010502000301010004807f'
    >>> decode_log(encode_log(log)) == log, log.n_entries, log.n_values, log.n_directions
    (True, 3, 1, 2)
"""
from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field

import numpy as np

from protocol.errors import ConfigError, LogFormatError

MAGIC = b"OVTL"
VERSION = 3
_HEADER = MAGIC + bytes([VERSION])
_MAX_VARINT = 2**63 - 1
_MAX_VARINT_BYTES = 9  # 9 * 7 = 63 payload bits
_MAX_BITS = 2**32 - 1  # a value entry's bits
_VALUE_FIELDS = ("site", "index", "bits")  # the varints of one value entry
_EMPTY_INDICES = np.zeros(0, dtype=np.int64)
_EMPTY_UP = np.zeros(0, dtype=bool)
_EMPTY_VALUES = np.zeros(0, dtype=np.uint32)
for _empty in (_EMPTY_INDICES, _EMPTY_UP, _EMPTY_VALUES):
    _empty.setflags(write=False)


@dataclass(frozen=True)
class SiteLog:
    """The logged decisions of one rounding site (SPEC §3.3).

    numel: elements in the site; indices: int64 flat row-major indices of the direction entries,
    strictly increasing, each < numel; up: bool, one direction per index (True = magnitude
    rounded away from zero); value_indices: int64 flat indices of the value entries, strictly
    increasing, each < numel, none among `indices`; values: uint32 bit patterns of target-dtype
    values, one per value index (< 2**16 for a bfloat16 target; the codec only requires < 2**32).
    The value fields default to empty (read-only) arrays, so `SiteLog(numel, indices, up)` is a
    site without value entries. encode_log validates all of these; decode_log only builds valid
    ones.
    """

    numel: int
    indices: np.ndarray
    up: np.ndarray
    value_indices: np.ndarray = field(default_factory=lambda: _EMPTY_INDICES)
    values: np.ndarray = field(default_factory=lambda: _EMPTY_VALUES)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SiteLog):
            return NotImplemented
        return (self.numel == other.numel and np.array_equal(self.indices, other.indices)
                and np.array_equal(self.up, other.up)
                and np.array_equal(self.value_indices, other.value_indices)
                and np.array_equal(self.values, other.values))

    def __hash__(self) -> int:
        # Normalise dtypes so that equal sites (np.array_equal ignores dtype) hash equally.
        return hash((self.numel, np.asarray(self.indices, dtype=np.int64).tobytes(),
                     np.asarray(self.up, dtype=bool).tobytes(),
                     np.asarray(self.value_indices, dtype=np.int64).tobytes(),
                     np.asarray(self.values, dtype=np.int64).tobytes()))


@dataclass(frozen=True)
class RoundingLog:
    """L_t: one SiteLog per rounding site executed in the step, in execution order, and the
    site count of each micro-batch's segment (`parts`, empty without micro-batches)."""

    sites: tuple[SiteLog, ...]
    parts: tuple[int, ...] = ()

    def part(self, index: int) -> RoundingLog:
        """Micro-batch `index`'s segment as a log of its own, with one part (a worker replays
        it alone); `index == len(parts)` is the tail. Raises IndexError for another index."""
        if not 0 <= index <= len(self.parts):
            raise IndexError(f"the log has {len(self.parts)} parts; no part {index}")
        start = sum(self.parts[:index])
        if index == len(self.parts):
            return RoundingLog(self.sites[start:])
        return RoundingLog(self.sites[start:start + self.parts[index]], (self.parts[index],))

    def first_site(self, index: int) -> int:
        """The step's site number of part `index`'s first site (the tail's for len(parts))."""
        return sum(self.parts[:index])

    @property
    def n_entries(self) -> int:
        """Logged entries over all sites, of both kinds (direction and value)."""
        return self.n_directions + self.n_values

    @property
    def n_directions(self) -> int:
        """Logged (index, direction) entries over all sites."""
        return sum(len(site.indices) for site in self.sites)

    @property
    def n_values(self) -> int:
        """Logged (index, value) entries over all sites."""
        return sum(len(site.value_indices) for site in self.sites)

    @property
    def n_elements(self) -> int:
        """Elements rounded over all sites (logged or not)."""
        return sum(site.numel for site in self.sites)


# ---------------------------------------------------------------------------------------------
# Varints (unsigned LEB128)


def _varint_lengths(values: np.ndarray) -> np.ndarray:
    """Bytes of the minimal LEB128 encoding of each value (uint64 array)."""
    lengths = np.ones(values.shape, dtype=np.int64)
    for k in range(1, _MAX_VARINT_BYTES):  # a loop over byte positions, not elements
        lengths += values >= np.uint64(1 << (7 * k))
    return lengths


def _encode_varints(values: np.ndarray) -> bytes:
    """Minimal LEB128 bytes of each value (integer array, 0 <= value <= 2**63 - 1), concatenated.

    Vectorised: one pass per byte position writes that byte of every value long enough to have it.
    """
    values = values.astype(np.uint64)
    lengths = _varint_lengths(values)
    starts = np.cumsum(lengths) - lengths
    out = np.zeros(int(lengths.sum()), dtype=np.uint8)
    for k in range(_MAX_VARINT_BYTES):
        has = lengths > k
        payload = (values[has] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = np.where(lengths[has] > k + 1, np.uint64(0x80), np.uint64(0))
        out[starts[has] + k] = (payload | more).astype(np.uint8)
    return out.tobytes()


def _encode_varint(value: int) -> bytes:
    """Minimal LEB128 of one int — the per-site header fields, where numpy would cost more."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Encoding


def _segments(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sites' entries laid end to end: (first entry of each site, rank of each entry in its site).

    This is what lets the codec treat all sites' entries as one array instead of looping.
    """
    first = np.cumsum(counts) - counts
    rank = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)
    return first, rank


def _site_error(k: int, message: str) -> LogFormatError:
    return LogFormatError(f"rounding log site {k}: {message}")


@dataclass(frozen=True)
class _Checked:
    """One site's arrays, type- and shape-checked by `_site_arrays`."""

    numel: int
    indices: np.ndarray        # int64
    up: np.ndarray             # bool
    value_indices: np.ndarray  # int64
    values: np.ndarray         # uint32


def _site_arrays(k: int, site: SiteLog) -> _Checked:
    """Check site k's types, shapes and value bits (cheap, per site); return its arrays.

    Raises LogFormatError: an invalid log has no canonical encoding, so it must not get a digest.
    """
    if not isinstance(site, SiteLog):
        raise _site_error(k, f"expected SiteLog, got {type(site).__name__}")
    numel = site.numel
    if isinstance(numel, bool) or not isinstance(numel, int | np.integer):
        raise _site_error(k, f"numel must be an int, got {type(numel).__name__}")
    if not 0 <= numel <= _MAX_VARINT:
        raise _site_error(k, f"numel {numel} outside [0, 2**63 - 1]")
    indices, up = np.asarray(site.indices), np.asarray(site.up)
    if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
        raise _site_error(k, f"indices must be a 1-D integer array, got {indices.dtype} "
                             f"{indices.shape}")
    if up.shape != indices.shape or (up.size and up.dtype != np.bool_):
        raise _site_error(k, f"up must be a bool array of shape {indices.shape}, got {up.dtype} "
                             f"{up.shape}")
    if indices.size > numel:
        raise _site_error(k, f"{indices.size} entries for {numel} elements")
    indices, up = indices.astype(np.int64, copy=False), up.astype(bool, copy=False)
    if site.value_indices is _EMPTY_INDICES and site.values is _EMPTY_VALUES:
        return _Checked(int(numel), indices, up, _EMPTY_INDICES, _EMPTY_VALUES)  # the usual case
    value_indices, values = np.asarray(site.value_indices), np.asarray(site.values)
    if value_indices.ndim != 1 or (value_indices.size and value_indices.dtype.kind not in "iu"):
        raise _site_error(k, f"value_indices must be a 1-D integer array, got "
                             f"{value_indices.dtype} {value_indices.shape}")
    if values.shape != value_indices.shape or (values.size and values.dtype.kind not in "iu"):
        raise _site_error(k, f"values must be an integer array of shape {value_indices.shape}, "
                             f"got {values.dtype} {values.shape}")
    if values.size and (values.min() < 0 or values.max() > _MAX_BITS):
        bad = int(np.flatnonzero((values < 0) | (values > _MAX_BITS))[0])
        raise _site_error(k, f"value entry {bad} bits {values[bad]} outside [0, 2**32 - 1]")
    if indices.size + value_indices.size > numel:
        raise _site_error(k, f"{indices.size} direction and {value_indices.size} value entries "
                             f"for {numel} elements")
    return _Checked(int(numel), indices, up, value_indices.astype(np.int64, copy=False),
                    values.astype(np.uint32, copy=False))


def _check_entries(numels: np.ndarray, counts: np.ndarray, indices: np.ndarray,
                   what: str = "entry") -> np.ndarray:
    """Check every site's indices are strictly increasing in [0, numel) (SPEC §2: flat indices);
    return the index deltas (first index, then differences) that the direction entries store."""
    first, rank = _segments(counts)
    deltas = indices.copy()
    deltas[1:] -= indices[:-1]
    deltas[first[counts > 0]] = indices[first[counts > 0]]
    bad = (rank > 0) & (deltas <= 0) | (indices < 0) | (indices >= np.repeat(numels, counts))
    if bad.any():
        e = int(np.flatnonzero(bad)[0])
        p = int(np.searchsorted(first, e, side="right")) - 1
        raise _site_error(p, f"{what} {e - first[p]} index {indices[e]} is not strictly "
                             f"increasing within [0, {numels[p]})")
    return deltas


def _collisions(first: np.ndarray, counts: np.ndarray, indices: np.ndarray, sites: np.ndarray,
                probes: np.ndarray) -> np.ndarray:
    """Whether each probes[j] is one of site sites[j]'s direction indices, i.e. in the strictly
    increasing run indices[first[s]:first[s] + counts[s]] (first and counts per site).

    A binary search of all probes at once: one numpy pass per halving (at most 64), not per probe.
    """
    lo = first[sites]
    hi = end = lo + counts[sites]
    if indices.size == 0:
        return np.zeros(probes.shape, dtype=bool)
    last = indices.size - 1
    while True:
        active = lo < hi
        if not active.any():
            break
        mid = (lo + hi) // 2
        below = indices[np.minimum(mid, last)] < probes
        lo = np.where(active & below, mid + 1, lo)
        hi = np.where(active & ~below, mid, hi)
    return (lo < end) & (indices[np.minimum(lo, last)] == probes)


def _encode_values(checked: list[_Checked], numels: np.ndarray, counts: np.ndarray,
                   indices: np.ndarray) -> bytes:
    """The value section: n_values, then (site, index, bits) varints per value entry, after
    checking every site's value indices are strictly increasing in [0, numel) and none of them is
    among the site's direction indices (`counts`, `indices`: the direction entries)."""
    v_counts = np.array([c.value_indices.size for c in checked], dtype=np.int64)
    n_values = int(v_counts.sum())
    if n_values == 0:
        return _encode_varint(0)
    v_indices = np.concatenate([c.value_indices for c in checked])
    bits = np.concatenate([c.values for c in checked])
    v_deltas = _check_entries(numels, v_counts, v_indices, "value entry")
    v_first, v_rank = _segments(v_counts)
    sites = np.repeat(np.arange(len(checked), dtype=np.int64), v_counts)
    hit = _collisions(np.cumsum(counts) - counts, counts, indices, sites, v_indices)
    if hit.any():
        e = int(np.flatnonzero(hit)[0])
        p = int(sites[e])
        raise _site_error(p, f"value entry {e - v_first[p]} index {v_indices[e]} is also a "
                             "direction entry")
    site_field = sites.copy()
    site_field[1:] -= sites[:-1]
    index_field = v_deltas - (v_rank > 0)  # a site's first index, else the gap minus one
    fields = np.stack([site_field, index_field, bits.astype(np.int64)], axis=1).ravel()
    return _encode_varint(n_values) + _encode_varints(fields)


def _pack_directions(up: np.ndarray, counts: np.ndarray) -> tuple[bytes, np.ndarray]:
    """All sites' direction bits, each site padded to whole bytes (LSB first, zero padding);
    returns the bytes and each site's end offset in them."""
    first, rank = _segments(counts)
    nbytes = (counts + 7) // 8
    byte_ends = np.cumsum(nbytes)
    bits = np.zeros(int(byte_ends[-1]) * 8 if byte_ends.size else 0, dtype=bool)
    bits[np.repeat((byte_ends - nbytes) * 8, counts) + rank] = up
    return np.packbits(bits, bitorder="little").tobytes(), byte_ends


def encode_log(log: RoundingLog) -> bytes:
    """The one canonical encoding of `log` (format v3, see the module docstring).

    Raises LogFormatError for parts that are not ints >= 1 summing to at most the site count,
    and, naming the site, if a site is invalid (unsorted, duplicate or
    out-of-range indices of either kind, a value index that is also a direction index, value bits
    outside [0, 2**32), arrays of the wrong type or shape). Entries of all sites are validated,
    varint-encoded and bit-packed in single vectorised passes; only the site headers are written
    one by one.
    """
    if not isinstance(log, RoundingLog):
        raise LogFormatError(f"expected RoundingLog, got {type(log).__name__}")
    checked = [_site_arrays(k, site) for k, site in enumerate(log.sites)]
    parts = _checked_parts(log.parts, len(checked))
    numels = np.array([c.numel for c in checked], dtype=np.int64)
    counts = np.array([c.indices.size for c in checked], dtype=np.int64)
    indices = np.concatenate([_EMPTY_INDICES] + [c.indices for c in checked])
    up = np.concatenate([_EMPTY_UP] + [c.up for c in checked])
    deltas = _check_entries(numels, counts, indices)
    delta_bytes = _encode_varints(deltas)
    delta_ends = np.concatenate(([0], np.cumsum(_varint_lengths(deltas.astype(np.uint64)))))
    dir_bytes, dir_ends = _pack_directions(up, counts)
    entry_ends = np.cumsum(counts)
    out = bytearray(_HEADER + _encode_varint(len(parts)))
    for count in parts:
        out += _encode_varint(count)
    out += _encode_varint(len(checked))
    delta_start = dir_start = 0
    rows = zip(numels.tolist(), counts.tolist(), delta_ends[entry_ends].tolist(),
               dir_ends.tolist(), strict=True)
    for numel, count, delta_end, dir_end in rows:
        out += _encode_varint(numel) + _encode_varint(count)
        out += delta_bytes[delta_start:delta_end] + dir_bytes[dir_start:dir_end]
        delta_start, dir_start = delta_end, dir_end
    out += _encode_values(checked, numels, counts, indices)
    return bytes(out)


def _checked_parts(parts: object, n_sites: int) -> tuple[int, ...]:
    """`parts` as ints after checking each is >= 1 and their sum is <= n_sites."""
    if not isinstance(parts, tuple) or any(
            isinstance(c, bool) or not isinstance(c, int | np.integer) for c in parts):
        raise LogFormatError(f"rounding log parts must be a tuple of ints, got {parts!r}")
    if any(c < 1 for c in parts) or sum(parts) > n_sites:
        raise LogFormatError(f"rounding log parts {parts} must each be >= 1 and sum to at most "
                             f"the {n_sites} sites")
    return tuple(int(c) for c in parts)


def log_digest(data: bytes) -> bytes:
    """ℓ_t = SHA-256 of the encoded log bytes (SPEC §2)."""
    return hashlib.sha256(data).digest()


# ---------------------------------------------------------------------------------------------
# Decoding, in two phases: a Python loop over site headers that only locates each site's entries
# (phase 1), then one vectorised pass that decodes and checks the entries of all sites (phase 2).
# Header problems and truncation are therefore reported before problems inside entries.


class _Reader:
    """A cursor over untrusted log bytes; every failure names the byte offset."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.buf = np.frombuffer(data, dtype=np.uint8)
        self.pos = 0
        # Every byte with the high bit clear ends a varint if a varint covers it; from any varint
        # start, the next `count` such bytes end `count` consecutive varints.
        self.terminators = np.flatnonzero(self.buf < 0x80)
        self._terminator_list = self.terminators.tolist()

    @property
    def remaining(self) -> int:
        return len(self.data) - self.pos

    def error(self, message: str, offset: int | None = None) -> LogFormatError:
        where = self.pos if offset is None else offset
        return LogFormatError(f"rounding log: {message} at byte offset {where}")

    def skip(self, n: int, what: str) -> None:
        if n > self.remaining:
            raise self.error(f"truncated {what} (needs {n} bytes, {self.remaining} left)")
        self.pos += n

    def take(self, n: int, what: str) -> bytes:
        start = self.pos
        self.skip(n, what)
        return self.data[start:self.pos]

    def varint(self, what: str) -> int:
        """One minimal varint <= 2**63 - 1 (scalar; header fields are one or two bytes)."""
        start, value = self.pos, 0
        for length, pos in enumerate(range(start, len(self.data)), start=1):
            byte = self.data[pos]
            value |= (byte & 0x7F) << (7 * (length - 1))
            if byte < 0x80:
                self.pos = pos + 1
                if length > 1 and byte == 0:
                    raise self.error(f"non-minimal varint ({what})", start)
                if value > _MAX_VARINT:
                    raise self.error(f"varint ({what}) exceeds 2**63 - 1", start)
                return value
            if length > _MAX_VARINT_BYTES:
                raise self.error(f"varint ({what}) longer than 10 bytes", start)
        raise self.error(f"truncated varint ({what})", start)

    def skip_varints(self, count: int, what: str) -> int:
        """Step over `count` varints; return the terminator number of the first one's last byte."""
        first = bisect.bisect_left(self._terminator_list, self.pos)
        if count > self.remaining or first + count > len(self._terminator_list):
            raise self.error(f"truncated {what} (needs {count} varints)")
        self.pos = self._terminator_list[first + count - 1] + 1
        return first


@dataclass(frozen=True)
class _Spans:
    """Phase 1 output: where the entries of each non-empty site lie (one array row per site)."""

    site: np.ndarray               # the site number k
    numel: np.ndarray
    count: np.ndarray
    delta_start: np.ndarray        # byte offset of the first index delta
    first_terminator: np.ndarray   # number of the terminator byte that ends the first delta
    dir_start: np.ndarray          # byte offset of the direction bytes

    def site_of(self, first: np.ndarray, entry: int) -> tuple[int, int]:
        """(site number k, rank within the site) of global entry number `entry`."""
        p = int(np.searchsorted(first, entry, side="right")) - 1
        return int(self.site[p]), entry - int(first[p])


def _check_limit(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_VARINT:
        raise ConfigError(f"{what} must be an int in [0, 2**63 - 1], got {value!r}")
    return value


def decode_log(data: bytes, *, max_sites: int = 10_000_000, max_numel: int = 2**48,
               max_values: int = 10_000_000) -> RoundingLog:
    """Parse untrusted bytes into a RoundingLog, accepting only the canonical encoding.

    max_sites / max_numel / max_values (value entries over all sites) bound what a peer can make
    us allocate or claim. Raises LogFormatError (naming the byte offset and, where there is one,
    the site) for a wrong magic or version, truncation, trailing bytes, non-minimal or oversized
    varints, count > numel, indices not strictly increasing or >= numel, nonzero padding bits,
    parts of no site or past the last site, value entries naming a site >= n_sites or colliding
    with a direction entry, value bits >= 2**32, or a limit exceeded; ConfigError for bad
    limits.
    """
    _check_limit(max_sites, "max_sites")
    _check_limit(max_numel, "max_numel")
    _check_limit(max_values, "max_values")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise LogFormatError(f"rounding log must be bytes, got {type(data).__name__}")
    reader = _Reader(bytes(data))
    _read_header(reader)
    parts = _read_parts(reader, max_sites)
    n_sites = reader.varint("site count")
    if sum(parts) > n_sites:
        raise reader.error(f"parts of {sum(parts)} sites in all for {n_sites} sites")
    if n_sites > max_sites:
        raise reader.error(f"{n_sites} sites exceed the limit of {max_sites}")
    if 2 * n_sites > reader.remaining:  # every site takes >= 2 bytes: fail before looping
        raise reader.error(f"truncated: {n_sites} sites need >= {2 * n_sites} bytes, "
                           f"{reader.remaining} left")
    numels, spans = _read_layout(reader, n_sites, max_numel)
    n_directions = int(spans.count.sum())
    value_span = _read_value_layout(reader, sum(numels) - n_directions, max_values)
    if reader.remaining:
        raise reader.error(f"{reader.remaining} trailing bytes after the last value entry")
    indices, up = _read_entries(reader, spans)
    dir_counts = np.zeros(n_sites, dtype=np.int64)
    dir_counts[spans.site] = spans.count
    v_sites, v_indices, v_bits = _read_values(reader, value_span, np.array(numels, np.uint64),
                                              dir_counts, indices)
    directions = _by_site(spans.site, np.cumsum(spans.count) - spans.count, indices, up)
    v_first = np.flatnonzero(np.diff(v_sites, prepend=-1))
    values = _by_site(v_sites[v_first], v_first, v_indices, v_bits)
    none, no_values = (_EMPTY_INDICES, _EMPTY_UP), (_EMPTY_INDICES, _EMPTY_VALUES)
    return RoundingLog(tuple(SiteLog(numel, *directions.get(k, none), *values.get(k, no_values))
                             for k, numel in enumerate(numels)), parts)


def _by_site(sites: np.ndarray, first: np.ndarray, a: np.ndarray,
             b: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{site: (its slice of a, its slice of b)}, the sites' entries starting at `first`."""
    if sites.size == 0:
        return {}
    pieces = zip(np.split(a, first[1:]), np.split(b, first[1:]), strict=True)
    return dict(zip(sites.tolist(), pieces, strict=True))


def _read_header(reader: _Reader) -> None:
    magic = reader.take(len(MAGIC), "magic")
    if magic != MAGIC:
        raise reader.error(f"bad magic {magic!r}, expected {MAGIC!r}", 0)
    version = reader.take(1, "version")[0]
    if version != VERSION:
        raise reader.error(f"unsupported version {version}, expected {VERSION}", len(MAGIC))


def _read_parts(reader: _Reader, max_sites: int) -> tuple[int, ...]:
    """The micro-batch parts: site counts, each >= 1 (their sum is checked against n_sites)."""
    n_parts = reader.varint("part count")
    if n_parts > max_sites:  # each part has a site of its own
        raise reader.error(f"{n_parts} parts exceed the limit of {max_sites} sites")
    if n_parts > reader.remaining:  # every part takes >= 1 byte: fail before looping
        raise reader.error(f"truncated: {n_parts} parts need >= {n_parts} bytes, "
                           f"{reader.remaining} left")
    parts = []
    for i in range(n_parts):
        start = reader.pos
        count = reader.varint(f"part {i} site count")
        if count < 1:
            raise reader.error(f"part {i} has no site", start)
        parts.append(count)
    return tuple(parts)


def _read_layout(reader: _Reader, n_sites: int, max_numel: int) -> tuple[list[int], _Spans]:
    """Phase 1: read every site header (SPEC §3.3: in execution order) and skip its entries."""
    numels, rows = [], []
    for k in range(n_sites):
        numel = reader.varint(f"site {k} numel")
        if numel > max_numel:
            raise reader.error(f"site {k}: numel {numel} exceeds the limit of {max_numel}")
        count = reader.varint(f"site {k} entry count")
        if count > numel:
            raise reader.error(f"site {k}: {count} entries for {numel} elements")
        numels.append(numel)
        if count:
            delta_start = reader.pos
            first_terminator = reader.skip_varints(count, f"site {k} index deltas")
            dir_start = reader.pos
            reader.skip(-(-count // 8), f"site {k} direction bits")
            rows.append((k, numel, count, delta_start, first_terminator, dir_start))
    columns = np.array(rows, dtype=np.int64).reshape(-1, 6).T
    return numels, _Spans(*columns)


def _read_entries(reader: _Reader, spans: _Spans) -> tuple[np.ndarray, np.ndarray]:
    """Phase 2: the direction entries' (int64 indices, bool directions) of all non-empty sites,
    laid end to end in site order."""
    if spans.site.size == 0:
        return _EMPTY_INDICES, _EMPTY_UP
    first, rank = _segments(spans.count)
    deltas, starts = _read_deltas(reader, spans, first, rank)
    indices = _deltas_to_indices(reader, spans, first, rank, deltas, starts)
    up = _read_directions(reader, spans, first, rank)
    return indices, up


def _varint_values(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The values (uint64) of the varints at `starts`, of `lengths` bytes (each <= 9, checked)."""
    values = np.zeros(starts.size, dtype=np.uint64)
    for k in range(int(lengths.max(initial=0))):  # a loop over byte positions, not elements
        has = lengths > k
        payload = (buf[starts[has] + k] & 0x7F).astype(np.uint64)
        values[has] |= payload << np.uint64(7 * k)
    return values


def _read_deltas(reader: _Reader, spans: _Spans, first: np.ndarray,
                 rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode every index delta (uint64) at once; return them with their byte offsets."""
    ends = reader.terminators[np.repeat(spans.first_terminator, spans.count) + rank]
    starts = np.empty_like(ends)
    starts[1:] = ends[:-1] + 1
    starts[first] = spans.delta_start
    lengths = ends - starts + 1
    for bad, problem in (((lengths > 1) & (reader.buf[ends] == 0), "non-minimal varint"),
                         (lengths > _MAX_VARINT_BYTES, "varint exceeds 2**63 - 1")):
        if bad.any():
            e = int(np.flatnonzero(bad)[0])
            k, i = spans.site_of(first, e)
            raise reader.error(f"site {k}: {problem} in index delta {i}", int(starts[e]))
    return _varint_values(reader.buf, starts, lengths), starts


def _deltas_to_indices(reader: _Reader, spans: _Spans, first: np.ndarray, rank: np.ndarray,
                       deltas: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Running sums of each site's deltas; every later delta >= 1 and every index < numel."""
    # One cumsum over all sites, rebased per site. Sums are mod 2**64, but within a site every
    # partial sum up to the first index >= numel is < numel + 2**63 <= 2**64, so the first
    # flagged entry is the real culprit.
    total = np.cumsum(deltas, dtype=np.uint64)
    indices = total - np.repeat(total[first] - deltas[first], spans.count)
    problems = (((rank > 0) & (deltas == 0), "repeats the previous index (delta 0)"),
                (indices >= np.repeat(spans.numel.astype(np.uint64), spans.count),
                 "index out of range [0, numel)"))
    for bad, problem in problems:
        if bad.any():
            e = int(np.flatnonzero(bad)[0])
            k, i = spans.site_of(first, e)
            raise reader.error(f"site {k}: entry {i} {problem}", int(starts[e]))
    return indices.astype(np.int64)


def _read_directions(reader: _Reader, spans: _Spans, first: np.ndarray,
                     rank: np.ndarray) -> np.ndarray:
    """Unpack all direction bits (LSB first); padding bits must be zero (canonical)."""
    nbytes = (spans.count + 7) // 8
    byte_first = np.cumsum(nbytes) - nbytes
    byte_pos = np.repeat(spans.dir_start - byte_first, nbytes) + np.arange(int(nbytes.sum()))
    bits = np.unpackbits(reader.buf[byte_pos], bitorder="little")
    used = np.repeat(byte_first * 8, spans.count) + rank
    up = bits[used].astype(bool)
    bits[used] = 0
    if bits.any():
        byte = int(np.flatnonzero(bits)[0]) // 8
        p = int(np.searchsorted(byte_first, byte, side="right")) - 1
        raise reader.error(f"site {int(spans.site[p])}: nonzero padding bits in the direction "
                           "bytes", int(byte_pos[byte]))
    return up


@dataclass(frozen=True)
class _ValueSpan:
    """Phase 1 output for the value section: where its 3 * count varints lie."""

    start: int             # byte offset of the first entry's site varint
    first_terminator: int  # number of the terminator byte that ends it
    count: int             # value entries


def _read_value_layout(reader: _Reader, room: int, max_values: int) -> _ValueSpan:
    """Phase 1, value section: read n_values, check it, and skip the entries' varints. `room` is
    the number of elements without a direction entry, which distinct value entries cannot
    exceed."""
    offset = reader.pos
    n_values = reader.varint("value count")
    if n_values > max_values:
        raise reader.error(f"{n_values} value entries exceed the limit of {max_values}", offset)
    if 3 * n_values > reader.remaining:  # every entry takes >= 3 bytes: fail before allocating
        raise reader.error(f"truncated: {n_values} value entries need >= {3 * n_values} bytes, "
                           f"{reader.remaining} left", offset)
    if n_values > room:
        raise reader.error(f"{n_values} value entries for {room} elements without a direction "
                           "entry", offset)
    start = reader.pos
    first = reader.skip_varints(3 * n_values, "value entries") if n_values else 0
    return _ValueSpan(start, first, n_values)


def _read_values(reader: _Reader, span: _ValueSpan, numels: np.ndarray, dir_counts: np.ndarray,
                 dir_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Phase 2, value section: decode and check every value entry at once; return their (int64
    sites, int64 indices, uint32 bits). `numels` and `dir_counts` are per site, `dir_indices` the
    direction indices of all sites end to end. Errors number value entries over the whole log
    (their order in the value section), and name the site once it is known to exist."""
    n = span.count
    if n == 0:
        return _EMPTY_INDICES, _EMPTY_INDICES, _EMPTY_VALUES
    ends = reader.terminators[span.first_terminator:span.first_terminator + 3 * n]
    starts = np.empty_like(ends)
    starts[0] = span.start
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    for bad, problem in (((lengths > 1) & (reader.buf[ends] == 0), "non-minimal varint"),
                         (lengths > _MAX_VARINT_BYTES, "varint exceeds 2**63 - 1")):
        if bad.any():
            e = int(np.flatnonzero(bad)[0])
            raise reader.error(f"value entry {e // 3}: {problem} ({_VALUE_FIELDS[e % 3]})",
                               int(starts[e]))
    fields = _varint_values(reader.buf, starts, lengths).reshape(n, 3)
    site_field, index_field, bits = (np.ascontiguousarray(fields[:, i]) for i in range(3))
    starts = starts.reshape(n, 3)

    # Sites: running sums of the site deltas. Up to the first bad entry every partial sum is
    # < n_sites and every delta < n_sites, so the sums there cannot wrap around 2**64.
    n_sites = numels.size
    sites = np.cumsum(site_field, dtype=np.uint64)
    bad = (site_field >= n_sites) | (sites >= n_sites)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        site = (int(sites[j - 1]) if j else 0) + int(site_field[j])
        raise reader.error(f"value entry {j}: site {site} out of range [0, {n_sites})",
                           int(starts[j, 0]))
    sites_i = sites.astype(np.int64)

    # Indices: per site, the first index field is the index, each later one the gap minus one.
    # One cumsum over all entries, rebased per site; as in _deltas_to_indices the sums are mod
    # 2**64 but exact up to the first index >= numel (< numel + 2**63 <= 2**64).
    new_site = np.ones(n, dtype=bool)
    new_site[1:] = site_field[1:] != 0
    steps = index_field + (~new_site).astype(np.uint64)
    total = np.cumsum(steps, dtype=np.uint64)
    firsts = np.flatnonzero(new_site)
    base = total[firsts] - steps[firsts]
    indices = total - np.repeat(base, np.diff(firsts, append=n))
    site_numels = numels[sites_i]
    bad = indices >= site_numels
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise reader.error(f"site {sites_i[j]}: value entry {j} index {indices[j]} out of range "
                           f"[0, {site_numels[j]})", int(starts[j, 1]))
    indices_i = indices.astype(np.int64)
    hit = _collisions(np.cumsum(dir_counts) - dir_counts, dir_counts, dir_indices, sites_i,
                      indices_i)
    if hit.any():
        j = int(np.flatnonzero(hit)[0])
        raise reader.error(f"site {sites_i[j]}: value entry {j} index {indices_i[j]} is also a "
                           "direction entry", int(starts[j, 1]))
    bad = bits > _MAX_BITS
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise reader.error(f"site {sites_i[j]}: value entry {j} bits {bits[j]} exceed "
                           "2**32 - 1", int(starts[j, 2]))
    return sites_i, indices_i, bits.astype(np.uint32)


EMPTY_LOG_DIGEST: bytes = log_digest(encode_log(RoundingLog(())))


# ---------------------------------------------------------------------------------------------
# Size accounting


@dataclass(frozen=True)
class LogSize:
    """How big a rounding log is, against a dense encoding of every element's decision.

    dense_ternary_bytes: every element as one of three decisions (nearest / up / down), packed
    5 trits per byte (1.6 bits per element), i.e. ceil(elements / 5). Ratios are 0.0 when their
    denominator is 0.
    """

    encoded_bytes: int
    entries: int
    elements: int

    @property
    def bytes_per_element(self) -> float:
        return self.encoded_bytes / self.elements if self.elements else 0.0

    @property
    def bits_per_entry(self) -> float:
        return 8 * self.encoded_bytes / self.entries if self.entries else 0.0

    @property
    def dense_ternary_bytes(self) -> int:
        return -(-self.elements // 5)  # = ceil(elements * 1.6 / 8), without float error

    @property
    def ratio_to_dense(self) -> float:
        dense = self.dense_ternary_bytes
        return self.encoded_bytes / dense if dense else 0.0


def size_report(log_or_bytes: RoundingLog | bytes) -> LogSize:
    """Size figures of a log, given decoded or encoded. Raises LogFormatError for bad bytes."""
    if isinstance(log_or_bytes, RoundingLog):
        log, data = log_or_bytes, encode_log(log_or_bytes)
    else:
        data = log_or_bytes
        log = decode_log(data)
    return LogSize(len(data), log.n_entries, log.n_elements)
