"""Private torch attributes gpudiag reaches (through ``getattr``): each use survives the
attribute's absence and the signature of every torch version pyproject.toml admits."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT


def test_flight_recorder_dump_is_none_where_torch_has_no_recorder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._C._distributed_c10d as c10d

    from gpudiag.repro.sweep.run import dump_flight_recorder

    for name in ("_dump_fr_trace", "_dump_nccl_trace"):
        monkeypatch.delattr(c10d, name, raising=False)
    assert dump_flight_recorder(tmp_path, 0, "gloo") is None
    assert dump_flight_recorder(tmp_path, 0, "nccl") is None
    assert list(tmp_path.iterdir()) == []


def test_flight_recorder_dump_takes_both_signatures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._C._distributed_c10d as c10d

    from gpudiag.repro.sweep.run import dump_flight_recorder

    def before_2_15() -> bytes:  # torch 2.11-2.14: one recorder, no backend argument
        return b"old"

    def from_2_15(backend: str) -> bytes:
        return backend.encode()

    monkeypatch.delattr(c10d, "_dump_nccl_trace", raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace", before_2_15, raising=False)
    assert dump_flight_recorder(tmp_path / "a", 1, "gloo") is None  # (no folder: best effort)
    (tmp_path / "a").mkdir()
    written = dump_flight_recorder(tmp_path / "a", 1, "gloo")
    assert written is not None and written.read_bytes() == b"old"
    monkeypatch.setattr(c10d, "_dump_fr_trace", from_2_15, raising=False)
    written = dump_flight_recorder(tmp_path, 2, "nccl")  # NCCL without its own recorder: the shared one
    assert written is not None and written.read_bytes() == b"nccl"


#: Underscore names of torch that every admitted version types and documents: the foreach
#: kernels (``torch._foreach_norm`` …), the base classes users subclass, and the extension
#: module ``torch._C`` itself (what is read from it is still checked).
PUBLIC_BY_CONVENTION = ("_foreach_", "_BatchNorm", "_DropoutNd")
EXACT = ("_C",)


def _torch_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or "torch" for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_torch_attributes(source: str) -> list[str]:
    """``torch…._name`` attribute reads in ``source`` (a module's text), as ``line: expr``."""
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    return [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not node.attr.startswith(PUBLIC_BY_CONVENTION)
        and node.attr not in EXACT
        and _root(node.value) in torch_names
    ]


def test_the_scan_finds_a_typed_private_attribute() -> None:
    typed = "import torch._C._distributed_c10d as c10d\n\ndata = c10d._dump_fr_trace()\n"
    assert private_torch_attributes(typed) == ["3: c10d._dump_fr_trace"]
    guarded = 'import torch._C._distributed_c10d as c10d\n\ndump = getattr(c10d, "_dump_fr_trace", None)\n'
    assert private_torch_attributes(guarded) == []
    assert private_torch_attributes("import torch\n\nn = torch._foreach_norm([])\n") == []
    assert private_torch_attributes("import torch\n\nf = torch._C._dump\n") == ["3: torch._C._dump"]


def test_no_private_torch_attribute_is_typed_against_one_version() -> None:
    """mypy checks attribute reads against the installed torch's stubs, so a private name
    present in one version and not another fails ``make test`` on the other (issue 35)."""
    root = ROOT
    found = [
        f"{path.relative_to(root)}:{hit}"
        for folder in ("diag", "checks", "repro")
        for path in sorted((root / folder).rglob("*.py"))
        for hit in private_torch_attributes(path.read_text())
    ]
    assert found == [], "reach these through getattr(..., None) and handle absence:\n" + "\n".join(found)
