"""Job specs (SPEC §2 "JobSpec") and the `ovt keygen` / `ovt job ...` commands."""

from __future__ import annotations

import textwrap

import pytest

from protocol.cli.main import main
from protocol.codec.canonical import PROTOCOL_VERSION, decode, encode
from protocol.errors import ConfigError, EncodingError, ProgramError
from protocol.job.create import create_job, load_job_program
from protocol.job.spec import JobSpec

JOB_TOML = """
program = "image-cnn"
steps = 6
seed = 3
init_seed = 1
checkpoint_interval = 4
commit_interval = 3
[config]
image_size = 8
channels = 4
batch_size = 8
dataset_size = 64
"""


@pytest.fixture
def job_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(JOB_TOML)
    return path


def test_create_is_deterministic_and_round_trips(job_file):
    spec, state0 = create_job(job_file)
    again, _ = create_job(job_file)
    assert spec.job_id == again.job_id
    assert JobSpec.from_bytes(spec.to_bytes()) == spec
    assert spec.steps == 6 and spec.seed == 3 and spec.data.count == 64
    assert spec.config["image_size"] == 8
    assert int(state0["step"]) == 0


def test_job_id_binds_every_field(job_file, tmp_path):
    spec, _ = create_job(job_file)
    other = tmp_path / "other.toml"
    other.write_text(JOB_TOML.replace("seed = 3", "seed = 4"))
    assert create_job(other)[0].job_id != spec.job_id


@pytest.mark.parametrize("mutate", [
    lambda b: {**b, "steps": 0},
    lambda b: {**b, "extra": 1},
    lambda b: {**b, "h0": b"short"},
    lambda b: {**b, "protocol_version": 99},
    lambda b: {**b, "precision": {**b["precision"], "target": "float16"}},
    lambda b: {k: v for k, v in b.items() if k != "seed"},
])
def test_bad_specs_are_rejected(job_file, mutate):
    spec, _ = create_job(job_file)
    with pytest.raises(EncodingError):
        JobSpec.from_bytes(encode(mutate(spec.to_body())))


@pytest.mark.parametrize("alias", [float(PROTOCOL_VERSION)])
def test_aliased_protocol_version_is_refused(job_file, alias):
    """Finding 3 (issue 10): these bytes hash to another job id X, yet decoded to the real job
    Y (whose to_bytes and job_id are Y's), so an auditor asked to audit X replayed into Y's
    store."""
    spec, _ = create_job(job_file)
    aliased = encode({**spec.to_body(), "protocol_version": alias})
    assert aliased != spec.to_bytes() and decode(aliased) == spec.to_body()  # equal, not same
    with pytest.raises(EncodingError):
        JobSpec.from_bytes(aliased)


@pytest.mark.parametrize("mutate", [
    lambda b: {**b, "data": {**b["data"], "extra": 1}},
    lambda b: {**b, "precision": {**b["precision"], "extra": 1}},
])
def test_unknown_nested_fields_are_refused(job_file, mutate):
    spec, _ = create_job(job_file)
    with pytest.raises(EncodingError, match="does not re-encode to its own bytes"):
        JobSpec.from_bytes(encode(mutate(spec.to_body())))


def test_random_bytes_are_rejected_as_encoding_errors(job_file):
    spec, _ = create_job(job_file)
    data = spec.to_bytes()
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(EncodingError):
            JobSpec.from_bytes(data[:cut])
    assert decode(data) == spec.to_body()


@pytest.mark.parametrize("text, message", [
    ("steps = 3", "at least 'program' and 'steps'"),
    ('program = "image-cnn"\nsteps = 0', "steps must be an integer >= 1"),
    ('program = "image-cnn"\nsteps = 2\ncolour = 1', "unknown keys in job file: colour"),
    ('program = "image-cnn"\nsteps = 2\n[precision]\ntarget = "float8"', "unknown dtype"),
    ('program = "image-cnn"\nsteps = [', "not valid TOML"),
])
def test_bad_job_files_explain_themselves(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        create_job(path)


def test_changed_program_source_is_detected(tmp_path):
    program = tmp_path / "my_program.py"
    program.write_text(textwrap.dedent("""
        from protocol.engine.programs import image_cnn
        def build(config):
            return image_cnn.build({"image_size": 8, "channels": 4, "batch_size": 8,
                                    "dataset_size": 64, **config})
    """))
    path = tmp_path / "job.toml"
    path.write_text(f'program = "{program}:build"\nsteps = 2\n')
    spec, _ = create_job(path)
    load_job_program(spec)  # unchanged: loads
    program.write_text(program.read_text() + "\n# a change\n")
    with pytest.raises(ProgramError, match="differs from the one this job committed to"):
        load_job_program(spec)


def test_cli_keygen_create_show_run_audit(job_file, tmp_path, capsys):
    assert main(["keygen", "--out", str(tmp_path / "t.key")]) == 0
    assert main(["keygen", "--out", str(tmp_path / "a.key")]) == 0
    assert main(["keygen", "--out", str(tmp_path / "a.key")]) == 2  # refuses to overwrite
    spec_path = tmp_path / "job.ovtjob"
    assert main(["job", "create", str(job_file), "--out", str(spec_path)]) == 0
    assert (tmp_path / "job.s0.safetensors").exists()
    assert main(["job", "show", str(spec_path), "--json"]) == 0
    shown = capsys.readouterr().out
    job_id = JobSpec.from_bytes(spec_path.read_bytes()).job_id.hex()
    assert job_id in shown
    assert main(["job", "run", str(spec_path), "--store", str(tmp_path / "ts"),
                 "--key", str(tmp_path / "t.key")]) == 0
    assert main(["job", "audit", str(spec_path), "--trainer-store", str(tmp_path / "ts"),
                 "--store", str(tmp_path / "as"), "--key", str(tmp_path / "a.key"),
                 "--profile", "emulated-gpu"]) == 0
    assert "MATCHES" in capsys.readouterr().out


def test_cli_job_errors_are_one_line(tmp_path, capsys):
    assert main(["job", "show", str(tmp_path / "missing.ovtjob")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ovt: error: cannot read job spec") and err.count("\n") == 1
    (tmp_path / "garbage.ovtjob").write_bytes(b"\x00\x01garbage")
    assert main(["job", "show", str(tmp_path / "garbage.ovtjob")]) == 2
