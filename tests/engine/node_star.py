"""What the push/pull tests share: a loopback switch with an optimizer node's engine serving a
parameter store (an `SgdParamStore`: plain SGD on the summed gradient) and one started engine per
worker, all real sockets or rings; the switch's counters are read once the engines are closed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from luwu.dataplane.engine import Engine
from luwu.dataplane.loopback import LoopbackSwitch, StarPlan
from luwu.mininet.paramstore import SgdParamStore


@dataclass
class NodeStar:
    switch: LoopbackSwitch
    node: Engine
    engines: list[Engine] = field(default_factory=list)
    counters: dict | None = None  # the switch's, after the engines closed (set on a clean exit)


@contextmanager
def node_star(plan: StarPlan, server: SgdParamStore, **switch_kw) -> Iterator[NodeStar]:
    """The switch of `plan` (LoopbackSwitch keywords: drop, seed, runtime), node 0's engine serving
    `server`, and every worker's engine, started; all closed on exit."""
    with LoopbackSwitch(plan, **switch_kw) as sw:
        node = Engine(plan.node_plan(0), provider=server, on_gradient=server.on_gradient)
        server.engine = node
        node.start()
        star = NodeStar(sw, node)
        try:
            star.engines = [Engine(plan.worker_plan(r)).start() for r in range(plan.workers)]
            yield star
        finally:
            for e in star.engines:
                e.close()
            node.close()
        star.counters = sw.counters()
