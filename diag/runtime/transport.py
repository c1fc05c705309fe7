"""The transport: every tensor that crosses devices in ``dp`` goes through here.

``Transport.send`` moves a tensor from device ``src`` to ``dst`` inside autograd, so the
gradient travels back through the transport too (replicate ↔ reduce, gather ↔ gather-grad).
When watching, each move is recorded (:class:`~gpudiag.runtime.record.Transfer`: link,
phase, bytes, checksum, NaN/Inf count, time); a :class:`FaultPlan` corrupts chosen moves.
With watching off and no faults, a move is just the copy DataParallel makes anyway.
"""

from __future__ import annotations

from typing import Any

import torch

from gpudiag.runtime.devices import DeviceSet
from gpudiag.runtime.faults import FaultPlan, corrupt
from gpudiag.runtime.record import Recorder, Transfer
from gpudiag.runtime.stats import checksum, count_nonfinite


class Transport:
    """Moves tensors between the devices of a :class:`DeviceSet`, watching and breaking."""

    def __init__(self, devices: DeviceSet, recorder: Recorder | None = None, faults: FaultPlan | None = None):
        self.devices = devices
        self.recorder = recorder if recorder is not None and recorder.enabled else None
        self.faults = faults or FaultPlan()
        self.step = 1
        #: dp_forward: the device whose replica is running its forward now (None between)
        self.replica: int | None = None
        #: bench: dp_forward times its phases on this (a ``timing.PhaseTimer``) when set
        self.timer: Any = None
        #: dp_forward on virtual devices: the state of each device's own generator (device
        #: id → ``torch.get_rng_state()``) for every device but the first, which draws
        #: from the CPU generator itself
        self.generators: dict[int, torch.Tensor] = {}

    def send(
        self, tensor: torch.Tensor, src: int, dst: int, phase: str, back: str | None, name: str = ""
    ) -> Any:
        """``tensor`` on ``dst``; its gradient returns to ``src`` as phase ``back``."""
        if src == dst:
            return tensor
        if back is None or not tensor.requires_grad:
            return self.move(tensor.detach(), src, dst, phase, name)
        return _Send.apply(tensor, self, src, dst, phase, back, name)

    def move(self, tensor: torch.Tensor, src: int, dst: int, phase: str, name: str = "") -> torch.Tensor:
        """Copy ``tensor`` to ``dst`` (outside autograd), injecting and recording."""
        recorder = self.recorder
        start = recorder.now() if recorder is not None else 0.0
        sent = checksum(tensor) if recorder is not None else None
        target = self.devices.torch_device(dst)
        out = tensor.to(target, copy=True) if self.devices.kind == "virtual" else tensor.to(target)
        applied = []
        if self.faults:
            for fault in self.faults.due(src, dst, self.step):
                out = corrupt(out, fault)
                applied.append(fault.text)
        if recorder is not None and sent is not None:
            got = checksum(out)
            sent_value, got_value = torch.stack([sent.to(got.device, got.dtype), got]).double().tolist()
            recorder.transfers.append(
                Transfer(
                    step=self.step,
                    phase=phase,
                    src=src,
                    dst=dst,
                    link=self.devices.link(src, dst),
                    bytes=out.numel() * out.element_size(),
                    checksum=got_value,
                    nonfinite=count_nonfinite(out, got_value),
                    start=start,
                    end=recorder.now(),
                    name=name,
                    faults=applied,
                    sent_checksum=sent_value,
                )
            )
        return out


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        transport: Transport,
        src: int,
        dst: int,
        phase: str,
        back: str,
        name: str,
    ) -> torch.Tensor:
        ctx.route = (transport, src, dst, back, name)
        return transport.move(tensor, src, dst, phase, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        transport, src, dst, back, name = ctx.route
        return (transport.move(grad, dst, src, back, name), None, None, None, None, None, None)
