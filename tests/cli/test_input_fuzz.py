"""Random bytes and random JSON given to the commands that read a topology file
(``topology --from-file``, ``--machine``) end within seconds with exit 0, 1 or 2 — never
an internal error, a traceback or a hang. (``replay`` and ``ckpt`` have their own.)"""

from __future__ import annotations

import json
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import SEED_MACHINE, TOPO, fuzz_examples, invoke, within

SETTINGS = settings(
    max_examples=fuzz_examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MACHINE = json.loads(SEED_MACHINE.read_text())
CAPTURE = (TOPO / "seed_8gpu_nv4_pairs_node_sys.txt").read_bytes()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


def _mutated_machine(data: st.DataObject) -> object:
    """The example machine file with one field somewhere replaced by a random value."""
    doc = json.loads(json.dumps(MACHINE))
    node = doc
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
        if not isinstance(node[key], (dict, list)) or data.draw(st.booleans()):
            node[key] = data.draw(json_values)
            break
        node = node[key]
    return doc


def _run(args: list[str]) -> None:
    start = time.monotonic()
    result = invoke(args)
    took = time.monotonic() - start
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.output)
    assert "internal error" not in result.output and "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert took < within(idle_s=1.0), f"took {took:.1f} s"  # (0.34 s at most at load 7)


@SETTINGS
@given(
    raw=st.binary(max_size=3000)
    | st.builds(lambda cut, junk: CAPTURE[:cut] + junk, st.integers(0, 3000), st.binary(max_size=50))
)
def test_random_bytes_as_a_capture_or_a_machine_file(tmp_path_factory, raw: bytes) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("fuzz") / "input"
    path.write_bytes(raw)
    _run(["topology", "--from-file", str(path), "--format", "json"])
    _run(["topology", "--machine", str(path), "--format", "json"])


@SETTINGS
@given(data=st.data())
def test_random_json_as_a_machine_file(tmp_path_factory, data: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    doc = data.draw(json_values) if data.draw(st.booleans()) else _mutated_machine(data)
    path = tmp_path_factory.mktemp("fuzz") / "machine.json"
    path.write_text(json.dumps(doc))
    _run(["topology", "--machine", str(path), "--format", "json"])
    _run(["topology", "--machine", str(path)])
