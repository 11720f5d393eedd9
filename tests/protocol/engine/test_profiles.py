"""protocol.engine.profiles: presets, key=value parsing, thread counts, the ISA subprocess rule."""

from __future__ import annotations

import pytest
import torch

from protocol.engine.profiles import PRESETS, Profile, available_profiles, current_isa
from protocol.errors import ConfigError

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


def test_describe():
    assert PRESETS["cpu-2t"].describe() == "cpu threads=2"
    assert Profile.parse("threads=1,splitk=7,memory=channels_last,isa=avx2").describe() == \
        "cpu threads=1 channels_last isa=avx2 splitk=7"
    assert Profile("x").describe() == f"cpu threads={torch.get_num_threads()}"


def test_available_profiles():
    names = [p.name for p in available_profiles(program_has_conv=False)]
    assert names[:4] == ["cpu-1t", "cpu-2t", "isa-default", "emulated-gpu"]
    with_conv = [p.name for p in available_profiles(program_has_conv=True)]
    assert with_conv[:5] == ["cpu-1t", "cpu-2t", "channels-last", "isa-default", "emulated-gpu"]
    assert ("cuda" in names) == torch.cuda.is_available()
