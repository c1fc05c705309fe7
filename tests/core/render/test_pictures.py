"""The pictures (issue 47): each SVG is well-formed XML drawn from real inputs — the real
captures, the real flight-recorder dumps of gloo jobs, a real bench and gradcheck run on
CPU (tests/data/pictures, written by ``gpudiag bench --model cnn --steps 5 --gpus 2,4`` and
``gpudiag gradcheck --model torchvision:resnet18?num_classes=10``, ``--format json``) — with
one node per GPU, one lane per rank, and every name from an input escaped; REPORT.html is
self-contained. Structure, not pixels (``make screenshots`` is for eyes)."""

from __future__ import annotations

import copy
import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from gpudiag.hang.analysis import analyse
from gpudiag.hang.reader import read_dumps
from gpudiag.hang.result import judge
from gpudiag.render import svg as svgmod
from gpudiag.render.pictures import bundle_pictures, check_pictures, picture
from gpudiag.render.svg_bench import bench_svg
from gpudiag.render.svg_gradcheck import MAX_ROWS, gradcheck_svg
from gpudiag.render.svg_hang import MAX_LANES, hang_svg
from gpudiag.render.svg_topology import topology_svg
from gpudiag.topology import parse_capture
from gpudiag.topology.analysis import analyze
from tests.helpers import DATA, FR, SEED_TOPO, TOPO

NS = "{http://www.w3.org/2000/svg}"
HOSTILE = "</text><script>alert(1)</script>&amp;\"'\x00\x1b]8;;x\x07 ]]><!--"
BENCH = json.loads((DATA / "pictures" / "bench_cnn_cpu.json").read_text())
GRADCHECK = json.loads((DATA / "pictures" / "gradcheck_resnet18_cpu.json").read_text())


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{NS}svg" and len(svg.encode()) <= svgmod.MAX_BYTES
    return root


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(f"{NS}text")]


def topology_doc(path: Path) -> dict[str, Any]:
    return analyze(parse_capture(path.read_text(encoding="utf-8"), path.name)).to_json()


def captures() -> list[Path]:
    out = []
    for path in sorted(TOPO.glob("*.txt")):
        try:
            topology_doc(path)
        except Exception:  # not an nvidia-smi topo -m capture (rocm-smi, p2pBandwidthLatencyTest)
            continue
        out.append(path)
    return out


@pytest.mark.parametrize("path", [SEED_TOPO, *captures()], ids=lambda p: p.name)
def test_topology_one_node_per_gpu(path: Path) -> None:
    doc = topology_doc(path)
    root = parse(topology_svg(doc))
    gpus = sorted(g["index"] for g in doc["gpus"].values())
    shown = sorted(int(t[4:]) for t in texts(root) if re.fullmatch(r"GPU \d+", t))
    assert shown == gpus


def test_topology_seed_islands_and_paths() -> None:
    root = parse(topology_svg(topology_doc(SEED_TOPO)))
    arcs = [p for p in root.iter(f"{NS}path") if p.get("fill") == "none"]
    assert len(arcs) == 4  # NVLink joins (0,1) (2,3) (4,5) (6,7)
    labels = texts(root)
    assert labels.count("NV4") == 4 and "8 GPUs; 4 NVLink islands" in labels
    assert sum(t.startswith("NODE:") for t in labels) == 2 and sum(t.startswith("SYS:") for t in labels) == 1


def test_topology_all_to_all_nvlink_is_one_band() -> None:
    root = parse(topology_svg(topology_doc(TOPO / "h100_8gpu_nv18_8nic_spaces.txt")))
    assert "NV18 all-to-all: 8 GPUs" in texts(root)
    assert not [p for p in root.iter(f"{NS}path") if p.get("fill") == "none"]  # no 28 arcs


def test_topology_escapes_hostile_names_and_stays_bounded() -> None:
    doc = topology_doc(SEED_TOPO)
    for g in doc["gpus"].values():
        g["name"] = HOSTILE * 1000
    svg = topology_svg(doc)
    root = parse(svg)
    assert "<script" not in svg and not list(root.iter(f"{NS}script"))
    big = {"gpus": {f"GPU{i}": {"index": i, "name": HOSTILE} for i in range(500)}, "pairs": []}
    root = parse(topology_svg(big))
    assert sum(bool(re.fullmatch(r"GPU \d+", t)) for t in texts(root)) == 16
    assert any("484 more GPUs" in t for t in texts(root))


def real_hang(case: str) -> dict[str, Any]:
    return judge(analyse(read_dumps([str(FR / "gloo" / case / "json")]))).to_json()


@pytest.mark.parametrize(
    "case", ["dead", "skip", "subgroup", "swap", "straggler", "healthy", "p2p", "shapes"]
)
def test_hang_one_lane_per_rank(case: str) -> None:
    doc = real_hang(case)
    root = parse(hang_svg(doc))
    lanes = [t for t in texts(root) if re.fullmatch(r"ranks? \d+(–\d+)?", t)]
    assert lanes == [f"rank {r}" for r in range(doc["world_size"])]
    bold = {"".join(t.itertext()) for t in root.iter(f"{NS}text") if t.get("font-weight") == "bold"}
    assert {f"rank {r}" for r in doc["culprit_ranks"]} == bold - {texts(root)[0]}  # the title is bold


def test_hang_the_dead_rank_has_an_empty_lane() -> None:
    root = parse(hang_svg(real_hang("dead")))
    assert "no dump: dead, or killed before it could dump" in texts(root)
    assert "all_reduce #2 in default_pg (pending)" in texts(root)


def scaled(world: int, culprit: int) -> dict[str, Any]:
    """The real subgroup verdict's rows repeated to ``world`` ranks, one culprit."""
    doc = real_hang("subgroup")
    row = next(r for r in doc["ranks"] if r["rank"] == 1)
    doc["ranks"] = [dict(copy.deepcopy(row), rank=r) for r in range(world)]
    doc["ranks"][culprit].update(op="barrier", group="default_pg")
    doc["world_size"], doc["culprit_ranks"] = world, [culprit]
    return doc


def test_hang_64_ranks_each_a_lane_more_summarised() -> None:
    root = parse(hang_svg(scaled(64, 17)))
    assert [t for t in texts(root) if re.fullmatch(r"rank \d+", t)] == [f"rank {r}" for r in range(64)]
    root = parse(hang_svg(scaled(1000, 517)))
    lanes = [t for t in texts(root) if re.fullmatch(r"ranks? \d+(–\d+)?", t)]
    assert lanes == ["ranks 0–516", "rank 517", "ranks 518–999"]
    varied = scaled(1000, 3)
    for r in varied["ranks"]:
        r["seq"] = r["rank"]  # every rank somewhere else: at most MAX_LANES lanes, the culprit kept
    lanes = [t for t in texts(parse(hang_svg(varied))) if re.fullmatch(r"ranks? \d+(–\d+)?", t)]
    assert len(lanes) == MAX_LANES and "rank 3" in lanes


def test_hang_escapes_hostile_group_names() -> None:
    doc = real_hang("skip")
    for r in doc["ranks"]:
        r["group"] = HOSTILE
    doc["summary"] = HOSTILE * 50
    svg = hang_svg(doc)
    root = parse(svg)
    assert "<script" not in svg and any("</text><script>" in t for t in texts(root))


def test_bench_one_bar_per_case_phases_named() -> None:
    root = parse(bench_svg(BENCH))
    names = [t for t in texts(root) if re.fullmatch(r"(single|dp|ddp) ×\d fp32", t)]
    assert names == [f"{c['strategy']} ×{c['gpus']} {c['dtype']}" for c in BENCH["cases"]]
    assert {"forward", "backward", "allreduce"} <= set(texts(root))  # the legend names the phases
    assert any(t.startswith("allreduce ") and t.endswith(" ms") for t in texts(root))  # ddp's exposed reduce


def test_gradcheck_a_row_per_module_a_marker_per_comparison() -> None:
    root = parse(gradcheck_svg(GRADCHECK))
    modules = list(dict.fromkeys(p["name"].rpartition(".")[0] for p in GRADCHECK["comparisons"][0]["params"]))
    labels = texts(root)
    assert modules == labels[labels.index("conv1") : labels.index("conv1") + len(modules)]
    markers = [e for e in root.iter() if e.tag in (f"{NS}circle", f"{NS}polygon") or e.tag == f"{NS}rect"]
    assert len([e for e in root.iter(f"{NS}circle")]) == len(modules) + 1  # dp as-is per module, + legend
    assert markers and "tolerance 1.3e-05 (fp32)" in labels


def test_gradcheck_large_models_by_depth_and_hostile_names() -> None:
    doc = copy.deepcopy(GRADCHECK)
    doc["comparisons"] = doc["comparisons"][:1]
    doc["comparisons"][0]["params"] = [
        {"name": f"blocks.{i // 10}.layer{i % 10}.{HOSTILE}.weight", "rel_norm_err": 10.0 ** -(i % 9)}
        for i in range(300)
    ]
    svg = gradcheck_svg(doc)
    root = parse(svg)
    rows = [t for t in texts(root) if t.startswith("blocks.")]
    assert 0 < len(rows) <= MAX_ROWS and "<script" not in svg


@pytest.mark.parametrize("draw", [topology_svg, hang_svg, bench_svg, gradcheck_svg])
def test_empty_or_damaged_results_draw_a_sentence(draw: Any) -> None:
    parse(draw({}))
    parse(draw({"gpus": [], "ranks": "x", "cases": [None], "comparisons": [{"params": [{"name": 3}]}]}))


def test_picture_of_a_damaged_result_says_so() -> None:
    root = parse(picture("bench", {"cases": [{"phases_s": {"forward": "fast"}, "samples_per_s": [1]}]}))
    assert root is not None
    root = parse(picture("topology", {"gpus": {"x": {"index": 0}}, "pairs": [{"a": 0}]}))
    assert root is not None


class Resources(HTMLParser):
    """Every URL an HTML page would fetch or link to, and its tags."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "action", "srcset", "data", "poster") and value:
                self.urls.append(value)
            if value and "url(" in value:
                self.urls += re.findall(r"url\(([^)]*)\)", value)

    def handle_data(self, data: str) -> None:
        if self.tags and self.tags[-1] == "style":
            self.urls += re.findall(r"url\(([^)]*)\)", data) + re.findall(r"@import\s+(\S+)", data)


def test_report_html_is_self_contained_and_escaped() -> None:
    report = {
        "gpudiag": "0.1.0",
        "torch": "2.14.1",
        "created": "2026-11-29T05:00:00+00:00",
        "simulation": "simulated: " + HOSTILE,
        "checks": [
            {"name": "topology", "status": "warning", "headline": "<img src=http://x/a.png>", "findings": [],
             "result": topology_doc(SEED_TOPO), "command": "gpudiag topology"},
            {"name": "hang", "status": "fail", "headline": "stuck", "result": real_hang("subgroup"),
             "findings": [{"code": "hang", "severity": "error", "message": HOSTILE, "fix": "<a href=//x>"}]},
            {"name": "gradcheck", "status": "pass", "headline": "ok", "result": GRADCHECK, "findings": []},
            {"name": "env", "status": "pass", "headline": "env", "result": {}, "findings": []},
        ],
    }  # fmt: skip
    files = bundle_pictures(report, "# report\n<script src=https://x/y.js></script>\n")
    assert set(files) == {"topology.svg", "hang.svg", "gradcheck.svg", "REPORT.html"}
    page = files["REPORT.html"].decode()
    found = Resources()
    found.feed(page)
    assert all(url.startswith("#") for url in found.urls), found.urls  # in-page anchors and patterns only
    assert not {"script", "img", "link", "iframe", "object", "embed", "base"} & set(found.tags)
    assert "&lt;img src=http://x/a.png&gt;" in page  # a URL in a headline stays text
    assert found.tags.count("svg") == 3 and "<script src" not in page
    for name in ("topology.svg", "hang.svg", "gradcheck.svg"):
        parse(files[name].decode())
    assert check_pictures(report).keys() == {"topology.svg", "hang.svg", "gradcheck.svg"}


def test_a_broken_pair_is_marked_on_the_topology() -> None:
    """nancheck's link-corruption on (5,6) of the seed machine (its evidence as nancheck
    writes it) is drawn on the topology; a warning's pairs are not."""
    finding = {
        "code": "link-corruption",
        "severity": "error",
        "message": "m",
        "evidence": {"pairs": [[6, 5]]},
    }
    report = {
        "checks": [
            {"name": "topology", "status": "warning", "result": topology_doc(SEED_TOPO), "findings": []},
            {"name": "nancheck", "status": "fail", "result": {}, "findings": [finding]},
            {"name": "peer", "status": "warn", "result": {}, "findings": [dict(finding, severity="warning",
             code="other", evidence={"directions": [[0, 1]]})]},
        ]
    }  # fmt: skip
    labels = texts(parse(check_pictures(report)["topology.svg"]))
    assert "GPU 5–6: link-corruption" in labels and not any(t.startswith("GPU 0–1") for t in labels)
