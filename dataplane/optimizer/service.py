"""An optimizer node on the network: an `OptimizerNode` hosted by an engine in the node role.

Each node session of the plan serves one job: its summed gradients (AGG from the switch) go to
the node's pipeline, and PULLs are answered from the node's served parameters as soon as the
requested version is published. Jobs arrive over the control channel (`control.py`) with their
spec and initial parameters, or come back from a checkpoint. With a `ControlAuth` the channel
takes only authenticated connections, and a job's token may add only that job.
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..engine import Engine, EngineConfig
from ..session import EndpointPlan
from .control import DEFAULT_MAX_MESSAGE, ControlAuth, Grant, unpack_arrays
from .control_server import ControlLimits, ControlServer
from .node import OptimizerNode
from .spec import JobSpec, NodeConfig


class OptimizerService:
    def __init__(self, plan: EndpointPlan, config: NodeConfig, restore: Path | str | None = None,
                 engine_config: EngineConfig | None = None):
        self.node = OptimizerNode.restore(config, restore) if restore else OptimizerNode(config)
        self.engine = Engine(plan, engine_config)
        self.node.add_listener(lambda *_: self.engine.notify_params())
        self.sessions: dict[int, str] = {}  # session -> job id
        # job id -> layers a zeros add_job still awaits set_layer for: such a job is incomplete, and
        # an add_job of it again is answered as new (its values are sent again), never as a job the
        # node already has, so a hand-over that failed half-way is not trained from zeros on a retry
        self.awaiting: dict[str, set[int]] = {}
        self._lock = threading.Lock()
        self.control: ControlServer | None = None

    def start(self, control: str | None = None, auth: ControlAuth | None = None,
              max_message: int = DEFAULT_MAX_MESSAGE, limits: ControlLimits | None = None) -> OptimizerService:
        """Start the engine and, with `control`, the control channel (`auth`: who may use it; None
        serves it unauthenticated, for in-process tests; `limits`: its bounds, by default
        ControlLimits' with `max_message`, the bytes one message may claim)."""
        self.engine.start()
        if control:
            self.control = ControlServer(control, self.handle, auth=auth,
                                         limits=limits or ControlLimits(max_message=max_message)).start()
        return self

    def add_job(self, session: int, contributors: int, spec: JobSpec, zeros: bool = False) -> bool:
        """Serve `spec` on `session`; a job restored from a checkpoint (or added before) is bound,
        not re-added, and its state kept. `zeros`: its layers' values follow in `set_layer`
        messages, and until every layer has had one the job is incomplete. Returns True when the
        job was already on the node, complete (its state is kept: no values are to be sent)."""
        with self._lock:
            if session in self.sessions and self.sessions[session] != spec.job_id:
                raise ValueError(f"session {session} already serves job {self.sessions[session]!r}")
            existing = spec.job_id in self.node.jobs and spec.job_id not in self.awaiting
            if spec.job_id in self.awaiting and self.node.jobs[spec.job_id].spec.to_json() != spec.to_json():
                raise ValueError(f"job {spec.job_id!r} is on this node from a hand-over that stopped half-way, with "
                                 "another spec (layers, optimizer or served dtype): hand it over under a new job id, "
                                 "or restart the node")
            if spec.job_id not in self.node.jobs:
                self.node.add_job(spec)
                if zeros:
                    self.awaiting[spec.job_id] = {layer.layer_id for layer in spec.layers}
            self.sessions[session] = spec.job_id
        self.engine.bind(session, self.node.provider(spec.job_id),
                         self.node.gradient_sink(spec.job_id, contributors)).wait(30)
        return existing

    def handle(self, header: dict, blobs: list[bytes], grant: Grant | None = None) -> dict:
        op = header.get("op")
        if op == "add_job":
            if "initial" in header:
                initial: dict | int | None = unpack_arrays(header["initial"], blobs)
            else:  # zeros: the values follow in set_layer messages (ModelInNetwork's hand-over)
                initial = None if header.get("zeros") else int(header.get("seed", 0))
            spec = JobSpec.from_json(header["job"], initial)
            if grant is not None and grant.job_id is not None and spec.job_id != grant.job_id:
                raise PermissionError(f"this connection holds the token of job {grant.job_id!r}; it cannot add job "
                                      f"{str(spec.job_id)[:80]!r}")
            existing = self.add_job(int(header["session"]), int(header["contributors"]), spec,
                                    zeros="initial" not in header and bool(header.get("zeros")))
            return {"job_id": spec.job_id, "existing": existing}  # existing: its state kept (no set_layer)
        if op == "set_layer":  # a layer's starting values after a seeded add_job: one layer per message
            job_id = str(header.get("job_id", ""))
            if grant is not None and grant.job_id is not None and job_id != grant.job_id:
                raise PermissionError(f"this connection holds the token of job {grant.job_id!r}, not of "
                                      f"{job_id[:80]!r}")
            values = unpack_arrays(header["initial"], blobs)
            if set(values) != {int(header["layer"])}:
                raise ValueError(f"set_layer of layer {header['layer']} carries values of layers {sorted(values)}")
            self.node.set_initial(job_id, int(header["layer"]), values[int(header["layer"])])
            with self._lock:
                left = self.awaiting.get(job_id)
                if left is not None:
                    left.discard(int(header["layer"]))
                    if not left:
                        del self.awaiting[job_id]
            return {}
        if op == "stats":
            return {"stats": {"node": self.node.stats(), "engine": self.engine.session_stats()}}
        if op == "checkpoint":
            return {"path": str(self.node.checkpoint_now(timeout=300))}
        if op == "skipped":  # steps skipped for a non-finite gradient (GradScaler-like), per layer
            job_id = str(header.get("job_id", ""))
            if grant is not None and grant.job_id is not None and job_id != grant.job_id:
                raise PermissionError(f"this connection holds the token of job {grant.job_id!r}, not of "
                                      f"{job_id[:80]!r}")
            return {"skipped": {str(s): ids for s, ids in self.node.skipped_steps(job_id).items()}}
        raise ValueError(f"unknown control request {op!r}: add_job, set_layer, stats, checkpoint or skipped")

    @property
    def address(self) -> tuple[str, int]:
        return self.engine.address

    def close(self) -> None:
        if self.control is not None:
            self.control.stop()
        self.engine.close()
        self.node.close()
