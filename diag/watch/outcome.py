"""The first fault said: the :class:`NonFiniteReport` made from what a rank found, GradScaler
skips counted (a run of them, or one below the scale floor, is the fault), the record
written, then raised or warned as the watcher's mode says. Functions of the watcher
(:class:`gpudiag.watch.core.Watcher`, passed in: this module does not import it)."""

import math
import warnings
from dataclasses import replace
from typing import Any

from gpudiag.errors import InputError
from gpudiag.watch.found import Local
from gpudiag.watch.record import (
    NonFiniteError,
    NonFiniteReport,
    NonFiniteWarning,
    Transfer,
    record_dir,
    write_record,
)
from gpudiag.watch.torchapi import user_stacklevel

#: GradScaler: skipped optimizer steps in a row (no clean backward between them) after which
#: the skips are reported as a fault — a healthy run's scale falls from 2**16 to what its
#: gradients need in a dozen or so halvings; twenty in a row is a gradient that stays
#: non-finite at every scale (``max_skips=``).
MAX_SKIPS = 20
#: GradScaler: a skip at a scale below this is reported as a fault, in a row or not
#: (``scale_floor=``): float16's smallest normal number, 2**-14 — gradients that overflow
#: even scaled down 16384 times are not an overflow the scaler can fix.
SCALE_FLOOR = 2.0**-14


def skip_limits(max_skips: Any, scale_floor: Any) -> tuple[int, float]:
    """``watch(max_skips=, scale_floor=)`` checked: a whole number of steps, 1 or more, and a
    finite scale, 0 or more (an :class:`InputError` otherwise)."""
    if isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 1:
        raise InputError(f"max_skips={max_skips!r}: expected a whole number of steps, 1 or more")
    if not isinstance(scale_floor, (int, float)) or not 0 <= scale_floor < math.inf:
        raise InputError(f"scale_floor={scale_floor!r}: expected a finite scale, 0 or more")
    return max_skips, float(scale_floor)


def skip_run(watcher: Any, skip: NonFiniteReport) -> NonFiniteReport:
    """Count a GradScaler skip; ``skip`` itself while skips are what the scaler is for,
    or a fault (the run's first skip, its detail saying why) once ``max_skips`` optimizer
    steps in a row were skipped or the scale fell below ``scale_floor``. Skips at one
    scale (micro-steps of one accumulated step) count once: the scale moves only when
    the scaler updates."""
    watcher._skipped_now = True
    scale = current_scale(watcher)
    if watcher._skip_first is None or scale is None or scale != watcher._skip_scale:
        watcher._skips += 1
    watcher._skip_scale = scale
    first = watcher._skip_first = watcher._skip_first or skip
    low = scale is not None and scale < watcher.scale_floor
    if watcher._skips < watcher.max_skips and not low:
        return skip
    shown = f"{scale:.3g}" if scale is not None else "?"
    why = (
        f"its scale fell to {shown}, below the floor {watcher.scale_floor:.3g}"
        if low
        else f"its scale fell to {shown}"
    )
    reason = (
        f"the GradScaler skipped {watcher._skips} optimizer step(s) in a row (backwards {first.step}-"
        f"{skip.step}) and {why}: a gradient that stays non-finite however far the loss is scaled "
        "down, not an overflow"
    )
    detail = first.detail.replace("; the GradScaler skips this step and lowers its scale", "")
    return replace(first, kind="fault", detail=f"{detail}; {reason}", this_rank=watcher.rank)


def conclude(
    watcher: Any,
    origin: Local,
    also: list[int],
    views: list[dict[str, Any]],
    arrived: bool = False,
    raising: bool = True,
) -> None:
    if watcher.done:
        return  # the first fault is said once
    report = NonFiniteReport(
        step=origin.step,
        rank=origin.rank,
        device=origin.device,
        module=origin.module,
        phase=origin.phase,
        detail=origin.detail,
        this_rank=watcher.rank,
        world_size=watcher.world,
        arrived=arrived,
        placement=watcher.placement,
        transfer=Transfer(**origin.transfer) if origin.transfer else None,
        kind=origin.kind,
        also=also,
        blind=origin.blind,
        run=watcher.run,
        ranks=[
            {
                "rank": v["rank"],
                "own": v["local"] is not None,
                "received": v["received"] is not None,
            }
            for v in views
            if "rank" in v
        ],
    )
    watcher.events.append(report)
    if report.kind == "scaler-skip":
        report = skip_run(watcher, report)
        if report.kind == "scaler-skip":
            return  # an overflow the scaler deals with: noted, not a fault
        watcher.events.append(report)  # a run of skips: the fault
    watcher.report, watcher.done = report, True
    watcher._trail.clear()
    if watcher._record_dir is not False:
        folder = record_dir(None if watcher._record_dir in (None, True) else watcher._record_dir)
        try:
            write_record(report, folder)
        except (OSError, InputError) as exc:  # (a link or a FIFO planted there): training goes on
            warnings.warn(
                f"gpudiag.watch could not write its record in {folder}: {exc}",
                stacklevel=user_stacklevel(),
            )
    if watcher.mode == "raise" and raising:
        raise NonFiniteError(report)
    if watcher.mode == "warn" or watcher.mode == "raise":
        warnings.warn(NonFiniteWarning(report), stacklevel=user_stacklevel())


def current_scale(watcher: Any) -> float | None:
    """The GradScaler's current scale (``get_scale()``, a host sync on CUDA: read only
    on a skip), or None where it cannot be read."""
    try:
        return float(watcher.scaler.get_scale())
    except Exception:  # a scaler-like object without it: count every skip
        return None
