"""protocol.commit.keys and .commitments: keys, domain separation, commitments, claims (SPEC §2)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec.canonical import PROTOCOL_VERSION, encode
from protocol.commit.commitments import (
    KIND_CLAIM,
    KIND_COMMITMENT,
    Claim,
    Commitment,
    SignedCommitment,
    sign_commitment,
)
from protocol.commit.hashing import leaf_hash
from protocol.commit.keys import (
    SIGNATURE_DOMAIN,
    KeyPair,
    sign_object,
    signing_message,
    verify_object,
    verify_signature,
)
from protocol.commit.leaf import leaf_data
from protocol.commit.merkle import MerkleTree
from protocol.errors import (
    ConfigError,
    EncodingError,
    ProofError,
    RootMismatchError,
    SignatureError,
)

JOB = hashlib.sha256(b"job").digest()
OTHER_JOB = hashlib.sha256(b"other job").digest()
N = 6
_FIXED_KEY = KeyPair.generate()  # for hypothesis tests, which cannot take fixtures


def h(label: object) -> bytes:
    return hashlib.sha256(repr(label).encode()).digest()


@pytest.fixture(scope="module")
def key() -> KeyPair:
    return KeyPair.generate()


@pytest.fixture(scope="module")
def other_key() -> KeyPair:
    return KeyPair.generate()


def commitment(key: KeyPair, **changes) -> Commitment:
    fields = dict(job_id=JOB, n=N, root=h("root"), h_n=h("h_n"), public_key=key.public_key,
                  role="trainer", time=1_700_000_000)
    fields.update(changes)
    return Commitment(**fields)


# --- keys ---------------------------------------------------------------------------------------

def test_key_save_load_round_trip(tmp_path, key):
    path = tmp_path / "trainer.key"
    key.save(path)
    loaded = KeyPair.load(path)
    assert loaded.public_key == key.public_key
    assert len(loaded.public_key) == 32
    sig = loaded.sign(b"message")
    verify_signature(key.public_key, b"message", sig)
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")


def test_key_file_mode_is_0600_and_no_temp_file_left(tmp_path, key):
    old = os.umask(0)
    try:
        key.save(tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o600
    assert os.listdir(tmp_path) == ["k"]


def test_key_save_refuses_overwrite(tmp_path, key, other_key):
    path = tmp_path / "k"
    key.save(path)
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="already exists"):
        other_key.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["k"]
    other_key.save(path, overwrite=True)
    assert KeyPair.load(path).public_key == other_key.public_key
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["k"]


def test_key_save_into_missing_directory_is_config_error(tmp_path, key):
    with pytest.raises(ConfigError, match="cannot write key file"):
        key.save(tmp_path / "missing" / "k")


def test_key_repr_does_not_show_private_key(key):
    assert repr(key) == f"KeyPair(public_key={key.public_key.hex()})"


def _pem(private_key, encryption=None) -> bytes:
    return private_key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     encryption or serialization.NoEncryption())


@pytest.mark.parametrize("content, message", [
    (b"", "not an unencrypted PEM private key"),
    (b"garbage\x00\xff" * 10, "not an unencrypted PEM private key"),
    (b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
     "not an unencrypted PEM private key"),
    (ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
     "not an unencrypted PEM private key"),
    (_pem(ed25519.Ed25519PrivateKey.generate(),
          serialization.BestAvailableEncryption(b"password")),
     "not an unencrypted PEM private key"),
    (_pem(rsa.generate_private_key(public_exponent=65537, key_size=1024)), "not an Ed25519"),
    (_pem(ec.generate_private_key(ec.SECP256R1())), "not an Ed25519"),
    (b"x" * (64 * 1024 + 1), "too large"),
], ids=["empty", "garbage", "bad-base64-body", "public-key", "encrypted", "rsa", "ec",
        "oversized"])
def test_key_load_bad_file_is_config_error(tmp_path, content, message):
    path = tmp_path / "k"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        KeyPair.load(path)


def test_key_load_missing_or_directory_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read key file"):
        KeyPair.load(tmp_path / "missing")
    with pytest.raises(ConfigError, match="cannot read key file"):
        KeyPair.load(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_key_load_unreadable_is_config_error(tmp_path, key):
    path = tmp_path / "k"
    key.save(path)
    os.chmod(path, 0)
    with pytest.raises(ConfigError, match="cannot read key file"):
        KeyPair.load(path)


# --- raw and domain-separated signatures ------------------------------------------------------

def test_sign_and_verify(key, other_key):
    sig = key.sign(b"hello")
    assert len(sig) == 64
    verify_signature(key.public_key, b"hello", sig)
    with pytest.raises(SignatureError):
        verify_signature(key.public_key, b"hellO", sig)
    with pytest.raises(SignatureError):
        verify_signature(other_key.public_key, b"hello", sig)


@pytest.mark.parametrize("public_key, signature", [
    (b"\x00" * 31, b"\x00" * 64), (b"\x00" * 33, b"\x00" * 64), (b"\x00" * 32, b"\x00" * 63),
    (b"\x00" * 32, b"\x00" * 65), ("00" * 32, b"\x00" * 64), (b"\x00" * 32, None),
    (bytearray(32), b"\x00" * 64), (_FIXED_KEY.public_key, bytes(64)),
    (_FIXED_KEY.public_key, b"\xff" * 64),
])
def test_verify_signature_rejects_malformed_inputs(public_key, signature):
    with pytest.raises(SignatureError):
        verify_signature(public_key, b"message", signature)


def test_signing_message_layout():
    body = {"a": 1}
    assert signing_message("x", body) == SIGNATURE_DOMAIN + encode(
        {"kind": "x", "protocol_version": PROTOCOL_VERSION, "body": body})
    assert SIGNATURE_DOMAIN == b"ovt-signature-v1\x00"
    assert PROTOCOL_VERSION == 3


def test_claim_kind_signature_never_verifies_as_commitment(key):
    c = commitment(key)
    # The same body, signed under another kind: must not verify as a commitment.
    sig = sign_object(KIND_CLAIM, c.to_body(), key)
    verify_object(KIND_CLAIM, c.to_body(), key.public_key, sig)
    with pytest.raises(SignatureError):
        SignedCommitment(c, sig).verify(job_id=JOB, role="trainer")
    with pytest.raises(SignatureError):
        verify_object(KIND_COMMITMENT, c.to_body(), key.public_key, sig)


def test_signature_without_domain_or_other_version_does_not_verify(key):
    c = commitment(key)
    inner = {"kind": KIND_COMMITMENT, "protocol_version": PROTOCOL_VERSION, "body": c.to_body()}
    bad = [
        key.sign(encode(c.to_body())),
        key.sign(encode(inner)),
        key.sign(SIGNATURE_DOMAIN + encode(c.to_body())),
        key.sign(SIGNATURE_DOMAIN + encode({**inner, "protocol_version": PROTOCOL_VERSION + 1})),
        key.sign(b"ovt-signature-v2\x00" + encode(inner)),
    ]
    for sig in bad:
        with pytest.raises(SignatureError):
            SignedCommitment(c, sig).verify(job_id=JOB, role="trainer")
    SignedCommitment(c, key.sign(SIGNATURE_DOMAIN + encode(inner))).verify(
        job_id=JOB, role="trainer")


# --- commitments ------------------------------------------------------------------------------

def test_commitment_body_round_trip(key):
    c = commitment(key)
    assert c.to_body() == {"job_id": JOB, "n": N, "root": h("root"), "h_n": h("h_n"),
                           "public_key": key.public_key, "role": "trainer",
                           "time": 1_700_000_000}
    assert Commitment.from_body(c.to_body()) == c


@pytest.mark.parametrize("field, value", [
    ("job_id", b"\x00" * 31), ("job_id", b"\x00" * 33), ("job_id", "00" * 32),
    ("job_id", bytearray(32)), ("n", -1), ("n", True), ("n", 1.0), ("n", "6"), ("n", 2**63),
    ("n", 2**63 - 1), ("root", b""), ("root", None), ("h_n", [0] * 32),
    ("public_key", b"\x00" * 64), ("role", "arbiter"), ("role", "Trainer"), ("role", b"trainer"),
    ("role", None), ("time", -1), ("time", 1.5), ("time", False), ("time", 2**64),
])
def test_commitment_rejects_bad_fields(key, field, value):
    with pytest.raises(EncodingError, match=f"commitment {field}"):
        commitment(key, **{field: value})
    body = commitment(key).to_body()
    body[field] = value
    with pytest.raises(EncodingError):
        Commitment.from_body(body)


@pytest.mark.parametrize("body", [
    None, [], "commitment", {},
    {**commitment(KeyPair.generate()).to_body(), "extra": 1},
    {k: v for k, v in commitment(KeyPair.generate()).to_body().items() if k != "time"},
], ids=["none", "list", "str", "empty", "extra-field", "missing-field"])
def test_commitment_from_body_rejects_wrong_shape(body):
    with pytest.raises(EncodingError):
        Commitment.from_body(body)


def test_signed_commitment_round_trip_and_verify(key):
    signed = sign_commitment(commitment(key), key)
    data = signed.to_bytes()
    assert data == encode({"commitment": signed.commitment.to_body(),
                           "signature": signed.signature})
    back = SignedCommitment.from_bytes(data)
    assert back == signed
    back.verify(job_id=JOB, role="trainer")
    back.verify(job_id=JOB, role="trainer", n=N, public_key=key.public_key)


def test_sign_commitment_refuses_a_commitment_naming_another_key(key, other_key):
    with pytest.raises(ConfigError, match="public key"):
        sign_commitment(commitment(other_key), key)


def test_cross_job_replay_rejected(key):
    signed = sign_commitment(commitment(key), key)
    with pytest.raises(SignatureError, match="job"):
        signed.verify(job_id=OTHER_JOB, role="trainer")


def test_cross_role_replay_rejected(key):
    signed = sign_commitment(commitment(key), key)
    with pytest.raises(SignatureError, match="role is 'trainer', expected 'auditor'"):
        signed.verify(job_id=JOB, role="auditor")
    # Relabelling the role invalidates the signature.
    relabelled = SignedCommitment(dataclasses.replace(signed.commitment, role="auditor"),
                                  signed.signature)
    with pytest.raises(SignatureError, match="does not verify"):
        relabelled.verify(job_id=JOB, role="auditor")


def test_wrong_n_rejected(key):
    signed = sign_commitment(commitment(key), key)
    with pytest.raises(SignatureError, match="n = 6 steps, expected n = 7"):
        signed.verify(job_id=JOB, role="trainer", n=N + 1)


def test_unexpected_signer_rejected(key, other_key):
    # Anyone can sign a well-formed commitment with their own key; pinning the key catches it.
    signed = sign_commitment(commitment(other_key), other_key)
    signed.verify(job_id=JOB, role="trainer")
    with pytest.raises(SignatureError, match="signed by key"):
        signed.verify(job_id=JOB, role="trainer", public_key=key.public_key)


def test_verify_with_unknown_expected_role_is_config_error(key):
    signed = sign_commitment(commitment(key), key)
    with pytest.raises(ConfigError):
        signed.verify(job_id=JOB, role="arbiter")


@pytest.mark.parametrize("field, value", [
    ("job_id", OTHER_JOB), ("n", N + 1), ("root", h("other root")), ("h_n", h("other h_n")),
    ("time", 1_700_000_001), ("role", "auditor"),
])
def test_changing_any_field_breaks_the_signature(key, field, value):
    signed = sign_commitment(commitment(key), key)
    forged = SignedCommitment(dataclasses.replace(signed.commitment, **{field: value}),
                              signed.signature)
    with pytest.raises(SignatureError, match="does not verify"):
        forged.verify_signature()


def test_every_bit_flip_of_a_signed_commitment_is_rejected(key):
    data = sign_commitment(commitment(key), key).to_bytes()
    for i in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[i // 8] ^= 1 << (i % 8)
        with pytest.raises((EncodingError, SignatureError)):
            SignedCommitment.from_bytes(bytes(flipped)).verify(job_id=JOB, role="trainer", n=N)


def test_truncated_or_extended_signed_commitment_rejected(key):
    data = sign_commitment(commitment(key), key).to_bytes()
    for cut in range(len(data)):
        with pytest.raises(EncodingError):
            SignedCommitment.from_bytes(data[:cut])
    for extra in (b"\x00", b"\xc0", data):
        with pytest.raises(EncodingError):
            SignedCommitment.from_bytes(data + extra)
    with pytest.raises(EncodingError):
        SignedCommitment.from_bytes(data + b"\x00" * 2000)


@pytest.mark.parametrize("mutate", [
    lambda d: {**d, "signature": d["signature"][:63]},
    lambda d: {**d, "signature": d["signature"] + b"\x00"},
    lambda d: {**d, "signature": d["signature"].hex()},
    lambda d: {**d, "extra": b""},
    lambda d: {"commitment": d["commitment"]},
    lambda d: {**d, "commitment": [d["commitment"]]},
    lambda d: {**d, "commitment": {**d["commitment"], "role": "auditor "}},
    lambda d: [d["commitment"], d["signature"]],
], ids=["sig-short", "sig-long", "sig-str", "extra", "no-sig", "commitment-list", "bad-role",
        "list"])
def test_malformed_signed_commitment_is_encoding_error(key, mutate):
    signed = sign_commitment(commitment(key), key)
    obj = {"commitment": signed.commitment.to_body(), "signature": signed.signature}
    with pytest.raises(EncodingError):
        SignedCommitment.from_bytes(encode(mutate(obj)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_signed_commitment_from_random_bytes_only_raises_encoding_errors(data):
    try:
        SignedCommitment.from_bytes(data).verify(job_id=JOB, role="trainer")
    except (EncodingError, SignatureError):
        pass


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=40)
    | st.text(max_size=10) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(("job_id", "n", "root", "h_n", "public_key", "role", "time", "signature",
                        "extra")), _ANY)
def test_signed_commitment_with_any_field_replaced_only_raises_expected_errors(field, value):
    signed = sign_commitment(commitment(_FIXED_KEY), _FIXED_KEY)
    body = signed.commitment.to_body()
    obj = {"commitment": body, "signature": signed.signature}
    if field in body:
        body[field] = value
    else:
        obj[field] = value
    try:
        SignedCommitment.from_bytes(encode(obj)).verify(job_id=JOB, role="trainer", n=N)
    except (EncodingError, SignatureError):
        return
    assert obj["commitment"] == signed.commitment.to_body() and field != "extra"



# --- claims -----------------------------------------------------------------------------------

def test_leaf_data_is_canonical_triple():
    assert leaf_data(3, h(1), h(2)) == encode([3, h(1), h(2)])


class Party:
    """A party's leaves 0..N, its tree and its signed commitment."""

    def __init__(self, key: KeyPair, label: str, role: str = "trainer") -> None:
        self.states = [h((label, "state", t)) for t in range(N + 1)]
        self.logs = [h((label, "log", t)) for t in range(N + 1)]
        self.tree = MerkleTree([leaf_hash(leaf_data(t, s, g))
                                for t, (s, g) in enumerate(zip(self.states, self.logs,
                                                               strict=True))])
        self.signed = sign_commitment(
            commitment(key, root=self.tree.root, h_n=self.states[N], role=role), key)

    def claim(self, t: int) -> Claim:
        return Claim(JOB, t, self.states[t], self.logs[t], list(self.tree.proof(t)), N + 1)


@pytest.fixture(scope="module")
def trainer(key) -> Party:
    return Party(key, "trainer")


@pytest.fixture(scope="module")
def auditor(other_key) -> Party:
    return Party(other_key, "auditor", role="auditor")


def test_good_claims_verify(trainer):
    trainer.signed.verify(job_id=JOB, role="trainer", n=N)
    for t in range(N + 1):
        claim = trainer.claim(t)
        claim.verify(trainer.signed)
        assert Claim.from_bytes(claim.to_bytes()) == claim


@pytest.mark.parametrize("field", ["state_hash", "log_hash"])
def test_claim_with_altered_hash_rejected(trainer, field):
    for t in range(N + 1):
        claim = trainer.claim(t)
        altered = dataclasses.replace(claim, **{field: h(("altered", t))})
        with pytest.raises(RootMismatchError):
            altered.verify(trainer.signed)


def test_claim_with_altered_step_rejected(trainer):
    for t in range(N + 1):
        claim = trainer.claim(t)
        for other in range(N + 1):
            if other != t:
                with pytest.raises(ProofError):
                    dataclasses.replace(claim, step=other).verify(trainer.signed)


def test_claim_with_altered_proof_rejected(trainer):
    for t in range(N + 1):
        claim = trainer.claim(t)
        proof = list(claim.proof)
        variants = [proof[:-1], proof + [h("x")], [h("x")] + proof, proof[::-1]]
        for i in range(len(proof)):
            changed = list(proof)
            changed[i] = bytes([changed[i][0] ^ 1]) + changed[i][1:]
            variants.append(changed)
        for variant in variants:
            if variant == proof:
                continue
            with pytest.raises(ProofError):
                dataclasses.replace(claim, proof=variant).verify(trainer.signed)


def test_claim_against_another_partys_root_rejected(trainer, auditor):
    with pytest.raises(RootMismatchError):
        trainer.claim(2).verify(auditor.signed)
    auditor.claim(2).verify(auditor.signed)


def test_claim_for_another_job_or_size_rejected(trainer):
    claim = trainer.claim(2)
    with pytest.raises(ProofError, match="job"):
        dataclasses.replace(claim, job_id=OTHER_JOB).verify(trainer.signed)
    with pytest.raises(ProofError, match="leaves"):
        dataclasses.replace(claim, size=N + 2).verify(trainer.signed)


def test_claim_against_badly_signed_commitment_rejected(trainer, other_key):
    forged = SignedCommitment(trainer.signed.commitment, other_key.sign(b"x"))
    with pytest.raises(SignatureError):
        trainer.claim(1).verify(forged)


def test_every_bit_flip_of_a_claim_is_rejected(trainer):
    data = trainer.claim(3).to_bytes()
    for i in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[i // 8] ^= 1 << (i % 8)
        with pytest.raises((EncodingError, ProofError)):
            Claim.from_bytes(bytes(flipped)).verify(trainer.signed)


@pytest.mark.parametrize("field, value", [
    ("job_id", b"\x00" * 31), ("step", -1), ("step", True), ("step", N + 1),
    ("state_hash", b"\x00" * 33), ("log_hash", "x"), ("proof", b"\x00" * 32),
    ("proof", [b"\x00" * 31]), ("proof", [b"\x00" * 32] * 65), ("proof", None),
    ("size", 0), ("size", 1.0),
])
def test_claim_rejects_bad_fields(trainer, field, value):
    body = trainer.claim(3).to_body()
    body[field] = value
    with pytest.raises(EncodingError):
        Claim.from_body(body)
    with pytest.raises(EncodingError):
        Claim.from_bytes(encode(body))


def test_claim_from_body_rejects_wrong_shape(trainer):
    body = trainer.claim(3).to_body()
    for bad in (None, [], {**body, "extra": 0}, {k: v for k, v in body.items() if k != "size"}):
        with pytest.raises(EncodingError):
            Claim.from_body(bad)


def test_claim_proof_is_stored_as_tuple(trainer):
    claim = trainer.claim(3)
    assert isinstance(claim.proof, tuple)
    assert claim.to_body()["proof"] == list(claim.proof)
    hash(claim)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_claim_from_random_bytes_only_raises_encoding_errors(data):
    try:
        Claim.from_bytes(data)
    except (EncodingError, SignatureError):
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(("job_id", "step", "state_hash", "log_hash", "proof", "size", "extra")),
       _ANY)
def test_claim_with_any_field_replaced_only_raises_expected_errors(field, value):
    party = _FIXED_PARTY
    body = party.claim(3).to_body()
    body[field] = value
    try:
        Claim.from_bytes(encode(body)).verify(party.signed)
    except (EncodingError, ProofError, SignatureError):
        return
    assert body == party.claim(3).to_body()


_FIXED_PARTY = Party(_FIXED_KEY, "fixed")
