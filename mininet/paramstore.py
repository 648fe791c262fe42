"""The emulated optimizer node's parameters: the slices of layers one attachment serves, plain SGD.

The push/pull check needs a node whose result the workers can predict exactly, so this is the
engine's node role (`ParamProvider` + gradient sink) with an SGD step, not the full out-of-core
Adam node (`luwu node`), whose own tests cover the optimizer.
"""

from __future__ import annotations

import threading

import numpy as np

from luwu.dataplane.protocol import Dtype


class SliceStore:
    def __init__(self, params: dict[int, np.ndarray], lr: float):
        self.params = {layer: p.astype(np.float32).copy() for layer, p in params.items()}
        self.version = {layer: 0 for layer in params}
        self.lr = np.float32(lr)
        self.lock = threading.Lock()
        self.engine = None  # set once the engine exists: told when new parameters are ready
        self.gradients = 0
        self.unknown = 0  # gradients for tensors this store does not hold (reported, never applied)
        self.saturated = False

    def lookup(self, tensor: int, version: int):
        with self.lock:
            if tensor not in self.params:
                raise KeyError(tensor)
            if self.version[tensor] < version:
                return None
            return self.params[tensor].copy(), Dtype.FP32

    def on_gradient(self, tensor: int, grad: np.ndarray, saturated: bool) -> None:
        with self.lock:
            if tensor not in self.params:
                self.unknown += 1
                return
            self.params[tensor] -= self.lr * grad.astype(np.float32)
            self.version[tensor] += 1
            self.gradients += 1
            self.saturated |= bool(saturated)
        if self.engine is not None:
            self.engine.notify_params()
