"""The auditor's own stored files (an audit record, an audit request) decode strictly: a
decoded file re-encodes to exactly its bytes (SPEC §2; issue 10, finding 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from auditor_node.audit import DIVERGED, AuditRecord
from auditor_node.runner import _read_request
from protocol.codec.canonical import decode, encode
from protocol.errors import EncodingError

RECORD = AuditRecord(job_id=bytes(range(32)), state=DIVERGED, steps=12, replayed=5,
                     divergent_step=5, reason="state hash differs",
                     challenge=Path("store/challenge.ovt"))


def test_a_record_round_trips():
    assert AuditRecord.from_bytes(RECORD.to_bytes()) == RECORD


@pytest.mark.parametrize("field, alias", [("steps", True), ("replayed", 5.0),
                                          ("divergent_step", True), ("steps", "12"),
                                          ("challenge", "store//challenge.ovt"),
                                          ("job_id", b"short")])
def test_aliased_audit_record_fields_are_refused(field, alias):
    """Finding 3: a record with steps `True` or a path that `Path` normalises decoded to a
    record whose own bytes are other ones."""
    aliased = encode({**decode(RECORD.to_bytes()), field: alias})
    with pytest.raises(EncodingError):
        AuditRecord.from_bytes(aliased)


@pytest.mark.parametrize("body", [{"trainer": "127.0.0.1:1", "extra": 1}, {"trainer": 1},
                                  {}, ["127.0.0.1:1"]])
def test_aliased_or_malformed_audit_requests_are_refused(tmp_path, body):
    path = tmp_path / "audit-request.ovt"
    path.write_bytes(encode(body))
    with pytest.raises(EncodingError):
        _read_request(path)


def test_a_request_round_trips(tmp_path):
    path = tmp_path / "audit-request.ovt"
    path.write_bytes(encode({"trainer": "127.0.0.1:1"}))
    assert _read_request(path) == "127.0.0.1:1"
