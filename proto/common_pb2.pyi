from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_MODE_UNSPECIFIED: _ClassVar[JobMode]
    JOB_MODE_LIVE: _ClassVar[JobMode]
    JOB_MODE_RESTART: _ClassVar[JobMode]
JOB_MODE_UNSPECIFIED: JobMode
JOB_MODE_LIVE: JobMode
JOB_MODE_RESTART: JobMode

class RankAssignment(_message.Message):
    __slots__ = ("unit_id", "nodes", "group_rank", "first_rank", "procs_per_node")
    UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    PROCS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    unit_id: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    group_rank: int
    first_rank: int
    procs_per_node: int
    def __init__(self, unit_id: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., group_rank: _Optional[int] = ..., first_rank: _Optional[int] = ..., procs_per_node: _Optional[int] = ...) -> None: ...

class RankTable(_message.Message):
    __slots__ = ("assignments", "world_size", "groups")
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    assignments: _containers.RepeatedCompositeFieldContainer[RankAssignment]
    world_size: int
    groups: int
    def __init__(self, assignments: _Optional[_Iterable[_Union[RankAssignment, _Mapping]]] = ..., world_size: _Optional[int] = ..., groups: _Optional[int] = ...) -> None: ...

class Rendezvous(_message.Message):
    __slots__ = ("host", "port", "host_unit_id")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    host_unit_id: str
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., host_unit_id: _Optional[str] = ...) -> None: ...
