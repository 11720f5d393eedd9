"""load_program and program_source: built-ins, module refs, file refs and every failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.engine.programs import char_transformer, hf_causal_lm, image_cnn, registry, token_lm
from protocol.engine.programs.base import TrainingProgram
from protocol.errors import ConfigError, ProgramError
from tests.protocol.engine.programs import user_program_example

USER = "tests.protocol.engine.programs.user_program_example"

FILE_PROGRAM = '''
from dataclasses import dataclass

from protocol.engine.programs import char_transformer

PRESETS = {"short": {"corpus_chars": 300}}


@dataclass(frozen=True)
class Small:
    d_model: int = 16


def build(config=None):
    return char_transformer.build({"d_model": Small().d_model, "n_heads": 2, "seq_len": 8,
                                   "batch_size": 2, **(config or {})})
'''


@pytest.fixture
def program_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_program.py"
    path.write_text(FILE_PROGRAM)
    return path


@pytest.mark.parametrize("name", ["image-cnn", "char-transformer"])
def test_builtins_load(name):
    program = registry.load_program(name)
    assert isinstance(program, TrainingProgram)
    assert program.name == name


def test_builtin_table():
    assert registry.BUILTIN == {"image-cnn": image_cnn.build,
                                "char-transformer": char_transformer.build,
                                "token-lm": token_lm.build,
                                "hf-causal-lm": hf_causal_lm.build}


def test_preset_is_merged_under_the_explicit_config():
    program = registry.load_program("image-cnn", {"channels": 8}, preset="bench")
    assert program.config["channels"] == 8
    assert program.config["image_size"] == image_cnn.PRESETS["bench"]["image_size"]
    assert program.batch_size == image_cnn.PRESETS["bench"]["batch_size"]


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="no preset 'huge'.*test, bench"):
        registry.load_program("char-transformer", preset="huge")


def test_module_function_ref():
    program = registry.load_program(f"{USER}:build", {"classes": 3}, preset="tiny")
    assert program.name == "image-cnn"
    assert program.config["channels"] == 2
    assert program.config["classes"] == 3
    assert program.config["image_size"] == 8


def test_file_function_ref(program_file):
    program = registry.load_program(f"{program_file}:build", preset="short")
    assert program.name == "char-transformer"
    assert program.config["d_model"] == 16
    assert program.config["corpus_chars"] == 300
    again = registry.load_program(f"{program_file}:build")
    assert again.config["corpus_chars"] == char_transformer.CharTransformerConfig().corpus_chars


@pytest.mark.parametrize("ref, message", [
    ("no-such-program", "unknown program 'no-such-program'.*image-cnn, char-transformer"),
    ("image-cnn:build", "cannot import 'image-cnn'"),
    ("no_such_package.module:build", "cannot import 'no_such_package.module'"),
    (f"{USER}:missing", "has no function 'missing'"),
    (f"{USER}:NOT_CALLABLE", "has no function 'NOT_CALLABLE'"),
    (f"{USER}:not_a_program", "returned dict, not a TrainingProgram"),
    (f"{USER}:broken", "failed to build: RuntimeError: this program is broken"),
    (f"{USER}:", "unknown program"),
    ("/no/such/file.py:build", "no such file"),
])
def test_failures_are_program_errors(ref, message):
    with pytest.raises(ProgramError, match=message):
        registry.load_program(ref)


def test_file_that_fails_to_import(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def build(config):\n    return (\n")
    with pytest.raises(ProgramError, match="error while loading.*SyntaxError"):
        registry.load_program(f"{path}:build")


def test_config_errors_of_the_factory_pass_through():
    with pytest.raises(ConfigError, match="unknown config key"):
        registry.load_program(f"{USER}:build", {"no_such_key": 1})


def test_program_source_of_a_builtin_is_its_module():
    assert registry.program_source("image-cnn") == Path(image_cnn.__file__).read_bytes()
    assert registry.program_source("char-transformer") == \
        Path(char_transformer.__file__).read_bytes()


def test_program_source_of_module_and_file_refs(program_file):
    expected = Path(user_program_example.__file__).read_bytes()
    assert registry.program_source(f"{USER}:build") == expected
    assert registry.program_source(f"{program_file}:build") == FILE_PROGRAM.encode()


@pytest.mark.parametrize("ref", ["no-such-program", "no_such_package.module:build",
                                 "/no/such/file.py:build"])
def test_program_source_failures(ref):
    with pytest.raises(ProgramError):
        registry.program_source(ref)


def test_parameter_count_is_known_for_built_ins_only():
    assert registry.parameter_count("image-cnn", {}) == image_cnn.parameter_count({})
    assert registry.parameter_count("char-transformer", {"d_model": 32}) == \
        char_transformer.parameter_count({"d_model": 32})
    assert registry.parameter_count(f"{USER}:build", {}) is None  # only building it tells
