"""The software switch's P4Runtime service, so one controller code path programs it and BMv2 alike.

`serve(switch, address, p4info_path, device_id=0)` starts a gRPC server (finsy's generated
`P4RuntimeServicer`) on top of the switch's tables: SetForwardingPipelineConfig (checks that
every table, action and counter of the P4Info is one this switch implements, then clears the
tables as loading a program does), GetForwardingPipelineConfig (FAILED_PRECONDITION "No
forwarding pipeline config set for this device." before that, the text BMv2 uses and finsy
matches), Write (table entries, default actions, multicast groups; per-update errors in
`grpc-status-details-bin` as p4.v1.Error, like BMv2), Read (table entries, multicast groups, the
`drops` / `events` / `rx_types` / `session_packets` counters; registers are UNIMPLEMENTED as on
BMv2), StreamChannel (primary arbitration by election id) and Capabilities. Where the spec leaves
a choice, BMv2's answer (p4runtime_semantics.py: default-entry reset, `egress_port` read-back);
every write can be audited (dataplane/p4runtime/audit.py).

The roles, one module each: p4runtime_service.py (`P4RuntimeBase`: authentication, pipeline,
the Write/Read envelopes, audit; the controller's in-process fake P4Runtime server,
tests/controller/fake_p4runtime.py, reuses it with a recording store), p4runtime_stream.py (the
StreamChannel and its arbitration), p4runtime_tables.py (`SwitchP4Runtime`: what writes and
reads do to the switch's tables); this one starts and stops the gRPC server.

With a `P4RuntimeAuth` (`p4runtime_auth.py`; `luwu switch` always has one) every call but
Capabilities needs a credential: a TLS client certificate with a luwu role (`luwu certs`) or the
switch's bearer token. Only the `controller` role may become primary, Write or set the pipeline
(PERMISSION_DENIED for a `reader`, whose StreamChannel is always a backup, told of an election id
above its own when no primary is); a client with no
credential can neither arbitrate, nor write, nor read. `serve(..., auth=None)` is the
unauthenticated in-process server of tests and tools.
"""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
from finsy.proto import p4r_grpc

from ..p4runtime.audit import AuditLog
from .p4runtime_auth import P4RuntimeAuth, check_transport, local_server_credentials
from .p4runtime_service import P4RuntimeBase
from .p4runtime_tables import SwitchP4Runtime

DEFAULT_WORKERS = 16  # gRPC handler threads: each open StreamChannel holds one


class P4RuntimeHandle:
    """A running P4Runtime server: `.address` (with the bound port), `.stop()`."""

    def __init__(self, server: grpc.Server, address: str, servicer: P4RuntimeBase):
        self.server, self.address, self.servicer = server, address, servicer

    def stop(self, grace: float | None = None) -> None:
        self.server.stop(grace).wait()
        if self.servicer.audit is not None:
            self.servicer.audit.close()


def start_server(servicer: P4RuntimeBase, address: str, credentials: grpc.ServerCredentials | None = None,
                 workers: int = DEFAULT_WORKERS) -> P4RuntimeHandle:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="p4rt"))
    p4r_grpc.add_P4RuntimeServicer_to_server(servicer, server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen for P4Runtime on {address}: is the port in use?")
    server.start()
    return P4RuntimeHandle(server, f"{address.rpartition(':')[0]}:{port}", servicer)


def serve(switch, address: str, p4info_path, device_id: int = 0, credentials=None,
          auth: P4RuntimeAuth | None = None, audit: AuditLog | None = None,
          client_ca: bool = False) -> P4RuntimeHandle:
    """Serve P4Runtime for `switch` (a SoftwareSwitch) on `address` ("HOST:PORT", port 0 = any).

    Args:
        switch: the SoftwareSwitch whose tables are served.
        address: "HOST:PORT" to listen on.
        p4info_path: the P4Info the controller will install (checked to exist).
        device_id: the P4Runtime device id (BMv2's convention: 0).
        credentials: TLS server credentials (`p4runtime_auth.server_credentials`), or None.
        auth: who is admitted (a token, certificate roles or both); None serves unauthenticated
            (tests and in-process tools only). With auth and no TLS, only a loopback address is allowed and
            the server uses gRPC local credentials (loopback peers; call credentials allowed).
        audit: where every Write update and pipeline change is logged with its caller and result
            (dataplane/p4runtime/audit.py); None: not logged.
        client_ca: `credentials` require a client certificate (mutual TLS); needed for
            `auth.certificates`.

    Returns:
        A P4RuntimeHandle (`.address`, `.stop()`).

    Example:
        >>> handle = serve(sw, "127.0.0.1:0", P4INFO_TXTPB, auth=P4RuntimeAuth(switch_token(admin, "s1")))
    """
    check_transport(address, auth, credentials is not None, client_ca)
    if auth is not None and credentials is None:
        credentials = local_server_credentials()
    if p4info_path and not Path(p4info_path).exists():
        raise FileNotFoundError(f"P4Info {p4info_path} not found: run `luwu p4 generate` or pass the committed "
                                "p4/build/p4info.txtpb")
    # The P4Info itself arrives with SetForwardingPipelineConfig (checked against the tables then);
    # the path is only checked here so that a daemon misconfiguration shows at start.
    return start_server(SwitchP4Runtime(switch, device_id, auth, audit), address, credentials)
