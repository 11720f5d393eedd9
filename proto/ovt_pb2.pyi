from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobRef(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: bytes
    def __init__(self, job_id: _Optional[bytes] = ...) -> None: ...

class StepRef(_message.Message):
    __slots__ = ("job_id", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: bytes
    step: int
    def __init__(self, job_id: _Optional[bytes] = ..., step: _Optional[int] = ...) -> None: ...

class StepRange(_message.Message):
    __slots__ = ("job_id", "first", "last")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    job_id: bytes
    first: int
    last: int
    def __init__(self, job_id: _Optional[bytes] = ..., first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class SpecReply(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: bytes
    def __init__(self, spec: _Optional[bytes] = ...) -> None: ...

class CommitmentRequest(_message.Message):
    __slots__ = ("job_id", "n")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    job_id: bytes
    n: int
    def __init__(self, job_id: _Optional[bytes] = ..., n: _Optional[int] = ...) -> None: ...

class CommitmentReply(_message.Message):
    __slots__ = ("signed_commitment",)
    SIGNED_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    signed_commitment: bytes
    def __init__(self, signed_commitment: _Optional[bytes] = ...) -> None: ...

class LeafReply(_message.Message):
    __slots__ = ("step", "state_hash", "log_hash", "proof", "tree_size")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    LOG_HASH_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    step: int
    state_hash: bytes
    log_hash: bytes
    proof: _containers.RepeatedScalarFieldContainer[bytes]
    tree_size: int
    def __init__(self, step: _Optional[int] = ..., state_hash: _Optional[bytes] = ..., log_hash: _Optional[bytes] = ..., proof: _Optional[_Iterable[bytes]] = ..., tree_size: _Optional[int] = ...) -> None: ...

class LogReply(_message.Message):
    __slots__ = ("log",)
    LOG_FIELD_NUMBER: _ClassVar[int]
    log: bytes
    def __init__(self, log: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data", "offset", "total_size", "sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    total_size: int
    sha256: bytes
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ..., total_size: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class Example(_message.Message):
    __slots__ = ("index", "tensors", "proof")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    index: int
    tensors: bytes
    proof: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, index: _Optional[int] = ..., tensors: _Optional[bytes] = ..., proof: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BatchReply(_message.Message):
    __slots__ = ("examples",)
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    examples: _containers.RepeatedCompositeFieldContainer[Example]
    def __init__(self, examples: _Optional[_Iterable[_Union[Example, _Mapping]]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("spec", "initial_state")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_FIELD_NUMBER: _ClassVar[int]
    spec: bytes
    initial_state: bytes
    def __init__(self, spec: _Optional[bytes] = ..., initial_state: _Optional[bytes] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: bytes
    def __init__(self, job_id: _Optional[bytes] = ...) -> None: ...

class SubmitPart(_message.Message):
    __slots__ = ("spec", "initial_state")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_FIELD_NUMBER: _ClassVar[int]
    spec: bytes
    initial_state: Chunk
    def __init__(self, spec: _Optional[bytes] = ..., initial_state: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "state", "step", "steps", "error")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job_id: bytes
    state: str
    step: int
    steps: int
    error: str
    def __init__(self, job_id: _Optional[bytes] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("trainer_address", "job_id")
    TRAINER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    trainer_address: str
    job_id: bytes
    def __init__(self, trainer_address: _Optional[str] = ..., job_id: _Optional[bytes] = ...) -> None: ...

class AuditReport(_message.Message):
    __slots__ = ("job_id", "state", "step", "steps", "divergent_step", "reason", "commitment", "error", "trainer")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DIVERGENT_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    job_id: bytes
    state: str
    step: int
    steps: int
    divergent_step: int
    reason: str
    commitment: bytes
    error: str
    trainer: str
    def __init__(self, job_id: _Optional[bytes] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., divergent_step: _Optional[int] = ..., reason: _Optional[str] = ..., commitment: _Optional[bytes] = ..., error: _Optional[str] = ..., trainer: _Optional[str] = ...) -> None: ...

class ChallengeReply(_message.Message):
    __slots__ = ("challenge",)
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    challenge: bytes
    def __init__(self, challenge: _Optional[bytes] = ...) -> None: ...
