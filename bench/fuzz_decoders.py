"""Decoder fuzzing (issue 10): every decoder of untrusted bytes, fed random bytes and mutations
of real objects' bytes, may do one of two things only: refuse with ovt's own error (an
`OvtError` subclass), or decode to an object that re-encodes to exactly its input (SPEC §2: one
byte string per value). Anything else — a TypeError, a KeyError, an accepted alias — is a
FINDING, and stops the run of its target with the input that caused it.

`TARGETS` holds one target per decoder: the canonical decoder, `decode_state`,
`load_safetensors`, `safetensors_file_digest` (a submitted S_0, hashed on disk), `decode_log`,
`JobSpec`, `SignedCommitment`, `Claim`, `Challenge`, the transcript, `Verdict` and the evidence
examples. Safetensors has no canonical form (a header may order or pad its entries freely), so
its property is a fixed point instead: what it decodes holds only state dtypes, and saving and
loading it again gives the same bits; the file digest must refuse what `load_safetensors`
refuses and give the h_t of what it loads.

Inputs come from real objects' bytes (each target's seeds), two ways: `single_edits`, every
one-edit mutation worth trying exhaustively (each field of the decoded value swapped for an
alias such as `True` or `1.0`, or a value of another type, and re-encoded canonically, so that
only the decoder's own checks can refuse it; edge integers written at every position of a
binary layout); and `random_input`, a seeded random mutator (a quarter random bytes, the rest
1-4 random edits: flip, set, insert, delete, truncate, an edge integer, a swapped field).
`tests/protocol/test_decoder_fuzz.py` runs the same targets, bounded; this script runs every
single edit and then `--inputs` random inputs per target:

    python bench/fuzz_decoders.py                          # 50,000 random inputs per target
    python bench/fuzz_decoders.py --inputs 2000 --seed 7   # quick
    python bench/fuzz_decoders.py --only transcript,verdict

It prints, per target, the inputs run, how they ended (decoded, or refused by which error) and
the time taken, and exits 1 if any target found an input outside the two allowed outcomes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import safetensors.torch
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.codec.canonical import decode, encode
from protocol.codec.roundinglog import (
    EMPTY_LOG_DIGEST,
    RoundingLog,
    SiteLog,
    decode_log,
    encode_log,
)
from protocol.codec.state import (
    decode_state,
    encode_state,
    load_safetensors,
    safetensors_file_digest,
    state_digest,
    states_equal,
)
from protocol.commit.commitments import Claim, Commitment, SignedCommitment, sign_commitment
from protocol.commit.data import DataCommitment, ProvenExample
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.commit.merkle import MerkleTree
from protocol.dispute import game
from protocol.dispute.challenge import Challenge
from protocol.dispute.evidence import decode_examples, encode_examples
from protocol.dispute.reexecute import Reexecution
from protocol.dispute.transcript import decode_transcript, encode_transcript, transcript_bytes
from protocol.dispute.verdict import Verdict, sign_verdict
from protocol.engine.datasets import DataFile
from protocol.engine.precision import PrecisionPolicy
from protocol.errors import OvtError, StateFormatError
from protocol.job.spec import JobSpec

EDITS = ("flip", "set", "insert", "delete", "truncate", "word", "value")
Edit = tuple[str, int, int]  # (kind, position, choice): see `mutate`
MSGPACK, SAFETENSORS, BINARY = "msgpack", "safetensors", "binary"  # a target's byte layout
FINDING = "FINDING"
T = TypeVar("T")  # what a target decodes
DROP = object()  # a "value" edit's replacement that removes the node from its map or list
# Integers at the edges of the widths a binary layout uses (AFL's "interesting values").
WORDS = [(width, value) for width in (1, 2, 4, 8)
         for value in (0, 1, 2**(8 * width - 1) - 1, 2**(8 * width - 1), 2**(8 * width) - 1)]
# What a "value" edit puts in place of one node of a decoded msgpack value: the aliases of an
# int, values of every other type, the edges of the int range, and two bad records.
MSGPACK_VALUES: list[object] = [
    True, False, None, 0, 1, -1, 1.0, 0.5, float("inf"), 2**63 - 1, 2**63, 2**64 - 1, -(2**63),
    "", "trainer", "start", b"", bytes(32), [], [1], {}, {"type": []}, {"type": "question"},
    DROP]
# ... and of one node of a safetensors header (JSON): every dtype safetensors knows, shapes and
# offsets torch cannot hold.
JSON_VALUES: list[object] = [
    True, None, 0, 1, -1, 1.5, 2**62, 2**63, 2**64 - 1, 2**64, "", "F32", "F64", "BF16", "F16",
    "I64", "I32", "I16", "I8", "U8", "BOOL", "U16", "U32", "U64", "C64", "F8_E4M3", "F8_E5M2",
    "F8_E8M0", "F4", [], [0], [0, 2**64 - 1], [2**62, 2**62, 0], [0, 8], {}, DROP]


@dataclass(frozen=True)
class Target(Generic[T]):
    """One decoder of untrusted bytes: `decode` it, and `check(obj, data)` what it decoded (a
    description of what is wrong, or None), starting mutations from `seeds()` (real objects'
    bytes) laid out as `layout` (which "value" edits follow)."""

    name: str
    decode: Callable[[bytes], T]
    check: Callable[[T, bytes], str | None]
    seeds: Callable[[], list[bytes]]
    layout: str


def outcome(target: Target, data: bytes) -> str:
    """How `target` ended on `data`: "decoded" (and the check holds), "refused: <the ovt
    error>", or "FINDING: ..." for anything else: an exception that is not ovt's own, or a
    decoded object that fails its check (an alias)."""
    try:
        obj = target.decode(data)
    except OvtError as err:
        return f"refused: {type(err).__name__}"
    except Exception as err:  # noqa: BLE001 - the finding this fuzzer exists to report
        return f"{FINDING}: {_line(err)}"
    try:
        problem = target.check(obj, data)
    except Exception as err:  # noqa: BLE001 - as above: a decoded object that breaks its check
        return f"{FINDING}: checking the decoded object raised {_line(err)}"
    return "decoded" if problem is None else f"{FINDING}: {problem}"


def _line(err: Exception) -> str:
    """An exception in one line (torch's messages carry a C++ stack trace)."""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"


def is_allowed(result: str) -> bool:
    """One of the two allowed outcomes: decoded to itself, or refused by ovt's own error."""
    return not result.startswith(FINDING)


def mutate(data: bytes, edits: Sequence[Edit], layout: str = BINARY) -> bytes:
    """`data` with `edits` applied in order; positions wrap around the current length.

    Byte edits: flip (xor with `choice`), set, insert, delete, truncate; "word" writes an
    integer of WORDS (little-endian) over the bytes at the position; "value" replaces one node
    (the position-th, pre-order) of the decoded value with MSGPACK_VALUES[choice] (a msgpack
    layout, descending into bytes that are canonical encodings themselves, as signed
    commitments inside a challenge are) or of the header with JSON_VALUES[choice]
    (safetensors), and re-encodes it, so the result is well formed and only the decoder's own
    checks can refuse it; on a binary layout, or bytes that no longer parse, it is a "word".
    """
    out = bytes(data)
    for kind, position, choice in edits:
        if kind == "value" and layout != BINARY:
            edited = _edit_value(out, position, choice, layout)
            if edited is not None:
                out = edited
                continue
            kind = "word"
        out = _edit_bytes(out, kind, position, choice)
    return out


def _edit_bytes(data: bytes, kind: str, position: int, choice: int) -> bytes:
    out = bytearray(data)
    at = position % (len(out) + 1)
    if kind == "insert":
        out[at:at] = bytes([choice])
    elif kind == "truncate":
        del out[at:]
    elif kind == "word":
        width, value = WORDS[choice % len(WORDS)]
        out[at:at + width] = value.to_bytes(width, "little")
    elif out:
        at %= len(out)
        if kind == "delete":
            del out[at]
        else:
            out[at] = out[at] ^ (choice or 1) if kind == "flip" else choice
    return bytes(out)


def _edit_value(data: bytes, position: int, choice: int, layout: str) -> bytes | None:
    """`data` with one node of its decoded value replaced (see `mutate`); None if it does not
    parse or the edit cannot be encoded."""
    if layout == MSGPACK:
        value = _decoded(data)
        if value is None:
            return None
        new = MSGPACK_VALUES[choice % len(MSGPACK_VALUES)]
        edited, _ = _replace(value, position % _nodes(data, MSGPACK), new, _nested)
        return None if edited is DROP else encode(edited)
    if len(data) < 8:
        return None
    size = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + size])
    except ValueError:
        return None
    new = JSON_VALUES[choice % len(JSON_VALUES)]
    edited, _ = _replace(header, position % _count(header, _never), new, _never)
    if edited is DROP:
        return None
    text = json.dumps(edited, separators=(",", ":")).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + size:]


def single_edits(target: Target) -> Iterator[bytes]:
    """Every one-edit mutation of every seed that is worth trying exhaustively: on a msgpack
    layout, each node of the decoded value replaced by each of MSGPACK_VALUES; on a safetensors
    layout, each node of the header by each of JSON_VALUES, and each WORDS integer written at
    each position of the header; on a binary layout, each WORDS integer at each position."""
    for seed in target.seeds():
        if target.layout == BINARY:
            words = range(len(seed))
        elif target.layout == SAFETENSORS:
            words = range(8 + int.from_bytes(seed[:8], "little"))
        else:
            words = range(0)
        for position in words:
            for choice in range(len(WORDS)):
                yield _edit_bytes(seed, "word", position, choice)
        if target.layout != BINARY:
            values = MSGPACK_VALUES if target.layout == MSGPACK else JSON_VALUES
            for node in range(_nodes(seed, target.layout)):
                for choice in range(len(values)):
                    edited = _edit_value(seed, node, choice, target.layout)
                    if edited is not None:
                        yield edited


@functools.lru_cache(maxsize=1024)
def _nodes(data: bytes, layout: str) -> int:
    """Nodes of the value a well-formed msgpack or safetensors `data` holds (`_count`)."""
    if layout == MSGPACK:
        return _count(_decoded(data), _nested)
    size = int.from_bytes(data[:8], "little")
    return _count(json.loads(data[8:8 + size]), _never)


def _nested(value: object) -> object | None:
    """The map or list that `value` encodes canonically, if it is such bytes, else None."""
    if type(value) is not bytes or not value or value[0] not in _CONTAINER_BYTES:
        return None
    return _decoded(value)


@functools.lru_cache(maxsize=1024)
def _decoded(data: bytes) -> object | None:
    """`decode(data)` if it is a map or a list, else None (cached: `_replace` never mutates
    what it walks, and the same seeds are walked over and over)."""
    try:
        value = decode(data)
    except OvtError:
        return None
    return value if isinstance(value, dict | list) else None


def _never(value: object) -> None:
    return None


# msgpack's first bytes of a map or an array (fixmap, fixarray, map16/32, array16/32)
_CONTAINER_BYTES = frozenset([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])


def _count(value: object, nested: Callable[[object], object | None]) -> int:
    """Nodes of `value`, pre-order, counting into `nested` encodings."""
    inner = nested(value)
    if inner is not None:
        return 1 + _count(inner, nested)
    if isinstance(value, dict):
        return 1 + sum(_count(v, nested) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_count(v, nested) for v in value)
    return 1


def _replace(value: object, index: int, new: object,
             nested: Callable[[object], object | None]) -> tuple[object, int]:
    """`value` with node `index` (pre-order, as `_count` numbers them) replaced by `new`;
    returns it and what is left of the index (negative once replaced)."""
    if index == 0:
        return new, -1
    index -= 1
    inner = nested(value)
    if inner is not None:
        edited, index = _replace(inner, index, new, nested)
        return (value if index >= 0 else value if edited is DROP else encode(edited)), index
    if isinstance(value, dict | list):
        items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        kept = []
        for key, item in items:
            if index >= 0:
                item, index = _replace(item, index, new, nested)
            if item is not DROP:
                kept.append((key, item))
        return (dict(kept) if isinstance(value, dict) else [item for _, item in kept]), index
    return value, index


# ---- the property of each kind of decoder ---------------------------------------------------

def reencodes(encode_obj: Callable[[T], bytes]) -> Callable[[T, bytes], str | None]:
    """The property of a canonical decoder: the object re-encodes to exactly its input."""
    def check(obj: T, data: bytes) -> str | None:
        if encode_obj(obj) != data:
            return f"decoded a {type(obj).__name__} that re-encodes to other bytes (an alias)"
        return None
    return check


def _safetensors_fixed_point(state: object, data: bytes) -> str | None:
    """What `load_safetensors` accepted holds only state dtypes (`state_digest` raises a
    TypeError for any other) and survives a save and a load bit for bit."""
    if not isinstance(state, dict):
        return f"decoded a {type(state).__name__}, not a state"
    state_digest(state)
    if not states_equal(load_safetensors(safetensors.torch.save(state)), state):
        return "a loaded safetensors state does not survive a save and a load"
    return None


def _file_digest_as_loaded(data: bytes) -> bytes:
    """`safetensors_file_digest` of `data` written to a file; it must refuse `data` exactly
    when `load_safetensors` does (its StateFormatError stands; refusing what loads raises an
    AssertionError, a finding)."""
    with tempfile.NamedTemporaryFile(prefix="ovt-fuzz-", suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        try:
            return safetensors_file_digest(f.name)
        except StateFormatError:
            load_safetensors(data)  # raises StateFormatError too, or the finding is below
            raise AssertionError("the file digest refuses a state load_safetensors takes") \
                from None


def _digest_of_the_loaded_state(digest: object, data: bytes) -> str | None:
    """The file digest is the h_t of the state `load_safetensors` loads (which must load)."""
    if digest != state_digest(load_safetensors(data)):
        return "the file digest differs from the loaded state's h_t"
    return None


# ---- seeds: real objects' bytes --------------------------------------------------------------

def _key(n: int) -> KeyPair:
    return KeyPair(Ed25519PrivateKey.from_private_bytes(bytes([n]) * 32))


def _h(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def _state() -> dict[str, torch.Tensor]:
    return {"model.w": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7,
            "model.bf": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
            "model.mask": torch.tensor([True, False, True]),
            "model.empty": torch.zeros(0, 4, dtype=torch.float64),
            "step": torch.tensor(3, dtype=torch.int64)}


def _log() -> RoundingLog:
    return RoundingLog((SiteLog(5, np.array([0, 3]), np.array([True, False])),
                        SiteLog(0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)),
                        SiteLog(300, np.array([1, 200, 299]), np.array([True, True, False]))))


def _value_logs() -> list[RoundingLog]:
    """Logs with value entries (format v2): in the first, a middle and the last site, next to
    direction entries and in a site without them, bits from 0 to 2**32 - 1; and one whose only
    entries are value entries."""
    none, no_up = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    return [
        RoundingLog((
            SiteLog(5, np.array([0, 3]), np.array([True, False]),
                    np.array([1, 4]), np.array([0x3F80, 0], dtype=np.uint32)),
            SiteLog(0, none, no_up),
            SiteLog(200, none, no_up, np.array([7]), np.array([0xFFFF], dtype=np.uint32)),
            SiteLog(300, np.array([1, 200, 299]), np.array([True, True, False]),
                    np.array([0, 150, 298]), np.array([2**32 - 1, 0x7FC0, 1], dtype=np.uint32)),
        )),
        RoundingLog((SiteLog(3, none, no_up), SiteLog(2**40, none, no_up,
                                                      np.array([2**40 - 1]),
                                                      np.array([0xBF80], dtype=np.uint32)))),
    ]


N, D = 8, 3  # the dispute's job has N steps; the auditor's leaves differ from step D on


def _spec() -> JobSpec:
    return JobSpec(program="image-cnn", program_source_hash=_h("source"),
                   config={"image_size": 8, "lr": 0.1, "name": "tiny", "flags": [True, None]},
                   data=DataCommitment(_h("data"), 64), h0=state_digest(_state()), steps=N,
                   seed=3, policy=PrecisionPolicy(), checkpoint_interval=4, commit_interval=4)


def _data_file_spec() -> JobSpec:
    """A spec on a user's token file (`protocol.engine.datasets.DataFile`)."""
    return dataclasses.replace(_spec(), data_file=DataFile("tokens", "data/train.bin", "uint16",
                                                           64))


@dataclass(frozen=True)
class _Party:
    leaves: list[Leaf]
    tree: MerkleTree
    key: KeyPair
    signed: SignedCommitment

    def claim(self, spec: JobSpec, step: int) -> Claim:
        leaf = self.leaves[step]
        return Claim(spec.job_id, step, leaf.state_hash, leaf.log_hash,
                     tuple(self.tree.proof(step)), self.tree.size)


def _party(spec: JobSpec, role: str, last: int, diverge_at: int, key: int) -> _Party:
    leaves = [Leaf(0, spec.h0, EMPTY_LOG_DIGEST)] + [
        Leaf(t, _h(role if t >= diverge_at else "agreed", t), _h("log", t))
        for t in range(1, last + 1)]
    tree, keypair = MerkleTree([leaf.hash for leaf in leaves]), _key(key)
    commitment = Commitment(spec.job_id, last, tree.root, leaves[-1].state_hash,
                            keypair.public_key, role, 1_700_000_000)
    return _Party(leaves, tree, keypair, sign_commitment(commitment, keypair))


@functools.cache
def _dispute() -> tuple[JobSpec, _Party, _Party, Challenge]:
    spec = _spec()
    trainer = _party(spec, game.TRAINER, N, D, 1)
    auditor = _party(spec, game.AUDITOR, N, D, 2)
    challenge = Challenge(spec.job_id, N, "state hash differs from the trainer's",
                          trainer.signed, trainer.claim(spec, N), auditor.signed,
                          auditor.claim(spec, N), trainer.claim(spec, 0), auditor.claim(spec, 0))
    return spec, trainer, auditor, challenge


def _played(silent_auditor: bool) -> game.GameState:
    """The challenge's game: bisected to its end, or (`silent_auditor`) until the auditor
    misses a deadline after one round."""
    spec, trainer, auditor, c = _dispute()
    state = game.start(spec, c.trainer_commitment, c.auditor_commitment, c.step,
                       trainer_key=trainer.key.public_key, auditor_key=auditor.key.public_key,
                       trainer_leaf=c.trainer_leaf, auditor_leaf=c.auditor_leaf,
                       trainer_leaf0=c.trainer_leaf0, auditor_leaf0=c.auditor_leaf0,
                       now=1000.0, deadline_s=10.0)
    while game.is_running(state):
        state, step = game.ask(state, state.clock + 1.0)
        state = game.answer(state, game.TRAINER, trainer.claim(spec, step), state.clock + 1.0)
        if silent_auditor and game.rounds(state) == 2:
            return game.timeout(state, state.clock + 20.0)
        state = game.answer(state, game.AUDITOR, auditor.claim(spec, step), state.clock + 1.0)
    return state


def _verdicts() -> list[bytes]:
    spec, *_ = _dispute()
    timed_out = sign_verdict(spec, _played(True), None, timings={"total_s": 1.5},
                             bytes_moved={"trainer": 100, "auditor": 90}, key=_key(3),
                             now=1_700_000_100)
    bisected = _played(False)
    d = game.dispute(bisected)
    assert d is not None
    reexec = Reexecution(d.step, "computed", d.auditor.state_hash if d.auditor else _h(), "",
                         None, "cpu-2t", d.agreed.state_hash, d.trainer.log_hash,
                         (_h("example", 0),), 0.25)
    computed = sign_verdict(spec, bisected, reexec, timings={"total_s": 2.0}, bytes_moved={},
                            key=_key(3), now=1_700_000_100)
    return [timed_out.to_bytes(), computed.to_bytes()]


def _examples() -> list[bytes]:
    example = {"image": torch.arange(4, dtype=torch.float32).reshape(1, 2, 2),
               "label": torch.tensor(1, dtype=torch.int64)}
    return [encode_examples([ProvenExample(5, example, [_h("p", 0), _h("p", 1)]),
                             ProvenExample(9, example, [])])]


TARGETS: tuple[Target[Any], ...] = (
    Target("canonical", decode, reencodes(encode),
           lambda: [encode({"a": [1, -2, 2**40, 1.5, None, True, b"\x00"], "b": {"c": "d"}})],
           MSGPACK),
    Target("state", decode_state, reencodes(encode_state), lambda: [encode_state(_state())],
           BINARY),
    Target("safetensors", load_safetensors, _safetensors_fixed_point,
           lambda: [safetensors.torch.save(_state(), metadata={"step": "3"})], SAFETENSORS),
    Target("safetensors-file", _file_digest_as_loaded, _digest_of_the_loaded_state,
           lambda: [safetensors.torch.save(_state(), metadata={"step": "3"})], SAFETENSORS),
    Target("log", decode_log, reencodes(encode_log),
           lambda: [encode_log(log) for log in (_log(), *_value_logs())], BINARY),
    Target("job-spec", JobSpec.from_bytes, reencodes(JobSpec.to_bytes),
           lambda: [_spec().to_bytes(), _data_file_spec().to_bytes()], MSGPACK),
    Target("signed-commitment", SignedCommitment.from_bytes,
           reencodes(SignedCommitment.to_bytes), lambda: [_dispute()[1].signed.to_bytes()],
           MSGPACK),
    Target("claim", Claim.from_bytes, reencodes(Claim.to_bytes),
           lambda: [_dispute()[3].trainer_leaf.to_bytes()], MSGPACK),
    Target("challenge", Challenge.from_bytes, reencodes(Challenge.to_bytes),
           lambda: [_dispute()[3].to_bytes()], MSGPACK),
    Target("transcript", decode_transcript, reencodes(encode_transcript),
           lambda: [transcript_bytes(_played(True)), transcript_bytes(_played(False))],
           MSGPACK),
    Target("verdict", Verdict.from_bytes, reencodes(Verdict.to_bytes), _verdicts, MSGPACK),
    Target("evidence-examples", decode_examples, reencodes(encode_examples), _examples,
           MSGPACK),
)


# ---- the long run ----------------------------------------------------------------------------

def random_input(rng: random.Random, seeds: Sequence[bytes], layout: str) -> bytes:
    """A quarter random bytes (up to 512), the rest 1-4 random edits (`mutate`) of one of
    `seeds`."""
    if rng.random() < 0.25:
        return rng.randbytes(rng.randrange(513))
    edits = [(rng.choice(EDITS), rng.randrange(2**32), rng.randrange(256))
             for _ in range(rng.randint(1, 4))]
    return mutate(rng.choice(seeds), edits, layout)


@dataclass
class Report:
    """One target's run: single edits and random inputs tried, their outcomes, the time, and
    the finding if any."""

    name: str
    single_edits: int
    inputs: int
    outcomes: Counter
    seconds: float
    failure: str | None = None


def run(target: Target, inputs: int, seed: int) -> Report:
    """Fuzz `target` with every `single_edits` input, then `inputs` random ones; stop at the
    first finding."""
    started = time.perf_counter()
    rng, seeds = random.Random(f"{seed}:{target.name}"), target.seeds()
    sweep = list(single_edits(target))
    randoms = (random_input(rng, seeds, target.layout) for _ in range(inputs))
    counts: Counter = Counter()
    for k, data in enumerate(itertools.chain(sweep, randoms)):
        result = outcome(target, data)
        if not is_allowed(result):
            return Report(target.name, len(sweep), k + 1 - len(sweep), counts,
                          time.perf_counter() - started, f"{result} on input {data.hex()[:400]}")
        counts[result] += 1
    return Report(target.name, len(sweep), inputs, counts, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=50_000, help="inputs per target")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random mutator")
    parser.add_argument("--only", help="comma-separated target names (default: all)")
    args = parser.parse_args(argv)
    names = [t.name for t in TARGETS]
    chosen = names if args.only is None else args.only.split(",")
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown targets {', '.join(unknown)}; known: {', '.join(names)}")
    failed = False
    print(f"{'target':<18} {'single':>7} {'random':>8} {'seconds':>8}  outcomes (seed {args.seed})")
    for target in (t for t in TARGETS if t.name in chosen):
        report = run(target, args.inputs, args.seed)
        outcomes = ", ".join(f"{name} {n}" for name, n in report.outcomes.most_common())
        print(f"{report.name:<18} {report.single_edits:>7} {report.inputs:>8} "
              f"{report.seconds:>8.1f}  {outcomes}", flush=True)
        if report.failure is not None:
            failed = True
            print(f"  {report.failure}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
