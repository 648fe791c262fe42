"""The control plane: gRPC controller, planning, switch programming over P4Runtime, `luwu-ctl`."""
