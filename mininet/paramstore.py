"""The emulation's parameter store: the simplest an engine in the node role can serve, plain SGD in RAM.

`ParamProvider` (lookup) plus gradient sink (on_gradient), with results a worker can predict
exactly: for push/pull checks in tests and emulation (`luwu mininet run --push-pull`), where the
full out-of-core Adam node (`luwu node`, dataplane/optimizer/) would only add noise.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from luwu.dataplane.observe import trace
from luwu.dataplane.protocol import Dtype

if TYPE_CHECKING:
    from luwu.dataplane.engine import Engine


class SgdParamStore:
    def __init__(self, params: dict[int, np.ndarray], lr: float, bf16: bool = False):
        self.params = {t: p.astype(np.float32).reshape(-1).copy() for t, p in params.items()}
        self.version = dict.fromkeys(params, 0)
        self.lr = np.float32(lr)
        self.bf16 = bf16
        self.lock = threading.Lock()
        self.engine: Engine | None = None  # set once the engine exists: told when new parameters are ready
        self.gradients = 0
        self.unknown = 0  # gradients for tensors this store does not hold (counted, never applied)
        self.saturated = False

    def lookup(self, tensor: int, version: int):
        with self.lock:
            if tensor not in self.params:
                raise KeyError(tensor)
            if self.version[tensor] < version:
                return None
            p = self.params[tensor].copy()
        if self.bf16:  # truncated to bf16 bits, as a worker can reproduce exactly
            return (p.view(np.uint32) >> 16).astype(np.uint16), Dtype.BF16
        return p, Dtype.FP32

    def on_gradient(self, tensor: int, grad: np.ndarray, saturated: bool) -> None:
        with trace.span("optimize", "optimizer", layer=tensor, step=self.version.get(tensor, -1)):
            self._apply(tensor, grad, saturated)
        if self.engine is not None:
            self.engine.notify_params()

    def _apply(self, tensor: int, grad: np.ndarray, saturated: bool) -> None:
        with self.lock:
            if tensor not in self.params:
                self.unknown += 1
                return
            self.params[tensor] -= self.lr * grad.astype(np.float32)
            self.version[tensor] += 1
            self.gradients += 1
            self.saturated |= bool(saturated)
