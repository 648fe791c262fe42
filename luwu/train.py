"""The public model-in-network API.

    import luwu
    from luwu.train import ModelInNetwork

    mnn = ModelInNetwork(model, optimizer=luwu.AdamW(lr=3e-4), network=job_network)
    for x, y in batches:
        loss = loss_fn(mnn(x), y)
        loss.backward()
        mnn.step()            # the optimizer already ran in the network; this advances the version
    mnn.close()

`JobNetwork` says where this worker's engine, switch and optimizer nodes are; `LocalNetwork`
builds the whole thing on loopback (a software switch and optimizer nodes, no controller).
The implementation is in `luwu.worker.model_in_network`.
"""

from luwu.worker.model_in_network import SGD, Adam, AdamW, JobNetwork, ModelInNetwork, UnitError
from luwu.worker.model_in_network.local import LocalNetwork

__all__ = ["SGD", "Adam", "AdamW", "JobNetwork", "LocalNetwork", "ModelInNetwork", "UnitError"]
