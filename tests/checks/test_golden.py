"""Golden text of gradcheck, nancheck and peer, as ``tests/golden/topology_*.txt`` holds for
topology: small runs on CPU virtual devices (built-in models, fixed seeds, the seed machine,
a canned host) whose whole text output is compared with ``tests/golden``. Floats at rounding
level are masked (``mask_rounding``); the rest is the same on every torch pyproject.toml
admits. ``GPUDIAG_UPDATE_GOLDEN=1`` rewrites the files: review the diff, commit."""

from __future__ import annotations

import pytest

from gpudiag.hw.host import collect
from tests.helpers import assert_golden, invoke, mask_rounding
from tests.helpers.hosts import epyc_host

pytestmark = pytest.mark.usefixtures("no_gpu")  # CPU virtual devices on a GPU machine too

SEED = ["--machine", "seed_8gpu_machine.json"]


def test_gradcheck_text_of_a_batchnorm_model() -> None:
    """cnn-bn: dp and ddp differ as-is, agree in controlled mode: explained, exit 0."""
    result = invoke(["gradcheck", "--model", "cnn-bn", "--input-shape", "3,8,8"])
    assert result.exit_code == 0, result.output
    assert_golden("gradcheck_cnn_bn.txt", mask_rounding(result.stdout))


def test_nancheck_text_of_a_rehearsed_link_fault() -> None:
    """A NaN planted on 5->6 at step 2 of the seed machine: link-corruption on (5,6), exit 1."""
    args = ["nancheck", *SEED, "--pairs", "0-1,5-6", "--inject", "5->6:nan@2"]
    result = invoke(args)
    assert result.exit_code == 1, result.output
    assert_golden("nancheck_seed_link.txt", mask_rounding(result.stdout))


def test_peer_text_of_a_rehearsed_copy_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies 5->6 zeroed on the seed machine, on an EPYC host with the IOMMU on and ACS
    redirecting (canned, with no NCCL_* of the caller's environment): exit 1."""
    monkeypatch.setattr(
        "gpudiag.checks.peer.collect", lambda runner=None: collect(epyc_host(), env={}, home="/nonexistent")
    )
    args = ["peer", *SEED, "--pairs", "5-6", "--sizes", "4K", "--inject", "5->6:zero"]
    result = invoke(args)
    assert result.exit_code == 1, result.output
    assert_golden("peer_seed_copy.txt", mask_rounding(result.stdout))
