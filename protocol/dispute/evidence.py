"""Evidence for an offline re-check of h_i* (SPEC §5.3): the one part of a verdict that a
transcript replay cannot re-derive.

`save_evidence` writes what the arbiter re-executed step i from — S_{i-1} as safetensors, B_i's
examples with their data proofs and L_i as canonical bytes, nothing pickled (SPEC §4) — and
`recheck_evidence` re-runs step i from those files and requires the verdict's finding and h_i*.
"""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch

from protocol.codec.canonical import decode_object, encode
from protocol.codec.fields import hex_or_repr, require_fields, require_uint
from protocol.codec.state import decode_state, encode_state, load_safetensors
from protocol.commit.data import ProvenExample
from protocol.commit.hashing import HASH_SIZE
from protocol.commit.merkle import MAX_PROOF_LEN
from protocol.dispute.game import dispute
from protocol.dispute.reexecute import Reexecution, reexecute
from protocol.dispute.verdict import Verdict, replayed, verify_verdict
from protocol.engine.profiles import Profile
from protocol.errors import EncodingError, StateFormatError, VerdictError
from protocol.files import atomic_write
from protocol.job.create import load_job_program

STATE_FILE = "prev_state.safetensors"
EXAMPLES_FILE = "examples.ovtx"
LOG_FILE = "log.ovtl"
EXAMPLES_KIND = "ovt-evidence-examples"
MAX_EXAMPLES_BYTES = 256 * 2**20
MAX_EVIDENCE_FILE_BYTES = 4 * 2**30


def save_evidence(directory: str | Path, prev_state: dict[str, torch.Tensor],
                  examples: list[ProvenExample], log: bytes) -> None:
    """Write the re-execution's evidence so anyone can re-run step i offline: S_{i-1} as
    safetensors, B_i's examples (`encode_examples`) and L_i's bytes. Nothing is pickled
    (SPEC §4). Files are written atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in prev_state.items()}
    atomic_write(directory / STATE_FILE, safetensors.torch.save(tensors))
    atomic_write(directory / EXAMPLES_FILE, encode_examples(examples))
    atomic_write(directory / LOG_FILE, bytes(log))


def load_evidence(directory: str | Path) -> tuple[dict[str, torch.Tensor], list[ProvenExample],
                                                  bytes]:
    """Read what `save_evidence` wrote: (S_{i-1}, B_i's proven examples, L_i bytes).

    Strict and pickle-free: `load_safetensors` for the state, `decode_examples` for the
    examples. Raises VerdictError for a missing, oversized or malformed file. Does not check
    the evidence against a dispute: `reexecute` does.
    """
    directory = Path(directory)
    try:
        prev_state = load_safetensors(_read(directory / STATE_FILE))
    except StateFormatError as err:
        raise VerdictError(f"{directory / STATE_FILE} is not a safetensors state: {err}") \
            from None
    try:
        examples = decode_examples(_read(directory / EXAMPLES_FILE, MAX_EXAMPLES_BYTES))
    except EncodingError as err:
        raise VerdictError(f"{directory / EXAMPLES_FILE} does not parse: {err}") from None
    return prev_state, examples, _read(directory / LOG_FILE)


def encode_examples(examples: list[ProvenExample]) -> bytes:
    """The canonical bytes of B_i's examples: each its index, its canonical state encoding and
    its data proof (the one encoding `decode_examples` inverts)."""
    items = [{"index": int(e.index), "example": encode_state(e.example),
              "proof": [bytes(p) for p in e.proof]} for e in examples]
    return encode({"kind": EXAMPLES_KIND, "examples": items})


def decode_examples(data: bytes) -> list[ProvenExample]:
    """Examples from untrusted bytes: canonical, exact fields, 32-byte proof hashes, canonical
    example encodings, and re-encoding to exactly `data` (SPEC §2, `decode_object`). Raises
    EncodingError."""
    return decode_object(data, _examples_from_body, encode_examples, what="evidence examples",
                         max_bytes=MAX_EXAMPLES_BYTES)


def _examples_from_body(body: object) -> list[ProvenExample]:
    body = require_fields("an evidence examples file", body, ("kind", "examples"))
    if body["kind"] != EXAMPLES_KIND or type(body["examples"]) is not list:
        raise EncodingError("not an ovt evidence examples file")
    examples = []
    for k, item in enumerate(body["examples"]):
        item = require_fields(f"example {k}", item, ("index", "example", "proof"))
        index, data, proof = item["index"], item["example"], item["proof"]
        require_uint(f"example {k} index", index)
        if type(data) is not bytes:
            raise EncodingError(f"example {k} must be encoded bytes")
        if type(proof) is not list or len(proof) > MAX_PROOF_LEN or \
                not all(type(p) is bytes and len(p) == HASH_SIZE for p in proof):
            raise EncodingError(f"example {k} has a malformed proof")
        try:
            example = decode_state(data)
        except StateFormatError as err:
            raise EncodingError(f"example {k} does not decode: {err}") from None
        examples.append(ProvenExample(index, example, list(proof)))
    return examples


def _read(path: Path, limit: int = MAX_EVIDENCE_FILE_BYTES) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise VerdictError(f"cannot read evidence file {path}: {err.strerror or err}") from None
    if len(data) > limit:
        raise VerdictError(f"evidence file {path} is over {limit} bytes")
    return data


def recheck_evidence(verdict: Verdict | bytes, directory: str | Path, *,
                     profile: Profile) -> Reexecution:
    """Re-run the verdict's re-execution from saved evidence on `profile` (SPEC §5.3) and
    require the same finding and h_i*: the one part of a verdict a transcript replay cannot
    re-derive. Verdict bytes are verified first (`verify_verdict`); a Verdict object is taken
    as already verified, but its dispute is still re-derived from its transcript.

    Returns the new re-execution. Raises VerdictError when the verdict re-executed nothing
    (no disputed step, or withheld evidence), the evidence does not match the dispute, or the
    finding or h_i* differs.
    """
    if not isinstance(verdict, Verdict):
        verdict = verify_verdict(verdict)
    signed = verdict.reexecution
    if signed is None:
        raise VerdictError(f"the verdict ({verdict.finding}) re-executed no step: there is no "
                           f"evidence to re-check")
    if signed.finding not in ("computed", "invalid-log"):
        raise VerdictError(f"the verdict's re-execution of step {signed.step} is "
                           f"{signed.finding!r}: there is no evidence to re-check")
    spec, game = replayed(verdict)
    d = dispute(game)
    if d is None or d.step != signed.step:
        raise VerdictError(f"the verdict's transcript does not dispute step {signed.step}")
    prev_state, examples, log = load_evidence(directory)
    again = reexecute(spec, d, prev_state, examples, log,
                      program=load_job_program(spec, examples=False), profile=profile)
    if again.finding == "bad-evidence":
        raise VerdictError(f"the evidence in {directory} is not the evidence of step {d.step}: "
                           f"{again.detail}")
    if (again.finding, again.state_hash) != (signed.finding, signed.state_hash):
        raise VerdictError(
            f"re-executing step {d.step} on {profile.name} gives {again.finding} "
            f"{hex_or_repr(again.state_hash)}, the verdict says {signed.finding} "
            f"{hex_or_repr(signed.state_hash)}")
    return again
