"""portable_init: torch's default distributions, from protocol.engine.rng only."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from protocol.engine.initialization import portable_init
from protocol.engine.rng import RandomStream
from protocol.errors import ProgramError


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.Conv1d(5, 4, 2, bias=False),
        nn.Embedding(7, 6, padding_idx=2), nn.LayerNorm(6), nn.Linear(6, 3), nn.GroupNorm(1, 3),
    )


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_matches_a_naive_reference_drawn_straight_from_the_streams():
    model = _model()
    portable_init(model, seed=11)

    def uniform(name: str, shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
        bound = 1.0 / math.sqrt(fan_in)
        return RandomStream(11, "init", name).uniform(shape, -bound, bound)

    assert torch.equal(model[0].weight, uniform("0.weight", (5, 3, 3, 3), 27))
    assert torch.equal(model[0].bias, uniform("0.bias", (5,), 27))
    assert torch.equal(model[2].weight, uniform("2.weight", (4, 5, 2), 10))
    assert torch.equal(model[5].weight, uniform("5.weight", (3, 6), 6))
    assert torch.equal(model[5].bias, uniform("5.bias", (3,), 6))
    embedding = RandomStream(11, "init", "3.weight").normal((7, 6))
    embedding[2] = 0
    assert torch.equal(model[3].weight, embedding)


def test_norm_layers_get_ones_zeros_and_fresh_running_statistics():
    model = _model()
    bn = model[1]
    bn.train()
    bn(torch.randn(4, 5, 3, 3))  # moves running stats and num_batches_tracked
    with torch.no_grad():
        for norm in (bn, model[4], model[6]):
            norm.weight.fill_(3.0)
            norm.bias.fill_(-2.0)
    portable_init(model, seed=0)
    for norm in (bn, model[4], model[6]):
        assert torch.equal(norm.weight, torch.ones_like(norm.weight))
        assert torch.equal(norm.bias, torch.zeros_like(norm.bias))
    assert torch.equal(bn.running_mean, torch.zeros(5))
    assert torch.equal(bn.running_var, torch.ones(5))
    assert bn.num_batches_tracked.item() == 0


def test_same_seed_same_bits_whatever_the_thread_count_and_torch_seed():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(1)
        one = _model()
        portable_init(one, seed=5)
        torch.set_num_threads(2)
        torch.manual_seed(2)
        two = _model()
        portable_init(two, seed=5)
    finally:
        torch.set_num_threads(threads)
    a, b = _state(one), _state(two)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_different_seeds_give_different_weights():
    one, two = _model(), _model()
    portable_init(one, seed=0)
    portable_init(two, seed=1)
    assert not torch.equal(one[0].weight, two[0].weight)
    assert not torch.equal(one[3].weight, two[3].weight)


def test_does_not_touch_torchs_generator():
    model = _model()
    before = torch.get_rng_state()
    portable_init(model, seed=3)
    assert torch.equal(before, torch.get_rng_state())


def test_uniform_bounds_and_normal_moments():
    model = nn.Sequential(nn.Linear(400, 300), nn.Embedding(500, 200))
    portable_init(model, seed=0)
    bound = 1 / math.sqrt(400)
    weight = model[0].weight
    assert weight.abs().max() <= bound
    assert weight.abs().max() > 0.99 * bound
    emb = model[1].weight
    assert abs(emb.mean().item()) < 0.01
    assert abs(emb.std().item() - 1) < 0.01


def test_float64_model_is_set_from_the_same_float32_draws():
    one, two = _model(), _model().double()
    portable_init(one, seed=4)
    portable_init(two, seed=4)
    assert two[0].weight.dtype == torch.float64
    assert torch.equal(one[0].weight.double(), two[0].weight)


def test_tied_weights_are_set_once_under_their_first_name():
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    portable_init(model, seed=0)
    assert torch.equal(model[1].weight, RandomStream(0, "init", "0.weight").normal((5, 4)))


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))


class FloatTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(3))


class BoolMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(3, 3, dtype=torch.bool).tril())


@pytest.mark.parametrize("module, name", [(Scale(), "1.gain"), (FloatTable(), "1.table")])
def test_unknown_module_with_floating_tensors_is_refused_by_name(module, name):
    with pytest.raises(ProgramError, match=f"'{name}'.*{type(module).__name__}"):
        portable_init(nn.Sequential(nn.Linear(2, 3), module), seed=0)


def test_non_floating_buffers_of_other_modules_are_left_alone():
    model = nn.Sequential(nn.Linear(2, 3), BoolMask())
    portable_init(model, seed=0)
    assert torch.equal(model[1].mask, torch.ones(3, 3, dtype=torch.bool).tril())
