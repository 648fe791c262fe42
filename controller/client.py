"""A small synchronous client of the controller for daemons, workers and `luwu-ctl`.

`ControllerClient(address, token)` (defaults: $LUWU_CONTROLLER, $LUWU_TOKEN) wraps the gRPC
stub: every call carries `authorization: Bearer <token>`, an unreachable controller raises
`ControllerUnreachable` saying what to check, and a refusal raises `ControllerRefused` with
the status code and the controller's explanation. `heartbeat_loop` reports a daemon's health
from a background thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message

from luwu.dataplane.process.usage import check_host_port, pem_certificates_or_error
from luwu.dataplane.session import EndpointPlan, shm_port_address
from luwu.proto import controller_pb2 as pb
from luwu.proto import controller_pb2_grpc as pb_grpc

from .config import CONTROLLER_ENV, DEFAULT_LISTEN, TOKEN_ENV

if TYPE_CHECKING:
    from luwu.dataplane.switch import SoftwareSwitch

DEFAULT_TIMEOUT = 30.0  # seconds per RPC (CreateJob programs switches)
DEFAULT_HEARTBEAT = 2.0  # seconds between heartbeats


class ControllerUnreachable(ConnectionError):
    pass


class ControllerRefused(RuntimeError):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class ControllerClient:
    """A synchronous client of the controller's gRPC API (`luwu.v1.Controller`).

    Args:
        address: the controller, `host:port` or `unix:/path` (default: $LUWU_CONTROLLER, else the
            controller's default listen address).
        token: the admin or a job's token, sent as `authorization: Bearer <token>` (default: $LUWU_TOKEN).
        tls_ca: a CA bundle (PEM file) to reach the controller over TLS; plain gRPC without it.
        timeout: seconds per RPC.
        options: extra gRPC channel options (e.g. keepalive, see `watch.keepalive_options`).

    Every method raises `ControllerUnreachable` when the controller does not answer and
    `ControllerRefused` (its status code and explanation) when it refuses the request.

    Examples::

        >>> with ControllerClient("127.0.0.1:50100", token) as ctl:
        ...     job, job_token = ctl.create_job(pb.Job(name="demo", num_workers=2))
        ...     plans = ctl.node_plans(job.job_id, "node0", token=job_token)
    """

    def __init__(self, address: str | None = None, token: str | None = None, tls_ca: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, options: list[tuple[str, int]] | None = None):
        self.address = address or os.environ.get(CONTROLLER_ENV) or DEFAULT_LISTEN
        if not self.address.startswith("unix:") and "://" not in self.address:
            check_host_port(self.address, f"controller address (--controller or ${CONTROLLER_ENV})")
        self.token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        self.timeout = timeout
        if tls_ca:
            creds = grpc.ssl_channel_credentials(pem_certificates_or_error(tls_ca, "--tls-ca"))
            self.channel = grpc.secure_channel(self.address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(self.address, options=options)
        self.stub = pb_grpc.ControllerStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _metadata(self, token: str | None) -> list[tuple[str, str]]:
        tok = token if token is not None else self.token
        return [("authorization", f"Bearer {tok}")] if tok else []

    def _refusal(self, exc: grpc.RpcError) -> ControllerUnreachable | ControllerRefused:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and \
                "cannot program" not in (exc.details() or ""):
            return ControllerUnreachable(
                f"cannot reach the luwu controller at {self.address}: is `luwu controller` running? check "
                f"--controller / {CONTROLLER_ENV} ({code.name}: {exc.details()})")
        return ControllerRefused(code, exc.details() or "")

    def call(self, method: str, request: Message, token: str | None = None, timeout: float | None = None) -> Any:
        """RPC `method` (its name in controller.proto) with `request`; returns its response message."""
        try:
            return getattr(self.stub, method)(request, metadata=self._metadata(token),
                                              timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise self._refusal(exc) from None

    # -- registrations ----------------------------------------------------------------------------
    def register_switch(self, switch: pb.Switch) -> pb.RegisterSwitchResponse:
        return self.call("RegisterSwitch", pb.RegisterSwitchRequest(switch=switch))

    def register_node(self, node: pb.Node) -> pb.RegisterNodeResponse:
        return self.call("RegisterNode", pb.RegisterNodeRequest(node=node))

    def deregister_switch(self, name: str) -> pb.DeregisterResponse:
        return self.call("DeregisterSwitch", pb.DeregisterRequest(name=name))

    def deregister_node(self, name: str) -> pb.DeregisterResponse:
        return self.call("DeregisterNode", pb.DeregisterRequest(name=name))

    def switches(self) -> list[pb.Switch]:
        return list(self.call("ListSwitches", pb.ListSwitchesRequest()).switches)

    def nodes(self) -> list[pb.Node]:
        return list(self.call("ListNodes", pb.ListNodesRequest()).nodes)

    def drain(self, name: str) -> pb.DrainNodeResponse:
        return self.call("DrainNode", pb.DrainNodeRequest(name=name))

    # -- jobs -----------------------------------------------------------------------------------
    def create_job(self, job: pb.Job) -> tuple[pb.Job, str]:
        resp = self.call("CreateJob", pb.CreateJobRequest(job=job))
        return resp.job, resp.job_token

    def join_job(self, job_id: str, rank: int, endpoint: str, token: str | None = None) -> tuple[EndpointPlan, dict]:
        import json

        resp = self.call("JoinJob", pb.JoinJobRequest(job_id=job_id, rank=rank, endpoint_address=endpoint), token)
        return EndpointPlan.from_json(resp.endpoint_plan_json), json.loads(resp.job_json)

    def job(self, job_id: str, token: str | None = None) -> pb.Job:
        return self.call("GetJob", pb.GetJobRequest(job_id=job_id), token)

    def jobs(self, include_ended: bool = False) -> list[pb.Job]:
        return list(self.call("ListJobs", pb.ListJobsRequest(include_ended=include_ended)).jobs)

    def end_job(self, job_id: str, token: str | None = None) -> pb.Job:
        return self.call("EndJob", pb.EndJobRequest(job_id=job_id), token).job

    def plan(self, job_id: str, token: str | None = None) -> pb.GetPlanResponse:
        return self.call("GetPlan", pb.GetPlanRequest(job_id=job_id), token)

    def node_plans(self, job_id: str, node: str, token: str | None = None) -> list[EndpointPlan]:
        """An optimizer node's EndpointPlans for a job (one per switch port it serves the job on)."""
        from .plan import JobPlan

        plan = JobPlan.from_json(self.plan(job_id, token).plan_json)
        if node not in plan.nodes:
            raise ControllerRefused(grpc.StatusCode.NOT_FOUND, f"node {node} does not serve job {job_id} "
                                                               f"(its nodes: {', '.join(plan.nodes) or 'none'})")
        return plan.node_plans(node)

    def watch(self, job_id: str, include_past: bool = True, token: str | None = None,
              timeout: float | None = None) -> Iterator[pb.JobEvent]:
        stream = self.stub.WatchJob(pb.WatchJobRequest(job_id=job_id, include_past=include_past),
                                    metadata=self._metadata(token), timeout=timeout)
        try:
            yield from stream
        except grpc.RpcError as exc:
            ended = exc.code() == grpc.StatusCode.CANCELLED or (
                timeout is not None and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
            if not ended:  # a watch that ran out its own timeout just ends
                raise self._refusal(exc) from None
        finally:
            stream.cancel()

    # -- health and counters ------------------------------------------------------------------------
    def report_health(self, kind: str, name: str, counters: dict[str, int] | None = None,
                      detail: str = "") -> pb.HealthAck:
        return self.call("ReportHealth", pb.HealthReport(kind=kind, name=name, counters=counters or {},
                                                         detail=detail))

    def heartbeat_loop(self, kind: str, name: str, interval: float = DEFAULT_HEARTBEAT,
                       counters: Callable[[], dict[str, int]] | None = None,
                       on_error: Callable[[Exception], None] | None = None) -> Heartbeat:
        return Heartbeat(self, kind, name, interval, counters, on_error)

    def counters(self, switch: str = "") -> list[pb.SwitchCounters]:
        return list(self.call("GetCounters", pb.GetCountersRequest(switch_name=switch)).switches)

    def status(self) -> pb.StatusResponse:
        return self.call("Status", pb.StatusRequest())


class Heartbeat:
    """Reports `kind`/`name` every `interval` seconds until `.stop()`; errors go to `on_error`."""

    def __init__(self, client: ControllerClient, kind: str, name: str, interval: float,
                 counters: Callable[[], dict[str, int]] | None, on_error: Callable[[Exception], None] | None):
        self.client, self.kind, self.name, self.interval = client, kind, name, interval
        self.counters, self.on_error = counters, on_error
        self.sent = 0
        self.last_error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"luwu-heartbeat-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.report_health(self.kind, self.name, self.counters() if self.counters else None)
                self.sent += 1
                self.last_error = None
            except (ControllerUnreachable, ControllerRefused) as exc:
                self.last_error = exc
                if self.on_error:
                    self.on_error(exc)
            except ValueError:  # the client was closed under us: nothing left to report to
                return
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def software_switch_record(switch: SoftwareSwitch, name: str, p4runtime_address: str, role: pb.SwitchRole = pb.STAR, rail: int = 0,
                           peers: dict[int, tuple[str, int]] | None = None, nodes: dict[int, str] | None = None,
                           device_id: int = 0, macs: dict[int, str] | None = None) -> pb.Switch:
    """The registration of a running `SoftwareSwitch`: its lanes, slots and ports (UDP: HOST:PORT,
    shared memory: shm:/dev/shm/NAME, both in `udp_address`; raw Ethernet: the interface).

    `peers` maps a port to the (switch, port) at its other end, `nodes` a port to the optimizer
    node on it; every other port is a worker port. `macs` maps a port to the MAC of what is at
    its other end (raw Ethernet ports: the switch writes it into the frames it sends there). A
    switch with raw Ethernet ports declares its service address (the IPv4 endpoints send to).
    The drop simulators' entries the switch holds now are declared as the port's simulated loss
    (the controller keeps exactly those)."""
    peers, nodes, macs = peers or {}, nodes or {}, macs or {}
    rec = pb.Switch(name=name, p4runtime_address=p4runtime_address, device_id=device_id, target="software",
                    lanes=switch.lanes, slots=switch.config.slots, role=role, rail=rail,
                    udp_port=switch.config.udp_port)
    if any(getattr(a, "kind", "") not in ("udp", "shm") for a in switch.ports.values()):
        rec.service_address = switch.config.service_ip
    for number, attachment in sorted(switch.ports.items()):
        port = rec.ports.add(number=number)
        if getattr(attachment, "kind", "") == "udp":
            port.udp_address = f"{attachment.address[0]}:{attachment.address[1]}"
        elif getattr(attachment, "kind", "") == "shm":  # the planner hands it on as a Wiring(transport="shm")
            port.udp_address = shm_port_address(str(attachment.address))
        else:
            port.interface = getattr(attachment, "ifname", "")
        if number in peers:
            port.peer_kind, port.peer, port.peer_port = pb.PEER_SWITCH, peers[number][0], peers[number][1]
        elif number in nodes:
            port.peer_kind, port.peer = pb.PEER_NODE, nodes[number]
        else:
            port.peer_kind = pb.PEER_WORKER
        if number in macs:
            port.mac = macs[number]
        for table, field in (("ingress_drop_sim", "ingress_drop_threshold"), ("egress_drop_sim", "egress_drop_threshold")):
            entry = switch.tables.lookup(table, {"port": number})
            if entry is not None:
                setattr(port, field, int(entry["params"]["threshold"]))
    return rec

