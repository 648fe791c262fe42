"""One trial of `luwu bench capacity`: a system (luwu, ddp, fsdp) trains the model of a given number
of layers for a few steps in fresh processes, its workers capped (memcap.py); did it fit?

A trial fits when every worker finished its steps and each worker process's peak RSS stayed under
the cap (where nothing enforced it, `measured`: each worker's summed with the processes it started). It does not fit when a
worker was OOM-killed by its cgroup, raised MemoryError (RLIMIT_AS), or peaked over the cap; it
failed (`error`) on anything else, and (`timeout`) when it outlived its time.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from luwu.bench.memcap import MemoryCap
from luwu.dataplane.process.children import LineChild, die_with_parent

NET_START = 120.0  # s for the luwu deployment (switch process, optimizer node) to come up
NET_REPORT = 60.0  # s for it to report once the workers are done
POLL = 0.2  # s between checks of the workers
# what a process that ran out of address space (RLIMIT_AS) leaves in its log
_NO_MEMORY = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "cannot allocate memory",
              "failed to map segment", "Resource temporarily unavailable", "out of memory")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _child(name: str, argv: list[str], log: Path, on_message: Callable[[dict], None] | None,
           stdin: bool = False) -> LineChild:
    with open(log, "ab") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                env=_env())
    return LineChild(name, proc, log, on_message)


def _env() -> dict:
    import os

    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LUWU_NO_BACKEND="1")


def trial(system: str, layers: int, params: int, base: dict, cap: MemoryCap, workdir: Path, timeout: float,
          on_event: Callable[[str], None] = lambda s: None) -> dict:
    """Run `system` on the model of `layers` layers; returns the trial's record (see the module's docstring)."""
    from luwu.bench.rendezvous import host_store

    with host_store(timeout_s=max(timeout, 300.0)) as store:  # the DDP/FSDP ranks' c10d store
        return _trial(system, layers, params, base, cap, workdir, timeout, on_event, store)


def _trial(system: str, layers: int, params: int, base: dict, cap: MemoryCap, workdir: Path, timeout: float,
           on_event: Callable[[str], None], store: str) -> dict:
    name = f"{system}-L{layers}"
    d = workdir / name
    d.mkdir(parents=True, exist_ok=True)
    model = dict(base["model"], layers=layers)
    spec = dict(base, model=model, store=store, networks=str(d / "networks.json"), state_dir=str(d / "state"))
    spec_path = d / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "luwu.bench.capacity_trial", str(spec_path)]
    world = int(spec["world"])
    rec: dict = {"system": system, "layers": layers, "params": params, "fits": False, "reason": None}
    msgs: dict[int, list[dict]] = {r: [] for r in range(world)}
    net: LineChild | None = None
    workers: list[LineChild] = []
    slots = []
    t0 = time.monotonic()
    deadline = t0 + timeout
    try:
        if system == "luwu":
            on_event("starting the switch and the optimizer node")
            net = _child(f"{name} net", die_with_parent([*cmd, "net"]), d / "net.log", None, stdin=True)
            net.expect("ready", time.monotonic() + min(NET_START, timeout))
        for r in range(world):
            slots.append(cap.slot(f"{name}-r{r}"))

        def got(msg: dict, r: int) -> None:
            msgs[r].append(msg)
            if "step" in msg:
                on_event(f"step {msg['step'] + 1}/{spec['steps']} (rank {msg['rank']}: {msg['seconds']:.1f} s)")
            elif msg.get("built"):
                on_event(f"rank {r} built the model")

        on_event("building the model")
        for r in range(world):
            argv = slots[r].argv(die_with_parent([*cmd, system, str(r)]))
            workers.append(_child(f"{name} rank {r}", argv, d / f"rank{r}.log", functools.partial(got, r=r)))
        while any(w.alive() for w in workers):
            if time.monotonic() > deadline:
                rec["reason"] = "timeout"
                break
            if any(not w.alive() and w.proc.returncode != 0 for w in workers):
                break  # one rank failed: the others would wait for it in a collective
            time.sleep(POLL)
        for w in workers:
            w.stop(grace=1.0 if any(x.proc.returncode not in (None, 0) for x in workers) else 5.0)
            w.join_reader(5.0)
        codes = [w.proc.returncode for w in workers]
        rec["exit_codes"] = codes
        oom = [s.oom_kills() for s in slots]
        rec["cgroup_oom_kills"] = oom if cap.kind.startswith("cgroup") else None
        rec["cgroup_peak_bytes"] = [s.cgroup_peak() for s in slots] if cap.kind.startswith("cgroup") else None
        rec["init"] = next((m.get("init") for m in msgs[0] if m.get("built")), None)  # meta or eager
        dones = [next((m for m in msgs[r] if m.get("done")), None) for r in range(world)]
        ooms = [next((m for m in msgs[r] if "oom" in m), None) for r in range(world)]
        each = [m["peak_rss_each_bytes"] if m else None for m in dones]
        rec["worker_peak_rss_bytes"] = [e[0] if e else None for e in each]  # the worker process itself
        rec["worker_processes_peak_rss_bytes"] = each  # the worker, then what it started (luwu: its engine)
        # summed peaks count shared memory (a luwu worker's /dev/shm rings with its engine) once per process
        rec["worker_tree_peak_rss_bytes"] = [sum(e) if e else None for e in each]
        # what is held to the cap: with no enforcement, each worker with the processes it started (their
        # summed peaks: an upper bound); else (the cgroup held them jointly, or RLIMIT_AS each) each process
        rec["worker_capped_peak_bytes"] = [(sum(e) if cap.kind == "measured" else max(e)) if e else None for e in each]
        peaks = [p for p in rec["worker_capped_peak_bytes"] if p is not None]
        if cap.kind == "rlimit-as" and not any(ooms):  # too little address space to start, or an allocator that aborts
            hit = next((w.name for w in workers if w.proc.returncode not in (0, None) and w.log is not None
                        and any(m in _read(w.log) for m in _NO_MEMORY)), None)
            if hit is not None:
                ooms = [{"oom": f"{hit} ran out of address space (RLIMIT_AS): see its log"}]
        if any(oom) or any(ooms):
            rec["reason"] = "oom"
            rec["detail"] = next((m["oom"] for m in ooms if m), f"OOM-killed by the cgroup's limit (ranks {oom})")
        elif rec["reason"] is None and all(dones):
            if max(peaks) > cap.limit:  # a cgroup does not charge pages another cgroup brought in (shared libraries)
                rec["reason"] = "over-cap"
                rec["detail"] = f"peak RSS {max(peaks)} B > cap {cap.limit} B (measured after the run)"
            else:
                rec["fits"], rec["reason"] = True, "fits"
        elif rec["reason"] is None:
            rec["reason"] = "error"
            bad = next((w for w in workers if w.proc.returncode not in (0, None)), workers[0])
            rec["detail"] = f"{bad.name} exited {bad.proc.returncode}{bad.log_hint()[-1500:]}"
        if all(dones):
            steps = [max(m["seconds"][i] for m in dones if m) for i in range(int(spec["steps"]))]  # the slowest rank's
            timed = steps[1:] or steps  # the first step warms up (allocations, the node's first pulls)
            tokens = sum(int(m["tokens_per_step"]) for m in dones if m)
            rec["step_seconds"] = steps
            rec["tokens_per_s"] = tokens * len(timed) / sum(timed)
            rec["losses"] = [m["losses"] for m in dones if m]
            if system == "luwu":  # ModelInNetwork's own accounting: resident bytes by kind, malloc's heap
                rec["mnn_memory"] = [m.get("mnn_memory") for m in dones if m]
    except LineChild.Error as e:
        rec["reason"], rec["detail"] = "error", str(e)[-2000:]
    finally:
        for w in workers:
            w.stop(grace=1.0)
        if net is not None:
            net.tell("stop")
            try:
                rep = net.expect("done", time.monotonic() + NET_REPORT)
                rec["node"] = {k: rep.get(k) for k in ("proc_io", "node_io", "peak_rss_bytes", "node_stats")}
            except LineChild.Error as e:
                rec.setdefault("node", {"error": str(e)[-1000:]})
            net.stop()
        for s in slots:
            s.close()
    rec["wall_s"] = time.monotonic() - t0
    return rec
