"""The canonical encoding (protocol.codec.canonical, SPEC §2): golden bytes, a golden set of
non-canonical and malformed inputs that must each be rejected, and property tests."""

from __future__ import annotations

import doctest
import enum
import hashlib
import math
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import canonical as encoding
from protocol.codec.canonical import INT_MAX, INT_MIN, MAX_DEPTH, decode, digest, encode
from protocol.errors import EncodingError


def test_module_docstring_example_runs():
    result = doctest.testmod(encoding)
    assert result.attempted > 0 and result.failed == 0


# ---- golden bytes ----------------------------------------------------------------------------
# Written by hand from the msgpack spec (github.com/msgpack/msgpack/blob/master/spec.md).

GOLDEN = [
    (None, "c0"),
    (False, "c2"),
    (True, "c3"),
    (0, "00"),
    (127, "7f"),
    (128, "cc80"),
    (255, "ccff"),
    (256, "cd0100"),
    (65535, "cdffff"),
    (65536, "ce00010000"),
    (2**32, "cf0000000100000000"),
    (INT_MAX, "cfffffffffffffffff"),
    (-1, "ff"),
    (-32, "e0"),
    (-33, "d0df"),
    (-128, "d080"),
    (-129, "d1ff7f"),
    (-(2**15) - 1, "d2ffff7fff"),
    (-(2**31) - 1, "d3ffffffff7fffffff"),
    (INT_MIN, "d38000000000000000"),
    (1.5, "cb3ff8000000000000"),
    (-0.0, "cb8000000000000000"),
    (math.inf, "cb7ff0000000000000"),
    ("", "a0"),
    ("é", "a2c3a9"),
    ("x" * 32, "d920" + "78" * 32),
    (b"", "c400"),
    (b"\x00", "c40100"),
    ([], "90"),
    ((1, 2), "920102"),
    ({}, "80"),
    # keys sorted by UTF-8 bytes: "B" (42) < "a" (61) < "ab" < "é" (c3a9)
    ({"é": 0, "ab": 1, "a": 2, "B": 3}, "84a14203a16102a2616201a2c3a900"),
    ({"b": 1, "a": [True, None, -1, 1.5, b"\x00", "é"]},
     "82a16196c3c0ffcb3ff8000000000000c40100a2c3a9a16201"),
]


@pytest.mark.parametrize(("value", "hexbytes"), GOLDEN)
def test_golden_bytes(value, hexbytes):
    assert encode(value).hex() == hexbytes
    back = decode(bytes.fromhex(hexbytes))
    assert encode(back).hex() == hexbytes
    assert back == (list(value) if isinstance(value, tuple) else value)


def test_digest_is_sha256_of_the_encoding():
    value = {"job": "x", "n": 3}
    assert digest(value) == hashlib.sha256(encode(value)).digest()
    assert digest({"n": 3, "job": "x"}) == digest(value)  # insertion order does not matter


def test_round_trip_of_nested_values():
    value = {"spec": {"steps": 10, "lr": 0.1, "name": "char-transformer", "seed": INT_MAX},
             "leaves": [[0, b"\x01" * 32, b""], [1, b"\x02" * 32, b"\xff"]],
             "flags": [True, False, None], "neg": INT_MIN, "unicode": "ℓ_t ∅ 🙂",
             "empty": {"list": [], "map": {}, "str": "", "bytes": b""}}
    data = encode(value)
    assert decode(data) == value
    assert encode(decode(data)) == data


# ---- golden set of rejected inputs -----------------------------------------------------------

REJECTED = {
    # non-minimal ints: msgpack allows them, canonical form does not
    "uint8 holding a fixint": "cc05",
    "int8 holding a positive fixint": "d005",
    "int8 holding a negative fixint": "d0ff",
    "uint16 holding a uint8": "cd00ff",
    "uint16 holding a fixint": "cd0005",
    "uint32 holding a uint16": "ce0000ffff",
    "uint64 holding a uint32": "cf00000000ffffffff",
    "int16 holding an int8": "d1ff80",
    "int16 holding a positive value": "d10100",
    "int32 holding an int16": "d2ffff8000",
    "int64 holding an int32": "d3ffffffff80000000",
    "int64 holding a positive value": "d30000000000000001",
    # floats
    "float32": "ca3fc00000",
    "float64 NaN": "cb7ff8000000000000",
    "float64 NaN, other payload": "cbfff0000000000001",
    "float32 NaN": "ca7fc00000",
    # strings, bytes, arrays, maps with wider headers than needed
    "str8 for a 1-byte str": "d90161",
    "str16 for a 1-byte str": "da000161",
    "bin16 for 1 byte": "c5000100",
    "array16 for 1 element": "dc000100",
    "map16 for 1 entry": "de0001a16100",
    "invalid UTF-8 in str": "a1ff",
    "overlong UTF-8 in str": "a2c0af",
    "lone surrogate in str": "a3eda080",
    # maps
    "unsorted keys": "82a16201a16102",
    "keys sorted by length, not bytes": "82a16201a2616102",
    "duplicate keys": "82a16101a16102",
    "int key": "810101",
    "bytes key": "81c4016101",
    "nil key": "81c001",
    "array key": "819001",
    # ext types, the timestamp among them
    "fixext1": "d40100",
    "fixext1, negative type": "d4fe00",
    "timestamp of a bad length": "d4ff00",
    "ext8": "c7010100",
    "timestamp32": "d6ff00000000",
    "timestamp64": "d7ff0000000000000000",
    # framing
    "empty": "",
    "trailing byte": "c0c0",
    "trailing byte after a map": "80ff",
    "truncated uint16": "cd01",
    "truncated str": "a261",
    "truncated array": "9201",
    "truncated map": "81a161",
    "truncated float64": "cb3ff8",
    "reserved byte 0xc1": "c1",
    "array claiming more elements than bytes": "dd7fffffff",
    "str claiming more bytes than there are": "dbffffffff",
}


@pytest.mark.parametrize("hexbytes", REJECTED.values(), ids=REJECTED.keys())
def test_rejected_inputs(hexbytes):
    with pytest.raises(EncodingError):
        decode(bytes.fromhex(hexbytes))


def test_rejection_messages_say_what_is_wrong():
    with pytest.raises(EncodingError, match="non-canonical"):
        decode(bytes.fromhex("cc05"))
    with pytest.raises(EncodingError, match="trailing bytes"):
        decode(b"\xc0\xc0")
    with pytest.raises(EncodingError, match="ext type 1"):
        decode(bytes.fromhex("d40100"))
    with pytest.raises(EncodingError, match="map keys must be str"):
        decode(bytes.fromhex("81c4016101"))
    with pytest.raises(EncodingError, match="NaN"):
        decode(bytes.fromhex("cb7ff8000000000000"))
    with pytest.raises(EncodingError, match="empty"):
        decode(b"")


def test_oversized_input_is_rejected_before_parsing():
    data = encode(b"x" * 1000)
    assert decode(data, max_bytes=len(data)) == b"x" * 1000
    with pytest.raises(EncodingError, match="exceeds the limit"):
        decode(data, max_bytes=len(data) - 1)


def test_nesting_limit():
    ok = b"\x91" * MAX_DEPTH + b"\xc0"
    assert encode(decode(ok)) == ok
    for depth in (MAX_DEPTH + 1, 5000, 100_000):  # 100_000 trips msgpack's own stack limit
        with pytest.raises(EncodingError):
            decode(b"\x91" * depth + b"\xc0")
    deep: list = []
    for _ in range(MAX_DEPTH):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper"):
        encode(deep)


def test_decode_accepts_bytes_like_and_refuses_other_types():
    assert decode(bytearray(b"\x01")) == 1 and decode(memoryview(b"\x01")) == 1
    with pytest.raises(TypeError):
        decode("c0")


# ---- what encode refuses (programming errors: TypeError / ValueError) ------------------------


class _Color(enum.IntEnum):
    RED = 1


class _Name(enum.StrEnum):
    A = "a"


@pytest.mark.parametrize("value", [
    {1: "int key"}, {b"k": 1}, {("t",): 1}, {None: 1}, {_Name.A: 1},
    {1, 2}, frozenset(), bytearray(b"x"), memoryview(b"x"), 1j, object(),
    _Color.RED, _Name.A, OrderedDict(a=1), [1, {2: 3}],
])
def test_encode_rejects_types_outside_the_model(value):
    with pytest.raises(TypeError):
        encode(value)


@pytest.mark.parametrize("value", [
    INT_MAX + 1, INT_MIN - 1, 2**100, math.nan, -math.nan, [math.nan], {"x": math.nan},
    "\ud800",
])
def test_encode_rejects_values_outside_the_model(value):
    with pytest.raises(ValueError):
        encode(value)


def test_int_range_edges_round_trip():
    for value in (INT_MIN, INT_MIN + 1, -1, 0, 2**63 - 1, 2**63, INT_MAX):
        assert decode(encode(value)) == value


def test_bool_and_int_and_float_are_distinct():
    assert len({encode(True), encode(1), encode(1.0)}) == 3
    assert len({encode(0.0), encode(-0.0)}) == 2
    assert decode(encode(1.0)) == 1.0 and type(decode(encode(1.0))) is float


# ---- properties ------------------------------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers(INT_MIN, INT_MAX)
            | st.floats(allow_nan=False) | st.text() | st.binary())
values = st.recursive(
    _scalars,
    lambda children: (st.lists(children, max_size=5) | st.tuples(children, children)
                      | st.dictionaries(st.text(max_size=8), children, max_size=5)),
    max_leaves=30,
)


def _as_decoded(value):
    """What decode returns for an encoded `value`: tuples come back as lists."""
    if isinstance(value, list | tuple):
        return [_as_decoded(item) for item in value]
    if isinstance(value, dict):
        return {key: _as_decoded(item) for key, item in value.items()}
    return value


@settings(max_examples=300, deadline=None)
@given(values)
def test_valid_values_round_trip(value):
    data = encode(value)
    back = decode(data)
    assert encode(back) == data
    assert back == _as_decoded(value)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_raise_only_encoding_error(data):
    try:
        value = decode(data)
    except EncodingError:
        return
    assert encode(value) == data  # accepted bytes are exactly a canonical encoding


@settings(max_examples=300, deadline=None)
@given(values, st.data())
def test_mutated_encodings_are_canonical_or_rejected(value, data):
    """Change one byte of a valid encoding: the result is rejected with EncodingError or is
    itself the canonical encoding of what it decodes to; never another exception."""
    raw = bytearray(encode(value))
    position = data.draw(st.integers(0, len(raw) - 1))
    raw[position] = data.draw(st.integers(0, 255))
    try:
        decoded = decode(bytes(raw))
    except EncodingError:
        return
    assert encode(decoded) == bytes(raw)


# ---- decode_object: the one strictness rule for objects (issue 10, finding 3) ----------------

def _version_of(body: object) -> int:
    """A lax builder, as an object's own field checks might be: `True` and `1.0` pass as 1."""
    if not isinstance(body, dict) or body.get("v") != 1:
        raise EncodingError("not a versioned map")
    return 1


@pytest.mark.parametrize("alias", [True, 1.0])
def test_decode_object_refuses_a_value_that_only_equals_the_objects_own(alias):
    data = encode({"v": alias})
    assert _version_of(decode(data)) == 1  # the lax builder alone accepts it
    with pytest.raises(EncodingError, match="does not re-encode to its own bytes"):
        encoding.decode_object(data, _version_of, lambda v: encode({"v": v}), what="thing")


def test_decode_object_returns_the_object_of_its_own_bytes():
    data = encode({"v": 1})
    assert encoding.decode_object(data, _version_of, lambda v: encode({"v": v}),
                                  what="thing") == 1
