"""pytest helpers: check in your own test suite that parallel strategies agree.

    from gpudiag.testing import assert_strategies_agree

    def test_my_model_is_parallel_safe():
        inputs, targets = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        assert_strategies_agree(MyModel, inputs, targets, allow=["batchnorm-per-replica"])

Like the CLI, this is a front end: it imports ``gpudiag.checks`` (and torch) when called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def assert_strategies_agree(
    model_factory: Callable[[], Any],
    inputs: Any,
    targets: Any,
    *,
    allow: Iterable[str] = (),
    **options: Any,
) -> Any:
    """Run :func:`gpudiag.gradcheck` and fail (``AssertionError`` with the summary) unless
    the verdict is ``pass``, or ``explained`` only by finding codes listed in ``allow``.
    ``options`` are gradcheck's keyword arguments (strategies, world_size, steps, loss…).
    Returns the report."""
    from gpudiag.checks.gradcheck import EXPLAINS, gradcheck

    report = gradcheck(model_factory, inputs, targets, **options)
    allowed = set(allow)
    if report.verdict == "fail":
        raise AssertionError(report.summary())
    if report.verdict == "explained":
        causes = {f.code for f in report.findings if f.code in EXPLAINS and f.severity == "warning"}
        if not causes or not causes <= allowed:
            raise AssertionError(
                f"strategies differ; causes {sorted(causes)} not all in allow={sorted(allowed)}\n"
                + report.summary()
            )
    return report
