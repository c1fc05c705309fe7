"""The sweep's output folder: refused before anything runs when gpudiag may not write it
(:func:`check_output`, :func:`not_a_sweep`), and rank 0's answer passed to every rank
(:func:`agree_on_output`) so all nodes refuse together; and each node's record left in the
same store once its own phase is done (:func:`post_record`), so rank 0 has the record of
every node still alive even when the group never forms or fails before the gather
(:func:`posted_records`): a node killed early is the one named missing, never a live one.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from gpudiag.errors import InputError
from gpudiag.repro.sweep.node import Identity, SweepOptions
from gpudiag.repro.sweep.results import RUN

__all__ = [
    "REFUSAL_WAIT_S",
    "agree_on_output",
    "check_output",
    "not_a_sweep",
    "post_record",
    "posted_records",
]


def check_output(options: SweepOptions) -> Path:
    """The output folder, refused before anything runs when gpudiag may not write it: an
    existing one only with ``--force``, and only when it is a sweep gpudiag wrote and holds
    nothing else (:func:`not_a_sweep`)."""
    from gpudiag.fileio import check_target

    return check_target(options.output, force=options.force, folder=True, replaceable=not_a_sweep)


def not_a_sweep(path: Path) -> str | None:
    """None when ``path`` is a sweep folder gpudiag wrote — its manifest ``sweep.json`` (a
    regular file, read bounded) names the ``gpudiag.sweep-run/`` schema — holding only what
    a sweep writes (:func:`~gpudiag.repro.sweep.results.sweep_files`); else why ``--force``
    may not replace it. A file a user added is never deleted: the folder is refused, naming it."""
    from gpudiag.fileio import read_bounded
    from gpudiag.repro.sweep.results import sweep_files
    from gpudiag.repro.sweep.rules import parse_json

    manifest = path / RUN
    if manifest.is_symlink() or not manifest.is_file():
        return f"not a gpudiag sweep folder (no {RUN})"
    try:
        document = parse_json(read_bounded(manifest, "sweep manifest"), str(manifest))
    except InputError:
        return f"not a gpudiag sweep folder (no readable {RUN})"
    schema = document.get("schema") if isinstance(document, dict) else None
    if not (isinstance(schema, str) and schema.startswith("gpudiag.sweep-run/")):
        return f"not a gpudiag sweep folder ({RUN} has no gpudiag sweep schema)"
    listed = document.get("files")
    ok = isinstance(listed, list) and all(isinstance(n, str) for n in listed)
    foreign = sweep_files(path, set(listed) if ok else None)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return f"it holds files a sweep does not write ({shown}): move them out first"
    return None


#: How long rank 0, having refused ``-o``, waits for the other ranks to read why before it
#: exits (its exit ends torchrun's agent, and with it the store they read from).
REFUSAL_WAIT_S = 30.0


def agree_on_output(
    ident: Identity, refusal: InputError | None, env: Mapping[str, str], timeout: float
) -> None:
    """Rank 0's answer on ``-o`` (written, or refused and why) passed to every rank through
    torchrun's own store (its agent's, at ``MASTER_ADDR:MASTER_PORT``, which exists before
    any process group does), so when rank 0 refuses the output folder every node refuses
    too, at once (exit 2), instead of waiting for a group that rank 0 never joins. Rank 0
    waits up to :data:`REFUSAL_WAIT_S` for the others to read a refusal. Nothing happens
    without the agent's store (``TORCHELASTIC_USE_AGENT_STORE``: another launcher) or when it
    cannot be reached; a rank that gets no answer within ``timeout`` goes on as before."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not env.get("MASTER_PORT", "").isdigit():
        return
    try:
        store = _agent_store(env, timeout)
        prefix = f"gpudiag-sweep-output/{_run_key(env)}/"
        key = prefix + "answer"
        if ident.rank == 0:
            store.set(key, "ok" if refusal is None else f"refused {refusal}")
            if refusal is not None:
                others = [f"{prefix}read/{r}" for r in range(1, ident.world)]
                end = time.monotonic() + min(timeout, REFUSAL_WAIT_S)
                # (cast: torch 2.6's TCPStore stub has no check)
                while time.monotonic() < end and not cast(Any, store).check(others):
                    time.sleep(0.05)
            return
        store.wait([key], datetime.timedelta(seconds=timeout))
        answer = store.get(key).decode()
        store.set(f"{prefix}read/{ident.rank}", "1")
    except Exception:  # (no store to reach, or no answer in time: the join decides, as before)
        return
    if answer.startswith("refused "):
        raise InputError(f"rank 0 refused the output folder: {answer.removeprefix('refused ')}")


def _agent_store(env: Mapping[str, str], timeout: float) -> Any:
    """A client of torchrun's agent store (``MASTER_ADDR:MASTER_PORT``); raises when there
    is none (``TORCHELASTIC_USE_AGENT_STORE`` unset: another launcher) or it cannot be reached."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not env.get("MASTER_PORT", "").isdigit():
        raise RuntimeError("no torchrun agent store")
    import torch.distributed as dist

    return dist.TCPStore(
        env.get("MASTER_ADDR", "127.0.0.1"),
        int(env["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _run_key(env: Mapping[str, str]) -> str:
    """This run among the store's keys (torchrun's run id and restart count)."""
    return f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def post_record(ident: Identity, record: Mapping[str, Any], env: Mapping[str, str], timeout: float) -> None:
    """Leave this node's record in torchrun's agent store, before it joins the group
    (best effort: without the store, the group's own collectives carry it as before)."""
    with contextlib.suppress(Exception):
        _agent_store(env, timeout).set(
            f"gpudiag-sweep-records/{_run_key(env)}/{ident.node}", json.dumps(record)
        )


def posted_records(nodes: int, env: Mapping[str, str], timeout: float) -> dict[int, str]:
    """The records nodes left with :func:`post_record`, by node number (never waits for one
    that is not there: a node that never posted one died or never finished its own phase)."""
    found: dict[int, str] = {}
    with contextlib.suppress(Exception):
        store = _agent_store(env, timeout)
        prefix = f"gpudiag-sweep-records/{_run_key(env)}/"
        for number in range(nodes):
            key = f"{prefix}{number}"
            with contextlib.suppress(Exception):
                if cast(Any, store).check([key]):
                    found[number] = store.get(key).decode()
    return found
