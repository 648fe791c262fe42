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

from luwu.dataplane.p4runtime.entries import RuntimeConfig, StarSession, route_entry, star_program
from luwu.dataplane.protocol import DEFAULT_UDP_PORT, NODE

STAR_FILE = "star4.json"


@dataclass
class Host:
    rank: int  # worker rank, or NODE for the optimizer node
    port: int
    mac: str
    ip: str


def star_hosts(workers: int = 4) -> tuple[list[Host], Host]:
    hosts = [Host(r, r + 1, f"08:00:00:00:00:{r + 1:02x}", f"10.0.0.{r + 1}") for r in range(workers)]
    node = Host(NODE, workers + 1, f"08:00:00:00:00:{workers + 1:02x}", f"10.0.0.{workers + 1}")
    return hosts, node


STAR_SESSIONS = [  # (session, kind, pool_base, pool_size, epoch)
    (1, "collective", 0, 16, 1),
    (2, "collective", 16, 256, 2),
    (3, "node", 272, 256, 3),
]
STAR_GROUP = 1


def star_runtime(workers: int = 4, sessions: list[tuple] | None = None, udp_port: int = DEFAULT_UDP_PORT,
                 group: int = STAR_GROUP) -> RuntimeConfig:
    """The runtime config of a one-switch star (see the module docstring)."""
    hosts, node = star_hosts(workers)
    by_port = {h.port: h for h in hosts + [node]}
    star = [StarSession(sid, base, size, epoch, up_port=node.port if kind == "node" else 0)
            for sid, kind, base, size, epoch in sessions or STAR_SESSIONS]
    cfg = star_program(workers, star, worker_port=lambda r: hosts[r].port, group=group,
                       endpoint=lambda dst, port: (by_port[port].mac, by_port[port].ip, udp_port))
    for h in hosts + [node]:
        cfg.table_entries.append(route_entry(h.ip, 32, port=h.port, dst_mac=h.mac))
    return cfg
