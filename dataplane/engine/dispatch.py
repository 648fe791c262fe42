"""The engine's receive dispatch (a mixin of Engine, engine.py): a received batch to its sessions.

`_dispatch` is what the engine's loop (loop.py) calls for every batch the transport received: it
drops packets whose header check fails (`dropped.bad_header`), then hands the common batch (one
session's packets of one type) to `_handle` whole, or a mixed batch one group per (session,
type); `_handle` drops wrong-sized data packets (`rx_bad`) and calls the session's `on_*` method.
A float sum's RESULT batch, the common one, first goes whole to its session's compiled pass
(collective.py `on_result_batch`), which makes every one of these checks itself and declines,
for the code here to run, when any row would fail one.
Also `Session`, what an endpoint's session id names (engine.py and loop.py use it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..integrity import check_lanes, header_ok, headers_ok, wire_len
from ..protocol import DATA_HEADER, HEADER_LEN, HEARTBEAT_HEADER, NODE, VERSION, Flag, MsgType
from .collective import CollectiveSession
from .grouping import SCALAR_BATCH, groups_reference, groups_scalar
from .node_server import NodeServerSession
from .node_worker import WorkerNodeSession

if TYPE_CHECKING:
    from ..net.transport import Transport

Session = CollectiveSession | NodeServerSession | WorkerNodeSession  # what an endpoint's session id names
_ALL, _ANY, _MIN = np.logical_and.reduce, np.logical_or.reduce, np.minimum.reduce  # without the ndarray methods' wrappers (per batch)
# a header's first 32-bit word less its flags byte (ver_type, flags, session: bytes 0-3), in either byte order
_SAME_BATCH = np.frombuffer(bytes([0xFF, 0x00, 0xFF, 0xFF]), dtype=np.uint32)[0]
_RESULT_VT = (VERSION << 4) | int(MsgType.RESULT)  # a RESULT's first header byte


def _bad_headers(hb: np.ndarray, k: int) -> np.ndarray | None:
    """None when every one of the k (k, 32) headers `hb` passes its header check, else which do."""
    if k <= 4:
        if all(map(header_ok, [x.tobytes() for x in hb])):
            return None
        return np.array([header_ok(x.tobytes()) for x in hb], dtype=bool)
    ok = headers_ok(hb)
    return None if _ALL(ok) else ok


def widened(rows: np.ndarray, idx: np.ndarray, lens: np.ndarray, dtypes: np.ndarray, lanes: int) -> np.ndarray:
    """Private copies of received aggregation packets `rows[idx]` shorter than `lanes` lanes
    (lengths `lens`, docs/protocol.md 3.3), each made the whole packet a switch of `lanes` lanes
    carries with the same check words: check lanes moved to the end of `lanes` lanes, the lanes
    between zero (the words weigh the lanes before them, and the added ones are zero). Readers of
    received packets then see one layout. Copies, not in place: a multicast row of shared memory
    is read by every worker on the host."""
    out = np.zeros((len(idx), rows.shape[1]), dtype=np.uint8)
    for j, (i, n, d) in enumerate(zip(idx.tolist(), lens.tolist(), dtypes.tolist())):
        ck, full = 4 * check_lanes(d), HEADER_LEN + 4 * lanes
        out[j, :n - ck] = rows[i, :n - ck]
        out[j, full - ck:full] = rows[i, n - ck:n]
    return out


class DispatchMixin:
    if TYPE_CHECKING:  # what the mixin uses of Engine (engine.py), declared for the type checker
        sock: Transport
        sessions: dict[int, Session]
        stats: dict[str, int]

    def _dispatch(self, k: int, now: float) -> None:
        rows = self.sock.rx[:k]
        lens = self.sock.rx_len[:k]
        # the headers gathered once into 32-byte rows: the sessions read a dozen fields, and each
        # read of the packet rows themselves (64 KiB apart, a page each) missed cache and TLB per row
        hb = np.ascontiguousarray(rows[:, :HEADER_LEN])
        # a float sum's RESULTs, the common batch: every check below and the session's in one
        # compiled pass (collective.py `on_result_batch`); what it does not pass whole takes them
        if hb[0, 0] == _RESULT_VT:
            s = self.sessions.get((int(hb[0, 2]) << 8) | int(hb[0, 3]))
            if isinstance(s, CollectiveSession) and s.on_result_batch(rows, lens, hb.view(DATA_HEADER)[:, 0], now,
                                                                      checked=False):
                return
        # the header check first (docs/protocol.md 3.5): a corrupted header is dropped, counted and
        # never read further; the sender's timeout and resend recover it like a lost packet
        ok = _bad_headers(hb, k)
        if ok is not None:
            keep = np.flatnonzero(ok)
            self.stats["dropped.bad_header"] += k - len(keep)
            if not len(keep):
                return
            rows, lens, hb = rows[keep], lens[keep], hb[keep]
            k = len(keep)
        h = hb.view(DATA_HEADER)[:, 0]  # header_view's checks hold: hb is (k, 32) uint8
        # the common batch, one session's packets of one type: every header's first word (ver_type,
        # flags, session) the same but for the flags, checked in a few calls before any grouping
        # (a lone packet, a third of all batches, is one by itself)
        vt, _flags, s_hi, s_lo = hb[0, :4].tolist()
        if k == 1:
            same = True
        else:
            word = hb.view(np.uint32)[:, 0] & _SAME_BATCH
            same = _ALL(word == word[0])
        if same and vt >> 4 == VERSION and _MIN(lens) >= HEADER_LEN:
            s = self.sessions.get((s_hi << 8) | s_lo)
            if s is None or not self._handle(s, vt & 0xF, np.arange(k), rows, lens, h, now):
                self.stats["rx_unexpected"] += k
            return
        # a mixed batch (a PARAM and a HEARTBEAT...): one group per (session, type), in that order
        groups, bad = groups_scalar(hb, lens) if k <= SCALAR_BATCH else groups_reference(h, lens)
        self.stats["rx_bad"] += bad
        for sid, t, idx in groups:
            s = self.sessions.get(sid)
            if s is None or not self._handle(s, t, idx, rows, lens, h, now):
                self.stats["rx_unexpected"] += len(idx)

    def _handle(self, s: Session, t: int, idx: np.ndarray, rows: np.ndarray, lens: np.ndarray, h: np.ndarray,
                now: float) -> bool:
        if t in (MsgType.RESULT, MsgType.AGG, MsgType.GRAD):
            # the common batch, a float sum's RESULTs, in one compiled pass; anything it would not
            # pass whole (a bad length, a failed check...) takes the references below
            if t == MsgType.RESULT and len(idx) == len(h) and isinstance(s, CollectiveSession) \
                    and s.on_result_batch(rows, lens, h, now):
                return True
            row_lanes = getattr(s, "row_lanes", s.lanes)  # (collective: with check lanes)
            if len(idx) == len(h):  # the whole batch (idx ascending: all of it, in order): no gathers
                hs, n = h, lens
            else:
                hs, n = h[idx], lens[idx]
            if len(hs) == 1:  # a lone packet (an exponent agreement's): on Python ints, as wire_len allows
                _vt, flags, _s, _w, count, *_r, dtype, _hc, _numel = hs[0].item()
                want = np.array([wire_len(count, dtype, flags, row_lanes)])
            else:
                want = wire_len(hs["count"].astype(np.int64), hs["dtype"], hs["flags"], row_lanes)
            good = n == want
            if not _ALL(good):
                self.stats["rx_bad"] += int((~good).sum())
                idx, n, hs = idx[good], n[good], hs[good]
            short = n < HEADER_LEN + 4 * row_lanes
            if _ANY(short):  # shorter than the switch's lanes (docs/protocol.md 3.3): made whole, in copies
                wide = widened(rows, idx[short], n[short], hs["dtype"][short], row_lanes)
                done = bool(_ALL(short)) or self._deliver(s, t, idx[~short], rows, lens, h, now)
                return self._deliver(s, t, np.arange(len(wide)), wide, lens[idx[short]], hs[short], now) and done
        return self._deliver(s, t, idx, rows, lens, h, now)

    def _deliver(self, s: Session, t: int, idx: np.ndarray, rows: np.ndarray, lens: np.ndarray, h: np.ndarray,
                 now: float) -> bool:
        """Hand packets `idx` (of one type, lengths checked) to session `s`'s `on_*` method; False
        when `s` takes no packets of type `t`."""
        if isinstance(s, CollectiveSession):
            if t == MsgType.RESULT:
                s.on_results(idx, rows, h, now)
                return True
            return False
        if isinstance(s, WorkerNodeSession):
            if t == MsgType.PARAM:
                s.on_params(idx, rows, lens, h, now)
                return True
            if t == MsgType.HEARTBEAT:
                # the gathered headers seen as heartbeats (rows[idx] copied whole rows of up to 64 KiB)
                # one tolist() of the records: four field views and their lists cost more than a few packets
                for _vt, flags, _s, worker, _c, _seq, ack, credit, *_r in h.view(HEARTBEAT_HEADER)[idx].tolist():
                    if worker == NODE:
                        s.on_node_heartbeat(ack, credit, now, bool(flags & int(Flag.GAP)))
                return True
            return False
        if t == MsgType.AGG:
            s.on_agg(idx, rows, h, now)
        elif t == MsgType.GRAD:
            fb = (h["flags"][idx] & int(Flag.FALLBACK)) != 0
            s.on_fallback(idx[fb], rows, h, now)
            if not fb.all():
                return False
        elif t == MsgType.HEARTBEAT:
            for _vt, _f, _s, _w, _c, _seq, ack, credit, *_r in h.view(HEARTBEAT_HEADER)[idx].tolist():
                s.on_workers_heartbeat(ack, credit, now)
        elif t == MsgType.PULL:
            s.on_pull(idx, rows, lens, h, now)
        else:
            return False
        return True
