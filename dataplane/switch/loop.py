"""The switch's event loop: a background thread that, every turn, drains the ports with
recvmmsg into one shared buffer (UDP ports and raw ports each have one; shared-memory ports
lend their rows in place, the turn copying only their headers: shm_arena.py), runs the turn's
packets through the pipeline as one batch under the switch lock, and sends the results with
sendmmsg (or onto the rings). After an idle turn it sleeps in poll() -- on sockets, and on the
rings' doorbells -- and then reads only the sockets poll reported (every ring: looking costs no
system call)."""

from __future__ import annotations

import select
import sys
import threading

from ..kernels import use_numba
from ..protocol import aggregation_packet_len
from .attach_shm import shm_row_bytes
from .receiver import GroupReceiver
from .shm_arena import RingArena, ShmTurn

_WARMING = threading.Lock()


def _warm_kernels() -> None:
    """Load the lane kernels (dataplane/kernels/switch_lanes.py) on a background thread, once per
    process, so the first aggregation batch does not stall on numba while endpoints' timers run."""
    if _WARMING.acquire(blocking=False):  # never released: once per process
        def warm() -> None:
            from ..kernels.switch_lanes import warm_up
            from ..process.heap import refreeze

            warm_up()
            refreeze()  # a daemon froze its start-up objects: the kernels' are long-lived too (heap.py)

        threading.Thread(target=warm, name="luwu-switch-kernels", daemon=True).start()


MAX_TURN_ROWS = 2048  # rows of a shared receive buffer: ports beyond it wait for the next turn
# socket ports drain up to this many recvmmsg batches each per turn: big turns pay the pipeline's
# per-batch cost (hundreds of us of numpy calls) once for a whole backlog (luwu bench switch)
SOCKET_DEPTH = 4
MAX_TURN_BYTES = 64 << 20  # and at most this much receive buffer (64 KiB packets: 1024 rows)
# a shared-memory port gives a turn at most this many bytes of packets (64 KiB packets: 64 rows).
# A turn's results go out only once the whole turn is folded, so a turn of every port's whole
# backlog (up to its window: 128 rows of 64 KiB) holds every worker's results back for
# milliseconds while their cores idle; smaller turns overlap the switch's sums with the workers'
# own work. 4-worker 16 MiB allreduce on 2 cores: 1.56 -> 1.66-1.74 cores kept busy, 4% less time
# per allreduce for 4% more CPU (more turns); 32 rows: no faster, up to 17% more CPU
# (docs/shared_memory.md)
SHM_TURN_BYTES = 4 << 20
KINDS = ("udp", "raw", "shm")


class EventLoop:
    def __init__(self, switch):
        self.switch = switch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="luwu-switch", daemon=True)
        self._receivers: dict[str, GroupReceiver] = {}
        self._arena: RingArena | None = None  # the shm ports' up rings side by side (shm_arena.py)
        self._arena_failed = False

    def start(self) -> None:
        if use_numba():  # a bad LUWU_KERNELS fails here, once, instead of on every batch
            _warm_kernels()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _shm_turn(self, rings: list) -> ShmTurn | None:
        """The receiver of shm ports with no receive copy, over a fresh arena of their up rings
        (None: the arena cannot be made here; the rows are copied, as `pop_into` does)."""
        if self._arena is not None:  # between turns: no view of the old arena is left
            self._arena.close()
            self._arena = None
        if self._arena_failed:
            return None
        try:
            self._arena = RingArena([a.rx for a in rings])
        except (OSError, ValueError) as e:
            self._arena_failed = True
            print(f"luwu switch: shared-memory ports copy their rows ({e})", file=sys.stderr)
            return None
        # headers only: a turn may take every port's whole backlog (share rows each) and pay the
        # pipeline's per-turn cost once for all of it; more contributions to a slot per turn
        # also fold in one pass instead of rounds (fast/aggregate_groups.py)
        return ShmTurn(MAX_TURN_ROWS, self._arena, [a.rx for a in rings])

    def _receiver(self, kind: str, nports: int) -> GroupReceiver:
        cfg = self.switch.config
        packet = aggregation_packet_len(cfg.lanes)
        max_len = max(packet, {"udp": cfg.max_datagram, "raw": cfg.max_frame}.get(kind) or shm_row_bytes(cfg.lanes))
        row_len = packet if kind == "udp" else None  # UDP rows one packet wide; longer datagrams spill
        depth = 1 if kind == "shm" else min(SOCKET_DEPTH, max(1, MAX_TURN_BYTES // (cfg.batch * nports * (row_len or max_len))))
        rows = min(MAX_TURN_ROWS, max(cfg.batch, cfg.batch * nports * depth))
        rx = self._receivers.get(kind)
        if rx is None or rx.capacity < rows:
            rx = self._receivers[kind] = GroupReceiver(rows, max_len, want_addr=kind == "udp", row_len=row_len)
        return rx

    def _run(self) -> None:
        sw = self.switch
        batch = sw.config.batch
        poll_ms = max(1, int(sw.config.poll_interval * 1000))
        poller = select.poll()
        registered: set[int] = set()
        seen_ports = None
        groups: list = []
        rings: list = []  # shared-memory ports and their doorbell fds: armed before every sleep (they ring only then)
        # rings whose doorbell may hold a byte: a producer rings only after publishing to an armed
        # ring, so a ring that had no packets since its last drain (and that poll did not report)
        # has none, and arming it needs no read() (a byte left behind only wakes poll at once)
        rung: set[int] = set()
        turn = 0
        ready: set[int] | None = None  # None: try every port (the last turn was busy)
        while not self._stop.is_set():
            if sw.ports_version != seen_ports:  # ports attached or closed: rebuild the per-turn plan
                seen_ports = sw.ports_version
                atts = list(sw.ports.values())
                fds = {a.fd for a in atts}
                for fd in registered - fds:
                    poller.unregister(fd)
                for fd in fds - registered:
                    poller.register(fd, select.POLLIN)
                registered = fds
                rings = [(a, a.fd) for a in atts if a.kind == "shm"]
                ring_share = max(1, SHM_TURN_BYTES // max([a.rx.row_bytes for a, _ in rings], default=1))
                rung = {fd for _, fd in rings}
                shm_rx = self._shm_turn([a for a, _ in rings]) if rings else None
                groups = [(kind, [a for a in atts if a.kind == kind]) for kind in KINDS]
                groups = [(kind, g, shm_rx if kind == "shm" and shm_rx is not None else self._receiver(kind, len(g)))
                          for kind, g in groups if g]
                ready = None
            busy = False
            for kind, group, rx in groups:
                rx.reset()
                segments = []
                n = len(group)
                share = max(batch, rx.capacity // n)  # a socket port's rows this turn (drained)
                if kind == "shm":
                    share = min(share, ring_share)
                for i in range(n):  # rotate the start so no port always gets the leftovers
                    att = group[(turn + i) % n]
                    if kind != "shm" and ready is not None and att.fd not in ready:
                        continue  # (a ring is looked at without a system call: every ring, always)
                    start = rx.filled
                    try:
                        if kind != "shm":
                            k = rx.drain(att.fd, att.port, batch, share)
                        elif isinstance(rx, ShmTurn):
                            k = rx.take(att.rx, att.port, share)
                        else:
                            k = att.recv_into(rx, batch)
                    except OSError as e:  # a closed or broken socket: note it, keep serving the others
                        print(f"luwu switch: port {att.port}: receive failed: {e}", file=sys.stderr)
                        continue
                    if k:
                        segments.append((att, start, start + k))
                        if kind == "shm":
                            rung.add(att.rx.fd)
                if segments:
                    busy = True
                    try:
                        with sw.lock:
                            sw.handle_turn(rx, segments)
                    finally:
                        if isinstance(rx, ShmTurn):
                            rx.release()  # after the turn's last access to the borrowed rows
            turn += 1
            if sw.links_in or sw.links_out:
                with sw.lock:
                    sw.release_stale()
            if busy or not all([a.arm(fd in rung) for a, fd in rings]):  # noqa: C419 - arm every ring, no short cut
                ready = None
            else:
                rung.clear()  # every ring armed and drained where it could hold a byte
                try:
                    ready = {fd for fd, _ in poller.poll(poll_ms)}
                except InterruptedError:
                    ready = None
                else:
                    rung |= ready
        groups = []
        if self._arena is not None:  # the loop's last turn is over: no view of it is left
            self._arena.close()
            self._arena = None
