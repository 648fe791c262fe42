"""An in-process fake P4Runtime server for controller tests (after p4runtime-shell's tests).

It speaks real gRPC with the same arbitration and pipeline handling as the software switch's
server (`P4RuntimeBase`), but stores entities as the protobufs it was sent, records every
Write, and can be told to fail: the next N writes as a whole, single updates matching a
predicate (reported per update as BMv2 does), or SetForwardingPipelineConfig.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
from finsy.proto import p4r

from luwu.dataplane.switch.p4runtime_server import P4RuntimeHandle, start_server
from luwu.dataplane.switch.p4runtime_service import P4RuntimeBase, UpdateError


class FakeP4Runtime(P4RuntimeBase):
    def __init__(self, device_id: int = 0):
        super().__init__(device_id)
        self.entries: dict[tuple, p4r.TableEntry] = {}
        self.groups: dict[int, p4r.MulticastGroupEntry] = {}
        self.counters: dict[tuple[int, int], tuple[int, int]] = {}  # (counter_id, index) -> (packets, bytes)
        self.writes: list[p4r.WriteRequest] = []
        self.pipeline_sets = 0
        self._fail_writes: list[tuple[grpc.StatusCode, str]] = []
        self._fail_update: Callable[[p4r.Update], bool] | None = None
        self._fail_update_code = grpc.StatusCode.RESOURCE_EXHAUSTED
        self._fail_pipeline: tuple[grpc.StatusCode, str] | None = None
        self._lock = threading.Lock()

    # -- failure injection -------------------------------------------------------------------------
    def fail_next_writes(self, count: int = 1, code=grpc.StatusCode.UNAVAILABLE, message="injected failure") -> None:
        self._fail_writes += [(code, message)] * count

    def fail_updates(self, predicate: Callable[[p4r.Update], bool] | None,
                     code=grpc.StatusCode.RESOURCE_EXHAUSTED) -> None:
        self._fail_update, self._fail_update_code = predicate, code

    def fail_pipeline(self, code=grpc.StatusCode.INTERNAL, message="injected pipeline failure") -> None:
        self._fail_pipeline = (code, message)

    # -- hooks --------------------------------------------------------------------------------------
    def SetForwardingPipelineConfig(self, request, context):
        if self._fail_pipeline is not None:
            code, message = self._fail_pipeline
            self._fail_pipeline = None
            context.abort(code, message)
        response = super().SetForwardingPipelineConfig(request, context)
        self.pipeline_sets += 1
        return response

    def Write(self, request, context):
        with self._lock:
            self.writes.append(request)
            injected = self._fail_writes.pop(0) if self._fail_writes else None
        if injected is not None:
            context.abort(*injected)
        return super().Write(request, context)

    def clear(self) -> None:
        self.entries.clear()
        self.groups.clear()

    def apply_update(self, update: p4r.Update) -> None:
        if self._fail_update is not None and self._fail_update(update):
            raise UpdateError(self._fail_update_code, "injected update failure")
        which = update.entity.WhichOneof("entity")
        if which == "table_entry":
            entry = update.entity.table_entry
            key = _key(entry)
            store, what = self.entries, f"table entry {key}"
        elif which == "packet_replication_engine_entry":
            entry = update.entity.packet_replication_engine_entry.multicast_group_entry
            key = entry.multicast_group_id
            store, what = self.groups, f"multicast group {key}"
        else:
            raise UpdateError(grpc.StatusCode.UNIMPLEMENTED, f"the fake does not store {which}")
        if update.type == p4r.Update.INSERT:
            if key in store:
                raise UpdateError(grpc.StatusCode.ALREADY_EXISTS, f"{what} exists")
            store[key] = _copy(entry)
        elif update.type == p4r.Update.MODIFY:
            if key not in store:
                raise UpdateError(grpc.StatusCode.NOT_FOUND, f"{what} does not exist")
            store[key] = _copy(entry)
        elif update.type == p4r.Update.DELETE:
            if store.pop(key, None) is None:
                raise UpdateError(grpc.StatusCode.NOT_FOUND, f"{what} does not exist")
        else:
            raise UpdateError(grpc.StatusCode.INVALID_ARGUMENT, "unspecified update type")

    def read_entity(self, entity: p4r.Entity) -> list[p4r.Entity]:
        which = entity.WhichOneof("entity")
        if which == "table_entry":
            want = entity.table_entry
            return [p4r.Entity(table_entry=e) for k, e in sorted(self.entries.items())
                    if want.table_id in (0, e.table_id) and (not want.match or k == _key(want))]
        if which == "packet_replication_engine_entry":
            gid = entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id
            return [p4r.Entity(packet_replication_engine_entry=p4r.PacketReplicationEngineEntry(
                multicast_group_entry=g)) for i, g in sorted(self.groups.items()) if gid in (0, i)]
        if which == "counter_entry":
            want = entity.counter_entry
            ids = [want.counter_id] if want.counter_id else [c.id for c in self.schema.counters]
            out = []
            for cid in ids:
                size = self.schema.counters[cid].size
                indices = [want.index.index] if want.HasField("index") else range(size)
                for i in indices:
                    packets, nbytes = self.counters.get((cid, i), (0, 0))
                    out.append(p4r.Entity(counter_entry=p4r.CounterEntry(
                        counter_id=cid, index=p4r.Index(index=i),
                        data=p4r.CounterData(packet_count=packets, byte_count=nbytes))))
            return out
        raise UpdateError(grpc.StatusCode.UNIMPLEMENTED, f"the fake does not read {which}")

    # -- test helpers -------------------------------------------------------------------------------
    def table_entries(self, table_id: int) -> list[p4r.TableEntry]:
        return [e for e in self.entries.values() if e.table_id == table_id]

    def updates(self) -> list[p4r.Update]:
        return [u for w in self.writes for u in w.updates]


def _key(entry: p4r.TableEntry) -> tuple:
    return (entry.table_id, tuple(sorted((m.field_id, m.SerializeToString(deterministic=True)) for m in entry.match)),
            entry.is_default_action)


def _copy(msg):
    out = type(msg)()
    out.CopyFrom(msg)
    return out


def serve_fake(address: str = "127.0.0.1:0", device_id: int = 0) -> tuple[FakeP4Runtime, P4RuntimeHandle]:
    fake = FakeP4Runtime(device_id)
    return fake, start_server(fake, address)
