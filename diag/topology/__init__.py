"""GPU interconnect topology: the model, the ``nvidia-smi topo`` reader and the advice."""

from gpudiag.topology.capture import CaptureError, parse_capture
from gpudiag.topology.model import GpuInfo, GpuPair, Topology

__all__ = ["CaptureError", "GpuInfo", "GpuPair", "Topology", "parse_capture"]
