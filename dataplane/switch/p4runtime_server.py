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

`P4RuntimeBase` holds everything but the storage; the controller's in-process fake P4Runtime
server (tests/controller/fake_p4runtime.py) reuses it with a recording store.

With a `P4RuntimeAuth` (`p4runtime_auth.py`; `luwu switch` always has one) every call but
Capabilities needs a credential: a TLS client certificate with a luwu role (`luwu certs`) or the
switch's bearer token. Only the `controller` role may become primary, Write or set the pipeline
(PERMISSION_DENIED for a `reader`, whose StreamChannel is always a backup, told of an election id
above its own when no primary is); a client with no
credential can neither arbitrate, nor write, nor read. `serve(..., auth=None)` is the
unauthenticated in-process server of tests and tools.
"""

from __future__ import annotations

import queue
import threading
from concurrent import futures
from pathlib import Path

import grpc
from finsy import P4Schema
from finsy.p4entity import P4Replica
from finsy.p4values import encode_exact, encode_lpm
from finsy.proto import U128, p4i, p4r, p4r_grpc, rpc_code, rpc_status

from ..p4runtime.audit import AuditLog, WatchedContext, describe_update, peer_identity
from . import p4runtime_semantics as sem
from .p4runtime_auth import CONTROLLER, Grant, P4RuntimeAuth, check_transport, local_server_credentials
from .table_schema import SCHEMA, TableError, check_p4info_implemented, short_name

API_VERSION = "1.4.1"
NO_PIPELINE = "No forwarding pipeline config set for this device."
COUNTERS = ("drops", "events", "rx_types", "session_packets")
READ_CHUNK = 1000  # entities per ReadResponse
DEFAULT_WORKERS = 16  # gRPC handler threads: each open StreamChannel holds one
REFUSED_STREAM_DRAIN = 1.0  # s a refused StreamChannel waits for the client's first message before ending it


class UpdateError(Exception):
    """One update of a Write (or one entity of a Read) failed with a gRPC canonical code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class _Stream:
    def __init__(self, context):
        self.context = context
        self.election_id: int | None = None
        self.reader = False  # a reader's stream is a backup that never becomes primary
        self.outbox: queue.Queue = queue.Queue()


class P4RuntimeBase(p4r_grpc.P4RuntimeServicer):
    """Arbitration, pipeline config and the Write/Read envelopes; subclasses store entities.
    With `audit` (dataplane/p4runtime/audit.py AuditLog) every Write update and pipeline change, accepted or
    refused, is logged with its caller."""

    def __init__(self, device_id: int = 0, auth: P4RuntimeAuth | None = None, audit: AuditLog | None = None):
        self.device_id = device_id
        self.auth = auth
        self.audit = audit
        self.schema: P4Schema | None = None
        self.config: p4r.ForwardingPipelineConfig | None = None
        self._saved: p4r.ForwardingPipelineConfig | None = None
        self._streams: list[_Stream] = []
        self._mutex = threading.RLock()

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

    # -- arbitration ----------------------------------------------------------------------------
    def primary_election_id(self) -> int | None:
        ids = [s.election_id for s in self._streams if s.election_id is not None]
        return max(ids) if ids else None

    def _arbitrate(self, stream: _Stream, update: p4r.MasterArbitrationUpdate, context) -> None:
        if update.device_id != self.device_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown device id {update.device_id}: this switch is "
                                                     f"device {self.device_id} (pass device_id={self.device_id})")
        if self.auth is not None:
            why = self.auth.role_refusal(update.role.name if update.HasField("role") else "")
            if why:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        election = U128.decode(update.election_id)
        if stream.reader:  # always a backup, never counted for primary
            with self._mutex:
                primary = self.primary_election_id()
            if primary is None or primary <= election:
                # no primary above it: stock clients (finsy) take a backup whose id is not below the primary's
                # for a broken invariant, so the answer names an id just above the reader's, which no one holds
                primary = min(election + 1, (1 << 128) - 1)
            stream.outbox.put(p4r.StreamMessageResponse(arbitration=p4r.MasterArbitrationUpdate(
                device_id=self.device_id, role=update.role if update.HasField("role") else None,
                election_id=U128.encode(primary), status=rpc_status.Status(
                    code=rpc_code.ALREADY_EXISTS, message="role reader: a backup that may only read"))))
            return
        with self._mutex:
            for other in list(self._streams):
                if other is not stream and other.election_id == election:
                    if other.context.is_active():
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Election id already exists")
                    self._streams.remove(other)  # a client that went away without closing its stream
            old_primary = self.primary_election_id()
            stream.election_id = election
            primary = self.primary_election_id()
            # a change of primary goes to every stream that has arbitrated; one still connecting would
            # take it for the answer to its own (finsy: backup invariant failed)
            targets = [s for s in self._streams if s.election_id is not None] if primary != old_primary else [stream]
            for s in targets:
                code = rpc_code.OK if s.election_id == primary else rpc_code.ALREADY_EXISTS
                s.outbox.put(p4r.StreamMessageResponse(arbitration=p4r.MasterArbitrationUpdate(
                    device_id=self.device_id, role=update.role if update.HasField("role") else None,
                    election_id=U128.encode(primary), status=rpc_status.Status(code=code))))

    def StreamChannel(self, request_iterator, context):
        if isinstance(self._grant(context), str):
            # take the client's first message (its arbitration) before refusing, for at most a second: a
            # stream aborted while the client still wrote it reached the client as gRPC's INTERNAL ("Internal
            # error from Core") instead of the refusal, now and then on a loaded machine
            first = threading.Thread(target=next, args=(request_iterator, None), name="p4rt-refused", daemon=True)
            first.start()
            first.join(REFUSED_STREAM_DRAIN)
        grant = self._authenticate(context)  # before the stream exists: an unauthenticated client never arbitrates
        stream = _Stream(context)
        stream.reader = grant.role != CONTROLLER
        with self._mutex:
            self._streams.append(stream)

        def pump():
            try:
                for request in request_iterator:
                    stream.outbox.put(("request", request))
            except Exception:  # the client went away: the stream ends below
                pass
            stream.outbox.put(("eof", None))

        threading.Thread(target=pump, name="p4rt-stream", daemon=True).start()
        try:
            while True:
                item = stream.outbox.get()
                if isinstance(item, p4r.StreamMessageResponse):
                    yield item
                    continue
                kind, request = item
                if kind == "eof":
                    return
                which = request.WhichOneof("update")
                if which == "arbitration":
                    self._arbitrate(stream, request.arbitration, context)
                else:  # packet-out / digest acks: this target has no CPU port
                    yield p4r.StreamMessageResponse(error=p4r.StreamError(
                        canonical_code=rpc_code.UNIMPLEMENTED, message=f"stream message {which!r} not supported"))
        finally:
            with self._mutex:
                if stream in self._streams:
                    was_primary = stream.election_id == self.primary_election_id()
                    self._streams.remove(stream)
                    primary = self.primary_election_id()
                    if was_primary and primary is not None:
                        # only streams that arbitrated hear of the new primary: one still connecting
                        # would take "OK, election 0" for its own win (finsy: primary invariant failed)
                        for s in (s for s in self._streams if s.election_id is not None):
                            s.outbox.put(p4r.StreamMessageResponse(arbitration=p4r.MasterArbitrationUpdate(
                                device_id=self.device_id, election_id=U128.encode(primary or 0),
                                status=rpc_status.Status(code=rpc_code.OK if s.election_id == primary
                                                         else rpc_code.ALREADY_EXISTS))))

    def _check_writer(self, device_id: int, election_id, context, rpc: str = "Write") -> None:
        self._require_controller(self._authenticate(context), rpc, context)
        if device_id != self.device_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown device id {device_id}: this switch is device "
                                                     f"{self.device_id}")
        primary = self.primary_election_id()
        if primary is None or U128.decode(election_id) != primary:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "Not primary: open a StreamChannel and win "
                                                             "arbitration with the highest election id first")

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
        errors = []
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


class SwitchP4Runtime(P4RuntimeBase):
    """P4Runtime over the software switch's `tables` (insert/delete/entries/multicast) and counters."""

    def __init__(self, switch, device_id: int = 0, auth: P4RuntimeAuth | None = None, audit: AuditLog | None = None):
        super().__init__(device_id, auth, audit)
        self.switch = switch
        self._egress_port_groups: set[int] = set()  # groups written with the deprecated Replica.egress_port

    def check_p4info(self, p4info: p4i.P4Info) -> None:
        check_p4info_implemented(p4info, COUNTERS)

    def clear(self) -> None:
        with self.switch.lock:
            self.switch.tables.clear()
            self._egress_port_groups.clear()

    # -- write ----------------------------------------------------------------------------------
    def apply_update(self, update: p4r.Update) -> None:
        which = update.entity.WhichOneof("entity")
        if which == "table_entry":
            self._write_table(update.type, update.entity.table_entry)
        elif which == "packet_replication_engine_entry" and \
                update.entity.packet_replication_engine_entry.WhichOneof("type") == "multicast_group_entry":
            self._write_group(update.type, update.entity.packet_replication_engine_entry.multicast_group_entry)
        else:
            raise UpdateError(grpc.StatusCode.UNIMPLEMENTED, f"writing {which} is not supported by this switch")

    def _table(self, table_id: int):
        try:
            return self.schema.tables[table_id]
        except (KeyError, ValueError):
            raise UpdateError(grpc.StatusCode.NOT_FOUND, f"unknown table id {table_id}{sem.spec(sem.IDS)}") from None

    def _decode(self, entry: p4r.TableEntry):
        table = self._table(entry.table_id)
        match = {}
        for fm in entry.match:
            try:
                field = table.match_fields[fm.field_id]
            except (KeyError, ValueError):
                raise UpdateError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"table {table.alias}: unknown match field id {fm.field_id}") from None
            kind = fm.WhichOneof("field_match_type")
            if kind == "exact":
                match[field.name] = int.from_bytes(fm.exact.value, "big")
            elif kind == "lpm":
                match[field.name] = (int.from_bytes(fm.lpm.value, "big"), fm.lpm.prefix_len)
            else:
                raise UpdateError(grpc.StatusCode.INVALID_ARGUMENT, f"table {table.alias}: {kind} match unsupported")
        for field in table.match_fields:  # an omitted lpm field is "don't care" (prefix 0)
            if field.name not in match and short_name(field.name) in [k.name for k in SCHEMA[short_name(
                    table.name)].keys if k.kind == "lpm"]:
                match[field.name] = (0, 0)
        action, params = None, {}
        if entry.HasField("action"):
            if entry.action.WhichOneof("type") != "action":
                raise UpdateError(grpc.StatusCode.UNIMPLEMENTED, "action profiles are not supported")
            try:
                act = self.schema.actions[entry.action.action.action_id]
            except (KeyError, ValueError):
                raise UpdateError(grpc.StatusCode.NOT_FOUND,
                                  f"unknown action id {entry.action.action.action_id}{sem.spec(sem.IDS)}") from None
            action = act.alias
            for p in entry.action.action.params:
                try:
                    params[act.params[p.param_id].name] = int.from_bytes(p.value, "big")
                except (KeyError, ValueError):
                    raise UpdateError(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"action {act.alias}: unknown param id {p.param_id}") from None
        return table, match, action, params

    def _write_table(self, kind, entry: p4r.TableEntry) -> None:
        table, match, action, params = self._decode(entry)
        tables = self.switch.tables
        try:
            with self.switch.lock:
                if entry.is_default_action:
                    if kind != p4r.Update.MODIFY:
                        raise UpdateError(grpc.StatusCode.INVALID_ARGUMENT, f"table {table.alias}: a default entry "
                                          f"can only be MODIFIED{sem.spec(sem.DEFAULT_ENTRY)}")
                    if action is None:  # no action: back to the program's initial default, as BMv2 does
                        action, params = sem.initial_default(self.schema, table)
                    tables.set_default(table.name, action, params)
                    return
                exists = tables.lookup(table.name, match) is not None
                if kind == p4r.Update.INSERT:
                    if exists:
                        raise UpdateError(grpc.StatusCode.ALREADY_EXISTS,
                                          f"table {table.alias}: entry {match} exists{sem.spec(sem.TABLE_WRITE)}")
                    tables.insert(table.name, match, action or "", params)
                elif kind in (p4r.Update.MODIFY, p4r.Update.DELETE):
                    if not exists:
                        raise UpdateError(grpc.StatusCode.NOT_FOUND,
                                          f"table {table.alias}: no entry {match}{sem.spec(sem.TABLE_WRITE)}")
                    if kind == p4r.Update.MODIFY:
                        tables.insert(table.name, match, action or "", params, modify=True)
                    else:
                        tables.delete(table.name, match)
                else:
                    raise UpdateError(grpc.StatusCode.INVALID_ARGUMENT,
                                      f"update type must be INSERT/MODIFY/DELETE{sem.spec(sem.TABLE_WRITE)}")
        except TableError as exc:
            raise UpdateError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def _write_group(self, kind, group: p4r.MulticastGroupEntry) -> None:
        tables = self.switch.tables
        gid = group.multicast_group_id
        replicas = [(rep.port, rep.instance) for rep in (P4Replica.decode(r) for r in group.replicas)]
        try:
            with self.switch.lock:
                exists = gid in tables.multicast_groups()
                if kind == p4r.Update.INSERT and exists:
                    raise UpdateError(grpc.StatusCode.ALREADY_EXISTS,
                                      f"multicast group {gid} exists{sem.spec(sem.MULTICAST)}")
                if kind in (p4r.Update.MODIFY, p4r.Update.DELETE) and not exists:
                    raise UpdateError(grpc.StatusCode.NOT_FOUND,
                                      f"multicast group {gid} does not exist{sem.spec(sem.MULTICAST)}")
                if kind == p4r.Update.DELETE:
                    tables.delete_multicast_group(gid)
                else:
                    tables.set_multicast_group(gid, replicas)
                self._egress_port_groups.discard(gid)
                if kind != p4r.Update.DELETE and sem.uses_egress_port(group):
                    self._egress_port_groups.add(gid)
        except TableError as exc:
            raise UpdateError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    # -- read -----------------------------------------------------------------------------------
    def read_entity(self, entity: p4r.Entity) -> list[p4r.Entity]:
        which = entity.WhichOneof("entity")
        if which == "table_entry":
            return self._read_tables(entity.table_entry)
        if which == "packet_replication_engine_entry":
            if entity.packet_replication_engine_entry.WhichOneof("type") == "clone_session_entry":
                return []  # this switch has no clone sessions (not the multicast groups a second time)
            gid = entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id
            groups = self.switch.tables.multicast_groups()
            return [p4r.Entity(packet_replication_engine_entry=p4r.PacketReplicationEngineEntry(
                multicast_group_entry=p4r.MulticastGroupEntry(
                    multicast_group_id=g, replicas=sem.encode_replicas(groups[g], g in self._egress_port_groups))))
                for g in sorted(groups) if gid in (0, g)]
        if which == "counter_entry":
            return self._read_counters(entity.counter_entry)
        if which in ("action_profile_member", "action_profile_group") and not len(self.schema.action_profiles):
            return []  # a wildcard read of what the P4Info has none of (finsy's delete_all asks)
        if which == "register_entry":
            raise UpdateError(grpc.StatusCode.UNIMPLEMENTED, "Register reads are not supported (as on BMv2): "
                                                            "luwu's registers never need the controller")
        raise UpdateError(grpc.StatusCode.UNIMPLEMENTED, f"reading {which} is not supported by this switch")

    def _read_tables(self, want: p4r.TableEntry) -> list[p4r.Entity]:
        tables = [self._table(want.table_id)] if want.table_id else list(self.schema.tables)
        _, want_match, _, _ = self._decode(want) if want.table_id and want.match else (None, None, None, None)
        out = []
        for table in tables:
            if short_name(table.name) not in SCHEMA:
                continue
            for row in self.switch.tables.entries(table.name):
                match = {k: tuple(v) if isinstance(v, (tuple, list)) else v for k, v in row["match"].items()}
                if want_match and any(match.get(short_name(k)) != v for k, v in want_match.items()):
                    continue
                out.append(p4r.Entity(table_entry=self._encode_entry(table, match, row["action"], row["params"])))
        return out

    def _encode_entry(self, table, match: dict, action: str, params: dict) -> p4r.TableEntry:
        fields = []
        for field in table.match_fields:
            value = match[short_name(field.name)]
            if isinstance(value, tuple):
                if value[1] == 0:
                    continue  # don't care
                data, plen = encode_lpm(value, field.bitwidth)
                fields.append(p4r.FieldMatch(field_id=field.id, lpm=p4r.FieldMatch.LPM(value=data, prefix_len=plen)))
            else:
                fields.append(p4r.FieldMatch(field_id=field.id, exact=p4r.FieldMatch.Exact(
                    value=encode_exact(value, field.bitwidth))))
        act = self.schema.actions[action]
        return p4r.TableEntry(table_id=table.id, match=fields, action=p4r.TableAction(action=p4r.Action(
            action_id=act.id, params=[p4r.Action.Param(param_id=p.id, value=encode_exact(params[p.name], p.bitwidth))
                                      for p in act.params])))

    def _read_counters(self, want: p4r.CounterEntry) -> list[p4r.Entity]:
        counters = self.switch.counters()
        chosen = [self.schema.counters[want.counter_id]] if want.counter_id else list(self.schema.counters)
        # The software switch keeps one array per counter name; when the P4 program has the same
        # name in two controls (LuwuIngress.drops, LuwuEgress.drops) the first carries the totals
        # and the others read zero, so a client summing by name gets the switch's figure.
        owner: dict[str, int] = {}
        for counter in sorted(self.schema.counters, key=lambda c: c.id):
            owner.setdefault(short_name(counter.name), counter.id)
        out = []
        for counter in chosen:
            name = short_name(counter.name)
            values = counters.get(name, {}) if owner.get(name) == counter.id else {}
            indices = [want.index.index] if want.HasField("index") else range(counter.size)
            for i in indices:
                packets, nbytes = values.get(i, (0, 0))
                out.append(p4r.Entity(counter_entry=p4r.CounterEntry(
                    counter_id=counter.id, index=p4r.Index(index=i),
                    data=p4r.CounterData(packet_count=int(packets), byte_count=int(nbytes)))))
        return out


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
