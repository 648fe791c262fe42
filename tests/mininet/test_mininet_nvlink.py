"""The emulated NVLink exchange on loopback: shards, and the hierarchical allreduce of one server's GPUs."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from luwu.mininet.nvlink import NvlinkError, NvlinkPeers, hierarchical_allreduce, shard_bounds

WAIT = 30.0  # s any exchange may take on a loaded machine


def test_shards_cover_the_tensor_once():
    for numel, parts in [(10, 3), (3, 3), (7, 1), (1000, 8)]:
        b = shard_bounds(numel, parts)
        assert b[0][0] == 0 and b[-1][1] == numel
        assert all(b[i][1] == b[i + 1][0] for i in range(parts - 1))
        sizes = [hi - lo for lo, hi in b]
        assert max(sizes) - min(sizes) <= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_server_sums_over_its_gpus_and_every_gpu_gets_the_whole_sum():
    """Three GPUs of one server: with a single server the rail step sums one contribution, so the
    result is exactly the server's sum; it must reach every GPU in full, int32 wrap-around included."""
    gpus, numel = 3, 10_001
    addrs = [f"127.0.0.{k + 2}" for k in range(gpus)]
    port = _free_port()
    rng = np.random.default_rng(5)
    xs = [rng.integers(-(2**31), 2**31, numel, dtype=np.int64).astype(np.int32) for _ in range(gpus)]
    want = np.sum([x.astype(np.int64) for x in xs], axis=0).astype(np.int32)
    peers = [NvlinkPeers(k, addrs, port, WAIT) for k in range(gpus)]
    out, errors = [None] * gpus, []
    rail_calls = []

    def gpu(k):
        try:
            peers[k].connect()
            out[k], _phases = hierarchical_allreduce(peers[k], xs[k], lambda part: rail_calls.append(part.size) or part)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=gpu, args=(k,)) for k in range(gpus)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 3)
    finally:
        for p in peers:
            p.close()
    assert not errors, errors
    assert sorted(rail_calls) == sorted(hi - lo for lo, hi in shard_bounds(numel, gpus))
    for got in out:
        np.testing.assert_array_equal(got, want)


def test_a_missing_peer_is_a_clear_error():
    addrs = ["127.0.0.2", "127.0.0.3"]
    lonely = NvlinkPeers(0, addrs, _free_port(), timeout=0.5)
    try:
        with pytest.raises(NvlinkError, match="cannot reach GPU 1"):
            lonely.connect()
    finally:
        lonely.close()
