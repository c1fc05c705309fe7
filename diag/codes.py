"""The table of finding codes: every code gpudiag emits, its severity, its section of
``docs/findings.md`` and a one-line title (NVIDIA DCGM's ``dcgm_errors.h`` is the model).

Codes are public API: scripts match on them, so they are never renamed. A :class:`Finding`,
a sweep ``Problem`` and a ``RankFailure`` are made only from a code in this table
(:func:`lookup` raises :class:`UnknownCode` otherwise), and a test holds the table equal to
the headings of ``docs/findings.md``. Adding a code: a row here and a ``###`` section there.

``severity`` is the code's usual severity, as its docs section states it; a few codes are
milder where their section says so (``uneven-shards`` is ``info`` when nothing differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Severity = Literal["info", "warning", "error"]

#: Section key → the ``##`` heading of docs/findings.md it stands for.
SECTIONS = {
    "topology": "Topology (`gpudiag topology`)",
    "runtime": "Runtime (every command that runs training)",
    "gradients": "Gradients (`gpudiag gradcheck`)",
    "nancheck": "Where training breaks (`gpudiag nancheck`)",
    "peer": "Peer-to-peer paths (`gpudiag peer`)",
    "transport": "NCCL's transports (`gpudiag transport`)",
    "environment": "Environment (`gpudiag env`, `report`, `doctor`)",
    "hang": "Hangs (`gpudiag hang`)",
    "bench": "Training speed (`gpudiag bench`)",
    "sweep": "A cluster, node by node (`gpudiag sweep`)",
    "checkpoint": "Distributed checkpoints (`gpudiag ckpt inspect|verify DIR`)",
}


@dataclass(frozen=True)
class Code:
    """One finding code: ``name`` (kebab-case), its usual ``severity``, the ``section`` key
    of :data:`SECTIONS` where it is documented, and a one-line ``title``."""

    name: str
    severity: Severity
    section: str
    title: str


class UnknownCode(ValueError):
    """A finding was made with a code that is not in :data:`CODES` (a programming error:
    register the code and document it)."""


_ROWS: tuple[tuple[str, Severity, str, str], ...] = (
    # topology
    ("mixed-links", "warning", "topology", "some GPU pairs are joined by NVLink, others only by PCIe"),
    (
        "sys-ambiguous",
        "warning",
        "topology",
        "SYS between GPUs of one NUMA node: the label is not trustworthy",
    ),
    ("nvswitch-without-nvlink", "warning", "topology", "NVSwitch-class GPUs show no NVLink between any pair"),
    ("p2p-not-supported", "warning", "topology", "peer-to-peer access is not available for a GPU pair"),
    ("asymmetric-cell", "warning", "topology", "A→B and B→A read differently in the capture"),
    ("truncated-capture", "warning", "topology", "the capture stops before its last rows"),
    ("capture-extra-values", "warning", "topology", "a capture row has more values than the header"),
    ("capture-missing-values", "warning", "topology", "a capture row has fewer values than the header"),
    ("gpu-lost", "error", "topology", "NVML reports a GPU lost (fell off the bus or failed)"),
    ("nvml-field-unavailable", "warning", "topology", "NVML could not read one field for some GPUs"),
    ("best-gpu-groups", "info", "topology", "the best disjoint groups of 2 and of 4 GPUs"),
    ("numa-affinity", "info", "topology", "which CPUs and NUMA node each GPU is close to"),
    # runtime
    ("rank-crashed", "error", "runtime", "a DDP rank raised"),
    ("rank-hung", "error", "runtime", "a rank gave neither a result nor an error before the deadline"),
    ("syncbn-skipped", "warning", "runtime", "SyncBatchNorm was asked for but cannot run here"),
    # gradients
    (
        "batchnorm-per-replica",
        "warning",
        "gradients",
        "BatchNorm normalises each replica with its own statistics",
    ),
    ("dropout-active", "warning", "gradients", "random draws of train mode differ between strategies"),
    (
        "random-in-forward",
        "warning",
        "gradients",
        "the forward draws random numbers controlled mode cannot take",
    ),
    ("nondeterministic-op", "warning", "gradients", "the reference itself is not reproducible"),
    ("loss-scale-world-size", "error", "gradients", "DDP's gradient is W or 1/W times single's"),
    ("uneven-shards", "warning", "gradients", "the batch does not split evenly over the devices"),
    ("unused-parameters", "warning", "gradients", "some parameters get no gradient"),
    ("nonfinite-gradient", "error", "gradients", "NaN or Inf in a strategy's gradient or loss"),
    ("ranks-diverged", "error", "gradients", "DDP ranks hold different parameters after a step"),
    (
        "numerics-differ",
        "error",
        "gradients",
        "a process of the comparison computed under other numeric settings",
    ),
    ("numerics-changed", "warning", "gradients", "the model changed torch's numeric flags"),
    (
        "mismatch-unexplained",
        "error",
        "gradients",
        "a strategy differs beyond tolerance and no cause was confirmed",
    ),
    # gradcheck: bugs in the user's code (issue 46)
    ("batch-size-in-forward", "error", "gradients", "the model's forward depends on the per-device batch"),
    ("unseeded-random", "error", "gradients", "the forward draws random numbers the seed does not reach"),
    ("state-in-forward", "error", "gradients", "the forward writes parameters: per-replica state"),
    # nancheck
    ("link-corruption", "error", "nancheck", "training breaks only on particular GPU pairs"),
    ("device-fault", "error", "nancheck", "every pair containing one GPU fails"),
    ("numeric-divergence", "error", "nancheck", "every GPU diverges alone too: the model, not the hardware"),
    (
        "pair-numeric-divergence",
        "warning",
        "nancheck",
        "a pair diverges while its GPUs train alone, no transfer broke",
    ),
    ("loss-explosion", "warning", "nancheck", "a pair's loss grew past 100× its first value"),
    # peer
    ("p2p-copy-mismatch", "error", "peer", "a one-way peer copy arrived wrong at the destination"),
    (
        "p2p-bandwidth-inverted",
        "warning",
        "peer",
        "direct copies are slower than copies staged through the host",
    ),
    ("allreduce-wrong-values", "error", "peer", "a two-rank all-reduce returned wrong values"),
    ("collective-hang", "error", "peer", "the all-reduce did not finish before the timeout"),
    ("iommu-enabled", "warning", "peer", "an IOMMU translates device DMA"),
    ("acs-redirect", "warning", "peer", "PCIe ACS redirects peer requests through the root complex"),
    ("nccl-env-override", "info", "peer", "NCCL settings that change how GPUs talk are set"),
    # transport
    ("nccl-slow-path", "warning", "transport", "an NVLink/PIX/PXB pair went over SHM or the network"),
    ("nccl-same-host-net", "warning", "transport", "two GPUs of one host talk over the network"),
    ("nccl-socket-with-ib", "warning", "transport", "NET/Socket used although InfiniBand devices are logged"),
    ("nccl-mixed-transports", "warning", "transport", "pairs the topology calls equal took different paths"),
    ("nccl-transport-setting", "info", "transport", "a setting that chooses NCCL's transports is in the log"),
    ("nccl-no-transport-lines", "info", "transport", "the log has no transport line to read"),
    # transport (issue 45): GPUDirect RDMA, pairs the log alone cannot judge, NCCL's WARN lines
    ("nccl-no-gdrdma", "warning", "transport", "inter-node InfiniBand without GPUDirect RDMA"),
    ("nccl-needs-topology", "info", "transport", "pairs whose path only the topology can judge"),
    ("nccl-shm-failed", "warning", "transport", "NCCL could not create or attach its /dev/shm segment"),
    ("nccl-warn", "warning", "transport", "NCCL logged WARN lines (errors)"),
    # environment
    ("weights-only-load-off", "warning", "environment", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set"),
    # bench
    ("input-bound", "warning", "bench", "the step waits for the next batch"),
    ("dp-overhead", "warning", "bench", "DataParallel's scatter, replicate and gather take much of the step"),
    ("dp-memory-imbalance", "warning", "bench", "DataParallel's first GPU holds much more memory"),
    (
        "gpus-poorly-connected",
        "warning",
        "bench",
        "the GPUs of a multi-GPU case are joined only by slow paths",
    ),
    ("rank-straggler", "warning", "bench", "one DDP rank's own work per step is slower than the others'"),
    ("comm-exposed", "warning", "bench", "the step waits for the gradient all-reduce after backward"),
    ("per-gpu-batch-small", "warning", "bench", "a per-GPU batch too small to scale"),
    ("cpu-oversubscribed", "warning", "bench", "more compute threads than the host has cores"),
    ("amp-no-gain", "warning", "bench", "mixed precision gives almost no speed-up"),
    ("below-timing-floor", "info", "bench", "steps too short for bench's own timing cost to be negligible"),
    # sweep
    ("node-missing", "error", "sweep", "an expected host never joined the sweep"),
    ("node-hung", "error", "sweep", "a rank stopped answering during the sweep"),
    ("node-check-failed", "error", "sweep", "one of the node's own checks failed or broke"),
    ("node-allreduce-wrong", "error", "sweep", "the job-wide all-reduce returned wrong values on the node"),
    ("node-link-corrupt", "error", "sweep", "the pairwise link test saw wrong values through the node"),
    ("node-link-slow", "error", "sweep", "the node's pair all-reduce was much slower than the median"),
    ("node-figure-low", "error", "sweep", "a figure of the node is far below the other nodes'"),
    ("node-below-baseline", "error", "sweep", "a figure of the node is below the baseline for its machine"),
    ("node-version-differs", "error", "sweep", "a version differs from the one most nodes have"),
    ("node-host-differs", "error", "sweep", "a host fact differs from the one most nodes have"),
    ("node-topology-differs", "error", "sweep", "the node's GPU topology differs from most nodes'"),
    ("node-fewer-gpus", "error", "sweep", "the node has fewer GPUs than most nodes"),
    ("node-no-gpus", "error", "sweep", "torch sees no CUDA GPU on the node"),
    ("node-host-duplicate", "error", "sweep", "several nodes report the same host name"),  # hang
    ("hang-diverged", "error", "hang", "a rank called another collective than its group at the same point"),
    ("hang-never-entered", "error", "hang", "a member never reached the collective the majority waits in"),
    (
        "hang-extra-collective",
        "error",
        "hang",
        "a rank called a collective the rest of its group never calls",
    ),
    ("hang-rank-missing", "error", "hang", "a member of the group left no flight-recorder dump"),
    ("hang-tie", "error", "hang", "the group's members split evenly: no culprit can be named"),
    (
        "hang-consequence",
        "warning",
        "hang",
        "a group waits only because its ranks are stuck in another group",
    ),
    ("hang-all-entered", "info", "hang", "every member entered the pending collective with the same sizes"),
    (
        "hang-size-mismatch",
        "warning",
        "hang",
        "a collective ran with other sizes or dtypes on different ranks",
    ),
    (
        "hang-buffer-wrapped",
        "info",
        "hang",
        "a rank's flight-recorder ring buffer dropped its oldest entries",
    ),
    (
        "hang-p2p-unrecorded",
        "info",
        "hang",
        "gloo ran operations its flight recorder lists no entry for (send/recv)",
    ),
    (
        "hang-p2p-pending",
        "warning",
        "hang",
        "a rank's last operation is a send or recv that never completed",
    ),
    (
        "hang-rooted-pending",
        "error",
        "hang",
        "ranks still wait in a broadcast, scatter, gather or reduce that another rank completed",
    ),
    ("hang-dump-left-out", "warning", "hang", "a file given was not judged: not a dump, or another job's"),
    # distributed checkpoints (gpudiag ckpt inspect|verify DIR)
    (
        "dcp-metadata-unsafe",
        "error",
        "checkpoint",
        "a DCP .metadata names objects outside DCP's metadata types",
    ),
    ("dcp-file-missing", "error", "checkpoint", "a data file the DCP metadata names is not in the folder"),
    ("dcp-file-truncated", "error", "checkpoint", "a DCP data file is shorter than the byte ranges it holds"),
    ("dcp-chunk-damaged", "error", "checkpoint", "a stored chunk is not what the DCP metadata says"),
    ("dcp-object-unsafe", "warning", "checkpoint", "a DCP object entry pickles arbitrary objects: not read"),
    ("dcp-coverage-gap", "error", "checkpoint", "a tensor's chunks leave a gap, overlap or reach past it"),
    ("nonfinite-in-checkpoint", "error", "checkpoint", "checkpoint tensors hold NaN or Inf"),
    (
        "optimizer-state-partial",
        "warning",
        "checkpoint",
        "an optimizer's state misses entries for some parameters",
    ),
    ("keys-missing", "error", "checkpoint", "model keys the checkpoint does not hold"),
    (
        "keys-unexpected",
        "warning",
        "checkpoint",
        "checkpoint keys the model does not have (DCP ignores them)",
    ),
    ("shape-mismatch", "error", "checkpoint", "tensors whose shape differs from the model's"),
    ("dtype-cast-silent", "warning", "checkpoint", "tensors that loading would cast to the model's dtype"),
    ("key-path-wrapper", "warning", "checkpoint", "keys carry wrapper segments (_orig_mod., module.…)"),
)

#: Every finding code, by name.
CODES: dict[str, Code] = {
    name: Code(name, severity, section, title) for name, severity, section, title in _ROWS
}


def lookup(name: str) -> Code:
    """The registered code ``name``; :class:`UnknownCode` if it is not in the table."""
    try:
        return CODES[name]
    except KeyError:
        raise UnknownCode(
            f"finding code {name!r} is not registered in gpudiag.codes (and docs/findings.md)"
        ) from None
