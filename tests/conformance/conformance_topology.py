"""The switch every conformance vector runs on: hosts, ports, sessions and its runtime JSON.

One switch with 64 lanes (tofino mode). Workers of ranks 0..3 on ports 1..4, the optimizer
node on port 5, a parent switch (for the ToR session) on port 6, a host no session knows on port
7, and a child switch of the node session on port 8 (a `child_ports` entry). Sessions:

  DATA   2  collective, 4 workers, pool [16, 272),  epoch 2, group 1       (ALLREDUCE at a root)
  META   1  collective, 4 workers, pool [0, 16),    epoch 1, group 1       (small pool: set reuse)
  NODE   3  node,       4 workers, pool [272, 528), epoch 3, group 1, up 5 (GRAD, PARAM, PULL, HB)
  ONE    4  collective, 1 worker,  pool [528, 532), epoch 4, group 2       (N = 1)
  TOR    5  UPSTREAM,   ranks 0,1, pool [600, 608), epoch 5, group 3, up 6, up_worker 7
  REUSE  6  collective, 4 workers, pool [16, 32),   epoch 6, group 1       (reuses DATA's slots)

The runtime JSON is built with luwu.dataplane.p4runtime.entries's builders and validated against the
committed P4Info, so the same file programs the software switch and BMv2.
"""

from __future__ import annotations

from dataclasses import dataclass

from luwu.dataplane.p4runtime.entries import (
    RuntimeConfig,
    TableEntry,
    child_port_entry,
    endpoint_entry,
    multicast_group,
    route_entry,
    session_entry,
    worker_entry,
)
from luwu.dataplane.protocol import DEFAULT_UDP_PORT, NODE, NextStep

LANES = 64
SLOTS = 1024  # slots per set of the switch under test (>= every pool end below)
UDP_PORT = DEFAULT_UDP_PORT
SWITCH_MAC = "02:00:00:00:00:fe"
SERVICE_IP = "10.0.0.254"  # where endpoints send luwu packets


@dataclass(frozen=True)
class Host:
    name: str
    rank: int  # worker rank; NODE for the optimizer node and the parent switch
    port: int
    mac: str
    ip: str


WORKERS = [Host(f"w{r}", r, r + 1, f"08:00:00:00:00:{r + 1:02x}", f"10.0.0.{r + 1}") for r in range(4)]
NODE_HOST = Host("node", NODE, 5, "08:00:00:00:00:05", "10.0.0.5")
PARENT = Host("parent", NODE, 6, "08:00:00:00:01:fe", "10.0.1.254")
OUTSIDER = Host("outsider", 9, 7, "08:00:00:00:00:09", "10.0.0.9")  # a host the sessions do not know
CHILD = Host("child", 12, 8, "08:00:00:00:02:fe", "10.0.2.254")  # a child switch of NODE_S; rank 12 is below it


@dataclass(frozen=True)
class Session:
    id: int
    members: tuple[Host, ...]  # contributors, rank = bit index
    pool_base: int
    pool_size: int
    epoch: int
    group: int
    next_step: int = int(NextStep.ROOT)
    up: Host | None = None  # the node (ROOT node session) or the parent (UPSTREAM)
    up_worker: int = 0

    @property
    def mask(self) -> int:
        return sum(1 << h.rank for h in self.members)

    def slot(self, seq: int) -> tuple[int, int]:
        """(slot, set) of sequence number `seq` (docs/protocol.md 4)."""
        shift = self.pool_size.bit_length() - 1
        return self.pool_base + (seq & (self.pool_size - 1)), (seq >> shift) & 1


META = Session(1, tuple(WORKERS), 0, 16, 1, 1)
DATA = Session(2, tuple(WORKERS), 16, 256, 2, 1)
NODE_S = Session(3, tuple(WORKERS), 272, 256, 3, 1, up=NODE_HOST)
ONE = Session(4, (WORKERS[0],), 528, 4, 4, 2)
TOR = Session(5, tuple(WORKERS[:2]), 600, 8, 5, 3, next_step=int(NextStep.UPSTREAM), up=PARENT, up_worker=7)
REUSE = Session(6, tuple(WORKERS), 16, 16, 6, 1)
SESSIONS = (META, DATA, NODE_S, ONE, TOR, REUSE)
GROUPS = {1: tuple(WORKERS), 2: (WORKERS[0],), 3: tuple(WORKERS[:2])}


def base_runtime() -> RuntimeConfig:
    cfg = RuntimeConfig()
    for s in SESSIONS:
        cfg.table_entries.append(session_entry(
            s.id, pool_base=s.pool_base, pool_size=s.pool_size, num_workers=len(s.members), worker_mask=s.mask,
            epoch=s.epoch, mcast_grp=s.group, next_step=s.next_step, up_port=s.up.port if s.up else 0,
            up_worker=s.up_worker))
        for h in s.members:
            cfg.table_entries.append(worker_entry(s.id, h.rank, worker_bit=1 << h.rank, port=h.port))
            cfg.table_entries.append(endpoint_entry(s.id, h.rank, dst_mac=h.mac, dst_ip=h.ip, dst_udp=UDP_PORT))
        if s.up:
            cfg.table_entries.append(endpoint_entry(s.id, NODE, dst_mac=s.up.mac, dst_ip=s.up.ip, dst_udp=UDP_PORT))
    cfg.table_entries.append(child_port_entry(NODE_S.id, CHILD.port))
    for h in [*WORKERS, NODE_HOST]:
        cfg.table_entries.append(route_entry(h.ip, 32, port=h.port, dst_mac=h.mac))
    for gid, members in GROUPS.items():
        cfg.multicast_group_entries.append(multicast_group(gid, [(h.port, h.rank) for h in members]))
    return cfg


def runtime_for(extra: list[TableEntry] = ()) -> dict:
    """The runtime JSON (as a dict) of the base setup plus a vector's extra entries."""
    cfg = base_runtime()
    cfg.table_entries.extend(extra)
    return cfg.to_dict()
