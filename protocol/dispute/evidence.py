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

from protocol.codec.canonical import decode, encode
from protocol.codec.fields import MAX_UINT, hex_or_repr
from protocol.codec.state import decode_state, encode_state
from protocol.commit.data import ProvenExample
from protocol.commit.hashing import HASH_SIZE
from protocol.commit.merkle import MAX_PROOF_LEN
from protocol.dispute.game import dispute
from protocol.dispute.reexecute import Reexecution, reexecute
from protocol.dispute.verdict import Verdict, replayed, verify_verdict
from protocol.engine.profiles import Profile
from protocol.errors import EncodingError, StateFormatError, VerdictError
from protocol.files import atomic_write

STATE_FILE = "prev_state.safetensors"
EXAMPLES_FILE = "examples.ovtx"
LOG_FILE = "log.ovtl"
EXAMPLES_KIND = "ovt-evidence-examples"
MAX_EXAMPLES_BYTES = 256 * 2**20
MAX_EVIDENCE_FILE_BYTES = 4 * 2**30



def save_evidence(directory: str | Path, prev_state: dict[str, torch.Tensor],
                  examples: list[ProvenExample], log: bytes) -> None:
    """Write the re-execution's evidence so anyone can re-run step i offline: S_{i-1} as
    safetensors, B_i's examples (index, canonical state encoding, proof) as canonical bytes,
    and L_i's bytes. Nothing is pickled (SPEC §4). Files are written atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in prev_state.items()}
    atomic_write(directory / STATE_FILE, safetensors.torch.save(tensors))
    items = [{"index": int(e.index), "example": encode_state(e.example),
              "proof": [bytes(p) for p in e.proof]} for e in examples]
    atomic_write(directory / EXAMPLES_FILE, encode({"kind": EXAMPLES_KIND, "examples": items}))
    atomic_write(directory / LOG_FILE, bytes(log))


def load_evidence(directory: str | Path) -> tuple[dict[str, torch.Tensor], list[ProvenExample],
                                                  bytes]:
    """Read what `save_evidence` wrote: (S_{i-1}, B_i's proven examples, L_i bytes).

    Strict and pickle-free: safetensors for the state, the canonical encoding (exact fields,
    32-byte proof hashes, canonical example encodings) for the examples. Raises VerdictError
    for a missing, oversized or malformed file. Does not check the evidence against a dispute:
    `reexecute` does.
    """
    directory = Path(directory)
    raw = _read(directory / STATE_FILE)
    try:
        prev_state = safetensors.torch.load(raw)
    except Exception as err:  # untrusted bytes: any parser failure is a bad file
        raise VerdictError(f"{directory / STATE_FILE} is not a safetensors state: {err}") \
            from None
    try:
        body = decode(_read(directory / EXAMPLES_FILE, MAX_EXAMPLES_BYTES),
                      max_bytes=MAX_EXAMPLES_BYTES)
    except EncodingError as err:
        raise VerdictError(f"{directory / EXAMPLES_FILE} does not parse: {err}") from None
    examples = _examples_from_body(body, directory / EXAMPLES_FILE)
    return prev_state, examples, _read(directory / LOG_FILE)


def _examples_from_body(body: object, path: Path) -> list[ProvenExample]:
    if not isinstance(body, dict) or set(body) != {"kind", "examples"} \
            or body["kind"] != EXAMPLES_KIND or not isinstance(body["examples"], list):
        raise VerdictError(f"{path} is not an ovt evidence examples file")
    examples = []
    for k, item in enumerate(body["examples"]):
        if not isinstance(item, dict) or set(item) != {"index", "example", "proof"}:
            raise VerdictError(f"{path}: example {k} must have the fields example, index, proof")
        index, data, proof = item["index"], item["example"], item["proof"]
        if type(index) is not int or not 0 <= index <= MAX_UINT:
            raise VerdictError(f"{path}: example {k} has a bad index")
        if type(data) is not bytes:
            raise VerdictError(f"{path}: example {k} must be encoded bytes")
        if type(proof) is not list or len(proof) > MAX_PROOF_LEN or \
                not all(type(p) is bytes and len(p) == HASH_SIZE for p in proof):
            raise VerdictError(f"{path}: example {k} has a malformed proof")
        try:
            example = decode_state(data)
        except StateFormatError as err:
            raise VerdictError(f"{path}: example {k} does not decode: {err}") from None
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
    again = reexecute(spec, d, prev_state, examples, log, profile=profile)
    if again.finding == "bad-evidence":
        raise VerdictError(f"the evidence in {directory} is not the evidence of step {d.step}: "
                           f"{again.detail}")
    if (again.finding, again.state_hash) != (signed.finding, signed.state_hash):
        raise VerdictError(
            f"re-executing step {d.step} on {profile.name} gives {again.finding} "
            f"{hex_or_repr(again.state_hash)}, the verdict says {signed.finding} "
            f"{hex_or_repr(signed.state_hash)}")
    return again
