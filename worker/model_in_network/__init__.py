"""Model-in-network training: the worker holds no optimizer state and only the layers in flight;
parameters live on in-network optimizer nodes, gradients are summed by the switch.

    from luwu.train import ModelInNetwork
    mnn = ModelInNetwork(model, optimizer=luwu.AdamW(lr=3e-4), network=job_network)

See model.py for the mechanics (hooks.py for the hooks around each unit), units.py for how a model is cut, schedule.py for the pull policy.
"""

from .devices import SharedDeviceError
from .job import JoinError
from .model import ModelInNetwork
from .network import JobNetwork
from .optimizers import SGD, Adam, AdamW
from .units import Unit, UnitError, split_units

__all__ = ["SGD", "Adam", "AdamW", "JobNetwork", "JoinError", "ModelInNetwork", "SharedDeviceError", "Unit",
           "UnitError", "split_units"]
