"""The command line through click's CliRunner: help, formats, exit codes, safe writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import NVML, SEED_MACHINE, TOPO, assert_golden, invoke

SEED = str(TOPO / "seed_8gpu_nv4_pairs_node_sys.txt")
EXAMPLE_MACHINE = SEED_MACHINE


def run(*args: str, env: dict[str, str] | None = None, stdin: str | None = None):  # type: ignore[no-untyped-def]
    return invoke(list(args), env=env, input=stdin, catch_exceptions=False)


@pytest.mark.parametrize("args", [["--help"], ["topology", "--help"]])
def test_help(args: list[str]) -> None:
    result = run(*args)
    assert result.exit_code == 0
    assert "Usage:" in result.output


def test_every_command_and_subcommand_answers_help() -> None:
    """``gradcheck --help`` was an internal error once (a click type whose ``get_metavar`` did
    not take click 8.2's ``ctx``): every command's help is read here."""
    from gpudiag.cli import cli

    paths: list[list[str]] = []
    for name, command in cli.commands.items():
        if name == "watch":  # (a pointer to the Python API, exit 2 with its help: test_first_day)
            continue
        paths.append([name])
        paths += [[name, sub] for sub in getattr(command, "commands", {})]
    assert len(paths) > 10
    for path in paths:
        result = invoke([*path, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output, (path, result.output[-500:])


def test_version() -> None:
    assert run("--version").output.startswith("gpudiag, version ")


def test_topology_json_schema_from_a_capture() -> None:
    result = run("topology", "--from-file", SEED, "--format", "json")
    assert result.exit_code == 0
    doc = json.loads(result.output)
    assert doc["schema"] == "gpudiag.topology/1"
    assert doc["source"] == "nvidia-smi"
    assert doc["numbering"] == "nvidia-smi"
    assert doc["labels"] == [f"GPU{i}" for i in range(8)]
    assert doc["gpus"]["GPU0"]["cpu_affinity"] == "0-31"
    assert doc["gpus"]["GPU0"]["numa_affinity"] is None
    assert doc["nic_legend"] == {}
    assert doc["matrix"]["GPU0"]["GPU0"] == "X"  # the Greek Χ is normalised
    assert doc["matrix"]["GPU5"]["GPU6"] == "NODE"
    first = doc["pairs"][0]
    assert first == {
        "a": 0,
        "b": 1,
        "link": "NV4",
        "kind": "nvlink",
        "nvlinks": 4,
        "path": "NVLINK",
        "p2p": None,
        "p2p_caps": {},
    }
    assert {"code", "severity", "message", "evidence"} <= set(doc["warnings"][0])
    assert [a["code"] for a in doc["advice"]] == ["best-gpu-groups", "best-gpu-groups", "numa-affinity"]


def test_soc_is_reported_as_sys_path_in_json() -> None:
    doc = json.loads(
        run(
            "topology", "--from-file", str(TOPO / "p40_8gpu_pix_pxb_soc_legacy_tabs.txt"), "--format", "json"
        ).output
    )
    assert doc["matrix"]["GPU0"]["mlx5_0"] == "SOC"
    assert {p["path"] for p in doc["pairs"]} == {"PIX", "PXB"}


def test_capture_from_stdin() -> None:
    result = run("topology", "--from-file", "-", "--format", "json", stdin=Path(SEED).read_text())
    assert result.exit_code == 0
    assert json.loads(result.output)["pairs"][0]["link"] == "NV4"


def test_markdown_and_dot() -> None:
    md = run("topology", "--from-file", SEED, "--format", "markdown").output
    assert md.startswith("## GPU topology")
    assert "| **GPU0** | X | NV4 |" in md
    assert "`CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1`" in md
    dot = run(
        "topology", "--from-file", str(TOPO / "h100_8gpu_nv18_8nic_spaces.txt"), "--format", "dot"
    ).output
    assert dot.startswith("graph topology {") and dot.rstrip().endswith("}")
    assert '"GPU0" -- "GPU1" [label="NV18"' in dot
    assert '"GPU0" -- "NIC0" [label="PIX"' in dot
    assert '"GPU0" -- "NIC4"' not in dot  # far NICs are left out


@pytest.mark.parametrize(
    ("capture", "golden"),
    [
        ("seed_8gpu_nv4_pairs_node_sys.txt", "topology_seed.txt"),
        ("dgx_a100_8gpu_nv12_10nic_spaces.txt", "topology_dgx_a100.txt"),
    ],
)
def test_text_output_matches_golden_file(capture: str, golden: str) -> None:
    assert_golden(golden, run("topology", "--from-file", str(TOPO / capture)).output)


def test_no_driver_is_exit_3_with_one_line() -> None:
    result = run("topology", env={"GPUDIAG_NVML_SCENARIO": str(NVML / "no_driver.json")})
    assert result.exit_code == 3
    assert result.stdout == ""
    (line,) = result.stderr.strip().split("\n")
    assert "libnvidia-ml.so" in line and "--from-file" in line


def test_live_nvml_scenario_renders() -> None:
    result = run(
        "topology",
        "--format",
        "json",
        env={"GPUDIAG_NVML_SCENARIO": str(NVML / "rtx5090_2gpu_pcie_gns.json")},
    )
    assert result.exit_code == 0
    doc = json.loads(result.output)
    assert doc["source"] == "nvml"
    assert doc["pairs"][0]["p2p"] == "GNS"
    assert [w["code"] for w in doc["warnings"]] == ["p2p-not-supported"]
    assert doc["gpus"]["GPU1"]["torch_index"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from-file", "/nonexistent/topo.txt"], "does not exist"),
        (["--from-file", str(TOPO / "amd_rocm_smi_showtopo_4gpu_pcie.txt")], "rocm-smi"),
        (["--machine", "/nonexistent/m.json"], "does not exist"),
        (["--from-file", SEED, "--machine", SEED], "not both"),
        (["--machine", str(TOPO / "amd_rocm_smi_showtopo_4gpu_pcie.txt")], "rocm-smi"),
        (["--machine", "/dev/zero"], "larger than 8 MiB"),
    ],
)
def test_bad_input_is_exit_2_with_one_line(args: list[str], message: str) -> None:
    result = run("topology", *args)
    assert result.exit_code == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().split("\n")
    assert line.startswith("gpudiag: error:") and message in line


def test_bad_option_is_exit_2() -> None:
    assert run("topology", "--format", "yaml").exit_code == 2


def test_save_machine_then_machine_gives_the_same_result(tmp_path: Path) -> None:
    machine = tmp_path / "seed.json"
    first = run("topology", "--from-file", SEED, "--save-machine", str(machine), "--format", "json")
    again = run("topology", "--machine", str(machine), "--format", "json")
    a, b = json.loads(first.output), json.loads(again.output)
    assert (a.pop("source"), b.pop("source")) == ("nvidia-smi", "machine-file")
    assert a == b


def test_save_machine_refuses_to_overwrite_and_leaves_input_alone(tmp_path: Path) -> None:
    capture = tmp_path / "topo.txt"
    shutil.copy(SEED, capture)
    before = capture.read_bytes()
    target = tmp_path / "m.json"
    target.write_text("mine")
    result = run("topology", "--from-file", str(capture), "--save-machine", str(target))
    assert result.exit_code == 2 and "--force" in result.stderr
    assert target.read_text() == "mine"
    assert (
        run("topology", "--from-file", str(capture), "--save-machine", str(target), "--force").exit_code == 0
    )
    assert json.loads(target.read_text())["schema"] == "gpudiag.machine/1"
    assert capture.read_bytes() == before


def test_debug_shows_the_traceback() -> None:
    import subprocess
    import sys

    argv = [sys.executable, "-m", "gpudiag", "topology", "--from-file", "/nonexistent"]
    plain = subprocess.run(argv, capture_output=True, text=True)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    debug = subprocess.run([*argv[:3], "--debug", *argv[3:]], capture_output=True, text=True)
    assert debug.returncode != 0
    assert "Traceback (most recent call last)" in debug.stderr and "InputError" in debug.stderr


def test_names_with_brackets_are_printed_literally(tmp_path: Path) -> None:
    machine = tmp_path / "m.json"
    run("topology", "--from-file", SEED, "--save-machine", str(machine))
    data = json.loads(machine.read_text())
    data["gpus"][0]["name"] = "Odd [/] GPU [bold]"
    machine.write_text(json.dumps(data))
    result = run("topology", "--machine", str(machine))
    assert result.exit_code == 0
    assert "Odd [/] GPU [bold]" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["nancheck", "--machine", str(EXAMPLE_MACHINE), "--pairs", "\uff10-1"],
        ["peer", "--machine", str(EXAMPLE_MACHINE), "--sizes", "\uff14K"],
        ["gradcheck", "--model", "mlp", "--input-shape", "\uff13,8"],
        ["nancheck", "--machine", str(EXAMPLE_MACHINE), "--inject", "\uff15->6:nan"],
    ],
)
def test_non_ascii_digits_are_not_numbers(args: list[str]) -> None:
    result = invoke(args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e999"])
@pytest.mark.parametrize(
    "args",
    [
        ["gradcheck", "--model", "mlp", "--input-shape", "3,4,4", "--timeout={}"],
        ["nancheck", "--model", "mlp", "--input-shape", "3,4,4", "--timeout={}"],
        ["bench", "--model", "mlp", "--timeout={}"],
        ["run", "--stall={}", "script.py"],
        ["sweep", "--inject-delay={}"],
    ],
)
def test_a_number_that_is_not_finite_is_refused_before_anything_runs(args: list[str], value: str) -> None:
    """click's FloatRange lets nan and inf through its bounds: gradcheck --timeout inf
    failed as "the model factory raised OverflowError", --timeout nan as a crashed rank."""
    result = invoke([a.format(value) for a in args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "is not a finite number" in result.output or "is not in the range" in result.output  # (-inf)


def test_a_non_ascii_numa_node_never_reaches_a_command_line(tmp_path: Path) -> None:
    doc = json.loads(EXAMPLE_MACHINE.read_text())
    for gpu in doc["gpus"]:
        gpu["numa_affinity"] = "\uff10"  # a fullwidth 0
    machine = tmp_path / "m.json"
    machine.write_text(json.dumps(doc))
    result = run("topology", "--machine", str(machine))
    assert result.exit_code == 0 and "numactl" not in result.output and "taskset" in result.output


@pytest.mark.parametrize("command", ["topology", "nancheck", "peer"])
@pytest.mark.parametrize("machine", ["seed_8gpu_topo.txt", "diag/examples/seed_8gpu_machine.json"])
def test_machine_takes_a_capture_or_a_machine_file_and_bundled_examples_by_name(
    command: str, machine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # not the repository: the examples come with the package
    extra = {"topology": [], "nancheck": ["--pairs", "0-1", "--steps", "2"], "peer": ["--pairs", "0-1"]}[
        command
    ]
    result = invoke([command, "--machine", machine, *extra, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["schema"].startswith("gpudiag.")


def test_piped_text_is_never_cut_and_colour_follows_no_color_and_force_color(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io

    from rich.table import Table

    from gpudiag.render.text import text_console

    def printed(**env: str) -> str:
        for name in ("NO_COLOR", "FORCE_COLOR"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        stream = io.StringIO()  # not a terminal, as when piped
        with text_console(stream) as out:
            table = Table("name", "value")
            table.add_row("[red]x[/red]", "y" * 400)
            out.print(table)
        return stream.getvalue()

    plain = printed()
    assert "y" * 400 in plain and "\x1b[" not in plain  # whole, no colour
    forced = printed(FORCE_COLOR="1")
    assert "\x1b[" in forced and "y" * 400 in forced
    assert "\x1b[" not in printed(FORCE_COLOR="1", NO_COLOR="1")


def test_under_torchrun_only_rank_0_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    printed = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        result = run("topology", "--from-file", SEED, "--format", "json")
        assert result.exit_code == 0
        printed[rank] = result.stdout
    assert json.loads(printed["0"])["schema"] == "gpudiag.topology/1" and printed["1"] == ""


@pytest.mark.usefixtures("no_gpu")
def test_gradcheck_on_cpu_virtual_devices_says_simulated() -> None:
    """Issue 17: gradcheck without GPUs ran on virtual devices and said a plain `PASS`."""
    args = ["gradcheck", "--model", "mlp", "--input-shape", "3,8,8", "--strategies", "single,dp"]
    doc = json.loads(run(*args, "--format", "json").stdout)
    assert doc["verdict"] == "pass" and doc["simulated"] is True
    assert doc["simulation"].startswith("simulated on CPU virtual devices")
    text = run(*args).stdout
    assert text.startswith("gradcheck PASS (simulated)") and "CUDA, NCCL and TF32 not exercised" in text
    assert run(*args, "--format", "markdown").stdout.startswith("## gradcheck: **pass** (simulated)")
