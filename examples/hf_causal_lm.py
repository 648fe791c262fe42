"""A Hugging Face causal LM trained through ModelInNetwork, next to one process training it alone.

    python examples/hf_causal_lm.py --model gpt2 --steps 5 --workers 2 [--checkpointing]
    python examples/hf_causal_lm.py --model llama --meta --save /tmp/llama-trained
    python examples/hf_causal_lm.py --model llama --from-pretrained /tmp/llama-trained

Builds a tiny `transformers` model from a random config (no download): OPT (the paper's model
family), GPT-2, LLaMA or Qwen2 (grouped-query attention, RMSNorm, rotary), with the input embedding
and the output head tied (`--untied` unties LLaMA's). It starts a software switch and an optimizer
node on loopback (`LocalNetwork`) and trains the model unchanged on `--workers` ranks, each a
thread of this process with its own engine (a real job runs one process per rank, as
examples/model_in_network.py does): the HF model is called with keyword arguments and returns its
`ModelOutput`, the tied weight is one layer on the node, `--checkpointing` turns on HF's activation
checkpointing (each recomputed block pulls its parameters again). The same model trained by
torch.optim.AdamW in one process, on the same shards, gives the losses printed beside.

Never whole on a worker: `--meta` builds the model on the meta device and lets the network
initialise it, unit by unit (each unit's modules' own init under `torch.manual_seed(seed + unit)`);
`--from-pretrained DIR` streams a `save_pretrained` safetensors directory of the same `--model` to
the node unit by unit (`ModelInNetwork.from_pretrained`); `--save DIR` writes the trained model
back out in that format, one unit at a time. The one-process run starts from the same values.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

MODELS = ("opt", "gpt2", "llama", "qwen2")
DTYPES = ("fp32", "bf16")  # the model's dtype, and the dtype the node serves it in
LR, WEIGHT_DECAY = 1e-2, 0.1


def config(name: str, vocab: int = 96, hidden: int = 32, layers: int = 2, tied: bool = True):
    """A tiny random config of the `transformers` model family `name` (dropout off)."""
    import transformers as hf

    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tied)
    if name == "opt":
        return hf.OPTConfig(hidden_size=hidden, num_hidden_layers=layers, ffn_dim=2 * hidden, num_attention_heads=2,
                            max_position_embeddings=64, word_embed_proj_dim=hidden, dropout=0.0,
                            attention_dropout=0.0, **common)
    if name == "gpt2":
        return hf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0, **common)
    if name == "llama":
        return hf.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, **common)
    if name == "qwen2":
        return hf.Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **common)
    raise ValueError(f"unknown model {name!r}: choose from {', '.join(MODELS)}")


def build(name: str, seed: int = 0, checkpointing: bool | dict = False, initial: dict | None = None, **cfg: Any):
    """The model, seeded, in training mode; `checkpointing`: HF's activation checkpointing (True, or
    its kwargs such as {"use_reentrant": True}); `initial`: parameter values by name loaded into it."""
    import torch
    import transformers as hf

    c = config(name, **cfg)
    cls = {"opt": hf.OPTForCausalLM, "gpt2": hf.GPT2LMHeadModel, "llama": hf.LlamaForCausalLM,
           "qwen2": hf.Qwen2ForCausalLM}[name]
    torch.manual_seed(seed)
    model = cls(c).train()
    if initial is not None:
        model.load_state_dict(initial, strict=False)
    if checkpointing:
        kwargs = checkpointing if isinstance(checkpointing, dict) else None
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5; older: the alias
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def batch(step: int, rank: int, workers: int, rows: int = 4, length: int = 16, vocab: int = 96):
    """This rank's rows of step `step`'s batch: sequences counting up modulo `vocab`."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(3, vocab, (rows, 1), generator=g)
    return ((starts + torch.arange(length)) % vocab)[rank::workers]


def _groups(model):
    """torch AdamW groups as the node decays (LayerSpec no_decay="auto": tensors under 2 dimensions)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def reference(name: str, steps: int, workers: int, seed: int = 0, dtype: str = "fp32", initial: dict | None = None,
              **cfg: Any) -> dict:
    """One process, as ModelInNetwork computes: fp32 masters (from the model's own values) stepped
    by torch.optim.AdamW; each step the masters cast to the model's dtype (as the node serves them)
    compute each rank's shard in turn, whose gradients are widened to fp32 and averaged (as the
    switch sums and the node divides). Losses per rank and step, parameters by name in the model's
    dtype."""
    import torch

    work = build(name, seed, initial=initial, **cfg).to(_torch_dtype(dtype))
    master = {n: p.detach().float().clone().requires_grad_(True) for n, p in work.named_parameters()}
    named = dict(work.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for p in master.values() if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
                             {"params": [p for p in master.values() if p.dim() < 2], "weight_decay": 0.0}], lr=LR)
    losses: list[list[float]] = [[] for _ in range(workers)]
    for step in range(steps):
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(master[n])  # torch's cast: round to nearest even, as the node serves
        grads: dict[str, torch.Tensor] = {}
        for r in range(workers):
            x = batch(step, r, workers, vocab=work.config.vocab_size)
            loss = work(input_ids=x, labels=x, use_cache=False).loss
            loss.backward()
            for n, p in named.items():
                if p.grad is not None:
                    g = p.grad.float()
                    grads[n] = grads[n] + g if n in grads else g
                p.grad = None
            losses[r].append(loss.item())
        for n, m in master.items():
            m.grad = grads[n] / workers if n in grads else torch.zeros_like(m)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "params": {n: m.detach().to(_torch_dtype(dtype)) for n, m in master.items()}}


def _torch_dtype(dtype: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]


def build_meta(name: str, **cfg: Any):
    """The model on the meta device (no memory for its parameters), in training mode."""
    import torch
    import transformers as hf

    with torch.device("meta"):
        return hf.AutoModelForCausalLM.from_config(config(name, **cfg)).train()


def train(name: str, steps: int, workers: int, seed: int = 0, checkpointing: bool | dict = False, dtype: str = "fp32",
          state_dir: str | None = None, timeout: float = 300.0, meta: bool = False, init_from: str | None = None,
          save_to: str | None = None, initial: dict | None = None, **cfg: Any) -> dict:
    """ModelInNetwork on `workers` ranks (threads with embedded engines) on loopback. Per rank: its
    losses, its report; and rank 0's gathered parameters (`initial`: at version 0). `meta`: each
    rank builds the model on the meta device, the network initialises it (seed `seed`);
    `init_from`: a save_pretrained directory the initial values are streamed from; `save_to`: the
    trained model is written there (ModelInNetwork.save_pretrained); with `meta` too, each rank
    builds the model ModelInNetwork.from_pretrained(init_from); `initial`: parameter values by name
    loaded into the eagerly built models."""
    from luwu.worker.model_in_network import AdamW, ModelInNetwork
    from luwu.worker.model_in_network.local import LocalNetwork

    if meta and init_from is not None:
        models = [None] * workers  # ModelInNetwork.from_pretrained builds them
    elif meta:
        models = [build_meta(name, **cfg) for _ in range(workers)]
        if dtype != "fp32":
            models = [m.to(_torch_dtype(dtype)) for m in models]
        if checkpointing:
            for m in models:
                m.gradient_checkpointing_enable()
    else:
        models = [build(name, seed, checkpointing, initial, **cfg).to(_torch_dtype(dtype))  # torch's seed: here
                  for _ in range(workers)]
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="luwu-hf-") as tmp, \
            LocalNetwork(workers, 1, mode="tofino", state_dir=state_dir or tmp, switch_process=False) as net:
        def work(rank: int) -> None:
            mnn = None
            try:
                opt, kw = AdamW(lr=LR, weight_decay=WEIGHT_DECAY), {"served_dtype": dtype, "engine": "embedded",
                                                                        "timeout": timeout, "seed": seed}
                if models[rank] is None:
                    mnn = ModelInNetwork.from_pretrained(init_from, opt, net.network(rank), **kw)
                else:
                    mnn = ModelInNetwork(models[rank], opt, net.network(rank), init_from=init_from, **kw)
                initial = mnn.gather() if meta or init_from is not None else None  # the network's initial values
                losses = []
                for step in range(steps):
                    x = batch(step, rank, workers, vocab=mnn.module.config.vocab_size)
                    out = mnn(input_ids=x, labels=x, use_cache=False)  # keyword arguments, a ModelOutput back
                    out.loss.backward()
                    mnn.step()
                    losses.append(out.loss.item())
                if save_to is not None:
                    mnn.save_pretrained(save_to)
                results[rank] = {"losses": losses, "params": mnn.gather(), "report": mnn.report(),
                                 "initial": initial, "setup_memory": mnn.setup_memory}
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                results[rank] = e
            finally:
                if mnn is not None:
                    mnn.close()

        threads = [threading.Thread(target=work, args=(r,), name=f"rank{r}") for r in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    for r in range(workers):
        if isinstance(results.get(r), BaseException):
            raise results[r]
        if r not in results:
            raise TimeoutError(f"rank {r} did not finish within {timeout} s")
    return {"losses": [results[r]["losses"] for r in range(workers)], "params": results[0]["params"],
            "initial": results[0]["initial"], "reports": [results[r]["report"] for r in range(workers)],
            "setup_memory": [results[r]["setup_memory"] for r in range(workers)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="gpt2")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--checkpointing", action="store_true", help="HF activation checkpointing in every block")
    p.add_argument("--untied", action="store_true", help="untie the input embedding and the output head")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="the model's dtype, served so by the node")
    p.add_argument("--meta", action="store_true",
                   help="build the model on the meta device: the network initialises it unit by unit (its modules' "
                        "own init, seeded per unit), no worker ever holds it whole")
    p.add_argument("--from-pretrained", metavar="DIR",
                   help="start from a save_pretrained safetensors directory, streamed to the node unit by unit "
                        "(ModelInNetwork.from_pretrained; the one-process run loads it too)")
    p.add_argument("--save", metavar="DIR", help="write the trained model there (save_pretrained format, unit by unit)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.workers < 1 or 4 % args.workers:
        print("hf_causal_lm: --steps must be >= 1 and --workers one of 1, 2, 4 (the batch has 4 rows)",
              file=sys.stderr)
        return 2
    if args.from_pretrained is not None and not os.path.isdir(args.from_pretrained):
        print(f"hf_causal_lm: --from-pretrained {args.from_pretrained}: no such directory", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)  # the same reduction order in both runs
    tied = not args.untied
    meta = args.meta or args.from_pretrained is not None
    got = train(args.model, args.steps, args.workers, checkpointing=args.checkpointing, dtype=args.dtype, tied=tied,
                meta=meta, init_from=args.from_pretrained, save_to=args.save)
    # the one-process run starts from the values the network started from
    want = reference(args.model, args.steps, args.workers, dtype=args.dtype, tied=tied, initial=got["initial"])
    units = got["reports"][0]["units"]
    start = (f"streamed from {args.from_pretrained}" if args.from_pretrained else
             "built on meta, initialised by the network" if meta else "built whole on each worker")
    print(f"{args.model} ({'tied' if tied else 'untied'}, {args.dtype}), {args.workers} workers, {units} units on "
          f"the node; {start}")
    print("step  rank  ModelInNetwork  one process")
    for step in range(args.steps):
        for r in range(args.workers):
            print(f"{step:4d}  {r:4d}  {got['losses'][r][step]:14.6f}  {want['losses'][r][step]:11.6f}")
    worst = max(float((got["params"][n].float() - t.float()).abs().max()) for n, t in want["params"].items())
    print(f"largest parameter difference after {args.steps} steps: {worst:.2e}")
    if args.save:
        print(f"trained model written to {args.save} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
