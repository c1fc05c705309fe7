"""gpudiag.watch on the user's own loops: one device, DDP over gloo (2 forked ranks), the
runtime's DataParallel over virtual devices; a NaN injected in one module on one rank at a
chosen step must be named on every rank (rank, module, step, phase); clean runs report
nothing; close() leaves no hook."""

from __future__ import annotations

import json
import linecache
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpudiag
from gpudiag.runtime.launch import launch
from gpudiag.watch import NonFiniteError, read_records
from tests.helpers import ROOT, models


class Net(nn.Module):
    """A small model with nested paths: ``body.2.lin`` is a Linear inside a block."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), models.LinearNormBlock(), nn.Tanh())
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()
    )


def train(model: nn.Module, steps: int, seed: int = 1, accumulate: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    for _ in range(steps):
        for _ in range(accumulate):
            x = torch.randn(4, 8, generator=g)
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


# -- one device -----------------------------------------------------------------------


def test_single_device_names_module_and_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    models.poison(net.body[2].lin, lambda: watcher.step == 3)
    watcher = gpudiag.watch(net, "record", record_dir=tmp_path)
    train(net, 6)
    report = watcher.report
    assert report is not None
    assert (report.step, report.rank, report.module, report.phase) == (3, 0, "body.2.lin", "forward")
    assert "1 NaN/Inf of 64" in report.detail
    assert [e.step for e in watcher.events] == [3]  # the first only
    record = json.loads((tmp_path / "watch-rank0.json").read_text())
    assert record["schema"] == "gpudiag.watch/1" and record["module"] == "body.2.lin"
    assert list(read_records(tmp_path)) == ["watch-rank0.json"]
    watcher.close()


def test_raise_comes_out_of_backward_and_warn_warns(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    models.poison(net.head, lambda: watcher.step == 2)
    with gpudiag.watch(net, record_dir=False) as watcher, pytest.raises(NonFiniteError) as caught:
        train(net, 4)
    assert (caught.value.report.step, caught.value.report.module) == (2, "head")
    assert isinstance(caught.value, gpudiag.NonFiniteError)
    torch.manual_seed(0)
    net = Net()
    models.poison(net.body[0], lambda: watcher.step == 1)
    with (
        gpudiag.watch(net, "warn", record_dir=False) as watcher,
        pytest.warns(
            gpudiag.watch.NonFiniteWarning, match=r"step 1: arose on rank 0 \(cpu\) in body\.0"
        ) as warned,
    ):
        train(net, 3)
    # the warning points at the user's loss.backward() line, not into gpudiag or torch
    (warning,) = [w for w in warned if isinstance(w.message, gpudiag.watch.NonFiniteWarning)]
    assert warning.filename == __file__ and "backward()" in linecache.getline(
        warning.filename, warning.lineno
    )


def test_backward_fault_names_the_module_nearest_the_loss(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    watcher = gpudiag.watch(net, "record", record_dir=False)
    # the gradient leaving body.2.norm (towards body.2.lin) turns Inf: body.2.lin's weight
    # gradient is the first non-finite one in backward order
    models.poison(net.body[2].norm, lambda: watcher.step == 2, kind="grad")
    train(net, 4)
    report = watcher.report
    assert report is not None
    assert (report.step, report.phase, report.module) == (2, "backward", "body.2.lin")
    assert "gradient of body.2.lin." in report.detail


def test_loss_and_input_and_optimizer_phases(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    watcher = gpudiag.watch(net, "record", record_dir=False)
    x = torch.randn(4, 8)
    net(x).mean().backward()
    (net(x).mean() * float("nan")).backward()  # the loss outside the model
    assert watcher.report is not None and (watcher.report.module, watcher.report.phase) == (
        "<loss>",
        "backward",
    )
    assert watcher.report.step == 1
    watcher.close()

    watcher = gpudiag.watch(net, "record", record_dir=False)
    x[1, 2] = float("inf")
    net(x).mean().backward()
    assert watcher.report is not None and (watcher.report.module, watcher.report.phase) == (
        "<input>",
        "input",
    )
    watcher.close()

    net.zero_grad()
    watcher = gpudiag.watch(net, "record", record_dir=False)
    net(torch.randn(4, 8)).mean().backward()
    with torch.no_grad():
        net.body[2].lin.weight[0, 0] = float("nan")  # what a bad optimizer step leaves
    net(torch.randn(4, 8)).mean().backward()
    report = watcher.report
    assert report is not None
    assert (report.step, report.phase, report.module) == (0, "optimizer", "body.2.lin")
    assert "parameter body.2.lin.weight" in report.detail


def test_clean_run_reports_nothing_and_close_removes_every_hook(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    before = hook_count(net)
    watcher = gpudiag.watch(net, "raise", record_dir=tmp_path)
    assert hook_count(net) > before
    train(net, 5, accumulate=2)
    assert watcher.report is None and watcher.events == [] and watcher.step == 10
    watcher.close()
    assert hook_count(net) == before
    assert not list(tmp_path.iterdir())
    # no_grad forwards (evaluation) are not watched, and do not count as steps
    with gpudiag.watch(net) as watcher, torch.no_grad():
        net(torch.full((2, 8), float("nan")))
    assert watcher.report is None and watcher.step == 0


def test_grad_scaler_overflow_is_a_skip_not_a_fault() -> None:
    torch.manual_seed(0)
    net = Net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    models.poison(net.body[2].norm, lambda: watcher.step == 1, kind="grad")
    watcher = gpudiag.watch(net, "raise", scaler=scaler, record_dir=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(3):
        scaler.scale(net(torch.randn(4, 8)).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert watcher.report is None
    assert [(e.kind, e.step, e.module) for e in watcher.events] == [("scaler-skip", 1, "body.2.lin")]
    assert scaler.get_scale() < 2.0**10  # the scaler did skip it


def test_an_fp16_overflow_of_the_loss_gradient_is_the_scalers_skip() -> None:
    """fp16 outputs under autocast: scale × 2 overflows fp16 in the gradient flowing into
    the output; the scaler skips those steps and halves its scale — training goes on."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    scaler = torch.amp.GradScaler("cpu")  # 65536
    watcher = gpudiag.watch(net, "raise", scaler=scaler, record_dir=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(torch.randn(4, 8)).float().sum() * 2
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert watcher.report is None
    assert {e.kind for e in watcher.events} == {"scaler-skip"} and scaler.get_scale() < 65536


def test_eval_mode_forwards_keep_nothing_and_are_not_blamed() -> None:
    """A validation forward that forgot torch.no_grad(), on a NaN batch: kept by nothing,
    and the next (clean) training step is not blamed for it."""
    torch.manual_seed(0)
    net = Net()
    watcher = gpudiag.watch(net, "raise", record_dir=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(3):
        net.train()
        net(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        net.eval()
        bad = torch.randn(4, 8)
        bad[0, 0] = float("nan") if step == 1 else 0.0
        out = net(bad)
        assert watcher._trail == [] and all(kept is None for _, kept, _ in watcher._outputs)
        del out
    assert watcher.report is None and watcher.step == 3


def test_an_output_changed_in_place_later_is_not_blamed() -> None:
    """torchvision's BasicBlock adds the shortcut into bn2's output in place: a NaN from the
    downsample branch is named there, not at bn2."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=10)
    net.layer2[0].downsample[1].register_forward_hook(
        lambda m, i, o: o.index_fill(0, torch.tensor([0]), math.nan)
    )
    watcher = gpudiag.watch(net, "record", record_dir=False)
    torch.nn.functional.cross_entropy(net(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
    assert watcher.report is not None
    assert (watcher.report.module, watcher.report.phase) == ("layer2.0.downsample.1", "forward")


def test_compiled_model_says_what_it_cannot_see() -> None:
    torch.manual_seed(0)
    net = Net()
    compiled = torch.compile(net, backend="eager")
    watcher = gpudiag.watch(compiled, "record", record_dir=False)
    assert watcher.compiled and "torch.compile" in watcher.blind[0]
    x = torch.randn(4, 8)
    compiled(x).mean().backward()
    compiled(torch.full((4, 8), float("nan"))).mean().backward()
    report = watcher.report
    assert report is not None and report.step == 1 and report.phase == "input"
    assert report.blind and "torch.compile" in report.blind[0]
    watcher.close()
    assert hook_count(compiled) == 0


def test_bad_mode_is_an_input_error() -> None:
    from gpudiag.errors import InputError

    with pytest.raises(InputError, match="on_nonfinite"):
        gpudiag.watch(Net(), "explode")


def test_a_torch_without_the_end_of_backward_callback_is_refused_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watcher rests on autograd's queue_callback (torch internals): without it,
    watch() says so before any training, rather than failing inside a backward."""
    from gpudiag.errors import CannotRunHere

    engine = torch.autograd.Variable._execution_engine
    monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", object())
    with pytest.raises(CannotRunHere, match="end-of-backward callback"):
        gpudiag.watch(nn.Linear(2, 2))
    monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", engine)
    gpudiag.watch(nn.Linear(2, 2), record_dir=False).close()


def test_a_model_watched_twice_is_refused_until_the_first_is_closed() -> None:
    from gpudiag.errors import InputError

    net = Net()
    first = gpudiag.watch(net, record_dir=False)
    with pytest.raises(InputError, match="watched already"):
        gpudiag.watch(net, record_dir=False)
    first.close()
    gpudiag.watch(net, record_dir=False).close()


def test_callable_module_and_lazy_export() -> None:
    import gpudiag.watch.record as record

    assert callable(gpudiag.watch) and record.SCHEMA == "gpudiag.watch/1"
    with gpudiag.watch(Net(), record_dir=False) as w:
        assert w.placement == "single"


# -- DDP over gloo, two forked ranks ---------------------------------------------------


def _ddp_rank(
    rank: int, world: int, mode: str, bad_rank: int, bad_step: int, folder: str, accumulate: int, path: str
) -> bytes:
    torch.manual_seed(0)
    net = Net()
    ddp = _ddp_model(net, path)
    if bad_rank >= 0:
        models.poison(net.body[2].lin, lambda: rank == bad_rank and watcher.step == bad_step)
    watcher = _ddp_watch(ddp, path, mode, record_dir=folder)
    g = torch.Generator().manual_seed(10 + rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    error = None
    try:
        for _ in range(6):
            for micro in range(accumulate):
                x = torch.randn(4, 8, generator=g)
                if micro < accumulate - 1:
                    with ddp.no_sync():
                        ddp(x).pow(2).mean().backward()
                else:
                    ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    except NonFiniteError as exc:
        error = exc.report.to_json()
    report = watcher.report.to_json() if watcher.report is not None else None
    watcher.close()
    return json.dumps({"report": report, "error": error, "steps": watcher.step}).encode()


#: each way the watcher sees DDP gradients: (watch's comm_hook, DDP's gradient_as_bucket_view)
GRAD_PATHS = {
    "before-finalize": (None, False),  # the default
    "bucket-hook": (True, False),
    "tensor-hooks": (False, True),
}


def _ddp_model(net: nn.Module, path: str) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(net, gradient_as_bucket_view=GRAD_PATHS[path][1])


def _ddp_watch(ddp: Any, path: str, mode: str, **kwargs: Any) -> Any:
    watcher = gpudiag.watch(ddp, mode, comm_hook=GRAD_PATHS[path][0], **kwargs)
    assert watcher.grad_path == path
    return watcher


def _ddp(
    mode: str, bad_rank: int, bad_step: int, folder: Path, accumulate: int = 1, path: str = "before-finalize"
) -> list[dict[str, Any]]:
    args = (mode, bad_rank, bad_step, str(folder), accumulate, path)
    return [json.loads(bytes(b)) for b in launch(_ddp_rank, 2, args=args, timeout=120, method="fork")]


@pytest.mark.parametrize("path", GRAD_PATHS)
def test_ddp_every_rank_names_the_rank_module_and_step(tmp_path: Path, path: str) -> None:
    results = _ddp("raise", 1, 3, tmp_path, path=path)
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank} did not raise"
        assert (error["rank"], error["module"], error["step"], error["phase"]) == (
            1,
            "body.2.lin",
            3,
            "forward",
        )
        assert error["this_rank"] == rank and error["world_size"] == 2
        assert error["arrived"] is (rank == 0)  # rank 0 got it from the all-reduce
    assert "arrived through the all-reduce from rank 1" in results[0]["error"]["message"]
    records = read_records(tmp_path)
    assert sorted(records) == ["watch-rank0.json", "watch-rank1.json"]
    assert len({json.loads(r)["run"] for r in records.values()}) == 1  # one run, named alike


def test_records_an_earlier_run_left_are_not_taken_for_this_ones(tmp_path: Path) -> None:
    from gpudiag.watch.record import NonFiniteReport, write_record

    for rank in range(4):  # an earlier job of 4 ranks
        write_record(
            NonFiniteReport(1, 2, "cpu", "a", "forward", this_rank=rank, world_size=4, run="old"), tmp_path
        )
    for rank in range(2):  # this job of 2 ranks, in the same folder
        write_record(
            NonFiniteReport(5, 0, "cpu", "b", "backward", this_rank=rank, world_size=2, run="new"), tmp_path
        )
    records = read_records(tmp_path)
    assert sorted(records) == ["watch-rank0.json", "watch-rank1.json"]
    assert {json.loads(r)["run"] for r in records.values()} == {"new"}
    assert (tmp_path / "watch-rank3.json").exists()  # left where it is: gpudiag deletes nothing of it


@pytest.mark.parametrize("path", GRAD_PATHS)
def test_ddp_clean_run_and_no_sync_accumulation(tmp_path: Path, path: str) -> None:
    clean = _ddp("raise", -1, 0, tmp_path, accumulate=2, path=path)
    assert [r["report"] for r in clean] == [None, None] and [r["steps"] for r in clean] == [12, 12]
    assert not tmp_path.exists() or not list(tmp_path.iterdir())
    # a NaN in a no_sync micro-step (step 4 of 12) is agreed on at the next synchronised one
    results = _ddp("record", 0, 4, tmp_path, accumulate=2, path=path)
    for result in results:
        report = result["report"]
        assert (report["rank"], report["module"], report["step"]) == (0, "body.2.lin", 4)


# -- DataParallel ----------------------------------------------------------------------


def test_virtual_data_parallel_names_the_replica_and_the_transfer() -> None:
    from gpudiag.hw.sources import read_machine_or_capture
    from gpudiag.runtime.devices import DeviceSet
    from gpudiag.runtime.dp import VirtualDataParallel

    machine = read_machine_or_capture("seed_8gpu_topo.txt")
    torch.manual_seed(0)
    net = Net()
    dp = VirtualDataParallel(net, DeviceSet.virtual([5, 6], machine))
    models.poison(net.body[2].lin, lambda: watcher.step == 2 and dp.transport.replica == 6)
    watcher = gpudiag.watch(dp, "record", record_dir=False)
    train(dp, 4)
    report = watcher.report
    assert report is not None
    assert (report.step, report.module, report.phase, report.device) == (
        2,
        "body.2.lin",
        "forward",
        "virtual GPU6",
    )
    assert report.placement == "dp-virtual"
    assert report.transfer is not None
    assert (report.transfer.src, report.transfer.dst, report.transfer.kind) == ("GPU6", "GPU5", "gather")
    assert report.transfer.link == machine.cell("GPU6", "GPU5") and not report.transfer.corrupted


def test_virtual_data_parallel_names_a_corrupting_link() -> None:
    from gpudiag.hw.sources import read_machine_or_capture
    from gpudiag.runtime.devices import DeviceSet
    from gpudiag.runtime.dp import VirtualDataParallel

    machine = read_machine_or_capture("seed_8gpu_topo.txt")
    torch.manual_seed(0)
    net = Net()
    dp = VirtualDataParallel(net, DeviceSet.virtual([5, 6], machine), faults=["5->6:nan@3x1"])
    watcher = gpudiag.watch(dp, "record", record_dir=False)
    train(dp, 4)
    report = watcher.report
    assert report is not None and report.phase == "transfer" and report.step == 2  # forward 3 = step 2
    assert report.transfer is not None and report.transfer.corrupted
    assert (report.transfer.src, report.transfer.dst) == ("GPU5", "GPU6")
    assert report.device == "virtual GPU6"


def test_real_data_parallel_without_gpus_is_the_module_itself(no_gpu: None) -> None:
    torch.manual_seed(0)
    net = Net()
    dp = nn.DataParallel(net)
    models.poison(net.head, lambda: watcher.step == 1)
    watcher = gpudiag.watch(dp, "record", record_dir=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DataParallel's own notes on a CPU-only machine
        train(dp, 3)
    assert watcher.report is not None and (watcher.report.module, watcher.report.step) == ("head", 1)
    assert watcher.placement == "dp"


@pytest.mark.multi_gpu
def test_real_data_parallel_names_the_replica_device() -> None:
    torch.manual_seed(0)
    net = Net().cuda()
    dp = nn.DataParallel(net, device_ids=[0, 1])
    models.poison(net.body[2].lin, lambda: watcher.step == 2 and torch.cuda.current_device() == 1)
    watcher = gpudiag.watch(dp, "record", record_dir=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        dp(torch.randn(8, 8, generator=g).cuda()).pow(2).mean().backward()
        net.zero_grad()
    report = watcher.report
    assert report is not None and (report.step, report.module, report.device) == (2, "body.2.lin", "cuda:1")
    assert report.transfer is not None and (report.transfer.src, report.transfer.dst) == ("cuda:1", "cuda:0")


def test_gpudiag_report_bundles_the_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudiag.checks.suite import Here
    from gpudiag.repro.report import run_report

    torch.manual_seed(0)
    net = Net()
    models.poison(net.head, lambda: watcher.step == 1)
    watcher = gpudiag.watch(net, "record", record_dir=tmp_path / "records")
    train(net, 2)
    (tmp_path / "records" / "watch-rank9.json").write_text('{"schema": "other/1"}')  # not ours: left out
    monkeypatch.setenv("GPUDIAG_WATCH_DIR", str(tmp_path / "records"))
    report = run_report(Here.detect(None), ["env"])
    assert "watch/watch-rank0.json" in report.file_names()
    assert "watch/watch-rank9.json" not in report.file_names()
    assert json.loads(report.files["watch/watch-rank0.json"])["module"] == "head"


@pytest.mark.slow  # ~10 s: two fresh interpreters import torch; the forked DDP tests cover the rest
def test_ddp_under_torchrun(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    root = ROOT
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    job = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node=2",
        str(Path(__file__).with_name("watch_torchrun_job.py")),
    ]
    out = subprocess.run(
        [*job, str(tmp_path)], cwd=root, env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"watch-rank{rank}.json").read_text())
        assert (record["rank"], record["module"], record["step"], record["phase"]) == (
            1,
            "body.2.lin",
            2,
            "forward",
        )
        assert record["arrived"] is (rank == 0)
        assert f"rank {rank}: non-finite value at step 2: arose on rank 1" in out.stdout


def test_a_clean_cpu_forward_lets_go_of_what_it_kept_before_the_backward() -> None:
    """With the module hooks on every step (trail), on the CPU a forward is judged as it
    ends: a clean one keeps no module output into the backward; a bad one is named there and
    then, and reported after the backward."""
    net = Net()
    models.poison(net.body[2].lin, lambda: watcher.step == 1)
    with gpudiag.watch(net, "record", record_dir=False, localize="trail") as watcher:
        out = net(torch.randn(2, 8))
        assert watcher._trail == [] and watcher._inputs == [] and watcher._outputs[-1][1] is None
        out.pow(2).mean().backward()
        out = net(torch.randn(2, 8))
        assert watcher._trail == [] and watcher._early is not None and watcher.report is None
        out.pow(2).mean().backward()
    assert watcher.report is not None
    assert (watcher.report.step, watcher.report.module, watcher.report.phase) == (1, "body.2.lin", "forward")


def test_autograd_grad_is_not_a_step_and_a_second_backward_is_checked() -> None:
    torch.manual_seed(0)
    net = Net()
    models.poison(net.body[2].lin, lambda: watcher.step == 1)
    with gpudiag.watch(net, "record", record_dir=False) as watcher:
        for _ in range(3):  # a gradient penalty: autograd.grad first, then the real backward
            loss = net(torch.randn(4, 8)).pow(2).mean()
            grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)
            (loss + sum(g.pow(2).sum() for g in grads)).backward()
            if watcher.report is None:
                assert watcher.step == 1  # the penalty's autograd.grad did not count
        report = watcher.report
    assert report is not None and (report.step, report.module, report.phase) == (1, "body.2.lin", "forward")

    torch.manual_seed(0)
    net, bad = Net(), [False]
    models.poison(net.body[2].norm, lambda: bad[0], kind="grad")
    with gpudiag.watch(net, "record", record_dir=False) as watcher:
        loss = net(torch.randn(4, 8)).pow(2).mean()
        loss.backward(retain_graph=True)
        assert watcher.step == 1 and watcher.report is None
        bad[0] = True
        loss.backward()  # the same graph again: a backward pass of its own, checked
    report = watcher.report
    assert report is not None and (report.step, report.module, report.phase) == (1, "body.2.lin", "backward")


@pytest.mark.parametrize("loop", ["assigned-grads", "optimizer-in-backward"])
def test_loops_whose_backward_leaves_grad_unchanged_are_checked(loop: str) -> None:
    """autograd.grad whose gradients the loop assigns itself, and an optimizer stepping
    inside the backward (emptying .grad): each backward is a step, checked."""
    torch.manual_seed(0)
    net = Net()
    params = list(net.parameters())
    models.poison(net.body[2].lin, lambda: watcher.step == 2)
    opts = {id(p): torch.optim.SGD([p], lr=0.05) for p in params}
    if loop == "optimizer-in-backward":  # the PyTorch tutorial's pattern

        def step_now(p: torch.Tensor) -> None:
            opts[id(p)].step()
            p.grad = None

        for p in params:
            p.register_post_accumulate_grad_hook(step_now)
    with gpudiag.watch(net, "record", record_dir=False) as watcher:
        for _ in range(4):
            loss = net(torch.randn(4, 8)).pow(2).mean()
            if loop == "assigned-grads":
                for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
                    p.grad = g
                for opt in opts.values():
                    opt.step()
            else:
                loss.backward()
            if watcher.report is None:
                assert watcher.step >= 1
    report = watcher.report
    assert report is not None and (report.step, report.module, report.phase) == (2, "body.2.lin", "forward")


def test_forwards_without_backward_are_let_go() -> None:
    net = Net()
    with gpudiag.watch(net, record_dir=False) as watcher:
        for _ in range(50):
            net(torch.randn(2, 8))  # gradients on, no backward (evaluation without no_grad)
        assert len(watcher._outputs) <= 8 and len(watcher._trail) <= 8 * len(list(net.modules()))
        x = torch.randn(2, 8)
        (net(x).sum() + net(x).sum()).backward()  # two forwards, one backward
        assert watcher.step == 1 and watcher.report is None


@pytest.mark.parametrize("path", GRAD_PATHS)
def test_ddp_backward_fault_on_one_rank(tmp_path: Path, path: str) -> None:
    def rank_fn(rank: int, world: int) -> bytes:
        torch.manual_seed(0)
        net = Net()
        models.poison(net.body[2].norm, lambda: rank == 0 and watcher.step == 2, kind="grad")
        ddp = _ddp_model(net, path)
        watcher = _ddp_watch(ddp, path, "record", record_dir=False)
        for _ in range(4):
            ddp(torch.randn(4, 8)).pow(2).mean().backward()
            net.zero_grad()
        assert watcher.report is not None
        return json.dumps(watcher.report.to_json()).encode()

    for rank, raw in enumerate(launch(rank_fn, 2, timeout=120, method="fork")):
        report = json.loads(bytes(raw))
        assert (report["rank"], report["module"], report["step"], report["phase"]) == (
            0,
            "body.2.lin",
            2,
            "backward",
        )
        assert report["arrived"] is (rank == 1)


@pytest.mark.gpu
def test_single_cuda_device_names_module_and_step() -> None:
    torch.manual_seed(0)
    net = Net().cuda()
    models.poison(net.body[2].lin, lambda: watcher.step == 2)
    watcher = gpudiag.watch(net, "record", record_dir=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(4):
        net(torch.randn(4, 8, device="cuda")).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    report = watcher.report
    assert report is not None
    assert (report.step, report.module, report.phase, report.device) == (2, "body.2.lin", "forward", "cuda:0")


@pytest.mark.parametrize("path", ["before-finalize", "bucket-hook"])
def test_ddp_under_autocast_with_a_grad_scaler(path: str) -> None:
    """AMP under DDP (fp16 autocast on the CPU, a GradScaler): an overflow rank 0's backward
    makes at step 1 is the scaler's skip on every rank (training goes on); a NaN rank 1's
    forward makes at step 3 is a fault, named alike on both ranks."""

    def rank_fn(rank: int, world: int) -> bytes:
        torch.manual_seed(0)
        net = Net()
        models.poison(net.body[2].norm, lambda: rank == 0 and watcher.step == 1, kind="grad")
        models.poison(net.body[2].lin, lambda: rank == 1 and watcher.step == 3)
        ddp = _ddp_model(net, path)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        watcher = _ddp_watch(ddp, path, "record", scaler=scaler, record_dir=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ddp(torch.randn(4, 8, generator=g)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if watcher.report is not None:
                break
        events = [(e.kind, e.step, e.rank, e.module, e.phase) for e in watcher.events]
        return json.dumps({"events": events, "scale": scaler.get_scale()}).encode()

    for raw in launch(rank_fn, 2, timeout=120, method="fork"):
        result = json.loads(bytes(raw))
        assert result["events"] == [
            ["scaler-skip", 1, 0, "body.2.lin", "backward"],
            ["fault", 3, 1, "body.2.lin", "forward"],
        ], result
        assert result["scale"] < 2.0**8  # the scaler did skip step 1


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["before-finalize", "bucket-hook"])
def test_ddp_on_cuda_over_nccl_names_module_step_and_phase(path: str) -> None:
    """One NCCL rank: a forward fault at step 1 and, in a second model, a backward fault
    at step 2, each named — the CUDA witnesses (multi-tensor norms) read once per step."""

    def rank_fn(rank: int, world: int) -> bytes:
        found = []
        for kind, step in (("output", 1), ("grad", 2)):
            torch.manual_seed(0)
            net = Net().cuda()
            target = net.body[2].lin if kind == "output" else net.body[2].norm
            box: dict[str, Any] = {}
            models.poison(target, lambda step=step, box=box: box["watcher"].step == step, kind=kind)
            ddp = _ddp_model(net, path)
            watcher = box["watcher"] = _ddp_watch(ddp, path, "record", record_dir=False)
            for _ in range(4):
                ddp(torch.randn(4, 8, device="cuda")).pow(2).mean().backward()
                net.zero_grad()
            assert watcher.report is not None
            found.append(watcher.report.to_json())
            watcher.close()
        return json.dumps(found).encode()

    (raw,) = launch(rank_fn, 1, backend="nccl", timeout=300)
    forward, backward = json.loads(bytes(raw))
    assert (forward["module"], forward["step"], forward["phase"], forward["device"]) == (
        "body.2.lin",
        1,
        "forward",
        "cuda:0",
    )
    assert (backward["module"], backward["step"], backward["phase"]) == ("body.2.lin", 2, "backward")


def test_ddp_all_reduce_that_corrupts_what_one_rank_receives() -> None:
    def rank_fn(rank: int, world: int) -> bytes:
        from torch.nn.parallel import DistributedDataParallel

        from gpudiag.runtime.faults import FaultPlan

        torch.manual_seed(0)
        ddp = DistributedDataParallel(Net())
        watcher = gpudiag.watch(ddp, "raise", record_dir=False, comm_hook=True)
        assert watcher._comm is not None
        # the runtime's fault injection: what rank 1 receives at step 2 (runtime step 3) turns NaN
        watcher._comm.hook.faults = FaultPlan.parse(["0->1:nan@3x1"])
        try:
            for _ in range(4):
                ddp(torch.randn(4, 8)).pow(2).mean().backward()
                ddp.zero_grad()
        except NonFiniteError as exc:
            return json.dumps(exc.report.to_json()).encode()
        return b"{}"

    for rank, raw in enumerate(launch(rank_fn, 2, timeout=120, method="fork")):
        report = json.loads(bytes(raw))
        assert (report["rank"], report["step"], report["phase"]) == (1, 2, "all-reduce"), report
        assert "came back non-finite from the all-reduce" in report["detail"]
        assert report["ranks"] == [
            {"rank": 0, "own": False, "received": False},
            {"rank": 1, "own": False, "received": True},
        ]
        assert report["this_rank"] == rank


def _corrupting_hook(here: bool, step: list[int], at: int, value: float) -> Any:
    """A user's DDP comm hook: torch's all-reduce (mean), after which, on the rank where
    ``here`` is true, one element of what came back at step ``at`` (``step[0]``) is ``value``."""
    import torch.distributed as dist

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # (DDP checks annotations: none here)
        buffer = bucket.buffer().div_(dist.get_world_size())

        def done(fut: Any) -> torch.Tensor:
            out = fut.value()[0]
            if here and step[0] == at:
                out[3] = value
            return out

        return dist.all_reduce(buffer, async_op=True).get_future().then(done)

    return hook


@pytest.mark.parametrize("optimizer", [False, True], ids=["no-optimizer", "sgd"])
def test_ddp_all_reduce_that_corrupts_what_one_rank_receives_under_a_users_hook(optimizer: bool) -> None:
    """The default way (DDP's all-reduce left alone, here the user's own comm hook): what
    rank 1 receives at step 2 turns NaN although both ranks' own gradients were finite —
    named at step 2, phase all-reduce, also when rank 1's optimizer has made its parameters
    non-finite from it by the next step's agreement (the all-reduce came first)."""

    def rank_fn(rank: int, world: int) -> bytes:
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        ddp = DistributedDataParallel(Net())
        step = [0]
        ddp.register_comm_hook(None, _corrupting_hook(rank == 1, step, 2, float("nan")))
        watcher = gpudiag.watch(ddp, "raise", record_dir=False)
        assert watcher.grad_path == "before-finalize" and watcher._comm is None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        try:
            for step[0] in range(4):
                ddp(torch.randn(4, 8)).pow(2).mean().backward()
                if optimizer:
                    opt.step()
                ddp.zero_grad()
        except NonFiniteError as exc:
            return json.dumps(exc.report.to_json()).encode()
        return b"{}"

    for rank, raw in enumerate(launch(rank_fn, 2, timeout=120, method="fork")):
        report = json.loads(bytes(raw))
        assert (report["rank"], report["step"], report["phase"]) == (1, 2, "all-reduce"), report
        # with an optimizer, rank 1's own parameters went non-finite by the next step too
        assert report["ranks"] == [
            {"rank": 0, "own": False, "received": False},
            {"rank": 1, "own": optimizer, "received": True},
        ]
        assert report["this_rank"] == rank


@pytest.mark.parametrize("bad_step", [-1, 1], ids=["clean", "nan-at-1"])
def test_ddp_fp16_compressed_all_reduce_overflowing_under_a_grad_scaler_is_its_skip(bad_step: int) -> None:
    """torch's fp16_compress_hook with a GradScaler at its default scale: scaled gradients
    finite in float32 overflow float16 in the all-reduce; the scaler skips those steps and
    lowers its scale (healthy AMP). Noted as the scaler's skips, never a fault — and a real
    NaN beside them (rank 1's forward at step 1, agreed with step 0's skip) still is one."""

    def rank_fn(rank: int, world: int) -> bytes:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        net = Net()
        models.poison(net.body[2].lin, lambda: rank == 1 and watcher.step == bad_step)
        ddp = DistributedDataParallel(net)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        scaler = torch.amp.GradScaler("cpu")  # 65536
        watcher = gpudiag.watch(ddp, "record", scaler=scaler, record_dir=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        for _ in range(8):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = (ddp(torch.randn(4, 8, generator=g) * 30).float() - 5).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        watcher.close()
        kinds = sorted({(e.kind, e.phase) for e in watcher.events if e.kind == "scaler-skip"})
        report = watcher.report
        found = None if report is None else [report.step, report.rank, report.module, report.phase]
        result = {"report": found, "kinds": kinds, "scale": scaler.get_scale()}
        return json.dumps(result).encode()

    for raw in launch(rank_fn, 2, timeout=120, method="fork"):
        result = json.loads(bytes(raw))
        assert result["kinds"] == [["scaler-skip", "all-reduce"]], result
        if bad_step < 0:
            assert result["report"] is None and result["scale"] < 65536, result
        else:
            assert result["report"] == [1, 1, "body.2.lin", "forward"], result


def test_ddp_all_reduce_that_corrupts_at_the_last_step_is_said_at_close(tmp_path: Path) -> None:
    """What the all-reduce alone made non-finite is agreed on at the next step; at the
    last step there is none: the rank it reached says it at close(), a record and a
    warning, without raising (the others saw nothing)."""

    def rank_fn(rank: int, world: int) -> bytes:
        import warnings

        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        ddp = DistributedDataParallel(Net())
        step = [0]
        ddp.register_comm_hook(None, _corrupting_hook(rank == 1, step, 3, float("inf")))
        watcher = gpudiag.watch(ddp, "raise", record_dir=str(tmp_path))
        for step[0] in range(4):
            ddp(torch.randn(4, 8)).pow(2).mean().backward()
            ddp.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            watcher.close()
        said = [str(w.message) for w in caught if isinstance(w.message, gpudiag.watch.NonFiniteWarning)]
        report = watcher.report and watcher.report.to_json()
        return json.dumps({"said": said, "report": report, "run": watcher.run}).encode()

    quiet, told = (json.loads(bytes(raw)) for raw in launch(rank_fn, 2, timeout=120, method="fork"))
    assert quiet["run"] == told["run"]  # one name for the job's records, agreed at watch()
    assert (quiet["said"], quiet["report"]) == ([], None)
    assert len(told["said"]) == 1 and "came back non-finite from the all-reduce" in told["said"][0]
    report = told["report"]
    assert (report["rank"], report["step"], report["phase"], report["this_rank"]) == (1, 3, "all-reduce", 1)
    assert sorted(read_records(tmp_path)) == ["watch-rank1.json"]


def test_ddp_a_fault_in_the_last_no_sync_micro_step_is_said_at_close() -> None:
    """A no_sync micro-step's fault is agreed on at the next synchronised backward; after
    the last micro-step there is none: its rank says it at close() (record, warning)."""

    def rank_fn(rank: int, world: int) -> bytes:
        import warnings

        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        net = Net()
        ddp = DistributedDataParallel(net)
        models.poison(net.body[2].lin, lambda: rank == 0 and watcher.step == 4)
        watcher = gpudiag.watch(ddp, "raise", record_dir=False)  # (close() warns instead)
        for _ in range(2):
            ddp(torch.randn(4, 8)).pow(2).mean().backward()
            with ddp.no_sync():
                ddp(torch.randn(4, 8)).pow(2).mean().backward()
        with ddp.no_sync():  # the run ends on a micro-step: step 4
            ddp(torch.randn(4, 8)).pow(2).mean().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            watcher.close()
        said = [str(w.message) for w in caught if isinstance(w.message, gpudiag.watch.NonFiniteWarning)]
        return json.dumps(said).encode()

    told, quiet = (json.loads(bytes(raw)) for raw in launch(rank_fn, 2, timeout=120, method="fork"))
    assert quiet == [] and len(told) == 1 and "step 4: arose on rank 0" in told[0], told


@pytest.mark.parametrize("bad", [False, True], ids=["clean", "nan-on-rank-0"])
def test_ddp_join_with_uneven_inputs_does_not_hang(bad: bool) -> None:
    """Under ``ddp.join()`` a rank out of data shadows only DDP's collectives: the watcher
    exchanges nothing then (no hang), and each rank says what it saw — rank 0 its own NaN,
    rank 1 that the all-reduce brought it non-finite values."""

    def rank_fn(rank: int, world: int) -> bytes:
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        net = Net()
        ddp = DistributedDataParallel(net)
        models.poison(net.body[2].lin, lambda: bad and rank == 0 and watcher.step == 1)
        watcher = gpudiag.watch(ddp, "record", record_dir=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        with ddp.join():
            for _ in range(6 if rank == 0 else 3):
                ddp(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        report = watcher.report
        watcher.close()
        return json.dumps(None if report is None else [report.step, report.rank, report.phase]).encode()

    zero, one = (json.loads(bytes(raw)) for raw in launch(rank_fn, 2, timeout=60, method="fork"))
    if not bad:
        assert (zero, one) == (None, None)
    else:
        assert zero == [1, 0, "forward"] and one == [1, 1, "all-reduce"], (zero, one)


def test_ddp_second_backward_through_a_retained_graph_is_no_callback_order_problem() -> None:
    """DDP does not all-reduce a second backward through a retained graph (its finalize
    writes nothing then): the callback-order check, confirmed by the first, stays quiet."""

    def rank_fn(rank: int, world: int) -> bytes:
        import warnings

        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        ddp = DistributedDataParallel(Net())
        watcher = gpudiag.watch(ddp, "raise", record_dir=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                loss = ddp(torch.randn(4, 8)).pow(2).mean()
                loss.backward(retain_graph=True)
                loss.backward()
                ddp.zero_grad()
        said = [str(w.message) for w in caught if "gpudiag" in str(w.message)]
        return json.dumps({"path": watcher.grad_path, "said": said, "steps": watcher.step}).encode()

    for raw in launch(rank_fn, 2, timeout=120, method="fork"):
        assert json.loads(bytes(raw)) == {"path": "before-finalize", "said": [], "steps": 6}


def test_ddp_callbacks_in_another_order_fall_back_to_a_hook_per_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If a torch ran DDP's finalize before the watcher's first end-of-backward callback,
    the gradients read would be the all-reduced ones: the watcher sees that (no gradient
    changed after its read), says so, and watches each gradient as it arrives from then on,
    still naming the right rank."""
    from gpudiag.watch.core import Watcher, _end_of_backward_callback

    original = Watcher._end_of_backward

    def late(self: Any) -> None:  # what a torch with the other order would do: run after DDP's
        _end_of_backward_callback()(lambda: original(self))

    monkeypatch.setattr(Watcher, "_end_of_backward", late)

    def rank_fn(rank: int, world: int) -> bytes:
        import warnings

        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        net = Net()
        models.poison(net.body[2].norm, lambda: rank == 0 and watcher.step == 2, kind="grad")
        ddp = DistributedDataParallel(net)
        watcher = gpudiag.watch(ddp, "record", record_dir=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                ddp(torch.randn(4, 8)).pow(2).mean().backward()
                net.zero_grad()
        assert watcher.grad_path == "tensor-hooks"
        assert sum("ran before the watcher's" in str(w.message) for w in caught) == 1
        assert watcher.report is not None
        return json.dumps(watcher.report.to_json()).encode()

    for raw in launch(rank_fn, 2, timeout=120, method="fork"):
        report = json.loads(bytes(raw))
        assert (report["rank"], report["module"], report["step"], report["phase"]) == (
            0,
            "body.2.lin",
            2,
            "backward",
        )


@pytest.mark.parametrize("path", GRAD_PATHS)
def test_ddp_a_model_of_one_parameter_is_watched(path: str) -> None:
    """One gradient: its witness a vector of one value (a 0-d one made ``zip(..., witness.tolist())``
    a TypeError out of every backward), and a NaN loss on one rank named on both."""

    def rank_fn(rank: int, world: int) -> bytes:
        torch.manual_seed(0)
        lin = nn.Linear(4, 4, bias=False)
        ddp = _ddp_model(lin, path)
        watcher = _ddp_watch(ddp, path, "record", record_dir=False)
        for step in range(3):
            scale = math.nan if step == 2 and rank == 1 else 1.0  # a NaN loss on rank 1
            (ddp(torch.randn(3, 4)) * scale).pow(2).mean().backward()
            lin.zero_grad()
        assert watcher.report is not None
        return json.dumps(watcher.report.to_json()).encode()

    for raw in launch(rank_fn, 2, timeout=120, method="fork"):
        report = json.loads(bytes(raw))
        assert (report["rank"], report["step"], report["phase"]) == (1, 2, "backward")
