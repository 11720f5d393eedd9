"""Portable counter-based randomness (SPEC §3.4).

Every random number a step uses comes from here, never from torch's or CUDA's generators: their
bits depend on the device, the library version and sometimes the thread count. Philox4x32-10
(Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11 — the Random123 library) is
pure 32-bit integer arithmetic, so numpy computes the same words on every machine, and so does
the C++ pass that computes them where ovt's extension is built (`fused.philox`, 6–20× faster;
tests/protocol/engine/test_rng.py checks it against numpy's words).

A `RandomStream` is keyed by (seed, *path), e.g. `RandomStream(job_seed, "random", step, call)`
(the stream of a step's served random ops, `random_ops`).
Every method reads the stream from its first word, so two draws that must be independent need two
paths. Floating-point outputs are built without transcendental functions (libm differs across
machines) and rounded to float32 by numpy's IEEE conversion.

    >>> RandomStream(0, "example").words(2).dtype
    dtype('uint32')
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from numbers import Real

import numpy as np
import torch

from protocol.engine import fused
from protocol.errors import ConfigError

# Philox4x32 constants (Random123 philox.h).
_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = 0x9E3779B9
_W1 = 0xBB67AE85
_ROUNDS = 10
_MASK32 = 0xFFFFFFFF

_KEY_DOMAIN = b"ovt-rng-v1"
_TAG_INT = b"i"
_TAG_STR = b"s"
_U64_LIMIT = 2**64
_U24_SCALE = 2.0**-24  # (word >> 8) * 2**-24 is exact in float64
_IRWIN_HALL_TERMS = 12  # sum of 12 U(0,1) has variance 1
# elements of a uniform or normal draw computed at a time (`RandomStream._drawn`); a multiple of
# 4, so that each chunk's words start on a block for any words per element
_CHUNK_ELEMENTS = 1 << 20

Shape = int | Sequence[int]


def philox4x32(counters: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 of each row of `counters` ((N, 4) uint32) under `key`; returns (N, 4) uint32.

    Products of two 32-bit words are taken in uint64, so the hi/lo halves are exact on any machine
    (no reliance on signed overflow or compiler intrinsics).
    """
    c = [counters[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = key
    for r in range(_ROUNDS):  # a loop over rounds; each round is vectorised over all blocks
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        c = _philox_round(c, np.uint64(k0), np.uint64(k1))
    return np.stack(c, axis=1).astype(np.uint32)


def _philox_round(c: list[np.ndarray], k0: np.uint64, k1: np.uint64) -> list[np.ndarray]:
    """One Philox S-box/P-box round on four uint64 columns holding 32-bit values."""
    p0 = _M0 * c[0]
    p1 = _M1 * c[2]
    mask = np.uint64(_MASK32)
    return [(p1 >> 32) ^ c[1] ^ k0, p1 & mask, (p0 >> 32) ^ c[3] ^ k1, p0 & mask]


def _encode_path_item(item: object) -> bytes:
    """Canonical bytes of one key item: type tag, u32 big-endian length, payload.

    The length prefix makes the concatenation unambiguous (("ab",) and ("a", "b") differ).
    """
    if isinstance(item, str):
        payload = item.encode("utf-8")
        return _TAG_STR + len(payload).to_bytes(4, "big") + payload
    if isinstance(item, bool) or not isinstance(item, int | np.integer):
        raise ConfigError(f"random stream key items must be int or str, got {type(item).__name__}")
    value = int(item)
    if not 0 <= value < _U64_LIMIT:
        raise ConfigError(f"random stream integers must be in [0, 2**64), got {value}")
    return _TAG_INT + (8).to_bytes(4, "big") + value.to_bytes(8, "big")


def derive_key(seed: int, *path: int | str) -> tuple[int, int]:
    """The Philox key of stream (seed, *path): first 8 bytes of SHA-256 of its canonical encoding,
    read as two big-endian uint32 words. Raises ConfigError for negative ints or other types."""
    encoded = _KEY_DOMAIN + b"".join(_encode_path_item(item) for item in (seed, *path))
    digest = hashlib.sha256(encoded).digest()
    return int.from_bytes(digest[0:4], "big"), int.from_bytes(digest[4:8], "big")


def _check_count(n: object, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ConfigError(f"{what} must be a non-negative int, got {n!r}")
    return int(n)


def _check_shape(shape: object) -> tuple[tuple[int, ...], int]:
    """Normalise an int or a sequence of ints to (shape tuple, element count)."""
    dims = (shape,) if isinstance(shape, int | np.integer) else shape
    if not isinstance(dims, tuple | list | torch.Size):
        raise ConfigError(f"shape must be an int or a sequence of ints, got {shape!r}")
    dims = tuple(_check_count(d, "shape dimension") for d in dims)
    return dims, math.prod(dims)


def _check_finite(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite real number, got {value!r}")
    return float(value)


class RandomStream:
    """An independent stream keyed by (seed, *path). path items are ints (>= 0) or strs.

    Block i of the stream is Philox4x32-10 of counter (i mod 2**32, i >> 32, 0, 0) and yields
    four uint32 words, in order. Raises ConfigError for a negative int or another item type.
    """

    def __init__(self, seed: int, *path: int | str) -> None:
        self.key = derive_key(seed, *path)

    def words(self, n: int) -> np.ndarray:
        """The first n uint32 words of the stream (so words(n) is a prefix of words(m), n < m)."""
        n = _check_count(n, "word count")
        return self._blocks(0, -(-n // 4))[:n]

    def _blocks(self, first: int, count: int) -> np.ndarray:
        """The words of blocks first .. first + count - 1, four per block (C++ where it is
        built, else numpy: the same words)."""
        fast = fused.philox(self.key, first, count)
        if fast is not None:
            return np.frombuffer(fast, dtype=np.uint32)
        blocks = np.arange(first, first + count, dtype=np.uint64)
        counters = np.zeros((blocks.size, 4), dtype=np.uint32)
        counters[:, 0] = blocks & np.uint64(_MASK32)
        counters[:, 1] = blocks >> np.uint64(32)
        return philox4x32(counters, self.key).reshape(-1)

    def _unit_ints(self, start: int, n: int) -> np.ndarray:
        """Words start .. start + n - 1 of the stream (start a multiple of 4: a block's first
        word) as integers in [0, 2**24): the top 24 bits of each, so float32 holds u exactly."""
        first = start // 4
        words = self._blocks(first, -(-(start + n) // 4) - first)[:n]
        return (words >> np.uint32(8)).astype(np.int64)

    def _drawn(self, n: int, words_each: int,
               values: Callable[[np.ndarray], np.ndarray]) -> torch.Tensor:
        """A float32 CPU tensor of n elements, element j from words j·words_each ..
        (j + 1)·words_each - 1 alone (`values` maps unit integers of shape (elements,
        words_each) to the elements' float64 values, each then rounded once to float32, as
        numpy rounds: to nearest even), computed `_CHUNK_ELEMENTS` elements at a time: the
        bits of one draw, with one chunk's words held at a time. (GPT-2's 38.6 M-element
        embedding draws 464 M words for its normal values: 3.7 GB as int64 in one piece.)"""
        out = np.empty(n, dtype=np.float32)
        for begin in range(0, n, _CHUNK_ELEMENTS):
            count = min(_CHUNK_ELEMENTS, n - begin)
            ints = self._unit_ints(begin * words_each, count * words_each)
            out[begin:begin + count] = values(ints.reshape(count, words_each))
        return torch.from_numpy(out)

    def uniform(self, shape: Shape, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
        """float32 CPU tensor of values low + (high - low) * u with u on the grid k * 2**-24.

        The affine map is computed in float64 and rounded once to float32, so the bits are
        portable. Values lie in [low, high) for unit-ish bounds; for wide bounds the float32
        rounding of the largest u may reach `high` itself. Raises ConfigError for low >= high.
        """
        dims, n = _check_shape(shape)
        low, high = _check_finite(low, "low"), _check_finite(high, "high")
        if not low < high:
            raise ConfigError(f"uniform needs low < high, got [{low}, {high})")
        span = high - low
        return self._drawn(n, 1, lambda ints: low + span * (ints[:, 0] * _U24_SCALE)) \
            .reshape(dims)

    def normal(self, shape: Shape, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
        """float32 CPU tensor, approximately normal(mean, std) — Irwin–Hall, not exact.

        z = (sum of 12 grid uniforms) - 6 has mean 0 and variance 1 (minus 2**-48) and is bounded
        by ±6; its tails are lighter than a Gaussian's. We accept that to avoid log/sqrt/cos,
        whose last bits differ between libm builds. The sum is exact in integers, z is exact in
        float64, and mean + std * z is rounded once to float32. Raises ConfigError for std < 0.
        """
        dims, n = _check_shape(shape)
        mean, std = _check_finite(mean, "mean"), _check_finite(std, "std")
        if std < 0:
            raise ConfigError(f"normal needs std >= 0, got {std}")

        def values(ints: np.ndarray) -> np.ndarray:
            z = ints.sum(axis=1) * _U24_SCALE - _IRWIN_HALL_TERMS / 2
            return mean + std * z
        return self._drawn(n, _IRWIN_HALL_TERMS, values).reshape(dims)

    def keep_mask(self, shape: Shape, keep_prob: float | np.ndarray) -> torch.Tensor:
        """bool CPU tensor, True where word < keep_prob * 2**32 — an exact comparison in float64.

        keep_prob is one probability or a float64 array of them broadcastable to `shape` (one per
        element: Bernoulli draws with tensor probabilities). Scaling by 2**32 and widening a
        uint32 word are exact in float64, so the test is exact: P(True) = ceil(p * 2**32) / 2**32,
        within 2**-32 above p; keep_prob = 1 keeps everything, 0 nothing. Raises ConfigError
        unless every probability is in [0, 1] (NaN included).
        """
        dims, n = _check_shape(shape)
        if isinstance(keep_prob, np.ndarray):
            probs = keep_prob.astype(np.float64)
            if not ((probs >= 0.0) & (probs <= 1.0)).all():
                raise ConfigError("keep probabilities must be in [0, 1]")
            try:
                probs = np.broadcast_to(probs, dims)
            except ValueError:
                raise ConfigError(f"keep probabilities of shape {probs.shape} do not broadcast "
                                  f"to {dims}") from None
            threshold: np.ndarray | float = probs.reshape(-1) * 2.0**32
        else:
            keep_prob = _check_finite(keep_prob, "keep_prob")
            if not 0.0 <= keep_prob <= 1.0:
                raise ConfigError(f"keep_prob must be in [0, 1], got {keep_prob}")
            threshold = keep_prob * 2.0**32  # exact: a power-of-two scaling
        words = self.words(n)
        if isinstance(threshold, float):  # an integer word is below it iff below its ceiling
            limit = math.ceil(threshold)
            mask = words < np.uint32(limit) if limit < 2**32 else np.ones(n, dtype=bool)
        else:
            mask = words.astype(np.float64) < threshold
        return torch.from_numpy(mask.reshape(dims))

    def integers(self, shape: Shape, low: int, high: int) -> np.ndarray:
        """int64 array of integers in [low, high), -2**63 <= low < high <= 2**63.

        Each element takes two words as a 64-bit x (first word high) and is low + floor(x *
        span / 2**64), span = high - low, computed exactly in 32-bit limbs (`_mul_high`). Value
        v is hit by floor or ceil of 2**64 / span of the 2**64 draws, so its probability is
        within 2**-64 of 1 / span (relative bias below span * 2**-64; below 2**-32 for spans up
        to 2**32); span = 2**64 takes x itself. Raises ConfigError for other bounds.
        """
        dims, n = _check_shape(shape)
        for name, value in (("low", low), ("high", high)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ConfigError(f"integers needs an int {name}, got {value!r}")
        low, high = int(low), int(high)
        if not -(2**63) <= low < high <= 2**63:
            raise ConfigError(f"integers needs -2**63 <= low < high <= 2**63, got [{low}, {high})")
        span = high - low
        pairs = self.words(2 * n).astype(np.uint64).reshape(n, 2)
        if span == _U64_LIMIT:
            offsets = (pairs[:, 0] << np.uint64(32)) | pairs[:, 1]
        else:
            offsets = _mul_high(pairs[:, 0], pairs[:, 1], span)
        values = offsets + np.uint64(low % _U64_LIMIT)  # wraps mod 2**64: two's complement
        return values.view(np.int64).reshape(dims)

    def permutation(self, n: int) -> np.ndarray:
        """int64 permutation of range(n): stable argsort of 64-bit keys (two words per element).

        64-bit keys make ties (which the stable sort resolves by position) vanishingly rare.
        """
        n = _check_count(n, "permutation size")
        pairs = self.words(2 * n).astype(np.uint64).reshape(n, 2)
        keys = (pairs[:, 0] << np.uint64(32)) | pairs[:, 1]
        return np.argsort(keys, kind="stable").astype(np.int64)


def _mul_high(x_hi: np.ndarray, x_lo: np.ndarray, span: int) -> np.ndarray:
    """floor(x * span / 2**64) for x = x_hi * 2**32 + x_lo (uint64 columns of 32-bit values) and
    0 < span < 2**64: the high word of the 128-bit product, from four exact 32x32-bit products."""
    mask = np.uint64(_MASK32)
    s_hi, s_lo = np.uint64(span >> 32), np.uint64(span & _MASK32)
    lo_lo, hi_lo, lo_hi, hi_hi = x_lo * s_lo, x_hi * s_lo, x_lo * s_hi, x_hi * s_hi
    middle = (lo_lo >> np.uint64(32)) + (hi_lo & mask) + (lo_hi & mask)  # < 3 * 2**32
    return hi_hi + (hi_lo >> np.uint64(32)) + (lo_hi >> np.uint64(32)) + (middle >> np.uint64(32))
