"""The CPU's one-read check of a step (:func:`gpudiag.watch.witness.step_clean`): non-finite
whenever any gradient element or any loss-gradient witness is, wherever it sits; "cannot
tell" (the exact way judges) for what it does not take; and, through the watcher, the
same verdicts as before on the steps it hands on (frozen parameters, sparse gradients,
sums that overflow on finite values)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gpudiag
from gpudiag.watch.witness import grad_groups, step_clean


def with_grads(shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]
    for i, p in enumerate(params):
        p.grad = torch.full(shape := p.shape, 0.5 + i, dtype=dtype)
        assert p.grad.shape == shape
    return params


def read(
    groups: tuple[list[torch.Tensor], list[torch.Tensor]], out_grads: list[torch.Tensor]
) -> float | None:
    """step_clean as the end-of-backward callback runs it: grad mode off (a plain backward)."""
    with torch.no_grad():
        return step_clean(groups, out_grads)


SHAPES = [(4, 3), (3,), (2, 2, 2), (5,), (1,), (3, 1)]


@settings(max_examples=60, deadline=None)
@given(
    where=st.integers(0, len(SHAPES)),  # len(SHAPES): the loss's gradient witness
    element=st.integers(0, 100),
    value=st.sampled_from([math.nan, math.inf, -math.inf]),
)
def test_one_bad_element_anywhere_makes_the_value_non_finite(where: int, element: int, value: float) -> None:
    params = with_grads(SHAPES)
    out_grads = [torch.tensor(1.0), torch.tensor(-2.0)]
    clean = read(grad_groups(params), out_grads)
    assert clean is not None and math.isfinite(clean)
    if where == len(SHAPES):
        out_grads[element % 2] = torch.tensor(value)
    else:
        flat = params[where].grad.view(-1)
        flat[element % flat.numel()] = value
    bad = read(grad_groups(params), out_grads)
    assert bad is not None and not math.isfinite(bad)


def test_what_it_does_not_take_goes_the_exact_way() -> None:
    params = with_grads(SHAPES)
    groups = grad_groups(params)
    params[3].grad = None  # a frozen or unused parameter
    assert read(groups, []) is None
    params = with_grads(SHAPES, torch.float16)  # float16 sums overflow on finite values
    assert read(grad_groups(params), []) is None
    params = with_grads(SHAPES)
    params[1].grad = torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True)  # no concatenation
    assert read(grad_groups(params), []) is None
    with torch.enable_grad():  # the callback of a backward with create_graph=True
        assert step_clean(grad_groups(with_grads(SHAPES)), []) is None
    assert read(([], []), []) == 0.0
    total = sum((0.5 + i) * math.prod(s) for i, s in enumerate(SHAPES))
    assert read(grad_groups(with_grads(SHAPES, torch.float64)), []) == pytest.approx(total)


class Frozen(nn.Module):
    """A frozen embedding (no gradient), a sparse one, a bias that a NaN can reach alone."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Embedding(10, 4).requires_grad_(False)
        self.sparse = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 2)
        self.bad_bias = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.head(self.frozen(tokens) + self.sparse(tokens))
        return out.sum(1)


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen-embedding", "all-trained"])
def test_the_watcher_names_a_bias_gradient_whichever_way_the_step_is_read(freeze: bool) -> None:
    """A NaN that reaches only a bias's gradient (its hook, at step 2), on a model with a
    sparse gradient and, or not, a frozen parameter (the exact way, or the one read)."""
    torch.manual_seed(0)
    net = Frozen()
    net.frozen.requires_grad_(not freeze)
    net.head.bias.register_hook(lambda g: g * math.nan if net.bad_bias else g)
    with gpudiag.watch(net, "record", record_dir=False) as watcher:
        for step in range(4):
            net.bad_bias = step == 2
            net(torch.randint(0, 10, (3, 5))).sum().backward()
    report = watcher.report
    assert report is not None
    assert (report.step, report.phase, report.module) == (2, "backward", "head")
    assert "head.bias" in report.detail


def test_gradients_whose_sum_overflows_on_finite_values_are_clean() -> None:
    """Gradients near float32's largest value: the one read's sum is Inf, the exact count
    finds every element finite, and nothing is reported."""
    lin = nn.Linear(4, 4)
    lin.weight.register_hook(lambda g: torch.full_like(g, 3e38))
    with gpudiag.watch(lin, "raise", record_dir=False) as watcher:
        for _ in range(3):
            lin(torch.randn(2, 4)).sum().backward()
            assert torch.isfinite(lin.weight.grad).all()
            lin.zero_grad()
    assert watcher.report is None and watcher.step == 3
