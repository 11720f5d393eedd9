"""Decoder fuzz targets (issue 10): one per decoder of untrusted bytes (`bench.fuzz_decoders.
TARGETS`). The only allowed outcomes: the project's own error (an `OvtError` subclass), or an
object that re-encodes to exactly its input (for safetensors, which has no canonical form: a
state of state dtypes that survives a save and a load). Each target gets random bytes, every
single edit of its real objects' bytes (each field swapped for an alias or a value of another
type and re-encoded canonically, edge integers at every position of a binary layout), and
random mutations from the bench's mutator, bounded to 200 inputs per target and kind;
`python bench/fuzz_decoders.py` runs the same targets for 50,000 random inputs each."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz_decoders import TARGETS, Target, is_allowed, outcome, random_input, single_edits

BOUNDED = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BY_NAME = {t.name: t for t in TARGETS}


def test_there_is_a_target_per_untrusted_decoder():
    assert list(BY_NAME) == ["canonical", "state", "safetensors", "safetensors-file", "log",
                             "job-spec", "signed-commitment", "claim", "challenge",
                             "transcript", "verdict", "evidence-examples"]


@pytest.mark.parametrize("target", TARGETS, ids=BY_NAME)
def test_every_seed_decodes_to_itself(target: Target):
    """The mutations start from real objects' bytes, which must decode (else the target
    fuzzes nothing but the first check)."""
    seeds = target.seeds()
    assert [outcome(target, seed) for seed in seeds] == ["decoded"] * len(seeds)


@pytest.mark.parametrize("target", TARGETS, ids=BY_NAME)
def test_every_single_edit_is_refused_or_decodes_to_itself(target: Target):
    results = [outcome(target, data) for data in single_edits(target)]
    assert len(results) > 100
    assert [r for r in results if not is_allowed(r)][:3] == []


@pytest.mark.parametrize("target", TARGETS, ids=BY_NAME)
@BOUNDED
@given(data=st.binary(max_size=512))
def test_random_bytes_are_refused_or_decode_to_themselves(target: Target, data: bytes):
    result = outcome(target, data)
    assert is_allowed(result), result


@pytest.mark.parametrize("target", TARGETS, ids=BY_NAME)
@BOUNDED
@given(seed=st.integers(0, 2**64))
def test_random_mutations_are_refused_or_decode_to_themselves(target: Target, seed: int):
    data = random_input(random.Random(seed), target.seeds(), target.layout)
    result = outcome(target, data)
    assert is_allowed(result), result
