"""Observability: what a running luwu shows of itself.

- `trace`: per-process event timelines (`LUWU_TRACE_DIR`), the raw material of the others;
- `critical_path`: the analysis of those timelines (what held a step back; `luwu demo --trace`);
- `metrics`: the software switch's and the daemons' Prometheus exporters;
- `wireshark`: the Lua dissector of the luwu protocol (`luwu wireshark`).

A leaf of the layers (docs/architecture.md "Layers"): it reads the wire facts (protocol) and
nothing else of the project, so the switch, the engines, the node and the applications all use it.
"""
