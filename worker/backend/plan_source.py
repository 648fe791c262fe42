"""Where a rank's endpoint plan comes from: the embedded launcher, a plan file, or the controller.

* embedded (default, nothing configured): rank 0 starts the software switch in a child process
  (`LoopbackSwitch`, a child process launched first thing by `prestart_switch`, before the plan
  is built) and publishes the `StarPlan`, with the bound switch ports, through the c10d
  store; the other ranks read it from there.
* plan file (`LUWU_PLAN`): a `StarPlan` JSON of a switch someone started separately, or this
  rank's `EndpointPlan` (`{rank}` in the path: one file per rank), e.g. on an emulated network.
* controller (`LUWU_CONTROLLER=host:port`, `LUWU_JOB`, `LUWU_TOKEN`): `plan_from_controller`
  joins the job with JoinJob and gets this rank's plan.

Every source returns a `PlanLease`: the plan, and what to tell the user to check when the
switch does not answer; a controller's lease also holds the `ControllerWatch` that warns, naming
the controller, when it dies (the job goes on without it: docs/protocol.md 7.5).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from luwu.dataplane.loopback.launch import LoopbackSwitch
from luwu.dataplane.session import EndpointPlan

from .config import BackendConfig

if TYPE_CHECKING:  # imported where used: the controller's client (grpc) is needed only in controller mode
    from luwu.controller.watch import ControllerWatch
# the star's plan (dataplane/loopback/plan.py: table entries, ~10 ms of CPU) too: init_process_group
# only launches the switch process (prestart_switch) before returning

PLAN_KEY = "luwu/plan"
CLOSED_KEY = "luwu/closed/{rank}"
_switch_process: LoopbackSwitch | None = None  # the first embedded switch this process started: later groups'
# switches run in its process (no new process per new_group)
_prestarted: set[str] = set()  # work dirs whose switch process was launched and not yet taken (a deferred
# start-up takes it later: a group created meanwhile must not launch a second one)


@dataclass
class PlanLease:
    plan: EndpointPlan
    source: str  # one line: where the plan came from
    hint: str  # what to check when the switch does not answer (a sentence, ending in . or ?)
    switch: LoopbackSwitch | None = None  # the switch this rank started (embedded rank 0)
    local_size: int = 1  # >1: a rail-only plan, allreduce hierarchical over this many ranks per server
    watch: ControllerWatch | None = None  # controller mode: the ControllerWatch on the job's controller (controller/watch.py)

    def controller_note(self) -> str:
        """' ' + a sentence on a lost controller, for error messages ('' when none is lost)."""
        note = self.watch.describe() if self.watch is not None else ""
        return f" {note}" if note else ""

    @property
    def switch_address(self) -> str:
        return _switch_name(self.plan)


def _switch_name(plan: EndpointPlan) -> str:
    # imported here: importing this module must not load the engine package (startup.py launches the
    # switch process before that import)
    from luwu.dataplane.engine.transport import switch_name

    return switch_name(plan.wiring)


def obtain_plan(store, rank: int, world_size: int, timeout: timedelta, cfg: BackendConfig, workdir: str) -> PlanLease:
    if cfg.controller:
        return plan_from_controller(rank, world_size, cfg)
    if cfg.plan_file:
        return plan_from_file(rank, world_size, cfg.plan_file, cfg.local_world_size)
    return embedded_plan(store, rank, world_size, timeout, cfg, workdir)


# -- embedded ------------------------------------------------------------------------------------
def _switch_log(workdir: str) -> str:
    return os.path.join(workdir, "switch.log")


def prestart_switch(rank: int, cfg: BackendConfig, workdir: str) -> None:
    """Rank 0 of an embedded plan launches its switch process before anything else, so that the
    process's start-up (interpreter, imports, compiled kernels: most of init_process_group's time
    on a small host) overlaps the rest of the group's creation; `embedded_plan` then hands it the
    plan. Nothing when this process already runs a switch process (new_group adds a switch to it)."""
    if rank != 0 or cfg.controller or cfg.plan_file:
        return
    if (_switch_process is not None and _switch_process.alive()) or _prestarted - {workdir}:
        return  # later groups' switches run in the first one's process
    _prestarted.add(workdir)
    LoopbackSwitch.prestart(_switch_log(workdir))


def discard_prestarted_switch(workdir: str) -> None:
    """Stop a switch process `prestart_switch` launched that no switch took (set-up failed first)."""
    _prestarted.discard(workdir)
    LoopbackSwitch.discard_prestarted(_switch_log(workdir))


def embedded_plan(store, rank: int, world_size: int, timeout: timedelta, cfg: BackendConfig,
                  workdir: str) -> PlanLease:
    from luwu.dataplane.loopback.plan import StarPlan, plan_from_json, plan_to_json

    if rank == 0:
        global _switch_process
        try:
            star = StarPlan(workers=world_size, mode=cfg.packet_mode)
            owner = _switch_process if _switch_process is not None and _switch_process.alive() else None
            host = LoopbackSwitch(star, process=True, log_path=_switch_log(workdir), host=owner).start()
            if owner is None:
                _switch_process = host
            _prestarted.discard(workdir)
        except Exception as e:
            store.set(PLAN_KEY, json.dumps({"error": f"rank 0 could not start the luwu switch: {e}"}))
            raise
        store.set(PLAN_KEY, json.dumps({"plan": json.loads(plan_to_json(star)), "log": host.log_path}))
        log = host.log_path
    else:
        try:
            store.wait([PLAN_KEY], timeout)
            raw = json.loads(store.get(PLAN_KEY))
        except Exception as e:  # the store's own error names only the key
            raise RuntimeError(f"rank {rank} waited {timeout} for rank 0 to publish the luwu switch plan through the "
                               f"c10d store and got: {e}. Check that rank 0 is running and reached "
                               f"init_process_group('luwu').") from e
        if "error" in raw:
            raise RuntimeError(raw["error"])
        star = plan_from_json(raw["plan"])
        host, log = None, raw["log"]
        if star.workers != world_size:
            raise RuntimeError(f"the luwu plan in the store is for {star.workers} workers but this group has "
                               f"{world_size}: a stale key from an earlier run in the same store?")
    addr = _switch_name(star.worker_plan(rank))
    who = f"pid {host.pid}, " if host is not None else ""
    hint = (f"the embedded software switch at {addr} ({who}a child process of rank 0; its log: {log}): is it, "
            "and rank 0, still running?")
    return PlanLease(star.worker_plan(rank), "embedded switch started by rank 0", hint, switch=host)


def release_plan(store, lease: PlanLease, rank: int, world_size: int, wait: float) -> None:
    """Every rank says it has closed; the rank that started the embedded switch keeps it up until all
    have (or `wait` s passed: a rank that died never says so), then stops it."""
    if lease.watch is not None:
        lease.watch.stop()
    try:
        store.set(CLOSED_KEY.format(rank=rank), "1")
    except Exception:  # noqa: BLE001 - the store may already be gone at interpreter exit
        pass
    if lease.switch is None:
        return
    keys = [CLOSED_KEY.format(rank=r) for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=wait))
        for key in keys + [PLAN_KEY]:
            store.delete_key(key)
    except Exception:  # noqa: BLE001 - a rank that died never closes; stop the switch anyway
        pass
    lease.switch.stop()


# -- plan file -------------------------------------------------------------------------------------
def plan_from_file(rank: int, world_size: int, path: str, local_world_size: int = 1) -> PlanLease:
    """LUWU_PLAN: a StarPlan (every rank's plan, of a loopback switch), or this rank's own
    EndpointPlan (e.g. from a planner, for a switch on a real or emulated network); a `{rank}` in the
    path is replaced by the rank, so each rank can have its own file."""
    from luwu.dataplane.loopback.plan import plan_from_json

    path = path.replace("{rank}", str(rank))
    try:
        with open(path) as f:
            text = f.read()
        if "wiring" in json.loads(text):
            return _endpoint_plan_file(rank, world_size, path, EndpointPlan.from_json(text), local_world_size)
        star = plan_from_json(text)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"LUWU_PLAN={path}: cannot read a StarPlan or an EndpointPlan JSON from it ({e})") from e
    if star.workers != world_size:
        raise ValueError(f"LUWU_PLAN={path} plans {star.workers} workers but the process group has {world_size}")
    missing = [p for p in star.ports if p not in star.switch_ports]
    if missing:
        raise ValueError(f"LUWU_PLAN={path}: switch_ports has no address for switch port(s) {missing}")
    unbound = [p for p in star.ports if p not in star.endpoints] if star.transport == "udp" else []
    if unbound:  # the switch accepts a UDP port's traffic only from the address its plan gave the endpoint
        raise ValueError(f"LUWU_PLAN={path}: endpoints has no address for switch port(s) {unbound}; write the plan "
                         "after its switch started (plan_to_json of the StarPlan its LoopbackSwitch ran)")
    return PlanLease(star.worker_plan(rank), f"plan file {path}",
                     f"the software switch named in LUWU_PLAN={path}: is it running, at those ports?")


def _endpoint_plan_file(rank: int, world_size: int, path: str, plan: EndpointPlan,
                        local_world_size: int) -> PlanLease:
    if plan.wiring.rank != rank:
        raise ValueError(f"LUWU_PLAN={path} is the plan of rank {plan.wiring.rank}, not of rank {rank} (put {{rank}} "
                         "in the path to give each rank its own file)")
    local = check_covers_group(plan, world_size, f"LUWU_PLAN={path}", local_world_size)
    return PlanLease(plan, f"plan file {path}",
                     f"the switch {_switch_name(plan)} that LUWU_PLAN={path} names: is it running and programmed "
                     "with this job's plan?", local_size=local)


# -- controller --------------------------------------------------------------------------------------
def plan_from_controller(rank: int, world_size: int, cfg: BackendConfig) -> PlanLease:
    """Join the controller's job `LUWU_JOB` as `rank` and return this rank's endpoint plan."""
    try:
        from luwu.controller.client import ControllerClient
    except ImportError as e:
        raise RuntimeError(f"LUWU_CONTROLLER={cfg.controller} is set but luwu.controller.client cannot be imported "
                           f"({e}); unset LUWU_CONTROLLER to use the embedded switch") from e
    if not hasattr(ControllerClient, "join_job"):
        raise RuntimeError("LUWU_CONTROLLER is set but this luwu.controller.client has no join_job call yet; "
                           "unset LUWU_CONTROLLER to use the embedded switch")
    if not cfg.job:
        raise ValueError(f"LUWU_CONTROLLER={cfg.controller} is set but LUWU_JOB is not: set it to the job id "
                         "the controller gave at CreateJob (and LUWU_TOKEN to the job token)")
    from luwu.controller.watch import ControllerWatch, lost_controller

    lost = lost_controller(cfg.controller)
    if lost is not None:  # a group of this process already found it dead: say so now, not after an RPC timeout
        raise lost.error(f"joining job {cfg.job} (a new luwu process group)")
    from luwu.dataplane.loopback.plan import free_udp_port

    port = free_udp_port(cfg.endpoint_host)
    endpoint = f"{cfg.endpoint_host}:{port}"
    with ControllerClient(cfg.controller) as client:
        plan, info = client.join_job(cfg.job, rank, endpoint)
    workers = info.get("num_workers", world_size)
    if workers != world_size:
        raise RuntimeError(f"controller job {cfg.job} has {workers} workers but the process group has {world_size}")
    local = check_covers_group(plan, world_size, f"controller job {cfg.job}", cfg.local_world_size)
    if tuple(plan.wiring.local) != (cfg.endpoint_host, port):
        plan.wiring.local = (cfg.endpoint_host, port)
    # the job runs without its controller; the watch names a dead one (a warning) within seconds
    watch = ControllerWatch(cfg.controller, cfg.job, client.token)
    return PlanLease(plan, f"controller {cfg.controller}, job {cfg.job}",
                     f"LUWU_CONTROLLER={cfg.controller} and job {cfg.job}: `luwu-ctl jobs`, and the health and "
                     "counters of the job's switches there.", watch=watch, local_size=local)


def check_covers_group(plan: EndpointPlan, world_size: int, source: str, local_world_size: int = 1) -> int:
    """How this rank's collectives span the group: 1 when every collective session sums all ranks;
    `local_world_size` (K) for a rail-only plan whose sessions each sum world_size / K ranks, one per
    server (rail k holds local rank k of every server; hierarchy.py). Any other plan is refused:
    the backend would return a partial sum as if it were the whole one."""
    sizes = {s.num_workers for s in plan.sessions if s.kind == "collective"}
    if sizes <= {world_size}:
        return 1
    k = local_world_size
    if k > 1 and world_size % k == 0 and sizes == {world_size // k}:
        return k
    short = min(sizes)
    hint = (f"LOCAL_WORLD_SIZE={k} does not make one rail per server (sessions sum {short} ranks, "
            f"{world_size} / {k} = {world_size / k:g})" if k > 1 else
            "for a rail-only plan set LOCAL_WORLD_SIZE to the ranks per server (torchrun does) so allreduce goes "
            "hierarchical, or plan the job on a star or multi-rack topology")
    raise RuntimeError(f"{source}: a collective session sums {short} of the group's {world_size} ranks (a rail-only "
                       f"or otherwise partitioned plan); {hint}")


def default_workdir(cfg: BackendConfig, rank: int) -> str:
    import tempfile

    base = cfg.workdir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"luwu-rank{rank}-", dir=base)
