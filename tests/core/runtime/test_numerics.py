"""One set of numeric settings for a whole comparison: set in this process and in every
rank, reported as each process saw them (the flags exist on the CPU too)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from gpudiag.checks.gradcheck import gradcheck
from gpudiag.checks.gradcheck.explain import numerics_differ as _numerics_differ
from gpudiag.runtime import DeviceSet, RunConfig, run
from gpudiag.runtime.numerics import Numerics
from tests.helpers import models

#: Settings a user may well have in their process: TF32 and bf16 emulation, autotuning.
USERS = Numerics(
    cuda_matmul="tf32",
    cudnn_conv="tf32",
    cudnn_rnn="tf32",
    mkldnn_matmul="bf16",
    mkldnn_conv="none",
    mkldnn_rnn="none",
    cudnn_benchmark=True,
    cudnn_deterministic=False,
    deterministic_algorithms="off",
)


@pytest.fixture
def users_settings() -> Iterator[Numerics]:
    """This process under :data:`USERS` for the test; what it had before, after."""
    with USERS.applied():
        yield USERS


def test_applied_sets_every_flag_and_restores_them(users_settings: Numerics) -> None:
    assert Numerics.observe() == users_settings
    wanted = Numerics.comparison()
    with wanted.applied():
        assert Numerics.observe() == wanted
        assert torch.backends.cudnn.conv.fp32_precision == "ieee" and not torch.backends.cudnn.benchmark
        assert torch.backends.cudnn.deterministic and torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert Numerics.observe() == users_settings
    assert torch.backends.cudnn.allow_tf32 is True


def legacy_flags() -> tuple[bool, bool]:
    """What a training script reads through torch's legacy TF32 interface."""
    return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32


def test_the_legacy_tf32_interface_reads_true_under_and_after_the_comparison_settings() -> None:
    """torch 2.14 raised on ``torch.backends.cudnn.allow_tf32`` once conv and RNN were set
    to ``ieee`` through the new interface (issue 35): the user's code must read the truth."""
    with Numerics.comparison().applied():
        assert legacy_flags() == (False, False) and torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cudnn.conv.fp32_precision == torch.backends.cudnn.rnn.fp32_precision == "ieee"
        with USERS.applied():  # (its mkldnn bf16 beside cuda tf32 has no one legacy precision)
            assert legacy_flags() == (True, True)
            assert Numerics.observe() == USERS
        with replace(USERS, mkldnn_matmul="tf32").applied():
            assert legacy_flags() == (True, True) and torch.get_float32_matmul_precision() == "high"
        assert legacy_flags() == (False, False) and torch.get_float32_matmul_precision() == "highest"


class ReadsTf32Flags(torch.nn.Module):
    """A model whose forward reads the legacy TF32 switches, as training code often does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = models.mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if legacy_flags()[0]:
            raise AssertionError("TF32 reported on in a comparison process")
        return self.net(x)


def test_gradcheck_of_a_model_that_reads_the_legacy_tf32_switch_passes() -> None:
    x, y = models.batch(8)
    report = gradcheck(ReadsTf32Flags, x, y)
    assert report.verdict == "pass", report.summary()


@pytest.mark.parametrize("start", ["auto", "subprocess"])
def test_gradcheck_ranks_compute_under_the_references_settings(
    users_settings: Numerics, monkeypatch: pytest.MonkeyPatch, start: str
) -> None:
    """Forked ranks inherit the parent's flags, fresh ones torch's defaults: neither is
    the comparison's unless each rank sets them."""
    monkeypatch.setenv("GPUDIAG_RANK_START", start)
    x, y = models.batch(8)
    report = gradcheck(models.mlp, x, y)
    assert report.verdict == "pass", report.summary()
    wanted = Numerics.comparison().to_json()
    assert report.numerics == {name: wanted for name in ("single", "dp", "ddp rank 0", "ddp rank 1")}
    assert report.settings == {"numerics": Numerics.comparison().summary()}
    assert Numerics.observe() == users_settings  # the caller's flags are back


def test_a_run_sets_its_numerics_in_every_rank_and_none_leaves_them() -> None:
    x, y = models.batch(8)
    chosen = Numerics(cudnn_benchmark=True, mkldnn_matmul="bf16", deterministic_algorithms="warn")
    two = DeviceSet.virtual(2)
    ddp = run(models.mlp, x, y, RunConfig("ddp", two, numerics=chosen, watch=False))
    single = run(models.mlp, x, y, RunConfig("single", two, numerics=chosen, watch=False))
    assert ddp.numerics == [chosen, chosen] and single.numerics == [chosen]
    assert Numerics.observe() != chosen  # set for the run only
    as_they_are = run(models.mlp, x, y, RunConfig("single", two, watch=False))
    assert as_they_are.numerics == [Numerics.observe()]


def test_a_process_under_other_settings_is_an_error_a_changed_reference_a_warning() -> None:
    wanted = Numerics.comparison()
    tf32 = Numerics(cudnn_conv="tf32")
    findings = _numerics_differ(wanted, {"single": wanted, "ddp rank 0": wanted, "ddp rank 1": tf32})
    assert [(f.code, f.severity) for f in findings] == [("numerics-differ", "error")]
    assert (
        findings[0].message
        == "ddp rank 1 computed under other numeric settings than single: cudnn conv ieee → tf32"
    )
    findings = _numerics_differ(wanted, {"single": tf32, "ddp rank 0": tf32})
    assert [(f.code, f.severity) for f in findings] == [("numerics-changed", "warning")]


def test_a_backend_this_torch_lacks_is_observed_absent_and_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(torch.backends.mkldnn), "rnn", None)  # as on a build without it
    seen = Numerics.observe()
    assert seen.mkldnn_rnn == "absent" and seen.mkldnn_conv != "absent"
    with Numerics.comparison().applied():
        assert Numerics.observe().mkldnn_rnn == "absent"
    assert Numerics.observe() == seen


@pytest.fixture
def legacy_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch seen as one older than 2.9: no ``fp32_precision`` interface, only the legacy
    ``allow_tf32`` switches (what torch 2.6 to 2.8 have; ``make test-floor`` runs the real one)."""
    from gpudiag.runtime import numerics

    monkeypatch.setattr(numerics, "_backend", lambda path: None)


@pytest.mark.usefixtures("legacy_torch")
def test_a_torch_without_the_new_interface_is_read_and_set_through_the_legacy_switches() -> None:
    """Issue 52: on torch 2.6 every precision read ``absent`` and doctor warned
    ``numerics-changed`` ("cuda matmul ieee → absent") on a healthy run."""
    before = legacy_flags()
    try:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, True
        seen = Numerics.observe()
        assert (seen.cuda_matmul, seen.cudnn_conv, seen.cudnn_rnn) == ("tf32", "tf32", "tf32")
        assert (seen.mkldnn_matmul, seen.mkldnn_conv, seen.mkldnn_rnn) == ("ieee", "ieee", "ieee")
        with Numerics.comparison().applied():
            assert Numerics.observe() == Numerics.comparison()  # (nothing "absent", nothing differs)
            assert legacy_flags() == (False, False)
        assert Numerics.observe() == seen and legacy_flags() == (True, True)
        replace(Numerics.comparison(), cudnn_conv="none", cudnn_rnn="none").apply()
        assert legacy_flags()[0] is True  # (cuDNN's default: TF32)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
