"""Setting a model-in-network job up: rank 0 hands every optimizer node its units (the job's spec
and rank 0's initial parameters) over the node's control channel; then every rank waits at a
barrier before its first pull, so no worker asks a node for a layer it does not have yet; and at
close, before any engine stops, so no worker's last pulls stall: a node paces its parameter stream
by the heartbeats of all its workers (the switch takes their minimum), and a closed engine sends none.

The barrier is the c10d store when one is given (`store.add` + `store.wait`), otherwise a
one-element allreduce through the worker's engine (the job's collective session), which needs
nothing beyond the network itself.
"""

from __future__ import annotations

import numpy as np

from luwu.dataplane.optimizer.control import ControlClient
from luwu.dataplane.optimizer.spec import JobSpec, OptimizerSpec

from .units import Unit

BARRIER_KEY = "luwu/mnn/{job}/{what}"


def node_jobs(job_id: str, optimizer: OptimizerSpec, units: list[Unit], placement: dict[int, int],
              served_dtype: str) -> dict[int, JobSpec]:
    """One JobSpec per node index that serves at least one unit."""
    by_node: dict[int, list[Unit]] = {}
    for u in units:
        by_node.setdefault(placement[u.index], []).append(u)
    return {node: JobSpec(job_id, optimizer, [u.layer_spec() for u in us], served_dtype=served_dtype)
            for node, us in sorted(by_node.items())}


def hand_over(jobs: dict[int, JobSpec], sessions: dict[int, int], controls: list[str], contributors: int,
              initial: dict[int, dict[str, np.ndarray]], timeout: float, token: str = "") -> None:
    """Rank 0: give each node its job and the initial values of its units (`token`: the job's, for
    the nodes' control channels)."""
    for node, spec in jobs.items():
        if node >= len(controls) or not controls[node]:
            raise ValueError(f"rank 0 must reach optimizer node {node} to hand it the job: the network description "
                             f"lists control addresses for nodes 0..{len(controls) - 1} only")
        if node not in sessions:
            raise ValueError(f"optimizer node {node} has no node session in this worker's plan "
                             f"(sessions for nodes {sorted(sessions)})")
        mine = {ly.layer_id: initial[ly.layer_id] for ly in spec.layers}
        client = ControlClient(controls[node], timeout=timeout, token=token, job_id=spec.job_id)
        try:
            client.add_job(sessions[node], contributors, spec.to_json(), initial=mine)
        finally:
            client.close()


def barrier(job_id: str, world_size: int, store=None, engine=None, timeout: float = 300.0, what: str = "ready") -> None:
    """Every rank of the job reaches `what` ("ready": before the first pull; "end": before any
    engine closes) within `timeout` seconds."""
    if world_size <= 1:
        return
    if store is not None:
        import datetime

        key = BARRIER_KEY.format(job=job_id, what=what)
        done = key + "/all"
        if store.add(key + "/count", 1) == world_size:
            store.set(done, b"1")
        store.wait([done], datetime.timedelta(seconds=timeout))
        return
    got = engine.allreduce(np.ones(1, dtype=np.int32)).wait(timeout)
    if int(got[0]) != world_size:
        raise RuntimeError(f"{what} barrier: {int(got[0])} workers answered, the plan has {world_size}")
