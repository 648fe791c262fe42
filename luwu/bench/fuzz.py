"""`luwu bench fuzz`: a million hostile packets against a running software switch with live jobs.

Three processes: the switch (its UDP attachment and event loop, every port with a configured
peer but one spare), the honest side (two live jobs streaming ALLREDUCE phases whose int32 sums
are known, plus sinks; fuzz_live.py) and this one, the attacker. The attacker owns the socket of
rank 0 of its own job C (so it sends from a bound port, as a compromised worker would) and a
socket that is nobody's peer, and sends the mix of fuzz_model.py: random bytes, valid packets
with 1-8 header bits flipped, random field values, valid packets in another rank's or the
optimizer node's name from the wrong port or address, truncated, oversized and non-luwu UDP.

Every attack packet gets a fate from the independent model (fuzz_model.Model); at the end the
switch's counters (drops by DropReason, state-machine events) must equal the predictions plus
the honest traffic exactly, every honest RESULT must equal its sum exactly, and no honest phase
may hang. Exit status 1 otherwise. Prints grep-able `key: value` lines, progress on stderr;
`--json FILE` and `--plot FILE.png` (drops by reason) beside.

    luwu bench fuzz --packets 1000000 --workers 3 --seed 1 --json fuzz.json --plot fuzz.png
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from luwu.dataplane.net.mmsg import BatchSocket, udp_socket
from luwu.dataplane.process.usage import UserError, nonnegative_int, positive_float, positive_int
from luwu.dataplane.protocol import MAX_UDP_PAYLOAD, DropReason, Event, lanes_for_mode

from .fuzz_live import HOST, live_main
from .fuzz_model import (
    AGGREGATE,
    COMPROMISED,
    FALLBACK,
    FALLBACK_NO_ROUTE,
    FATE_NAMES,
    HEARTBEAT,
    KINDS,
    MULTICAST,
    PULL,
    Attack,
    Model,
    Topology,
)

BLOCK = 1024  # attack datagrams generated, modelled and sent per step
QUEUE_LIMIT = 2 << 20  # bytes waiting in the switch's sockets before the attacker pauses (buffers are 8 MiB)
START_TIMEOUT = 60  # s for the processes to come up and the live jobs to complete a first phase
DRAIN_TIMEOUT = 60  # s for the switch to take in what was sent, and the live jobs to finish
PROGRESS_EVERY = 5.0  # s between progress lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--packets", type=positive_int, default=1_000_000, help="attack datagrams to send")
    p.add_argument("--workers", type=positive_int, default=3, help="ranks per honest job (two jobs; 1..32)")
    p.add_argument("--seed", type=nonnegative_int, default=1, help="seeds the attack and the live jobs' values")
    p.add_argument("--mode", default="tofino", help="packet mode or lane count of the switch (tofino = 64 lanes)")
    p.add_argument("--pool", type=positive_int, default=16, help="slots per session (a power of two): the window")
    p.add_argument("--rate", type=positive_float, default=500.0, help="live phases per second per job")
    p.add_argument("--max-datagram", type=positive_int,
                   help="the switch's receive buffer per datagram (default: one aggregation packet, the smallest "
                        "allowed, so every oversized datagram arrives truncated)")
    p.add_argument("--hang", type=positive_float, default=30.0, help="s an honest phase may take before it is a hang")
    p.add_argument("--json", type=Path, help="write the result here as JSON")
    p.add_argument("--plot", type=Path, help="write a PNG of the drops by reason here (needs matplotlib)")


# --- the switch process ---------------------------------------------------------------------------

def _switch_main(conn, lanes: int, slots: int, max_datagram: int, runtime: dict, peers: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig

    sw = SoftwareSwitch(SwitchConfig(lanes=lanes, slots=slots, max_datagram=max_datagram))
    try:
        addrs = {p: sw.attach_udp(p, (HOST, 0), peer=peer) for p, peer in peers.items()}
        sw.load_runtime(runtime)
    except (OSError, ValueError) as exc:  # a port that cannot bind, a table the switch refuses: one line
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    sw.start()
    conn.send({"ports": addrs})
    while True:
        msg = conn.recv()
        if msg in ("counters", "stop"):
            if msg == "stop":
                sw.stop()
            conn.send({"counters": sw.counters(), "errors": sw.errors, "cpu_s": time.process_time()})
            if msg == "stop":
                return


def udp_queues(ports: set[int]) -> tuple[int, int]:
    """(bytes queued, datagrams the kernel dropped) over the loopback UDP sockets bound to `ports`."""
    queued = drops = 0
    with open("/proc/net/udp") as f:
        next(f)
        for line in f:
            col = line.split()
            if int(col[1].split(":")[1], 16) in ports:
                queued += int(col[4].split(":")[1], 16)
                drops += int(col[12])
    return queued, drops


class _Proc:
    def __init__(self, ctx, target, args):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()

    def get(self, what: str, timeout: float = START_TIMEOUT):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"the {what} did not answer within {timeout:.0f} s")
        return self.conn.recv()

    def ask(self, msg, what: str, timeout: float = START_TIMEOUT):
        self.conn.send(msg)
        return self.get(what, timeout)

    def close(self) -> None:
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# --- the run --------------------------------------------------------------------------------------

def fuzz(packets: int, workers: int = 3, seed: int = 1, mode="tofino", pool: int = 16, rate: float = 500.0,
         hang: float = 30.0, max_datagram: int | None = None, progress=None) -> dict:
    """Run the fuzz and return the result dict (see `check` for what must hold).

    Args:
        packets: attack datagrams to send.
        workers: ranks per honest job (two honest jobs).
        seed: seeds the attack mix and the live jobs' values.
        mode: the switch's packet mode or lane count.
        pool: slots per session pool (a power of two).
        rate: live phases per second per job.
        hang: seconds an honest phase may take before it counts as a hang.
        max_datagram: the switch's receive buffer per datagram (None: one aggregation packet).
        progress: called with one line of text now and then (None: quiet).

    Returns:
        A dict with `attack` (sent per kind, predicted fates), `switch` (drops by reason, events),
        `live` (results checked, wrong, hangs, phases), `accounting` (checks and failures) and timings.

    Examples:
        >>> r = fuzz(20_000)
        >>> r["live"]["wrong"], r["live"]["hangs"], r["accounting"]["failures"]
        (0, 0, [])
    """
    if not 1 <= workers <= 32:
        raise UserError("--workers must be 1..32")
    if pool & (pool - 1):
        raise UserError(f"--pool {pool} must be a power of two")
    try:
        lanes = lanes_for_mode(mode)
    except ValueError as exc:
        raise UserError(f"--mode: {exc}") from None
    say = progress or (lambda line: None)
    topo = Topology(workers, lanes, pool)
    max_datagram = max_datagram or topo.packet_len
    if not topo.packet_len <= max_datagram <= MAX_UDP_PAYLOAD + 29:
        raise UserError(f"--max-datagram {max_datagram} must be {topo.packet_len}..{MAX_UDP_PAYLOAD + 29}")
    ctx = mp.get_context("spawn")
    live = switch = None
    socks: list[BatchSocket] = []
    t_start = time.perf_counter()
    try:
        live = _Proc(ctx, live_main, ({"workers": workers, "lanes": lanes, "pool": pool, "seed": seed, "rate": rate,
                                       "retry": 0.2, "hang": hang},))
        hello = live.get("live-jobs process")
        socks = [BatchSocket(udp_socket(HOST, 0), batch=64, max_len=65536, peers=topo.spare_port + 1)
                 for _ in (COMPROMISED, 1)]
        peers: dict[int, tuple | None] = {topo.honest_port(j, r): tuple(hello["ranks"][j * workers + r])
                 for j in range(2) for r in range(workers)}
        peers[topo.compromised_port] = socks[COMPROMISED].sock.getsockname()[:2]
        peers[topo.idle_rank_port] = tuple(hello["sinks"]["idle_rank"])
        peers[topo.c_node_port] = tuple(hello["sinks"]["c_node"])
        peers[topo.honest_node_port] = tuple(hello["sinks"]["honest_node"])
        peers[topo.spare_port] = None
        switch = _Proc(ctx, _switch_main, (lanes, topo.slots, max_datagram, topo.runtime(), peers))
        up = switch.get("switch process")
        if "error" in up:
            raise RuntimeError(f"the switch did not start: {up['error']}")
        addrs = up["ports"]
        for s in socks:
            for p, a in addrs.items():
                s.set_peer(p, *a)
        switch_ports = {a[1] for a in addrs.values()}
        live.conn.send([addrs[topo.honest_port(j, r)] for j in range(2) for r in range(workers)])
        live.conn.send("go")
        deadline = time.monotonic() + START_TIMEOUT
        while min(j["phases_completed"] for j in live.ask("status", "live-jobs process")["jobs"].values()) < 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the live jobs completed no phase within {START_TIMEOUT} s")
            time.sleep(0.05)
        say(f"fuzz: switch up ({len(addrs)} ports), live jobs running; sending {packets:,} attack packets")
        attack = _attack(topo, Model(topo, max_datagram), seed, packets, socks, switch_ports, live, say)
        t_attack = attack.pop("seconds")
        _wait_drained(switch_ports)
        status = live.ask("stop", "live-jobs process", DRAIN_TIMEOUT + 2 * hang)
        honest_total = status["sent"]
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while True:  # until the switch has counted every datagram sent to it (or the kernel lost some)
            _wait_drained(switch_ports)
            snap = switch.ask("counters", "switch process")
            rx = sum(s.get("rx_packets", 0) for s in snap["counters"]["ports"].values())
            if rx >= attack["sent"] + honest_total or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        kernel_drops = udp_queues(switch_ports)[1]
        final = switch.ask("stop", "switch process")
    finally:
        for s in socks:
            s.close()
        for p in (switch, live):
            if p is not None:
                try:
                    p.conn.send("stop")
                except (OSError, BrokenPipeError):
                    pass
                p.close()
    result = _result(topo, attack, status, final, rx, kernel_drops)
    result["seconds"] = {"attack": t_attack, "total": time.perf_counter() - t_start}
    result["cpu_s"] = {"switch": final["cpu_s"], "live": status["cpu_s"], "attacker": time.process_time()}
    result["attack"]["packets_per_s"] = attack["sent"] / t_attack
    result["params"] = {"packets": packets, "workers": workers, "seed": seed, "lanes": lanes, "pool": pool,
                        "rate": rate, "hang_s": hang, "max_datagram": max_datagram}
    return result


def _attack(topo: Topology, model: Model, seed: int, packets: int, socks, switch_ports: set[int], live, say) -> dict:
    gen = Attack(topo, seed, BLOCK)
    sent_kind: Counter = Counter()
    fates: Counter = Counter()  # (fate, spare?) -> packets
    accepted: Counter = Counter()  # (fate name, session) of packets that pass validation
    rows_stride = np.uint64(gen.rows.strides[0])
    big_stride = np.uint64(gen.big.strides[0])
    from luwu.dataplane.net.mmsg import addr_of

    rows_base, big_base = np.uint64(addr_of(gen.rows)), np.uint64(addr_of(gen.big))
    sent = 0
    t0 = last = time.perf_counter()
    while sent < packets:
        n = min(BLOCK, packets - sent)
        rows, big, length, port, src, kind, over = gen.next_block(n)
        hdr = gen.model_rows(rows, big, over)
        fate = model.predict(hdr, length, port, src)
        spare = port == topo.spare_port
        for (f, sp), c in Counter(zip(fate.tolist(), spare.tolist())).items():
            fates[(f, sp)] += c
        ok = fate >= AGGREGATE
        for f, s in zip(fate[ok].tolist(), hdr[ok, 2:4].copy().view(">u2")[:, 0].tolist()):
            accepted[(FATE_NAMES[f], s)] += 1
        sent_kind.update(KINDS[k] for k in kind.tolist())
        i = np.arange(n, dtype=np.uint64)
        where = np.where(over, big_base + i * big_stride, rows_base + i * rows_stride)
        while udp_queues(switch_ports)[0] > QUEUE_LIMIT:  # never overrun the switch's socket buffers
            time.sleep(0.0005)
        for who, s in enumerate(socks):
            m = src == who
            if m.any():
                s.send(where[m], length[m], port[m])
        while socks[COMPROMISED].recv():  # the compromised rank's own results: drain, ignore
            pass
        sent += n
        now = time.perf_counter()
        if now - last >= PROGRESS_EVERY:
            last = now
            st = live.ask("status", "live-jobs process")
            say(f"fuzz: {sent:,}/{packets:,} attack packets ({sent / (now - t0) / 1e3:.1f}k/s); live phases "
                f"{sum(j['phases_completed'] for j in st['jobs'].values()):,}, results checked "
                f"{st['results_checked']:,}, wrong {st['wrong']}, hangs {st['hangs']}")
    return {"sent": sent, "seconds": time.perf_counter() - t0, "by_kind": dict(sent_kind), "fates": fates,
            "accepted": accepted}


def _wait_drained(ports: set[int]) -> None:
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while udp_queues(ports)[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the batch the event loop took last is counted under its lock


# --- accounting -----------------------------------------------------------------------------------

def _result(topo: Topology, attack: dict, live: dict, final: dict, rx: int, kernel_drops: int) -> dict:
    c = final["counters"]
    drops = {DropReason(k).name: v[0] for k, v in c["drops"].items()}
    events = {Event(k).name: v[0] for k, v in c["events"].items()}
    expect: Counter = Counter()
    spare_n = 0
    for (f, sp), n in attack["fates"].items():
        expect[f] += n
        spare_n += n if sp else 0
    failures: list[str] = []
    table = {}
    for r in DropReason:
        if r in (DropReason.DUPLICATE, DropReason.SIMULATED_LOSS, DropReason.NO_ROUTE):
            continue
        table[r.name] = {"switch": drops[r.name], "predicted": expect[int(r)]}
        if drops[r.name] != expect[int(r)]:
            failures.append(f"drops {r.name}: switch {drops[r.name]}, model {expect[int(r)]}")
    honest = live["sent"]
    state = events["ABSORBED"] + events["COMPLETED"] + events["RESENT"] + drops["DUPLICATE"]
    checks = [
        ("aggregation packets (ABSORBED+COMPLETED+RESENT+DUPLICATE)", state, honest + expect[AGGREGATE]),
        ("FALLBACK events", events["FALLBACK"], expect[FALLBACK] + expect[FALLBACK_NO_ROUTE]),
        ("NO_ROUTE copies (fallback in a session without a node)", drops["NO_ROUTE"], expect[FALLBACK_NO_ROUTE]),
        ("worker heartbeats (HB_ROUND+HB_ABSORBED)", events["HB_ROUND"] + events["HB_ABSORBED"], expect[HEARTBEAT]),
        ("SIMULATED_LOSS", drops["SIMULATED_LOSS"], 0),
        ("datagrams the switch received", rx, attack["sent"] + honest),
        ("datagrams the kernel dropped before the switch", kernel_drops, 0),
        ("switch batch errors", final["errors"], 0),
    ]
    fates_total = (sum(v["switch"] for v in table.values()) + state + events["FALLBACK"] + events["HB_ROUND"]
                   + events["HB_ABSORBED"] + expect[MULTICAST] + expect[PULL])
    checks.append(("every datagram has one fate (drops + state events + deliveries)", fates_total, rx))
    for name, got, want in checks:
        if got != want:
            failures.append(f"{name}: switch {got}, expected {want}")
    acc = attack["accepted"]
    honest_slots = sum(v for (f, s), v in acc.items() if s in (1, 2, 5) and f in ("aggregate", "heartbeat", "pull"))
    if honest_slots:
        failures.append(f"{honest_slots} attack packets reached an honest job's slots or heartbeat rounds")
    if live["unexpected"]:
        failures.append(f"{live['unexpected']} unexpected packets reached honest ranks")
    forged_node = live["sinks"]["honest_node"]
    if forged_node["forged_sums"]:
        failures.append(f"the honest job's node completed {forged_node['forged_sums']} sums from forged packets")
    return {
        "attack": {"sent": attack["sent"], "by_kind": attack["by_kind"],
                   "predicted": {(DropReason(f).name if f < AGGREGATE else FATE_NAMES[f]): n
                                 for f, n in sorted(expect.items())},
                   "spare_port_packets": spare_n,
                   "accepted_by_session": {f"{f}@{s}": n for (f, s), n in sorted(acc.items())}},
        "switch": {"drops": drops, "events": events, "received": rx, "kernel_drops": kernel_drops,
                   "errors": final["errors"]},
        "live": {k: live[k] for k in ("sent", "resent", "results_checked", "wrong", "hangs", "unexpected", "jobs")},
        "named": {
            "own_job_accepted": sum(v for (f, s), v in acc.items() if s in (3, 4)),
            "own_job_note": "valid-looking packets of the compromised rank in its own job's sessions: the "
                            "switch cannot tell them from its real contributions (docs/protocol.md 6.8); they "
                            "reach job C only",
            "forged_fallback_to_honest_node": sum(forged_node["fallback_grads_by_worker"].values()),
            "forged_fallback_workers": forged_node["fallback_grads_by_worker"],
            "forged_fallback_rejected_by_node": forged_node["node_rejected"],
            "forged_sums_at_honest_node": forged_node["forged_sums"],
            "honest_node_received": forged_node["by_type"],
        },
        "accounting": {"drops": table, "checks": [{"what": n, "switch": g, "expected": w} for n, g, w in checks],
                       "failures": failures},
    }


def ok(result: dict) -> bool:
    live = result["live"]
    return live["wrong"] == 0 and live["hangs"] == 0 and not result["accounting"]["failures"]


def run(args) -> int:
    r = fuzz(args.packets, args.workers, args.seed, args.mode, args.pool, args.rate, args.hang, args.max_datagram,
             progress=lambda line: print(line, file=sys.stderr, flush=True))
    live, sw = r["live"], r["switch"]
    lines = {
        "packets": r["attack"]["sent"], "packets_per_s": r["attack"]["packets_per_s"],
        "wall_s": r["seconds"]["total"], "attack_s": r["seconds"]["attack"],
        "cpu_s_switch": r["cpu_s"]["switch"], "cpu_s_live": r["cpu_s"]["live"],
        "cpu_s_attacker": r["cpu_s"]["attacker"],
        **{f"sent_{k}": v for k, v in sorted(r["attack"]["by_kind"].items())},
        **{f"drops_{k}": v for k, v in sw["drops"].items() if v},
        **{f"events_{k}": v for k, v in sw["events"].items() if v},
        "spare_port_packets": r["attack"]["spare_port_packets"],
        "live_phases": sum(j["phases_completed"] for j in live["jobs"].values()),
        "results_checked": live["results_checked"], "wrong": live["wrong"], "hangs": live["hangs"],
        "unexpected_at_honest_ranks": live["unexpected"],
        "own_job_accepted": r["named"]["own_job_accepted"],
        "forged_fallback_to_honest_node": r["named"]["forged_fallback_to_honest_node"],
        "forged_sums_at_honest_node": r["named"]["forged_sums_at_honest_node"],
        "accounting_failures": len(r["accounting"]["failures"]),
    }
    for k, v in lines.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    for f in r["accounting"]["failures"]:
        print(f"accounting_failure: {f}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2, default=str))
    if args.plot:
        _plot(r, args.plot)
    return 0 if ok(r) else 1


def _plot(r: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("plot: skipped (matplotlib is not installed)", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drops = {k: v for k, v in r["switch"]["drops"].items() if v}
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = sorted(drops, key=drops.__getitem__, reverse=True)
    ax.bar(names, [drops[n] for n in names], color="tab:red")
    pred = r["accounting"]["drops"]
    ax.plot([n for n in names if n in pred], [pred[n]["predicted"] for n in names if n in pred], "k_", ms=18,
            label="model's prediction")
    ax.set_yscale("log")
    ax.set_ylabel("packets dropped")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
    live = r["live"]
    ax.set_title(f"{r['attack']['sent']:,} attack packets, {live['results_checked']:,} results checked: "
                 f"wrong {live['wrong']}, hangs {live['hangs']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
