"""The example runtime configuration in `p4/runtime/`: a 4-worker star with one optimizer node.

One switch; workers of ranks 0..3 on ports 1..4 (h1..h4, 10.0.0.1..4), the optimizer node on
port 5 (h5, 10.0.0.5), Mininet-style MACs 08:00:00:00:00:0N. One job with three sessions:

  session 1  collective `meta` (exponent passes)   pool [0, 16)     epoch 1
  session 2  collective `data`                     pool [16, 272)   epoch 2
  session 3  node session of the optimizer node    pool [272, 528)  epoch 3, up_port 5

All three multicast on group 1 (the four workers, instance = rank). Every (session, rank)
has a `workers` and an `endpoints` entry; the node session also addresses NODE (0xFFFF).
Plain IPv4 between hosts goes through `ipv4_lpm`. `luwu p4 generate` writes the file, the
conformance suite and the BMv2 runner program switches from the same builder.
"""

from __future__ import annotations

from dataclasses import dataclass

from luwu.dataplane.protocol import DEFAULT_UDP_PORT, NODE, NextStep

from .runtime_config import (
    RuntimeConfig, endpoint_entry, multicast_group, route_entry, session_entry, worker_entry,
)

STAR_FILE = "star4.json"


@dataclass
class Host:
    rank: int  # worker rank, or NODE for the optimizer node
    port: int
    mac: str
    ip: str


@dataclass
class StarSession:
    session: int
    kind: str  # "collective" or "node"
    pool_base: int
    pool_size: int
    epoch: int


def star_hosts(workers: int = 4) -> tuple[list[Host], Host]:
    hosts = [Host(r, r + 1, f"08:00:00:00:00:{r + 1:02x}", f"10.0.0.{r + 1}") for r in range(workers)]
    node = Host(NODE, workers + 1, f"08:00:00:00:00:{workers + 1:02x}", f"10.0.0.{workers + 1}")
    return hosts, node


STAR_SESSIONS = [
    StarSession(1, "collective", 0, 16, 1),
    StarSession(2, "collective", 16, 256, 2),
    StarSession(3, "node", 272, 256, 3),
]
STAR_GROUP = 1


def star_runtime(workers: int = 4, sessions: list[StarSession] | None = None, udp_port: int = DEFAULT_UDP_PORT,
                 group: int = STAR_GROUP) -> RuntimeConfig:
    """The runtime config of a one-switch star (see the module docstring)."""
    hosts, node = star_hosts(workers)
    cfg = RuntimeConfig()
    mask = (1 << workers) - 1
    for s in sessions or STAR_SESSIONS:
        is_node = s.kind == "node"
        cfg.table_entries.append(session_entry(
            s.session, pool_base=s.pool_base, pool_size=s.pool_size, num_workers=workers, worker_mask=mask,
            epoch=s.epoch, mcast_grp=group, next_step=int(NextStep.ROOT),
            up_port=node.port if is_node else 0, up_worker=0))
        for h in hosts:
            cfg.table_entries.append(worker_entry(s.session, h.rank, worker_bit=1 << h.rank, port=h.port))
        for h in hosts + ([node] if is_node else []):
            cfg.table_entries.append(endpoint_entry(s.session, h.rank, dst_mac=h.mac, dst_ip=h.ip, dst_udp=udp_port))
    for h in hosts + [node]:
        cfg.table_entries.append(route_entry(h.ip, 32, port=h.port, dst_mac=h.mac))
    cfg.multicast_group_entries.append(multicast_group(group, [(h.port, h.rank) for h in hosts]))
    return cfg
