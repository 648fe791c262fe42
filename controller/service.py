"""The `luwu.v1.Controller` gRPC service: authentication, request checks, replies; logic is in `core`.

Every method authenticates first (admin token, or the job's own token for the job-scoped
calls), validates its fields, then calls `ControllerCore`. Refusals are gRPC status codes with
a detail string that says what to fix; a refused request changes nothing. `grpc_surface.py`
registers it: undecodable requests answer INVALID_ARGUMENT and no detail echoes a large input.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
from typing import NoReturn

import grpc

from luwu.proto import controller_pb2 as pb
from luwu.proto import controller_pb2_grpc as pb_grpc

from .auth import Authenticator, AuthError, Caller
from .core import ControllerCore, ControllerError
from .job_spec import JobSpec
from .plan import JobPlan
from .store import JobRow, token_hash
from .top import snapshot as top_snapshot

# the installed distribution's version (one source: pyproject.toml); `luwu.__version__` is the
# application package's, and imports point down
_VERSION = importlib.metadata.version("luwu")

WATCH_POLL = 1.0  # seconds between liveness checks of an idle WatchJob stream


async def _abort(context, code: grpc.StatusCode, message: str) -> NoReturn:
    """`context.abort`, which always raises; said here because grpc ships no types for mypy."""
    await context.abort(code, message)
    raise AssertionError("grpc ServicerContext.abort returned")


class ControllerService(pb_grpc.ControllerServicer):
    def __init__(self, core: ControllerCore, auth: Authenticator):
        self.core = core
        self.auth = auth

    # -- envelope -------------------------------------------------------------------------------
    async def _caller(self, context, method: str, admin: bool = True) -> Caller:
        try:
            caller = self.auth.caller(context.invocation_metadata())
            if not caller.admin:
                known = any(r.token_sha256 == token_hash(caller.token) for r in self.core.store.jobs())
                if not known:
                    raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "unknown token: use the deployment's admin token "
                                                                     "or the token CreateJob returned")
                if admin:
                    self.auth.require_admin(caller, method)
            return caller
        except AuthError as exc:
            self.auth.refused(method, exc.code)
            await _abort(context, exc.code, exc.message)

    async def _job(self, context, method: str, job_id: str) -> JobRow:
        return (await self._job_caller(context, method, job_id))[0]

    async def _job_caller(self, context, method: str, job_id: str) -> tuple[JobRow, Caller]:
        caller = await self._caller(context, method, admin=False)
        if not job_id:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{method}: job_id is empty")
        row = self.core.store.job(job_id)
        if row is None:
            code = grpc.StatusCode.NOT_FOUND if caller.admin else grpc.StatusCode.PERMISSION_DENIED
            if not caller.admin:
                self.auth.refused(method, code)
            await _abort(context, code, f"{method}: no job {job_id!r} visible to this token")
        try:
            self.auth.require_job(caller, method, row.token_sha256)
        except AuthError as exc:
            self.auth.refused(method, exc.code)
            await _abort(context, exc.code, exc.message)
        return row, caller

    @staticmethod
    async def _run(context, coro):
        try:
            return await coro
        except ControllerError as exc:
            await _abort(context, exc.code, exc.message)

    # -- registrations --------------------------------------------------------------------------
    async def RegisterSwitch(self, request, context):
        await self._caller(context, "RegisterSwitch")
        message = await self._run(context, self.core.register_switch(request.switch))
        return pb.RegisterSwitchResponse(switch=self._switch(request.switch.name), message=message)

    async def DeregisterSwitch(self, request, context):
        await self._caller(context, "DeregisterSwitch")
        await self._run(context, self.core.deregister("switch", request.name))
        return pb.DeregisterResponse(removed=True, message=f"switch {request.name} deregistered")

    async def RegisterNode(self, request, context):
        await self._caller(context, "RegisterNode")
        message = await self._run(context, self.core.register_node(request.node))
        return pb.RegisterNodeResponse(node=self._node(request.node.name), message=message)

    async def DeregisterNode(self, request, context):
        await self._caller(context, "DeregisterNode")
        await self._run(context, self.core.deregister("node", request.name))
        return pb.DeregisterResponse(removed=True, message=f"node {request.name} deregistered")

    async def ListSwitches(self, request, context):
        await self._caller(context, "ListSwitches")
        return pb.ListSwitchesResponse(switches=[self._switch(n) for n in sorted(self.core.switches)])

    async def ListNodes(self, request, context):
        await self._caller(context, "ListNodes")
        return pb.ListNodesResponse(nodes=[self._node(n) for n in sorted(self.core.nodes)])

    async def DrainNode(self, request, context):
        await self._caller(context, "DrainNode")
        affected = await self._run(context, self.core.drain_node(request.name))
        return pb.DrainNodeResponse(node=self._node(request.name), affected_jobs=affected)

    def _switch(self, name: str) -> pb.Switch:
        out = pb.Switch()
        out.CopyFrom(self.core.switches[name])
        out.health = self.core.health.health("switch", name)
        out.last_seen = self.core.health.seen("switch", name)
        out.jobs.extend(r.job_id for r in self.core.jobs_on("switch", name))
        out.programmed = self.core.programmed.get(name, "")
        out.drift = self.core.drift.get(name, "")
        return out

    def _node(self, name: str) -> pb.Node:
        out = pb.Node()
        out.CopyFrom(self.core.nodes[name])
        out.health = self.core.health.health("node", name)
        out.last_seen = self.core.health.seen("node", name)
        out.drained = self.core.drained(name)
        out.jobs.extend(r.job_id for r in self.core.jobs_on("node", name))
        return out

    # -- jobs -----------------------------------------------------------------------------------
    def _job_proto(self, row: JobRow) -> pb.Job:
        spec = JobSpec.from_dict(row.spec)
        plan = JobPlan.from_json(row.plan)
        job = pb.Job(job_id=row.job_id, name=row.name, num_workers=spec.num_workers, packet_mode=spec.packet_mode,
                     num_nodes=spec.num_nodes, state=row.state, created=row.created,
                     joined_ranks=sorted(row.joined), switches=sorted(plan.programs), nodes=plan.nodes,
                     hints=pb.TopologyHints(layout=spec.layout, switches=spec.switches,
                                            workers_per_switch=spec.workers_per_switch),
                     pools=pb.PoolSizes(meta=spec.meta_pool, data=spec.data_pool, node=spec.node_pool),
                     optimizer=pb.OptimizerSpec(name=spec.optimizer.get("name", ""),
                                                params=spec.optimizer.get("params", {}),
                                                param_dtype=spec.optimizer.get("param_dtype", "")))
        job.layers.extend(pb.LayerSpec(layer_id=lid, numel=n) for lid, n in spec.layers)
        return job

    async def CreateJob(self, request, context):
        await self._caller(context, "CreateJob")
        row, token = await self._run(context, self.core.create_job(request.job))
        return pb.CreateJobResponse(job=self._job_proto(row), job_token=token)

    async def JoinJob(self, request, context):
        row, caller = await self._job_caller(context, "JoinJob", request.job_id)
        plan_json, job_json = await self._run(context, self.core.join_job(row, request.rank, request.endpoint_address,
                                                                          repoint=caller.admin))
        return pb.JoinJobResponse(endpoint_plan_json=plan_json, job_json=job_json)

    async def GetJob(self, request, context):
        row = await self._job(context, "GetJob", request.job_id)
        return self._job_proto(row)

    async def ListJobs(self, request, context):
        await self._caller(context, "ListJobs")
        return pb.ListJobsResponse(jobs=[self._job_proto(r) for r in self.core.store.jobs(request.include_ended)])

    async def EndJob(self, request, context):
        row = await self._job(context, "EndJob", request.job_id)
        row = await self._run(context, self.core.end_job(row))
        return pb.EndJobResponse(job=self._job_proto(row))

    async def GetPlan(self, request, context):
        row = await self._job(context, "GetPlan", request.job_id)
        plan = JobPlan.from_json(row.plan)
        return pb.GetPlanResponse(plan_json=row.plan, explanation="\n".join(plan.explanation))

    async def WatchJob(self, request, context):
        row = await self._job(context, "WatchJob", request.job_id)
        queue = self.core.events.subscribe(row.job_id)
        try:
            if request.include_past:
                for e in self.core.events.past(row.job_id):
                    yield _event(e)
            if row.ended is not None:
                return
            while True:
                try:
                    e = await asyncio.wait_for(queue.get(), WATCH_POLL)
                except asyncio.TimeoutError:
                    if context.done():
                        return
                    continue
                if e is None:
                    return
                yield _event(e)
        finally:
            self.core.events.unsubscribe(row.job_id, queue)

    # -- health, counters, status ---------------------------------------------------------------
    async def ReportHealth(self, request, context):
        await self._caller(context, "ReportHealth")
        await self._run(context, self.core.report_health(request.kind, request.name, dict(request.counters)))
        return pb.HealthAck(known=True, health_timeout=self.core.config.health_timeout)

    async def GetCounters(self, request, context):
        await self._caller(context, "GetCounters")
        switches = await self._run(context, self.core.counters(request.switch_name))
        return pb.GetCountersResponse(switches=switches)

    async def GetTop(self, request, context):
        """Every (or one) live job's per-rank counters, scraped now from its switches' metrics (top.py)."""
        if request.job_id:
            rows = [await self._job(context, "GetTop", request.job_id)]
        else:
            await self._caller(context, "GetTop")
            rows = self.core.live_jobs()
        plans = {r.job_id: JobPlan.from_json(r.plan) for r in rows}
        addresses = {n: s.metrics_address for n, s in self.core.switches.items()}
        result = await asyncio.to_thread(top_snapshot, plans, addresses)
        return pb.GetTopResponse(top_json=json.dumps(result, sort_keys=True))

    async def Status(self, request, context):
        await self._caller(context, "Status")
        core = self.core
        return pb.StatusResponse(
            version=_VERSION, switches=len(core.switches), nodes=len(core.nodes),
            switches_up=sum(core.health.health("switch", n) == "up" for n in core.switches),
            nodes_up=sum(core.health.health("node", n) == "up" for n in core.nodes),
            jobs_active=len(core.live_jobs()), uptime=core.health.clock() - core.started, db_path=core.store.path,
            epoch_counter=core.store.counter("epoch"))


def _event(e) -> pb.JobEvent:
    return pb.JobEvent(job_id=e.job_id, seq=e.seq, time=e.time, kind=e.kind, subject=e.subject, message=e.message)
