"""protocol.codec.state: the canonical state encoding and its hash h_t (SPEC §2 "State")."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import state as state_module
from protocol.codec.dtypes import DTYPES, SAFETENSORS_DTYPES
from protocol.codec.state import (
    MAGIC,
    decode_state,
    encode_state,
    load_safetensors,
    safetensors_file_digest,
    state_digest,
    states_equal,
)
from protocol.errors import StateFormatError


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(3, 4, generator=g),
        "model.w64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "model.bf": torch.randn(5, generator=g).to(torch.bfloat16),
        "model.idx": torch.arange(-3, 3, dtype=torch.int64).reshape(2, 3),
        "model.mask": torch.tensor([[True, False], [False, True]]),
        "optim.w.step": torch.tensor(3.0),
        "model.empty": torch.zeros(0),
        "model.i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "model.u8": torch.tensor([0, 255], dtype=torch.uint8),
        "model.f16": torch.tensor([0.5, -2.0], dtype=torch.float16),
        "model.i32": torch.tensor([2**31 - 1], dtype=torch.int32),
        "model.i16": torch.tensor([-(2**15)], dtype=torch.int16),
        "step": torch.tensor(7, dtype=torch.int64),
    }


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy())
            == bytes(b.contiguous().reshape(-1).view(torch.uint8).numpy()))


def test_round_trip():
    state = sample_state()
    data = encode_state(state)
    back = decode_state(data)
    assert list(back) == sorted(state)
    for name, t in state.items():
        assert bit_equal(back[name], t), name
    assert encode_state(back) == data
    assert states_equal(back, state)


def test_digest_is_sha256_of_the_encoding():
    state = sample_state()
    assert state_digest(state) == hashlib.sha256(encode_state(state)).digest()


def test_name_order_of_the_mapping_does_not_matter():
    state = sample_state()
    reversed_state = dict(reversed(list(state.items())))
    assert list(reversed_state) != list(state)
    assert encode_state(reversed_state) == encode_state(state)
    assert state_digest(reversed_state) == state_digest(state)


def test_layout_does_not_matter():
    """Non-contiguous, transposed and channels_last tensors hash as their logical content."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 5, generator=g)
    m = torch.randn(6, 4, generator=g)
    plain = {"a": x, "b": m.t().contiguous(), "c": m[::2, 1:3].contiguous()}
    laid_out = {"a": x.contiguous(memory_format=torch.channels_last), "b": m.t(),
                "c": m[::2, 1:3]}
    assert not laid_out["a"].is_contiguous() and not laid_out["b"].is_contiguous()
    assert encode_state(laid_out) == encode_state(plain)
    assert state_digest(laid_out) == state_digest(plain)
    assert states_equal(laid_out, plain)
    back = decode_state(encode_state(laid_out))
    assert back["b"].shape == (4, 6) and torch.equal(back["b"], m.t())


def test_zero_dim_and_empty():
    state = {"scalar": torch.tensor(1.5), "empty": torch.zeros(0, dtype=torch.bfloat16),
             "i": torch.tensor(-1)}
    back = decode_state(encode_state(state))
    assert back["scalar"].shape == () and float(back["scalar"]) == 1.5
    assert back["empty"].shape == (0,) and back["empty"].dtype == torch.bfloat16
    assert int(back["i"]) == -1


@pytest.mark.parametrize("shape", [(0, 7), (3, 0, 2)])
def test_empty_multi_dim_tensors(shape):
    state = {"e": torch.zeros(shape, dtype=torch.bool), "f": torch.zeros(shape)}
    back = decode_state(encode_state(state))
    assert back["e"].shape == shape and back["f"].shape == shape
    assert state_digest(state) == hashlib.sha256(encode_state(state)).digest()


def test_empty_state():
    assert encode_state({}) == MAGIC + bytes([1]) + struct.pack("<I", 0)
    assert decode_state(encode_state({})) == {}


def test_decoded_tensors_are_writable_and_independent():
    data = encode_state({"a": torch.ones(3)})
    back = decode_state(data)
    back["a"][0] = 5.0  # must not fail (and must not touch `data`)
    assert decode_state(data)["a"][0] == 1.0


def golden_state() -> dict[str, torch.Tensor]:
    return {
        "step": torch.tensor(2, dtype=torch.int64),
        "m.w": torch.tensor([[1.0, -0.0], [0.5, 2.0]], dtype=torch.float32),
        "m.b1": torch.tensor([1.0, -2.0], dtype=torch.bfloat16),
    }


GOLDEN_ENCODING = bytes.fromhex(
    "4f565453" "01" "03000000"
    # "m.b1", bfloat16, ndim 1, shape (2,), 4 bytes: 0x3f80, 0xc000
    "0400" "6d2e6231" "08" "62666c6f61743136" "01" "0200000000000000" "0400000000000000"
    "803f" "00c0"
    # "m.w", float32, ndim 2, shape (2, 2), 16 bytes
    "0300" "6d2e77" "07" "666c6f61743332" "02" "0200000000000000" "0200000000000000"
    "1000000000000000" "0000803f" "00000080" "0000003f" "00000040"
    # "step", int64, ndim 0, 8 bytes
    "0400" "73746570" "05" "696e743634" "00" "0800000000000000" "0200000000000000"
)


def test_golden_encoding():
    """Guards the canonical layout: hand-written bytes of a tiny fixed state."""
    assert encode_state(golden_state()) == GOLDEN_ENCODING
    assert states_equal(decode_state(GOLDEN_ENCODING), golden_state())


# h_t of golden_state(), computed once and hard-coded.
GOLDEN_DIGEST = "a7e7640f3cbf5c2e719d72fcb1342e8ca71d92ad67b55e0c1f4c7240c0b0d378"


def test_golden_digest():
    """Guards the canonical layout (SPEC §2 "State"): a change to the byte layout, the name sort,
    the dtype names or the byte order changes this digest and breaks every stored commitment."""
    assert state_digest(golden_state()).hex() == GOLDEN_DIGEST


# -- strict decoding ----------------------------------------------------------------------------


SMALL = encode_state({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor(3, dtype=torch.int32)})


def test_bad_magic():
    with pytest.raises(StateFormatError, match="magic"):
        decode_state(b"OVTX" + SMALL[4:])


def test_bad_version():
    with pytest.raises(StateFormatError, match="version"):
        decode_state(SMALL[:4] + bytes([2]) + SMALL[5:])


@pytest.mark.parametrize("cut", range(len(SMALL)))
def test_truncation_at_every_byte(cut):
    with pytest.raises(StateFormatError):
        decode_state(SMALL[:cut])


@pytest.mark.parametrize("extra", [b"\x00", b"junk", SMALL])
def test_trailing_bytes(extra):
    with pytest.raises(StateFormatError, match="trailing"):
        decode_state(SMALL + extra)


def _entry(name: str, dtype: str, shape: tuple[int, ...], raw: bytes) -> bytes:
    return (struct.pack("<H", len(name)) + name.encode() + struct.pack("<B", len(dtype))
            + dtype.encode() + struct.pack(f"<B{len(shape)}Q", len(shape), *shape)
            + struct.pack("<Q", len(raw)) + raw)


def _encoding(*entries: bytes) -> bytes:
    return MAGIC + struct.pack("<BI", 1, len(entries)) + b"".join(entries)


def test_hand_built_encoding_is_accepted():
    data = _encoding(_entry("a", "int8", (2,), b"\x01\x02"), _entry("b", "bool", (), b"\x01"))
    assert states_equal(decode_state(data), {"a": torch.tensor([1, 2], dtype=torch.int8),
                                             "b": torch.tensor(True)})


@pytest.mark.parametrize("names", [("b", "a"), ("a", "a"), ("ab", "a")])
def test_unsorted_or_duplicate_names(names):
    data = _encoding(*(_entry(n, "int8", (1,), b"\x00") for n in names))
    with pytest.raises(StateFormatError, match="sorted"):
        decode_state(data)


@pytest.mark.parametrize("dtype", ["float128", "complex64", "", "FLOAT32", "\xff"])
def test_bad_dtype(dtype):
    with pytest.raises(StateFormatError, match="dtype"):
        decode_state(_encoding(_entry("a", dtype, (1,), b"\x00" * 4)))


@pytest.mark.parametrize("shape, nbytes", [((2,), 4), ((2,), 12), ((2**40, 2**40), 8), ((), 0)])
def test_byte_count_must_match_the_shape(shape, nbytes):
    with pytest.raises(StateFormatError):
        decode_state(_encoding(_entry("a", "float32", shape, b"\x00" * nbytes)))


def test_name_that_is_not_utf8():
    data = _encoding(_entry("a", "int8", (1,), b"\x00")).replace(b"\x01\x00a", b"\x01\x00\xff")
    with pytest.raises(StateFormatError, match="not UTF-8"):
        decode_state(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_encodings_decode_or_raise_state_format_error(data):
    """Property: any corruption either decodes to a state or raises StateFormatError — never
    anything else (a corrupted length can make any bytes a name: test_name_that_is_not_utf8)."""
    raw = bytearray(SMALL)
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] ^= data.draw(st.integers(1, 255))
    try:
        decode_state(bytes(raw))
    except StateFormatError:
        pass


# -- bit-exact equality -------------------------------------------------------------------------


def test_states_equal_distinguishes_signed_zeros():
    assert not states_equal({"a": torch.tensor([0.0])}, {"a": torch.tensor([-0.0])})
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # what torch.equal would say
    assert state_digest({"a": torch.tensor([0.0])}) != state_digest({"a": torch.tensor([-0.0])})


@pytest.mark.parametrize("dtype, int_dtype", [(torch.float32, torch.int32),
                                              (torch.float64, torch.int64),
                                              (torch.bfloat16, torch.int16),
                                              (torch.float16, torch.int16)])
def test_states_equal_compares_nan_payloads(dtype, int_dtype):
    quiet = torch.tensor([float("nan")], dtype=dtype)
    payload = (quiet.view(int_dtype) + 1).view(dtype)
    assert torch.isnan(payload).all()
    assert states_equal({"a": quiet}, {"a": quiet.clone()})  # same NaN bits: equal
    assert not states_equal({"a": quiet}, {"a": payload})


def test_states_equal_checks_names_dtypes_shapes():
    a = {"x": torch.ones(2)}
    assert not states_equal(a, {"y": torch.ones(2)})
    assert not states_equal(a, {"x": torch.ones(2, dtype=torch.float64)})
    assert not states_equal(a, {"x": torch.ones(1, 2)})
    assert not states_equal(a, {"x": torch.ones(2), "z": torch.ones(1)})
    assert states_equal(a, {"x": torch.ones(2)})


def test_unsupported_dtype_is_refused_by_the_encoder():
    with pytest.raises(TypeError, match="complex64"):
        encode_state({"c": torch.zeros(2, dtype=torch.complex64)})


# -- finding 7 (issue 10): decoders of peer bytes raise only StateFormatError -----------------


@pytest.mark.parametrize("shape", [(0, 2**64 - 1), (2**62, 2**62, 0), (0, 2**63),
                                   (2**40, 2**30, 0)])
def test_decode_state_shape_torch_cannot_hold_is_a_state_format_error(shape):
    """A zero-size tensor whose dimensions overflow torch's int64 count (torch answers these
    with TypeError or RuntimeError) is refused before torch sees the shape."""
    with pytest.raises(StateFormatError, match="beyond what torch holds"):
        decode_state(_encoding(_entry("a", "float32", shape, b"")))


def test_zero_size_shapes_torch_can_hold_still_decode():
    for shape in ((0, 2**63 - 1), (2**31, 2**31, 0)):
        data = _encoding(_entry("a", "float32", shape, b""))
        assert decode_state(data)["a"].shape == shape
        assert encode_state(decode_state(data)) == data


@pytest.mark.parametrize("byte", [2, 0x80, 0xFF])
def test_decode_state_bool_byte_other_than_0_or_1_is_refused(byte):
    """Finding 3 at the state's depth: a bool byte 2 would be another byte string (another
    h_t) for a tensor that torch reads as True."""
    with pytest.raises(StateFormatError, match="bool byte"):
        decode_state(_encoding(_entry("b", "bool", (2,), bytes([1, byte]))))


def _safetensors(dtype: str, shape: list[int], raw: bytes) -> bytes:
    header = json.dumps({"t": {"dtype": dtype, "shape": shape,
                               "data_offsets": [0, len(raw)]}}).encode()
    return struct.pack("<Q", len(header)) + header + raw


def test_load_safetensors_round_trips_every_state_dtype():
    state = sample_state()
    assert states_equal(load_safetensors(safetensors.torch.save(state)), state)


def test_safetensors_dtypes_are_the_state_dtypes():
    assert sorted(map(str, SAFETENSORS_DTYPES.values())) == sorted(map(str, DTYPES.values()))


@pytest.mark.parametrize("dtype, itemsize", [("U16", 2), ("U32", 4), ("U64", 8), ("C64", 8),
                                             ("F8_E4M3", 1), ("F8_E5M2", 1), ("F8_E8M0", 1)])
def test_peer_safetensors_of_another_dtype_is_a_state_format_error(dtype, itemsize):
    """safetensors.torch.load gives these to torch (a uint16 tensor state_digest refuses with a
    TypeError; F8_E8M0 a KeyError inside safetensors): refused here, naming the dtype."""
    with pytest.raises(StateFormatError, match=f"dtype '{dtype}'"):
        load_safetensors(_safetensors(dtype, [1], b"\x01" * itemsize))


@pytest.mark.parametrize("shape", [[0, 2**64 - 1], [0, 2**63]])
def test_peer_safetensors_shape_torch_cannot_hold_is_a_state_format_error(shape):
    with pytest.raises(StateFormatError, match="beyond what torch holds"):
        load_safetensors(_safetensors("F32", shape, b""))


@pytest.mark.parametrize("data", [b"", b"\x00" * 8, b"\xff" * 16, _safetensors("F32", [2], b"x")],
                         ids=["empty", "zero-header", "huge-header", "short-data"])
def test_malformed_safetensors_is_a_state_format_error(data):
    with pytest.raises(StateFormatError, match="not a safetensors state"):
        load_safetensors(data)


def test_peer_safetensors_bool_byte_other_than_0_or_1_is_refused():
    with pytest.raises(StateFormatError, match="bool byte"):
        load_safetensors(_safetensors("BOOL", [1], b"\x02"))


# -- safetensors_file_digest: a submitted S_0 hashed where it lies (issue 10, finding 6) --------

def _file(tmp_path, data: bytes):
    path = tmp_path / "s0.safetensors"
    path.write_bytes(data)
    return path


def test_a_safetensors_file_hashes_to_the_digest_of_the_state_it_holds(tmp_path, monkeypatch):
    """Finding 6 (review): the trainer read a submitted S_0 whole into memory to hash it."""
    monkeypatch.setattr(state_module, "FILE_CHUNK_BYTES", 5)  # tensors span many reads
    state = sample_state()
    data = safetensors.torch.save(state, metadata={"job_id": "x"})
    assert safetensors_file_digest(_file(tmp_path, data)) == state_digest(state)


@pytest.mark.parametrize("data", [
    b"", b"\x00" * 8, b"\xff" * 16, _safetensors("F32", [2], b"x"),
    _safetensors("U16", [1], b"\x01\x00"), _safetensors("F32", [0, 2**64 - 1], b""),
    _safetensors("BOOL", [3], b"\x01\x00\x02"), _safetensors("I8", [2], b"\x01\x02") + b"!",
    _safetensors("I8", [1] * 256, b"\x01")],
    ids=["empty", "zero-header", "huge-header", "short-data", "u16", "huge-shape", "bool-byte",
         "trailing", "256-dims"])
def test_a_safetensors_file_is_refused_exactly_as_its_bytes_are(tmp_path, data):
    with pytest.raises(StateFormatError):
        load_safetensors(data)
    with pytest.raises(StateFormatError):
        safetensors_file_digest(_file(tmp_path, data))


def test_a_header_json_reads_differently_from_the_safetensors_parser_is_refused(tmp_path,
                                                                                  monkeypatch):
    data = _safetensors("I8", [2], b"\x01\x02")
    monkeypatch.setattr(state_module.json, "loads", lambda header: {"t": {"dtype": "I8",
                                                                          "shape": [1]}})
    with pytest.raises(StateFormatError, match="reads differently"):
        safetensors_file_digest(_file(tmp_path, data))
