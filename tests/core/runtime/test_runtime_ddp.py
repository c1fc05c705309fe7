"""Real DistributedDataParallel over gloo: equal to single, watched, broken, bounded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gpudiag.errors import InputError
from gpudiag.runtime import DeviceSet, RankFailure, RunConfig, run
from gpudiag.runtime.launch import launch
from tests.helpers import ROOT, models, within

TWO = DeviceSet.virtual(2)


#: multiprocessing's own helper, which lives as long as this process: the resource tracker.
HELPERS = (b"multiprocessing.resource_tracker",)


def children() -> list[int]:
    """Live (non-zombie) child processes of this process, from /proc, but for
    multiprocessing's helpers."""
    me = str(os.getpid())
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        mine = fields.get("PPid", "").strip() == me and not fields.get("State", "").startswith("Z")
        if mine and not any(helper in cmdline for helper in HELPERS):
            out.append(int(status.parent.name))
    return out


close = models.assert_close_dicts


def test_ddp_equals_single_for_a_mean_loss() -> None:
    x, y = models.batch(8)
    single = run(models.mlp, x, y, RunConfig("single", TWO, steps=2))
    ddp = run(models.mlp, x, y, RunConfig("ddp", TWO, steps=2, track_params=True))
    close(single.grads, ddp.grads)
    close(single.params, ddp.params, atol=1e-5)
    assert len(ddp.rank_digests) == 2 and ddp.rank_digests[0] == ddp.rank_digests[1]
    assert len(ddp.rank_losses) == 2
    assert children() == []


def test_ddp_on_a_real_torchvision_model() -> None:
    torchvision = pytest.importorskip("torchvision")

    def resnet18() -> torch.nn.Module:
        return torchvision.models.resnet18(num_classes=10).eval()  # BatchNorm on running stats

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    single = run(resnet18, x, y, RunConfig("single", TWO, optimizer="none"))
    ddp = run(resnet18, x, y, RunConfig("ddp", TWO, optimizer="none"))
    close(single.grads, ddp.grads, atol=1e-5)
    assert {b.rank for b in ddp.recorder.buckets} == {0, 1}


def test_no_sync_accumulation_equals_single() -> None:
    x, y = models.batch(8)
    single = run(models.mlp, x, y, RunConfig("single", TWO, accumulate=2))
    ddp = run(models.mlp, x, y, RunConfig("ddp", TWO, accumulate=2))
    close(single.grads, ddp.grads)
    assert {b.step for b in ddp.recorder.buckets} == {1}  # one all-reduce, after the last micro-batch


def test_find_unused_parameters() -> None:
    x, y = models.batch(8)
    ok = run(models.Unused, x, y, RunConfig("ddp", TWO, steps=2, find_unused_parameters=True, timeout=30))
    assert len(ok.losses) == 2
    with pytest.raises(RankFailure) as info:
        run(models.Unused, x, y, RunConfig("ddp", TWO, steps=2, timeout=30))
    assert info.value.code == "rank-crashed"
    assert "find_unused_parameters" in info.value.detail
    assert children() == []


def test_buckets_are_watched_and_a_fault_names_the_receiving_rank() -> None:
    x, y = models.batch(8)
    result = run(models.mlp, x, y, RunConfig("ddp", TWO, steps=2, faults=("0->1:nan@2",)))
    buckets = result.recorder.buckets
    assert {(b.step, b.rank) for b in buckets} == {(1, 0), (1, 1), (2, 0), (2, 1)}
    bad = [b for b in buckets if b.nonfinite_after]
    assert [(b.step, b.rank, b.nonfinite_before, b.faults) for b in bad] == [(2, 1, 0, ["0->1:nan@2"])]
    clean = [b for b in buckets if b.step == 1]
    assert all(b.norm_before > 0 and b.norm_after > 0 for b in clean)


def test_watching_off_uses_the_default_hook_and_records_nothing() -> None:
    x, y = models.batch(8)
    on = run(models.mlp, x, y, RunConfig("ddp", TWO))
    off = run(models.mlp, x, y, RunConfig("ddp", TWO, watch=False))
    assert off.recorder.events() == []
    close(on.grads, off.grads, atol=0)


def test_syncbatchnorm_is_skipped_on_cpu_with_a_reason() -> None:
    x, y = models.batch(8)
    result = run(models.bn_net, x, y, RunConfig("ddp", TWO, sync_batchnorm=True))
    (note,) = result.notes
    assert note.code == "syncbn-skipped" and "CPU" in note.message


def test_crashed_rank_is_a_finding_with_its_traceback_and_leaves_no_process() -> None:
    x, y = models.batch(8)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run(models.Crashes, x, y, RunConfig("ddp", TWO, timeout=60))
    assert info.value.code == "rank-crashed" and info.value.rank == 1
    assert "boom on rank 1" in info.value.detail and "Traceback" in info.value.detail
    assert info.value.exit_code == 1
    finding = info.value.to_finding()
    assert (finding.code, finding.severity, finding.evidence["rank"]) == ("rank-crashed", "error", 1)
    assert "boom on rank 1" in finding.evidence["detail"]
    assert time.monotonic() - start < within(idle_s=3.0)
    assert children() == []


def test_hung_rank_is_a_finding_after_the_timeout_and_leaves_no_process() -> None:
    x, y = models.batch(8)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run(models.Hangs, x, y, RunConfig("ddp", TWO, timeout=3))
    assert info.value.code == "rank-hung"
    assert "3 s" in str(info.value)
    assert 3 <= time.monotonic() - start < within(idle_s=6.0)  # (3.3 s at load 7)
    assert children() == []


def test_fresh_interpreter_ranks_are_reaped_when_they_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    launch_module = importlib.import_module(
        "gpudiag.runtime.launch"
    )  # (the package's `launch` is a function)
    started: list[int] = []
    real_close = launch_module.Ranks.close

    def close(self: Any) -> None:
        started.extend(p.pid for p in self.procs)
        real_close(self)

    monkeypatch.setattr(launch_module.Ranks, "close", close)
    monkeypatch.setenv("GPUDIAG_RANK_START", "subprocess")
    x, y = models.batch(8)
    with pytest.raises(RankFailure) as info:
        assert launch_module.start_method("gloo") == "subprocess"
        run(models.Hangs, x, y, RunConfig("ddp", TWO, timeout=8))
    assert info.value.code == "rank-hung"
    assert len(started) == 2
    assert children() == []


def _rank_bytes(rank: int, world: int) -> bytes:
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return f"{rank}:{t.item():g}".encode()


def test_launch_returns_bytes_in_rank_order() -> None:
    assert [r[:] for r in launch(_rank_bytes, 3, timeout=30)] == [b"0:6", b"1:6", b"2:6"]


def _rank_tensors(rank: int, world: int) -> list[bytes | memoryview]:
    from gpudiag.runtime.wire import pack

    return pack(
        {
            "rank": rank,
            "grads": {"w": torch.arange(6.0).reshape(2, 3) + rank, "b": torch.tensor([True, False])},
            "half": torch.tensor(1.5, dtype=torch.bfloat16),  # 0-dim, 2-byte elements
            "empty": torch.empty(0, 4, dtype=torch.int64),
            "losses": [0.5, float("nan"), float("inf")],
        }
    )


def test_packed_tensors_come_back_from_every_rank_bit_for_bit() -> None:
    from gpudiag.runtime.wire import unpack

    for rank, data in enumerate(launch(_rank_tensors, 2, timeout=30)):
        got = unpack(data)
        assert got["rank"] == rank
        assert torch.equal(got["grads"]["w"], torch.arange(6.0).reshape(2, 3) + rank)
        assert got["grads"]["b"].tolist() == [True, False]
        assert got["half"].dtype == torch.bfloat16 and got["half"].shape == () and got["half"].item() == 1.5
        assert got["empty"].shape == (0, 4) and got["empty"].dtype == torch.int64
        assert got["losses"][0] == 0.5 and math.isnan(got["losses"][1]) and got["losses"][2] == math.inf
        # The tensors are views of the one buffer the result was read into, not copies:
        # consecutive ones sit 64 bytes apart (w has 24 bytes, then padding).
        assert got["grads"]["b"].data_ptr() - got["grads"]["w"].data_ptr() == 64
    # Read-only bytes are accepted too (copied once).
    assert unpack(b"".join(_rank_tensors(1, 2)))["grads"]["w"][0, 0].item() == 1.0


def test_ranks_are_not_forked_beside_another_thread_or_a_cuda_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fork() beside a running thread can leave the child a lock that is never released,
    and a CUDA context does not survive it."""
    import threading

    from gpudiag.runtime.launch import start_method

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # whatever ran before here
    assert start_method("gloo") == "fork"
    assert start_method("nccl") == "subprocess"
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        assert start_method("gloo") == "subprocess"
    finally:
        stop.set()
        worker.join()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert start_method("gloo") == "subprocess"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("GPUDIAG_RANK_START", "subprocess")
    assert start_method("gloo") == "subprocess"
    monkeypatch.setenv("GPUDIAG_RANK_START", "spawn")
    with pytest.raises(InputError, match="GPUDIAG_RANK_START='spawn': expected auto or subprocess"):
        start_method("gloo")


def test_two_runs_at_once_do_not_collide() -> None:
    code = (
        "from gpudiag.runtime.launch import launch\n"
        "from tests.core.runtime.test_runtime_ddp import _rank_bytes\n"
        "print([r[:] for r in launch(_rank_bytes, 2, timeout=60)])\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(out.strip() == b"[b'0:3', b'1:3']" for out, _ in outs)


def test_torchrun_group_is_joined_instead_of_launching() -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node=2",
            str(Path(__file__).with_name("torchrun_job.py")),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    x, y = models.batch(8)
    local = run(models.mlp, x, y, RunConfig("ddp", TWO, steps=2))
    for got, want in zip(doc["rank_losses"], local.rank_losses, strict=True):
        assert got == pytest.approx(want)
    assert doc["digests"][0] == doc["digests"][1]


@pytest.mark.filterwarnings("error")
def test_ranks_do_not_inherit_a_warnings_as_errors_filter() -> None:
    x, y = models.batch(8)
    result = run(models.Warns, x, y, RunConfig("ddp", DeviceSet.virtual(2)))
    assert len(result.rank_losses) == 2
