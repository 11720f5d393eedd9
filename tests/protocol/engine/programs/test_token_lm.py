"""token-lm specifics: the synthetic token corpus, sizes and presets, causality, and a bit-exact
cross-profile replay of its test preset."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from protocol.engine.programs import registry, token_lm
from protocol.engine.replaycheck import SideSpec, replay_check
from protocol.errors import ConfigError
from protocol.job.create import DEFAULT_MAX_PARAMS

SMALL = {"vocab_size": 64, "d_model": 16, "n_heads": 2, "n_layers": 1, "seq_len": 8,
         "batch_size": 2, "corpus_tokens": 400}


def test_corpus_is_deterministic_in_range_and_prefix_stable():
    tokens = token_lm.generate_corpus(3000, 512, seed=3)
    assert tokens.shape == (3000,) and tokens.dtype == np.int64
    assert tokens.min() >= 0 and tokens.max() < 512
    assert np.array_equal(tokens, token_lm.generate_corpus(3000, 512, seed=3))
    assert not np.array_equal(tokens, token_lm.generate_corpus(3000, 512, seed=4))
    assert np.array_equal(token_lm.generate_corpus(700, 512, seed=3), tokens[:700])


def test_corpus_is_zipf_like_and_mostly_follows_the_successor_graph():
    tokens = token_lm.generate_corpus(1 << 15, 1024, seed=0)
    counts = np.bincount(tokens, minlength=1024)
    assert counts[:16].sum() > counts[-512:].sum()  # low ids are frequent
    pairs = {(int(a), int(b)) for a, b in zip(tokens[:-1], tokens[1:], strict=True)}
    # a walk with BRANCH successors per token: far fewer distinct bigrams than positions
    assert len(pairs) < len(tokens) // 3


def test_windows_are_consecutive_and_cover_the_corpus():
    data = token_lm.build(SMALL).dataset
    assert len(data) == (400 - 1) // 8
    corpus = token_lm.generate_corpus(400, 64, 0)
    for i in range(len(data) - 1):
        a, b = data.example(i)["tokens"], data.example(i + 1)["tokens"]
        assert a.shape == (9,) and a.dtype == torch.int64
        assert a[-1] == b[0]
        assert a.tolist() == corpus[8 * i:8 * i + 9].tolist()
    with pytest.raises(IndexError):
        data.example(len(data))


def test_defaults_are_the_test_preset():
    defaults = dataclasses.asdict(token_lm.TokenLMConfig())
    for key, value in token_lm.PRESETS["test"].items():
        assert defaults[key] == value


@pytest.mark.parametrize("preset", list(token_lm.PRESETS))
def test_parameter_count_matches_the_model_and_fits_the_job_cap(preset):
    config = token_lm.PRESETS[preset]
    cfg = token_lm.parse_config(config)
    with torch.device("meta"):  # the GPT-2-width presets, without allocating them
        model = token_lm.TokenLM(cfg)
    built = sum(p.numel() for p in model.parameters())
    assert token_lm.parameter_count(config) == built
    assert registry.parameter_count("token-lm", config) == built
    assert built <= DEFAULT_MAX_PARAMS


def test_gpt2_presets():
    small = token_lm.PRESETS["gpt2-small"]
    assert small["vocab_size"] == 50_257 and small["d_model"] == 768
    assert small["n_heads"] == 12 and small["n_layers"] == 12
    assert small["seq_len"] == 64 and small["batch_size"] == 8
    assert token_lm.PRESETS["gpt2-small-2l"] == {**small, "n_layers": 2}
    assert token_lm.parameter_count(token_lm.PRESETS["gpt2-small-2l"]) == 91_421_184
    assert token_lm.parameter_count(small) == 162_299_904
    assert token_lm.parse_config(small).optimizer == "adamw"


def test_builtin_and_untied_head():
    program = registry.load_program("token-lm", preset="test")
    assert program.name == "token-lm"
    model = program.model
    assert isinstance(model, token_lm.TokenLM)
    assert model.head.weight is not model.tok_emb.weight
    assert model.head.bias is None
    assert registry.program_source("token-lm") == open(token_lm.__file__, "rb").read()


def test_attention_is_causal_and_uses_no_fused_kernel(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("fused attention used")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    program = token_lm.build(SMALL)
    program.init(program.model, 0)
    tokens = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 64
    a, b = program.model(tokens), program.model(changed)
    assert torch.equal(a[:, :5], b[:, :5])
    assert not torch.equal(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("bad", [{"d_model": 30, "n_heads": 4}, {"corpus_tokens": 10},
                                 {"vocab_size": 1}, {"n_layers": 0}, {"optimizer": "lion"}])
def test_out_of_range_config(bad):
    with pytest.raises(ConfigError, match="token-lm"):
        token_lm.build(bad)


def _spec(role: str, profile: str, run_dir, steps: int) -> SideSpec:
    return SideSpec(role=role, program="token-lm", preset="test", config={}, seed=0,
                    init_seed=1, steps=steps, policy="float64->float32", profile=profile,
                    mode="ovt", probe_steps=(), run_dir=str(run_dir))


def test_test_preset_trains_and_replays_bit_exactly_on_the_emulated_gpu(tmp_path):
    steps = 4
    check = replay_check(_spec("trainer", "cpu-2t", tmp_path, steps),
                         _spec("auditor", "emulated-gpu", tmp_path, steps))
    assert check.trainer.error is None, check.trainer.error
    assert check.auditor.error is None, check.auditor.error
    assert check.bit_exact, check.summary()
    assert len(check.auditor.hashes) == steps + 1
    assert check.trainer.losses[-1] < check.trainer.losses[0]  # it trains
    assert all(n > 0 for n in check.trainer.elements)
