"""Model-in-network training of a stock torch model, on one machine.

    python examples/model_in_network.py --workers 2 --steps 30

Starts a software switch and an optimizer node on loopback (`LocalNetwork`, no controller), then
N worker processes. Each builds an ordinary model from torch's own layers (embedding,
nn.TransformerEncoderLayer blocks, LayerNorm, Linear), wraps it in `ModelInNetwork` and trains:
no optimizer on the worker, parameters pulled per layer, gradients pushed into the network.
`luwu demo` is the full version (controller, DDP baseline, report and plots).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


class TinyLM:
    """Built lazily in the worker (torch is imported there)."""

    @staticmethod
    def build(vocab: int, d: int, layers: int, heads: int, seed: int):
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(vocab, d)
                self.layers = nn.ModuleList(
                    nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
                    for _ in range(layers))
                self.norm = nn.LayerNorm(d)
                self.head = nn.Linear(d, vocab)

            def forward(self, x):
                mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
                h = self.embed(x)
                for layer in self.layers:
                    h = layer(h, src_mask=mask, is_causal=True)
                return self.head(self.norm(h))

        torch.manual_seed(seed)
        return Model()


def batch(step: int, rank: int, workers: int, rows: int, length: int, vocab: int):
    """Sequences counting up modulo `vocab` from random starts: easy to learn, easy to check."""
    import torch

    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, vocab, (rows, 1), generator=g)
    seq = (starts + torch.arange(length + 1)) % vocab
    seq = seq[rank::workers]
    return seq[:, :-1], seq[:, 1:]


def worker(rank: int, args, network_json: str, out) -> None:
    import torch
    import torch.nn.functional as F

    import luwu
    from luwu.train import ModelInNetwork

    torch.set_num_threads(1)
    model = TinyLM.build(args.vocab, args.d_model, args.layers, args.heads, seed=0)
    mnn = ModelInNetwork(model, optimizer=luwu.AdamW(lr=3e-3), network=network_json)
    try:
        for step in range(args.steps):
            x, y = batch(step, rank, args.workers, args.batch, args.length, args.vocab)
            loss = F.cross_entropy(mnn(x).reshape(-1, args.vocab), y.reshape(-1))
            loss.backward()
            mnn.step()
            if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
        out.put((rank, mnn.report()))
    finally:
        mnn.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="global batch (rows split over the workers)")
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    args = p.parse_args()

    from luwu.train import LocalNetwork

    ctx = mp.get_context("spawn")
    with LocalNetwork(workers=args.workers, nodes=1) as net:
        out = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, args, net.network(r).to_json(), out)) for r in range(args.workers)]
        for proc in procs:
            proc.start()
        reports = dict(out.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join(60)
    mem = reports[0]["memory"]
    print(f"model {reports[0]['model_bytes'] / 2**20:.2f} MiB in {reports[0]['units']} units; worker 0 held at most "
          f"{mem['peak_bytes'] / 2**20:.2f} MiB of model state (no optimizer state); traffic "
          f"{reports[0]['engine']['socket']['tx_bytes'] / 2**20:.1f} MiB out, "
          f"{reports[0]['engine']['socket']['rx_bytes'] / 2**20:.1f} MiB in")


if __name__ == "__main__":
    main()
