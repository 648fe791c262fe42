"""luwu: in-network aggregation and optimizer offload for PyTorch data-parallel training.

The import package gathers the project's parts (each a top-level folder of the repository):
`luwu.dataplane` (wire protocol, software switch, SmartNIC engine, optimizer node),
`luwu.controller`, `luwu.worker` (torch.distributed backend, model-in-network training),
`luwu.proto`, `luwu.mininet` and `luwu.p4`. See docs/architecture.md.
"""

_OPTIMIZER_SPECS = ("AdamW", "Adam", "SGD")


def __getattr__(name: str):
    """`luwu.AdamW(lr=...)`, `luwu.Adam`, `luwu.SGD`: optimizer specs for ModelInNetwork (the optimizer
    runs on the optimizer node), imported on first use so `import luwu` stays light. `luwu.__version__`
    likewise: importlib.metadata costs ~60 ms of CPU in every daemon and child process that imports
    luwu, on the start-up path of init_process_group."""
    if name == "__version__":
        from importlib.metadata import version

        return version("luwu")  # one source: pyproject.toml
    if name in _OPTIMIZER_SPECS:
        from luwu.worker.model_in_network import optimizers

        return getattr(optimizers, name)
    raise AttributeError(f"module 'luwu' has no attribute {name!r}")


def _register_torch_backend() -> None:
    """`import luwu` registers the `luwu` torch.distributed backend when torch is importable.

    If torch is already imported, at once; otherwise as soon as torch's own import finishes (a
    one-shot import hook), so that `import luwu` stays instant for the daemons and the CLI, which
    never use torch, and works without torch. LUWU_NO_BACKEND=1 skips it.
    """
    import os
    import sys

    if os.environ.get("LUWU_NO_BACKEND"):
        return
    if "torch" in sys.modules:
        _register_now()
        return
    import importlib.abc

    class _AfterTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != "torch":
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec("torch")
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RegisteringLoader(spec.loader)
            return spec

    class _RegisteringLoader(importlib.abc.Loader):
        def __init__(self, loader):
            self._loader = loader

        def create_module(self, spec):
            return self._loader.create_module(spec)

        def exec_module(self, module):
            self._loader.exec_module(module)  # torch is fully imported after this
            module.__loader__ = module.__spec__.loader = self._loader
            _register_now()

        def __getattr__(self, name):
            return getattr(self._loader, name)

    sys.meta_path.insert(0, _AfterTorch())


def _register_now() -> None:
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not dist.is_available():
        return
    try:
        from luwu.worker.backend import register

        register()
    except Exception as e:  # noqa: BLE001 - never make `import torch` or `import luwu` fail for this
        import warnings

        warnings.warn(f"luwu: could not register the 'luwu' torch.distributed backend: {e!r}", RuntimeWarning,
                      stacklevel=2)


_register_torch_backend()
