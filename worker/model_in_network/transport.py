"""The worker's engine as ModelInNetwork uses it: staging buffers, push, pull, stats.

Two shapes, one interface. `ProcessTransport` (the default) runs the engine as its own process
(`EngineClient.spawn`), so packet work never competes with training for the GIL; its staging
buffers are /dev/shm files both processes map. `EmbeddedTransport` runs the engine as a thread
of this process, with plain numpy staging buffers. A staging buffer holds one unit's values (a
pull lands there) or gradient (a push reads it until the push completes).
"""

from __future__ import annotations

import numpy as np

from luwu.dataplane.engine import Engine, EngineConfig
from luwu.dataplane.engine.client import EngineClient
from luwu.dataplane.engine.handles import Handle
from luwu.dataplane.session import EndpointPlan


class Staging:
    """One staging buffer of `capacity` float32 elements."""

    __slots__ = ("array", "buf", "capacity")

    def __init__(self, array: np.ndarray, buf=None):
        self.array = array
        self.buf = buf  # the ShmBuffer behind `array` (process engine) or None
        self.capacity = array.size

    def view(self, numel: int) -> np.ndarray:
        return self.array[:numel]


class EmbeddedTransport:
    kind = "embedded"

    def __init__(self, engine: Engine, owned: bool):
        self.engine = engine
        self.owned = owned

    @classmethod
    def start(cls, plan: EndpointPlan, config: EngineConfig | None = None) -> EmbeddedTransport:
        return cls(Engine(plan, config).start(), owned=True)

    def staging(self, numel: int) -> Staging:
        return Staging(np.zeros(numel, dtype=np.float32))

    def release_staging(self, st: Staging) -> None:
        pass

    def push(self, st: Staging, numel: int, session: int, tensor: int) -> Handle:
        return self.engine.push(session, tensor, st.view(numel))

    def pull(self, st: Staging, numel: int, session: int, tensor: int, version: int) -> Handle:
        return self.engine.pull(session, tensor, version, out=st.view(numel))

    def allreduce(self, x: np.ndarray) -> np.ndarray:
        return self.engine.allreduce(x).wait()

    def stats(self) -> dict:
        return self.engine.session_stats()

    def close(self) -> None:
        if self.owned:
            self.engine.close()


class ProcessTransport:
    kind = "process"

    def __init__(self, client: EngineClient, owned: bool):
        self.client = client
        self.owned = owned
        self._scratch: Staging | None = None

    @classmethod
    def start(cls, plan: EndpointPlan, workdir: str | None = None) -> ProcessTransport:
        return cls(EngineClient.spawn(plan, workdir), owned=True)

    def staging(self, numel: int) -> Staging:
        buf = self.client.buffer(4 * max(numel, 1))
        return Staging(buf.view(np.float32, max(numel, 1)), buf)

    def release_staging(self, st: Staging) -> None:
        pass  # the client owns its buffers and removes them at close

    def push(self, st: Staging, numel: int, session: int, tensor: int) -> Handle:
        return self.client.push(st.buf, st.view(numel), session, tensor)

    def pull(self, st: Staging, numel: int, session: int, tensor: int, version: int) -> Handle:
        return self.client.pull(st.buf, st.view(numel), session, tensor, version)

    def allreduce(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x).reshape(-1)
        if self._scratch is None or self._scratch.capacity < x.size:
            self._scratch = self.staging(max(x.size, 64))
        view = self._scratch.buf.view(x.dtype, x.size)
        view[:] = x
        self.client.allreduce(self._scratch.buf, view).wait()
        return view.copy()

    def stats(self) -> dict:
        return self.client.stats()

    def close(self) -> None:
        if self.owned:
            self.client.close()


def make_transport(engine, plan: EndpointPlan):
    """`engine`: "process" (spawn `luwu engine`), "embedded" (a thread here), or a running
    `Engine` / `EngineClient` to use (not closed by ModelInNetwork)."""
    if isinstance(engine, Engine):
        return EmbeddedTransport(engine, owned=False)
    if isinstance(engine, EngineClient):
        return ProcessTransport(engine, owned=False)
    if engine == "process":
        return ProcessTransport.start(plan)
    if engine == "embedded":
        return EmbeddedTransport.start(plan)
    raise ValueError(f"engine={engine!r}: use 'process', 'embedded', or a running Engine / EngineClient")
