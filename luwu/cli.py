"""The `luwu` command: one entry point whose subcommands live in the modules that own them.

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are
imported only when their command runs, so `luwu --help` is instant and a broken optional part
cannot break the others. A user mistake is one line on stderr and exit status 2: flags are
checked by argparse types (luwu.dataplane.process.usage) and a one-line parser, and a `UserError` raised
while the command runs is printed as `luwu <cmd>: <message>`.

Exit statuses, the same in `luwu`, `luwu bench`, the commands with actions (`luwu p4`, `luwu
mininet`) and `luwu-ctl`: `--help` and `--version` print to stdout and exit 0; a missing or
unknown command is a usage mistake like any other, one line on stderr naming the choices, exit 2.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("luwu.demo", "train a small GPT through the switch and the optimizer node on loopback"),
    "switch": ("luwu.daemons.switch", "run the software switch (UDP on loopback, or raw interfaces)"),
    "bmv2": ("luwu.daemons.bmv2", "run BMv2 (simple_switch_grpc) with the luwu pipeline on interfaces"),
    "engine": ("luwu.dataplane.engine.daemon", "run a SmartNIC engine daemon beside a worker"),
    "node": ("luwu.daemons.node", "run an in-network optimizer node"),
    "controller": ("luwu.controller.server", "run the gRPC controller"),
    "mininet": ("luwu.mininet.runner", "run a topology in Mininet emulation"),
    "p4": ("luwu.p4_command", "generate, check and build the P4 programs"),
    "simulate": ("luwu.simulate.command", "simulate a training iteration at paper scale; plan optimizer nodes"),
    "certs": ("luwu.certs", "make a CA and P4Runtime TLS certificates (client roles controller/reader, servers)"),
    "wireshark": ("luwu.dataplane.observe.wireshark", "write the Wireshark/tshark dissector for the luwu header"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "allreduce": ("luwu.bench.allreduce", "in-network allreduce vs Gloo and the raw UDP ceiling"),
    "optimizer": ("luwu.bench.optimizer", "optimizer node vs torch fused AdamW and the disk"),
    "switch": ("luwu.bench.switch", "the software switch alone vs a do-nothing UDP relay"),
    "fuzz": ("luwu.bench.fuzz", "hostile packets against a running switch with live jobs: exact sums, every drop accounted"),
    "observability": ("luwu.bench.observability", "what tracing and metrics cost: the allreduce with them off and on"),
    "integrity": ("luwu.bench.integrity", "what the wire's integrity checks cost: the allreduce before and after"),
    "capacity": ("luwu.bench.capacity", "the largest model luwu, DDP and FSDP2 train with every worker under a memory cap"),
}


def _usage(table: dict[str, tuple[str, str]], prog: str) -> str:
    width = max(len(k) for k in table)
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in table.items())
    return f"usage: {prog} COMMAND [options]\n\ncommands:\n{rows}\n\n`{prog} COMMAND --help` for a command's options."


def _dispatch(table: dict[str, tuple[str, str]], prog: str, argv: list[str]) -> int:
    from luwu.dataplane.process.usage import USAGE_EXIT, OneLineParser, UserError

    if argv and argv[0] in ("-h", "--help"):
        print(_usage(table, prog))
        return 0
    if argv and argv[0] in ("-V", "--version"):
        from luwu import __version__

        print(f"{prog} {__version__}")
        return 0
    if not argv or argv[0] not in table:
        problem = f"unknown command {argv[0]!r}" if argv else "missing command"
        print(f"{prog}: {problem}: one of {', '.join(table)} (see {prog} --help)", file=sys.stderr)
        return USAGE_EXIT
    name, rest = argv[0], argv[1:]
    if prog == "luwu" and name == "bench":
        return _dispatch(BENCHES, "luwu bench", rest)

    module = importlib.import_module(table[name][0])
    parser = OneLineParser(prog=f"{prog} {name}", description=table[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except UserError as exc:  # bad input found while running: one line, no traceback
        print(f"{prog} {name}: {exc}", file=sys.stderr)
        return USAGE_EXIT


def main(argv: list[str] | None = None) -> int:
    return _dispatch({**COMMANDS, "bench": ("", "benchmarks: " + ", ".join(BENCHES))}, "luwu",
                     sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
