"""Shared-memory turns run the pipeline on the packets where they lie in the up rings
(dataplane/switch/shm_arena.py: headers copied, payloads read and written in the rings' rows
mapped side by side): on random traffic from several ports, interleaved, across the rings'
wrap-around, what every endpoint receives (bytes and order) and the counters equal what the same
packets produce as datagrams (`process_datagrams`, the UDP attachment's semantics), with the
numba kernels and with the numpy reference; and the arena is the rings' memory itself."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switch_setup import LANES, SLOTS, agg_packet, param, runtime
from test_switch_vectorised_equivalence import packets

from luwu.dataplane.net.shm_endpoint import ShmEndpoint
from luwu.dataplane.net.shm_ring import H_HEAD, supported
from luwu.dataplane.protocol import HEADER_LEN, TRAILER_LEN, DropReason
from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig
from luwu.dataplane.switch.shm_arena import RingArena, ShmTurn

pytestmark = pytest.mark.skipif(not supported(), reason="shared-memory rings need Linux on x86-64 with /dev/shm")

PORTS = (0, 1, 2, 3, 4, 5)  # the workers' ports, the node's (4), session 3's parent (5) and 1's up port (0)
RING_SLOTS = 16  # small rings: turns cross their wrap-around often
TURN_MAX = 12  # packets per turn: every port's outputs of a turn fit its down ring


def make_switch() -> SoftwareSwitch:
    sw = SoftwareSwitch(SwitchConfig(lanes=LANES, slots=SLOTS, seed=1))
    sw.load_runtime(runtime())
    return sw


def core(c: dict) -> dict:
    """Counters both switches keep alike; the per-port rx/tx packet counts only a switch with
    ports keeps (checked against what crossed the rings)."""
    ports = {p: {k: v for k, v in pc.items() if k not in ("rx_packets", "tx_packets")} for p, pc in c["ports"].items()}
    return {**{k: c[k] for k in ("drops", "events", "rx_types", "session_packets")},
            "ports": {p: pc for p, pc in ports.items() if pc}}


class ShmRig:
    """A switch with shm ports driven turn by turn by hand, as its event loop does (take every
    port's packets into one ShmTurn, handle_turn, release), with an endpoint on every port."""

    def __init__(self):
        self.sw = make_switch()
        self.prefix = {p: self.sw.attach_shm(p, slots=RING_SLOTS) for p in PORTS}
        self.ep = {p: ShmEndpoint(self.prefix[p]) for p in PORTS}
        rings = [self.sw.ports[p].rx for p in PORTS]
        self.arena = RingArena(rings)
        self.turn = ShmTurn(64, self.arena, rings)

    def run_turn(self, items: list[tuple[int, bytes]], take: tuple = (), read: bool = True) -> dict[int, list[bytes]]:
        """Put `items` on their ports' up rings, run one turn taking the ports in the items'
        order of first appearance (then ports `take`, whose rings hold packets put there
        otherwise), and return what every port's endpoint receives (`read=False`: nothing is
        read, the down rings and multicast pools keep what the turn left there; {} returned)."""
        width = self.ep[1].up.row_bytes
        for p in PORTS:
            datas = [d[:width] for q, d in items if q == p]
            if datas:
                rows = np.zeros((len(datas), width), dtype=np.uint8)
                for i, d in enumerate(datas):
                    rows[i, :len(d)] = np.frombuffer(d, dtype=np.uint8)
                lengths = np.array([len(d) for d in datas], dtype=np.int64)
                assert self.ep[p].up.push_rows(rows, np.arange(len(datas)), lengths)[0] == len(datas)
        self.turn.reset()
        segments = []
        for p in dict.fromkeys([*(q for q, _ in items), *take]):
            start = self.turn.filled
            k = self.turn.take(self.sw.ports[p].rx, p, 64)
            segments.append((self.sw.ports[p], start, start + k))
        try:
            with self.sw.lock:
                self.sw.handle_turn(self.turn, segments)
        finally:
            self.turn.release()
        if not read:
            return {}
        out = {}
        for p, ep in self.ep.items():
            got = []
            while k := ep.recv():
                got += [ep.rx[i, :ep.rx_len[i]].tobytes() for i in range(k)]
            out[p] = got
        return out

    def close(self):
        self.arena.close()
        for ep in self.ep.values():
            ep.close()
        self.sw.stop()


def by_port(items: list[tuple[int, bytes]]) -> dict[int, list[bytes]]:
    return {p: [d for q, d in items if q == p] for p in PORTS}


@pytest.fixture(params=["numba", "reference"])
def kernels(request, monkeypatch):
    """Both lane paths (dataplane/kernels): the compiled kernels and the numpy reference."""
    monkeypatch.setenv("LUWU_KERNELS", request.param)
    return request.param


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(packets(), min_size=1, max_size=6).map(lambda runs: [p for r in runs for p in r]),
                min_size=1, max_size=8),
       st.randoms(use_true_random=False))
def test_shm_turns_equal_datagram_batches(kernels, turns, rnd):
    rig, ref = ShmRig(), make_switch()
    sent, received = 0, dict.fromkeys(PORTS, 0)
    try:
        for items in turns:
            items = items[:TURN_MAX]
            # a turn's batch is its ports' packets one port after the other (the loop's order)
            order = list(dict.fromkeys(p for p, _ in items))
            rnd.shuffle(order)
            items = [it for p in order for it in items if it[0] == p]
            if not items:
                continue
            got = rig.run_turn(items)
            want = by_port(ref.process_datagrams(items))
            assert got == want
            sent += len(items)
            for p in PORTS:
                received[p] += len(got[p])
        assert rig.sw.errors == 0
        assert core(rig.sw.counters()) == core(ref.counters())
        ports = rig.sw.counters()["ports"]
        assert sum(c.get("rx_packets", 0) for c in ports.values()) == sent
        assert {p: c.get("tx_packets", 0) for p, c in ports.items() if c.get("tx_packets")} == \
            {p: n for p, n in received.items() if n}
    finally:
        rig.close()


def test_the_arena_is_the_rings_memory():
    """A payload written by the endpoint is what the arena row holds, and a result the switch
    writes into an arena row is what the ring holds (the same pages, mapped twice)."""
    rig = ShmRig()
    try:
        ring = rig.sw.ports[2].rx
        data = agg_packet(1, 1, 0, list(range(1, LANES + 1)))
        rig.ep[2].up.push_rows(np.frombuffer(data, dtype=np.uint8)[None, :].copy(), np.array([0]),
                               np.array([len(data)]))
        rig.turn.reset()
        assert rig.turn.take(ring, 2, 64) == 1
        row = int(rig.turn.prow[0])
        assert rig.arena.rows[row, :len(data)].tobytes() == data
        rig.arena.rows[row, 40] ^= 0xFF
        assert ring.rows[0, 40] == data[40] ^ 0xFF
        rig.turn.release()
        assert ring.pending() == 0
    finally:
        rig.close()


def test_an_allreduce_over_shm_turns_sums_in_the_rings():
    """Three workers' contributions to one slot, each on its own port, in one turn: the sum
    comes back to every worker, read from the up ring rows where they lie (no receive copy) and
    written once, straight into the multicast pool row every worker reads (Batch.results): the
    last contributor's row keeps its own lanes under the rewritten header."""
    rig, ref = ShmRig(), make_switch()
    try:
        items = [(r + 1, agg_packet(1, r, 0, [r + 1] * LANES)) for r in (0, 1, 2)]
        got = rig.run_turn(items)
        assert got == by_port(ref.process_datagrams(items))
        assert all(len(got[p]) == 1 for p in (1, 2, 3))
        result = got[3][0]
        assert result[HEADER_LEN:] == np.full(LANES, 6, dtype=">i4").tobytes()
        last = rig.sw.ports[3].rx.rows[0, :len(result)].tobytes()
        assert last[:HEADER_LEN] == result[:HEADER_LEN]  # the header rewritten in its row
        assert last[HEADER_LEN:] == items[2][1][HEADER_LEN:]  # the sum never written there
        pools = list(rig.sw._pools._pools.values())
        assert len(pools) == 1 and pools[0].shm.rows[0, :len(result)].tobytes() == result
    finally:
        rig.close()


@pytest.mark.parametrize("path", ["arena", "copy"])
def test_the_event_loop_sums_over_shm_with_and_without_the_arena(path, monkeypatch, capfd):
    """Through the running event loop: a phase of three workers on their own ports comes back
    summed to each, whether the loop runs on the rings' rows (the arena) or, where the arena
    cannot be made, copies them (said once on stderr)."""
    from luwu.dataplane.switch import loop

    if path == "copy":
        def no_arena(rings):
            raise OSError("no address space (test)")
        monkeypatch.setattr(loop, "RingArena", no_arena)
    sw, ref = make_switch(), make_switch()
    eps = {}
    try:
        for p in PORTS:
            eps[p] = ShmEndpoint(sw.attach_shm(p))
        sw.start()
        items = [(r + 1, agg_packet(1, r, seq, [r + seq, -r, 7])) for seq in range(3) for r in (0, 1, 2)]
        width = eps[1].up.row_bytes
        for p, data in items:
            row = np.zeros((1, width), dtype=np.uint8)
            row[0, :len(data)] = np.frombuffer(data, dtype=np.uint8)
            assert eps[p].send_rows(row, np.array([0]), np.array([len(data)])) == 1
        want = by_port(ref.process_datagrams(items))
        got = {p: [] for p in PORTS}
        for _ in range(2000):  # bounded: 20 s at most
            for p, ep in eps.items():
                while k := ep.recv():
                    got[p] += [ep.rx[i, :ep.rx_len[i]].tobytes() for i in range(k)]
            if all(len(got[p]) >= len(want[p]) for p in PORTS):
                break
            time.sleep(0.01)
        assert got == want
        assert sw.errors == 0
    finally:
        sw.stop()
        for ep in eps.values():
            ep.close()
    assert ("copy their rows" in capfd.readouterr().err) == (path == "copy")


@pytest.mark.parametrize("impaired", [False, True])
def test_rows_leaving_by_udp_or_through_impaired_links_are_whole(impaired):
    """A turn of shm packets whose results leave on a UDP port (the node's), and (impaired) a
    link that duplicates every packet: the bytes that leave are the whole packets, rewritten
    headers included (Batch.whole), equal to what the same datagrams produce."""
    import socket

    from switch_setup import NODE_PORT

    from luwu.dataplane.protocol import MsgType

    node = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    node.bind(("127.0.0.1", 0))
    node.settimeout(20.0)
    sw, ref = make_switch(), make_switch()
    ports = (1, 2, 3)
    eps = {p: ShmEndpoint(sw.attach_shm(p)) for p in ports}
    sw.attach_udp(NODE_PORT, ("127.0.0.1", 0), peer=node.getsockname())
    for s in (sw, ref) if impaired else ():
        s.set_drop_sim(2, duplicate=1.0)  # every packet on port 2's link twice, both directions
    rings = [sw.ports[p].rx for p in ports]
    arena = RingArena(rings)
    turn = ShmTurn(64, arena, rings)
    try:
        # session 2 completes at the node's (UDP) port; session 1 multicasts to the shm ports
        items = [(r + 1, agg_packet(2, r, 0, [5 * r + 1] * LANES, mtype=MsgType.GRAD)) for r in (0, 1, 2)]
        items += [(r + 1, agg_packet(1, r, 1, [r - 7] * LANES)) for r in (0, 1, 2)]
        items = [it for p in ports for it in items if it[0] == p]
        width = eps[1].up.row_bytes
        for p in ports:
            datas = [d for q, d in items if q == p]
            rows = np.zeros((len(datas), width), dtype=np.uint8)
            for i, d in enumerate(datas):
                rows[i, :len(d)] = np.frombuffer(d, dtype=np.uint8)
            eps[p].up.push_rows(rows, np.arange(len(datas)), np.array([len(d) for d in datas]))
        segments = []
        for p in ports:
            start = turn.filled
            k = turn.take(sw.ports[p].rx, p, 64)
            segments.append((sw.ports[p], start, start + k))
        with sw.lock:
            sw.handle_turn(turn, segments)
        turn.release()
        want = ref.process_datagrams(items)
        got = {p: [] for p in ports}
        for p, ep in eps.items():
            while k := ep.recv():
                got[p] += [ep.rx[i, :ep.rx_len[i]].tobytes() for i in range(k)]
        assert got == {p: [d for q, d in want if q == p] for p in ports}
        to_node = [d for q, d in want if q == NODE_PORT]
        assert to_node and [node.recv(65536) for _ in to_node] == to_node
        assert sw.errors == 0
    finally:
        arena.close()
        for ep in eps.values():
            ep.close()
        sw.stop()
        node.close()


def test_a_length_past_its_row_is_dropped_malformed_in_one_and_in_many_packet_turns():
    """A ring length word beyond the row (only a broken endpoint writes one) drops the packet
    MALFORMED whether it comes alone (ShmTurn.take's scalar path) or among others -- a PARAM as
    long as the row, which the row's bytes alone would pass -- and the turn after it (ShmTurn.cut
    reset) forwards valid packets as ever."""
    rig = ShmRig()
    try:
        up = rig.ep[0].up  # session 1's up port: its PARAMs go to the workers' ports 1..3
        width = up.row_bytes
        data = param(1, count=(width - HEADER_LEN - TRAILER_LEN) // 4, dtype=1)  # (its trailer fills the row)
        assert len(data) == width
        for count in (1, 3):
            rows = np.zeros((count, width), dtype=np.uint8)
            rows[:] = np.frombuffer(data, dtype=np.uint8)
            assert up.push_rows(rows, np.arange(count), np.full(count, width))[0] == count
            up.lengths[(int(up.h[H_HEAD]) - 1) & (up.slots - 1)] = width + 8  # the last one claims more than its row
            before = rig.sw.counters()["drops"][int(DropReason.MALFORMED)][0]
            out = rig.run_turn([], take=(0,))  # (the packets are on port 0's ring already)
            assert rig.sw.counters()["drops"][int(DropReason.MALFORMED)][0] == before + 1
            assert len(out[1]) == count - 1
            assert len(rig.run_turn([(0, data)])[1]) == 1  # the next turn: forwarded
        assert rig.sw.errors == 0
    finally:
        rig.close()
