"""char-transformer specifics: the generated corpus, causality, the attention op sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from protocol.engine.programs import char_transformer
from protocol.errors import ConfigError

SMALL = {"d_model": 16, "n_heads": 2, "n_layers": 1, "seq_len": 8, "batch_size": 2,
         "corpus_chars": 400}


def test_corpus_has_the_requested_length_and_only_vocabulary_characters():
    text = char_transformer.generate_corpus(5000, seed=3)
    assert len(text) == 5000
    assert set(text) <= set(char_transformer.VOCAB)
    assert text == char_transformer.generate_corpus(5000, seed=3)
    assert text != char_transformer.generate_corpus(5000, seed=4)
    assert char_transformer.generate_corpus(100, seed=3) == text[:100]


def test_windows_are_consecutive_and_cover_the_corpus():
    program = char_transformer.build(SMALL)
    data = program.dataset
    assert len(data) == (400 - 1) // 8
    text = char_transformer.generate_corpus(400, 0)
    vocab = char_transformer.VOCAB
    for i in range(len(data) - 1):
        a, b = data.example(i)["tokens"], data.example(i + 1)["tokens"]
        assert a.shape == (9,) and a.dtype == torch.int64
        assert a[-1] == b[0]
        assert "".join(vocab[t] for t in a.tolist()) == text[8 * i:8 * i + 9]


def test_attention_is_causal():
    program = char_transformer.build({**SMALL, "dropout": 0.0})
    program.init(program.model, 0)
    tokens = torch.randint(len(char_transformer.VOCAB), (2, 8))
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % len(char_transformer.VOCAB)
    a, b = program.model(tokens), program.model(changed)
    assert torch.equal(a[:, :5], b[:, :5])
    assert not torch.equal(a[:, 5:], b[:, 5:])


def test_no_fused_attention_kernels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("fused attention used")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    program = char_transformer.build(SMALL)
    tokens = torch.zeros(2, 9, dtype=torch.int64)
    program.loss(program.model, {"tokens": tokens}).backward()
    assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in program.model.modules())


def test_dropout_modules_follow_the_config():
    program = char_transformer.build({**SMALL, "dropout": 0.25})
    drops = [m for m in program.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(drops) == 1 + 3 * SMALL["n_layers"]
    assert all(m.p == 0.25 for m in drops)


@pytest.mark.parametrize("bad", [{"d_model": 30, "n_heads": 4}, {"corpus_chars": 100},
                                 {"dropout": 1.0}, {"n_layers": 0}])
def test_out_of_range_sizes(bad):
    with pytest.raises(ConfigError, match="char-transformer"):
        char_transformer.build(bad)
