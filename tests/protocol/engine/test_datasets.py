"""Datasets from files (protocol/engine/datasets.py): token files and safetensors files of named
tensors, committed per example like the built-ins' (SPEC §2.1); every bad file a ConfigError
naming the file and the problem; the descriptor's strict canonical body; the data folder's
containment (no "..", no absolute path, no symbolic link out)."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from protocol.codec.canonical import decode, encode
from protocol.commit.data import commit_dataset
from protocol.engine.datasets import (
    AbsentExamples,
    DataFile,
    TensorFile,
    TokenFile,
    commit_examples,
    normal_path,
    npy_token_dtype,
    open_data_file,
    require_same_fields,
    resolve_data_path,
)
from protocol.errors import ConfigError, EncodingError

WINDOW = 8


class ListSource:
    """The naive in-memory reference: a list of examples."""

    def __init__(self, examples):
        self.examples = list(examples)

    def __len__(self):
        return len(self.examples)

    def example(self, index):
        return self.examples[index]


def _tokens(n: int, dtype: str, high: int = 1000) -> np.ndarray:
    return np.random.default_rng(n).integers(0, high, n).astype(dtype)


def _windows(tokens: np.ndarray, window: int) -> ListSource:
    count = (len(tokens) - 1) // window
    return ListSource({"tokens": torch.from_numpy(
        tokens[i * window:i * window + window + 1].astype(np.int64))} for i in range(count))


def _bin(tmp_path: Path, tokens: np.ndarray, name: str = "train.bin") -> DataFile:
    tokens.tofile(tmp_path / name)
    return DataFile("tokens", name, str(tokens.dtype), WINDOW)


def _npy(tmp_path: Path, tokens: np.ndarray, name: str = "train.npy") -> DataFile:
    np.save(tmp_path / name, tokens)
    return DataFile("tokens", name, str(tokens.dtype), WINDOW)


def _tensors(tmp_path: Path, tensors: dict, name: str = "train.safetensors") -> DataFile:
    (tmp_path / name).write_bytes(safetensors.torch.save(tensors))
    return DataFile("tensors", name)


def _images(n: int = 10) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return {"image": torch.randn(n, 3, 4, 4, generator=gen),
            "label": torch.randint(0, 10, (n,), generator=gen)}


# ---- exact examples ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["uint16", "int32"])
@pytest.mark.parametrize("write", [_bin, _npy])
def test_token_windows_are_exactly_the_slices_of_the_file(tmp_path, dtype, write):
    tokens = _tokens(8 * 20 + 5, dtype, high=60000)  # 20 windows and a dropped partial one
    source = open_data_file(write(tmp_path, tokens), tmp_path)
    assert isinstance(source, TokenFile) and len(source) == 20
    for i in range(len(source)):
        example = source.example(i)
        assert list(example) == ["tokens"] and example["tokens"].dtype == torch.int64
        assert torch.equal(example["tokens"], torch.from_numpy(
            tokens[i * WINDOW:i * WINDOW + WINDOW + 1].astype(np.int64)))
    with pytest.raises(IndexError):
        source.example(20)


def test_a_token_file_is_memory_mapped_not_read_whole(tmp_path):
    source = open_data_file(_bin(tmp_path, _tokens(1000, "uint16")), tmp_path)
    assert isinstance(source._tokens, np.memmap)
    source = open_data_file(_npy(tmp_path, _tokens(1000, "int32")), tmp_path)
    assert isinstance(source._tokens, np.memmap)


def test_exactly_one_window_is_one_example(tmp_path):
    source = open_data_file(_bin(tmp_path, _tokens(WINDOW + 1, "uint16")), tmp_path)
    assert len(source) == 1


def test_tensor_examples_are_exactly_the_rows(tmp_path):
    tensors = {**_images(), "mask": torch.rand(10, 2) > 0.5, "half": torch.randn(10).bfloat16()}
    source = open_data_file(_tensors(tmp_path, tensors), tmp_path)
    assert isinstance(source, TensorFile) and len(source) == 10
    for i in range(10):
        example = source.example(i)
        assert sorted(example) == sorted(tensors)
        for name, t in tensors.items():
            assert example[name].dtype == t.dtype and torch.equal(example[name], t[i])
    example = source.example(3)
    example["label"].fill_(-1)  # an example is the caller's own copy
    assert torch.equal(source.example(3)["label"], tensors["label"][3])


@pytest.mark.parametrize("write", [_bin, _npy])
def test_the_commitment_of_a_token_file_is_that_of_the_same_windows_in_memory(tmp_path, write):
    tokens = _tokens(8 * 13 + 1, "uint16")
    source = open_data_file(write(tmp_path, tokens), tmp_path)
    assert commit_dataset(source)[0] == commit_dataset(_windows(tokens, WINDOW))[0]
    assert commit_examples(source)[0] == commit_dataset(source)[0]


def test_uint16_and_int32_files_of_the_same_ids_commit_alike(tmp_path):
    tokens = _tokens(100, "uint16")
    a = open_data_file(_bin(tmp_path, tokens, "a.bin"), tmp_path)
    b = open_data_file(_bin(tmp_path, tokens.astype("int32"), "b.bin"), tmp_path)
    assert commit_dataset(a)[0] == commit_dataset(b)[0]  # the examples are int64 either way


def test_the_commitment_of_a_tensor_file_is_that_of_the_same_rows_in_memory(tmp_path):
    tensors = _images(12)
    source = open_data_file(_tensors(tmp_path, tensors), tmp_path)
    reference = ListSource({name: t[i] for name, t in tensors.items()} for i in range(12))
    assert commit_dataset(source)[0] == commit_dataset(reference)[0]
    assert commit_dataset(source)[0].count == 12


def test_a_remembered_commitment_is_forgotten_when_the_file_changes(tmp_path):
    tokens = _tokens(200, "uint16")
    descriptor = _bin(tmp_path, tokens)
    first = commit_examples(open_data_file(descriptor, tmp_path))[0]
    assert commit_examples(open_data_file(descriptor, tmp_path))[0] == first
    changed = tokens.copy()
    changed[5] += 1
    changed.tofile(tmp_path / descriptor.path)
    stat = (tmp_path / descriptor.path).stat()
    os.utime(tmp_path / descriptor.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again = commit_examples(open_data_file(descriptor, tmp_path))[0]
    assert again != first and again == commit_dataset(_windows(changed, WINDOW))[0]


def test_npy_token_dtype_is_read_from_the_header(tmp_path):
    np.save(tmp_path / "a.npy", _tokens(50, "int32"))
    assert npy_token_dtype(tmp_path / "a.npy", "data file 'a.npy'") == "int32"


# ---- every bad file: a ConfigError naming the file and the problem ---------------------------

def _write_bytes(name: str, data: bytes):
    def make(tmp_path: Path) -> str:
        (tmp_path / name).write_bytes(data)
        return name
    return make


def _save_npy(name: str, array: np.ndarray, cut: int = 0):
    def make(tmp_path: Path) -> str:
        np.save(tmp_path / name, array)
        if cut:
            data = (tmp_path / name).read_bytes()
            (tmp_path / name).write_bytes(data[:-cut])
        return name
    return make


def _npz_as_npy(tmp_path: Path) -> str:
    with zipfile.ZipFile(tmp_path / "z.npy", "w") as archive:
        archive.writestr("arr_0.npy", b"")
    return "z.npy"


def _directory(tmp_path: Path) -> str:
    (tmp_path / "dir.bin").mkdir()
    return "dir.bin"


NPY_HEADER = np.lib.format.magic(1, 0) + b"\x20\x00" + b"{'descr': '<u2', 'fortran_"


@pytest.mark.parametrize("make, dtype, problem", [
    (lambda tmp: "missing.bin", "uint16", "does not exist"),
    (lambda tmp: "missing.npy", "uint16", "does not exist"),
    (_directory, "uint16", "not a regular file"),
    (_write_bytes("odd.bin", b"\x01\x00\x02"), "uint16", "is truncated: 3 bytes is not a whole "
                                                         "number of uint16"),
    (_write_bytes("odd32.bin", b"\x00" * 42), "int32", "is truncated: 42 bytes"),
    (_write_bytes("empty.bin", b""), "uint16", "holds 0 tokens, fewer than one window of 9"),
    (_write_bytes("short.bin", b"\x00\x00" * 8), "uint16", "holds 8 tokens, fewer than one "
                                                           "window of 9"),
    (_write_bytes("neg.bin", np.array([1] * 20 + [-7] + [2] * 9, "<i4").tobytes()), "int32",
     "token id -7 at position 20 is negative"),
    (_write_bytes("garbage.npy", b"not an npy file at all, no magic"), "uint16",
     "not a valid .npy file"),
    (_write_bytes("empty.npy", b""), "uint16", "not a valid .npy file"),
    (_write_bytes("header.npy", NPY_HEADER), "uint16", "not a valid .npy file"),
    (_save_npy("trunc.npy", np.arange(100, dtype="<u2"), cut=3), "uint16",
     "not a valid .npy file"),
    (_save_npy("objects.npy", np.array([1, "a"], dtype=object)), "uint16",
     "not a valid .npy file"),
    (_npz_as_npy, "uint16", "not a .npy array file"),
    (_save_npy("float.npy", np.arange(100, dtype="<f4")), "uint16", "dtype '<f4'"),
    (_save_npy("int64.npy", np.arange(100, dtype="<i8")), "uint16", "dtype '<i8'"),
    (_save_npy("big.npy", np.arange(100, dtype=">u2")), "uint16", "dtype '>u2'"),
    (_save_npy("matrix.npy", np.zeros((10, 10), dtype="<u2")), "uint16",
     "shape (10, 10); a token file is 1-D"),
    (_save_npy("few.npy", np.zeros(5, dtype="<u2")), "uint16", "holds 5 tokens"),
    (_save_npy("other.npy", np.zeros(50, dtype="<i4")), "uint16",
     "holds int32 token ids, not the uint16 this job names"),
    (_save_npy("neg.npy", np.array([3] * 30 + [-1], dtype="<i4")), "int32",
     "token id -1 at position 30 is negative"),
])
def test_bad_token_files_explain_themselves(tmp_path, make, dtype, problem):
    name = make(tmp_path)
    with pytest.raises(ConfigError, match=f"data file '{name}'") as caught:
        open_data_file(DataFile("tokens", name, dtype, WINDOW), tmp_path)
    assert problem in str(caught.value)
    assert "\n" not in str(caught.value)


def _save_st(name: str, tensors: dict, cut: int = 0):
    def make(tmp_path: Path) -> str:
        data = safetensors.torch.save(tensors)
        (tmp_path / name).write_bytes(data[:len(data) - cut])
        return name
    return make


@pytest.mark.parametrize("make, problem", [
    (lambda tmp: "missing.safetensors", "does not exist"),
    (_directory, "not a regular file"),
    (_write_bytes("garbage.safetensors", b"\xff" * 64), "not a usable safetensors file"),
    (_write_bytes("empty.safetensors", b""), "not a usable safetensors file"),
    (_save_st("trunc.safetensors", _images(), cut=5), "not a usable safetensors file"),
    (_save_st("u16.safetensors", {"x": torch.zeros(4, 2, dtype=torch.uint16)}),
     "not a usable safetensors file"),
    (_save_st("none.safetensors", {}), "holds no tensors"),
    (_save_st("scalar.safetensors", {"x": torch.zeros(4), "s": torch.tensor(1.0)}),
     "tensor 's' is a scalar"),
    (_save_st("mismatch.safetensors", {"image": torch.zeros(10, 3), "label": torch.zeros(9)}),
     "disagree on the number of examples (their first dimensions: image 10, label 9)"),
    (_save_st("zero.safetensors", {"image": torch.zeros(0, 3), "label": torch.zeros(0)}),
     "holds 0 examples"),
])
def test_bad_tensor_files_explain_themselves(tmp_path, make, problem):
    name = make(tmp_path)
    with pytest.raises(ConfigError, match=f"data file '{name}'") as caught:
        open_data_file(DataFile("tensors", name), tmp_path)
    assert problem in str(caught.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
@pytest.mark.parametrize("descriptor", [DataFile("tokens", "locked.bin", "uint16", WINDOW),
                                        DataFile("tokens", "locked.npy", "uint16", WINDOW),
                                        DataFile("tensors", "locked.safetensors")])
def test_an_unreadable_file_explains_itself(tmp_path, descriptor):
    if descriptor.path.endswith(".npy"):
        np.save(tmp_path / descriptor.path, _tokens(100, "uint16"))
    elif descriptor.path.endswith(".bin"):
        _tokens(100, "uint16").tofile(tmp_path / descriptor.path)
    else:
        (tmp_path / descriptor.path).write_bytes(safetensors.torch.save(_images()))
    (tmp_path / descriptor.path).chmod(0)
    with pytest.raises(ConfigError, match=f"data file '{descriptor.path}'"):
        open_data_file(descriptor, tmp_path)


def test_the_absent_dataset_has_the_count_and_refuses_to_be_read():
    absent = AbsentExamples(DataFile("tensors", "train.safetensors"), 77)
    assert len(absent) == 77
    with pytest.raises(ConfigError, match="data file 'train.safetensors' is not read here"):
        absent.example(0)


# ---- the program's fields ---------------------------------------------------------------------

@pytest.mark.parametrize("theirs, problem", [
    ({"img": torch.zeros(3, 4, 4), "label": torch.tensor(1)}, "has the fields ['img', 'label']"),
    ({"image": torch.zeros(3, 4, 4), "label": torch.tensor(1, dtype=torch.int32)},
     "field 'label' is int32; the program's examples have int64"),
    ({"image": torch.zeros(3, 4, 4, dtype=torch.float64), "label": torch.tensor(1)},
     "field 'image' is float64"),
    ({"image": torch.zeros(3, 8, 8), "label": torch.tensor(1)},
     "field 'image' has shape (3, 8, 8) per example; the program's examples have (3, 4, 4)"),
])
def test_examples_with_other_fields_than_the_programs_are_refused(theirs, problem):
    ours = ListSource([{"image": torch.zeros(3, 4, 4), "label": torch.tensor(2)}])
    with pytest.raises(ConfigError, match="data file 'x'") as caught:
        require_same_fields(ListSource([theirs]), ours, "data file 'x'")
    assert problem in str(caught.value)
    require_same_fields(ours, ours, "data file 'x'")
    require_same_fields(ListSource([theirs]), ListSource([]), "data file 'x'")  # nothing to hold


# ---- the descriptor ---------------------------------------------------------------------------

GOOD = [DataFile("tokens", "data/train.bin", "uint16", 256),
        DataFile("tokens", "train.npy", "int32", 1),
        DataFile("tensors", "a/b/c.safetensors")]


@pytest.mark.parametrize("descriptor", GOOD)
def test_the_descriptor_round_trips_through_its_canonical_body(descriptor):
    body = decode(encode(descriptor.to_body()))
    assert DataFile.from_body(body) == descriptor


@pytest.mark.parametrize("body", [
    {"kind": "tokens", "path": "t.bin", "dtype": "uint16", "window": True},
    {"kind": "tokens", "path": "t.bin", "dtype": "uint16", "window": 8.0},
    {"kind": "tokens", "path": "t.bin", "dtype": "uint16", "window": 0},
    {"kind": "tokens", "path": "t.bin", "dtype": "uint16"},
    {"kind": "tokens", "path": "t.bin", "dtype": "uint16", "window": 8, "extra": 1},
    {"kind": "tokens", "path": "t.bin", "dtype": b"uint16", "window": 8},
    {"kind": "tokens", "path": "t.bin", "dtype": "int64", "window": 8},
    {"kind": "tokens", "path": "t.txt", "dtype": "uint16", "window": 8},
    {"kind": "tensors", "path": "t.safetensors", "dtype": None, "window": None},
    {"kind": "tensors", "path": b"t.safetensors"},
    {"kind": "images", "path": "t.safetensors"},
    {"path": "t.safetensors"},
    {"kind": "tensors", "path": "../t.safetensors"},
    {"kind": "tensors", "path": "/etc/t.safetensors"},
    {"kind": "tensors", "path": "./t.safetensors"},
    {"kind": "tensors", "path": "a//t.safetensors"},
    {"kind": "tensors", "path": "a/"},
    {"kind": "tensors", "path": "."},
    {"kind": "tensors", "path": ""},
    {"kind": "tensors", "path": "a\\..\\..\\t"},
    {"kind": "tensors", "path": "a\0b"},
    {"kind": "tensors", "path": "x" * 1025},
    ["tensors", "t.safetensors"],
])
def test_bad_descriptor_bodies_are_refused(body):
    with pytest.raises(EncodingError):
        DataFile.from_body(body)


@pytest.mark.parametrize("given, normal", [("./data//train.bin", "data/train.bin"),
                                           ("data/./train.bin", "data/train.bin"),
                                           ("train.bin", "train.bin")])
def test_a_job_files_path_is_put_in_normal_form(given, normal):
    assert normal_path(given) == normal


@pytest.mark.parametrize("given", ["/abs/train.bin", "../train.bin", "data/../../train.bin",
                                   "", ".", 3])
def test_a_job_files_path_must_stay_inside_its_folder(given):
    with pytest.raises(ConfigError):
        normal_path(given)


# ---- the data folder: nothing outside it is read ---------------------------------------------

def test_a_symbolic_link_out_of_the_data_folder_is_refused(tmp_path):
    outside, folder = tmp_path / "outside", tmp_path / "data"
    outside.mkdir()
    folder.mkdir()
    _tokens(100, "uint16").tofile(outside / "secret.bin")
    (folder / "train.bin").symlink_to(outside / "secret.bin")
    (folder / "sub").symlink_to(outside, target_is_directory=True)
    for path in ("train.bin", "sub/secret.bin"):
        with pytest.raises(ConfigError, match="leads outside the data directory"):
            open_data_file(DataFile("tokens", path, "uint16", WINDOW), folder)


def test_a_symbolic_link_inside_the_data_folder_is_followed(tmp_path):
    tokens = _tokens(100, "uint16")
    tokens.tofile(tmp_path / "real.bin")
    (tmp_path / "link.bin").symlink_to("real.bin")
    source = open_data_file(DataFile("tokens", "link.bin", "uint16", WINDOW), tmp_path)
    assert commit_dataset(source)[0] == commit_dataset(_windows(tokens, WINDOW))[0]


def test_a_symbolic_link_loop_is_refused(tmp_path):
    (tmp_path / "a.bin").symlink_to("b.bin")
    (tmp_path / "b.bin").symlink_to("a.bin")
    with pytest.raises(ConfigError, match="data file 'a.bin'"):
        open_data_file(DataFile("tokens", "a.bin", "uint16", WINDOW), tmp_path)


def test_a_missing_data_folder_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot resolve it in the data directory"):
        resolve_data_path(tmp_path / "nowhere", "train.bin")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="is not a directory"):
        resolve_data_path(tmp_path / "file", "train.bin")


@pytest.mark.parametrize("path", ["../x.bin", "/etc/passwd", "a/../../x.bin"])
def test_resolving_refuses_a_path_out_of_the_folder(tmp_path, path):
    with pytest.raises(ConfigError):
        resolve_data_path(tmp_path, path)
