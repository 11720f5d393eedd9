"""Data commitment (SPEC §2.1): a batch's examples verify against the root with their proofs;
a relabelled or swapped example, or a batch for other indices, does not."""

from __future__ import annotations

import pytest
import torch

from protocol.commit.data import ProvenExample, commit_dataset, prove_examples, verify_examples
from protocol.engine.batches import batch_indices
from protocol.engine.programs.registry import load_program
from protocol.errors import ProofError, RootMismatchError

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}


@pytest.fixture(scope="module")
def committed():
    source = load_program("image-cnn", TINY).dataset
    commitment, tree = commit_dataset(source)
    return source, commitment, tree


def test_commitment_is_deterministic(committed):
    source, commitment, _ = committed
    again, _ = commit_dataset(load_program("image-cnn", TINY).dataset)
    assert again == commitment and commitment.count == len(source) == 64


def test_a_batch_verifies(committed):
    source, commitment, tree = committed
    indices = batch_indices(0, len(source), 8, step=3)
    verify_examples(commitment, prove_examples(source, tree, indices), indices)


def test_a_relabelled_example_is_rejected(committed):
    source, commitment, tree = committed
    indices = batch_indices(0, len(source), 8, step=3)
    items = prove_examples(source, tree, indices)
    poisoned = dict(items[2].example, label=(items[2].example["label"] + 1) % 10)
    items[2] = ProvenExample(items[2].index, poisoned, items[2].proof)
    with pytest.raises(RootMismatchError):
        verify_examples(commitment, items, indices)


def test_a_swapped_image_is_rejected(committed):
    source, commitment, tree = committed
    indices = batch_indices(0, len(source), 8, step=1)
    items = prove_examples(source, tree, indices)
    other = source.example(int(indices[0]) ^ 1)
    assert not torch.equal(other["image"], items[0].example["image"])
    items[0] = ProvenExample(items[0].index, {**items[0].example, "image": other["image"]},
                             items[0].proof)
    with pytest.raises(RootMismatchError):
        verify_examples(commitment, items, indices)


def test_examples_for_other_indices_are_rejected(committed):
    source, commitment, tree = committed
    indices = batch_indices(0, len(source), 8, step=2)
    items = prove_examples(source, tree, indices)
    with pytest.raises(ProofError, match="expected"):
        verify_examples(commitment, items[::-1], indices)
    with pytest.raises(ProofError):
        verify_examples(commitment, items[:-1], indices)
