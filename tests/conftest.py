"""For every test run: the daemons' default state folder ($XDG_STATE_HOME/luwu, where `luwu switch`
appends its P4Runtime audit log when no --audit-log is given) is a temporary folder, removed when
the run ends, so that tests write nothing into the user's home. Set at import, before any test
module copies os.environ for its subprocesses."""

from __future__ import annotations

import os
import shutil
import tempfile

_STATE = tempfile.mkdtemp(prefix="luwu-test-state-")
os.environ["XDG_STATE_HOME"] = _STATE


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_STATE, ignore_errors=True)
