"""``gpudiag bench``: is multi-GPU training as fast as it should be — and if not, why?

- ``run.py``      bench(): plan the cases, run each through the runtime with phase timing
- ``figures.py``  Case and the folding of recorded phases into step times and a breakdown
- ``explain.py``  findings from figures (pure: dp-overhead, comm-exposed,
                  per-gpu-batch-small, cpu-oversubscribed, amp-no-gain)
- ``report.py``   BenchResult (JSON ``gpudiag.bench/1``)
- ``compare.py``  --compare: each figure's change against the run-to-run spread
"""

from __future__ import annotations

from .compare import BenchComparison, compare, compare_files
from .figures import Case
from .report import SCHEMA, BenchResult
from .run import bench

__all__ = ["SCHEMA", "BenchComparison", "BenchResult", "Case", "bench", "compare", "compare_files"]
