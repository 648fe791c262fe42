"""The switch's counters (docs/protocol.md 6.6): packets and bytes per drop reason, event,
received luwu type and session, plus per-port socket statistics of the software switch.

Bytes are what the port carried: the whole frame on Ethernet ports (like a P4 counter's
packet_length), the luwu datagram on UDP ports. Updates take whole batches (`np.bincount`).
"""

from __future__ import annotations

import numpy as np

from ..protocol import COUNTER_SIZE, MAX_SESSIONS, DropReason, Event, MsgType

TYPE_CODES = 16  # the 4-bit type field


class Counters:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.drops = np.zeros((COUNTER_SIZE, 2), dtype=np.int64)
        self.events = np.zeros((COUNTER_SIZE, 2), dtype=np.int64)
        self.rx_types = np.zeros((TYPE_CODES, 2), dtype=np.int64)
        self.session_packets = np.zeros((MAX_SESSIONS, 2), dtype=np.int64)
        self.ports: dict[int, dict[str, int]] = {}

    @staticmethod
    def _add(table: np.ndarray, codes: np.ndarray, nbytes: np.ndarray) -> None:
        if len(codes) == 0:
            return
        if len(codes) == 1 and 0 <= (code := int(codes[0])) < len(table):  # most shm turns: one packet, no bincounts
            table[code, 0] += 1
            table[code, 1] += int(nbytes[0])
            return
        # only up to the largest code: the session table has 65536 rows, a turn touches a few
        n = min(len(table), int(codes.max()) + 1)
        table[:n, 0] += np.bincount(codes, minlength=n)[:n]
        table[:n, 1] += np.bincount(codes, weights=nbytes, minlength=n)[:n].astype(np.int64)

    def drop(self, codes: np.ndarray, nbytes: np.ndarray) -> None:
        self._add(self.drops, codes, nbytes)

    def event(self, codes: np.ndarray, nbytes: np.ndarray) -> None:
        self._add(self.events, codes, nbytes)

    def rx_type(self, codes: np.ndarray, nbytes: np.ndarray) -> None:
        self._add(self.rx_types, codes, nbytes)

    def session(self, ids: np.ndarray, nbytes: np.ndarray) -> None:
        self._add(self.session_packets, ids, nbytes)

    def port(self, port: int, key: str, n: int = 1) -> None:
        stats = self.ports.setdefault(port, {})
        stats[key] = stats.get(key, 0) + n

    def ports_add(self, ports: np.ndarray, key: str) -> None:
        """Count one `key` per entry of `ports` (a batch's worth: one update per distinct port)."""
        uniq, n = np.unique(ports, return_counts=True)
        for port, k in zip(uniq.tolist(), n.tolist()):
            self.port(port, key, k)

    def snapshot(self) -> dict:
        """{"drops": {code: (packets, bytes)}, "events": ..., "rx_types": ..., "session_packets": ..., "ports": ...}.

        drops/events list every defined code (zeros included), rx_types every 4-bit type,
        session_packets only sessions that saw packets."""
        def rows(table, codes):
            return {int(c): (int(table[c, 0]), int(table[c, 1])) for c in codes}

        return {
            "drops": rows(self.drops, [int(r) for r in DropReason]),
            "events": rows(self.events, [int(e) for e in Event]),
            "rx_types": rows(self.rx_types, range(TYPE_CODES)),
            "session_packets": rows(self.session_packets, np.flatnonzero(self.session_packets[:, 0])),
            "ports": {p: dict(s) for p, s in sorted(self.ports.items())},
        }


def named(snapshot: dict) -> dict:
    """The same counters keyed by name (for stats files and humans)."""
    def name(enum, code):
        try:
            return enum(code).name
        except ValueError:
            return str(code)

    return {
        "drops": {name(DropReason, c): list(v) for c, v in snapshot["drops"].items()},
        "events": {name(Event, c): list(v) for c, v in snapshot["events"].items()},
        "rx_types": {name(MsgType, c): list(v) for c, v in snapshot["rx_types"].items() if v[0]},
        "session_packets": {str(s): list(v) for s, v in snapshot["session_packets"].items()},
        "ports": {str(p): s for p, s in snapshot.get("ports", {}).items()},
        "stragglers": {str(s): {str(w): v for w, v in ws.items()} for s, ws in snapshot.get("stragglers", {}).items()},
    }
