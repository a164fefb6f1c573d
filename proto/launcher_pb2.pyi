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
    LEAVE_CAUSE_DRAINED: _ClassVar[LeaveCause]
    LEAVE_CAUSE_SHUTDOWN: _ClassVar[LeaveCause]

class EpochPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EPOCH_PHASE_UNSPECIFIED: _ClassVar[EpochPhase]
    EPOCH_PHASE_STARTED: _ClassVar[EpochPhase]
    EPOCH_PHASE_RECONFIGURED: _ClassVar[EpochPhase]
    EPOCH_PHASE_STOPPED: _ClassVar[EpochPhase]
    EPOCH_PHASE_LEFT: _ClassVar[EpochPhase]
    EPOCH_PHASE_FIRST_STEP: _ClassVar[EpochPhase]
    EPOCH_PHASE_FINISHED: _ClassVar[EpochPhase]
    EPOCH_PHASE_RESUMED_FROM_CHECKPOINT: _ClassVar[EpochPhase]
    EPOCH_PHASE_STATE_LOST: _ClassVar[EpochPhase]
LEAVE_CAUSE_UNSPECIFIED: LeaveCause
LEAVE_CAUSE_PREEMPTED: LeaveCause
LEAVE_CAUSE_DRAINED: LeaveCause
LEAVE_CAUSE_SHUTDOWN: LeaveCause
EPOCH_PHASE_UNSPECIFIED: EpochPhase
EPOCH_PHASE_STARTED: EpochPhase
EPOCH_PHASE_RECONFIGURED: EpochPhase
EPOCH_PHASE_STOPPED: EpochPhase
EPOCH_PHASE_LEFT: EpochPhase
EPOCH_PHASE_FIRST_STEP: EpochPhase
EPOCH_PHASE_FINISHED: EpochPhase
EPOCH_PHASE_RESUMED_FROM_CHECKPOINT: EpochPhase
EPOCH_PHASE_STATE_LOST: EpochPhase

class LauncherMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "worker_exited", "leave_request", "epoch_report")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    WORKER_EXITED_FIELD_NUMBER: _ClassVar[int]
    LEAVE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    EPOCH_REPORT_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    worker_exited: WorkerExited
    leave_request: LeaveRequest
    epoch_report: EpochReport
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., worker_exited: _Optional[_Union[WorkerExited, _Mapping]] = ..., leave_request: _Optional[_Union[LeaveRequest, _Mapping]] = ..., epoch_report: _Optional[_Union[EpochReport, _Mapping]] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("job_id", "unit_id", "secret", "nodes", "address", "procs_per_node", "slurm_job_id", "last_epoch", "worker_pids", "launcher_version", "store_port")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROCS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    SLURM_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORKER_PIDS_FIELD_NUMBER: _ClassVar[int]
    LAUNCHER_VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    unit_id: str
    secret: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    address: str
    procs_per_node: int
    slurm_job_id: int
    last_epoch: int
    worker_pids: _containers.RepeatedScalarFieldContainer[int]
    launcher_version: str
    store_port: int
    def __init__(self, job_id: _Optional[str] = ..., unit_id: _Optional[str] = ..., secret: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., address: _Optional[str] = ..., procs_per_node: _Optional[int] = ..., slurm_job_id: _Optional[int] = ..., last_epoch: _Optional[int] = ..., worker_pids: _Optional[_Iterable[int]] = ..., launcher_version: _Optional[str] = ..., store_port: _Optional[int] = ...) -> None: ...

class WorkerProgress(_message.Message):
    __slots__ = ("local_rank", "rank", "pid", "step", "progress_time", "waiting", "beat_time", "samples", "loss")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_TIME_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    BEAT_TIME_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    rank: int
    pid: int
    step: int
    progress_time: _timestamp_pb2.Timestamp
    waiting: bool
    beat_time: _timestamp_pb2.Timestamp
    samples: int
    loss: float
    def __init__(self, local_rank: _Optional[int] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., step: _Optional[int] = ..., progress_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., waiting: _Optional[bool] = ..., beat_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., samples: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("epoch", "sequence", "sent_at", "workers")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    sequence: int
    sent_at: _timestamp_pb2.Timestamp
    workers: _containers.RepeatedCompositeFieldContainer[WorkerProgress]
    def __init__(self, epoch: _Optional[int] = ..., sequence: _Optional[int] = ..., sent_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerProgress, _Mapping]]] = ...) -> None: ...

class WorkerExited(_message.Message):
    __slots__ = ("epoch", "local_rank", "pid", "exit_code", "signal", "exited_at", "detail", "error", "traceback")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    EXITED_AT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    local_rank: int
    pid: int
    exit_code: int
    signal: int
    exited_at: _timestamp_pb2.Timestamp
    detail: str
    error: str
    traceback: str
    def __init__(self, epoch: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., exited_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., detail: _Optional[str] = ..., error: _Optional[str] = ..., traceback: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("epoch", "cause", "deadline", "detail")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    cause: LeaveCause
    deadline: _timestamp_pb2.Timestamp
    detail: str
    def __init__(self, epoch: _Optional[int] = ..., cause: _Optional[_Union[LeaveCause, str]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., detail: _Optional[str] = ...) -> None: ...

class EpochReport(_message.Message):
    __slots__ = ("epoch", "phase", "step", "at", "detail", "store_port")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    phase: EpochPhase
    step: int
    at: _timestamp_pb2.Timestamp
    detail: str
    store_port: int
    def __init__(self, epoch: _Optional[int] = ..., phase: _Optional[_Union[EpochPhase, str]] = ..., step: _Optional[int] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., detail: _Optional[str] = ..., store_port: _Optional[int] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("registered", "start_epoch", "reconfigure", "stop_epoch", "leave")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    START_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_FIELD_NUMBER: _ClassVar[int]
    STOP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    start_epoch: StartEpoch
    reconfigure: Reconfigure
    stop_epoch: StopEpoch
    leave: Leave
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., start_epoch: _Optional[_Union[StartEpoch, _Mapping]] = ..., reconfigure: _Optional[_Union[Reconfigure, _Mapping]] = ..., stop_epoch: _Optional[_Union[StopEpoch, _Mapping]] = ..., leave: _Optional[_Union[Leave, _Mapping]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("current_epoch", "heartbeat_interval", "heartbeat_timeout", "mode", "progress_timeout", "command", "environment", "working_dir", "procs_per_node", "job_name", "worker_silence_timeout")
    class EnvironmentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CURRENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
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
    current_epoch: int
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
    def __init__(self, current_epoch: _Optional[int] = ..., heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., heartbeat_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., mode: _Optional[_Union[_common_pb2.JobMode, str]] = ..., progress_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., command: _Optional[_Iterable[str]] = ..., environment: _Optional[_Mapping[str, str]] = ..., working_dir: _Optional[str] = ..., procs_per_node: _Optional[int] = ..., job_name: _Optional[str] = ..., worker_silence_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class StartEpoch(_message.Message):
    __slots__ = ("epoch", "rank_table", "rendezvous", "resume_step", "state_holders", "stop_grace")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_TABLE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    STOP_GRACE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    rank_table: _common_pb2.RankTable
    rendezvous: _common_pb2.Rendezvous
    resume_step: int
    state_holders: _containers.RepeatedScalarFieldContainer[str]
    stop_grace: _duration_pb2.Duration
    def __init__(self, epoch: _Optional[int] = ..., rank_table: _Optional[_Union[_common_pb2.RankTable, _Mapping]] = ..., rendezvous: _Optional[_Union[_common_pb2.Rendezvous, _Mapping]] = ..., resume_step: _Optional[int] = ..., state_holders: _Optional[_Iterable[str]] = ..., stop_grace: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Reconfigure(_message.Message):
    __slots__ = ("epoch", "from_epoch", "rank_table", "rendezvous", "state_sources", "target_step")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FROM_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_TABLE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    STATE_SOURCES_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEP_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    from_epoch: int
    rank_table: _common_pb2.RankTable
    rendezvous: _common_pb2.Rendezvous
    state_sources: _containers.RepeatedScalarFieldContainer[str]
    target_step: int
    def __init__(self, epoch: _Optional[int] = ..., from_epoch: _Optional[int] = ..., rank_table: _Optional[_Union[_common_pb2.RankTable, _Mapping]] = ..., rendezvous: _Optional[_Union[_common_pb2.Rendezvous, _Mapping]] = ..., state_sources: _Optional[_Iterable[str]] = ..., target_step: _Optional[int] = ...) -> None: ...

class StopEpoch(_message.Message):
    __slots__ = ("epoch", "reason", "failed_unit_id", "grace")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILED_UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    reason: str
    failed_unit_id: str
    grace: _duration_pb2.Duration
    def __init__(self, epoch: _Optional[int] = ..., reason: _Optional[str] = ..., failed_unit_id: _Optional[str] = ..., grace: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Leave(_message.Message):
    __slots__ = ("epoch", "reason", "save_state")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SAVE_STATE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    reason: str
    save_state: bool
    def __init__(self, epoch: _Optional[int] = ..., reason: _Optional[str] = ..., save_state: _Optional[bool] = ...) -> None: ...

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
    start: StartEpoch
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., start: _Optional[_Union[StartEpoch, _Mapping]] = ...) -> None: ...

class NodeStop(_message.Message):
    __slots__ = ("epoch", "grace")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GRACE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    grace: _duration_pb2.Duration
    def __init__(self, epoch: _Optional[int] = ..., grace: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class NodeStopped(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

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
