"""The conformance vectors' data model and the helpers the vector modules write them with.

A vector starts from a fresh switch programmed with conformance_topology's runtime JSON (plus
the vector's extra entries), feeds frames one at a time, and expects, after each, exactly the
listed (port, frame) outputs; at the end the counters must have moved by exactly the listed
deltas (every code not listed: 0). Expected outputs and counters are written from the spec
(docs/protocol.md), never taken from a switch.

`rx_types` and `session_packets` follow two spec rules and are derived from the inputs unless
a vector lists them: every received luwu packet with a whole 32-byte header counts under its
type nibble; every one that reaches the session lookup with a configured session counts under
its session (drops before the lookup -- loss, MALFORMED, BAD_VERSION, BAD_TYPE -- do not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance_frames import frame_in, frame_out, lanes_bytes, luwu_layer
from conformance_topology import GROUPS, LANES, SESSIONS, UDP_PORT, Host, Session
from scapy.layers.inet import UDP
from scapy.layers.l2 import Ether

from luwu.dataplane.p4runtime.entries import TableEntry
from luwu.dataplane.protocol import HEADER_LEN, Dtype, Flag, MsgType
from luwu.dataplane.scapy_layer import Luwu

COUNTER_KINDS = ("drops", "events", "rx_types", "session_packets")


@dataclass
class Step:
    port: int
    frame: bytes
    out: list[tuple[int, bytes]]
    note: str = ""


@dataclass
class Vector:
    name: str
    spec: str  # the docs/protocol.md sections it checks
    covers: tuple[str, ...]  # coverage tags (tests/conformance/test_vectors_selfcheck.py)
    steps: list[Step]
    drops: dict[int, int] = field(default_factory=dict)
    events: dict[int, int] = field(default_factory=dict)
    rx_types: dict[int, int] | None = None  # None: derived (module docstring)
    session_packets: dict[int, int] | None = None
    extra: list[TableEntry] = field(default_factory=list)

    def expected_counters(self) -> dict[str, dict[int, int]]:
        rx, sess = {}, {}
        known = {s.id for s in SESSIONS}
        for step in self.steps:
            luwu = _luwu(step.frame)
            if luwu is None:
                continue
            rx[luwu.type] = rx.get(luwu.type, 0) + 1
            if luwu.session in known:
                sess[luwu.session] = sess.get(luwu.session, 0) + 1
        return {"drops": {int(k): v for k, v in self.drops.items()},
                "events": {int(k): v for k, v in self.events.items()},
                "rx_types": rx if self.rx_types is None else {int(k): v for k, v in self.rx_types.items()},
                "session_packets": sess if self.session_packets is None else dict(self.session_packets)}


def _luwu(frame: bytes) -> Luwu | None:
    pkt = Ether(frame)
    if UDP not in pkt or pkt[UDP].dport != UDP_PORT or len(bytes(pkt[UDP].payload)) < HEADER_LEN:
        return None
    return pkt[Luwu]


# -- writing vectors ----------------------------------------------------------------------------

class Script:
    """Steps of one vector: `send(...)` one frame and say what must come out."""

    def __init__(self):
        self.steps: list[Step] = []

    def send(self, src: Host, layer: Luwu, payload: bytes = b"", out=(), note: str = "", port: int | None = None,
             frame: bytes | None = None) -> None:
        data = frame if frame is not None else frame_in(src, layer, payload)
        self.steps.append(Step(src.port if port is None else port, data, list(out), note))


@dataclass
class Agg:
    """One aggregation packet (GRAD or ALLREDUCE) of a worker, and its lanes."""

    layer: Luwu
    values: list[int]
    src: Host

    @property
    def payload(self) -> bytes:
        return lanes_bytes(self.values)


def agg(mtype: MsgType, s: Session, src: Host, seq: int, values, *, flags: int = 0, exponent: int = 0,
        dtype: Dtype = Dtype.INT32, slot: int | None = None, set_: int | None = None, count: int = LANES,
        tensor: int = 11, numel: int = 1 << 20) -> Agg:
    """A worker's packet `seq` of session `s`, slot and SET flag from the pool arithmetic."""
    pslot, pset = s.slot(seq)
    slot = pslot if slot is None else slot
    set_ = pset if set_ is None else set_
    flags = (flags & ~Flag.SET) | (Flag.SET if set_ else 0)
    layer = luwu_layer(mtype, s.id, src.rank, flags=int(flags), count=count, seq=seq, slot=slot, tensor=tensor,
                       offset=(seq * LANES) & 0xFFFFFFFF, exponent=exponent, dtype=int(dtype), numel=numel)
    return Agg(layer, list(values), src)


def result(trigger: Agg, *, mtype: MsgType, worker: int, exponent: int, flags: int) -> Luwu:
    """The emitted header: the trigger's, with type, worker, exponent and flags as the spec says;
    seq, slot, tensor, offset, count, dtype and numel kept (docs/protocol.md 6.3)."""
    t = trigger.layer
    return luwu_layer(mtype, t.session, worker, flags=flags, count=t.count, seq=t.seq, slot=t.slot, tensor=t.tensor,
                      offset=t.offset, exponent=exponent, dtype=t.dtype, numel=t.numel)


def to_group(s: Session, src: Host, layer: Luwu, payload: bytes = b"") -> list[tuple[int, bytes]]:
    """One copy per replica of the session's group, each addressed to that replica's endpoint."""
    return [(h.port, frame_out(src, h, layer, payload)) for h in GROUPS[s.group]]


def to_host(src: Host, dst: Host, layer: Luwu, payload: bytes = b"") -> list[tuple[int, bytes]]:
    return [(dst.port, frame_out(src, dst, layer, payload))]


def to_up(s: Session, src: Host, layer: Luwu, payload: bytes = b"") -> list[tuple[int, bytes]]:
    return to_host(src, s.up, layer, payload)


def keep_flags(flags: int) -> int:
    return int(flags) & int(Flag.SET | Flag.MAX)

