"""`luwu bench integrity` (luwu/bench/integrity.py): the revision it compares with is really the
one its processes import, and bad input is one line on stderr with exit 2. No assertion on the
figures (the machine is shared); a whole run is minutes, so only its parts run here."""

from __future__ import annotations

import subprocess
import sys

from luwu.bench.integrity import extract_revision


def test_the_before_revision_is_laid_out_as_luwu_and_imported_from_there(tmp_path):
    root = extract_revision("HEAD", tmp_path / "x")
    assert (root / "luwu" / "cli.py").is_file() and (root / "luwu" / "dataplane" / "protocol.py").is_file()
    assert (root / "luwu" / "dataplane" / "engine" / "engine.py").is_file()  # nested packages come along
    work = tmp_path / "cwd"
    work.mkdir()
    code = "import luwu.dataplane.protocol as p, luwu.bench.allreduce as a; print(p.__file__); print(a.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=work, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    files = out.stdout.split()
    assert files and all(f.startswith(str(root)) for f in files), files


def test_bad_input_is_one_line_and_exit_2():
    for argv in (["--before", "none"], ["--off-env", "NOEQUALS"], ["--before", "no-such-revision-x", "--rounds", "1"],
                 ["--size", "0", "--before", "none", "--off-env", "A=1"]):
        p = subprocess.run([sys.executable, "-m", "luwu.cli", "bench", "integrity", *argv], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2, (argv, p.stderr[-300:])
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
