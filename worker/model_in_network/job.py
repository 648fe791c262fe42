"""Setting a model-in-network job up: the first rank of each group (rank 0 on a flat plan, rank k
of server 0 for rail k on rail-only) hands the optimizer nodes its routes reach their layers (the
job's spec and that rank's initial parameters, sliced as routes.py says) over the nodes' control
channels; then every rank waits at a
barrier before its first pull, so no worker asks a node for a layer it does not have yet; and at
close, before any engine stops, so no worker's last pulls stall: a node paces its parameter stream
by the heartbeats of all its workers (the switch takes their minimum), and a closed engine sends none.

The barrier is the c10d store when one is given (`store.add` + `store.wait`), otherwise an
allreduce through the worker's engine (the job's collective session), which needs nothing beyond
the network itself.

The start barrier (`join`) carries failures: a rank that fails before it (a model it cannot cut, a
node that refuses its job, ...) still joins it with its error, and every rank compares the others'
model fingerprints (units' names, shapes and dtypes). Every other rank then raises `JoinError`
at once, naming the failed (or mismatched) rank and the cause, instead of waiting out the
timeout. Through the engine the error's text travels in the allreduce itself: each rank owns a
slot of the summed int32 vector (1 for "here", a failure flag, its fingerprint, its message's
bytes), and every other rank's slot is zeros, so the sum is each rank's slot exactly. Through a
store, the failed rank writes its message under the barrier's key and wakes the others.
"""

from __future__ import annotations

import datetime
import functools
import shutil
import tempfile
import threading
import warnings
import zlib
from collections.abc import Callable, Mapping

import numpy as np

from luwu.dataplane.optimizer.control import ControlClient, pack_arrays
from luwu.dataplane.optimizer.spec import JobSpec, LayerSpec, OptimizerSpec

from .routes import Route, piece_initial, piece_spec
from .units import Unit

BARRIER_KEY = "luwu/mnn/{job}/{what}"
JOIN_MESSAGE_BYTES = 400  # of a failed rank's error, carried through the engine's start barrier
REPORT_WAIT = 5.0  # s a rank that failed before it had an engine waits for the others to take its error
REPORT_TIMEOUT = 30.0  # s a rank that failed with its engine open (its hand-over, say) waits for the same
_HEAD = 5  # a rank's slot: here (1), failed (0/1), fingerprint (two 16-bit halves), message length; then its bytes


class JoinError(RuntimeError):
    """Another rank of the job failed before or at the start barrier, or joined with another model:
    the message names the rank and its cause."""


def fingerprint(units: list[Unit]) -> int:
    """CRC-32 of the units' names, parameter names, shapes and dtypes: equal on every rank that
    built the same model."""
    text = ";".join(f"{u.index}:{u.name}:" + ",".join(f"{n}{tuple(p.shape)}{p.dtype}" for n, p in u.params)
                    for u in units)
    return zlib.crc32(text.encode())


def node_jobs(job_id: str, optimizer: OptimizerSpec, units: list[Unit], routes: dict[int, Route],
              initial: Callable[[int], np.ndarray], served_dtype: str) -> dict[int, tuple[JobSpec, dict]]:
    """node index -> (its JobSpec, {layer: a function returning that layer's {tensor: initial
    values}}) for every node this rank's routes reach: a whole unit as the unit's LayerSpec, a slice
    as routes.piece_spec names it. `initial(unit)` is the unit's flat fp32 values (made by the unit's
    own init for a meta-built model: materialize.py); it is called when a layer's values are sent,
    so one unit's values exist at a time (the last unit's are kept for its other pieces)."""
    layers: dict[int, list[LayerSpec]] = {}
    values: dict[int, dict[int, Callable[[], dict[str, np.ndarray]]]] = {}
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
            values.setdefault(piece.node, {})[u.index] = functools.partial(piece_values, u.index, spans, spec.shapes)
    return {node: (JobSpec(job_id, optimizer, specs, served_dtype=served_dtype), values[node])
            for node, specs in sorted(layers.items())}


def hand_over(jobs: dict[int, tuple[JobSpec, dict]], sessions: dict[int, int], controls: list[str],
              contributors: int, timeout: float, token: str = "") -> None:
    """Give each node its job and the initial values of its layers (`token`: the job's, for the
    nodes' control channels; `contributors`: the job's ranks, whose mean the node steps with). The
    job goes first, at zeros, then each layer's values in a message of its own (`set_layer`), so
    neither side holds more than one layer's values at a time (a whole model's in one message
    was 4 bytes per parameter on the node, and over its control channel's message limit, the RAM
    budget, for a model larger than a quarter of it). A job the node already has (restored from a
    checkpoint) keeps its state: no values are sent."""
    for node, (spec, initial) in jobs.items():
        if node >= len(controls) or not controls[node]:
            raise ValueError(f"this rank must reach optimizer node {node} to hand it the job: the network description "
                             f"lists control addresses for nodes 0..{len(controls) - 1} only")
        if node not in sessions:
            raise ValueError(f"optimizer node {node} has no node session in this worker's plan "
                             f"(sessions for nodes {sorted(sessions)})")
        client = ControlClient(controls[node], timeout=timeout, token=token, job_id=spec.job_id)
        try:
            reply = client.call({"op": "add_job", "session": sessions[node], "contributors": contributors,
                                 "job": spec.to_json(), "zeros": True})  # zeros until each layer's values come
            if reply.get("existing"):  # restored from a checkpoint (`luwu node --restore`): its state stays
                continue
            for layer, values in initial.items():
                desc, blobs = pack_arrays({layer: values()})
                client.call({"op": "set_layer", "job_id": spec.job_id, "layer": layer, "initial": desc}, blobs)
        finally:
            client.close()


def barrier(job_id: str, world_size: int, store=None, engine=None, timeout: float = 300.0, what: str = "ready") -> None:
    """Every rank of the job reaches `what` ("ready": before the first pull; "end": before any
    engine closes) within `timeout` seconds."""
    if world_size <= 1:
        return
    if store is not None:
        key = BARRIER_KEY.format(job=job_id, what=what)
        done = key + "/all"
        if store.add(key + "/count", 1) == world_size:
            store.set(done, b"1")
        store.wait([done], datetime.timedelta(seconds=timeout))
        return
    got = engine.allreduce(np.ones(1, dtype=np.int32)).wait(timeout)
    if int(got[0]) != world_size:
        raise RuntimeError(f"{what} barrier: {int(got[0])} workers answered, the plan has {world_size}")


def join(job_id: str, rank: int, world_size: int, store=None, engine=None, timeout: float = 300.0,
         failure: BaseException | None = None, model: int | None = None) -> None:
    """The start barrier, carrying failures: every rank of the job reaches it within `timeout`
    seconds, each with its model's `fingerprint` (None: not known, e.g. the model could not be
    cut) or the `failure` that stops it.

    Args:
        job_id (str): the job (the store's keys).
        rank (int): this rank in the job, 0..world_size-1.
        world_size (int): the job's ranks.
        store: a c10d Store, or None to agree through `engine`'s allreduce.
        engine: this worker's engine link (used when `store` is None).
        timeout (float): seconds to wait for the others.
        failure (BaseException, optional): this rank failed before the barrier; the others
            raise JoinError naming this rank and the error's text (the first JOIN_MESSAGE_BYTES
            bytes through the engine). This call then returns; the caller raises its own error.
        model (int, optional): this rank's `fingerprint(units)`.

    Raises:
        JoinError: another rank failed, or joined with a model of another fingerprint than rank 0's.
        TimeoutError / the store's error: a rank did not reach the barrier within `timeout`.

    Example::

        try:
            hand_over(...)
        except Exception as e:
            join(job_id, rank, world, engine=engine, failure=e)  # the others raise at once, naming us
            raise
        join(job_id, rank, world, engine=engine, model=fingerprint(units))
    """
    if world_size <= 1:
        return
    text = "" if failure is None else f"{type(failure).__name__}: {failure}"
    if store is not None:
        slots = _join_store(store, job_id, rank, world_size, timeout, text, model)
    else:
        slots = _join_engine(engine, rank, world_size, timeout, text, model)
    if failure is not None:
        return
    failed = [(r, msg) for r, (bad, msg, _) in enumerate(slots) if bad]
    if failed:
        raise JoinError(f"rank {rank}: " + "; ".join(f"rank {r} failed at join: {msg}" for r, msg in failed)
                        + (" (it stopped; this rank stops too)" if len(failed) == 1 else " (they stopped; this rank "
                                                                                           "stops too)"))
    want = slots[0][2]
    other = [r for r, (_, _, fp) in enumerate(slots) if fp is not None and want is not None and fp != want]
    if other:
        raise JoinError(f"rank {rank}: rank(s) {other} joined with a model other than rank 0's (model fingerprint "
                        f"{', '.join(f'{slots[r][2]:08x}' for r in other)} against {want:08x}: the units' names, "
                        "shapes or dtypes differ); build the same model on every rank")


def _join_engine(engine, rank: int, world: int, timeout: float, text: str,
                 model: int | None) -> list[tuple[bool, str, int | None]]:
    width = _HEAD + JOIN_MESSAGE_BYTES
    vec = np.zeros((world, width), dtype=np.int32)
    msg = text.encode("utf-8", "replace")[:JOIN_MESSAGE_BYTES]
    fp = -1 if model is None else model  # -1: no fingerprint (the halves below are then 0xffff, 0xffff)
    vec[rank, :_HEAD] = (1, bool(text), (fp >> 16) & 0xFFFF, fp & 0xFFFF, len(msg))
    vec[rank, _HEAD:_HEAD + len(msg)] = np.frombuffer(msg, dtype=np.uint8)
    got = np.asarray(engine.allreduce(vec.reshape(-1)).wait(timeout)).reshape(world, width)
    here = got[:, 0]
    if not (here == 1).all():
        counts = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(here) if c != 1)
        raise RuntimeError(f"ready barrier: each rank should answer once, got {counts}: two workers share a rank, "
                           "or the ranks run different plans")
    out = []
    for row in got:
        n = int(min(max(row[4], 0), JOIN_MESSAGE_BYTES))
        message = bytes(row[_HEAD:_HEAD + n].astype(np.uint8)).decode("utf-8", "replace")
        hi, lo = int(row[2]), int(row[3])
        out.append((bool(row[1]), message, None if (hi, lo) == (0xFFFF, 0xFFFF) else (hi << 16) | lo))
    return out


def _join_store(store, job_id: str, rank: int, world: int, timeout: float, text: str,
                model: int | None) -> list[tuple[bool, str, int | None]]:
    key = BARRIER_KEY.format(job=job_id, what="ready")
    done, abort = key + "/all", key + "/failed"
    store.set(f"{key}/model/{rank}", b"" if model is None else str(model).encode())
    if text:
        store.set(f"{key}/error/{rank}", text.encode("utf-8", "replace"))
        store.set(abort, str(rank).encode())  # (any failed rank's; each one's error is under its own key)
        store.set(done, b"1")  # wake the ranks that wait
        return []
    if store.add(key + "/count", 1) == world:
        store.set(done, b"1")
    store.wait([done], datetime.timedelta(seconds=timeout))
    if store.check([abort]):
        failed = []
        for r in range(world):
            if store.check([f"{key}/error/{r}"]):
                failed.append(r)
        return [(r in failed, store.get(f"{key}/error/{r}").decode("utf-8", "replace") if r in failed else "", None)
                for r in range(world)]
    models = [store.get(f"{key}/model/{r}").decode() for r in range(world)]
    return [(False, "", int(m) if m else None) for m in models]


def report_failure(job_id: str, rank: int, world_size: int, store, engine, timeout: float,
                   failure: BaseException) -> None:
    """Join the start barrier with `failure` (`join(failure=...)`) so that the other ranks raise at
    once naming this rank; a failure of the report itself is only warned about (the caller raises
    `failure` anyway)."""
    try:
        join(job_id, rank, world_size, store, engine, timeout, failure=failure)
    except Exception as e:  # noqa: BLE001 - the caller raises the real error
        warnings.warn(f"rank {rank}: could not tell the other ranks that this one failed at join ({e}); they "
                      f"will wait for it until their timeout", stacklevel=3)


def names_join_failures(init: Callable) -> Callable:
    """For `ModelInNetwork.__init__`: a rank that fails before it reaches the start barrier (a
    model it cannot cut, a plan it cannot honour, ...) still joins the barrier with its error,
    through the store or an engine opened for that, so that every other rank raises JoinError
    naming it within seconds instead of timing out. `__init__` sets `_join_attempted` once it
    joined or reported (then there is nothing to do here)."""
    @functools.wraps(init)
    def wrapper(self, model, optimizer, network, *args, **kw):
        try:
            init(self, model, optimizer, network, *args, **kw)
        except Exception as e:
            if not getattr(self, "_join_attempted", False):
                _report_before_engine(network, kw, e)
            raise

    return wrapper


def _report_before_engine(network, kw: dict, failure: BaseException) -> None:
    """Join the barrier with `failure` from a rank that failed before it had an engine: through
    the store, or an engine opened for it. The others are usually at the barrier already; if
    they are not there within REPORT_WAIT seconds, the report goes on in a daemon thread (until
    the job's timeout) and this rank raises its error without waiting for them."""
    from luwu.worker.engine_link import open_engine  # the worker's engine, as ModelInNetwork opens it

    from .network import JobNetwork

    try:
        net = JobNetwork.from_json(network) if isinstance(network, str) else network
        rank, world = net.rank, net.world_size
    except Exception:  # noqa: BLE001 - no plan to reach the others with: the caller raises the error
        return
    store, timeout = kw.get("store"), float(kw.get("timeout", 300.0))
    if world <= 1:
        return
    if store is not None:
        report_failure(net.job_id, rank, world, store, None, timeout, failure)
        return
    workdir = tempfile.mkdtemp(prefix="luwu-mnn-")  # the engine's socket and log, removed with it
    try:
        engine = open_engine(kw.get("engine", "process"), net.endpoint, workdir)
    except Exception as e:  # noqa: BLE001
        shutil.rmtree(workdir, ignore_errors=True)
        warnings.warn(f"rank {rank}: could not open an engine to tell the other ranks that this one failed at join "
                      f"({e}); they will wait for it until their timeout", stacklevel=3)
        return

    def report() -> None:
        try:
            report_failure(net.job_id, rank, world, None, engine, timeout, failure)
        finally:
            engine.close()
            shutil.rmtree(workdir, ignore_errors=True)

    t = threading.Thread(target=report, name=f"luwu-mnn-join-failure-{rank}", daemon=True)
    t.start()
    t.join(min(timeout, REPORT_WAIT))
