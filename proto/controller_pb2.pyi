from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SwitchRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[SwitchRole]
    STAR: _ClassVar[SwitchRole]
    TOR: _ClassVar[SwitchRole]
    CLUSTER: _ClassVar[SwitchRole]
    RAIL: _ClassVar[SwitchRole]

class PeerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_UNSPECIFIED: _ClassVar[PeerKind]
    PEER_WORKER: _ClassVar[PeerKind]
    PEER_NODE: _ClassVar[PeerKind]
    PEER_SWITCH: _ClassVar[PeerKind]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    PLANNED: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    DEGRADED: _ClassVar[JobState]
    ENDED: _ClassVar[JobState]
ROLE_UNSPECIFIED: SwitchRole
STAR: SwitchRole
TOR: SwitchRole
CLUSTER: SwitchRole
RAIL: SwitchRole
PEER_UNSPECIFIED: PeerKind
PEER_WORKER: PeerKind
PEER_NODE: PeerKind
PEER_SWITCH: PeerKind
JOB_STATE_UNSPECIFIED: JobState
PLANNED: JobState
RUNNING: JobState
DEGRADED: JobState
ENDED: JobState

class SwitchPort(_message.Message):
    __slots__ = ("number", "udp_address", "interface", "peer_kind", "peer", "peer_port", "mac", "ip", "ingress_drop_threshold", "egress_drop_threshold")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    UDP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INTERFACE_FIELD_NUMBER: _ClassVar[int]
    PEER_KIND_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PEER_PORT_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    INGRESS_DROP_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    EGRESS_DROP_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    number: int
    udp_address: str
    interface: str
    peer_kind: PeerKind
    peer: str
    peer_port: int
    mac: str
    ip: str
    ingress_drop_threshold: int
    egress_drop_threshold: int
    def __init__(self, number: _Optional[int] = ..., udp_address: _Optional[str] = ..., interface: _Optional[str] = ..., peer_kind: _Optional[_Union[PeerKind, str]] = ..., peer: _Optional[str] = ..., peer_port: _Optional[int] = ..., mac: _Optional[str] = ..., ip: _Optional[str] = ..., ingress_drop_threshold: _Optional[int] = ..., egress_drop_threshold: _Optional[int] = ...) -> None: ...

class Ipv4Route(_message.Message):
    __slots__ = ("prefix", "port", "mac")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    port: int
    mac: str
    def __init__(self, prefix: _Optional[str] = ..., port: _Optional[int] = ..., mac: _Optional[str] = ...) -> None: ...

class Switch(_message.Message):
    __slots__ = ("name", "p4runtime_address", "device_id", "target", "lanes", "slots", "role", "rail", "ports", "service_address", "udp_port", "metrics_address", "routes", "health", "last_seen", "jobs", "programmed", "drift")
    NAME_FIELD_NUMBER: _ClassVar[int]
    P4RUNTIME_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RAIL_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UDP_PORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    PROGRAMMED_FIELD_NUMBER: _ClassVar[int]
    DRIFT_FIELD_NUMBER: _ClassVar[int]
    name: str
    p4runtime_address: str
    device_id: int
    target: str
    lanes: int
    slots: int
    role: SwitchRole
    rail: int
    ports: _containers.RepeatedCompositeFieldContainer[SwitchPort]
    service_address: str
    udp_port: int
    metrics_address: str
    routes: _containers.RepeatedCompositeFieldContainer[Ipv4Route]
    health: str
    last_seen: float
    jobs: _containers.RepeatedScalarFieldContainer[str]
    programmed: str
    drift: str
    def __init__(self, name: _Optional[str] = ..., p4runtime_address: _Optional[str] = ..., device_id: _Optional[int] = ..., target: _Optional[str] = ..., lanes: _Optional[int] = ..., slots: _Optional[int] = ..., role: _Optional[_Union[SwitchRole, str]] = ..., rail: _Optional[int] = ..., ports: _Optional[_Iterable[_Union[SwitchPort, _Mapping]]] = ..., service_address: _Optional[str] = ..., udp_port: _Optional[int] = ..., metrics_address: _Optional[str] = ..., routes: _Optional[_Iterable[_Union[Ipv4Route, _Mapping]]] = ..., health: _Optional[str] = ..., last_seen: _Optional[float] = ..., jobs: _Optional[_Iterable[str]] = ..., programmed: _Optional[str] = ..., drift: _Optional[str] = ...) -> None: ...

class RegisterSwitchRequest(_message.Message):
    __slots__ = ("switch",)
    SWITCH_FIELD_NUMBER: _ClassVar[int]
    switch: Switch
    def __init__(self, switch: _Optional[_Union[Switch, _Mapping]] = ...) -> None: ...

class RegisterSwitchResponse(_message.Message):
    __slots__ = ("switch", "message")
    SWITCH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    switch: Switch
    message: str
    def __init__(self, switch: _Optional[_Union[Switch, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("removed", "message")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    message: str
    def __init__(self, removed: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class ListSwitchesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSwitchesResponse(_message.Message):
    __slots__ = ("switches",)
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    switches: _containers.RepeatedCompositeFieldContainer[Switch]
    def __init__(self, switches: _Optional[_Iterable[_Union[Switch, _Mapping]]] = ...) -> None: ...

class NodeCapacity(_message.Message):
    __slots__ = ("params_per_second", "ram_bytes", "disk_bytes")
    PARAMS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    params_per_second: float
    ram_bytes: int
    disk_bytes: int
    def __init__(self, params_per_second: _Optional[float] = ..., ram_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("name", "data_address", "capacity", "health", "last_seen", "drained", "jobs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    name: str
    data_address: str
    capacity: NodeCapacity
    health: str
    last_seen: float
    drained: bool
    jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., data_address: _Optional[str] = ..., capacity: _Optional[_Union[NodeCapacity, _Mapping]] = ..., health: _Optional[str] = ..., last_seen: _Optional[float] = ..., drained: _Optional[bool] = ..., jobs: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: Node
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("node", "message")
    NODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    node: Node
    message: str
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DrainNodeResponse(_message.Message):
    __slots__ = ("node", "affected_jobs")
    NODE_FIELD_NUMBER: _ClassVar[int]
    AFFECTED_JOBS_FIELD_NUMBER: _ClassVar[int]
    node: Node
    affected_jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ..., affected_jobs: _Optional[_Iterable[str]] = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ("layer_id", "numel")
    LAYER_ID_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    layer_id: int
    numel: int
    def __init__(self, layer_id: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "params", "param_dtype")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PARAM_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    params: _containers.ScalarMap[str, float]
    param_dtype: str
    def __init__(self, name: _Optional[str] = ..., params: _Optional[_Mapping[str, float]] = ..., param_dtype: _Optional[str] = ...) -> None: ...

class TopologyHints(_message.Message):
    __slots__ = ("layout", "switches", "workers_per_switch")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_PER_SWITCH_FIELD_NUMBER: _ClassVar[int]
    layout: str
    switches: _containers.RepeatedScalarFieldContainer[str]
    workers_per_switch: int
    def __init__(self, layout: _Optional[str] = ..., switches: _Optional[_Iterable[str]] = ..., workers_per_switch: _Optional[int] = ...) -> None: ...

class PoolSizes(_message.Message):
    __slots__ = ("meta", "data", "node")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    meta: int
    data: int
    node: int
    def __init__(self, meta: _Optional[int] = ..., data: _Optional[int] = ..., node: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "name", "num_workers", "layers", "optimizer", "packet_mode", "num_nodes", "hints", "pools", "state", "joined_ranks", "created", "switches", "nodes", "message")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    PACKET_MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOINED_RANKS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    num_workers: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    optimizer: OptimizerSpec
    packet_mode: str
    num_nodes: int
    hints: TopologyHints
    pools: PoolSizes
    state: JobState
    joined_ranks: _containers.RepeatedScalarFieldContainer[int]
    created: float
    switches: _containers.RepeatedScalarFieldContainer[str]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    message: str
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., num_workers: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., packet_mode: _Optional[str] = ..., num_nodes: _Optional[int] = ..., hints: _Optional[_Union[TopologyHints, _Mapping]] = ..., pools: _Optional[_Union[PoolSizes, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., joined_ranks: _Optional[_Iterable[int]] = ..., created: _Optional[float] = ..., switches: _Optional[_Iterable[str]] = ..., nodes: _Optional[_Iterable[str]] = ..., message: _Optional[str] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class CreateJobResponse(_message.Message):
    __slots__ = ("job", "job_token")
    JOB_FIELD_NUMBER: _ClassVar[int]
    JOB_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job: Job
    job_token: str
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., job_token: _Optional[str] = ...) -> None: ...

class JoinJobRequest(_message.Message):
    __slots__ = ("job_id", "rank", "endpoint_address")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    endpoint_address: str
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., endpoint_address: _Optional[str] = ...) -> None: ...

class JoinJobResponse(_message.Message):
    __slots__ = ("endpoint_plan_json", "job_json")
    ENDPOINT_PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    JOB_JSON_FIELD_NUMBER: _ClassVar[int]
    endpoint_plan_json: str
    job_json: str
    def __init__(self, endpoint_plan_json: _Optional[str] = ..., job_json: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("include_ended",)
    INCLUDE_ENDED_FIELD_NUMBER: _ClassVar[int]
    include_ended: bool
    def __init__(self, include_ended: _Optional[bool] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class EndJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class EndJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetPlanResponse(_message.Message):
    __slots__ = ("plan_json", "explanation")
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    plan_json: str
    explanation: str
    def __init__(self, plan_json: _Optional[str] = ..., explanation: _Optional[str] = ...) -> None: ...

class HealthReport(_message.Message):
    __slots__ = ("kind", "name", "counters", "detail")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    counters: _containers.ScalarMap[str, int]
    detail: str
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ..., detail: _Optional[str] = ...) -> None: ...

class HealthAck(_message.Message):
    __slots__ = ("known", "health_timeout")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    HEALTH_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    known: bool
    health_timeout: float
    def __init__(self, known: _Optional[bool] = ..., health_timeout: _Optional[float] = ...) -> None: ...

class GetCountersRequest(_message.Message):
    __slots__ = ("switch_name",)
    SWITCH_NAME_FIELD_NUMBER: _ClassVar[int]
    switch_name: str
    def __init__(self, switch_name: _Optional[str] = ...) -> None: ...

class CounterValue(_message.Message):
    __slots__ = ("counter", "index", "label", "packets", "bytes")
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PACKETS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    counter: str
    index: int
    label: str
    packets: int
    bytes: int
    def __init__(self, counter: _Optional[str] = ..., index: _Optional[int] = ..., label: _Optional[str] = ..., packets: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class SwitchCounters(_message.Message):
    __slots__ = ("switch", "values", "error")
    SWITCH_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    switch: str
    values: _containers.RepeatedCompositeFieldContainer[CounterValue]
    error: str
    def __init__(self, switch: _Optional[str] = ..., values: _Optional[_Iterable[_Union[CounterValue, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class GetCountersResponse(_message.Message):
    __slots__ = ("switches",)
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    switches: _containers.RepeatedCompositeFieldContainer[SwitchCounters]
    def __init__(self, switches: _Optional[_Iterable[_Union[SwitchCounters, _Mapping]]] = ...) -> None: ...

class GetTopRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetTopResponse(_message.Message):
    __slots__ = ("top_json",)
    TOP_JSON_FIELD_NUMBER: _ClassVar[int]
    top_json: str
    def __init__(self, top_json: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "switches", "switches_up", "nodes", "nodes_up", "jobs_active", "uptime", "db_path", "epoch_counter")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_UP_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODES_UP_FIELD_NUMBER: _ClassVar[int]
    JOBS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_FIELD_NUMBER: _ClassVar[int]
    DB_PATH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_COUNTER_FIELD_NUMBER: _ClassVar[int]
    version: str
    switches: int
    switches_up: int
    nodes: int
    nodes_up: int
    jobs_active: int
    uptime: float
    db_path: str
    epoch_counter: int
    def __init__(self, version: _Optional[str] = ..., switches: _Optional[int] = ..., switches_up: _Optional[int] = ..., nodes: _Optional[int] = ..., nodes_up: _Optional[int] = ..., jobs_active: _Optional[int] = ..., uptime: _Optional[float] = ..., db_path: _Optional[str] = ..., epoch_counter: _Optional[int] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "include_past")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PAST_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    include_past: bool
    def __init__(self, job_id: _Optional[str] = ..., include_past: _Optional[bool] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("job_id", "seq", "time", "kind", "subject", "message")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    seq: int
    time: float
    kind: str
    subject: str
    message: str
    def __init__(self, job_id: _Optional[str] = ..., seq: _Optional[int] = ..., time: _Optional[float] = ..., kind: _Optional[str] = ..., subject: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
