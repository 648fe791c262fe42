"""transformers' Trainer and accelerate train on the luwu backend, 2 ranks on CPU, with the one-line
workaround of docs/backend.md ("Accelerate and Trainer"): both pick Gloo themselves for a CPU job
(accelerate's `_prepare_backend` hard-codes it, and refuses another name), so the script creates
the luwu group first and they use it. Each rank trains a tiny model built from a config on its own
data for two steps; DDP's gradient sums through luwu keep the replicas identical."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

COMMON = r"""
import json, os, sys, warnings
import torch
import torch.distributed as dist
warnings.filterwarnings("ignore")
torch.manual_seed(0)
dist.init_process_group("luwu")  # the workaround: before accelerate or the Trainer choose a backend
rank = dist.get_rank()
"""

TRAINER = COMMON + r"""
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
model = LlamaForCausalLM(cfg)
before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 12), generator=g)]
args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, max_steps=2, per_device_train_batch_size=2,
                         learning_rate=0.1, report_to=[], save_strategy="no", logging_steps=1,
                         dataloader_num_workers=0, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
out = trainer.train()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
print("RESULT " + json.dumps({"backend": dist.get_backend(), "steps": out.global_step, "loss": out.training_loss,
                              "wrapped": type(trainer.model_wrapped).__name__, "params": flat[:64].tolist(),
                              "moved": float((flat - before).abs().sum())}), flush=True)
dist.destroy_process_group()
"""

ACCELERATE = COMMON + r"""
from accelerate import Accelerator
acc = Accelerator(cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + rank)
x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
model, opt, loader = acc.prepare(model, opt, loader)
for xb, yb in loader:  # 2 steps
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
flat = torch.cat([p.detach().flatten() for p in acc.unwrap_model(model).parameters()])
print("RESULT " + json.dumps({"backend": dist.get_backend(), "processes": acc.num_processes,
                              "wrapped": type(model).__name__, "params": flat.tolist(),
                              "moved": float((flat - before).abs().sum())}), flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_like(script: str, tmp_path, world: int = 2) -> list[dict]:
    """`script` on `world` ranks with torchrun's environment (env:// rendezvous); each rank's RESULT."""
    port = str(_free_port())
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if k != "LUWU_NO_BACKEND"}
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   LUWU_WORKDIR=str(tmp_path / f"luwu{r}"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        procs.append(subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "out")], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=240)
            assert p.returncode == 0, stderr[-4000:]
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            assert lines, stdout[-2000:] + stderr[-2000:]
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


def test_trainer_trains_on_luwu(tmp_path):
    res = _torchrun_like(TRAINER, tmp_path)
    for out in res:
        assert out["backend"] == "luwu"
        assert out["steps"] == 2 and out["loss"] == out["loss"] and out["loss"] > 0  # finite, not NaN
        assert out["wrapped"] == "DistributedDataParallel"
        assert out["moved"] > 0  # it trained
    assert res[0]["params"] == res[1]["params"]  # different data, one model: the gradients were summed


def test_accelerate_trains_on_luwu(tmp_path):
    res = _torchrun_like(ACCELERATE, tmp_path)
    for out in res:
        assert out["backend"] == "luwu" and out["processes"] == 2
        assert out["wrapped"] == "DistributedDataParallel"
        assert out["moved"] > 0
    assert res[0]["params"] == res[1]["params"]
