"""P4Runtime's StreamChannel for the software switch's service: the open streams of one device
and which of them is primary (the highest election id), after the spec's master arbitration and
BMv2's answers: a change of primary goes to every stream that has arbitrated, a duplicate election
id is refused, a `reader`'s stream is a backup that never becomes primary. Packet-out and digest
acknowledgements are refused (this target has no CPU port).

`Arbiter` holds the streams; the service (p4runtime_service.py) admits a stream's caller first
and asks `check_primary` before every write.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
from finsy.proto import U128, p4r, rpc_code, rpc_status

from .p4runtime_auth import P4RuntimeAuth


class _Stream:
    def __init__(self, context):
        self.context = context
        self.election_id: int | None = None
        self.reader = False  # a reader's stream is a backup that never becomes primary
        self.outbox: queue.Queue = queue.Queue()


class Arbiter:
    """The StreamChannels of device `device_id` and their primary. `mutex` is the service's lock
    (the pipeline, writes and reads hold it too); `auth` refuses roles the switch does not know."""

    def __init__(self, device_id: int, auth: P4RuntimeAuth | None, mutex: threading.RLock):
        self.device_id = device_id
        self.auth = auth
        self._mutex = mutex
        self._streams: list[_Stream] = []

    def primary_election_id(self) -> int | None:
        ids = [s.election_id for s in self._streams if s.election_id is not None]
        return max(ids) if ids else None

    def arbitrate(self, stream: _Stream, update: p4r.MasterArbitrationUpdate, context) -> None:
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
            if primary is None:  # the stream's own id was just set
                raise RuntimeError("P4Runtime arbitration: no primary after a stream took an election id")
            # a change of primary goes to every stream that has arbitrated; one still connecting would
            # take it for the answer to its own (finsy: backup invariant failed)
            targets = [s for s in self._streams if s.election_id is not None] if primary != old_primary else [stream]
            for s in targets:
                code = rpc_code.OK if s.election_id == primary else rpc_code.ALREADY_EXISTS
                s.outbox.put(p4r.StreamMessageResponse(arbitration=p4r.MasterArbitrationUpdate(
                    device_id=self.device_id, role=update.role if update.HasField("role") else None,
                    election_id=U128.encode(primary), status=rpc_status.Status(code=code))))

    def channel(self, request_iterator, context, reader: bool) -> Iterator[p4r.StreamMessageResponse]:
        """The body of a StreamChannel its caller admitted: answers its arbitration updates (`reader`: a
        backup that never becomes primary) and refuses its other messages, until the client ends it."""
        stream = _Stream(context)
        stream.reader = reader
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
                    self.arbitrate(stream, request.arbitration, context)
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

    def check_primary(self, election_id, context) -> None:
        """Abort `context` (PERMISSION_DENIED) unless `election_id` is the primary's: only the primary writes."""
        primary = self.primary_election_id()
        if primary is None or U128.decode(election_id) != primary:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "Not primary: open a StreamChannel and win "
                                                             "arbitration with the highest election id first")
