"""hf-causal-lm: HuggingFace GPT-2 and Llama as a built-in program (the optional hf extra).

Config checks, the lazy import, the portable init (a naive reference drawn straight from the
streams), the loss, and bit-exact replay across profiles: tiny GPT-2 with its default SDPA
attention and dropout 0.1, tiny Llama (RoPE, RMSNorm, grouped-query attention), and a fine-tune
from a `save_pretrained` folder with warm-up + cosine, clipping and 4 micro-batches. The default
selection runs 2 steps of each; the 20-step versions are marked slow.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from protocol.codec.state import state_digest  # noqa: E402
from protocol.engine.executor import Executor  # noqa: E402
from protocol.engine.precision import PrecisionPolicy  # noqa: E402
from protocol.engine.profiles import PRESETS as PROFILES  # noqa: E402
from protocol.engine.programs import hf_causal_lm, registry, token_lm  # noqa: E402
from protocol.engine.rng import RandomStream  # noqa: E402
from protocol.errors import ConfigError, ProgramError  # noqa: E402

NAME = hf_causal_lm.NAME
PRESETS = hf_causal_lm.PRESETS
GPT2, LLAMA = PRESETS["test"]["model"], PRESETS["llama-test"]["model"]
FAST_STEPS, SLOW_STEPS = 2, 20
FINE_TUNE = {"lr": 3e-3, "warmup_steps": 1, "decay_steps": 4, "min_lr": 1e-4,
             "clip_grad_norm": 0.5}


def build(preset: str = "test", **config):
    return registry.load_program(NAME, config, preset)


def batch(program, size: int = 4) -> dict[str, torch.Tensor]:
    return {"tokens": torch.stack([program.dataset.example(i)["tokens"] for i in range(size)])}


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_build_with_a_normalised_config_that_rebuilds_the_same(preset):
    program = build(preset)
    assert program.name == NAME and program.batch_size == PRESETS[preset]["batch_size"]
    assert program.config["transformers_version"] == transformers.__version__
    assert program.config["model"] == PRESETS[preset]["model"]
    assert program.model.training
    assert all(p.dtype == torch.float32 for p in program.model.parameters())
    again = registry.load_program(NAME, program.config)
    assert again.config == program.config
    assert registry.parameter_count(NAME, program.config) == \
        sum(p.numel() for p in program.model.parameters())


def test_dataclass_defaults_are_the_test_preset():
    defaults = dataclasses.asdict(hf_causal_lm.HFCausalLMConfig())
    for key, value in PRESETS["test"].items():
        assert defaults[key] == value
    assert build(None).config == build("test").config


def test_the_default_attention_and_dropout_are_transformers_own():
    gpt2 = build("test").model
    assert gpt2.config._attn_implementation == "sdpa"
    drops = {n: m.p for n, m in gpt2.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert drops and set(drops.values()) == {0.1}
    assert {"transformer.drop", "transformer.h.0.attn.attn_dropout"} <= set(drops)
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied
    llama = build("llama-test").model
    attention = llama.model.layers[0].self_attn
    assert llama.config._attn_implementation == "sdpa"
    assert attention.num_key_value_groups == 2  # 4 query heads share 2 KV heads


def test_parameter_count_of_gpt2_small_is_known_and_allocates_nothing():
    config = {"model": {"model_type": "gpt2"}, "seq_len": 1023}
    assert registry.parameter_count(NAME, config) == 124_439_808  # GPT-2 small, tied head


def test_to_dict_is_accepted_as_the_model():
    program = build("llama-test")
    as_dict = program.model.config.to_dict()  # id2label has int keys, dtype, version...
    again = build("llama-test", model=as_dict)
    assert again.config["transformers_version"] == transformers.__version__
    assert "transformers_version" not in again.config["model"]
    assert again.config["model"]["id2label"] == {"0": "LABEL_0", "1": "LABEL_1"}
    assert registry.parameter_count(NAME, again.config) == \
        registry.parameter_count(NAME, program.config)


@pytest.mark.parametrize("config,message", [
    ({"model": {**GPT2, "n_layers": 3}}, "n_layers that a gpt2 config does not know"),
    ({"model": {**GPT2, "model_type": "bert"}}, "model_type must be one of gpt2, llama"),
    ({"model": {"n_layer": 2}}, "model_type must be one of"),
    ({"model": {**GPT2, "auto_map": {"AutoModelForCausalLM": "x.Y"}}}, "auto_map is refused"),
    ({"model": {**GPT2, "quantization_config": {}}}, "quantization_config is refused"),
    ({"model": {**GPT2, "attn_implementation": "flash_attention_2"}}, "attn_implementation"),
    ({"model": {**GPT2, "n_embd": 30}}, "transformers"),  # not divisible by n_head
    ({"model": {**GPT2, "layer_norm_epsilon": math.nan}}, "must be finite"),
    ({"model": {**GPT2, "n_positions": 16}}, "seq_len \\+ 1 positions"),
    ({"model": {**GPT2, "n_layer": 10**6}}, "number of layers must be in \\[1, 256\\]"),
    ({"model": "gpt2"}, "model must be a mapping"),
    ({"transformers_version": "4.0.0"}, "made with transformers 4.0.0"),
    ({"model": {**GPT2, "transformers_version": "4.0.0"}}, "model.transformers_version"),
    ({"corpus_tokens": 64}, "at least batch_size windows"),
    ({"min_lr": 1.0}, "min_lr"),
    ({"dropout": 0.1}, "unknown config key"),
])
def test_bad_configs_are_config_errors(config, message):
    with pytest.raises(ConfigError, match=message):
        build("test", **config)
    with pytest.raises(ConfigError, match=message):
        registry.parameter_count(NAME, {**PRESETS["test"], **config})


def test_an_init_error_for_modules_and_rope_types_it_does_not_know():
    program = build("test")
    program.model.extra = torch.nn.Bilinear(2, 2, 2)
    with pytest.raises(ProgramError, match="'extra.weight' \\(a Bilinear\\)"):
        program.init(program.model, 0)
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    scaled = build("llama-test", model={**LLAMA, "rope_parameters": rope})
    with pytest.raises(ProgramError, match="rope_type 'default' only, not 'linear'"):
        scaled.init(scaled.model, 0)


def test_without_transformers_the_rest_of_ovt_works_and_the_error_names_the_extra():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from protocol.engine.programs import registry\n"
            "from protocol.errors import ProgramError\n"
            "assert registry.load_program('token-lm', preset='test').name == 'token-lm'\n"
            "for call in (lambda: registry.load_program('hf-causal-lm'),\n"
            "             lambda: registry.parameter_count('hf-causal-lm', None)):\n"
            "    try:\n"
            "        call()\n"
            "    except ProgramError as err:\n"
            "        assert \"pip install -e '.[hf]'\" in str(err), err\n"
            "    else:\n"
            "        raise AssertionError('built without transformers')\n"
            "assert registry.program_source('hf-causal-lm')\n")
    root = Path(__file__).resolve().parents[4]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# -- data and loss -------------------------------------------------------------------------------


def test_examples_are_token_lm_windows_over_the_model_vocabulary():
    program = build("llama-test")
    corpus = token_lm.generate_corpus(program.config["corpus_tokens"], LLAMA["vocab_size"], 0)
    for i in (0, 1, len(program.dataset) - 1):
        example = program.dataset.example(i)
        assert list(example) == ["tokens"]
        assert example["tokens"].dtype == torch.int64 and example["tokens"].shape == (17,)
        assert example["tokens"].tolist() == corpus[16 * i:16 * i + 17].tolist()


@pytest.mark.parametrize("preset", ["test", "llama-test"])
def test_loss_is_the_mean_next_token_cross_entropy(preset):
    program = build(preset)
    program.init(program.model, 0)
    program.model.eval()  # no dropout, so the two forward passes compute the same
    tokens = batch(program)["tokens"]  # (B, T + 1)
    with torch.no_grad():
        loss = program.loss(program.model, {"tokens": tokens})
        logits = program.model(input_ids=tokens[:, :-1]).logits  # (B, T, vocab)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)
    assert 0.9 * math.log(64) < float(loss) < 1.1 * math.log(64)  # near-uniform at init


# -- portable init -------------------------------------------------------------------------------


def test_gpt2_init_matches_a_naive_reference_drawn_straight_from_the_streams():
    program = build("test")
    program.init(program.model, 7)
    sd = program.model.state_dict()

    def normal(name: str, std: float) -> torch.Tensor:
        return RandomStream(7, "init", name).normal(tuple(sd[name].shape), 0.0, std)

    residual = 0.02 / math.sqrt(2 * GPT2["n_layer"])
    assert torch.equal(sd["transformer.wte.weight"], normal("transformer.wte.weight", 0.02))
    assert torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])  # set once, tied
    assert torch.equal(sd["transformer.wpe.weight"], normal("transformer.wpe.weight", 0.02))
    for layer in range(GPT2["n_layer"]):
        h = f"transformer.h.{layer}"
        assert torch.equal(sd[f"{h}.attn.c_attn.weight"], normal(f"{h}.attn.c_attn.weight", 0.02))
        assert torch.equal(sd[f"{h}.mlp.c_fc.weight"], normal(f"{h}.mlp.c_fc.weight", 0.02))
        for proj in (f"{h}.attn.c_proj.weight", f"{h}.mlp.c_proj.weight"):
            assert torch.equal(sd[proj], normal(proj, residual))
        for norm in ("ln_1", "ln_2"):
            assert torch.equal(sd[f"{h}.{norm}.weight"], torch.ones(GPT2["n_embd"]))
    biases = [k for k in sd if k.endswith(".bias")]
    assert biases and all(not sd[k].any() for k in biases)


def test_llama_init_sets_norms_and_computes_the_rotary_frequencies_portably():
    program = build("llama-test")
    native = {n: b.clone() for n, b in program.model.named_buffers()}
    assert set(native) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    assert not set(native) & set(program.model.state_dict())  # non-persistent
    for buffer in program.model.buffers():
        buffer.fill_(0)  # init must set them
    program.init(program.model, 3)
    sd = program.model.state_dict()
    name = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(sd[name], RandomStream(3, "init", name).normal((16, 32), 0.0, 0.02))
    assert torch.equal(sd["model.norm.weight"], torch.ones(32))
    head_dim = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    # transformers' own formula, computed natively here: the same bits for these sizes
    expected = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    for name, buffer in program.model.named_buffers():
        assert torch.equal(buffer, expected), name


@pytest.mark.parametrize("preset", ["test", "llama-test"])
def test_init_is_bit_identical_across_builds_and_thread_counts_and_depends_on_the_seed(preset):
    threads = torch.get_num_threads()
    states = []
    try:
        for count, seed in ((1, 5), (2, 5), (2, 6)):
            torch.set_num_threads(count)
            program = build(preset)
            program.init(program.model, seed)
            states.append({k: v.clone() for k, v in program.model.state_dict().items()})
    finally:
        torch.set_num_threads(threads)
    one, two, other = states
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert any(not torch.equal(one[k], other[k]) for k in one)


# -- replay across profiles ----------------------------------------------------------------------

POLICY = PrecisionPolicy()


def executor(program, profile: str, micro_batches: int = 1, mode: str = "ovt") -> Executor:
    return Executor(program, seed=0, policy=POLICY, profile=PROFILES[profile], mode=mode,
                    micro_batches=micro_batches)


@dataclasses.dataclass
class Recording:
    state0: dict[str, torch.Tensor]
    logs: list
    hashes: list[bytes]


def record(preset: str, steps: int, config: dict | None = None, weights: Path | None = None,
           micro_batches: int = 1) -> Recording:
    trainer = executor(build(preset, **(config or {})), "cpu-2t", micro_batches)
    trainer.init_state(1, weights=weights)
    state0, logs, hashes = trainer.state(), [], [state_digest(trainer.state())]
    for _ in range(steps):
        result = trainer.step()
        assert math.isfinite(result.loss) and result.log.n_entries > 0
        logs.append(result.log)
        hashes.append(state_digest(trainer.state()))
    assert len(set(hashes)) == steps + 1  # every step changed the state
    return Recording(state0, logs, hashes)


def replay(run: Recording, preset: str, profile: str, config: dict | None = None,
           micro_batches: int = 1) -> list[bytes]:
    auditor = executor(build(preset, **(config or {})), profile, micro_batches)
    auditor.load_state(run.state0)
    hashes = [state_digest(auditor.state())]
    for log in run.logs:
        auditor.step(log)
        hashes.append(state_digest(auditor.state()))
    return hashes


@pytest.fixture(scope="module")
def recordings():
    runs: dict[tuple[str, int], Recording] = {}

    def get(preset: str, steps: int) -> Recording:
        if (preset, steps) not in runs:
            runs[preset, steps] = record(preset, steps)
        return runs[preset, steps]
    return get


FAST_CASES = [("test", "emulated-gpu"), ("test", "adversary"),
              ("llama-test", "emulated-gpu"), ("llama-test", "adversary")]
SLOW_CASES = [(preset, profile) for preset in ("test", "llama-test")
              for profile in ("cpu-1t", "emulated-gpu", "splitk-8", "reversed", "adversary",
                              "adversary-gpu")]


@pytest.mark.parametrize("preset,profile", FAST_CASES)
def test_replay_is_bit_exact(recordings, preset, profile):
    run = recordings(preset, FAST_STEPS)
    assert replay(run, preset, profile) == run.hashes


@pytest.mark.slow
@pytest.mark.parametrize("preset,profile", SLOW_CASES)
def test_replay_is_bit_exact_for_20_steps(recordings, preset, profile):
    run = recordings(preset, SLOW_STEPS)
    assert replay(run, preset, profile) == run.hashes


def test_eager_attention_replays_bit_exactly_too():
    config = {"model": {**GPT2, "attn_implementation": "eager"}}
    assert build("test", **config).model.config._attn_implementation == "eager"
    run = record("test", 1, config)
    assert replay(run, "test", "emulated-gpu", config) == run.hashes


def test_s0_ships_llamas_rotary_frequencies(recordings):
    state0 = recordings("llama-test", FAST_STEPS).state0
    assert {"model.model.rotary_emb.inv_freq", "model.model.rotary_emb.original_inv_freq"} \
        <= set(state0)


def _fine_tune(tmp_path: Path, preset: str, steps: int, auditors: tuple[str, ...]) -> None:
    source = build(preset, **FINE_TUNE)
    source.init(source.model, 11)
    source.model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    run = record(preset, steps, FINE_TUNE, weights=tmp_path, micro_batches=4)
    saved = source.model.state_dict()
    assert all(torch.equal(run.state0[f"model.{k}"], v) for k, v in saved.items())
    for profile in auditors:
        assert replay(run, preset, profile, FINE_TUNE, micro_batches=4) == run.hashes, profile


def test_fine_tune_from_save_pretrained_with_schedule_clipping_and_micro_batches(tmp_path):
    _fine_tune(tmp_path, "test", FAST_STEPS, ("emulated-gpu",))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["test", "llama-test"])
def test_fine_tune_for_20_steps(tmp_path, preset):
    _fine_tune(tmp_path, preset, SLOW_STEPS, ("emulated-gpu", "adversary"))


@pytest.mark.parametrize("preset", ["test", "llama-test"])
def test_plain_float32_diverges_between_cpu_and_an_emulated_gpu(preset):
    hashes = []
    for profile in ("cpu-2t", "emulated-gpu"):
        plain = executor(build(preset), profile, mode="plain")
        plain.init_state(1)
        first = state_digest(plain.state())
        plain.step()
        hashes.append((first, state_digest(plain.state())))
    (s0_a, s1_a), (s0_b, s1_b) = hashes
    assert s0_a == s0_b and s1_a != s1_b
