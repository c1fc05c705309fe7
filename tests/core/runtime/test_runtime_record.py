"""Records serialise to JSON Lines and to the Chrome trace format Perfetto reads."""

from __future__ import annotations

import json

from gpudiag.runtime import DeviceSet, RunConfig, run
from tests.helpers import models


def test_chrome_trace_is_valid_trace_event_json() -> None:
    x, y = models.batch(8)
    dp = run(models.mlp, x, y, RunConfig("dp", DeviceSet.virtual(2), steps=2, faults=("0->1:inf@2x1",)))
    ddp = run(models.mlp, x, y, RunConfig("ddp", DeviceSet.virtual(2), steps=2))
    for result in (dp, ddp):
        trace = json.loads(json.dumps(result.recorder.to_chrome_trace()))
        events = trace["traceEvents"]
        assert events
        for event in events:
            assert {"name", "ph", "ts", "pid", "tid"} <= set(event)
            assert event["ph"] in ("X", "i")
            assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
            if event["ph"] == "X":
                assert event["dur"] >= 0
    names = {e["name"] for e in dp.recorder.to_chrome_trace()["traceEvents"]}
    assert {"step 1", "step 2", "scatter", "replicate", "forward", "gather", "scatter 0->1"} <= names
    faulted = [e for e in dp.recorder.to_chrome_trace()["traceEvents"] if e["args"].get("faults")]
    assert faulted and faulted[0]["args"]["step"] == 2
    cats = {e["cat"] for e in ddp.recorder.to_chrome_trace()["traceEvents"]}
    assert cats == {"step", "bucket"}


def test_jsonl_has_one_typed_object_per_event() -> None:
    x, y = models.batch(8)
    result = run(models.mlp, x, y, RunConfig("dp", DeviceSet.virtual(2)))
    lines = result.recorder.to_jsonl().splitlines()
    assert len(lines) == len(result.recorder.events())
    kinds = {json.loads(line)["type"] for line in lines}
    assert kinds == {"step", "phase", "transfer"}
    transfer = next(json.loads(line) for line in lines if '"transfer"' in line)
    assert {"step", "phase", "src", "dst", "link", "bytes", "checksum", "nonfinite", "start", "end"} <= set(
        transfer
    )
