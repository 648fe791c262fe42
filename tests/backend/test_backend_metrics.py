"""LUWU_METRICS: every rank of a luwu job serves its engine's statistics to Prometheus at PORT +
rank (luwu.worker.metrics); a scrape after an all_reduce shows the packets its engine sent."""

from __future__ import annotations

import socket
import urllib.request

import torch
import torch.distributed as dist
from backend_harness import run_ranks


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            if base >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
            return base
    raise RuntimeError("no two consecutive free TCP ports")


def scrape_after_allreduce(rank: int, world: int) -> dict:
    import os

    from prometheus_client.parser import text_string_to_metric_families

    t = torch.ones(100_000)
    dist.all_reduce(t)
    port = int(os.environ["LUWU_METRICS"].rsplit(":", 1)[1]) + rank
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20).read().decode()
    samples = {(s.labels.get("engine", ""), s.labels.get("section", ""), s.labels.get("name", "")): s.value
               for fam in text_string_to_metric_families(text) if fam.name == "luwu_engine_stat" for s in fam.samples}
    dist.barrier()  # no rank leaves (closing its engine) while another still scrapes
    return {"sum": float(t[0]), "samples": {"|".join(k): v for k, v in samples.items()}}


def test_every_rank_serves_its_engine_metrics(tmp_path):
    base = _free_port_pair()
    results = run_ranks(scrape_after_allreduce, 2, tmp_path,
                        env={"LUWU_ENGINE": "embedded", "LUWU_METRICS": f"127.0.0.1:{base}"})
    for rank, res in enumerate(results):
        assert res["sum"] == 2.0
        mine = {k: v for k, v in res["samples"].items() if k.startswith(f"rank{rank}-group")}
        assert mine, sorted(res["samples"])[:10]
        assert mine[f"rank{rank}-group0|socket|tx_packets"] > 0, ", ".join(sorted(mine))
        assert any(k.endswith("send_stream.packets") and v > 0 for k, v in mine.items()), ", ".join(sorted(mine))
