"""protocol.engine.profiles: presets, key=value parsing, thread counts, the ISA subprocess rule."""

from __future__ import annotations

import pytest
import torch

from protocol.engine.profiles import (
    PRESETS,
    Profile,
    available_profiles,
    current_isa,
    plain_profile,
)
from protocol.engine.splitk import SplitK
from protocol.errors import ConfigError

aten = torch.ops.aten

OTHER_ISA = next(isa for isa in ("default", "avx2", "avx512") if isa != current_isa())


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_parse_to_themselves(name):
    profile = Profile.parse(name)
    assert profile is PRESETS[name] and profile.name == name


def test_preset_contents():
    assert PRESETS["cpu-1t"].threads == 1 and PRESETS["cpu-2t"].threads == 2
    assert PRESETS["channels-last"].channels_last
    assert PRESETS["isa-default"].isa == "default"
    assert PRESETS["emulated-gpu"].splitk == 1 and PRESETS["emulated-gpu"].device == "cpu"
    assert PRESETS["cuda"].device == "cuda"


@pytest.mark.parametrize("name, threads, splitk, chunks, order, adversary", [
    ("emulated-gpu", 2, 1, 3, "permuted", False),
    ("splitk-8", 2, 2, 8, "permuted", False),
    ("pairwise", 2, 3, 8, "pairwise", False),
    ("reversed", 1, 4, 16, "reversed", False),
    ("adversary", 2, None, 3, "permuted", True),
    ("adversary-gpu", 2, 5, 4, "permuted", True),
])
def test_emulated_presets(name, threads, splitk, chunks, order, adversary):
    p = PRESETS[name]
    assert (p.device, p.threads, p.splitk, p.chunks, p.order, p.adversary) == (
        "cpu", threads, splitk, chunks, order, adversary)
    assert not p.channels_last and p.isa is None


def test_only_the_adversary_presets_are_adversarial():
    assert {n for n, p in PRESETS.items() if p.adversary} == {"adversary", "adversary-gpu"}


@pytest.mark.parametrize("text, fields", [
    ("threads=1,splitk=7", dict(threads=1, splitk=7)),
    ("device=cuda", dict(device="cuda")),
    ("device=cuda:1", dict(device="cuda:1")),
    ("device=cpu", dict(device="cpu")),
    ("memory=channels_last", dict(channels_last=True)),
    ("memory=contiguous", dict(channels_last=False)),
    ("isa=default,threads=2", dict(isa="default", threads=2)),
    ("isa=avx512", dict(isa="avx512")),
    (" threads = 3 , splitk = -2 ", dict(threads=3, splitk=-2)),
    ("splitk=1,chunks=8", dict(splitk=1, chunks=8)),
    ("splitk=0,chunks=2,order=pairwise", dict(splitk=0, chunks=2, order="pairwise")),
    ("order=reversed,splitk=9", dict(splitk=9, order="reversed")),
    ("splitk=1,order=permuted", dict(splitk=1)),
    ("adversary=1", dict(adversary=True)),
    ("adversary=true,threads=2", dict(adversary=True, threads=2)),
    ("adversary=TRUE", dict(adversary=True)),
    ("adversary=0", dict()),
    ("adversary=false", dict()),
    ("threads=2,splitk=5,chunks=4,adversary=1", dict(threads=2, splitk=5, chunks=4,
                                                     adversary=True)),
])
def test_key_value_profiles(text, fields):
    profile = Profile.parse(text)
    assert profile == Profile(name=text, **fields)


@pytest.mark.parametrize("text, match", [
    ("nope", "unknown profile 'nope'; presets: cpu-1t"),
    ("", "unknown profile"),
    ("foo=1", "unknown profile key 'foo'"),
    ("threads=1,,", "unknown profile key ''"),
    ("threads=0", "bad value '0' for 'threads'"),
    ("threads=-1", "bad value"),
    ("threads=two", "bad value 'two' for 'threads'"),
    ("threads=", "bad value '' for 'threads'"),
    ("threads=1,splitk", "bad value '' for 'splitk'"),
    ("splitk=1.5", "bad value '1.5' for 'splitk'"),
    ("memory=fast", "bad value 'fast' for 'memory'"),
    ("isa=sse", "bad value 'sse' for 'isa'"),
    ("device=tpu", "bad value 'tpu' for 'device'"),
    ("splitk=1,chunks=1", "bad value '1' for 'chunks'"),
    ("splitk=1,chunks=0", "bad value '0' for 'chunks'"),
    ("splitk=1,chunks=three", "bad value 'three' for 'chunks'"),
    ("splitk=1,chunks=2.5", "bad value '2.5' for 'chunks'"),
    ("splitk=1,chunks=", "bad value '' for 'chunks'"),
    ("splitk=1,order=random", "bad value 'random' for 'order'"),
    ("splitk=1,order=Pairwise", "bad value 'Pairwise' for 'order'"),
    ("splitk=1,order=", "bad value '' for 'order'"),
    ("adversary=yes", "bad value 'yes' for 'adversary'"),
    ("adversary=2", "bad value '2' for 'adversary'"),
    ("adversary=", "bad value '' for 'adversary'"),
    ("chunks=8", "chunks and order need splitk=SEED"),
    ("order=pairwise,threads=1", "chunks and order need splitk=SEED"),
    ("nope", "keys device, threads, memory, isa, splitk, chunks, order, adversary"),
])
def test_bad_profiles(text, match):
    with pytest.raises(ConfigError, match=match):
        Profile.parse(text)


def test_applied_sets_and_restores_the_thread_count():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        with Profile.parse("threads=1").applied() as p:
            assert torch.get_num_threads() == 1 and p.threads == 1
        assert torch.get_num_threads() == 3
        with pytest.raises(RuntimeError, match="boom"), PRESETS["cpu-2t"].applied():
            assert torch.get_num_threads() == 2
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 3
        with Profile("no-threads").applied():  # threads=None: leaves the count alone
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_needs_subprocess_for_another_isa():
    assert not Profile("a").needs_subprocess
    assert not Profile("b", isa=current_isa()).needs_subprocess
    other = Profile("c", isa=OTHER_ISA)
    assert other.needs_subprocess
    assert other.env() == {"ATEN_CPU_CAPABILITY": OTHER_ISA}
    assert Profile("d").env() == {}
    with pytest.raises(ConfigError, match=f"ATEN_CPU_CAPABILITY={OTHER_ISA}"):
        other.check_runnable()
    with pytest.raises(ConfigError), other.applied():
        pass
    Profile("b", isa=current_isa()).check_runnable()


def test_current_isa_is_lower_case():
    assert current_isa() == current_isa().lower() and current_isa()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_profile_without_cuda():
    with pytest.raises(ConfigError, match="CUDA"):
        PRESETS["cuda"].check_runnable()


@pytest.mark.parametrize("fields", [dict(chunks=1), dict(chunks=0), dict(chunks=2.5),
                                    dict(chunks=True), dict(order="tree"), dict(order="")])
def test_bad_fields_are_refused_on_construction(fields):
    with pytest.raises(ConfigError, match="profile 'x'"):
        Profile("x", splitk=1, **fields)


def test_describe():
    assert PRESETS["cpu-2t"].describe() == "cpu threads=2"
    assert Profile.parse("threads=1,splitk=7,memory=channels_last,isa=avx2").describe() == \
        "cpu threads=1 channels_last isa=avx2 splitk=7 chunks=3 order=permuted"
    assert Profile("x").describe() == f"cpu threads={torch.get_num_threads()}"
    assert PRESETS["emulated-gpu"].describe() == "cpu threads=2 splitk=1 chunks=3 order=permuted"
    assert PRESETS["pairwise"].describe() == "cpu threads=2 splitk=3 chunks=8 order=pairwise"
    assert PRESETS["reversed"].describe() == "cpu threads=1 splitk=4 chunks=16 order=reversed"
    assert PRESETS["adversary"].describe() == "cpu threads=2 adversary"
    assert PRESETS["adversary-gpu"].describe() == \
        "cpu threads=2 splitk=5 chunks=4 order=permuted adversary"


def _describe_to_text(description: str) -> str:
    """describe()'s words written back as parse's key=value pairs."""
    device, *words = description.split()
    items = [f"device={device}"]
    for word in words:
        items.append({"channels_last": "memory=channels_last", "adversary": "adversary=1"}.get(
            word, word))
    return ",".join(items)


def _fields(profile: Profile) -> dict:
    return {k: v for k, v in vars(profile).items() if k != "name"}


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.threads is not None])
def test_describe_round_trips_through_parse(name):
    preset = PRESETS[name]
    again = Profile.parse(_describe_to_text(preset.describe()))
    assert _fields(again) == _fields(preset) and again.describe() == preset.describe()


@pytest.mark.parametrize("text", ["threads=1,splitk=7,chunks=5,order=pairwise,adversary=1",
                                  "threads=3,memory=channels_last,isa=avx2,splitk=-1",
                                  "device=cuda:1,threads=2,adversary=0"])
def test_key_value_text_round_trips_through_describe(text):
    profile = Profile.parse(text)
    assert _fields(Profile.parse(_describe_to_text(profile.describe()))) == _fields(profile)


def test_reorder():
    assert Profile("x").reorder() is None and PRESETS["adversary"].reorder() is None
    for name, p in PRESETS.items():
        sk = p.reorder()
        if p.splitk is None:
            assert sk is None, name
            continue
        assert isinstance(sk, SplitK)
        assert (sk.seed, sk.chunks, sk.order) == (p.splitk, p.chunks, p.order), name


def test_emulated_gpu_reorders_as_before():
    """emulated-gpu's SplitK is the one the executor built before chunks and order existed."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 200, generator=g)
    b = torch.randn(200, 8, generator=g)
    sk = PRESETS["emulated-gpu"].reorder()
    assert sk is not None
    assert torch.equal(sk(aten.mm.default, (a, b), {}), SplitK(1)(aten.mm.default, (a, b), {}))


CPU_PRESETS = ["cpu-1t", "cpu-2t", "isa-default", "emulated-gpu", "splitk-8", "pairwise",
               "reversed", "adversary", "adversary-gpu"]


def test_available_profiles():
    cuda = ["cuda"] if torch.cuda.is_available() else []
    names = [p.name for p in available_profiles(program_has_conv=False)]
    assert names == CPU_PRESETS + cuda
    with_conv = [p.name for p in available_profiles(program_has_conv=True)]
    assert with_conv == CPU_PRESETS[:2] + ["channels-last"] + CPU_PRESETS[2:] + cuda
    assert set(with_conv) == set(PRESETS) - (set() if cuda else {"cuda"})


def test_plain_profile_of_each_device():
    assert plain_profile("cuda", 8) is PRESETS["cuda"]
    cpu = plain_profile("cpu", 3)
    assert (cpu.name, cpu.device, cpu.threads) == ("cpu-3t", "cpu", 3)
    assert plain_profile("cpu", 2) == PRESETS["cpu-2t"]
    with pytest.raises(ConfigError, match="expected cpu or cuda"):
        plain_profile("gpu", 2)
