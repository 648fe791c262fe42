"""The P4Runtime gRPC service without its storage (`P4RuntimeBase`): who may call (authentication
and roles, p4runtime_auth.py), the forwarding pipeline (SetForwardingPipelineConfig checks the
P4Info against what the target implements, GetForwardingPipelineConfig answers BMv2's
FAILED_PRECONDITION text before one is set), the envelopes of Write (per-update errors in
`grpc-status-details-bin` as p4.v1.Error, like BMv2) and Read (chunked), Capabilities, and the
audit of every write and pipeline change (dataplane/p4runtime/audit.py). The StreamChannel and its
arbitration are p4runtime_stream.py's; what a Write does to the tables is the subclass's
(`SwitchP4Runtime`, p4runtime_tables.py, and the controller tests' recording fake).
"""

from __future__ import annotations

import threading

import grpc
from finsy import P4Schema
from finsy.proto import p4i, p4r, p4r_grpc, rpc_code, rpc_status

from ..p4runtime.audit import AuditLog, WatchedContext, describe_update, peer_identity
from .p4runtime_auth import CONTROLLER, Grant, P4RuntimeAuth
from .p4runtime_stream import Arbiter

API_VERSION = "1.4.1"
NO_PIPELINE = "No forwarding pipeline config set for this device."
READ_CHUNK = 1000  # entities per ReadResponse
REFUSED_STREAM_DRAIN = 1.0  # s a refused StreamChannel waits for the client's first message before ending it


class UpdateError(Exception):
    """One update of a Write (or one entity of a Read) failed with a gRPC canonical code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class P4RuntimeBase(p4r_grpc.P4RuntimeServicer):
    """Authentication, pipeline config, the Write/Read envelopes and the StreamChannel (its arbitration:
    `arbiter`, p4runtime_stream.py); subclasses store entities.
    With `audit` (dataplane/p4runtime/audit.py AuditLog) every Write update and pipeline change, accepted or
    refused, is logged with its caller."""

    def __init__(self, device_id: int = 0, auth: P4RuntimeAuth | None = None, audit: AuditLog | None = None):
        self.device_id = device_id
        self.auth = auth
        self.audit = audit
        self.schema: P4Schema | None = None
        self.config: p4r.ForwardingPipelineConfig | None = None
        self._saved: p4r.ForwardingPipelineConfig | None = None
        self._mutex = threading.RLock()
        self.arbiter = Arbiter(device_id, auth, self._mutex)

    # -- storage hooks (subclasses) -------------------------------------------------------------
    def check_p4info(self, p4info: p4i.P4Info) -> None:
        """Raise ValueError naming what this target does not implement."""

    def clear(self) -> None:
        """A new pipeline: every entry and group goes."""

    def apply_update(self, update: p4r.Update) -> None:
        raise UpdateError(grpc.StatusCode.UNIMPLEMENTED, "writes are not supported")

    def read_entity(self, entity: p4r.Entity) -> list[p4r.Entity]:
        raise UpdateError(grpc.StatusCode.UNIMPLEMENTED, "reads are not supported")

    # -- authentication -------------------------------------------------------------------------
    def _grant(self, context) -> Grant | str:
        if self.auth is None:
            return Grant(CONTROLLER, "none (no authentication)")
        return self.auth.admit(context.invocation_metadata(), context.auth_context())

    def _authenticate(self, context) -> Grant:
        grant = self._grant(context)
        if isinstance(grant, str):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, grant)
            raise AssertionError("abort returned")  # grpc's abort raises; a test double might not
        return grant

    def _require_controller(self, grant: Grant, rpc: str, context) -> None:
        if grant.role != CONTROLLER:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{grant.identity} has role {grant.role!r}, which may "
                                                             f"not {rpc}: only role 'controller' may (issue one with "
                                                             f"`luwu certs issue NAME --role controller`)")

    # -- stream and arbitration (p4runtime_stream.py) ------------------------------------------------
    def primary_election_id(self) -> int | None:
        return self.arbiter.primary_election_id()

    def StreamChannel(self, request_iterator, context):
        if isinstance(self._grant(context), str):
            # take the client's first message (its arbitration) before refusing, for at most a second: a
            # stream aborted while the client still wrote it reached the client as gRPC's INTERNAL ("Internal
            # error from Core") instead of the refusal, now and then on a loaded machine
            first = threading.Thread(target=next, args=(request_iterator, None), name="p4rt-refused", daemon=True)
            first.start()
            first.join(REFUSED_STREAM_DRAIN)
        grant = self._authenticate(context)  # before the stream exists: an unauthenticated client never arbitrates
        yield from self.arbiter.channel(request_iterator, context, reader=grant.role != CONTROLLER)

    def _check_writer(self, device_id: int, election_id, context, rpc: str = "Write") -> None:
        self._require_controller(self._authenticate(context), rpc, context)
        if device_id != self.device_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown device id {device_id}: this switch is device "
                                                     f"{self.device_id}")
        self.arbiter.check_primary(election_id, context)

    # -- pipeline -------------------------------------------------------------------------------
    def Capabilities(self, request, context):
        return p4r.CapabilitiesResponse(p4runtime_api_version=API_VERSION)

    def _who(self, context) -> dict[str, str]:
        grant = self._grant(context)
        if isinstance(grant, str):  # refused: named by its certificate where it showed one
            return peer_identity(context, "none (refused)")
        return {"peer": str(context.peer() or ""), "identity": grant.identity, "role": grant.role}

    def _audit_refusal(self, context: WatchedContext, what: dict) -> None:
        if self.audit is not None and context.refused is not None and not context.logged:
            code, message = context.refused
            self.audit.record(self._who(context), what, f"{code.name}: {message}")

    def SetForwardingPipelineConfig(self, request, context):
        watched = WatchedContext(context)
        what = {"rpc": "SetForwardingPipelineConfig",
                "action": p4r.SetForwardingPipelineConfigRequest.Action.Name(request.action),
                "cookie": request.config.cookie.cookie if request.config.HasField("cookie") else None}
        try:
            response = self._set_pipeline(request, watched)
        finally:
            self._audit_refusal(watched, what)
        if self.audit is not None:
            self.audit.record(self._who(context), what, "OK")
        return response

    def _set_pipeline(self, request, context):
        self._check_writer(request.device_id, request.election_id, context, "SetForwardingPipelineConfig")
        A = p4r.SetForwardingPipelineConfigRequest
        with self._mutex:
            if request.action == A.COMMIT:
                if self._saved is None:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, "COMMIT without a saved config: send "
                                                                       "VERIFY_AND_SAVE first")
                self._install(self._saved, clear=True)
                return p4r.SetForwardingPipelineConfigResponse()
            if request.action == A.UNSPECIFIED:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "SetForwardingPipelineConfig needs an action")
            try:
                self.check_p4info(request.config.p4info)
                schema = P4Schema(request.config.p4info)
            except (ValueError, KeyError) as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"P4Info refused: {exc}")
            if request.action == A.VERIFY_AND_SAVE:
                self._saved = request.config
            elif request.action in (A.VERIFY_AND_COMMIT, A.RECONCILE_AND_COMMIT):
                self._install(request.config, clear=request.action == A.VERIFY_AND_COMMIT, schema=schema)
        return p4r.SetForwardingPipelineConfigResponse()

    def _install(self, config, clear: bool, schema: P4Schema | None = None) -> None:
        self.schema = schema or P4Schema(config.p4info)
        self.config = p4r.ForwardingPipelineConfig()
        self.config.CopyFrom(config)
        if clear:
            self.clear()

    def GetForwardingPipelineConfig(self, request, context):
        self._authenticate(context)
        if request.device_id != self.device_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown device id {request.device_id}")
        with self._mutex:
            if self.config is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_PIPELINE)
            R = p4r.GetForwardingPipelineConfigRequest
            out = p4r.ForwardingPipelineConfig()
            if request.response_type in (R.ALL, R.P4INFO_AND_COOKIE):
                out.p4info.CopyFrom(self.config.p4info)
            if request.response_type == R.ALL or request.response_type == R.DEVICE_CONFIG_AND_COOKIE:
                out.p4_device_config = self.config.p4_device_config
            if self.config.HasField("cookie"):
                out.cookie.CopyFrom(self.config.cookie)
        return p4r.GetForwardingPipelineConfigResponse(config=out)

    # -- write / read ---------------------------------------------------------------------------
    def Write(self, request, context):
        watched = WatchedContext(context)
        try:
            return self._write(request, watched)
        finally:
            if watched.refused is not None:  # refused as a whole: one line, naming the first update
                first = describe_update(request.updates[0], self.schema) if request.updates else {}
                self._audit_refusal(watched, {"rpc": "Write", "updates": len(request.updates), **first})

    def _write(self, request, context: WatchedContext):
        self._check_writer(request.device_id, request.election_id, context)
        if self.config is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_PIPELINE)
        errors: list[UpdateError | None] = []
        with self._mutex:
            for update in request.updates:
                try:
                    self.apply_update(update)
                    errors.append(None)
                except UpdateError as exc:
                    errors.append(exc)
        if self.audit is not None:  # one line per update, as applied (a batch may partly fail)
            who = self._who(context)
            for update, e in zip(request.updates, errors):
                self.audit.record(who, {"rpc": "Write", **describe_update(update, self.schema)},
                                  "OK" if e is None else f"{e.code.name}: {e.message}")
            context.logged = True
        failed = [e for e in errors if e is not None]
        if failed:
            status = rpc_status.Status(code=rpc_code.UNKNOWN, message=f"{len(failed)} of {len(errors)} updates failed:"
                                                                       f" {failed[0].message}")
            for e in errors:
                detail = p4r.Error(canonical_code=rpc_code.OK) if e is None else p4r.Error(
                    canonical_code=e.code.value[0], message=e.message, space="luwu")
                status.details.add().Pack(detail)
            context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
            context.abort(grpc.StatusCode.UNKNOWN, status.message)
        return p4r.WriteResponse()

    def Read(self, request, context):
        self._authenticate(context)
        if request.device_id != self.device_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown device id {request.device_id}")
        if self.config is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_PIPELINE)
        found: list[p4r.Entity] = []
        with self._mutex:
            for entity in request.entities:
                try:
                    found += self.read_entity(entity)
                except UpdateError as exc:
                    context.abort(exc.code, exc.message)
        for i in range(0, len(found), READ_CHUNK):
            yield p4r.ReadResponse(entities=found[i:i + READ_CHUNK])
        if not found:
            yield p4r.ReadResponse()
