"""Run by tests/core/watch/test_watch.py under torchrun: a plain DDP loop over gloo, watched; rank 1's
``body.2.lin`` output gets a NaN at step 2. Every rank writes its record into argv[1] and
prints what NonFiniteError said."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gpudiag
from tests.core.watch.test_watch import Net
from tests.helpers.models import poison

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = Net()
poison(net.body[2].lin, lambda: rank == 1 and watcher.step == 2)
model = DistributedDataParallel(net)
watcher = gpudiag.watch(model, record_dir=sys.argv[1])
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
try:
    for _ in range(5):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
except gpudiag.NonFiniteError as exc:
    print(f"rank {rank}: {exc}")
watcher.close()
dist.destroy_process_group()
