"""LocalNetwork's read-outs on a real loopback deployment (a switch process and an optimizer node):
the switch's counters and the nodes' control addresses while it runs, and a clear error, not a
None where a dict was promised, once the switch is gone."""

from __future__ import annotations

import pytest

from luwu.worker.model_in_network.local import LocalNetwork


def test_counters_while_running_and_a_clear_error_once_the_switch_is_gone(tmp_path):
    with LocalNetwork(1, 1, mode="tofino", state_dir=tmp_path) as net:
        counters = net.counters()
        assert set(counters) >= {"drops", "events", "rx_types"}
        assert net.controls == [f"unix:{tmp_path}/node0.sock"]
        net.switch.stop()
        with pytest.raises(RuntimeError, match="loopback switch is not running"):
            net.counters()
