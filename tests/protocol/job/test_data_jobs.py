"""Jobs on a user's data file (a job file's [data] section, protocol/engine/datasets.py): the
spec commits to the file's examples like to a built-in's; a node reads the file only inside the
data folder its operator offers, and only if it is the committed one; the arbiter never reads
it, and re-execution still checks each example against the commitment (SPEC §2.1, §5.3)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from protocol.cli.main import main
from protocol.codec.canonical import encode
from protocol.commit.data import ProvenExample, commit_dataset, prove_examples
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.dispute.game import Dispute
from protocol.dispute.reexecute import reexecute
from protocol.engine.batches import batch_indices
from protocol.engine.datasets import AbsentExamples, DataFile, TensorFile, TokenFile
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError, EncodingError
from protocol.job.create import create_job, job_executor, load_job_program
from protocol.job.run import run_job
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore
from tests.protocol.engine.test_datasets import ListSource

SEQ_LEN = 16  # token-lm's "test" preset
TOKENS = SEQ_LEN * 40 + 1  # 40 windows
TOKEN_JOB = """
program = "token-lm"
preset = "test"
steps = 3
checkpoint_interval = 2
commit_interval = 3
[data]
kind = "tokens"
path = "data/train.bin"
dtype = "uint16"
window = 16
"""
IMAGES = 32
TENSOR_JOB = """
program = "image-cnn"
steps = 3
checkpoint_interval = 2
commit_interval = 3
[config]
image_size = 8
channels = 4
batch_size = 8
[data]
kind = "tensors"
path = "images.safetensors"
"""




def _token_ids(n: int = TOKENS, dtype: str = "uint16") -> np.ndarray:
    return np.random.default_rng(0).integers(0, 512, n).astype(dtype)  # token-lm test: 512 ids


def _images(n: int = IMAGES, label_dtype=torch.int64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"image": torch.randn(n, 3, 8, 8, generator=gen),
            "label": torch.randint(0, 10, (n,), generator=gen).to(label_dtype)}


def _token_job(folder: Path, text: str = TOKEN_JOB, tokens: np.ndarray | None = None) -> Path:
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (_token_ids() if tokens is None else tokens).tofile(folder / "data" / "train.bin")
    (folder / "job.toml").write_text(text)
    return folder / "job.toml"


def _tensor_job(folder: Path, text: str = TENSOR_JOB, tensors: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images.safetensors").write_bytes(
        safetensors.torch.save(_images() if tensors is None else tensors))
    (folder / "job.toml").write_text(text)
    return folder / "job.toml"


@pytest.fixture
def token_job(tmp_path) -> tuple[JobSpec, dict, Path]:
    job_file = _token_job(tmp_path / "job")
    spec, state0 = create_job(job_file)
    return spec, state0, job_file.parent


# ---- creating a job on a file -----------------------------------------------------------------

def test_a_token_job_commits_to_the_files_windows(token_job):
    spec, _, _ = token_job
    assert spec.data_file == DataFile("tokens", "data/train.bin", "uint16", SEQ_LEN)
    ids = _token_ids()
    windows = ListSource({"tokens": torch.from_numpy(
        ids[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1].astype(np.int64))} for i in range(40))
    assert spec.data == commit_dataset(windows)[0]
    assert JobSpec.from_bytes(spec.to_bytes()) == spec


def test_a_npy_token_files_dtype_comes_from_its_header(tmp_path):
    folder = tmp_path / "job"
    (folder / "data").mkdir(parents=True)
    np.save(folder / "data" / "train.npy", _token_ids(dtype="int32"))
    text = TOKEN_JOB.replace("train.bin", "train.npy").replace('dtype = "uint16"\n', "")
    (folder / "job.toml").write_text(text)
    spec, _ = create_job(folder / "job.toml")
    assert spec.data_file == DataFile("tokens", "data/train.npy", "int32", SEQ_LEN)
    (folder / "job.toml").write_text(text + 'dtype = "uint16"\n')
    with pytest.raises(ConfigError, match="dtype is 'uint16', but data file 'data/train.npy'"):
        create_job(folder / "job.toml")


def test_a_tensor_job_commits_to_the_files_rows(tmp_path):
    spec, _ = create_job(_tensor_job(tmp_path / "job"))
    assert spec.data_file == DataFile("tensors", "images.safetensors")
    images = _images()
    rows = ListSource({name: t[i] for name, t in images.items()} for i in range(IMAGES))
    assert spec.data == commit_dataset(rows)[0] and spec.data.count == IMAGES


def test_the_job_id_binds_the_data_file(tmp_path):
    a, _ = create_job(_token_job(tmp_path / "a"))
    ids = _token_ids()
    ids[3] += 1
    b, _ = create_job(_token_job(tmp_path / "b", tokens=ids))
    c, _ = create_job(_token_job(tmp_path / "c", TOKEN_JOB.replace('"data/train.bin"',
                                                                   '"./data//train.bin"')))
    assert a.data != b.data and a.job_id != b.job_id
    assert c == a  # the path is kept in normal form


@pytest.mark.parametrize("section, message", [
    ('[data]\nkind = "images"\npath = "x"', "kind must be one of tokens, tensors"),
    ('[data]\nkind = ["tokens"]\npath = "x"', "kind must be one of tokens, tensors"),
    ('[data]\nkind = "tensors"\npath = 7', "[data] path must be a non-empty string, got int 7"),
    ('[data]\nkind = "tensors"\npath = "images.safetensors"\nwindow = 3',
     "unknown keys in [data] of kind 'tensors': window"),
    ('[data]\nkind = "tensors"', "[data] needs a path"),
    ('[data]\nkind = "tensors"\npath = "/etc/images.safetensors"', "must be relative"),
    ('[data]\nkind = "tensors"\npath = "../images.safetensors"', "normal form"),
    ('[data]\nkind = "tokens"\npath = "t.bin"\nwindow = 16', "dtype is needed for a .bin"),
    ('[data]\nkind = "tokens"\npath = "t.bin"\ndtype = "uint16"', "needs a window"),
    ('[data]\nkind = "tokens"\npath = "t.bin"\ndtype = "int64"\nwindow = 16',
     "dtype must be one of uint16, int32"),
    ('[data]\nkind = "tokens"\npath = "t.bin"\ndtype = "uint16"\nwindow = 0',
     "window must be an integer >= 1"),
    ('[data]\nkind = "tokens"\npath = "t.txt"\ndtype = "uint16"\nwindow = 16',
     "a .bin or a .npy file"),
    ('[data]\nkind = "tensors"\npath = "missing.safetensors"', "does not exist"),
])
def test_bad_data_sections_explain_themselves(tmp_path, section, message):
    job_file = _tensor_job(tmp_path / "job", TENSOR_JOB.split("[data]")[0] + section)
    with pytest.raises(ConfigError) as caught:
        create_job(job_file)
    assert message in str(caught.value)


def test_a_data_key_that_is_no_section_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"\[data\] must be a dict, got 3"):
        create_job(_tensor_job(tmp_path / "job", "data = 3\n" + TENSOR_JOB.split("[data]")[0]))


def test_a_file_whose_examples_the_program_cannot_read_is_refused(tmp_path):
    wrong_window = TOKEN_JOB.replace("window = 16", "window = 8")
    with pytest.raises(ConfigError, match=r"field 'tokens' has shape \(9,\) per example; the "
                                          r"program's examples have \(17,\)"):
        create_job(_token_job(tmp_path / "a", wrong_window))
    with pytest.raises(ConfigError, match="field 'label' is int32; the program's examples have "
                                          "int64"):
        create_job(_tensor_job(tmp_path / "b", tensors=_images(label_dtype=torch.int32)))
    images_for_a_language_model = TOKEN_JOB.split("[data]")[0] + \
        '[data]\nkind = "tensors"\npath = "images.safetensors"\n'
    with pytest.raises(ConfigError, match=r"has the fields \['image', 'label'\]; the program's "
                                          r"examples have \['tokens'\]"):
        create_job(_tensor_job(tmp_path / "c", images_for_a_language_model))


def test_a_file_of_fewer_examples_than_a_batch_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="holds 7 examples, fewer than one batch of 8"):
        create_job(_tensor_job(tmp_path / "job", tensors=_images(7)))


def test_a_token_beyond_the_programs_vocabulary_is_refused_up_front(tmp_path):
    """An id out of range would fail inside the step (on CUDA as a device-side assert)."""
    ids = _token_ids()
    ids[100] = 512  # token-lm test: ids 0..511
    with pytest.raises(ConfigError, match="token id 512 at position 100 is beyond the "
                                          "program's vocabulary of 512"):
        create_job(_token_job(tmp_path / "job", tokens=ids))


def test_a_window_that_does_not_fit_is_refused_before_it_is_read(tmp_path):
    with pytest.raises(ConfigError, match=r"has shape \(33,\) per example; the program's "
                                          r"examples have \(17,\)"):
        create_job(_token_job(tmp_path / "job", TOKEN_JOB.replace("window = 16", "window = 32")))


# ---- the spec ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mutate", [
    lambda b: {**b, "data_file": {**b["data_file"], "window": True}},
    lambda b: {**b, "data_file": {**b["data_file"], "window": 16.0}},
    lambda b: {**b, "data_file": {**b["data_file"], "path": "../data/train.bin"}},
    lambda b: {**b, "data_file": {**b["data_file"], "path": "/data/train.bin"}},
    lambda b: {**b, "data_file": {**b["data_file"], "path": "./data/train.bin"}},
    lambda b: {**b, "data_file": {**b["data_file"], "extra": 1}},
    lambda b: {**b, "data_file": {k: v for k, v in b["data_file"].items() if k != "dtype"}},
    lambda b: {**b, "data_file": "data/train.bin"},
    lambda b: {k: v for k, v in b.items() if k != "data_file"},
])
def test_a_spec_with_a_bad_or_aliased_data_file_is_refused(token_job, mutate):
    spec, _, _ = token_job
    with pytest.raises(EncodingError):
        JobSpec.from_bytes(encode(mutate(spec.to_body())))


def test_a_spec_without_a_data_file_says_so_and_round_trips(tmp_path):
    (tmp_path / "job.toml").write_text(TENSOR_JOB.split("[data]")[0])
    spec, _ = create_job(tmp_path / "job.toml")
    assert spec.data_file is None and spec.to_body()["data_file"] is None
    assert JobSpec.from_bytes(spec.to_bytes()) == spec


# ---- loading on a node: only inside its data folder, only the committed file -----------------

def test_a_node_reads_the_file_inside_its_data_folder(token_job):
    spec, _, folder = token_job
    program = load_job_program(spec, folder)
    assert isinstance(program.dataset, TokenFile) and len(program.dataset) == spec.data.count
    ex = job_executor(spec, Profile.parse("cpu-2t"), folder)
    assert ex.program.dataset.example(0)["tokens"].shape == (SEQ_LEN + 1,)


def test_a_node_without_a_data_folder_refuses_a_data_job(token_job):
    spec, _, _ = token_job
    with pytest.raises(ConfigError, match=r"data file 'data/train.bin' of job .* this node was "
                                          r"given no data folder \(--data-dir\)"):
        load_job_program(spec)


def test_a_data_folder_without_the_file_is_refused(token_job, tmp_path):
    spec, _, _ = token_job
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not in the data folder"):
        load_job_program(spec, tmp_path / "empty")


def test_a_symbolic_link_out_of_the_data_folder_is_refused(token_job, tmp_path):
    spec, _, folder = token_job
    offered = tmp_path / "offered"
    (offered / "data").mkdir(parents=True)
    (offered / "data" / "train.bin").symlink_to(folder / "data" / "train.bin")
    with pytest.raises(ConfigError, match="leads outside the data directory"):
        load_job_program(spec, offered)
    (offered / "data" / "train.bin").unlink()
    (offered / "data").rmdir()
    (offered / "data").symlink_to(folder / "data", target_is_directory=True)
    with pytest.raises(ConfigError, match="leads outside the data directory"):
        load_job_program(spec, offered)


def test_a_data_file_changed_after_creation_is_refused(token_job):
    spec, _, folder = token_job
    ids = _token_ids()
    ids[100] = (ids[100] + 1) % 512
    ids.tofile(folder / "data" / "train.bin")
    with pytest.raises(ConfigError, match="data file 'data/train.bin' differs from the one this "
                                          "job committed to"):
        load_job_program(spec, folder)
    _token_ids()[:-SEQ_LEN].tofile(folder / "data" / "train.bin")  # one window fewer
    with pytest.raises(ConfigError, match="data file 'data/train.bin' holds 39 examples, but "
                                          "the job commits to 40"):  # counted before hashed
        load_job_program(spec, folder)


def test_a_data_file_rewritten_under_a_running_job_stops_it(token_job, tmp_path):
    """Reviewer finding: the file's commitment is remembered by its path, inode, size and
    modification time; a rewrite that keeps all four must still not be trained on (the trainer
    could not prove that batch and would lose its dispute): each batch is checked first."""
    spec, state0, folder = token_job
    store = JobStore(tmp_path / "trainer", dataclasses.replace(spec, steps=1))
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=Profile("cpu-1t"), data_dir=folder)  # step 1
    path = folder / "data" / "train.bin"
    before = path.stat()
    ((_token_ids().astype(np.int64) + 1) % 512).astype(np.uint16).tofile(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_ino == before.st_ino
    store = JobStore(tmp_path / "resumed", spec)
    store.put_initial(state0)
    with pytest.raises(ConfigError, match="changed under the job: step 1's batch is not the "
                                          "committed one"):
        run_job(store, KeyPair.generate(), profile=Profile("cpu-1t"), data_dir=folder)


def test_the_arbiter_loads_a_data_job_without_the_file(token_job, tmp_path):
    spec, _, folder = token_job
    shutil.rmtree(folder / "data")
    program = load_job_program(spec, examples=False)
    assert isinstance(program.dataset, AbsentExamples) and len(program.dataset) == 40
    with pytest.raises(ConfigError, match="is not read here"):
        program.dataset.example(0)


def test_a_tensor_job_loads_on_a_node(tmp_path):
    job_file = _tensor_job(tmp_path / "job")
    spec, _ = create_job(job_file)
    program = load_job_program(spec, job_file.parent)
    assert isinstance(program.dataset, TensorFile)
    assert torch.equal(program.dataset.example(5)["image"], _images()["image"][5])


# ---- run, audit and re-execute ----------------------------------------------------------------

def test_cli_create_run_audit_a_data_job(tmp_path, capsys):
    job_file = _token_job(tmp_path / "job")
    spec_path = tmp_path / "job.ovtjob"
    for role in ("t", "a"):
        assert main(["keygen", "--out", str(tmp_path / f"{role}.key")]) == 0
    assert main(["job", "create", str(job_file), "--out", str(spec_path)]) == 0
    capsys.readouterr()
    assert main(["job", "run", str(spec_path), "--store", str(tmp_path / "ts"),
                 "--key", str(tmp_path / "t.key")]) == 2
    assert "no data folder (--data-dir)" in capsys.readouterr().err
    assert not (tmp_path / "ts").exists()  # refused before a store was made
    data_dir = str(job_file.parent)
    assert main(["job", "run", str(spec_path), "--store", str(tmp_path / "ts"),
                 "--key", str(tmp_path / "t.key"), "--data-dir", data_dir]) == 0
    assert main(["job", "audit", str(spec_path), "--trainer-store", str(tmp_path / "ts"),
                 "--store", str(tmp_path / "as"), "--key", str(tmp_path / "a.key"),
                 "--profile", "emulated-gpu", "--data-dir", data_dir]) == 0
    assert "MATCHES" in capsys.readouterr().out


def test_reexecution_of_a_data_job_checks_examples_against_the_commitment(tmp_path):
    """The arbiter re-executes a step of a tensors job with the examples a party proved, the
    file itself nowhere on its disk; a doctored example is bad evidence."""
    job_file = _tensor_job(tmp_path / "job")
    spec, state0 = create_job(job_file)
    folder = job_file.parent
    store = JobStore(tmp_path / "store", spec)
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-2t"), data_dir=folder)
    program = load_job_program(spec, folder)
    _, tree = commit_dataset(program.dataset)
    step = 2
    indices = batch_indices(spec.seed, spec.data.count, program.batch_size, step)
    examples = prove_examples(program.dataset, tree, indices)
    prev = store.state_at(step - 1, job_executor(spec, Profile.parse("cpu-2t"), folder))
    log = store.log_bytes(step)
    trainer = store.leaf(step)
    dispute = Dispute(step, store.leaf(step - 1), trainer, Leaf(step, bytes(32),
                                                                trainer.log_hash))
    shutil.rmtree(folder)  # the arbiter has no data file
    arbiter = load_job_program(spec, examples=False)

    r = reexecute(spec, dispute, prev, examples, log, program=arbiter,
                  profile=Profile.parse("emulated-gpu"))
    assert r.finding == "computed", r.detail
    assert r.state_hash == trainer.state_hash

    first = examples[0]
    doctored = {**first.example, "label": (first.example["label"] + 1) % 10}
    forged = [dataclasses.replace(first, example=doctored), *examples[1:]]
    assert isinstance(forged[0], ProvenExample)
    r = reexecute(spec, dispute, prev, forged, log, program=arbiter,
                  profile=Profile.parse("emulated-gpu"))
    assert r.finding == "bad-evidence" and "not B_2 of the data commitment" in r.detail
