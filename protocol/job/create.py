"""Making a job: a `JobSpec` and its S_0 from a job file; loading the program a spec names.

A user writes a small TOML file (program, config, steps, seed, precision, intervals, and
optionally a data file); `create_job` turns it into a `JobSpec` by loading the program, hashing
its source, committing to its dataset (or the data file's examples) and producing the initial
state S_0 once, from the portable generator or from pretrained weights (SPEC §3.4: S_0 is
committed by `h_0` and shipped, never re-derived on another machine).
`job_id = sha256(canonical JobSpec)`.

Example job file:

    program = "char-transformer"     # built-in, package.module:function or file.py:function
    preset = "test"                  # optional size preset of a built-in
    steps = 200
    seed = 0                         # data order and dropout
    init_seed = 1                    # S_0 (used once, at creation)
    checkpoint_interval = 50
    commit_interval = 50
    micro_batches = 1                # optional: gradients summed over this many parts of a batch
    init_from = "pretrained"         # optional: S_0's model from a safetensors file or a
                                     # save_pretrained folder (relative to this file), not init_seed
    [config]                         # program config overrides
    lr = 0.003
    [precision]                      # optional; these are the defaults
    compute = "float64"
    target = "float32"
    [data]                           # optional: train on a file instead of the program's data
    kind = "tokens"                  # a flat token file: .bin (raw little-endian) or .npy
    path = "data/train.bin"          # relative to this job file's folder (no "..", no "/x")
    dtype = "uint16"                 # .bin only: "uint16" or "int32" (a .npy's header says)
    window = 32                      # example i = tokens[i*window : i*window + window + 1]

or, for a safetensors file of named tensors sharing their first dimension (example i is
{name: t[i]}, e.g. "image" (N, 3, 16, 16) float32 and "label" (N,) int64 for image-cnn):

    [data]
    kind = "tensors"
    path = "data/train.safetensors"

A data file's examples must have the field names, dtypes and shapes of the program's own
(char-transformer and token-lm take "tokens" windows of seq_len + 1: window = seq_len). The spec
commits to them like to a built-in's (a Merkle root over per-example hashes) and names the file
by its relative path: the trainer and the auditor read it inside the folder their operator gives
with `--data-dir` (`ovt job run|audit --data-dir` here), and refuse a job whose file is not
there, leaves that folder or differs from the committed one. The arbiter never reads it.

Whichever the examples, a node that loads a job's program with its examples checks them against
the spec's data commitment (`require_committed_data`): a spec is a peer's, and a job on examples
that are not the committed ones is one whose batches nobody could prove (SPEC §2.1, §5.3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import tomllib
from pathlib import Path

import torch

from protocol.codec.canonical import digest
from protocol.codec.dtypes import DTYPES
from protocol.codec.fields import abbrev
from protocol.codec.state import state_digest
from protocol.commit.data import DataCommitment
from protocol.commit.merkle import MerkleTree
from protocol.engine.dataparallel import Recipe, WorkerGroup, require_world
from protocol.engine.datasets import (
    TOKENS,
    AbsentExamples,
    DataFile,
    commit_examples,
    normal_path,
    npy_token_dtype,
    open_data_file,
    require_same_fields,
    require_token_ids_below,
    resolve_data_path,
)
from protocol.engine.executor import Executor
from protocol.engine.precision import RULES_VERSION, PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.base import TrainingProgram
from protocol.engine.programs.registry import (
    BUILTIN,
    load_program,
    parameter_count,
    program_source,
)
from protocol.errors import ConfigError, ProgramError, ResourceLimitError
from protocol.job.spec import JobSpec, count, typed

DEFAULT_MAX_PARAMS = 2**28  # the largest built-in model a peer's spec may ask for (1 GiB f32)
# The most examples a job's data may hold. Every party builds each epoch's data order, a
# permutation of them all (about 40 bytes an example while it is made: 10 GiB at this bound),
# from the count in the spec, a peer's: the arbiter, which reads no data file, only from it.
MAX_EXAMPLES = 2**28
_JOB_KEYS = {"program", "preset", "steps", "seed", "init_seed", "checkpoint_interval",
             "commit_interval", "micro_batches", "init_from", "config", "precision", "data"}
_PRECISION_KEYS = {"compute", "target", "rules"}
_DATA_KEYS = {"tokens": {"kind", "path", "dtype", "window"}, "tensors": {"kind", "path"}}


def load_job_program(spec: JobSpec, data_dir: Path | None = None, *,
                     examples: bool = True) -> TrainingProgram:
    """Load the program `spec` names, after checking its source is the one committed to, with
    the examples `spec.data` commits to (`require_committed_data`).

    A job with a data file trains on the file's examples instead of the program's own: the file
    is read inside `data_dir` (the folder this node's operator offers) and checked to have the
    fields of the program's own examples. With `examples=False` (the arbiter: it takes each
    batch's examples from the parties, checked against `spec.data`) the file is not read, and
    the program's dataset cannot be read either; only the commitment's count is checked.

    Raises ProgramError if the source differs (or the program cannot be loaded), ConfigError if
    its config is not valid for it, for a data file that `data_dir` is None for, that leaves
    `data_dir`, is missing or unreadable or has other fields, and for examples that are not
    the committed ones.
    """
    check_program_source(spec)
    program = load_program(spec.program, spec.config)
    if spec.data_file is not None and not examples:
        program = dataclasses.replace(program,
                                      dataset=AbsentExamples(spec.data_file, spec.data.count))
    elif spec.data_file is not None:
        locate_data_file(spec, data_dir)
        assert data_dir is not None  # locate_data_file refuses a job with a data file without one
        program = with_data_file(program, spec.data_file, data_dir)
    require_committed_data(spec, program, read=examples)
    return program


def locate_data_file(spec: JobSpec, data_dir: Path | None) -> Path | None:
    """Where this node finds `spec`'s data file inside `data_dir` (None for a job on its
    program's own dataset): a cheap check, before anything is read or built. Raises
    ConfigError when this node offers no data folder (a peer's spec must never make a node read
    a file its operator did not offer), the path leaves the folder, or no file is there."""
    if spec.data_file is None:
        return None
    shown = f"{spec.data_file.describe()} of job {spec.job_id.hex()[:16]}…"
    if data_dir is None:
        raise ConfigError(f"{shown} cannot be read: this node was given no data folder "
                          f"(--data-dir) to find it in")
    path = resolve_data_path(data_dir, spec.data_file.path)
    if not path.is_file():
        raise ConfigError(f"{shown} is not in the data folder {data_dir}")
    return path


def with_data_file(program: TrainingProgram, data_file: DataFile,
                   data_dir: Path) -> TrainingProgram:
    """`program` with the examples of `data_file` (inside `data_dir`) as its dataset. Raises
    ConfigError for a bad file, examples with other fields than the program's own, token ids
    beyond the program's vocabulary, or fewer examples than one batch."""
    source = open_data_file(data_file, data_dir)
    shown = data_file.describe()
    require_same_fields(source, program.dataset, shown)
    if program.vocab_size is not None:
        require_token_ids_below(source, program.vocab_size, shown)
    if len(source) < program.batch_size:
        raise ConfigError(f"{shown} holds {len(source)} examples, fewer than one batch of "
                          f"{program.batch_size}")
    return dataclasses.replace(program, dataset=source)


def require_committed_data(spec: JobSpec, program: TrainingProgram, *,
                           read: bool = True) -> None:
    """`program`'s dataset (its own or, for a job with a data file, the file's examples) is
    the one `spec.data` commits to (SPEC §2.1): root and count. A party trains and replays only
    on the committed examples, since they are what it must prove B_i against in a dispute
    (SPEC §5.3): a job on other examples would leave the honest auditor's challenge unprovable.

    The count comes first, cheaply: it must be the dataset's and at most MAX_EXAMPLES (every
    party builds the data order from it). Then, with `read`, the root, from every example's
    hash, remembered (`commit_job_examples`), since a node loads a job
    again for every regenerated state and escalated audit (0.01-0.6 s each for the bundled
    presets); `read=False` where the examples are not had (the arbiter's `AbsentExamples`) or
    not hashed here. `program` is `spec`'s as `load_job_program` loads it.

    Raises ConfigError naming the dataset when it is not the committed one.
    """
    committed = spec.data
    shown = spec.data_file.describe() if spec.data_file is not None else \
        f"the dataset of program {spec.program!r}"
    _require_example_count(committed.count, f"the data commitment of job "
                                           f"{spec.job_id.hex()[:16]}…")
    if len(program.dataset) != committed.count:
        raise ConfigError(f"{shown} holds {len(program.dataset)} examples, but the job commits "
                          f"to {committed.count}")
    if not read:
        return
    data, _ = commit_job_examples(spec, program)
    if data != committed:
        raise ConfigError(f"{shown} differs from the one this job committed to (its examples "
                          f"give root {abbrev(data.root)} over {data.count}, the job's is "
                          f"{abbrev(committed.root)} over {committed.count})")


def commit_job_examples(spec: JobSpec, program: TrainingProgram
                        ) -> tuple[DataCommitment, MerkleTree]:
    """The commitment to `program`'s examples (`spec`'s program as `load_job_program` loads
    it) and its Merkle tree, remembered (`commit_examples`): a data file while it is unchanged,
    a built-in's own dataset by its program, source and config — a function of its code (the
    source `spec` commits to, which `check_program_source` checks) and its config alone. A user
    program's own dataset is hashed each time (its code may read anything)."""
    builtin = spec.data_file is None and spec.program in BUILTIN
    return commit_examples(program.dataset, (spec.program, spec.program_source_hash,
                                             digest(spec.config)) if builtin else None)


def _require_example_count(examples: int, shown: str) -> None:
    """Refuse data of more than MAX_EXAMPLES examples; `shown` names it. Raises ConfigError."""
    if examples > MAX_EXAMPLES:
        raise ConfigError(f"{shown} counts {examples} examples; at most {MAX_EXAMPLES} are "
                          f"taken (a data order is a permutation of them all)")


def check_program_source(spec: JobSpec) -> None:
    """Check that the source of the program `spec` names is the one the job committed to,
    without loading the program. Raises ProgramError if it differs or cannot be read."""
    digest = hashlib.sha256(program_source(spec.program)).digest()
    if digest != spec.program_source_hash:
        raise ProgramError(f"the source of program {spec.program!r} differs from the one "
                           f"this job committed to ({digest.hex()[:16]}… != "
                           f"{spec.program_source_hash.hex()[:16]}…)")


def require_model_size(spec: JobSpec, max_params: int) -> int | None:
    """Refuse a built-in model of more than `max_params` parameters, counted from the spec's
    config alone, before anything is built (a peer's spec must not make a node allocate what
    it likes). Returns the count; None for a user program, which only building can tell.

    Raises ResourceLimitError over the bound, ConfigError for a config the built-in rejects.
    """
    params = parameter_count(spec.program, spec.config)
    if params is not None and params > max_params:
        raise ResourceLimitError(f"program {spec.program!r} with this config has {params} "
                                 f"parameters; at most {max_params} are taken here "
                                 f"(--max-params)")
    return params


def job_executor(spec: JobSpec, profile: Profile, data_dir: Path | None = None) -> Executor:
    """An executor for `spec`'s program, seed and precision on `profile` (holding no state);
    a data file is read inside `data_dir` (raises as `load_job_program`)."""
    return Executor(load_job_program(spec, data_dir), seed=spec.seed, policy=spec.policy,
                    profile=profile, micro_batches=spec.micro_batches)


def job_workers(spec: JobSpec, profile: Profile, workers: int
                ) -> contextlib.AbstractContextManager[WorkerGroup | None]:
    """The data-parallel worker group for running `spec` with `workers` processes in all (SPEC
    §3.5; a null context for one): give it to `Executor.use_workers` inside its `with`.
    Raises ConfigError for fewer than one process, or more than the job has micro-batches."""
    require_world(workers, spec.micro_batches)
    if workers == 1:
        return contextlib.nullcontext()
    return WorkerGroup(workers, Recipe("protocol.job.create:worker_executor", {
        "spec": spec.to_bytes().hex(), "profile": dataclasses.asdict(profile)}))


def worker_executor(args: dict) -> Executor:
    """A data-parallel worker's executor for a job (`job_workers`' recipe): the spec's program
    without its data file, whose examples rank 0 sends."""
    spec = JobSpec.from_bytes(bytes.fromhex(args["spec"]))
    return Executor(load_job_program(spec, examples=False), seed=spec.seed, policy=spec.policy,
                    profile=Profile(**args["profile"]), micro_batches=spec.micro_batches)


def create_job(job_file: Path) -> tuple[JobSpec, dict[str, torch.Tensor]]:
    """Build a JobSpec and its initial state S_0 from a TOML job file (the format is in the
    module docstring; a [data] path is read relative to the job file's folder). Raises
    ConfigError for a file that cannot be read or holds a bad key or value, a bad data file,
    or a config the program rejects; ProgramError if the program cannot be loaded."""
    try:
        request = tomllib.loads(Path(job_file).read_text())
    except OSError as err:
        raise ConfigError(f"cannot read job file {job_file}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"job file {job_file} is not valid TOML: {err}") from None
    unknown = set(request) - _JOB_KEYS
    if unknown:
        raise ConfigError(f"unknown keys in job file: {', '.join(sorted(unknown))}; "
                          f"allowed: {', '.join(sorted(_JOB_KEYS))}")
    if "program" not in request or "steps" not in request:
        raise ConfigError("a job file needs at least 'program' and 'steps'")
    job_dir = Path(job_file).parent
    return build_job(
        program=typed(request["program"], str, "program"),
        config=typed(request.get("config", {}), dict, "config"),
        preset=request.get("preset"), steps=count(request["steps"], 1, "steps"),
        seed=count(request.get("seed", 0), 0, "seed"),
        init_seed=count(request.get("init_seed", 1), 0, "init_seed"),
        policy=_policy(request.get("precision", {})),
        checkpoint_interval=count(request.get("checkpoint_interval", 50), 1,
                                   "checkpoint_interval"),
        commit_interval=count(request.get("commit_interval", 50), 1, "commit_interval"),
        micro_batches=count(request.get("micro_batches", 1), 1, "micro_batches"),
        data_file=_data_file(request["data"], job_dir) if "data" in request else None,
        data_dir=job_dir,
        init_from=job_dir / typed(request["init_from"], str, "init_from")
        if "init_from" in request else None)


def build_job(*, program: str, config: dict, preset: str | None, steps: int, seed: int,
              init_seed: int, policy: PrecisionPolicy, checkpoint_interval: int,
              commit_interval: int, micro_batches: int = 1,
              data_file: DataFile | None = None, data_dir: Path | None = None,
              init_from: Path | None = None) -> tuple[JobSpec, dict[str, torch.Tensor]]:
    """The JobSpec and S_0 for a program (the library form of `ovt job create`); with
    `data_file`, on the examples of that file inside `data_dir`; with `init_from`, S_0's model
    from those safetensors weights (a file or a `save_pretrained` folder) instead of the
    portable init from `init_seed`.

    Raises ConfigError for a config the program rejects, a batch that does not split into
    `micro_batches` equal parts, a bad data file (as `with_data_file`), more than MAX_EXAMPLES
    examples or weights that do not fit the model; ProgramError if the program cannot be
    loaded.
    """
    instance = load_program(program, config, preset)
    if data_file is not None:
        if data_dir is None:
            raise ConfigError(f"{data_file.describe()}: no folder given to read it in")
        instance = with_data_file(instance, data_file, data_dir)
    _require_example_count(len(instance.dataset), "the job's data")
    ex = Executor(instance, seed=seed, policy=policy, profile=Profile("create"),
                  micro_batches=micro_batches)
    ex.init_state(init_seed, weights=init_from)
    state0 = ex.state()
    data, _ = commit_examples(instance.dataset)
    spec = JobSpec(
        program=program, program_source_hash=hashlib.sha256(program_source(program)).digest(),
        config=dict(instance.config), data=data, h0=state_digest(state0), steps=steps,
        seed=seed, policy=policy, checkpoint_interval=checkpoint_interval,
        commit_interval=commit_interval, micro_batches=micro_batches, data_file=data_file)
    return spec, state0


def _policy(section: dict) -> PrecisionPolicy:
    typed(section, dict, "precision")
    unknown = set(section) - _PRECISION_KEYS
    if unknown:
        raise ConfigError(f"unknown keys in [precision]: {', '.join(sorted(unknown))}")
    try:
        compute = DTYPES[section.get("compute", "float64")]
        target = DTYPES[section.get("target", "float32")]
    except KeyError as err:
        raise ConfigError(f"unknown dtype {err.args[0]!r} in [precision]") from None
    return PrecisionPolicy(compute, target, section.get("rules", RULES_VERSION))


def _data_file(section: dict, job_dir: Path) -> DataFile:
    """The [data] section as a DataFile; a .npy token file's dtype comes from its header."""
    typed(section, dict, "[data]")
    kind = section.get("kind")
    if not isinstance(kind, str) or kind not in _DATA_KEYS:
        raise ConfigError(f"[data] kind must be one of {', '.join(_DATA_KEYS)}, got {kind!r}")
    unknown = set(section) - _DATA_KEYS[kind]
    if unknown:
        raise ConfigError(f"unknown keys in [data] of kind {kind!r}: "
                          f"{', '.join(sorted(unknown))}; allowed: "
                          f"{', '.join(sorted(_DATA_KEYS[kind]))}")
    if "path" not in section:
        raise ConfigError("[data] needs a path (relative to the job file's folder)")
    path = normal_path(section["path"])
    if kind != TOKENS:
        return DataFile(kind, path)
    dtype = section.get("dtype")
    if path.endswith(".npy"):
        shown = f"data file {path!r} ({job_dir / path})"
        header = npy_token_dtype(resolve_data_path(job_dir, path), shown)
        if dtype is not None and dtype != header:
            raise ConfigError(f"[data] dtype is {dtype!r}, but {shown} holds {header} ids")
        dtype = header
    elif dtype is None:
        raise ConfigError("[data] dtype is needed for a .bin token file: uint16 or int32")
    if "window" not in section:
        raise ConfigError("[data] needs a window for a token file (example i is tokens "
                          "[i*window : i*window + window + 1])")
    return DataFile(kind, path, typed(dtype, str, "[data] dtype"),
                    count(section["window"], 1, "[data] window"))
