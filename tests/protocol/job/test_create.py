"""protocol.job.create.require_model_size: a peer's spec is bounded before its model is built."""

from __future__ import annotations

import dataclasses

import pytest

from protocol.engine.precision import PrecisionPolicy
from protocol.engine.programs.registry import parameter_count
from protocol.errors import ResourceLimitError
from protocol.job.create import build_job, require_model_size

USER_PROGRAM = "tests.protocol.engine.programs.user_program_example:build"
TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}


@pytest.fixture(scope="module")
def spec():
    spec, _ = build_job(program="image-cnn", config=TINY, preset=None, steps=2, seed=0,
                        init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=1,
                        commit_interval=2)
    return spec


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
