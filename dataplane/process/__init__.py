"""What every luwu process shares, whatever its layer: its command line, its children, its heap.

- `usage`: `UserError` and the argparse types that turn a user's mistake into one line and exit 2;
- `children`: starting child processes by module name (`python_module`, which the layering test
  reads as an import), so that they die with their parent, and stopping them for sure;
- `heap`: the allocator and garbage-collector settings of the datapath daemons.

A leaf of the layers (docs/architecture.md "Layers"): it imports nothing from the project, so the
daemons and commands of every layer (engine, switch, controller, `luwu`, `luwu-ctl`) can use it.
"""
