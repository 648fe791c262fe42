"""What is taken on each switch: session ids, slot ranges, worker ports.

Rebuilt from the live jobs' plans whenever the controller plans a new job (so a restarted
controller derives it from sqlite and never hands out a slot twice). A session's id and pool
must be free on every switch of its tree at once: the same id and range are used everywhere.
"""

from __future__ import annotations

from luwu.dataplane.protocol import MAX_SESSIONS


class SwitchUsage:
    def __init__(self, slots: dict[str, int]):
        self.slots = dict(slots)  # switch -> slots per set
        self.ids: dict[str, set[int]] = {name: set() for name in slots}
        self.pools: dict[str, list[tuple[int, int, str]]] = {name: [] for name in slots}  # (base, size, owner)
        self.ports: dict[str, dict[int, str]] = {name: {} for name in slots}  # port -> owner job

    @classmethod
    def from_plans(cls, slots: dict[str, int], plans) -> SwitchUsage:
        usage = cls(slots)
        for plan in plans:
            usage.add_plan(plan)
        return usage

    def add_plan(self, plan) -> None:
        for s in plan.sessions:
            self.take_session(s.switches, s.spec.session, s.spec.pool_base, s.spec.pool_size, plan.job_id,
                              fallback=s.fallback)
        for p in plan.placements:
            self.take_port(p.switch, p.port, plan.job_id)

    def _known(self, switch: str) -> None:
        if switch not in self.slots:
            raise KeyError(f"switch {switch!r} is not registered")

    # -- session ids --------------------------------------------------------------------------
    def free_session_id(self, switches: list[str]) -> int:
        for s in switches:
            self._known(s)
        taken = set().union(*(self.ids[s] for s in switches)) if switches else set()
        for sid in range(1, MAX_SESSIONS):
            if sid not in taken:
                return sid
        raise RuntimeError(f"no free session id on {', '.join(switches)}: all {MAX_SESSIONS - 1} are in use; "
                           "end a job first")

    # -- slot pools ---------------------------------------------------------------------------
    def free_pool(self, switches: list[str], size: int) -> int | None:
        """Lowest base aligned to `size` with [base, base+size) free on every switch, or None."""
        limit = min(self.slots[s] for s in switches)
        for base in range(0, limit - size + 1, size):
            if all(not _overlaps(base, size, self.pools[s]) for s in switches):
                return base
        return None

    def take_session(self, switches: list[str], sid: int, base: int, size: int, owner: str,
                     fallback: bool = False) -> None:
        for s in switches:
            self._known(s)
            if sid in self.ids[s]:
                raise ValueError(f"session id {sid} is already used on switch {s!r}")
            if not fallback and _overlaps(base, size, self.pools[s]):
                raise ValueError(f"slots [{base}, {base + size}) overlap another pool on switch {s!r}")
        for s in switches:
            self.ids[s].add(sid)
            if not fallback:
                self.pools[s].append((base, size, owner))

    def free_slots(self, switch: str) -> int:
        return self.slots[switch] - sum(size for _, size, _ in self.pools[switch])

    # -- worker ports -------------------------------------------------------------------------
    def port_owner(self, switch: str, port: int) -> str | None:
        return self.ports.get(switch, {}).get(port)

    def take_port(self, switch: str, port: int, owner: str) -> None:
        self._known(switch)
        current = self.ports[switch].get(port)
        if current is not None and current != owner:
            raise ValueError(f"port {port} of switch {switch!r} already holds a worker of job {current}")
        self.ports[switch][port] = owner


def _overlaps(base: int, size: int, ranges: list[tuple[int, int, str]]) -> bool:
    return any(base < b + s and b < base + size for b, s, _ in ranges)
