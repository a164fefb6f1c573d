import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tidal.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_RECONFIGURING: _ClassVar[JobState]
    JOB_STATE_DEGRADED: _ClassVar[JobState]
    JOB_STATE_COMPLETED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_FINISHING: _ClassVar[JobState]

class UnitState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNIT_STATE_UNSPECIFIED: _ClassVar[UnitState]
    UNIT_STATE_SUBMITTED: _ClassVar[UnitState]
    UNIT_STATE_JOINING: _ClassVar[UnitState]
    UNIT_STATE_ACTIVE: _ClassVar[UnitState]
    UNIT_STATE_LEAVING: _ClassVar[UnitState]
    UNIT_STATE_LEFT: _ClassVar[UnitState]
    UNIT_STATE_FAILED: _ClassVar[UnitState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_RECONFIGURING: JobState
JOB_STATE_DEGRADED: JobState
JOB_STATE_COMPLETED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_FINISHING: JobState
UNIT_STATE_UNSPECIFIED: UnitState
UNIT_STATE_SUBMITTED: UnitState
UNIT_STATE_JOINING: UnitState
UNIT_STATE_ACTIVE: UnitState
UNIT_STATE_LEAVING: UnitState
UNIT_STATE_LEFT: UnitState
UNIT_STATE_FAILED: UnitState

class JobSpec(_message.Message):
    __slots__ = ("name", "min_replicas", "max_replicas", "nodes_per_replica", "procs_per_node", "global_batch", "mode", "command", "sbatch_options", "partition", "working_dir", "environment", "replica_step", "allowed_replicas", "yield_to_pending", "weight")
    class EnvironmentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NODES_PER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    PROCS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    SBATCH_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STEP_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    YIELD_TO_PENDING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    min_replicas: int
    max_replicas: int
    nodes_per_replica: int
    procs_per_node: int
    global_batch: int
    mode: _common_pb2.JobMode
    command: _containers.RepeatedScalarFieldContainer[str]
    sbatch_options: _containers.RepeatedScalarFieldContainer[str]
    partition: str
    working_dir: str
    environment: _containers.ScalarMap[str, str]
    replica_step: int
    allowed_replicas: _containers.RepeatedScalarFieldContainer[int]
    yield_to_pending: bool
    weight: int
    def __init__(self, name: _Optional[str] = ..., min_replicas: _Optional[int] = ..., max_replicas: _Optional[int] = ..., nodes_per_replica: _Optional[int] = ..., procs_per_node: _Optional[int] = ..., global_batch: _Optional[int] = ..., mode: _Optional[_Union[_common_pb2.JobMode, str]] = ..., command: _Optional[_Iterable[str]] = ..., sbatch_options: _Optional[_Iterable[str]] = ..., partition: _Optional[str] = ..., working_dir: _Optional[str] = ..., environment: _Optional[_Mapping[str, str]] = ..., replica_step: _Optional[int] = ..., allowed_replicas: _Optional[_Iterable[int]] = ..., yield_to_pending: _Optional[bool] = ..., weight: _Optional[int] = ...) -> None: ...

class Unit(_message.Message):
    __slots__ = ("unit_id", "slurm_job_id", "nodes", "state", "group_rank", "last_heartbeat", "replica", "node_index", "compute_ratio", "straggler")
    UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    SLURM_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_RATIO_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    unit_id: str
    slurm_job_id: int
    nodes: _containers.RepeatedScalarFieldContainer[str]
    state: UnitState
    group_rank: int
    last_heartbeat: _timestamp_pb2.Timestamp
    replica: int
    node_index: int
    compute_ratio: float
    straggler: bool
    def __init__(self, unit_id: _Optional[str] = ..., slurm_job_id: _Optional[int] = ..., nodes: _Optional[_Iterable[str]] = ..., state: _Optional[_Union[UnitState, str]] = ..., group_rank: _Optional[int] = ..., last_heartbeat: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., replica: _Optional[int] = ..., node_index: _Optional[int] = ..., compute_ratio: _Optional[float] = ..., straggler: _Optional[bool] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "spec", "state", "owner_uid", "generation", "world_size", "replicas", "step", "samples_per_second", "goodput", "created_at", "last_event", "units")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: JobSpec
    state: JobState
    owner_uid: int
    generation: int
    world_size: int
    replicas: int
    step: int
    samples_per_second: float
    goodput: float
    created_at: _timestamp_pb2.Timestamp
    last_event: Event
    units: _containers.RepeatedCompositeFieldContainer[Unit]
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., owner_uid: _Optional[int] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., replicas: _Optional[int] = ..., step: _Optional[int] = ..., samples_per_second: _Optional[float] = ..., goodput: _Optional[float] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_event: _Optional[_Union[Event, _Mapping]] = ..., units: _Optional[_Iterable[_Union[Unit, _Mapping]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("sequence", "time", "job_id", "unit_id", "generation", "kind", "reason", "fields")
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    time: _timestamp_pb2.Timestamp
    job_id: str
    unit_id: str
    generation: int
    kind: str
    reason: str
    fields: _containers.ScalarMap[str, str]
    def __init__(self, sequence: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., job_id: _Optional[str] = ..., unit_id: _Optional[str] = ..., generation: _Optional[int] = ..., kind: _Optional[str] = ..., reason: _Optional[str] = ..., fields: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("name", "state", "flags", "partitions", "cpus", "gres", "reason", "job_id", "unit_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    GRES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    flags: _containers.RepeatedScalarFieldContainer[str]
    partitions: _containers.RepeatedScalarFieldContainer[str]
    cpus: int
    gres: str
    reason: str
    job_id: str
    unit_id: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., flags: _Optional[_Iterable[str]] = ..., partitions: _Optional[_Iterable[str]] = ..., cpus: _Optional[int] = ..., gres: _Optional[str] = ..., reason: _Optional[str] = ..., job_id: _Optional[str] = ..., unit_id: _Optional[str] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "owner")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    owner: str
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., owner: _Optional[str] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job", "secret_path")
    JOB_FIELD_NUMBER: _ClassVar[int]
    SECRET_PATH_FIELD_NUMBER: _ClassVar[int]
    job: Job
    secret_path: str
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., secret_path: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("include_finished",)
    INCLUDE_FINISHED_FIELD_NUMBER: _ClassVar[int]
    include_finished: bool
    def __init__(self, include_finished: _Optional[bool] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("job_id", "after_sequence", "limit")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_sequence: int
    limit: int
    def __init__(self, job_id: _Optional[str] = ..., after_sequence: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes", "stale", "observed_at")
    NODES_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_AT_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    stale: bool
    observed_at: _timestamp_pb2.Timestamp
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., stale: _Optional[bool] = ..., observed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ResizeJobRequest(_message.Message):
    __slots__ = ("job_id", "min_replicas", "max_replicas")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    min_replicas: int
    max_replicas: int
    def __init__(self, job_id: _Optional[str] = ..., min_replicas: _Optional[int] = ..., max_replicas: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: str
    def __init__(self, target: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("unit_ids",)
    UNIT_IDS_FIELD_NUMBER: _ClassVar[int]
    unit_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unit_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobHistoryRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ProgressSample(_message.Message):
    __slots__ = ("time", "step", "samples", "world_size", "loss")
    TIME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    time: _timestamp_pb2.Timestamp
    step: int
    samples: int
    world_size: int
    loss: float
    def __init__(self, time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., step: _Optional[int] = ..., samples: _Optional[int] = ..., world_size: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class JobHistory(_message.Message):
    __slots__ = ("job_id", "global_batch", "samples", "events")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    global_batch: int
    samples: _containers.RepeatedCompositeFieldContainer[ProgressSample]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, job_id: _Optional[str] = ..., global_batch: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[ProgressSample, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...
