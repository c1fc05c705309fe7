"""gpudiag.watch inside PyTorch Lightning, the Hugging Face Trainer and Accelerate, each
with the real library: a NaN injected in one module on one rank at a chosen step is named
on every rank (two forked gloo ranks that look to the library like torchrun's); a clean
run reports nothing. Skipped, with the reason, where a library is not installed
(``pip install gpudiag[lightning,transformers,accelerate]``; the ``test`` extra has them)."""

from __future__ import annotations

import json
import os
import socket
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpudiag.runtime.launch import launch
from tests.helpers import models

STEP = 3  # the backward pass (0-based) whose forward gets the NaN


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_torchrun(rank: int, world: int, port: int) -> None:
    """This forked rank, already in its gloo group, looks like one torchrun started."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    warnings.simplefilter("ignore")  # the libraries' own deprecation notes; faults raise


def _outcome(watcher: Any, error: BaseException | None) -> bytes:
    from gpudiag.watch import NonFiniteError

    if error is not None and not isinstance(error, NonFiniteError):
        return json.dumps({"crash": "".join(traceback.format_exception(error))[-3000:]}).encode()
    report = watcher.report.to_json() if watcher is not None and watcher.report is not None else None
    return json.dumps(
        {"report": report, "raised": error is not None, "placement": watcher.placement}
    ).encode()


def _check(results: list[dict[str, Any]], module: str, bad_rank: int = 1) -> None:
    for rank, result in enumerate(results):
        assert "crash" not in result, result.get("crash")
        report = result["report"]
        assert result["raised"] and report is not None, f"rank {rank} saw nothing"
        assert (report["rank"], report["module"], report["step"], report["phase"]) == (
            bad_rank,
            module,
            STEP,
            "forward",
        )
        assert report["this_rank"] == rank and report["arrived"] is (rank != bad_rank)
        assert result["placement"] == "ddp"


# -- PyTorch Lightning -----------------------------------------------------------------


def _lightning_rank(
    rank: int, world: int, port: int, bad_rank: int, folder: str, package: str = "pytorch_lightning"
) -> bytes:
    _as_torchrun(rank, world, port)
    import importlib
    import sys

    if package == "lightning.pytorch":  # as where only the unified package is installed
        sys.modules["pytorch_lightning"] = None  # type: ignore[assignment]  # import fails
        sys.modules.pop("gpudiag.watch.lightning", None)
    pl = importlib.import_module(package)
    from gpudiag.watch.lightning import WatchCallback

    assert issubclass(WatchCallback, pl.Callback)

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    module = Regressor()
    callback = WatchCallback("raise", record_dir=folder)
    models.poison(module.net[2], lambda: rank == bad_rank and callback.watcher.step == STEP)
    g = torch.Generator().manual_seed(rank)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    trainer = pl.Trainer(
        max_steps=6,
        callbacks=[callback],
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
    )
    error = None
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    except Exception as exc:
        error = exc
    return _outcome(callback.watcher, error)


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
def test_lightning_ddp_names_rank_module_and_step(tmp_path: Path, package: str) -> None:
    pytest.importorskip(package, reason=f"{package} not installed (the test extra has both)")
    args = (_free_port(), 1, str(tmp_path), package)
    results = launch(_lightning_rank, 2, args=args, timeout=120, method="fork")
    _check([json.loads(bytes(r)) for r in results], "net.2")


def test_lightning_clean_run_reports_nothing(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning", reason="pytorch-lightning not installed (gpudiag[lightning])")
    results = launch(_lightning_rank, 2, args=(_free_port(), -1, str(tmp_path)), timeout=120, method="fork")
    for result in map(json.loads, map(bytes, results)):
        assert "crash" not in result, result.get("crash")
        assert result["report"] is None and not result["raised"]
    assert not list(tmp_path.glob("watch-rank*.json"))


# -- Hugging Face Trainer --------------------------------------------------------------


def _hf_rank(rank: int, world: int, port: int, bad_rank: int, folder: str) -> bytes:
    _as_torchrun(rank, world, port)
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from gpudiag.watch.hf import WatchCallback

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)  # built here: nothing downloaded
    g = torch.Generator().manual_seed(rank)
    data = [
        {"input_ids": torch.randint(0, 50, (8,), generator=g), "labels": torch.tensor(i % 2)}
        for i in range(48)
    ]
    args = TrainingArguments(
        output_dir=folder,
        max_steps=6,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    callback = WatchCallback.attach(trainer, "raise", record_dir=folder)
    dense = model.bert.encoder.layer[1].attention.output.dense
    models.poison(dense, lambda: rank == bad_rank and callback.watcher.step == STEP)
    error = None
    try:
        trainer.train()
    except Exception as exc:
        error = exc
    return _outcome(callback.watcher, error)


def test_hf_trainer_ddp_names_rank_module_and_step(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers not installed (gpudiag[transformers])")
    results = launch(_hf_rank, 2, args=(_free_port(), 1, str(tmp_path)), timeout=120, method="fork")
    _check([json.loads(bytes(r)) for r in results], "bert.encoder.layer.1.attention.output.dense")
    assert sorted(p.name for p in tmp_path.glob("watch-rank*.json")) == [
        "watch-rank0.json",
        "watch-rank1.json",
    ]


def test_hf_callback_without_the_trainer_refuses_several_processes(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers not installed (gpudiag[transformers])")

    def rank_fn(rank: int, world: int) -> bytes:
        from gpudiag.errors import InputError
        from gpudiag.watch.hf import WatchCallback

        try:
            WatchCallback().on_train_begin(None, None, None, model=nn.Linear(2, 2))
        except InputError as exc:
            return str(exc).encode()
        return b"accepted"

    for result in launch(rank_fn, 2, timeout=60, method="fork"):
        assert b"WatchCallback.attach(trainer)" in bytes(result)


# -- Accelerate ------------------------------------------------------------------------


def _accelerate_rank(rank: int, world: int, port: int, bad_rank: int, folder: str) -> bytes:
    _as_torchrun(rank, world, port)
    from accelerate import Accelerator

    import gpudiag.watch.accelerate

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    # (injected before watching: the watcher's own hook then sees the poisoned output)
    models.poison(inner[2][0], lambda: rank == bad_rank and watcher.step == STEP)
    watcher = gpudiag.watch.accelerate.watch(accelerator, model, "raise", record_dir=folder)
    g = torch.Generator().manual_seed(rank)
    error = None
    try:
        for _ in range(6):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    except Exception as exc:
        error = exc
    return _outcome(watcher, error)


def test_accelerate_ddp_names_rank_module_and_step(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="accelerate not installed (gpudiag[accelerate])")
    results = launch(_accelerate_rank, 2, args=(_free_port(), 1, str(tmp_path)), timeout=120, method="fork")
    _check([json.loads(bytes(r)) for r in results], "2.0")


def test_accelerate_clean_run_reports_nothing(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="accelerate not installed (gpudiag[accelerate])")
    results = launch(_accelerate_rank, 2, args=(_free_port(), -1, str(tmp_path)), timeout=120, method="fork")
    for result in map(json.loads, map(bytes, results)):
        assert "crash" not in result, result.get("crash")
        assert result["report"] is None and not result["raised"]


# -- one process: the model replayed (HF, Accelerate) or hooked (Lightning) -------------


def _alone(rank: int, world: int, rank_fn: Any, folder: str) -> bytes:
    """``rank_fn`` in a forked process that is no rank of any group: no torchrun variables,
    no process group (the libraries then train on one process, without DDP)."""
    import torch.distributed as dist

    dist.destroy_process_group()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    globals()["_as_torchrun"] = lambda *args: warnings.simplefilter("ignore")  # (this child only)
    try:
        return rank_fn(0, 1, 0, 0, folder)
    finally:  # a group again for the launcher to leave
        dist.init_process_group("gloo", init_method=f"file://{folder}/alone-store", rank=0, world_size=1)


@pytest.mark.parametrize(
    ("library", "rank_fn", "module"),
    [
        ("pytorch_lightning", _lightning_rank, "net.2"),
        ("transformers", _hf_rank, "bert.encoder.layer.1.attention.output.dense"),
        ("accelerate", _accelerate_rank, "2.0"),
    ],
    ids=["lightning", "hf", "accelerate"],
)
def test_one_process_names_the_module_and_step(
    tmp_path: Path, library: str, rank_fn: Any, module: str
) -> None:
    """One process: HF and Accelerate call the model, whose faulty forward is replayed;
    Lightning calls training_step, not the model, so its callback keeps the module hooks."""
    pytest.importorskip(library, reason=f"{library} not installed (the test extra has it)")
    (raw,) = launch(_alone, 1, args=(rank_fn, str(tmp_path)), timeout=120, method="fork")
    result = json.loads(bytes(raw))
    assert "crash" not in result, result.get("crash")
    report = result["report"]
    assert result["raised"] and result["placement"] == "single" and report is not None
    assert (report["module"], report["step"], report["phase"]) == (module, STEP, "forward")
