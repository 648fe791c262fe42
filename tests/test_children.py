"""dataplane/process/children.py, the one helper every launcher uses for its children: a child dies with
its parent even when the parent is SIGKILLed, `stop` ends a process group for sure, and
`LineChild.expect` returns a daemon's ready line or says which child failed, how, and where its
log is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from luwu.dataplane.process import children


def _line_child(tmp_path, code: str) -> children.LineChild:
    log = tmp_path / "child.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    return children.LineChild("the test daemon", proc, log)


def test_expect_returns_the_ready_line_after_other_output(tmp_path):
    child = _line_child(tmp_path, "import json, time\nprint('starting up')\nprint(json.dumps({'event': 'progress'}))\n"
                                  "print(json.dumps({'ready': True, 'port': 7}), flush=True)\ntime.sleep(30)")
    try:
        msg = child.expect("ready", time.monotonic() + 20)
        assert msg == {"ready": True, "port": 7}
        assert "starting up" in child.lines
    finally:
        assert child.stop(grace=1) is not None
    assert not child.alive()


def test_a_child_that_exits_before_ready_is_named_with_its_code_and_log(tmp_path):
    child = _line_child(tmp_path, "import sys\nsys.stderr.write('bad --port: no such interface\\n')\nsys.exit(3)")
    with pytest.raises(RuntimeError) as err:
        child.expect("ready", time.monotonic() + 20)
    msg = str(err.value)
    assert "the test daemon exited (3) before 'ready'" in msg, msg
    assert str(tmp_path / "child.log") in msg and "bad --port: no such interface" in msg, msg


def test_an_error_line_is_raised_as_the_childs_error(tmp_path):
    child = _line_child(tmp_path, "import json, time\nprint(json.dumps({'event': 'error', 'error': 'no switch'}), "
                                  "flush=True)\ntime.sleep(30)")
    try:
        with pytest.raises(RuntimeError, match="the test daemon: no switch"):
            child.expect("ready", time.monotonic() + 20)
    finally:
        child.stop(grace=1)


SLEEPER = {"command": "[sys.executable, '-c', 'import time; time.sleep(60)']",
           # a python_module child runs in the prelude's own interpreter (no exec)
           "module": "children.python_module('timeit', '-n', '1', '-r', '1', 'import time; time.sleep(60)')"}


@pytest.mark.parametrize("kind", sorted(SLEEPER))
def test_a_child_dies_with_its_parent_even_by_sigkill(tmp_path, kind):
    pid_file = tmp_path / "grandchild.pid"
    # the parent starts a long sleeper with die_with_parent, writes its pid, then waits forever
    parent_code = (
        "import subprocess, sys\n"
        "from luwu.dataplane.process import children\n"
        f"p = subprocess.Popen(children.die_with_parent({SLEEPER[kind]}))\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "p.wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the parent never started its child"
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 20
    while _alive(grandchild):
        assert time.monotonic() < deadline, f"pid {grandchild} outlived its SIGKILLed parent"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")


def test_cpu_seconds_counts_every_thread_of_a_child_including_exited_ones():
    """What the benchmarks and the demo's cpu_per_step read: a child that burned 0.3 s of CPU in
    a thread that has ended, then 0.1 s in its main thread, is charged for both, and the figure
    never goes down; a process that is gone reads 0.0."""
    script = ("import threading, time, sys\n"
              "def burn(t):\n"
              "    end = time.process_time() + t\n"
              "    while time.process_time() < end:\n"
              "        pass\n"
              "th = threading.Thread(target=burn, args=(0.3,)); th.start(); th.join()\n"
              "burn(0.1)\n"
              "print('done', flush=True)\n"
              "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        readings = []
        line = ""
        while not line:
            readings.append(children.cpu_seconds(proc.pid))
            line = proc.stdout.readline()
        readings.append(children.cpu_seconds(proc.pid))
        assert line.strip() == "done"
        assert readings == sorted(readings) and readings[-1] >= 0.4
        assert proc.pid in children.descendants(os.getpid())
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert children.cpu_seconds(proc.pid) == 0.0


@pytest.mark.parametrize("prelude", [False, True], ids=["python_module", "py310-runpy-prelude"])
def test_python_module_ignores_a_luwu_folder_in_the_current_directory(tmp_path, prelude):
    # a repository root (or any folder) holding luwu/ must not shadow the installed package
    decoy = tmp_path / "luwu"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("import sys\nprint('the decoy luwu/ was imported')\nsys.exit(3)\n")
    argv = ([sys.executable, "-c", children._SAFE_PATH_PRELUDE, "luwu.cli", "--version"] if prelude
            else children.python_module("luwu.cli", "--version"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    plain = subprocess.run([sys.executable, "-m", "luwu.cli", "--version"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 3, "the decoy must shadow a plain `python -m` (else this test shows nothing)"
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "decoy" not in out.stdout and out.stdout.strip().startswith("luwu ")


@pytest.mark.parametrize("args", [("--version",), ("no-such-command",)])
def test_a_module_under_die_with_parent_runs_as_python_m_runs_it(args):
    """Same output, errors and exit status as `python -P -m` (the runpy prelude, one interpreter)."""
    plain = subprocess.run(children.python_module("luwu.cli", *args), capture_output=True, text=True, timeout=120)
    argv = children.die_with_parent(children.python_module("luwu.cli", *args))
    assert argv[:3] == [sys.executable, "-P", "-c"]
    wrapped = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert (wrapped.returncode, wrapped.stdout, wrapped.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert plain.returncode == (0 if args == ("--version",) else 2)
