"""What P4Runtime writes and reads do to the software switch (`SwitchP4Runtime`): table entries
(INSERT/MODIFY/DELETE, default entries), multicast groups and counters, decoded with the installed
P4Info into the switch's `tables` and encoded back for Read. Where the spec leaves a choice, BMv2's
answer (p4runtime_semantics.py: default-entry reset, `egress_port` read-back); registers are
UNIMPLEMENTED as on BMv2. The service around it (authentication, pipeline, arbitration, audit) is
p4runtime_service.py's.
"""

from __future__ import annotations

import grpc
from finsy import P4Schema
from finsy.p4entity import P4Replica
from finsy.p4values import encode_exact, encode_lpm
from finsy.proto import p4i, p4r

from ..p4runtime.audit import AuditLog
from . import p4runtime_semantics as sem
from .p4runtime_auth import P4RuntimeAuth
from .p4runtime_service import NO_PIPELINE, P4RuntimeBase, UpdateError
from .table_schema import SCHEMA, TableError, check_p4info_implemented, short_name

COUNTERS = ("drops", "events", "rx_types", "session_packets")


class SwitchP4Runtime(P4RuntimeBase):
    """P4Runtime over the software switch's `tables` (insert/delete/entries/multicast) and counters."""

    def __init__(self, switch, device_id: int = 0, auth: P4RuntimeAuth | None = None, audit: AuditLog | None = None):
        super().__init__(device_id, auth, audit)
        self.switch = switch
        self._egress_port_groups: set[int] = set()  # groups written with the deprecated Replica.egress_port

    def _p4(self) -> P4Schema:
        """The installed P4Info (Write and Read refuse to run before a pipeline is set)."""
        if self.schema is None:
            raise UpdateError(grpc.StatusCode.FAILED_PRECONDITION, NO_PIPELINE)
        return self.schema

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
            return self._p4().tables[table_id]
        except (KeyError, ValueError):
            raise UpdateError(grpc.StatusCode.NOT_FOUND, f"unknown table id {table_id}{sem.spec(sem.IDS)}") from None

    def _decode(self, entry: p4r.TableEntry):
        table = self._table(entry.table_id)
        match: dict[str, int | tuple[int, int]] = {}
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
                act = self._p4().actions[entry.action.action.action_id]
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
        if which in ("action_profile_member", "action_profile_group") and not len(self._p4().action_profiles):
            return []  # a wildcard read of what the P4Info has none of (finsy's delete_all asks)
        if which == "register_entry":
            raise UpdateError(grpc.StatusCode.UNIMPLEMENTED, "Register reads are not supported (as on BMv2): "
                                                            "luwu's registers never need the controller")
        raise UpdateError(grpc.StatusCode.UNIMPLEMENTED, f"reading {which} is not supported by this switch")

    def _read_tables(self, want: p4r.TableEntry) -> list[p4r.Entity]:
        tables = [self._table(want.table_id)] if want.table_id else list(self._p4().tables)
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
        act = self._p4().actions[action]
        return p4r.TableEntry(table_id=table.id, match=fields, action=p4r.TableAction(action=p4r.Action(
            action_id=act.id, params=[p4r.Action.Param(param_id=p.id, value=encode_exact(params[p.name], p.bitwidth))
                                      for p in act.params])))

    def _read_counters(self, want: p4r.CounterEntry) -> list[p4r.Entity]:
        counters = self.switch.counters()
        chosen = [self._p4().counters[want.counter_id]] if want.counter_id else list(self._p4().counters)
        # The software switch keeps one array per counter name; when the P4 program has the same
        # name in two controls (LuwuIngress.drops, LuwuEgress.drops) the first carries the totals
        # and the others read zero, so a client summing by name gets the switch's figure.
        owner: dict[str, int] = {}
        for counter in sorted(self._p4().counters, key=lambda c: c.id):
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
