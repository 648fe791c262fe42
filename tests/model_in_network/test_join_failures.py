"""A failure at join on one rank is named on every rank (issue 26): two workers on a real loopback
network (a software switch and an optimizer node in this process, embedded engines). Before, the
other rank waited out its timeout in the start barrier and said only that an allreduce did not
complete. Each case gives the ranks a 60 s timeout, so that behaviour fails the test (it would
then end in a TimeoutError, not the JoinError the test asks for)."""

from __future__ import annotations

import tempfile
import threading
import time

import pytest
import torch
from mnn_reference import run_ranks_in_threads

from luwu.demo.model import GPTConfig, build
from luwu.worker.model_in_network import AdamW, ModelInNetwork
from luwu.worker.model_in_network.job import JoinError
from luwu.worker.model_in_network.local import LocalNetwork

CFG = GPTConfig(vocab=40, d_model=16, n_layers=2, n_heads=2, context=8, attn_bias=False)
TIMEOUT = 60.0  # the ranks' own timeout: the old behaviour waits it out
WAIT = 120.0  # the test's bound on each rank's thread


def _join_both(net: LocalNetwork, models: list[torch.nn.Module], units: list | None = None, store=None) -> dict:
    """Start ModelInNetwork on both ranks at once; {rank: the exception it raised, or None}."""
    results: dict[int, BaseException | None] = {}
    go = threading.Barrier(2, timeout=WAIT)

    def work(rank: int) -> None:
        go.wait()
        try:
            kw = {} if units is None or units[rank] is None else {"units": units[rank]}
            mnn = ModelInNetwork(models[rank], AdamW(lr=1e-3), net.network(rank), engine="embedded",
                                 timeout=TIMEOUT, store=store, **kw)
            mnn.close()
            results[rank] = None
        except BaseException as e:  # noqa: BLE001 - checked below
            results[rank] = e

    run_ranks_in_threads(work, 2, WAIT)
    assert set(results) == {0, 1}, f"a rank did not finish within {WAIT} s: {results}"
    return results


@pytest.mark.parametrize("barrier", ["engine", "store"])
def test_a_rank_that_cannot_cut_its_model_is_named_on_the_other_rank(tmp_path, barrier, monkeypatch):
    """Rank 1 fails before it has an engine (its units name no submodule); rank 0 raises JoinError
    naming rank 1 and the cause (through the engine's allreduce, or a c10d store), and rank 1
    raises its own error. The engine rank 1 opens to report its failure leaves no work directory
    behind once the report is done."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where mkdtemp puts the ranks' work directories
    store = torch.distributed.HashStore() if barrier == "store" else None
    with LocalNetwork(2, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net:
        models = [build(CFG, 0), build(CFG, 0)]
        got = _join_both(net, models, units=[None, ["no_such_module"]], store=store)
    assert isinstance(got[0], JoinError), repr(got[0])
    assert "rank 1 failed at join" in str(got[0]) and "no_such_module" in str(got[0])
    assert "no_such_module" in str(got[1]) and not isinstance(got[1], JoinError)
    deadline = time.monotonic() + WAIT  # the failure report runs on in a daemon thread until acknowledged
    while list(tmp.glob("luwu-mnn-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(tmp.glob("luwu-mnn-*")), sorted(p.name for p in tmp.iterdir())


def test_a_node_that_refuses_the_job_is_named_on_every_rank(tmp_path):
    """Rank 0 hands the node a job its RAM budget cannot hold (the issue's case): the node's refusal
    reaches rank 1 as rank 0's failure, with the node's own words."""
    with LocalNetwork(2, 1, mode="tofino", state_dir=tmp_path, switch_process=False, node_ram=16 << 10) as net:
        models = [build(CFG, 0), build(CFG, 0)]
        got = _join_both(net, models)
    assert got[0] is not None and "too small" in str(got[0]) and not isinstance(got[0], JoinError)
    assert isinstance(got[1], JoinError), repr(got[1])
    assert "rank 0 failed at join" in str(got[1]) and "ram_budget 16384 bytes is too small" in str(got[1])


def test_ranks_that_built_different_models_are_told_which_rank_differs(tmp_path):
    with LocalNetwork(2, 1, mode="tofino", state_dir=tmp_path, switch_process=False) as net:
        other = GPTConfig(vocab=40, d_model=16, n_layers=2, n_heads=2, context=8, attn_bias=True)
        got = _join_both(net, [build(CFG, 0), build(other, 0)])
    for r in (0, 1):
        assert isinstance(got[r], JoinError), repr(got[r])
        assert "rank(s) [1] joined with a model other than rank 0's" in str(got[r])
