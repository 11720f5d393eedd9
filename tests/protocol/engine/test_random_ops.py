"""protocol.engine.random_ops: every RNG op of a step served by the portable generator (SPEC §3.4).

(a) each served op's distribution on large draws — every statistical check allows SIGMAS
standard errors, so a correct generator fails one with probability about 2e-9; (b) the drawn
values, and a full training step with dropout2d, alpha dropout, SDPA attention dropout and
torch.rand / bernoulli / randperm in its loss, are the same bits on every profile (record on one,
replay on another); (c) each step and each call draws its own values; (d) what is not served is
refused, naming the op; (e) the plain modes draw the same values as ovt mode.
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protocol.codec.state import states_equal
from protocol.engine.executor import Executor, pinned_backends
from protocol.engine.initialization import portable_init
from protocol.engine.interceptor import RoundingMode, native_compute
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import PRESETS
from protocol.engine.programs.base import TrainingProgram
from protocol.engine.random_ops import (
    PURPOSE,
    SELU_ALPHA,
    PortableRandomFunctions,
    PortableRandomOps,
    StepRandomness,
)
from protocol.engine.rng import RandomStream
from protocol.engine.rounding import BoundAdversary, SiteRecorder, SiteReplayer
from protocol.errors import ConfigError, DeterminismError

POLICY = PrecisionPolicy()
SEED, STEP = 11, 3
N = 120_000  # draws per distribution check
SIGMAS = 6.0  # every statistical check: within 6 standard errors


def served(fn, *, seed: int = SEED, step: int = STEP):
    """fn() with its random ops served as in the plain modes (native arithmetic)."""
    randomness = StepRandomness(seed, step)
    with PortableRandomFunctions(randomness), PortableRandomOps(randomness):
        return fn()


def served_ovt(fn, *, seed: int = SEED, step: int = STEP, compute=native_compute,
               adversary: bool = False):
    """fn() with its random ops served as in ovt mode (under the interceptor, recording)."""
    randomness = StepRandomness(seed, step)
    rounder = SiteRecorder(POLICY)
    arithmetic = BoundAdversary(rounder, POLICY) if adversary else rounder
    with RoundingMode(POLICY, arithmetic, compute, randomness), \
            PortableRandomFunctions(randomness):
        return fn()


def stream(call: int, *, seed: int = SEED, step: int = STEP, micro_batch: int = 0
           ) -> RandomStream:
    """The stream the `call`-th draw of a step's micro-batch reads."""
    return RandomStream(seed, PURPOSE, step, micro_batch, call)


def rnd(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_moments(x: torch.Tensor, mean: float, var: float) -> None:
    """Sample mean and variance within SIGMAS standard errors of `mean` and `var` (the
    variance's standard error from the sample's fourth central moment)."""
    x = x.double().flatten()
    n = x.numel()
    m, v = x.mean().item(), x.var().item()
    fourth = ((x - m) ** 4).mean().item()
    assert abs(m - mean) < SIGMAS * math.sqrt(var / n), (m, mean)
    assert abs(v - var) < SIGMAS * math.sqrt((fourth - v * v) / n), (v, var)


def assert_frequency(hits: torch.Tensor, p: float) -> None:
    n = hits.numel()
    freq = hits.double().mean().item()
    assert abs(freq - p) <= SIGMAS * math.sqrt(p * (1 - p) / n) + 1e-12, (freq, p)


def assert_uniform_integers(x: torch.Tensor, low: int, high: int) -> None:
    """Every value in [low, high), and every bin's count within SIGMAS standard errors."""
    x = x.long().flatten()
    assert x.min() >= low and x.max() < high
    counts = torch.bincount(x - low, minlength=high - low).double()
    q, n = 1.0 / (high - low), x.numel()
    assert ((counts - n * q).abs() < SIGMAS * math.sqrt(n * q * (1 - q))).all(), counts


# -- (a) distributions --------------------------------------------------------------------------


@pytest.mark.parametrize("draw, low, high", [
    (lambda: torch.rand(N), 0.0, 1.0),
    (lambda: torch.rand_like(torch.zeros(N, 2)), 0.0, 1.0),
    (lambda: torch.zeros(N).uniform_(), 0.0, 1.0),
    (lambda: torch.zeros(N, dtype=torch.float64).uniform_(-2.0, 3.0), -2.0, 3.0),
    (lambda: torch.ops.aten.uniform.default(torch.zeros(N), 0.5, 1.5), 0.5, 1.5),
], ids=["rand", "rand_like", "uniform_", "uniform_-float64", "uniform"])
def test_uniform_draws(draw, low, high):
    x = served(draw)
    assert x.min() >= low and x.max() < high
    assert_moments(x, (low + high) / 2, (high - low) ** 2 / 12)


@pytest.mark.parametrize("draw, mean, std", [
    (lambda: torch.randn(N), 0.0, 1.0),
    (lambda: torch.randn_like(torch.zeros(N, dtype=torch.float64)), 0.0, 1.0),
    (lambda: torch.zeros(N).normal_(1.5, 2.0), 1.5, 2.0),
    (lambda: torch.normal(1.5, 2.0, (N,)), 1.5, 2.0),
    (lambda: torch.normal(torch.full((N,), 1.5), 2.0), 1.5, 2.0),
    (lambda: torch.normal(1.5, torch.full((N,), 2.0)), 1.5, 2.0),
    (lambda: torch.normal(torch.full((N,), 1.5), torch.full((N,), 2.0)), 1.5, 2.0),
], ids=["randn", "randn_like", "normal_", "float_float", "Tensor_float", "float_Tensor",
        "Tensor_Tensor"])
def test_normal_draws(draw, mean, std):
    x = served(draw)
    assert_moments(x, mean, std * std)
    assert ((x - mean).abs() <= 6 * std * (1 + 1e-6)).all()  # Irwin–Hall: bounded by 6 sigma


@pytest.mark.parametrize("draw, p", [
    (lambda: torch.bernoulli(torch.full((N,), 0.3)), 0.3),
    (lambda: torch.bernoulli(torch.zeros(N), 0.7), 0.7),
    (lambda: torch.zeros(N).bernoulli_(0.25), 0.25),
    (lambda: torch.zeros(N).bernoulli_(torch.full((N,), 0.6)), 0.6),
    (lambda: torch.bernoulli(torch.full((N,), 0.4), out=torch.empty(N)), 0.4),
    (lambda: torch.zeros(N, dtype=torch.int64).bernoulli_(0.5), 0.5),
], ids=["self-as-p", "p", "bernoulli_.float", "bernoulli_.Tensor", "out", "int64"])
def test_bernoulli_frequency(draw, p):
    x = served(draw)
    assert set(x.unique().tolist()) <= {0, 1}
    assert_frequency(x, p)


def test_bernoulli_with_per_element_probabilities():
    probs = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0]).repeat(N // 5, 1)  # (N/5, 5)
    x = served(lambda: torch.bernoulli(probs))
    assert x.shape == probs.shape and x.dtype == probs.dtype
    for j, p in enumerate(probs[0].tolist()):
        assert_frequency(x[:, j], p)
    assert not x[:, 0].any() and x[:, 4].all()
    with pytest.raises(ConfigError, match=r"in \[0, 1\]"):
        served(lambda: torch.bernoulli(torch.tensor([0.5, 1.5])))


@pytest.mark.parametrize("draw, low, high", [
    (lambda: torch.randint(-3, 7, (N,)), -3, 7),
    (lambda: torch.randint(10, (N,), dtype=torch.float32), 0, 10),
    (lambda: torch.randint_like(torch.zeros(N, dtype=torch.int32), 5, 9), 5, 9),
    (lambda: torch.zeros(N).random_(-3, 7), -3, 7),
    (lambda: torch.zeros(N, dtype=torch.int32).random_(6), 0, 6),
    (lambda: torch.zeros(N, dtype=torch.uint8).random_(), 0, 256),
    (lambda: torch.zeros(N, dtype=torch.bool).random_(), 0, 2),
], ids=["randint.low", "randint-float32", "randint_like", "random_.from", "random_.to",
        "random_-uint8", "random_-bool"])
def test_integer_draws_are_uniform(draw, low, high):
    assert_uniform_integers(served(draw), low, high)


def test_random_without_bounds_spans_the_dtype():
    ints = served(lambda: torch.zeros(N, dtype=torch.int64).random_())
    assert ints.min() >= 0 and ints.max() > 2**62  # [0, 2**63 - 1]
    floats = served(lambda: torch.zeros(N).random_())
    assert floats.min() >= 0 and floats.max() <= 2**24 and torch.equal(floats, floats.round())
    assert floats.max() > 2**23  # [0, 2**24]: float32's consecutive integers
    full = served(lambda: torch.zeros(N, dtype=torch.int64).random_(-(2**63), None))
    assert full.min() < -(2**62) and full.max() > 2**62


def test_randperm_is_a_permutation():
    for dtype in (torch.int64, torch.float32):
        perm = served(lambda dtype=dtype: torch.randperm(1000, dtype=dtype))
        assert perm.dtype == dtype
        assert torch.equal(perm.sort().values, torch.arange(1000, dtype=dtype))
        assert not torch.equal(perm, torch.arange(1000, dtype=dtype))


# -- dropout, at function level ------------------------------------------------------------------


def _noise(x: torch.Tensor, lead: int | None) -> tuple[int, ...]:
    return tuple(x.shape) if lead is None else tuple(x.shape[:lead]) + (1,) * (x.dim() - lead)


@pytest.mark.parametrize("call, shape, lead, alpha", [
    (lambda x: F.dropout(x, 0.3), (40, 50), None, False),
    (lambda x: torch.dropout(x, 0.3, True), (40, 50), None, False),
    (lambda x: F.dropout1d(x, 0.3), (40, 50, 3), 2, False),
    (lambda x: F.dropout1d(x, 0.3), (40, 3), 1, False),  # unbatched (C, L)
    (lambda x: F.dropout2d(x, 0.3), (40, 50, 2, 3), 2, False),
    (lambda x: F.dropout3d(x, 0.3), (4, 50, 2, 3, 2), 2, False),
    (lambda x: F.dropout3d(x, 0.3), (50, 2, 3, 2), 1, False),  # unbatched (C, D, H, W)
    (lambda x: torch.feature_dropout(x, 0.3, True), (40, 50, 2), 2, False),
    (lambda x: F.alpha_dropout(x, 0.3, training=True), (40, 50), None, True),
    (lambda x: torch.alpha_dropout(x, 0.3, True), (40, 50), None, True),
    (lambda x: F.feature_alpha_dropout(x, 0.3, training=True), (40, 50, 3), 2, True),
], ids=["dropout", "torch.dropout", "dropout1d", "dropout1d-unbatched", "dropout2d",
        "dropout3d", "dropout3d-unbatched", "feature_dropout", "alpha_dropout",
        "torch.alpha_dropout", "feature_alpha_dropout"])
def test_dropouts_follow_torchs_formulas_with_the_portable_mask(call, shape, lead, alpha):
    x, p = rnd(*shape, seed=5), 0.3
    out = served(lambda: call(x))
    keep = stream(0).keep_mask(_noise(x, lead), 1 - p)
    if alpha:
        a = 1.0 / math.sqrt((SELU_ALPHA * SELU_ALPHA * p + 1.0) * (1.0 - p))
        expected = torch.where(keep, x * a + SELU_ALPHA * a * p, -SELU_ALPHA * a * (1.0 - p))
    else:
        expected = torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)
    assert torch.equal(out, expected)
    assert_frequency(keep, 1 - p)


def test_alpha_dropout_keeps_zero_mean_and_unit_variance():
    x = rnd(N, seed=6)
    assert_moments(served(lambda: F.alpha_dropout(x, 0.2, training=True)), 0.0, 1.0)


def test_dropout_edge_cases():
    x = rnd(10, 10, seed=7)
    randomness = StepRandomness(0, 1)
    with PortableRandomFunctions(randomness):
        assert F.dropout(x, 0.5, training=False) is x
        assert F.dropout(x, 0.0) is x
        assert F.alpha_dropout(x, 0.5) is x  # alpha dropout's training defaults to False
        assert torch.equal(F.dropout2d(x.view(2, 5, 10), 1.0), torch.zeros(2, 5, 10))
        assert randomness.calls == 0  # nothing was drawn
        y = x.clone()
        out = F.dropout(y, 0.5, inplace=True)
        assert out is y and (y == 0).any() and not torch.equal(y, x)
        with pytest.raises(ConfigError, match="dropout probability"):
            F.dropout(x, 1.5)
        with pytest.raises(ConfigError, match="dropout1d expects"):
            F.dropout1d(x.view(100), 0.5)


def test_native_dropout_served_at_dispatch_level():
    x, p = rnd(50, 40, seed=8), 0.4
    out, mask = served(lambda: torch.ops.aten.native_dropout(x, p, True))
    keep = stream(0).keep_mask(x.shape, 1 - p)
    assert mask.dtype == torch.bool and torch.equal(mask, keep)
    assert torch.equal(out, torch.where(keep, x * (1 / (1 - p)), 0.0))
    out, mask = served(lambda: torch.ops.aten.native_dropout(x, p, False))
    assert torch.equal(out, x) and mask.all()
    # its backward (native_dropout_backward) runs under the interceptor too
    w = x.clone().requires_grad_()
    served_ovt(lambda: torch.ops.aten.native_dropout(w, p, True)[0].sum().backward())
    assert torch.equal(w.grad, torch.where(keep, torch.tensor(1 / (1 - p)), 0.0))


# -- SDPA's attention dropout --------------------------------------------------------------------


def _sdpa_reference(q, k, v, keep, p, attn_mask=None, is_causal=False, scale=None,
                    enable_gqa=False):
    """Math attention in plain float64 with the keep mask `keep` (torch's math kernel, spelled
    out: sqrt of the scale on q and k, softmax, masked, values scaled by 1 / (1 - p))."""
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    weights = (q * root) @ (k * root).transpose(-2, -1)  # (..., L, S)
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill(~attn_mask,
                                                                           -math.inf)
    if attn_mask is not None:
        weights = weights + attn_mask
    return weights.softmax(-1).masked_fill(~keep, 0.0) @ (v * (1.0 / (1.0 - p)))


def _qkv(q_shape, kv_shape, seed=9):
    return (rnd(*q_shape, seed=seed).double(), rnd(*kv_shape, seed=seed + 1).double(),
            rnd(*kv_shape[:-1], 5, seed=seed + 2).double())


BOOL_MASK = torch.rand(4, 6, generator=torch.Generator().manual_seed(3)) > 0.3
BOOL_MASK[:, 0] = True  # no fully masked row


@pytest.mark.parametrize("q_shape, kv_shape, kwargs, weights", [
    ((2, 3, 4, 8), (2, 3, 6, 8), {}, (2, 3, 4, 6)),
    ((2, 3, 6, 8), (2, 3, 6, 8), {"is_causal": True}, (2, 3, 6, 6)),
    ((2, 3, 4, 8), (2, 3, 6, 8), {"attn_mask": BOOL_MASK}, (2, 3, 4, 6)),
    ((2, 3, 4, 8), (2, 3, 6, 8), {"attn_mask": rnd(4, 6, seed=4).double()}, (2, 3, 4, 6)),
    ((2, 4, 4, 8), (2, 2, 6, 8), {"enable_gqa": True}, (2, 4, 4, 6)),
    ((1, 3, 4, 8), (2, 1, 6, 8), {"scale": 0.3}, (2, 3, 4, 6)),
], ids=["plain", "causal", "bool-mask", "float-mask", "gqa", "broadcast-scale"])
def test_sdpa_dropout_is_the_math_kernel_with_the_portable_mask(q_shape, kv_shape, kwargs,
                                                                 weights):
    q, k, v = _qkv(q_shape, kv_shape)
    p = 0.25
    out = served(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=p, **kwargs))
    keep = stream(0).keep_mask(weights, 1 - p)
    assert torch.equal(out, _sdpa_reference(q, k, v, keep, p, **kwargs))


def test_sdpa_without_dropout_passes_through():
    q, k, v = _qkv((2, 3, 4, 8), (2, 3, 6, 8))
    randomness = StepRandomness(SEED, STEP)
    with PortableRandomFunctions(randomness):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=False, dropout_p=0.0)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    assert randomness.calls == 0


# -- (b) the same bits on every profile ----------------------------------------------------------


def _draws():
    """Draws, and dropouts (whose arithmetic is correctly rounded: the same bits anywhere); SDPA,
    whose softmax rounding may differ by machine, is checked by replay below."""
    x = rnd(6, 8, seed=12)
    return [torch.rand(7), torch.randn(3, 5), torch.randint(-5, 5, (9,)), torch.randperm(11),
            torch.bernoulli(x.sigmoid()), torch.zeros(4).uniform_(-1, 1), x.clone().normal_(),
            F.dropout(x, 0.3), F.dropout2d(x.view(2, 3, 8), 0.5), F.alpha_dropout(x, 0.2, True)]


@pytest.mark.parametrize("profile", ["cpu-1t", "cpu-2t", "emulated-gpu", "adversary"])
def test_drawn_values_are_the_same_bits_on_every_profile(profile):
    reference = served_ovt(_draws)
    preset = PRESETS[profile]
    with pinned_backends(), preset.applied():
        drawn = served_ovt(_draws, compute=preset.reorder() or native_compute,
                           adversary=preset.adversary)
    for a, b in zip(reference, drawn, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


class RandomNet(nn.Module):
    """conv -> Dropout2d -> linear -> AlphaDropout -> causal self-attention with attention
    dropout (2 heads, 4 tokens) -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.drop2d = nn.Dropout2d(0.25)
        self.proj = nn.Linear(64, 16)
        self.alpha = nn.AlphaDropout(0.2)
        self.qkv = nn.Linear(4, 12)
        self.head = nn.Linear(16, 3)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        b = image.shape[0]
        x = self.drop2d(F.relu(self.conv(image)))  # (B, 4, 4, 4)
        x = self.alpha(self.proj(x.flatten(1)))  # (B, 16)
        q, k, v = self.qkv(x.view(b, 4, 4)).view(b, 4, 3, 2, 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)  # (B, 2, 4, 2)
        return self.head(x + a.transpose(1, 2).reshape(b, 16))  # (B, 3)


class TinyImages:
    def __init__(self, n: int = 16) -> None:
        self.images = RandomStream(0, "test-images").uniform((n, 2, 4, 4), -1.0, 1.0)
        self.labels = torch.arange(n) % 3

    def __len__(self) -> int:
        return len(self.labels)

    def example(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[i].clone(), "label": self.labels[i].clone()}


def _random_loss(model, batch, draws: list):
    """Cross-entropy of noisy logits, weighted by Bernoulli draws in a random order; the raw
    draws are appended to `draws` (as one float64 CPU tensor)."""
    logits = model(batch["image"])  # (B, 3)
    b, like = logits.shape[0], {"dtype": logits.dtype, "device": logits.device}
    u, z = torch.rand_like(logits), torch.randn(logits.shape, **like)  # (B, 3)
    kept = torch.bernoulli(torch.full((b,), 0.75, **like))  # (B,)
    order = torch.randperm(b, device=logits.device)  # (B,)
    probe = F.dropout(torch.ones(8, **like), 0.5)  # (8,)
    draws.append(torch.cat([u.flatten(), z.flatten(), kept, order, probe]).detach().cpu()
                 .double())
    weights = kept[order] + 0.5
    per_example = F.cross_entropy(logits + 0.1 * u + 0.01 * z, batch["label"], reduction="none")
    return (per_example * weights).mean()


def random_program(draws: list) -> TrainingProgram:
    return TrainingProgram(
        name="random-net", model=RandomNet(),
        make_optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        loss=functools.partial(_random_loss, draws=draws), dataset=TinyImages(), batch_size=4,
        init=portable_init, config={})


def _executor(draws: list, profile: str = "cpu-2t", mode: str = "ovt") -> Executor:
    return Executor(random_program(draws), seed=SEED, policy=POLICY, profile=PRESETS[profile],
                    mode=mode)


STEPS = 2


@pytest.fixture(scope="module")
def trainer():
    """Two recorded steps on cpu-2t: (S_0, the logs, the states after each step, the draws)."""
    draws: list = []
    ex = _executor(draws)
    ex.init_state(1)
    s0, logs, states = ex.state(), [], []
    for _ in range(STEPS):
        logs.append(ex.step().log)
        states.append(ex.state())
    return s0, logs, states, draws


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


@pytest.mark.parametrize("auditor", ["cpu-1t", "emulated-gpu", "adversary", CUDA])
def test_training_with_randomness_replays_bit_exactly(trainer, auditor):
    s0, logs, states, trainer_draws = trainer
    draws: list = []
    ex = _executor(draws, auditor)
    ex.load_state(s0)
    for t in range(STEPS):
        ex.step(logs[t])
        assert states_equal(ex.state(), states[t]), f"step {t + 1} on {auditor}"
    assert all(torch.equal(a, b) for a, b in zip(draws, trainer_draws, strict=True))
    assert not torch.equal(trainer_draws[0], trainer_draws[1])  # each step drew its own
    assert sum(log.n_entries for log in logs) > 0


def test_training_randomness_changes_the_state(trainer):
    """The draws matter: under another job seed the same step ends elsewhere."""
    s0, _, states, _ = trainer
    ex = Executor(random_program([]), seed=SEED + 1, policy=POLICY, profile=PRESETS["cpu-2t"])
    ex.load_state(s0)
    ex.step()
    assert not states_equal(ex.state(), states[0])


def test_hf_gpt2_with_attention_dropout_replays_bit_exactly():
    """HF GPT-2's default (sdpa) attention passes dropout_p to F.scaled_dot_product_attention;
    recorded on 2 threads, replayed on the emulated GPU on 1 thread."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1,
                                      n_head=2, attn_pdrop=0.2, resid_pdrop=0.1,
                                      embd_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # HF's own initialisation, outside the step
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.arange(16).view(2, 8) % 32

    def step(rounder, profile):
        model.zero_grad(set_to_none=True)
        randomness = StepRandomness(SEED, STEP)
        preset = PRESETS[profile]
        with pinned_backends(), preset.applied(), \
                RoundingMode(POLICY, rounder, preset.reorder() or native_compute, randomness), \
                PortableRandomFunctions(randomness):
            loss = model(ids, labels=ids).loss
            loss.backward()
        assert randomness.calls >= 2  # attention dropout, and F.dropout (embeddings, MLP...)
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    recorder = SiteRecorder(POLICY)
    recorded = step(recorder, "cpu-2t")
    replayer = SiteReplayer(POLICY, recorder.log(), step=STEP)
    replayed = step(replayer, "emulated-gpu")
    replayer.finish()
    assert all(torch.equal(a, b) for a, b in zip(recorded, replayed, strict=True))


# -- (c) each step and each call its own draw ----------------------------------------------------


def test_each_call_and_step_draws_its_own_values():
    ones = torch.ones(64, 33)

    def two_masks():
        return [F.dropout(ones, 0.5) != 0, F.dropout(ones, 0.5) != 0]

    first, second = served(two_masks)
    assert not torch.equal(first, second)  # call 0 and call 1
    again = served(two_masks)
    assert torch.equal(first, again[0]) and torch.equal(second, again[1])
    assert not torch.equal(first, served(two_masks, step=STEP + 1)[0])  # another step
    assert not torch.equal(first, served(two_masks, seed=SEED + 1)[0])  # another job seed
    assert torch.equal(first, stream(0).keep_mask(ones.shape, 0.5))
    assert torch.equal(second, stream(1).keep_mask(ones.shape, 0.5))


def test_function_and_dispatch_level_share_one_counter():
    ones = torch.ones(10, 10)
    u, mask, v = served(lambda: (torch.rand(5), F.dropout(ones, 0.5) != 0, torch.rand(5)))
    assert torch.equal(u, stream(0).uniform(5))
    assert torch.equal(mask, stream(1).keep_mask(ones.shape, 0.5))
    assert torch.equal(v, stream(2).uniform(5))


# -- (d) refusals --------------------------------------------------------------------------------


REFUSED = [
    (lambda x: x.exponential_(), "aten.exponential_.default"),
    (lambda x: x.geometric_(0.5), "aten.geometric_.default"),
    (lambda x: x.log_normal_(), "aten.log_normal_.default"),
    (lambda x: x.cauchy_(), "aten.cauchy_.default"),
    (lambda x: torch.multinomial(x.abs() + 0.1, 2), "aten.multinomial.default"),
    (lambda x: torch.poisson(x.abs()), "aten.poisson.default"),
    (lambda x: torch._standard_gamma(x.abs() + 1), "aten._standard_gamma.default"),
    (lambda x: torch.binomial(torch.full_like(x, 5.0), torch.full_like(x, 0.5)),
     "aten.binomial.default"),
    (lambda x: F.rrelu(x, training=True), "aten.rrelu_with_noise.default"),
]


@pytest.mark.parametrize("make, name", REFUSED, ids=[name for _, name in REFUSED])
@pytest.mark.parametrize("mode", ["plain", "ovt"])
def test_unserved_rng_ops_are_refused_by_name(make, name, mode):
    x = rnd(4, seed=14)
    run = served if mode == "plain" else served_ovt
    with pytest.raises(DeterminismError, match=rf"^{re.escape(name)} draws from a device "
                                               rf"random number generator.*instead"):
        run(lambda: make(x))


@pytest.mark.parametrize("make, name", [
    (lambda: torch.rand(3, dtype=torch.bfloat16), "aten.rand.default"),
    (lambda: torch.zeros(3, dtype=torch.float16).normal_(), "aten.normal_.default"),
    (lambda: torch.randint(0, 300, (3,), dtype=torch.bfloat16), "aten.randint.low"),
    (lambda: torch.randint(0, 300, (3,), dtype=torch.uint8), "aten.randint.low"),
], ids=["rand-bf16", "normal_-fp16", "randint-bf16", "randint-uint8"])
def test_draws_the_result_dtype_cannot_hold_are_refused(make, name):
    with pytest.raises(DeterminismError, match=rf"^{re.escape(name)} would round"):
        served(make)
    assert served(lambda: torch.randint(0, 256, (3,), dtype=torch.bfloat16)).dtype == \
        torch.bfloat16  # integers up to 2**8 are exact in bfloat16
    assert set(served(lambda: torch.zeros(9, dtype=torch.bfloat16).bernoulli_(0.5))
               .tolist()) <= {0.0, 1.0}


# -- (e) the plain modes draw what ovt mode draws ------------------------------------------------


def test_plain_and_ovt_modes_draw_the_same_values():
    plain, ovt = served(_draws), served_ovt(_draws)
    for a, b in zip(plain, ovt, strict=True):
        assert torch.equal(a, b)
    wide = served(lambda: (torch.rand(7, dtype=torch.float64), F.dropout(
        torch.ones(9, dtype=torch.float64), 0.3) != 0))  # plain64 keeps its state in float64
    assert torch.equal(wide[0], served(lambda: torch.rand(7)).double())
    assert torch.equal(wide[1], stream(1).keep_mask(9, 0.7))


def test_every_executor_mode_draws_the_same_values(trainer):
    *_, trainer_draws = trainer
    for mode in ("plain", "plain64"):
        draws: list = []
        ex = _executor(draws, mode=mode)
        ex.init_state(1)
        ex.step()
        assert torch.equal(draws[0], trainer_draws[0]), mode
