"""Programs switches over P4Runtime with finsy: one code path for BMv2 and the software switch.

`program(target, program)` connects (device id from the registration: BMv2's is 0, and finsy's
default 1 fails with a bare cancellation), sets the forwarding pipeline unless the switch
already runs it (finsy compares cookies, so a reconnecting controller does not wipe a
programmed switch), reconciles the managed tables (`sessions`, `workers`, `endpoints`) and the
multicast groups with the desired program by reading them first and writing only the
difference (delete, modify, insert), then reads everything back and checks it. So the same
call creates, updates and idempotently re-applies a switch's state, and, run periodically
(ControllerCore.check_drift), finds and repairs drift: entries someone else changed, deleted or
added. The drop simulators and `ipv4_lpm` are managed too (their desired entries are the loss
and the static IPv4 routes the switch declared at registration), so a stray 100% drop rule or a
stray route does not survive, and a declared route deleted by someone else comes back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

from finsy import (
    P4ClientError,
    P4CounterEntry,
    P4MulticastGroupEntry,
    P4TableAction,
    P4TableEntry,
    P4TableMatch,
    Switch,
    SwitchOptions,
)
from finsy.p4entity import P4Replica, encode_updates
from finsy.proto import p4r

from luwu.dataplane.p4runtime.audit import AuditLog, describe_update
from luwu.dataplane.p4runtime.credentials import SwitchTls, switch_credentials
from luwu.dataplane.p4runtime.entries import TableEntry, multicast_group

from .plan import SwitchProgram

MANAGED_TABLES = ("sessions", "workers", "child_ports", "endpoints", "ingress_drop_sim", "egress_drop_sim", "ipv4_lpm")
WRITE_BATCH = 500  # updates per WriteRequest
COUNTER_NAMES = ("drops", "events", "rx_types", "session_packets")



class _FinsyFailures(logging.Handler):
    """Keeps finsy's task failures: a failing pipeline step reaches us only as a bare cancellation,
    while finsy logs the real exception (at CRITICAL, naming the switch) -- we report that instead."""

    def __init__(self):
        super().__init__(logging.CRITICAL)
        self.last: dict[str, BaseException] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            text = record.getMessage()
            self.last[text.split("fy:", 1)[-1].split("|", 1)[0]] = record.exc_info[1]


_FAILURES = _FinsyFailures()
_finsy_log = logging.getLogger("finsy")
_finsy_log.setLevel(logging.CRITICAL)  # finsy narrates every connect; ProgramError reports the failures
_finsy_log.propagate = False
_finsy_log.addHandler(_FAILURES)


class ProgramError(RuntimeError):
    """A switch could not be programmed or read; the message names the switch and the cause."""


@dataclass
class SwitchTarget:
    name: str
    address: str
    device_id: int
    target: str = "software"  # "software" | "bmv2" | "tofino"
    lanes: int = 0
    slots: int = 0
    token: str = ""  # the switch's P4Runtime bearer token (dataplane/p4runtime/credentials.py)


class SwitchProgrammer:
    """Programs and reads switches over P4Runtime. With `audit` (dataplane/p4runtime/audit.py AuditLog) every
    update it writes is logged with the switch and its result, as the switch's own log does."""

    def __init__(self, p4info: Path, device_config: Callable[[SwitchTarget], bytes], timeout: float = 20.0,
                 tls: SwitchTls | None = None, audit: AuditLog | None = None):
        self.p4info = Path(p4info)
        self.tls = tls
        self.audit = audit
        self.device_config = device_config
        self.timeout = timeout
        if not self.p4info.exists():
            raise FileNotFoundError(f"P4Info {self.p4info} not found: run `luwu p4 generate` or pass --p4info")

    # -- connection -----------------------------------------------------------------------------
    async def _run(self, target: SwitchTarget, what: str, body):
        try:
            blob = self.device_config(target)
        except (OSError, ValueError) as exc:
            raise ProgramError(f"switch {target.name}: no device config for target {target.target!r}: {exc}") from exc
        opts = SwitchOptions(p4info=self.p4info, p4blob=blob, device_id=target.device_id,
                             channel_credentials=switch_credentials(target.address, target.token, self.tls))
        _FAILURES.last.pop(target.name, None)
        try:
            async with asyncio.timeout(self.timeout):
                async with Switch(target.name, target.address, opts) as sw:
                    return await body(sw)
        except ProgramError:
            raise
        except TimeoutError as exc:
            raise ProgramError(f"switch {target.name} ({target.address}): {what} timed out after {self.timeout} s "
                               "(is its P4Runtime server up, and is the device id right?)") from exc
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            if isinstance(exc, asyncio.CancelledError) and target.name in _FAILURES.last:
                exc = _FAILURES.last.pop(target.name)  # the cause behind finsy's cancellation
            raise ProgramError(f"switch {target.name} ({target.address}): {what} failed: "
                               f"{type(exc).__name__}: {exc}") from exc

    # -- programming ----------------------------------------------------------------------------
    async def program(self, target: SwitchTarget, program: SwitchProgram,
                      report: dict[str, list[str]] | None = None) -> dict[str, int]:
        """Make the switch hold exactly `program` in the managed tables and groups; return counts.

        `report`, when given, receives what was changed: {"deleted"|"modified"|"inserted": [table
        names], "groups": [group ids]} (one item per update)."""

        async def body(sw: Switch) -> dict[str, int]:
            schema = sw.p4info
            desired = {}
            for e in program.entries:
                try:
                    entity = _entity(e)
                    desired[_key(entity.encode_entry(schema))] = entity
                except (ValueError, KeyError) as exc:
                    raise ProgramError(f"switch {target.name}: entry {e} does not fit the P4Info: {exc}") from exc
            want_groups = {g.multicast_group_id: sorted(g.pairs()) for g in program.groups}
            current, groups = await _read_state(sw)
            counts = {"deleted": 0, "modified": 0, "inserted": 0, "groups": 0}
            deletes = [-entity for k, entity in current.items() if k not in desired]
            modifies = [~desired[k] for k in desired if k in current and _value(current[k], schema) !=
                        _value(desired[k], schema)]
            inserts = [+desired[k] for k in desired if k not in current]
            group_ops = [-P4MulticastGroupEntry(g) for g in groups if g not in want_groups]
            for g, reps in want_groups.items():
                group = P4MulticastGroupEntry(g, replicas=[P4Replica(p, instance=i) for p, i in reps])
                if g not in groups:
                    group_ops.append(+group)
                elif groups[g] != reps:
                    group_ops.append(~group)
            for batch in (deletes, group_ops, modifies, inserts):
                for i in range(0, len(batch), WRITE_BATCH):
                    await self._write(sw, target, batch[i:i + WRITE_BATCH])
            counts.update(deleted=len(deletes), modified=len(modifies), inserted=len(inserts), groups=len(group_ops))
            if report is not None:
                for kind, batch in (("deleted", deletes), ("modified", modifies), ("inserted", inserts)):
                    report[kind] = [_table_name(e, schema) for e in batch]
                report["groups"] = [str(e.multicast_group_id) for e in group_ops]
            after, after_groups = await _read_state(sw)
            bad = [k for k in desired if k not in after or _value(after[k], schema) != _value(desired[k], schema)]
            extra = [k for k in after if k not in desired]
            if bad or extra or after_groups != want_groups:
                raise ProgramError(f"switch {target.name}: read-back differs after programming: {len(bad)} entries "
                                   f"missing or different, {len(extra)} unexpected, groups "
                                   f"{'match' if after_groups == want_groups else 'differ'}")
            return counts

        return await self._run(target, "programming", body)

    async def _write(self, sw: Switch, target: SwitchTarget, batch: list) -> None:
        """`sw.write(batch)`, each update logged to the audit log with its result: OK, the switch's
        error for that update, or the error of the whole request."""
        if self.audit is None:
            await sw.write(batch)
            return
        updates = [u for u in encode_updates(batch, sw.p4info) if isinstance(u, p4r.Update)]
        results = ["OK"] * len(updates)
        try:
            await sw.write(batch)
        except P4ClientError as exc:
            for i in range(len(updates)):
                err = exc.details.get(i)
                results[i] = f"{err.canonical_code.name}: {err.message}" if err is not None else \
                    ("OK" if exc.details else f"{exc.code.name}: {exc.message}")
            raise
        except BaseException as exc:
            results = [f"{type(exc).__name__}: {exc}"] * len(updates)
            raise
        finally:
            who = {"identity": "luwu controller", "to": f"{target.name} ({target.address}, device {target.device_id})"}
            for update, result in zip(updates, results):
                self.audit.record(who, {"rpc": "Write", "switch": target.name, **describe_update(update, sw.p4info)},
                                  result)

    async def read_program(self, target: SwitchTarget) -> SwitchProgram:
        """What the switch holds in the managed tables and groups, as a SwitchProgram."""

        async def body(sw: Switch) -> SwitchProgram:
            current, groups = await _read_state(sw)
            entries = []
            for entity in current.values():
                match = {k: (list(v) if isinstance(v, tuple) else v) for k, v in (entity.match or {}).items()}
                if not isinstance(entity.action, P4TableAction):  # the managed tables have direct actions only
                    raise ProgramError(f"switch {target.name}: table {entity.table_id} holds an entry without a "
                                       f"direct action ({entity.action!r}); luwu does not manage it")
                entries.append(TableEntry(entity.table_id, match, entity.action.name, dict(entity.action.args)))
            return SwitchProgram(target.name, entries, [multicast_group(g, r) for g, r in sorted(groups.items())])

        return await self._run(target, "reading tables", body)

    async def read_counters(self, target: SwitchTarget) -> dict[str, dict[int, tuple[int, int]]]:
        async def body(sw: Switch) -> dict[str, dict[int, tuple[int, int]]]:
            # Counters are summed by their last name component: a program may count drops in
            # ingress and egress (LuwuIngress.drops, LuwuEgress.drops).
            out: dict[str, dict[int, tuple[int, int]]] = {}
            for counter in sw.p4info.counters:
                short = counter.name.rsplit(".", 1)[-1]
                if short not in COUNTER_NAMES:
                    continue
                values = out.setdefault(short, {})
                async for c in _read(sw, [P4CounterEntry(counter.name)]):
                    if c.index is None:  # a wildcard read answers per index; never file counts under None
                        raise ProgramError(f"switch {target.name}: counter {counter.name} read back without an index")
                    if c.packet_count or c.byte_count:
                        p, b = values.get(c.index, (0, 0))
                        values[c.index] = (p + c.packet_count, b + c.byte_count)
            return out

        return await self._run(target, "reading counters", body)


_E = TypeVar("_E")


def _read(sw: Switch, entities: list[_E]) -> AsyncIterator[_E]:
    """`sw.read(entities)`, typed: finsy declares its overloads `async def -> AsyncGenerator`, which
    types them as coroutines, while the implementation is an async generator (hence the cast)."""
    return cast(AsyncIterator[_E], sw.read(entities))


def _replica(r: int | tuple[int, int] | P4Replica) -> tuple[int, int]:
    """A replica read back, as (port, instance); finsy gives a P4Replica or a bare port."""
    if isinstance(r, P4Replica):
        return r.port, r.instance
    return r if isinstance(r, tuple) else (int(r), 0)


def _entity(e: TableEntry) -> P4TableEntry:
    match = P4TableMatch({k: tuple(v) if isinstance(v, list) else v for k, v in e.match.items()})
    return P4TableEntry(e.table, match=match, action=P4TableAction(e.action_name, **e.action_params))


def _table_name(entity: P4TableEntry, schema) -> str:
    return schema.tables[entity.table_id].alias


def _key(te) -> tuple:
    return (te.table_id, tuple(sorted((m.field_id, m.SerializeToString(deterministic=True)) for m in te.match)))


def _value(entity: P4TableEntry, schema) -> tuple:
    """The action and its params in a canonical order (params are keyed by id, not listed order)."""
    action = entity.encode_entry(schema).action.action
    return action.action_id, tuple(sorted((p.param_id, p.value) for p in action.params))


async def _read_state(sw: Switch) -> tuple[dict[tuple, P4TableEntry], dict[int, list[tuple[int, int]]]]:
    schema = sw.p4info
    current: dict[tuple, P4TableEntry] = {}
    groups: dict[int, list[tuple[int, int]]] = {}
    # one Read of every managed table and the groups: a switch answers it from one state, so a
    # batch another client writes meanwhile is seen whole or not at all (drift reports stay whole)
    wanted: list[P4TableEntry | P4MulticastGroupEntry] = [P4TableEntry(table) for table in MANAGED_TABLES]
    wanted.append(P4MulticastGroupEntry())
    async for entity in _read(sw, wanted):
        if isinstance(entity, P4TableEntry):
            current[_key(entity.encode_entry(schema))] = entity
        elif isinstance(entity, P4MulticastGroupEntry):
            reps = [_replica(r) for r in entity.replicas]
            groups[entity.multicast_group_id] = sorted(reps)
    return current, groups
