"""gradcheck scenarios through the CLI and the Python API, with asserted verdicts and codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import codes, invoke, invoke_json, models

SMALL = ["--input-shape", "3,8,8"]
MODELS = Path(models.__file__)


def gradcheck(*args: str) -> tuple[int, dict]:
    return invoke_json("gradcheck", *args)


def test_plain_mlp_passes() -> None:
    code, doc = gradcheck("--model", "mlp", *SMALL)
    assert code == 0
    assert doc["schema"] == "gpudiag.gradcheck/1"
    assert doc["verdict"] == "pass" and doc["reference"] == "single"
    assert doc["tolerance"]["rel_norm_err"] == pytest.approx(1.3e-5)
    assert doc["settings"]["numerics"].startswith("fp32 ieee everywhere; cuDNN benchmark off")
    assert set(doc["numerics"]) == {"single", "dp", "ddp rank 0", "ddp rank 1"}
    assert [(c["strategy"], c["mode"], c["ok"]) for c in doc["comparisons"]] == [
        ("dp", "as-is", True),
        ("ddp", "as-is", True),
    ]
    ddp = doc["comparisons"][1]
    assert ddp["world_size"] == 2 and ddp["rel_norm_err"] < 1e-6
    assert ddp["cosine"] == pytest.approx(1.0) and ddp["norm_ratio"] == pytest.approx(1.0)
    assert ddp["first_bad_param"] is None
    assert codes(doc) == []


def test_batchnorm_is_explained_and_confirmed_in_controlled_mode() -> None:
    code, doc = gradcheck("--model", "cnn-bn", *SMALL)
    assert code == 0 and doc["verdict"] == "explained"
    assert codes(doc) == ["batchnorm-per-replica"]
    modes = {(c["strategy"], c["mode"]): c["ok"] for c in doc["comparisons"]}
    assert modes == {
        ("dp", "as-is"): False,
        ("ddp", "as-is"): False,
        ("dp", "controlled"): True,
        ("ddp", "controlled"): True,
    }
    assert doc["findings"][0]["evidence"]["confirmed_by_controlled_rerun"] is True
    assert doc["comparisons"][0]["first_bad_param"] == "0.weight"


def test_auto_mode_starts_one_ddp_launch_for_as_is_and_controlled(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpudiag.checks.gradcheck.schedule as module

    launches: list[int] = []
    real = module.start_ddp

    def counting(jobs, *args):  # type: ignore[no-untyped-def]
        launches.append(len(jobs))
        return real(jobs, *args)

    monkeypatch.setattr(module, "start_ddp", counting)
    code, doc = gradcheck("--model", "cnn-bn", *SMALL)
    assert code == 0 and codes(doc) == ["batchnorm-per-replica"]
    assert launches == [2]  # both modes' DDP runs, one start and one rendezvous
    launches.clear()
    gradcheck("--model", "mlp", *SMALL)  # nothing to control: as-is only
    assert launches == [1]


def test_a_crash_in_the_controlled_ddp_run_is_pinned_on_it() -> None:
    code, doc = gradcheck(
        "--model", f"{MODELS}:CrashesWhenControlled", "--input-shape", "8", "--num-classes", "4"
    )
    assert code == 1 and doc["verdict"] == "fail"
    (finding,) = [f for f in doc["findings"] if f["code"] == "rank-crashed"]
    assert finding["evidence"]["mode"] == "controlled" and finding["evidence"]["strategy"] == "ddp"
    assert "boom in controlled mode" in finding["evidence"]["detail"]
    modes = {(c["strategy"], c["mode"]) for c in doc["comparisons"]}
    assert ("ddp", "as-is") in modes and ("ddp", "controlled") not in modes


def test_batchnorm_and_an_unused_parameter_are_both_explained() -> None:
    code, doc = gradcheck(
        "--model", f"{MODELS}:UnusedWithBatchNorm", "--input-shape", "8", "--num-classes", "4"
    )
    assert code == 0 and doc["verdict"] == "explained", doc["findings"]
    assert sorted(codes(doc)) == ["batchnorm-per-replica", "unused-parameters"]
    controlled = [c for c in doc["comparisons"] if c["mode"] == "controlled" and c["strategy"] == "ddp"]
    assert controlled and all(
        c["ok"] and c["options"] == {"find_unused_parameters": True} for c in controlled
    )


def test_strict_turns_explained_into_exit_1() -> None:
    code, doc = gradcheck("--model", "cnn-bn", *SMALL, "--strict")
    assert code == 1 and doc["verdict"] == "explained"


def test_dropout_is_explained() -> None:
    code, doc = gradcheck("--model", "mlp-dropout", *SMALL)
    assert code == 0 and doc["verdict"] == "explained"
    assert codes(doc) == ["dropout-active"]


def test_sum_loss_under_ddp_is_a_world_size_scale() -> None:
    """A loss normalised per device is a bug in the training code: named, and the run fails
    (issue 46: a CI gate must not pass it)."""
    code, doc = gradcheck("--model", "mlp", *SMALL, "--loss", "ce-sum")
    assert code == 1 and doc["verdict"] == "fail"
    assert codes(doc) == ["loss-scale-world-size"]
    ddp = next(c for c in doc["comparisons"] if c["strategy"] == "ddp")
    assert ddp["norm_ratio"] == pytest.approx(0.5, rel=1e-4) and ddp["cosine"] == pytest.approx(1.0)
    dp = next(c for c in doc["comparisons"] if c["strategy"] == "dp")
    assert dp["ok"]  # DP sums replica gradients of a loss on the gathered output


def test_uneven_batch_is_explained_by_mean_of_means() -> None:
    code, doc = gradcheck("--model", "mlp", *SMALL, "--batch-size", "7")
    assert code == 0 and doc["verdict"] == "explained"
    (finding,) = [f for f in doc["findings"] if f["code"] == "uneven-shards"]
    assert finding["evidence"]["shards"] == [4, 3]
    assert finding["severity"] == "warning"


def test_injected_nan_on_a_dp_link_fails_naming_the_link() -> None:
    code, doc = gradcheck("--model", "mlp", *SMALL, "--strategies", "single,dp", "--inject", "1->0:nan@1")
    assert code == 1 and doc["verdict"] == "fail"
    (finding,) = [f for f in doc["findings"] if f["code"] == "nonfinite-gradient"]
    ev = finding["evidence"]
    assert (ev["strategy"], ev["src"], ev["dst"], ev["phase"], ev["transfer_step"]) == (
        "dp",
        1,
        0,
        "gather",
        1,
    )
    assert "1->0" in finding["message"]


def test_unused_parameter_is_found_and_retried() -> None:
    code, doc = gradcheck("--model", "mlp-unused", *SMALL)
    assert code == 0 and doc["verdict"] == "explained"
    assert codes(doc) == ["unused-parameters"]
    retried = [c for c in doc["comparisons"] if c["options"].get("find_unused_parameters")]
    assert len(retried) == 1 and retried[0]["ok"]


def test_crashing_rank_fails_with_rank_crashed() -> None:
    code, doc = gradcheck("--model", f"{MODELS}:Crashes", "--input-shape", "8", "--num-classes", "4")
    assert code == 1 and doc["verdict"] == "fail"
    (finding,) = [f for f in doc["findings"] if f["code"] == "rank-crashed"]
    assert finding["evidence"]["rank"] == 1 and "boom on rank 1" in finding["evidence"]["detail"]


def test_several_adam_steps_compare_updates_and_ranks_stay_identical() -> None:
    code, doc = gradcheck("--model", "mlp", *SMALL, "--steps", "3", "--optimizer", "adam")
    assert code == 0 and doc["verdict"] == "pass"
    assert all(c["update_rel_err"] is not None for c in doc["comparisons"])


def test_mse_loss_and_text_and_markdown() -> None:
    code, doc = gradcheck("--model", "cnn", *SMALL, "--loss", "mse")
    assert code == 0 and doc["verdict"] == "pass"
    text = invoke(["gradcheck", "--model", "cnn-bn", *SMALL]).output
    head = text.splitlines()[:5]  # the answer first (issue 47): verdict, code, cause cell, fix
    assert head[0].startswith("gradcheck EXPLAINED") and "batchnorm-per-replica" in head[1]
    assert "BatchNorm statistics per device" in head[1] and "fix: SyncBatchNorm" in head[1]
    assert text.count("Where dp, ddp (as-is) differ") == 1 and "Where dp (as-is)" not in text
    md = invoke(["gradcheck", "--model", "mlp", *SMALL, "--format", "markdown"]).output
    assert md.startswith("## gradcheck: **pass**") and "| dp | as-is | ok |" in md


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "torchvision:resnet19"], "did you mean resnet18"),
        (["--model", "nope.py:f"], "does not exist"),
        (["--model", "mlp", "--inject", "1-0:sparkle"], "SRC->DST:KIND"),  # (1-0:nan is a spec now)
        (["--model", "mlp", "--input-shape", "3,x"], "bad shape"),
        (["--model", "mlp", "--strategies", "single,fsdp"], "single, dp, ddp"),
    ],
)
def test_bad_input_is_exit_2(args: list[str], message: str) -> None:
    result = invoke(["gradcheck", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_trace_file(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    result = invoke(["gradcheck", "--model", "mlp", *SMALL, "--trace", str(trace)])
    assert result.exit_code == 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"single (as-is)", "dp (as-is)", "ddp (as-is)"}


def test_python_api_on_a_regression_model_with_two_inputs_and_a_custom_loss() -> None:
    import gpudiag

    g = torch.Generator().manual_seed(0)
    x, z, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)

    def loss(output: dict, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.smooth_l1_loss(output["pred"], target)

    report = gpudiag.gradcheck(models.TwoInputRegressor, (x, z), y, loss=loss, world_size=3)
    assert report.verdict == "pass", report.summary()
    assert [c.world_size for c in report.comparisons] == [3, 3]


def test_pytest_helper() -> None:
    from gpudiag.testing import assert_strategies_agree

    x, y = models.batch(8)
    assert assert_strategies_agree(models.mlp, x, y).verdict == "pass"
    with pytest.raises(AssertionError, match="batchnorm-per-replica"):
        assert_strategies_agree(models.bn_net, x, y)
    assert (
        assert_strategies_agree(models.bn_net, x, y, allow=["batchnorm-per-replica"]).verdict == "explained"
    )


def wrapped_mlp() -> torch.nn.Module:
    return torch.nn.DataParallel(models.mlp())  # what the seeds do before training


def test_dataparallel_wrapped_factory_is_compared_unwrapped() -> None:
    import gpudiag

    x, y = models.batch(8)
    report = gpudiag.gradcheck(wrapped_mlp, x, y)
    assert report.verdict == "pass", report.summary()
    assert report.config["unwrapped"] == ["module."]
    assert report.comparisons[0].params[0].name == "0.weight"


def test_sync_batchnorm_on_cpu_is_skipped_with_the_reason() -> None:
    code, doc = gradcheck("--model", "cnn-bn", *SMALL, "--sync-batchnorm")
    assert code == 0
    notes = [f["message"] for f in doc["findings"] if f["code"] == "syncbn-skipped"]
    assert any("CPU" in n for n in notes) and any(
        "only works with DistributedDataParallel" in n for n in notes
    )
    assert "batchnorm-per-replica" in codes(doc)


def test_fused_norms_fall_back_to_float64_where_fp32_overflows() -> None:
    import torch

    from gpudiag.checks.gradcheck.compare import norms as _norms

    assert _norms([torch.full((4,), 1e20), torch.ones(9)]) == [pytest.approx(2e20), 3.0]
    assert _norms([torch.tensor([float("inf"), 1.0])]) == [float("inf")]
