"""DataParallel on CPU virtual devices: same arithmetic as DataParallel, every transfer watched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpudiag.hw.machine import load_machine
from gpudiag.runtime import DeviceSet, RunConfig, run
from gpudiag.runtime.dp import chunk_count, dp_forward
from gpudiag.runtime.record import Recorder
from gpudiag.runtime.transport import Transport
from tests import helpers
from tests.helpers import models

SEED_MACHINE = load_machine(str(helpers.SEED_MACHINE))


close = models.assert_close_dicts


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_dp_equals_single_without_batchnorm(optimizer: str) -> None:
    x, y = models.batch(8)
    devices = DeviceSet.virtual(4)
    single = run(models.mlp, x, y, RunConfig("single", devices, steps=3, optimizer=optimizer))
    dp = run(models.mlp, x, y, RunConfig("dp", devices, steps=3, optimizer=optimizer))
    close(single.grads, dp.grads)
    close(single.params, dp.params, atol=1e-5)
    assert single.losses == pytest.approx(dp.losses, rel=1e-5)


def test_uneven_batch_uses_torch_chunk_rules() -> None:
    x, y = models.batch(5)
    devices = DeviceSet.virtual(4)
    assert chunk_count((x,), {}, 4) == 3  # chunks of 2, 2, 1
    dp = run(models.mlp, x, y, RunConfig("dp", devices))
    forward = [p.device for p in dp.recorder.phases if p.name == "forward"]
    assert forward == [0, 1, 2]
    scatter = [(t.dst, t.bytes) for t in dp.recorder.transfers if t.phase == "scatter"]
    assert scatter == [(1, 2 * 8 * 4), (2, 1 * 8 * 4)]
    close(run(models.mlp, x, y, RunConfig("single", devices)).grads, dp.grads)


def test_batchnorm_in_train_mode_equals_the_per_chunk_computation() -> None:
    x, y = models.batch(8)
    devices = DeviceSet.virtual(2)
    dp = run(models.bn_net, x, y, RunConfig("dp", devices, optimizer="none"))
    single = run(models.bn_net, x, y, RunConfig("single", devices, optimizer="none"))

    torch.manual_seed(0)
    per_chunk = models.bn_net()
    out = torch.cat([per_chunk(part) for part in x.chunk(2)])
    nn.functional.cross_entropy(out, y).backward()
    reference = {n: p.grad for n, p in per_chunk.named_parameters()}
    close(dp.grads, reference)
    assert not torch.allclose(dp.grads["0.weight"], single.grads["0.weight"], atol=1e-6)

    # Running statistics come from the replica on the first device only.
    torch.manual_seed(0)
    first_only = models.bn_net()
    first_only(x.chunk(2)[0])
    close(dp.buffers, {n: b for n, b in first_only.named_buffers()})


def test_nested_inputs_and_keyword_arguments_are_scattered_and_gathered() -> None:
    torch.manual_seed(0)
    model = models.DictInput()
    x, _ = models.batch(6)
    z, _ = models.batch(6, seed=2)
    tag = torch.arange(6.0)
    scale = torch.linspace(1, 2, 6).unsqueeze(1)
    args = ({"x": x}, [z, tag])
    transport = Transport(DeviceSet.virtual(3), Recorder())
    got = dp_forward(model, args, {"scale": scale}, transport)
    want = model(*args, scale=scale)
    torch.testing.assert_close(got["logits"], want["logits"])
    torch.testing.assert_close(got["pair"][0], want["pair"][0])
    torch.testing.assert_close(got["pair"][1], tag)
    names = {t.name for t in transport.recorder.transfers if t.phase == "scatter"}  # type: ignore[union-attr]
    assert names == {"input"}
    assert sum(t.phase == "scatter" for t in transport.recorder.transfers) == 2 * 4  # type: ignore[union-attr]


def test_transfers_know_their_links_on_a_virtual_machine() -> None:
    x, y = models.batch(8)
    for ids, link in (([0, 1], "NV4"), ([5, 6], "NODE"), ([3, 4], "SYS")):
        result = run(models.mlp, x, y, RunConfig("dp", DeviceSet.virtual(ids, SEED_MACHINE)))
        assert {t.link for t in result.recorder.transfers} == {link}
        assert {(t.src, t.dst) for t in result.recorder.transfers} == {(ids[0], ids[1]), (ids[1], ids[0])}


def test_every_phase_is_recorded_with_bytes_and_checksums() -> None:
    x, y = models.batch(8)
    result = run(models.mlp, x, y, RunConfig("dp", DeviceSet.virtual(2)))
    phases = {t.phase for t in result.recorder.transfers}
    assert phases == {"scatter", "replicate", "gather", "gather-grad", "reduce"}
    replicate = {t.name: t for t in result.recorder.transfers if t.phase == "replicate"}
    weight = replicate["0.weight"]
    assert weight.bytes == 16 * 8 * 4
    torch.manual_seed(0)
    assert weight.checksum == pytest.approx(float(models.mlp()[0].weight.detach().double().sum()))
    assert all(t.nonfinite == 0 and t.end >= t.start for t in result.recorder.transfers)
    assert {p.name for p in result.recorder.phases} == {"scatter", "replicate", "forward", "gather"}


@pytest.mark.parametrize("kind", ["nan", "inf", "zero", "bitflip", "scale=1000"])
def test_each_fault_kind_is_recorded_at_the_right_step_link_and_phase(kind: str) -> None:
    x, y = models.batch(8)
    spec = f"1->0:{kind}@2x1"
    result = run(
        models.mlp, x, y, RunConfig("dp", DeviceSet.virtual([0, 1], SEED_MACHINE), steps=3, faults=(spec,))
    )
    hit = [t for t in result.recorder.transfers if t.faults]
    assert len(hit) == 1
    (t,) = hit
    assert (t.step, t.phase, t.src, t.dst, t.link, t.faults) == (2, "gather", 1, 0, "NV4", [spec])
    clean = [u for u in result.recorder.transfers if u.step == 2 and u.phase == "gather" and not u.faults]
    assert clean == []
    assert (t.nonfinite > 0) == (kind in ("nan", "inf"))
    assert t.corrupted  # what arrived differs from what was sent
    assert not any(u.corrupted for u in result.recorder.transfers if not u.faults and u.step == 1)


def test_fault_from_a_step_on_hits_every_transfer_after() -> None:
    x, y = models.batch(8)
    result = run(models.mlp, x, y, RunConfig("dp", DeviceSet.virtual(2), steps=3, faults=("0->1:nan@2",)))
    hit_steps = {t.step for t in result.recorder.transfers if t.faults}
    assert hit_steps == {2, 3}
    first = next(t for t in result.recorder.transfers if t.faults)
    assert (first.step, first.phase) == (2, "scatter")
    assert result.losses[0] == result.losses[0]  # finite first step
    assert torch.isnan(torch.tensor(result.losses[1]))


def test_watching_off_records_nothing_and_changes_nothing() -> None:
    x, y = models.batch(8)
    devices = DeviceSet.virtual(2)
    on = run(models.mlp, x, y, RunConfig("dp", devices, steps=2))
    off = run(models.mlp, x, y, RunConfig("dp", devices, steps=2, watch=False))
    assert off.recorder.events() == []
    close(on.params, off.params, atol=0)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_runs_on_virtual_devices(dtype: str) -> None:
    x, y = models.batch(8)
    devices = DeviceSet.virtual(2)
    single = run(models.mlp, x, y, RunConfig("single", devices, steps=2, dtype=dtype))
    dp = run(models.mlp, x, y, RunConfig("dp", devices, steps=2, dtype=dtype))
    assert all(torch.isfinite(g).all() for g in dp.grads.values())
    close(single.grads, dp.grads, atol=5e-2)


def test_gradient_accumulation_splits_the_batch() -> None:
    x, y = models.batch(8)
    devices = DeviceSet.virtual(2)
    whole = run(models.mlp, x, y, RunConfig("single", devices))
    two = run(models.mlp, x, y, RunConfig("dp", devices, accumulate=2))
    close(whole.grads, two.grads)


def test_virtual_devices_must_exist_on_the_machine() -> None:
    from gpudiag.errors import InputError

    with pytest.raises(InputError, match="no GPU 9"):
        DeviceSet.virtual([0, 9], SEED_MACHINE)
