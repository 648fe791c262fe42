"""The embedded plan's software switch, hosted in a child process of rank 0.

`SwitchHost.start(plan, workdir)` runs `python -m luwu.worker.backend.switch_host`, which starts a
`LoopbackSwitch` for the `StarPlan` it reads on stdin, answers with the bound switch ports, and then
serves `counters` / `stop` lines until its stdin closes (so it never outlives rank 0). A plain
subprocess rather than multiprocessing's spawn: spawn re-imports the user's `__main__`, which for a
torchrun training script without a `__main__` guard would run the training again in the switch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from .plan_codec import star_plan_from_json, star_plan_to_json

READY_TIMEOUT = 60.0  # s for the switch process to bind its ports
STOP_TIMEOUT = 10.0  # s for it to exit after `stop`


class SwitchHost:
    def __init__(self, proc: subprocess.Popen, log_path: str):
        self.proc = proc
        self.log_path = log_path
        self._lock = threading.Lock()

    @classmethod
    def start(cls, plan, workdir: str) -> "SwitchHost":
        log_path = os.path.join(workdir, "switch.log")
        log = open(log_path, "ab")
        env = dict(os.environ, OMP_NUM_THREADS="1", LUWU_NO_BACKEND="1")
        proc = subprocess.Popen([sys.executable, "-m", "luwu.worker.backend.switch_host"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        log.close()
        host = cls(proc, log_path)
        reply = host._ask(star_plan_to_json(plan), READY_TIMEOUT)
        if reply is None or "switch_ports" not in reply:
            host.stop()
            raise RuntimeError(f"the luwu software switch did not start (exit code {proc.poll()}); "
                               f"its log {log_path} says:\n{tail(log_path)}")
        plan.switch_ports.update({int(k): tuple(v) for k, v in reply["switch_ports"].items()})
        return host

    def _ask(self, line: str, timeout: float) -> dict | None:
        result: list = []

        def talk() -> None:
            try:
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
                answer = self.proc.stdout.readline()
                if answer:
                    result.append(json.loads(answer))
            except (OSError, ValueError):
                pass

        with self._lock:
            t = threading.Thread(target=talk, daemon=True)
            t.start()
            t.join(timeout)
        return result[0] if result else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def counters(self, timeout: float = 5.0) -> dict | None:
        return self._ask("counters", timeout) if self.alive() else None

    def stop(self) -> None:
        if self.alive():
            self._ask("stop", STOP_TIMEOUT)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT)


def tail(path: str, chars: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace").strip() or "(empty)"
    except OSError as e:
        return f"(cannot read it: {e})"


def main() -> int:
    from luwu.dataplane.loopback import LoopbackSwitch

    first = sys.stdin.readline()
    if not first:
        return 1
    plan = star_plan_from_json(first)
    switch = LoopbackSwitch(plan).start()
    print(json.dumps({"switch_ports": plan.switch_ports}), flush=True)
    try:
        for line in sys.stdin:  # EOF: rank 0 is gone
            cmd = line.strip()
            if cmd == "counters":
                print(json.dumps(switch.counters(), default=str), flush=True)
            elif cmd == "stop":
                print(json.dumps({"stopped": True}), flush=True)
                break
    finally:
        switch.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
