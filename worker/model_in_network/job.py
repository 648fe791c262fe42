"""Setting a model-in-network job up: the first rank of each group (rank 0 on a flat plan, rank k
of server 0 for rail k on rail-only) hands the optimizer nodes its routes reach their layers (the
job's spec and that rank's initial parameters, sliced as routes.py says) over the nodes' control
channels; then every rank waits at a
barrier before its first pull, so no worker asks a node for a layer it does not have yet; and at
close, before any engine stops, so no worker's last pulls stall: a node paces its parameter stream
by the heartbeats of all its workers (the switch takes their minimum), and a closed engine sends none.

The barrier is the c10d store when one is given (`store.add` + `store.wait`), otherwise a
one-element allreduce through the worker's engine (the job's collective session), which needs
nothing beyond the network itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import numpy as np

from luwu.dataplane.optimizer.control import ControlClient
from luwu.dataplane.optimizer.spec import JobSpec, LayerSpec, OptimizerSpec

from .routes import Route, piece_initial, piece_spec
from .units import Unit

BARRIER_KEY = "luwu/mnn/{job}/{what}"


def node_jobs(job_id: str, optimizer: OptimizerSpec, units: list[Unit], routes: dict[int, Route],
              initial: Callable[[int], np.ndarray], served_dtype: str) -> dict[int, tuple[JobSpec, dict]]:
    """node index -> (its JobSpec, {layer: ({tensor: shape}, values())}) for every node this rank's
    routes reach: a whole unit as the unit's LayerSpec, a slice as routes.piece_spec names it.
    `initial(unit)` is the unit's flat fp32 values; it is called while the layer is handed over
    (`hand_over`), so one unit's values are made at a time (the last unit's are kept for its
    other pieces)."""
    layers: dict[int, list[LayerSpec]] = {}
    values: dict[int, dict[int, tuple[Mapping[str, tuple[int, ...]], Callable[[], dict[str, np.ndarray]]]]] = {}
    last: dict[int, np.ndarray] = {}

    def piece_values(unit: int, spans: dict[str, tuple[int, int]],
                     shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        if unit not in last:
            last.clear()  # one unit at a time
            last[unit] = initial(unit)
        return piece_initial(last[unit], spans, shapes)

    for u in units:
        route = routes[u.index]
        if not route.pieces:  # an empty rail shard (a unit smaller than the rails): nothing on a node
            continue
        for piece in route.pieces:
            spec, spans = piece_spec(u, piece, route.whole)
            layers.setdefault(piece.node, []).append(spec)
            values.setdefault(piece.node, {})[u.index] = (
                spec.shapes, functools.partial(piece_values, u.index, spans, spec.shapes))
    return {node: (JobSpec(job_id, optimizer, specs, served_dtype=served_dtype), values[node])
            for node, specs in sorted(layers.items())}


def hand_over(jobs: dict[int, tuple[JobSpec, dict]], sessions: dict[int, int], controls: list[str],
              contributors: int, timeout: float, token: str = "") -> None:
    """Give each node its job and the initial values of its layers, streamed layer by layer
    (`token`: the job's, for the nodes' control channels; `contributors`: the job's ranks, whose
    mean the node steps with)."""
    for node, (spec, initial) in jobs.items():
        if node >= len(controls) or not controls[node]:
            raise ValueError(f"this rank must reach optimizer node {node} to hand it the job: the network description "
                             f"lists control addresses for nodes 0..{len(controls) - 1} only")
        if node not in sessions:
            raise ValueError(f"optimizer node {node} has no node session in this worker's plan "
                             f"(sessions for nodes {sorted(sessions)})")
        client = ControlClient(controls[node], timeout=timeout, token=token, job_id=spec.job_id)
        try:
            client.add_job_streamed(sessions[node], contributors, spec.to_json(),
                                    [(layer, shapes) for layer, (shapes, _) in initial.items()],
                                    functools.partial(_produce, initial))
        finally:
            client.close()


def _produce(initial: dict, layer: int) -> dict[str, np.ndarray]:
    return initial[layer][1]()


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
