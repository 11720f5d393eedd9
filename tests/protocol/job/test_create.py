"""protocol.job.create: a peer's spec is bounded before its model is built
(`require_model_size`), and a job's program loads only with the examples its spec commits to
(`require_committed_data`, review 26 finding 3), a built-in's own dataset included."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest

from protocol.commit.data import DataCommitment, commit_dataset
from protocol.engine.datasets import DataFile
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.programs.registry import parameter_count
from protocol.errors import ConfigError, ResourceLimitError
from protocol.job.create import MAX_EXAMPLES, build_job, load_job_program, require_model_size

USER_PROGRAM = "tests.protocol.engine.programs.user_program_example:build"
TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}


def _build(**changes):
    return build_job(**{"program": "image-cnn", "config": TINY, "preset": None, "steps": 2,
                        "seed": 0, "init_seed": 1, "policy": PrecisionPolicy(),
                        "checkpoint_interval": 1, "commit_interval": 2, **changes})


@pytest.fixture(scope="module")
def spec():
    return _build()[0]


def test_a_built_in_model_within_the_bound_is_counted(spec):
    params = parameter_count(spec.program, spec.config)
    assert params is not None and params > 0
    assert require_model_size(spec, params) == params


def test_a_built_in_model_over_the_bound_is_refused_from_its_config_alone(spec):
    huge = dataclasses.replace(spec, config={**spec.config, "channels": 1024})
    params = parameter_count(huge.program, huge.config)
    with pytest.raises(ResourceLimitError, match=f"has {params} parameters"):
        require_model_size(huge, 2**20)


def test_a_user_program_is_not_counted(spec):
    user = dataclasses.replace(spec, program=USER_PROGRAM)
    assert require_model_size(user, 1) is None


# ---- the data commitment (SPEC §2.1) ----------------------------------------------------------


def _data(spec, root: bytes | None = None, count: int | None = None):
    return dataclasses.replace(spec, data=DataCommitment(
        spec.data.root if root is None else root, spec.data.count if count is None else count))


def test_a_built_in_job_loads_with_its_own_dataset(spec):
    assert len(load_job_program(spec).dataset) == spec.data.count == 64
    assert len(load_job_program(spec, examples=False).dataset) == 64


def test_a_built_in_job_committing_to_another_root_does_not_load(spec):
    """The attack: a spec on image-cnn's own data with another data root. Nobody could prove a
    batch of it; a node loading it with its examples refuses it, naming the dataset."""
    forged = _data(spec, root=b"\x11" * 32)
    with pytest.raises(ConfigError, match=r"^the dataset of program 'image-cnn' differs from the "
                                          r"one this job committed to \(its examples give root "
                                          r"[0-9a-f]{16}… over 64, the job's is "
                                          r"1111111111111111… over 64\)$"):
        load_job_program(forged)
    # without its examples (the arbiter), only the count is checked: B_i's proofs check the root
    assert len(load_job_program(forged, examples=False).dataset) == 64


@pytest.mark.parametrize("examples", [True, False])
def test_a_built_in_job_committing_to_another_count_does_not_load(spec, examples):
    with pytest.raises(ConfigError, match="^the dataset of program 'image-cnn' holds 64 "
                                          "examples, but the job commits to 65$"):
        load_job_program(_data(spec, count=65), examples=examples)


@pytest.mark.parametrize("data_file", [None, DataFile("tensors", "images.safetensors")],
                         ids=["built-in", "data-file"])
def test_an_absurd_data_count_is_refused_before_a_data_order_is_made(spec, data_file,
                                                                     monkeypatch):
    """The arbiter reads no data file: its B_i check makes the data order, a permutation of
    the spec's count, from the spec alone. A count over MAX_EXAMPLES is refused first."""
    monkeypatch.setattr("protocol.engine.rng.RandomStream.permutation",
                        lambda *a: pytest.fail("a data order was made"))
    absurd = dataclasses.replace(_data(spec, count=2**40), data_file=data_file)
    with pytest.raises(ConfigError, match=f"counts {2**40} examples; at most {MAX_EXAMPLES} "):
        load_job_program(absurd, examples=False)


def test_a_job_of_more_than_max_examples_is_not_created(monkeypatch):
    monkeypatch.setattr("protocol.job.create.MAX_EXAMPLES", 32)
    with pytest.raises(ConfigError, match="^the job's data counts 64 examples; at most 32 are "
                                          "taken"):
        _build()



def _counting_hashes(monkeypatch) -> list:
    """A fresh cache of datasets' commitments (`commit_examples`), and the datasets hashed
    from now on."""
    monkeypatch.setattr("protocol.engine.datasets._commitments", OrderedDict())
    hashed: list = []

    def counted(source):
        hashed.append(source)
        return commit_dataset(source)

    monkeypatch.setattr("protocol.engine.datasets.commit_dataset", counted)
    return hashed


def _sized(spec, size: int, root: bytes | None = None):
    """`spec` on image-cnn's dataset of `size` examples (committing to `root`, default the
    64-example one's: only right for 64)."""
    return _data(dataclasses.replace(spec, config={**spec.config, "dataset_size": size}),
                 root=root, count=size)


def test_a_built_in_jobs_dataset_is_hashed_once_and_a_forged_root_still_refused(spec,
                                                                                monkeypatch):
    """Review 30, finding B: every `load_job_program` of a built-in job hashed its whole
    dataset again, and a node loads a job for each state it regenerates (any peer may ask) and
    each escalation of a sampled audit. Its commitment is now hashed once per program and
    config; whether it is the spec's is still decided on every load, a forged root's first
    or not."""
    hashed = _counting_hashes(monkeypatch)
    forged = _data(spec, root=b"\x11" * 32)
    refused = "^the dataset of program 'image-cnn' differs from the one this job committed to"
    with pytest.raises(ConfigError, match=refused):
        load_job_program(forged)
    assert len(hashed) == 1
    for _ in range(2):
        assert len(load_job_program(spec).dataset) == 64
        with pytest.raises(ConfigError, match=refused):
            load_job_program(forged)
    other_job = dataclasses.replace(spec, steps=spec.steps + 1, seed=spec.seed + 1)
    assert len(load_job_program(other_job).dataset) == 64  # the same program and config
    assert len(hashed) == 1
    with pytest.raises(ConfigError, match="holds 64 examples, but the job commits to 65$"):
        load_job_program(_data(spec, count=65))  # the count is checked on every load
    with pytest.raises(ConfigError, match=refused):  # another config: another dataset
        load_job_program(_sized(spec, 72))
    assert len(hashed) == 2


def test_a_process_remembers_a_bounded_number_of_built_in_datasets(spec, monkeypatch):
    hashed = _counting_hashes(monkeypatch)
    monkeypatch.setattr("protocol.engine.datasets._CACHED_COMMITMENTS", 2)
    for size in (64, 72, 80, 64, 80):  # 64 is forgotten when 80 is remembered
        with pytest.raises(ConfigError, match="differs from the one this job committed to"):
            load_job_program(_sized(spec, size, root=b"\x11" * 32))
    assert [len(source) for source in hashed] == [64, 72, 80, 64]
