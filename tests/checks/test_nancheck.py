"""nancheck on the seed machine (virtual devices): the seed story and its relatives."""

from __future__ import annotations

import json

import pytest

from gpudiag.checks.nancheck import Outcome, conclude
from gpudiag.parsers import parse_pairs
from tests.helpers import SEED_MACHINE, invoke

SEED = str(SEED_MACHINE)


def nancheck(*args: str) -> tuple[int, dict]:
    result = invoke(["nancheck", "--machine", SEED, *args, "--format", "json"], catch_exceptions=False)
    return result.exit_code, json.loads(result.stdout)


def pair(doc: dict, a: int, b: int) -> dict:
    return next(p for p in doc["pairs"] if (p["a"], p["b"]) == (a, b))


def test_seed_story_nan_on_the_pcie_pair_is_link_corruption() -> None:
    code, doc = nancheck("--inject", "5->6:nan@3")
    assert code == 1 and doc["schema"] == "gpudiag.nancheck/1" and doc["verdict"] == "fail"
    assert doc["strategy"] == "dp"
    assert len(doc["singles"]) == 8 and all(s["status"] == "ok" for s in doc["singles"])
    assert len(doc["pairs"]) == 28
    bad = [p for p in doc["pairs"] if p["status"] != "ok"]
    assert [(p["a"], p["b"]) for p in bad] == [(5, 6)]
    p56 = pair(doc, 5, 6)
    assert (p56["link"], p56["first_bad_step"]) == ("NODE", 3)
    assert p56["first_bad_transfer"]["src"] == 5 and p56["first_bad_transfer"]["dst"] == 6
    assert pair(doc, 6, 7)["status"] == "ok" and pair(doc, 6, 7)["link"] == "NV4"
    (finding,) = doc["findings"]
    assert finding["code"] == "link-corruption" and finding["severity"] == "error"
    assert finding["evidence"]["pairs"] == [[5, 6]] and finding["evidence"]["links"] == ["NODE"]
    assert "NCCL_P2P_DISABLE=1" in finding["fix"] and "iommu=pt" in finding["fix"]
    assert "CUDA_VISIBLE_DEVICES=0,1" in finding["fix"]


def test_a_fault_on_an_nvlink_pair_is_found_just_as_well() -> None:
    code, doc = nancheck("--inject", "6->7:bitflip@2x1")
    assert code == 1
    (finding,) = doc["findings"]
    assert finding["code"] == "link-corruption"
    assert finding["evidence"]["pairs"] == [[6, 7]] and finding["evidence"]["links"] == ["NV4"]
    assert pair(doc, 6, 7)["first_bad_step"] == 2


def test_every_pair_with_one_gpu_failing_is_a_device_fault() -> None:
    code, doc = nancheck("--inject", "*->4:inf@2")
    assert code == 1
    (finding,) = doc["findings"]
    assert finding["code"] == "device-fault" and finding["evidence"]["device"] == 4
    assert sorted(map(tuple, finding["evidence"]["pairs"])) == [
        (0, 4),
        (1, 4),
        (2, 4),
        (3, 4),
        (4, 5),
        (4, 6),
        (4, 7),
    ]


def test_a_learning_rate_that_blows_up_everywhere_is_numeric_divergence() -> None:
    code, doc = nancheck("--lr", "1e12", "--pairs", "0-1,5-6")
    assert code == 1
    (finding,) = doc["findings"]
    assert finding["code"] == "numeric-divergence"
    assert all(s["status"] != "ok" for s in doc["singles"])


def test_no_fault_passes() -> None:
    code, doc = nancheck("--pairs", "0-1,5-6,6-7")
    assert code == 0 and doc["verdict"] == "pass" and doc["findings"] == []
    assert [s["device"] for s in doc["singles"]] == [0, 1, 5, 6, 7]


def test_the_same_through_ddp() -> None:
    code, doc = nancheck(
        "--strategy", "ddp", "--pairs", "4-5,5-6,6-7", "--steps", "4", "--inject", "5->6:nan@3"
    )
    assert code == 1 and doc["strategy"] == "ddp"
    (finding,) = doc["findings"]
    assert finding["code"] == "link-corruption" and finding["evidence"]["pairs"] == [[5, 6]]
    where = pair(doc, 5, 6)["first_bad_transfer"]
    assert (where["phase"], where["dst"], where["step"], where["before_allreduce"]) == (
        "allreduce",
        6,
        3,
        False,
    )


def test_text_output_draws_the_pair_matrix() -> None:
    result = invoke(["nancheck", "--machine", SEED, "--inject", "5->6:nan@3", "--steps", "4"])
    assert result.exit_code == 1
    assert "NODE✗" in result.output and "link-corruption" in result.output


def test_virtual_devices_are_simulated_in_every_format() -> None:
    """Issue 17: a machine file's run said `pass` as if the machine's GPUs had trained."""
    args = ["nancheck", "--machine", SEED, "--pairs", "0-1", "--steps", "2"]
    doc = json.loads(invoke([*args, "--format", "json"]).stdout)
    assert doc["verdict"] == "pass" and doc["simulated"] is True
    assert "virtual devices laid out like" in doc["simulation"] and SEED in doc["simulation"]
    text = invoke(args)
    assert text.exit_code == 0 and text.stdout.startswith("nancheck PASS (simulated)")
    assert "Simulated on CPU virtual devices" in text.stdout and "(simulated, on the CPU)" in text.stdout
    markdown = invoke([*args, "--format", "markdown"]).stdout
    assert markdown.startswith("## nancheck: **pass** (simulated)")
    assert "not on the machine's GPUs" in markdown


@pytest.mark.usefixtures("no_gpu")
def test_without_gpus_or_machine_it_is_exit_3() -> None:
    result = invoke(["nancheck"])
    assert result.exit_code == 3
    assert "--machine" in result.stderr


@pytest.mark.parametrize("pairs", ["0-0", "0-9", "1:2"])
def test_bad_pairs_are_exit_2(pairs: str) -> None:
    result = invoke(["nancheck", "--machine", SEED, "--pairs", pairs])
    assert result.exit_code == 2


@pytest.mark.parametrize(
    ("command", "inject", "words"),
    [
        (["nancheck", "--machine", SEED, "--steps", "20"], "42->43:nan", "no run here has 42 and 43"),
        (
            ["nancheck", "--machine", SEED, "--steps", "20"],
            "5->6:nan@50",
            "step 50 comes after the run's last step (20)",
        ),
        (
            ["nancheck", "--machine", SEED, "--pairs", "5-6"],
            "0->1:nan",
            "no run here has 0 and 1 (runs: 5-6)",
        ),
        (["peer", "--machine", SEED, "--pairs", "0-1"], "*->7:zero", "no run here has 7"),
        (
            ["gradcheck", "--model", "mlp", "--input-shape", "4", "--world-size", "2"],
            "0->2:nan",
            "has 0 and 2",
        ),
        (
            ["gradcheck", "--model", "mlp", "--input-shape", "4", "--strategies", "single"],
            "0->1:nan",
            "no run moves",
        ),
        (
            ["gradcheck", "--model", "mlp", "--input-shape", "4", "--steps", "2"],
            "0->1:nan@3",
            "last step (2)",
        ),
    ],
)
def test_an_injection_that_cannot_fire_is_refused_before_anything_runs(
    command: list[str], inject: str, words: str
) -> None:
    result = invoke([*command, "--inject", inject])
    assert result.exit_code == 2 and "can never fire" in result.output and words in result.output, (
        result.output
    )
    assert "nothing was run" in result.output


def test_parse_pairs() -> None:
    assert parse_pairs("all", [0, 1, 2]) == [(0, 1), (0, 2), (1, 2)]
    assert parse_pairs("6-5,0-1,5-6", list(range(8))) == [(5, 6), (0, 1)]


def test_conclusions_from_patterns() -> None:
    ok = lambda *d: Outcome(d, "ok", None, [1.0])  # noqa: E731
    bad = lambda *d: Outcome(d, "diverged", 2, [1.0, float("nan")])  # noqa: E731
    singles = [ok(0), ok(1), ok(2)]
    assert conclude(singles, [ok(0, 1), ok(0, 2), ok(1, 2)], {}, None, "dp") == []
    (f,) = conclude(singles, [bad(0, 1), bad(0, 2), ok(1, 2)], {}, None, "dp")
    assert (f.code, f.evidence["device"]) == ("device-fault", 0)
    (f,) = conclude(singles, [bad(0, 1), ok(0, 2), ok(1, 2)], {(0, 1): "SYS"}, None, "dp")
    assert (f.code, f.evidence["links"]) == ("link-corruption", ["SYS"])
    # bad data that was already non-finite where it was made is the split batch, not the link
    made_bad = {"phase": "allreduce", "src": 1, "dst": 0, "step": 2, "before_allreduce": True}
    arrived_bad = {**made_bad, "before_allreduce": False}
    sent_bad = {"phase": "gather", "src": 1, "dst": 0, "step": 2, "nonfinite": 3, "corrupted": False}
    for where, code in (
        (made_bad, "pair-numeric-divergence"),
        (arrived_bad, "link-corruption"),
        (sent_bad, "pair-numeric-divergence"),
        ({**sent_bad, "corrupted": True}, "link-corruption"),
    ):
        pair = Outcome((0, 1), "diverged", 2, [1.0, float("nan")], where)
        (f,) = conclude(singles, [pair, ok(0, 2), ok(1, 2)], {}, None, "ddp")
        assert f.code == code, where
        assert f.severity == ("warning" if code == "pair-numeric-divergence" else "error")
    exploded = Outcome((0, 1), "exploded", 5, [1.0, 500.0])
    (f,) = conclude(singles, [exploded, ok(0, 2), ok(1, 2)], {}, None, "dp")
    assert f.code == "loss-explosion" and f.severity == "warning"


def test_trace_holds_every_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trace = tmp_path / "nan.jsonl"
    result = invoke(
        [
            "nancheck",
            "--machine",
            SEED,
            "--pairs",
            "5-6,6-7",
            "--steps",
            "3",
            "--inject",
            "5->6:nan@2",
            "--trace",
            str(trace),
        ],
    )
    assert result.exit_code == 1
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {e["run"] for e in events} == {"GPU5", "GPU6", "GPU7", "GPU5+GPU6", "GPU6+GPU7"}
    faulted = [e for e in events if e["type"] == "transfer" and e["faults"]]
    assert faulted and all(e["run"] == "GPU5+GPU6" and e["step"] >= 2 for e in faulted)


def test_a_standalone_rehearsal_says_so_first() -> None:
    code, doc = nancheck("--pairs", "5-6", "--steps", "4", "--inject", "5->6:nan@3")
    assert code == 1 and doc["rehearsal"].startswith("rehearsal with injected faults (--inject '5->6:nan@3')")
    text = invoke(["nancheck", "--machine", SEED, "--pairs", "5-6", "--steps", "4", "--inject", "5->6:nan@3"])
    assert text.stdout.startswith("Rehearsal with injected faults (--inject '5->6:nan@3')")
    assert nancheck("--pairs", "5-6", "--steps", "4")[1]["rehearsal"] is None


def test_a_rank_whose_gradient_went_bad_is_blamed_not_the_rank_it_reached() -> None:
    from gpudiag.checks.nancheck import _first_bad_transfer
    from gpudiag.runtime.record import Bucket, Recorder

    recorder = Recorder()
    for rank, before in ((0, 0), (1, 5)):  # rank 1 made the NaN; the all-reduce gave it to rank 0
        recorder.buckets.append(
            Bucket(
                step=2,
                rank=rank,
                index=0,
                numel=8,
                norm_before=1.0,
                nonfinite_before=before,
                norm_after=float("nan"),
                nonfinite_after=8,
                faults=[],
                time=0.0,
            )
        )
    result = type("Result", (), {"recorder": recorder})()
    where = _first_bad_transfer(result, (0, 1), "ddp")  # type: ignore[arg-type]
    assert where is not None and (where["dst"], where["before_allreduce"]) == (1, True)
