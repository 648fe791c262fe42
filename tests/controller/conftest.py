"""Fixtures for controller tests: software switches serving P4Runtime on loopback, fake P4Runtime
servers and an in-process controller with a temporary database."""

from __future__ import annotations

from pathlib import Path

import pytest
from ctl_helpers import ADMIN, LANES, SLOTS
from fake_p4runtime import serve_fake

from luwu.controller.client import ControllerClient
from luwu.controller.config import ControllerConfig
from luwu.controller.server import BackgroundController
from luwu.p4 import P4INFO_TXTPB


@pytest.fixture(scope="session")
def p4info() -> Path:
    path = Path(P4INFO_TXTPB)
    if not path.exists():
        pytest.fail(f"the committed P4Info {path} is missing: run `luwu p4 generate`")
    return path


@pytest.fixture
def software_switch(p4info):
    """factory(name) -> (SoftwareSwitch, P4Runtime address); all stopped at teardown."""
    from luwu.dataplane.switch import SoftwareSwitch, SwitchConfig
    from luwu.dataplane.switch.p4runtime_server import serve

    handles = []

    def make(lanes: int = LANES, slots: int = SLOTS):
        sw = SoftwareSwitch(SwitchConfig(lanes=lanes, slots=slots))
        handle = serve(sw, "127.0.0.1:0", p4info, device_id=0)
        handles.append(handle)
        return sw, handle.address

    yield make
    for h in handles:
        h.stop()


@pytest.fixture
def fake_switch():
    """factory() -> (FakeP4Runtime, address)."""
    handles = []

    def make():
        fake, handle = serve_fake()
        handles.append(handle)
        return fake, handle.address

    yield make
    for h in handles:
        h.stop()


@pytest.fixture
def controller_config(tmp_path, p4info) -> ControllerConfig:
    return ControllerConfig(listen="127.0.0.1:0", db=str(tmp_path / "controller.sqlite"), admin_token=ADMIN,
                            p4info=str(p4info), health_timeout=60.0, meta_pool=32, data_pool=128, node_pool=128,
                            program_timeout=15.0, reconcile_interval=0)  # drift tests run their rounds themselves


@pytest.fixture
def controller(controller_config):
    """An in-process controller; yields (BackgroundController, admin ControllerClient)."""
    bc = BackgroundController(controller_config)
    client = ControllerClient(bc.address, ADMIN)
    try:
        yield bc, client
    finally:
        client.close()
        bc.stop()
