"""The `luwu` torch.distributed backend: `import torch` registers it (the `torch.backends` entry
point, `autoload`; `import luwu` does too), then
`dist.init_process_group("luwu")` gives a process group whose collectives go through the SmartNIC
engine and the switch (allreduce/reduce_scatter aggregated in the network; broadcast, allgather,
barrier moved exactly over the same path; gather, scatter, all_to_all and send/recv over TCP).

Modules: `process_group` (the ProcessGroup), `collectives` (each collective's engine steps),
`codec` (tensors <-> engine arrays), `scheduler` (one submission order on every rank, completion,
deadlines), `work` (Work/Future), `direct` (point-to-point moves), `fallback` (exact recomputation of
saturated sums), `staging` (non-CPU tensors), `plan_source` (embedded switch, plan file or
controller), `startup` (the child processes launched first), `config` (environment variables),
`diagnostics` (errors and warnings). The engine itself is reached through
`luwu.worker.engine_link`, shared with ModelInNetwork.

Importing this package does not import torch; `register()` and the classes do.
"""

from __future__ import annotations

BACKEND_NAME = "luwu"
_registered = False


def register() -> None:
    """Register the `luwu` backend with torch.distributed (idempotent, cheap: the process group's
    code is imported when a group is created, not here)."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu", "cuda"])  # cuda: staged
    _registered = True


def autoload() -> None:
    """torch's `torch.backends` entry point (pyproject.toml): runs inside `import torch`, so
    `dist.init_process_group("luwu")` works without `import luwu`. Never raises (torch would
    fail its own import); TORCH_DEVICE_BACKEND_AUTOLOAD=0 or LUWU_NO_BACKEND=1 turn it off."""
    import os

    if os.environ.get("LUWU_NO_BACKEND"):
        return
    try:
        import torch.distributed as dist

        if dist.is_available():
            register()
    except Exception as e:  # noqa: BLE001 - a plugin must never break `import torch`
        import warnings

        warnings.warn(f"luwu: could not register the 'luwu' torch.distributed backend: {e!r}", RuntimeWarning,
                      stacklevel=2)


def _create_process_group(store, rank, world_size, timeout):
    # rank 0's switch process first: its start is the critical path of the group's first collective,
    # and the process group's modules (~15 ms of CPU) import while it starts; the group launches the
    # engine process after them (docs/backend.md "Start-up")
    from .config import BackendConfig
    from .startup import discard_children, prestart_children

    cfg = BackendConfig.from_env()
    workdir = prestart_children(rank, cfg)
    try:
        from .process_group import create_luwu_process_group
    except BaseException:
        discard_children(workdir)
        raise
    return create_luwu_process_group(store, rank, world_size, timeout, cfg, workdir, deferred=not cfg.eager_start)


def __getattr__(name: str):
    if name in ("LuwuProcessGroup", "create_luwu_process_group"):
        from . import process_group

        return getattr(process_group, name)
    if name == "LuwuWork":
        from .work import LuwuWork

        return LuwuWork
    if name == "LuwuError":
        from . import diagnostics

        return getattr(diagnostics, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKEND_NAME", "LuwuError", "LuwuProcessGroup", "LuwuWork", "register"]
