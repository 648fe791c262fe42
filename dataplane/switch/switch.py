"""`SoftwareSwitch`: the P4 pipeline's executable twin, as an object with tables, counters,
socket attachments and an event loop.

`process_frames` / `process_datagrams` run packets through the pipeline without sockets (the
conformance suite's entry point). `attach_udp` / `attach_raw` wire switch ports to sockets and
`start()` runs the event loop in a background thread: poll, recvmmsg batches, pipeline,
sendmmsg; `attach_shm` wires a port to shared-memory rings instead (endpoints on this host).
Every attachment is a `luwu.dataplane.net.transport.SwitchPort`: `emit` sends through its
`send_rows` whatever the kind (the shm ports' pool references and one-copy writes aside).
Output order: the emitted copies of a call or batch come in the order of the packets that
triggered them, replicas in multicast group order -- exactly what processing the packets
one at a time produces (docs in pipeline.py); link impairments, when configured, then duplicate
or swap neighbouring packets of a port.
"""

from __future__ import annotations

import itertools
import sys
import threading
import traceback

import numpy as np

from ..observe import trace
from ..protocol import ETH_IP_UDP_LEN, DropReason, aggregation_packet_len
from . import runtime_json
from .attach_raw import RawAttachment
from .attach_shm import MulticastPools, ShmAttachment, shm_row_bytes
from .attach_udp import UdpAttachment
from .batch import Batch, Emission
from .config import ConfigError, SwitchConfig
from .controls.drop_simulator import threshold_for
from .counters import Counters
from .fast import aggregate_one, forward_one
from .fast.emit_shm import emit_pooled, emit_small
from .impairments import Link
from .loop import EventLoop
from .peers import peers_from_tables
from .pipeline import LINK_IN, LINK_OUT, Pipeline
from .registers import Registers
from .table_schema import PORT_BITS, TableError
from .tables import Tables


class SoftwareSwitch:
    def __init__(self, config: SwitchConfig | None = None):
        self.config = cfg = config or SwitchConfig()
        self.lock = threading.Lock()  # held per batch by the event loop; hold it to change tables atomically
        self.registers = Registers(cfg.slots, cfg.lanes)
        self._counters = Counters()
        self.tables = Tables(cfg.slots, on_clear=self._on_pipeline_reset)
        self.pipeline = Pipeline(cfg, self.tables, self.registers, self._counters)
        self.ports: dict[int, UdpAttachment | RawAttachment | ShmAttachment] = {}
        self.ports_version = 0  # bumped when ports are attached or closed (the event loop replans)
        self._pools: MulticastPools | None = None  # rows multicast to several shm ports, written once
        self.links_in: dict[int, Link] = {}
        self.links_out: dict[int, Link] = {}
        self._loop: EventLoop | None = None
        self._peers_version = -1  # the tables version the UDP ports' peers were derived from (peers.py)
        self.errors = 0  # batches whose processing raised (logged, never fatal)
        self.aggregate_one_scratch: aggregate_one.Scratch | None = None  # fast/aggregate_one.py's kernel arguments (made on first use)

    @property
    def lanes(self) -> int:
        return self.config.lanes

    # -- control ---------------------------------------------------------------------------------
    def counters(self) -> dict:
        with self.lock:
            snap = self._counters.snapshot()
            if self.pipeline.stragglers is not None:
                snap["stragglers"] = self.pipeline.stragglers.snapshot()
            for port, link in self.links_in.items():
                for k, v in link.stats.items():
                    if v:
                        snap["ports"].setdefault(port, {})[f"sim_rx_{k}"] = v
            for port, link in self.links_out.items():
                for k, v in link.stats.items():
                    if v:
                        snap["ports"].setdefault(port, {})[f"sim_tx_{k}"] = v
            return snap

    def reset_counters(self) -> None:
        with self.lock:
            self._counters.reset()
            if self.pipeline.stragglers is not None:
                self.pipeline.stragglers.reset()

    def load_runtime(self, source, replace: bool = False) -> dict:
        """Apply a p4lang/tutorials runtime JSON (a path or a dict); see runtime_json.py."""
        return runtime_json.load(self.tables, source, replace)

    def _on_pipeline_reset(self) -> None:
        self.registers.reset()

    def set_drop_sim(self, port: int, ingress: float = 0.0, egress: float = 0.0, duplicate: float = 0.0,
                     reorder: float = 0.0) -> None:
        """Loss on a port's ingress/egress (the P4 drop_sim tables), plus the software-only
        duplication and reordering of both directions of its link (impairments.py)."""
        if isinstance(port, bool) or not isinstance(port, (int, np.integer)) or not 0 <= port < (1 << PORT_BITS):
            raise TableError(f"set_drop_sim: port {port!r} out of range 0..{(1 << PORT_BITS) - 1}")
        for name, p in (("ingress", ingress), ("egress", egress), ("duplicate", duplicate), ("reorder", reorder)):
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                raise TableError(f"set_drop_sim: {name} probability {p!r} must be in [0, 1]")
        for table, action, p in (("ingress_drop_sim", "set_ingress_drop_rate", ingress),
                                 ("egress_drop_sim", "set_egress_drop_rate", egress)):
            exists = self.tables.lookup(table, {"port": port}) is not None
            if p > 0:
                self.tables.insert(table, {"port": port}, action, {"threshold": threshold_for(p)}, modify=exists)
            elif exists:
                self.tables.delete(table, {"port": port})
        with self.lock:
            for links, direction in ((self.links_in, LINK_IN), (self.links_out, LINK_OUT)):
                if port not in links:
                    links[port] = Link(self.pipeline.link_stream(port, direction))
                links[port].duplicate = float(duplicate)
                links[port].reorder = float(reorder)

    # -- packets without sockets -------------------------------------------------------------------
    def process_datagrams(self, items: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """luwu datagrams in (UDP-attachment semantics: no L2-L4, endpoints not consulted)."""
        with self.lock:
            items = self._impair(self.links_in, list(items))
            if not items:
                return []
            b = Batch.from_bytes(items, False, aggregation_packet_len(self.lanes))
            em = self.pipeline.run(b)
            cache: dict[int, bytes] = {}
            out = []
            for port, pk in zip(em.port.tolist(), em.pkt.tolist()):
                data = cache.get(pk)
                if data is None:
                    data = cache[pk] = b.rows[pk, :b.luwu_len[pk]].tobytes()
                out.append((port, data))
            return self._impair(self.links_out, out)

    def process_frames(self, items: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Ethernet frames in and out (every port an Ethernet port)."""
        with self.lock:
            items = self._impair(self.links_in, list(items))
            if not items:
                return []
            b = Batch.from_bytes(items, True, ETH_IP_UDP_LEN + aggregation_packet_len(self.lanes))
            em = self.pipeline.run(b)
            frames, lengths, kept = self.pipeline.frames(b, em)
            out = [(port, frames[i, :lengths[i]].tobytes()) for i, port in enumerate(em.port[kept].tolist())]
            return self._impair(self.links_out, out)

    @staticmethod
    def _impair(links: dict[int, Link], items: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        if not any(link.active for link in links.values()):
            return items
        out = []
        for item in items:
            link = links.get(item[0])
            out.extend(link.pass_through([item]) if link is not None and link.active else [item])
        return out

    # -- sockets ---------------------------------------------------------------------------------
    def attach_udp(self, port: int, listen: tuple[str, int], peer: tuple[str, int] | str | None = None
                   ) -> tuple[str, int]:
        """Wire switch port `port` to a UDP socket bound to `listen`; returns the bound address.

        Args:
            port: the switch port number.
            listen: (host, port) to bind; port 0 picks a free one.
            peer: the one address the port accepts datagrams from and sends to. None: the
                address the tables' `endpoints` entries give the port's endpoint (peers.py);
                until they name one the port refuses everything (UNKNOWN_PORT). "learn": the
                source of the first valid packet (opt-in: whoever sends first owns the port).

        Returns:
            The bound (host, port).

        Example::

            addr = sw.attach_udp(1, ("127.0.0.1", 0), peer=engine.address)
        """
        self._check_free(port)
        att = UdpAttachment(port, listen, peer, self.config)
        self._add_port(att)
        return att.address

    def set_peer(self, port: int, peer: tuple[str, int] | None) -> None:
        """Bind UDP port `port` to `peer` (None: back to the tables' address, unbound until they name one)."""
        att = self.ports.get(port)
        if att is None or att.kind != "udp":
            raise ConfigError(f"switch port {port} is not a UDP port")
        with self.lock:
            if peer is None:
                att.configured = att.learning = False
                att.clear_peer()
                self._peers_version = -1
            else:
                att.set_peer(peer)

    def sync_peers(self) -> None:
        """Give every UDP port without a configured peer the address the tables name for it (peers.py).
        Called by the event loop whenever the tables changed; call it with the lock held."""
        version = self.tables.version
        if version == self._peers_version:
            return
        self._peers_version = version
        udp = [a for a in self.ports.values() if a.kind == "udp" and not a.configured and not a.learning]
        if not udp:
            return
        one, clash = peers_from_tables(self.tables)
        for att in udp:
            addr = one.get(att.port)
            if addr is None:
                if att.peer is not None or att.port in clash:
                    why = (f"its endpoints name {sorted(clash[att.port])}" if att.port in clash
                           else "no endpoints entry names its peer any more")
                    print(f"luwu switch: UDP port {att.port} is unbound ({why}): it refuses every datagram",
                          file=sys.stderr)
                att.clear_peer()
            elif att.peer != addr:
                att.bind(addr)

    def attach_shm(self, port: int, prefix: str | None = None, slots: int | None = None) -> str:
        """Wire switch port `port` to a pair of shared-memory packet rings (endpoints on this host).

        Args:
            port: the switch port number.
            prefix: path of the ring pair (`<prefix>.up`, `<prefix>.down` in /dev/shm); default:
                a fresh name. The switch creates the files and removes them when it stops.
            slots: packets each ring holds (a power of two; default: about 16 MiB of rows, 256..1024).

        Returns:
            The prefix, which the endpoint passes to `ShmEndpoint` (`Wiring(transport="shm")`).

        Example::

            prefix = sw.attach_shm(1)
            ep = ShmEndpoint(prefix)          # in the endpoint's process
        """
        self._check_free(port)
        att = ShmAttachment(port, self.config, prefix, slots)
        self._add_port(att)
        return att.address

    def attach_raw(self, port: int, ifname: str) -> None:
        """Wire switch port `port` to a network interface (AF_PACKET, root only)."""
        self._check_free(port)
        self._add_port(RawAttachment(port, ifname, self.config))

    def _add_port(self, att: UdpAttachment | RawAttachment | ShmAttachment) -> None:
        """Put an attachment (a `net.transport.SwitchPort`) on its port; the event loop replans."""
        with self.lock:
            self.ports[att.port] = att
            self.ports_version += 1
            self._peers_version = -1  # (a UDP port without a configured peer takes the tables')

    def _check_free(self, port: int) -> None:
        if isinstance(port, bool) or not isinstance(port, (int, np.integer)) or not 0 <= port < (1 << PORT_BITS):
            raise ConfigError(f"switch port {port!r} out of range 0..{(1 << PORT_BITS) - 1}")
        if port in self.ports:
            raise ConfigError(f"switch port {port} is already attached to {self.ports[port].address}")

    def port_addresses(self) -> dict[int, object]:
        return {p: a.address for p, a in sorted(self.ports.items())}

    def start(self) -> None:
        if self._loop is not None:
            raise RuntimeError("the switch is already running")
        self._loop = EventLoop(self)
        self._loop.start()

    def stop(self) -> None:
        """Stop the event loop and close every port (a stopped switch is not restarted)."""
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        with self.lock:
            for att in self.ports.values():
                att.close()
            self.ports.clear()
            if self._pools is not None:
                self._pools.close()
                self._pools = None
            self.ports_version += 1

    def __enter__(self) -> SoftwareSwitch:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the event loop's per-batch work (called with self.lock held) ------------------------------
    def handle_turn(self, rx, segments: list) -> None:
        """One event-loop turn: the packets of `segments` ((attachment, first row, end row) in
        the shared receive buffer `rx`) as one batch through the pipeline, then out."""
        try:
            n = rx.filled
            framed = segments[0][0].framed
            self.sync_peers()
            if n == 1 and forward_one.eligible(self, rx, segments[0][0]) and (
                    forward_one.turn(self, rx, segments[0][0]) or aggregate_one.turn(self, rx, segments[0][0])):
                return  # one heartbeat, PULL or multicast (fast/forward_one.py), or contribution (fast/aggregate_one.py)
            drop = np.zeros(n, dtype=np.int64)
            learning = []
            for att, a, z in segments:
                self._count_port(att.port, "rx_packets", z - a)
                if att.kind == "udp":
                    if att.peer is None and att.learning:
                        learning.append((att, a, z))
                    else:
                        drop[a:z][att.foreign(rx.addr[a:z])] = DropReason.UNKNOWN_PORT
            truncated = getattr(rx, "truncated", None)
            # (a shm turn knows whether it cut a row: no array look for the usual none)
            if truncated is not None and getattr(rx, "cut", True) and truncated[:n].any():  # longer than the receive buffer: the kernel kept only a prefix
                drop[(drop == 0) & truncated[:n]] = DropReason.MALFORMED
            b = Batch(rx.turn_rows(n), rx.length[:n], rx.port[:n], framed, drop)
            arena = getattr(rx, "arena", None)
            if arena is not None:  # shared-memory turn: the packets' bytes stay in their rings (shm_arena.py)
                b.arena, b.prow = arena.rows, rx.prow[:n]
                b.hdr, b.hb = rx.headers(n)
            if learning:
                valid = self.pipeline.valid(b)
                for att, a, z in learning:
                    att.learn(rx.addr[a:z], valid[a:z], b.drop[a:z])
            if self.links_in and any(self.links_in.get(att.port) is not None and self.links_in[att.port].active
                                     for att, _, _ in segments):
                b = self._impair_turn(b.whole(), framed)
                if b is None:
                    return
            with trace.span("pipeline turn", "switch", packets=n):
                self.emit(b, self.pipeline.run(b))
        except Exception:  # a bug must not take the switch down: log it, count it, keep forwarding
            self.errors += 1
            for att in self.ports.values():  # rows an aborted emit published without ringing
                att.notify()
            if self.errors <= 10:
                traceback.print_exc(file=sys.stderr)

    def _impair_turn(self, b: Batch, framed: bool) -> Batch | None:
        """Rebuild the turn's batch after the links duplicated or held back packets (copies rows)."""
        foreign = b.drop != 0
        if foreign.any():
            self.pipeline.count_copy_drops(b, DropReason.UNKNOWN_PORT, np.flatnonzero(foreign))
        items = [(int(b.port[i]), b.rows[i, :b.length[i]].tobytes()) for i in np.flatnonzero(~foreign)]
        items = self._impair(self.links_in, items)
        if not items:
            return None
        return Batch.from_bytes(items, framed, self._min_width(framed))

    def _min_width(self, framed: bool) -> int:
        return (ETH_IP_UDP_LEN if framed else 0) + aggregation_packet_len(self.lanes)

    def release_stale(self) -> None:
        """Packets the reorder simulator held back for longer than reorder_hold go now."""
        hold = self.config.reorder_hold
        for port, link in self.links_in.items():
            items = link.release_stale(hold)
            att = self.ports.get(port)
            if items and att is not None:
                b = Batch.from_bytes(items, att.framed, self._min_width(att.framed))
                self.emit(b, self.pipeline.run(b))
        for port, link in self.links_out.items():
            items = link.release_stale(hold)
            if items:
                self._send_bytes(port, [d for _, d in items])

    def emit(self, b: Batch, em: Emission) -> None:
        # (a shm turn's few copies to shm ports, or many into one multicast pool: fast/emit_shm.py)
        if not len(em) or emit_small(self, b, em) or emit_pooled(self, b, em):
            return
        ports = em.port
        # a few copies (most turns): np.unique's sort costs more than a set's
        uniq = np.unique(ports) if len(ports) > 16 else np.array(sorted(set(ports.tolist())), dtype=ports.dtype)
        if b.prow is not None:  # a split batch (shm_arena.py): the packets leave from their arena rows
            if all((a := self.ports.get(p)) is None or a.peer is None  # dropped NO_ROUTE: never read
                   or (a.kind == "shm" and not (self.links_out.get(p) is not None and self.links_out[p].active))
                   for p in uniq.tolist()):
                pk = em.pkt  # the sender's order: a packet's copies side by side (a repeat only rewrites)
                b.write_back(pk if len(pk) < 2 else pk[np.append(True, pk[1:] != pk[:-1])])
            else:  # bytes leave another way too (UDP, Ethernet, impairments): whole rows
                b = b.whole()
        src = b.rows if b.prow is None else b.arena  # rows `b.payload_rows(pkt)` hold the packets
        woken = []  # shm ports: publish to all of them first, then ring (a woken endpoint may preempt us)
        pool_id, pool_at = self._multicast_rows(b, em, uniq)
        if b.results is not None:  # deferred sums of copies that leave from their own rows (Batch.results)
            b.materialize(em.pkt if pool_id is None else em.pkt[pool_id < 0])
        holders: dict[int, list] = {}
        if pool_id is not None and pool_id[0] >= 0 and bool((pool_id == pool_id[0]).all()):
            # every copy a reference into one pool (a turn's RESULTs to every worker): every port
            # is a shm port without impairments and no copy is routed IPv4 (MulticastPools.place)
            self._send_pooled(b, em, uniq, int(pool_id[0]), pool_at, holders, woken)
            uniq = uniq[:0]
        for p in uniq.tolist():
            mine = None if len(uniq) == 1 else ports == p
            sub = em if mine is None else em.select(mine)
            refs = None if pool_id is None else (pool_id, pool_at) if mine is None else (pool_id[mine], pool_at[mine])
            att = self.ports.get(p)
            if att is None or att.peer is None:
                self.pipeline.count_copy_drops(b, DropReason.NO_ROUTE, sub.pkt)
                continue
            link = self.links_out.get(p)
            impaired = link is not None and link.active
            if att.kind in ("udp", "shm"):  # datagram ports: bare luwu packets
                if sub.l3.any():  # a routed IPv4 frame has no luwu datagram to put on such a port
                    self.pipeline.count_copy_drops(b, DropReason.NO_ROUTE, sub.pkt[sub.l3])
                    if refs is not None:
                        refs = (refs[0][~sub.l3], refs[1][~sub.l3])
                    sub = sub.select(~sub.l3)
                    if not len(sub):
                        continue
                lengths = b.luwu_len[sub.pkt]
                if impaired:
                    datas = [b.rows[pk, b.off:b.off + n].tobytes() for pk, n in zip(sub.pkt.tolist(), lengths.tolist())]
                    self._send_bytes(p, [d for _, d in link.pass_through([(p, d) for d in datas])])
                    continue
                if refs is not None and (refs[0] >= 0).any():  # (only shm ports get pool references)
                    sent = self._send_shm_mixed(att, b, sub, lengths, refs[0], refs[1], holders)
                else:  # (a UDP port's `b` is whole: `src` is b.rows, payload_rows the packets)
                    sent = att.send_rows(src, b.payload_rows(sub.pkt), lengths, b.off, notify=False)
                if att.kind == "shm":
                    woken.append(att)
                    self._count_port(p, "tx_ring_full", len(sub) - sent)
            else:
                frames, lengths, _ = self.pipeline.frames(b, sub)
                if impaired:
                    datas = [frames[i, :lengths[i]].tobytes() for i in range(len(frames))]
                    self._send_bytes(p, [d for _, d in link.pass_through([(p, d) for d in datas])])
                    continue
                sent = att.send_rows(frames, np.arange(len(frames)), lengths)
            self._count_port(p, "tx_packets", sent)
        if holders:
            self._pools.claim(holders)
        for att in woken:
            att.notify()

    def _multicast_rows(self, b: Batch, em: Emission, uniq: np.ndarray) -> tuple:
        """(pool id, pool position) per emitted copy, -1 for a copy that goes inline, or (None,
        None) when no packet goes to two shared-memory ports (attach_shm.MulticastPools)."""
        if len(uniq) < 2:
            return None, None
        shm = [p for p in uniq.tolist() if (a := self.ports.get(p)) is not None and a.kind == "shm"
               and not (self.links_out.get(p) is not None and self.links_out[p].active)]
        if len(shm) < 2:
            return None, None
        eligible = em.port == shm[0]
        for p in shm[1:]:  # a few ports: cheaper than np.isin's sort
            eligible |= em.port == p
        eligible &= ~em.l3
        if self._pools is None:
            self._pools = MulticastPools(shm_row_bytes(self.config.lanes))
        src = b.rows if b.prow is None else b.arena
        ids, at = self._pools.place(src, b.off, em.pkt, em.port, b.luwu_len, eligible, b.prow, b.results,
                                    b.result_lanes)
        return (ids, at) if (ids >= 0).any() else (None, None)

    def _send_pooled(self, b: Batch, em: Emission, uniq: np.ndarray, pid: int, at: np.ndarray, holders: dict,
                     woken: list) -> None:
        """Every emitted copy a reference into pool `pid`: each port's references, in emission
        order, onto its ring (the per-port loop of `emit` without its per-copy selections)."""
        lengths = b.luwu_len[em.pkt]
        one = len(uniq) == 1
        for p in uniq.tolist():
            att = self.ports[p]
            mine = None if one else em.port == p
            n_copies = len(em) if mine is None else int(np.count_nonzero(mine))
            sent = att.send_refs(pid, at if mine is None else at[mine], lengths if mine is None else lengths[mine])
            holders.setdefault(pid, []).append((att, att.tx.published()))
            woken.append(att)
            self._count_port(p, "tx_ring_full", n_copies - sent)
            self._count_port(p, "tx_packets", sent)

    def _send_shm_mixed(self, att, b: Batch, sub: Emission, lengths: np.ndarray, ids: np.ndarray,
                        at: np.ndarray, holders: dict) -> int:
        """A shm port's copies in emission order: runs of references to pool rows and runs copied inline."""
        if ids[0] == ids[-1] and bool((ids == ids[0]).all()):
            bounds = [0, len(ids)]  # one run (the common case: every copy a reference into one pool)
        else:
            bounds = [0, *(np.flatnonzero(np.diff(ids) != 0) + 1).tolist(), len(ids)]
        sent = 0
        for a, z in itertools.pairwise(bounds):
            pid = int(ids[a])
            if pid < 0:
                src = b.rows if b.prow is None else b.arena
                n = att.send_rows(src, b.payload_rows(sub.pkt[a:z]), lengths[a:z], b.off, notify=False)
            else:
                n = att.send_refs(pid, at[a:z], lengths[a:z])
                holders.setdefault(pid, []).append((att, att.tx.published()))
            sent += n  # a full ring loses the rest of the run (counted per port as ever)
        return sent

    def _send_bytes(self, port: int, datas: list[bytes]) -> None:
        att = self.ports.get(port)
        if att is None or not datas:
            return
        width = max(len(d) for d in datas)
        rows = np.zeros((len(datas), width), dtype=np.uint8)
        for i, d in enumerate(datas):
            rows[i, :len(d)] = np.frombuffer(d, dtype=np.uint8)
        lengths = np.array([len(d) for d in datas], dtype=np.int64)
        sent = att.send_rows(rows, np.arange(len(rows)), lengths)
        if att.kind == "shm":
            self._count_port(port, "tx_ring_full", len(rows) - sent)
        self._count_port(port, "tx_packets", sent)

    def _count_port(self, port: int, key: str, n: int) -> None:
        if n:
            self._counters.port(port, key, int(n))
