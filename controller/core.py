"""The controller's logic behind the gRPC surface: registrations, jobs, programming, health.

All state lives in the `StateStore`; in memory there are only caches of it (registrations),
liveness and the per-switch programming status. Every change runs under one asyncio lock, is
persisted first and then programmed, so a switch's desired state is always derivable from
sqlite: a restarted controller re-programs every switch from the live jobs (idempotently,
since programming reconciles) and a re-registering switch gets its entries back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable

import grpc

from luwu.dataplane.p4runtime import device_config_marker, switch_token
from luwu.dataplane.p4runtime.audit import AuditLog
from luwu.dataplane.p4runtime.credentials import SwitchTls
from luwu.dataplane.p4runtime.entries import TableEntry, drop_rate_entry, route_entry
from luwu.dataplane.protocol import DropReason, Event, MsgType
from luwu.proto import controller_pb2 as pb

from .addresses import check_endpoint_address
from .auth import new_token
from .config import ControllerConfig
from .events import JobEvents
from .health import HealthMonitor
from .job_spec import JobSpec
from .plan import JobPlan, SwitchProgram
from .planner import PlanError, Planner, ip_to_int
from .programmer import ProgramError, SwitchProgrammer, SwitchTarget
from .registry import build_topology, declared_routes, validate_node, validate_switch
from .store import JobRow, StateStore, token_hash
from .usage import SwitchUsage

LABELS = {"drops": DropReason, "events": Event, "rx_types": MsgType}


class ControllerError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class ControllerCore:
    def __init__(self, config: ControllerConfig, store: StateStore, programmer: SwitchProgrammer | None = None):
        self.config = config
        self.store = store
        tls = SwitchTls(config.switch_tls_ca, config.switch_tls_cert, config.switch_tls_key) \
            if config.switch_tls_ca else None
        audit = AuditLog(config.audit_log, {"controller": config.listen}) if config.audit_log else None
        self.programmer = programmer or SwitchProgrammer(config.p4info_path(), self._device_config,
                                                         config.program_timeout, tls, audit)
        self.planner = Planner(config)
        self.health = HealthMonitor(config.health_timeout)
        self.events = JobEvents(store)
        self.lock = asyncio.Lock()
        self.programmed: dict[str, str] = {}
        self.drift: dict[str, str] = {}  # switch -> "none" or the last drift found and repaired
        self.drift_repairs: dict[str, int] = {}  # switch -> read-back rounds that found and repaired drift
        # switch -> its tables held what the controller last wrote when it last looked; a read-back
        # round that fails (the switch busy, another client primary for a moment) leaves it as it was
        self.in_sync: dict[str, bool] = {}
        self.started = time.time()
        self.switches = {n: pb.Switch.FromString(r) for n, r in store.switches().items()}
        self.nodes = {n: pb.Node.FromString(r) for n, (r, _) in store.nodes().items()}
        for name in self.switches:
            self.health.track("switch", name)
        for name in self.nodes:
            self.health.track("node", name)

    def _device_config(self, target: SwitchTarget) -> bytes:
        if target.target == "software":
            return device_config_marker(target.lanes, target.slots, self.config.device_config_marker)
        if target.target == "bmv2":
            path = self.config.bmv2_json_path()
            if not path.exists():
                raise ValueError(f"BMv2 JSON {path} not found: run `luwu p4 build` or pass --bmv2-json")
            return path.read_bytes()
        raise ValueError(f"target {target.target!r} needs its compiled program: only software and bmv2 are "
                         "programmed by this controller")

    # -- helpers --------------------------------------------------------------------------------
    def live_jobs(self) -> list[JobRow]:
        return self.store.jobs(include_ended=False)

    def job_row(self, job_id: str) -> JobRow:
        row = self.store.job(job_id)
        if row is None:
            raise ControllerError(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}: `luwu-ctl jobs` lists them")
        return row

    def jobs_on(self, kind: str, name: str) -> list[JobRow]:
        out = []
        for row in self.live_jobs():
            plan = JobPlan.from_json(row.plan)
            if (kind == "switch" and name in plan.programs) or (kind == "node" and name in plan.nodes):
                out.append(row)
        return out

    def target(self, name: str) -> SwitchTarget:
        sw = self.switches[name]
        return SwitchTarget(name, sw.p4runtime_address, sw.device_id, sw.target, sw.lanes, sw.slots,
                            switch_token(self.config.admin_token, name) if self.config.admin_token else "")

    def desired(self, switch: str) -> SwitchProgram:
        merged = SwitchProgram(switch)
        record = self.switches.get(switch)
        if record is not None:
            merged.entries += declared_entries(record)
        for row in self.live_jobs():
            prog = JobPlan.from_json(row.plan).programs.get(switch)
            if prog:
                merged.entries += prog.entries
                merged.groups += prog.groups
        return merged

    async def program(self, switches: Iterable[str]) -> dict[str, str]:
        """Reconcile the given switches with the live jobs; {switch: error} for the failures."""
        names = sorted(set(switches))
        missing = [n for n in names if n not in self.switches]
        if missing:
            return dict.fromkeys(missing, "not registered")
        results = await asyncio.gather(*(self.programmer.program(self.target(n), self.desired(n)) for n in names),
                                       return_exceptions=True)
        errors = {}
        for name, res in zip(names, results):
            if isinstance(res, BaseException):
                errors[name] = str(res) if isinstance(res, ProgramError) else f"{type(res).__name__}: {res}"
                self.programmed[name] = errors[name]
                self.in_sync[name] = False
            else:
                self.programmed[name] = "ok"
                self.in_sync[name] = True
        return errors

    async def reconcile_all(self) -> dict[str, str]:
        async with self.lock:
            return await self.program(self.switches)

    # -- drift ----------------------------------------------------------------------------------
    async def check_drift(self) -> dict[str, str]:
        """One read-back round: reconcile every switch not known down; {switch: drift text} for the
        switches that held something other than what the controller last programmed (repaired now).

        Under the lock the desired state is what the last successful programming wrote, so any
        difference on a switch whose status was "ok" is drift: an operator's stray entry, a
        deleted or modified one, a lost multicast group."""
        found: dict[str, str] = {}
        async with self.lock:
            names = [n for n in sorted(self.switches) if self.health.health("switch", n) != "down"]
            reports: dict[str, dict[str, list[str]]] = {n: {} for n in names}
            results = await asyncio.gather(*(self.programmer.program(self.target(n), self.desired(n), reports[n])
                                             for n in names), return_exceptions=True)
            for name, res in zip(names, results):
                if isinstance(res, BaseException):
                    self.programmed[name] = str(res) if isinstance(res, ProgramError) else f"{type(res).__name__}: {res}"
                    continue
                was_ok = self.in_sync.get(name, False)
                self.programmed[name] = "ok"
                self.in_sync[name] = True
                self.drift.setdefault(name, "none")
                if was_ok and any(res.values()):
                    found[name] = self.drift[name] = _drift_text(reports[name])
                    self.drift_repairs[name] = self.drift_repairs.get(name, 0) + 1
                    for row in self.jobs_on("switch", name):
                        self.events.emit(row.job_id, "drift", name, f"switch {name}: {found[name]}")
        return found

    async def drift_loop(self) -> None:
        """check_drift every `reconcile_interval` seconds (not at all when it is 0)."""
        if not self.config.reconcile_interval:
            return
        while True:
            await asyncio.sleep(self.config.reconcile_interval)
            await self.check_drift()

    # -- registrations --------------------------------------------------------------------------
    async def register_switch(self, sw: pb.Switch) -> str:
        try:
            validate_switch(sw)
        except ValueError as exc:
            raise ControllerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        async with self.lock:
            old = self.switches.get(sw.name)
            if old is not None and (old.lanes, old.slots) != (sw.lanes, sw.slots) and self.jobs_on("switch", sw.name):
                raise ControllerError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"switch {sw.name} carries jobs planned for {old.lanes} lanes / {old.slots} "
                                      "slots: end them before changing its program")
            for row in self.jobs_on("switch", sw.name):
                prog = JobPlan.from_json(row.plan).programs[sw.name]
                clash = _collision(sw.name, declared_entries(sw), prog.entries)
                if clash:
                    raise ControllerError(grpc.StatusCode.FAILED_PRECONDITION, f"{clash} (job {row.job_id})")
            record = pb.Switch()
            record.CopyFrom(sw)
            for f in ("health", "last_seen", "jobs", "programmed"):
                record.ClearField(f)
            self.store.put_switch(sw.name, record.SerializeToString())
            self.switches[sw.name] = record
            self.health.track("switch", sw.name)
            self.health.report("switch", sw.name)
            errors = await self.program([sw.name])
        if errors:
            return f"registered; programming failed: {errors[sw.name]}"
        return "registered and programmed"

    async def deregister(self, kind: str, name: str) -> bool:
        async with self.lock:
            table = self.switches if kind == "switch" else self.nodes
            if name not in table:
                raise ControllerError(grpc.StatusCode.NOT_FOUND, f"no {kind} {name!r} is registered")
            busy = [r.job_id for r in self.jobs_on(kind, name)]
            if busy:
                raise ControllerError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"{kind} {name} serves job(s) {', '.join(busy)}: end them first")
            (self.store.delete_switch if kind == "switch" else self.store.delete_node)(name)
            del table[name]
            self.health.forget(kind, name)
            return True

    async def register_node(self, node: pb.Node) -> str:
        try:
            validate_node(node)
        except ValueError as exc:
            raise ControllerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        async with self.lock:
            record = pb.Node(name=node.name, data_address=node.data_address, capacity=node.capacity)
            self.store.put_node(node.name, record.SerializeToString())
            self.nodes[node.name] = record
            self.health.track("node", node.name)
            self.health.report("node", node.name)
        return "registered"

    async def drain_node(self, name: str) -> list[str]:
        async with self.lock:
            if name not in self.nodes:
                raise ControllerError(grpc.StatusCode.NOT_FOUND, f"no node {name!r} is registered")
            self.store.set_drained(name, True)
            affected = [r.job_id for r in self.jobs_on("node", name)]
            for job_id in affected:
                self.events.emit(job_id, "drained", name, f"node {name} is drained: no new job goes to it; this job "
                                                          "keeps it until it ends")
            return affected

    def drained(self, name: str) -> bool:
        return self.store.nodes().get(name, (b"", False))[1]

    # -- jobs -----------------------------------------------------------------------------------
    async def create_job(self, job: pb.Job) -> tuple[JobRow, str]:
        spec = JobSpec.from_proto(job)
        try:
            spec.validate()
        except ValueError as exc:
            raise ControllerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        async with self.lock:
            live = self.live_jobs()
            plans = [JobPlan.from_json(r.plan) for r in live]
            usage = SwitchUsage.from_plans({n: s.slots for n, s in self.switches.items()}, plans)
            load: dict[str, int] = {}
            for p in plans:
                for n in p.nodes:
                    load[n] = load.get(n, 0) + 1
            eligible = {n for n in self.nodes if not self.drained(n) and self.health.health("node", n) != "down"}
            job_id = f"{spec.name}-{self.store.next_job_number()}"
            try:
                plan = self.planner.plan(job_id, spec, build_topology(self.switches, self.nodes), usage,
                                         self.store.next_epoch, {n: v.capacity.params_per_second
                                                                 for n, v in self.nodes.items()},
                                         eligible, load, {n: v.data_address for n, v in self.nodes.items()})
            except PlanError as exc:
                raise ControllerError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
            for name, prog in sorted(plan.programs.items()):
                clash = _collision(name, declared_entries(self.switches[name]), prog.entries) \
                    if name in self.switches else ""
                if clash:
                    raise ControllerError(grpc.StatusCode.FAILED_PRECONDITION, f"job {spec.name}: {clash}")
            token = new_token()
            row = JobRow(job_id, spec.name, spec.to_dict(), plan.to_json(), pb.PLANNED, token_hash(token), time.time())
            self.store.put_job(row)  # persisted first: the switches' desired state includes it from now on
            errors = await self.program(plan.programs)
            if errors:
                self.store.db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
                await self.program(plan.programs)  # best effort: take the partial entries back out
                raise ControllerError(grpc.StatusCode.UNAVAILABLE, "cannot program the job's switches: "
                                      + "; ".join(f"{k}: {v}" for k, v in errors.items()))
            self.events.emit(job_id, "created", "", f"planned on {', '.join(sorted(plan.programs))}"
                             + (f"; nodes {', '.join(plan.nodes)}" if plan.nodes else ""))
            return row, token

    async def join_job(self, row: JobRow, rank: int, endpoint: str, repoint: bool = False) -> tuple[str, str]:
        """Join `rank` from `endpoint`; a rank that joined from elsewhere moves only with `repoint` (admin)."""
        if row.ended is not None:
            raise ControllerError(grpc.StatusCode.FAILED_PRECONDITION, f"job {row.job_id} has ended")
        if not 0 <= rank < row.spec["num_workers"]:
            raise ControllerError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"rank {rank} out of range 0..{row.spec['num_workers'] - 1} for job {row.job_id}")
        try:
            host, port = check_endpoint_address(endpoint)
        except ValueError as exc:
            raise ControllerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        async with self.lock:
            row = self.job_row(row.job_id)
            joined = row.joined.get(rank)
            if joined is not None and joined != endpoint and not repoint:
                # a job token must not move another rank's traffic (its sums) to an address of its choosing
                raise ControllerError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"rank {rank} of job {row.job_id} already joined from {joined}: a rank's "
                                      f"endpoint cannot be repointed to {endpoint} with the job token (rejoin from "
                                      f"{joined}, or an admin re-joins it)")
            plan = JobPlan.from_json(row.plan)
            wiring = plan.worker_wiring[rank]
            wiring.local = (host, port)
            placement = next(p for p in plan.placements if p.rank == rank)
            sids = {s.spec.session for s in plan.sessions if s.group == placement.group}
            for e in plan.programs[placement.switch].entries:
                if e.table == "endpoints" and e.match.get("dst") == rank and e.match.get("session") in sids:
                    e.action_params["dst_ip"] = ip_to_int(host)  # IPv4, checked above: stored as given
                    e.action_params["dst_udp"] = port
            previous = (row.plan, dict(row.joined), row.state)
            row.plan, row.joined[rank] = plan.to_json(), endpoint
            if len(row.joined) == row.spec["num_workers"] and row.state == pb.PLANNED:
                row.state = pb.RUNNING
            self.store.put_job(row)
            errors = await self.program([placement.switch])
            if errors:
                row.plan, row.joined, row.state = previous
                self.store.put_job(row)
                await self.program([placement.switch])
                raise ControllerError(grpc.StatusCode.UNAVAILABLE, f"cannot program switch {placement.switch} for "
                                                                   f"rank {rank}: {errors[placement.switch]}")
            self.events.emit(row.job_id, "joined", str(rank), f"rank {rank} joined from {endpoint}")
            if row.state == pb.RUNNING and previous[2] != pb.RUNNING:
                self.events.emit(row.job_id, "running", "", "every rank has joined")
        return plan.worker_plan(rank).to_json(), json.dumps(self.job_info(row, plan, rank))

    def job_info(self, row: JobRow, plan: JobPlan, rank: int) -> dict:
        group = plan.group_of(rank)
        return {"job_id": row.job_id, "name": row.name, "rank": rank, "num_workers": plan.num_workers,
                "group": group, "group_ranks": plan.groups[group], "packet_mode": row.spec["packet_mode"],
                "lanes": plan.lanes, "optimizer": row.spec["optimizer"], "layers": row.spec["layers"],
                "nodes": plan.nodes,
                "sessions": [{"session": s.spec.session, "kind": s.spec.kind, "purpose": s.spec.purpose,
                              "node": s.node, "group": s.group, "fallback": s.fallback} for s in plan.sessions],
                "shards": [vars(s) for s in plan.shards if s.group == group]}

    async def end_job(self, row: JobRow) -> JobRow:
        async with self.lock:
            row = self.job_row(row.job_id)
            if row.ended is not None:
                return row
            row.state, row.ended = pb.ENDED, time.time()
            self.store.put_job(row)
            errors = await self.program(JobPlan.from_json(row.plan).programs)
            note = "; switches not cleaned: " + "; ".join(f"{k}: {v}" for k, v in errors.items()) if errors else ""
            self.events.emit(row.job_id, "ended", "", "job ended" + note)
            self.events.close(row.job_id)
            return row

    # -- health ---------------------------------------------------------------------------------
    async def report_health(self, kind: str, name: str, counters: dict[str, int]) -> None:
        known = (self.switches if kind == "switch" else self.nodes if kind == "node" else None)
        if known is None:
            raise ControllerError(grpc.StatusCode.INVALID_ARGUMENT, f"health kind {kind!r} must be 'switch' or 'node'")
        if name not in known:
            raise ControllerError(grpc.StatusCode.NOT_FOUND, f"no {kind} {name!r} is registered: register it first")
        if self.health.report(kind, name, counters):
            await self._transition(kind, name, "up")

    async def _transition(self, kind: str, name: str, state: str) -> None:
        async with self.lock:
            for row in self.jobs_on(kind, name):
                self.events.emit(row.job_id, f"{kind}_{state}", name, f"{kind} {name} is {state}")
                if state == "down" and row.state != pb.DEGRADED:
                    row.state = pb.DEGRADED
                elif state == "up" and row.state == pb.DEGRADED and not self._any_down(row):
                    row.state = pb.RUNNING if len(row.joined) == row.spec["num_workers"] else pb.PLANNED
                self.store.put_job(row)
            if kind == "switch" and state == "up":
                await self.program([name])  # a switch that restarted gets its entries back

    def _any_down(self, row: JobRow) -> bool:
        plan = JobPlan.from_json(row.plan)
        return any(self.health.health("switch", s) == "down" for s in plan.programs) or \
            any(self.health.health("node", n) == "down" for n in plan.nodes)

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            for kind, name in self.health.sweep():
                await self._transition(kind, name, "down")

    # -- counters -------------------------------------------------------------------------------
    async def counters(self, name: str) -> list[pb.SwitchCounters]:
        names = [name] if name else sorted(self.switches)
        if name and name not in self.switches:
            raise ControllerError(grpc.StatusCode.NOT_FOUND, f"no switch {name!r} is registered")
        results = await asyncio.gather(*(self.programmer.read_counters(self.target(n)) for n in names),
                                       return_exceptions=True)
        out = []
        for n, res in zip(names, results):
            sc = pb.SwitchCounters(switch=n)
            if isinstance(res, BaseException):
                sc.error = str(res)
            else:
                for counter, values in sorted(res.items()):
                    for index, (packets, nbytes) in sorted(values.items()):
                        sc.values.add(counter=counter, index=index, label=_label(counter, index), packets=packets,
                                      bytes=nbytes)
            out.append(sc)
        return out


def declared_entries(record: pb.Switch) -> list[TableEntry]:
    """What the switch declared at registration, as the entries the controller keeps on it: the
    loss it simulates (drop_sim) and its static IPv4 routes (ipv4_lpm). Any other entry in those
    tables is drift."""
    entries = []
    for port in record.ports:
        for direction, threshold in (("ingress", port.ingress_drop_threshold),
                                     ("egress", port.egress_drop_threshold)):
            if threshold:
                entries.append(drop_rate_entry(direction, port.number, threshold=threshold))
    for net, port_number, mac in declared_routes(record):
        entries.append(route_entry(int(net.network_address), net.prefixlen, port=port_number,
                                   dst_mac=int(mac.replace(":", ""), 16)))
    return entries


def _collision(switch: str, declared: list[TableEntry], planned: list[TableEntry]) -> str:
    """'' or what a job's planned entries would overwrite of the switch's declared ones (a
    planned entry with the same table and match would silently replace a route or a drop rule)."""
    keys = {e.key(): e for e in declared}
    hits = [keys[e.key()] for e in planned if e.key() in keys]
    if not hits:
        return ""
    first = hits[0]
    return (f"switch {switch}: {len(hits)} planned entr{'y' if len(hits) == 1 else 'ies'} would replace what the "
            f"switch declared at registration ({first.table} {first.match})")


def _drift_text(report: dict[str, list[str]]) -> str:
    """'repaired at HH:MM:SS: 1 unexpected entry deleted (ingress_drop_sim); ...'"""
    parts = []
    for kind, one, many in (("deleted", "unexpected entry deleted", "unexpected entries deleted"),
                            ("modified", "changed entry restored", "changed entries restored"),
                            ("inserted", "missing entry re-inserted", "missing entries re-inserted"),
                            ("groups", "multicast group fixed", "multicast groups fixed")):
        items = report.get(kind, [])
        if items:
            parts.append(f"{len(items)} {one if len(items) == 1 else many} ({', '.join(sorted(set(items)))})")
    return f"repaired at {time.strftime('%H:%M:%S')}: " + "; ".join(parts)


def _label(counter: str, index: int) -> str:
    enum = LABELS.get(counter)
    if enum is None:
        return f"session {index}"
    try:
        return enum(index).name
    except ValueError:
        return str(index)
