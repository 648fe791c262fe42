"""A job request as the planner sees it, validated, with a conversion from the gRPC message.

Validation errors are `ValueError`s whose text says which field to fix; the service turns them
into INVALID_ARGUMENT.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from luwu.dataplane.protocol import lanes_for_mode

LAYOUTS = ("auto", "star", "multi_rack", "rail_only")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
MAX_WORKERS = 4096


@dataclass
class JobSpec:
    name: str
    num_workers: int
    layers: list[tuple[int, int]] = field(default_factory=list)  # (layer_id, numel)
    packet_mode: str = "jumbo"
    num_nodes: int = 1
    optimizer: dict = field(default_factory=lambda: {"name": "adamw", "params": {}, "param_dtype": "bf16"})
    layout: str = "auto"
    switches: list[str] = field(default_factory=list)
    workers_per_switch: int = 0
    meta_pool: int = 0  # 0: the controller's default
    data_pool: int = 0
    node_pool: int = 0

    def validate(self) -> None:
        if not NAME_RE.match(self.name or ""):
            raise ValueError(f"job name {self.name!r}: use 1-63 letters, digits, '_', '.', '-'")
        if not 1 <= self.num_workers <= MAX_WORKERS:
            raise ValueError(f"num_workers must be 1..{MAX_WORKERS}, got {self.num_workers}")
        lanes_for_mode(self.packet_mode)
        if self.num_nodes < 0:
            raise ValueError("num_nodes must be >= 0")
        if self.layout not in LAYOUTS:
            raise ValueError(f"topology hint layout {self.layout!r} must be one of {', '.join(LAYOUTS)}")
        seen = set()
        for lid, numel in self.layers:
            if lid in seen:
                raise ValueError(f"layer id {lid} appears twice in layers")
            if numel <= 0:
                raise ValueError(f"layer {lid}: numel must be positive, got {numel}")
            seen.add(lid)
        if self.num_nodes and not self.layers:
            raise ValueError("a job with optimizer nodes needs its layers (layer_id, numel) to shard them")
        for name in ("meta_pool", "data_pool", "node_pool"):
            v = getattr(self, name)
            if v < 0 or (v and v & (v - 1)):
                raise ValueError(f"pools.{name.split('_')[0]} must be 0 (default) or a power of two, got {v}")

    @property
    def lanes(self) -> int:
        return lanes_for_mode(self.packet_mode)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> JobSpec:
        raw = dict(raw)
        raw["layers"] = [tuple(x) for x in raw.get("layers", [])]
        return cls(**raw)

    @classmethod
    def from_proto(cls, job) -> JobSpec:
        opt = {"name": job.optimizer.name or "adamw", "params": dict(job.optimizer.params),
               "param_dtype": job.optimizer.param_dtype or "bf16"}
        return cls(name=job.name, num_workers=job.num_workers,
                   layers=[(layer.layer_id, layer.numel) for layer in job.layers],
                   packet_mode=job.packet_mode or "jumbo", num_nodes=job.num_nodes, optimizer=opt,
                   layout=job.hints.layout or "auto", switches=list(job.hints.switches),
                   workers_per_switch=job.hints.workers_per_switch, meta_pool=job.pools.meta,
                   data_pool=job.pools.data, node_pool=job.pools.node)
