"""gradcheck: do single-GPU, DataParallel and DDP compute the same gradients — and if not, why?

Runs the same model, batch and seed under ``single`` (the reference), ``dp`` and ``ddp``
through the runtime, compares gradients (and, with ``steps > 1``, parameter updates), and
explains every difference with a finding (``docs/findings.md``), naming a cause only where
it can apply and a confirming measurement agrees. The parts, in the order data flows:

- :mod:`.trainmode` — what train mode switches on in the model (batch statistics, random
  draws, by module) and the controlled form that takes it away;
- :mod:`.factories` — the model factories handed to the runtime (built once, controlled,
  another RNG state);
- :mod:`.schedule` — the only caller of the runtime: runs a batch of jobs, DDP in one launch;
- :mod:`.compare` — gradients against the reference, tolerances per dtype;
- :mod:`.explain` — findings: what a difference or failure means;
- :mod:`.check` — ``gradcheck()``: the steps from model to verdict;
- :mod:`.spec` — ``gradcheck_spec()``: the command line's entry (a model spec, a batch);
- :mod:`.report` — the report types and the verdict.
"""

from gpudiag.checks.gradcheck.check import gradcheck
from gpudiag.checks.gradcheck.compare import TOLERANCES, tolerance
from gpudiag.checks.gradcheck.factories import Prebuilt
from gpudiag.checks.gradcheck.report import EXPLAINS, SCHEMA, Comparison, GradcheckReport
from gpudiag.checks.gradcheck.spec import gradcheck_spec

__all__ = [
    "EXPLAINS",
    "SCHEMA",
    "TOLERANCES",
    "Comparison",
    "GradcheckReport",
    "Prebuilt",
    "gradcheck",
    "gradcheck_spec",
    "tolerance",
]
