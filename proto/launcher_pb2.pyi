import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tidal.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LeaveCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEAVE_CAUSE_UNSPECIFIED: _ClassVar[LeaveCause]
    LEAVE_CAUSE_PREEMPTED: _ClassVar[LeaveCause]

class GenerationPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GENERATION_PHASE_UNSPECIFIED: _ClassVar[GenerationPhase]
    GENERATION_PHASE_STARTED: _ClassVar[GenerationPhase]
    GENERATION_PHASE_RECONFIGURED: _ClassVar[GenerationPhase]
    GENERATION_PHASE_STOPPED: _ClassVar[GenerationPhase]
    GENERATION_PHASE_LEFT: _ClassVar[GenerationPhase]
    GENERATION_PHASE_FIRST_STEP: _ClassVar[GenerationPhase]
    GENERATION_PHASE_FINISHED: _ClassVar[GenerationPhase]
    GENERATION_PHASE_RESUMED_FROM_CHECKPOINT: _ClassVar[GenerationPhase]
    GENERATION_PHASE_STATE_LOST: _ClassVar[GenerationPhase]
LEAVE_CAUSE_UNSPECIFIED: LeaveCause
LEAVE_CAUSE_PREEMPTED: LeaveCause
GENERATION_PHASE_UNSPECIFIED: GenerationPhase
GENERATION_PHASE_STARTED: GenerationPhase
GENERATION_PHASE_RECONFIGURED: GenerationPhase
GENERATION_PHASE_STOPPED: GenerationPhase
GENERATION_PHASE_LEFT: GenerationPhase
GENERATION_PHASE_FIRST_STEP: GenerationPhase
GENERATION_PHASE_FINISHED: GenerationPhase
GENERATION_PHASE_RESUMED_FROM_CHECKPOINT: GenerationPhase
GENERATION_PHASE_STATE_LOST: GenerationPhase

class LauncherMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "worker_exited", "leave_request", "generation_report")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    WORKER_EXITED_FIELD_NUMBER: _ClassVar[int]
    LEAVE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    GENERATION_REPORT_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    worker_exited: WorkerExited
    leave_request: LeaveRequest
    generation_report: GenerationReport
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., worker_exited: _Optional[_Union[WorkerExited, _Mapping]] = ..., leave_request: _Optional[_Union[LeaveRequest, _Mapping]] = ..., generation_report: _Optional[_Union[GenerationReport, _Mapping]] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("job_id", "unit_id", "secret", "nodes", "address", "slurm_job_id", "last_generation", "worker_pids", "store_port", "started_at")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLURM_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_PIDS_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    unit_id: str
    secret: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    address: str
    slurm_job_id: int
    last_generation: int
    worker_pids: _containers.RepeatedScalarFieldContainer[int]
    store_port: int
    started_at: _timestamp_pb2.Timestamp
    def __init__(self, job_id: _Optional[str] = ..., unit_id: _Optional[str] = ..., secret: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., address: _Optional[str] = ..., slurm_job_id: _Optional[int] = ..., last_generation: _Optional[int] = ..., worker_pids: _Optional[_Iterable[int]] = ..., store_port: _Optional[int] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WorkerProgress(_message.Message):
    __slots__ = ("local_rank", "rank", "pid", "step", "progress_time", "waiting", "beat_time", "samples", "loss", "compute_generation", "compute_seconds", "compute_samples", "compute_steps")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_TIME_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    BEAT_TIME_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_STEPS_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    rank: int
    pid: int
    step: int
    progress_time: _timestamp_pb2.Timestamp
    waiting: bool
    beat_time: _timestamp_pb2.Timestamp
    samples: int
    loss: float
    compute_generation: int
    compute_seconds: float
    compute_samples: int
    compute_steps: int
    def __init__(self, local_rank: _Optional[int] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., step: _Optional[int] = ..., progress_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., waiting: _Optional[bool] = ..., beat_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., samples: _Optional[int] = ..., loss: _Optional[float] = ..., compute_generation: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., compute_samples: _Optional[int] = ..., compute_steps: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sequence", "sent_at", "workers")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    sent_at: _timestamp_pb2.Timestamp
    workers: _containers.RepeatedCompositeFieldContainer[WorkerProgress]
    def __init__(self, sequence: _Optional[int] = ..., sent_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerProgress, _Mapping]]] = ...) -> None: ...

class WorkerExited(_message.Message):
    __slots__ = ("generation", "local_rank", "pid", "exit_code", "signal", "exited_at", "detail", "error", "traceback")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    EXITED_AT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    generation: int
    local_rank: int
    pid: int
    exit_code: int
    signal: int
    exited_at: _timestamp_pb2.Timestamp
    detail: str
    error: str
    traceback: str
    def __init__(self, generation: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., exited_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., detail: _Optional[str] = ..., error: _Optional[str] = ..., traceback: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("generation", "cause", "detail")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    generation: int
    cause: LeaveCause
    detail: str
    def __init__(self, generation: _Optional[int] = ..., cause: _Optional[_Union[LeaveCause, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class GenerationReport(_message.Message):
    __slots__ = ("generation", "phase", "step", "at", "detail", "store_port", "replica_workers")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_WORKERS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    phase: GenerationPhase
    step: int
    at: _timestamp_pb2.Timestamp
    detail: str
    store_port: int
    replica_workers: int
    def __init__(self, generation: _Optional[int] = ..., phase: _Optional[_Union[GenerationPhase, str]] = ..., step: _Optional[int] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., detail: _Optional[str] = ..., store_port: _Optional[int] = ..., replica_workers: _Optional[int] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("registered", "generation", "change_coming")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CHANGE_COMING_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    generation: Generation
    change_coming: ChangeComing
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., generation: _Optional[_Union[Generation, _Mapping]] = ..., change_coming: _Optional[_Union[ChangeComing, _Mapping]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("current_generation", "heartbeat_interval", "heartbeat_timeout", "mode", "progress_timeout", "command", "environment", "working_dir", "procs_per_node", "job_name", "worker_silence_timeout", "replica", "node_index", "nodes_per_replica")
    class EnvironmentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CURRENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    PROCS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    WORKER_SILENCE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NODES_PER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    current_generation: int
    heartbeat_interval: _duration_pb2.Duration
    heartbeat_timeout: _duration_pb2.Duration
    mode: _common_pb2.JobMode
    progress_timeout: _duration_pb2.Duration
    command: _containers.RepeatedScalarFieldContainer[str]
    environment: _containers.ScalarMap[str, str]
    working_dir: str
    procs_per_node: int
    job_name: str
    worker_silence_timeout: _duration_pb2.Duration
    replica: int
    node_index: int
    nodes_per_replica: int
    def __init__(self, current_generation: _Optional[int] = ..., heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., heartbeat_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., mode: _Optional[_Union[_common_pb2.JobMode, str]] = ..., progress_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., command: _Optional[_Iterable[str]] = ..., environment: _Optional[_Mapping[str, str]] = ..., working_dir: _Optional[str] = ..., procs_per_node: _Optional[int] = ..., job_name: _Optional[str] = ..., worker_silence_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., replica: _Optional[int] = ..., node_index: _Optional[int] = ..., nodes_per_replica: _Optional[int] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("generation", "from_generation", "rank_table", "rendezvous", "target_step", "stop_grace", "reason", "failed_unit_id", "leaving", "save_state", "at_step_boundary")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FROM_GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_TABLE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEP_FIELD_NUMBER: _ClassVar[int]
    STOP_GRACE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILED_UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    SAVE_STATE_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    from_generation: int
    rank_table: _common_pb2.RankTable
    rendezvous: _common_pb2.Rendezvous
    target_step: int
    stop_grace: _duration_pb2.Duration
    reason: str
    failed_unit_id: str
    leaving: _containers.RepeatedScalarFieldContainer[str]
    save_state: bool
    at_step_boundary: bool
    def __init__(self, generation: _Optional[int] = ..., from_generation: _Optional[int] = ..., rank_table: _Optional[_Union[_common_pb2.RankTable, _Mapping]] = ..., rendezvous: _Optional[_Union[_common_pb2.Rendezvous, _Mapping]] = ..., target_step: _Optional[int] = ..., stop_grace: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., reason: _Optional[str] = ..., failed_unit_id: _Optional[str] = ..., leaving: _Optional[_Iterable[str]] = ..., save_state: _Optional[bool] = ..., at_step_boundary: _Optional[bool] = ...) -> None: ...

class ChangeComing(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class FollowerMessage(_message.Message):
    __slots__ = ("hello", "proof", "report", "worker_exited", "stopped")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    WORKER_EXITED_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    hello: FollowerHello
    proof: NodeProof
    report: NodeReport
    worker_exited: WorkerExited
    stopped: NodeStopped
    def __init__(self, hello: _Optional[_Union[FollowerHello, _Mapping]] = ..., proof: _Optional[_Union[NodeProof, _Mapping]] = ..., report: _Optional[_Union[NodeReport, _Mapping]] = ..., worker_exited: _Optional[_Union[WorkerExited, _Mapping]] = ..., stopped: _Optional[_Union[NodeStopped, _Mapping]] = ...) -> None: ...

class LeaderMessage(_message.Message):
    __slots__ = ("challenge", "accepted", "start", "stop", "beat", "done")
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    BEAT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    challenge: LeaderChallenge
    accepted: NodeAccepted
    start: NodeStart
    stop: NodeStop
    beat: NodeBeat
    done: NodeDone
    def __init__(self, challenge: _Optional[_Union[LeaderChallenge, _Mapping]] = ..., accepted: _Optional[_Union[NodeAccepted, _Mapping]] = ..., start: _Optional[_Union[NodeStart, _Mapping]] = ..., stop: _Optional[_Union[NodeStop, _Mapping]] = ..., beat: _Optional[_Union[NodeBeat, _Mapping]] = ..., done: _Optional[_Union[NodeDone, _Mapping]] = ...) -> None: ...

class FollowerHello(_message.Message):
    __slots__ = ("job_id", "unit_id", "slurm_job_id", "node_index", "node", "nonce")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    SLURM_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    unit_id: str
    slurm_job_id: int
    node_index: int
    node: str
    nonce: bytes
    def __init__(self, job_id: _Optional[str] = ..., unit_id: _Optional[str] = ..., slurm_job_id: _Optional[int] = ..., node_index: _Optional[int] = ..., node: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class LeaderChallenge(_message.Message):
    __slots__ = ("nonce", "proof")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    proof: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class NodeProof(_message.Message):
    __slots__ = ("proof",)
    PROOF_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    def __init__(self, proof: _Optional[bytes] = ...) -> None: ...

class NodeAccepted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStart(_message.Message):
    __slots__ = ("registered", "start")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    start: Generation
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., start: _Optional[_Union[Generation, _Mapping]] = ...) -> None: ...

class NodeStop(_message.Message):
    __slots__ = ("generation", "grace")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GRACE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    grace: _duration_pb2.Duration
    def __init__(self, generation: _Optional[int] = ..., grace: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class NodeStopped(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class NodeReport(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerProgress]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerProgress, _Mapping]]] = ...) -> None: ...

class NodeBeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeDone(_message.Message):
    __slots__ = ("exit_code", "reason")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    reason: str
    def __init__(self, exit_code: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...
