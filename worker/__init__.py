"""The worker side: the `luwu` torch.distributed backend and the model-in-network training API."""
