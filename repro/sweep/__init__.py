"""``gpudiag sweep``: every node of a cluster checked in one torchrun job, the bad node named.

- :mod:`.rules`: the thresholds (a JSON rules file, defaults shipped) and the baseline;
- :mod:`.judge`: records → verdicts (pure): outliers against the fleet, majorities, the
  pairwise link test's localisation;
- :mod:`.results`: results.jsonl, sweep.json, SUMMARY.md; reading a sweep folder back;
- :mod:`.hosts`: the expected hosts (``--expect-hosts``, Slurm's node list);
- :mod:`.run`: the distributed run under torchrun (imports torch when called).
"""

from __future__ import annotations
