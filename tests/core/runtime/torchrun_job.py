"""Run by tests/core/runtime/test_runtime_ddp.py under torchrun: DDP through the runtime's launcher,
which joins the torchrun group instead of starting ranks. Rank 0 prints JSON."""

import json
import os

from gpudiag.runtime import DeviceSet, RunConfig, run
from tests.helpers import models

x, y = models.batch(8)
result = run(models.mlp, x, y, RunConfig("ddp", DeviceSet.virtual(2), steps=2, track_params=True))
if os.environ["RANK"] == "0":
    print(
        json.dumps(
            {"losses": result.losses, "rank_losses": result.rank_losses, "digests": result.rank_digests}
        )
    )
