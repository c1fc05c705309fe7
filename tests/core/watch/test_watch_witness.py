"""The CPU's one-read check of a step (:func:`gpudiag.watch.witness.step_clean`, one pass of
torch's non-finite check over every gradient): False whenever any gradient element or any
loss-gradient witness is not finite, wherever it sits, True on huge finite values; "cannot
tell" (the exact way judges) for what it does not take; the gradients left as they were;
taken on the clean steps of real models, frozen parameters and masked logits included; and,
through the watcher, the same verdicts as before (sparse gradients, lazy modules, finite
values whose sum overflows)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gpudiag
from gpudiag.watch import localize
from gpudiag.watch import witness as wt
from gpudiag.watch.witness import all_finite, step_clean
from tests.helpers import fuzz_examples

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def with_grads(shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]
    for i, p in enumerate(params):
        p.grad = torch.full(shape := p.shape, 0.5 + i, dtype=dtype)
        assert p.grad.shape == shape
    return params


def read(params: list[nn.Parameter], out_grads: list[torch.Tensor]) -> bool | None:
    """step_clean as the end-of-backward callback runs it: grad mode off (a plain backward)."""
    with torch.no_grad():
        return step_clean(params, out_grads)


#: Shapes a vectorised pass takes in whole vectors and in a tail (tail elements: scalar code).
SHAPES = [(4, 3), (3,), (2, 2, 2), (5,), (1,), (3, 1), (67, 5)]


@settings(max_examples=fuzz_examples(80), deadline=None)
@given(
    where=st.integers(0, len(SHAPES) + 1),  # beyond SHAPES: one of the two loss-gradient witnesses
    element=st.integers(0, 400),
    value=st.sampled_from([math.nan, math.inf, -math.inf]),
    dtype=st.sampled_from(DTYPES),
)
def test_one_bad_element_anywhere_is_found(
    where: int, element: int, value: float, dtype: torch.dtype
) -> None:
    params = with_grads(SHAPES, dtype)
    out_grads = [torch.tensor(1.0), torch.full((9, 7), -2.0, dtype=dtype)]  # (any tensors: checked whole)
    assert read(params, out_grads) is True
    if where >= len(SHAPES):
        target = out_grads[where - len(SHAPES)]
    else:
        grad = params[where].grad
        assert grad is not None
        target = grad
    flat = target.view(-1)
    flat[element % flat.numel()] = value
    assert read(params, out_grads) is False


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_huge_finite_values_are_clean_and_left_as_they_were(dtype: torch.dtype) -> None:
    """The largest finite values of each dtype (a sum of them overflows; the check is per
    element), subnormals and a negative zero: clean, and every gradient's bits, and its
    in-place version, as before the check."""
    info = torch.finfo(dtype)
    params = with_grads(SHAPES, dtype)
    for p in params:
        grad = p.grad
        assert grad is not None
        flat = grad.view(-1)
        flat[0], flat[-1] = info.max, -info.max
        if flat.numel() > 2:
            flat[1] = info.smallest_normal / 4  # a subnormal
        if flat.numel() > 3:
            flat[2] = -0.0
    kept = [p.grad.clone() for p in params if p.grad is not None]
    versions = [wt.tensor_version(p.grad) for p in params if p.grad is not None]
    assert read(params, []) is True
    after = [p.grad for p in params if p.grad is not None]
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(kept, after, strict=True)
    )
    assert [wt.tensor_version(g) for g in after] == versions


def test_a_parameter_without_a_gradient_has_nothing_to_check() -> None:
    params = with_grads(SHAPES)
    params[3].grad = None
    assert read(params, [torch.tensor(2.0)]) is True
    assert read([], []) is True
    params[0].requires_grad_(False).grad = None  # frozen
    params[1].grad.view(-1)[0] = math.nan  # type: ignore[union-attr]
    assert read(params, []) is False


def test_what_it_does_not_take_goes_the_exact_way(monkeypatch: pytest.MonkeyPatch) -> None:
    params = with_grads(SHAPES)
    params[1].grad = torch.tensor([1.0, 0.0, 0.0]).to_sparse()  # a sparse gradient
    assert read(params, []) is None
    params = with_grads(SHAPES)
    params[1].grad = torch.ones(1).expand(3)  # an expanded tensor: no pass writes it
    assert read(params, []) is None
    params = with_grads(SHAPES)
    assert read(params, [torch.ones(2, dtype=torch.complex64)]) is None  # complex
    with torch.enable_grad():  # the callback of a backward with create_graph=True
        assert step_clean(with_grads(SHAPES), []) is None
    monkeypatch.setattr(wt, "_NON_FINITE_CHECK", None)  # a torch without it
    assert all_finite([torch.ones(3)]) is None
    assert read(with_grads(SHAPES), []) is None


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
def test_a_nan_reaching_only_a_bias_is_named_beside_sparse_and_frozen_parameters(freeze: bool) -> None:
    """A NaN that reaches only a bias's gradient (its hook, at step 2), on a model with a
    sparse 2-D gradient (``torch._foreach_norm`` takes none on torch 2.11: the exact way sums
    it) and, or not, a frozen parameter."""
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
            grad = lin.weight.grad
            assert grad is not None and torch.isfinite(grad).all()
            lin.zero_grad()
    assert watcher.report is None and watcher.step == 3


def test_a_lazy_module_is_watched_from_before_its_first_forward() -> None:
    """``gpudiag.watch(net)`` before the first forward, as with any model: a lazy module's
    parameters are uninitialized then (no ``dim()`` to group them by). The watcher still
    watches, and names a NaN reaching the lazy layer's gradient, as before 9557607."""
    torch.manual_seed(0)
    lazy = nn.LazyLinear(8)
    net = nn.Sequential(lazy, nn.ReLU(), nn.Linear(8, 2))
    with gpudiag.watch(net, "record", record_dir=False) as watcher:
        for step in range(4):
            if step == 2:  # materialized by now: a Parameter whose gradient can be hooked
                lazy.weight.register_hook(lambda g: g * math.nan)
            net(torch.randn(4, 5)).sum().backward()
            net.zero_grad()
    report = watcher.report
    assert report is not None
    assert (report.step, report.phase, report.module) == (2, "backward", "0")
    assert "0.weight" in report.detail


class Masks(nn.Module):
    """Logits with the last class masked (-inf) when ``masked``: a finite loss and gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.masked = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        return out.masked_fill(torch.tensor([False, False, True]), -math.inf) if self.masked else out


def spy_on_reads(monkeypatch: pytest.MonkeyPatch) -> tuple[list[bool | None], list[int]]:
    """What each step's one read returned, and the steps (counted from 1) where the exact
    way ran."""
    reads: list[bool | None] = []
    exact: list[int] = []
    one_read, grad_witness = localize.step_clean, localize.grad_witness

    def spied_read(*args: Any) -> bool | None:
        reads.append(one_read(*args))
        return reads[-1]

    def spied_exact(*args: Any) -> torch.Tensor:
        exact.append(len(reads))
        return grad_witness(*args)

    monkeypatch.setattr(localize, "step_clean", spied_read)
    monkeypatch.setattr(localize, "grad_witness", spied_exact)
    return reads, exact


def test_an_output_holding_an_inf_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Masked logits (-inf where masked) train with a finite loss and gradients: the one
    read, finite, settles the step (an Inf alone is a fault only where the gradients go
    non-finite); the exact way does not run."""
    reads, exact = spy_on_reads(monkeypatch)
    net = Masks()
    with gpudiag.watch(net, "raise", record_dir=False) as watcher:
        for masked in (False, True, True):
            net.masked = masked
            torch.nn.functional.cross_entropy(net(torch.randn(2, 4)), torch.tensor([0, 1])).backward()
    assert watcher.report is None and watcher.step == 3
    assert reads == [True, True, True] and not exact


class Encoder(nn.Module):
    """A real transformer encoder layer with a frozen embedding and an unused head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32).requires_grad_(False)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.head = nn.Linear(32, 50)
        self.unused = nn.Linear(32, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(tokens)))


def test_the_one_read_settles_the_clean_steps_of_a_real_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nn.TransformerEncoderLayer`` (dropout on) with a frozen embedding and a head that is
    never used: every clean step is settled by the one read (a torch whose end-of-backward
    callback ran in grad mode, or a parameter without a gradient, would send each step the
    exact way), and a NaN at step 3 is still named."""
    reads, exact = spy_on_reads(monkeypatch)
    torch.manual_seed(0)
    net = Encoder()
    tokens = torch.randint(0, 50, (4, 6))
    with gpudiag.watch(net, "record", record_dir=False) as watcher:
        for step in range(5):
            if step == 3:
                net.layer.linear2.weight.register_hook(lambda g: g * math.nan)
            out = net(tokens)
            torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens.flatten()).backward()
            net.zero_grad()
    assert reads[:4] == [True, True, True, False] and min(exact) == 4
    report = watcher.report
    assert report is not None and (report.step, report.phase) == (3, "backward")
    assert "layer.linear2.weight" in report.detail


@pytest.mark.parametrize("localize", ["replay", "trail"])
@pytest.mark.parametrize(
    ("dtype", "scale"), [(torch.float32, 1e35), (torch.float64, 1e100)], ids=["f32", "f64"]
)
def test_a_huge_but_finite_gradient_into_the_outputs_is_no_fault(
    localize: str, dtype: torch.dtype, scale: float
) -> None:
    """``(out * scale).sum()``: every gradient into the 4 x 1000 outputs is ``scale``, finite,
    but their float32 sum is not (4e38; 4e103 in float64, rounded to float32): the witness
    of the loss's gradient is exact both ways, so nothing is reported."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1000)).to(dtype)
    with gpudiag.watch(net, "raise", record_dir=False, localize=localize) as watcher:
        for _ in range(3):
            (net(torch.randn(4, 8, dtype=dtype)) * scale).sum().backward()
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
            net.zero_grad()
    assert watcher.report is None and watcher.step == 3


def test_the_loss_gradient_witness_is_exact_both_ways() -> None:
    """:func:`output_grad_witness`: finite for huge finite values, NaN/Inf for one bad one."""
    from gpudiag.watch.witness import output_grad_witness

    huge = torch.full((4, 1000), 1e35)
    assert math.isfinite(float(output_grad_witness(huge)))
    for bad in (math.nan, math.inf, -math.inf):
        one = huge.clone()
        one[2, 7] = bad
        assert not math.isfinite(float(output_grad_witness(one)))
        assert not math.isfinite(float(output_grad_witness(one.double())))


class Complex(nn.Module):
    """A complex output, or its lazily conjugated view (``conj``: torch's conjugate bit)."""

    def __init__(self, conj: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.conj = conj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        z = torch.complex(h, 2 * h)
        return z.conj() if self.conj else z


@pytest.mark.parametrize("localize", ["replay", "trail"])
@pytest.mark.parametrize("conj", [False, True], ids=["plain-output", "conj-output"])
def test_a_lazily_conjugated_output_or_gradient_is_witnessed(localize: str, conj: bool) -> None:
    """``(out.conj() * c).real.sum()``, an inner-product loss: the gradient into the output
    carries torch's conjugate bit (and with ``conj`` the output too), which
    ``torch.view_as_real`` refuses: the backward raised RuntimeError out of the watcher."""
    torch.manual_seed(0)
    net = Complex(conj)
    with gpudiag.watch(net, "raise", record_dir=False, localize=localize) as watcher:
        for _ in range(2):
            out = net(torch.randn(3, 4))
            (out.conj() * torch.tensor(1 + 2j)).real.sum().backward()
    assert watcher.report is None and watcher.step == 2


def test_a_large_model_is_read_by_sums_not_the_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past :data:`ONE_PASS_LIMIT` gradient values (here lowered to 50) a step is read by a
    sum per gradient (the pass would write every value back through memory): the one pass
    is not run, a clean step is still settled, and a NaN gradient still named; a lazy
    module's model is sized once its parameters are."""
    assert wt.one_pass_fits([nn.Parameter(torch.zeros(10))]) is True
    assert wt.one_pass_fits([nn.parameter.UninitializedParameter()]) is None
    monkeypatch.setattr(wt, "ONE_PASS_LIMIT", 50)
    assert wt.one_pass_fits([nn.Parameter(torch.zeros(51))]) is False
    frozen = nn.Parameter(torch.zeros(1000), requires_grad=False)  # a frozen backbone: no gradients
    assert wt.one_pass_fits([frozen, nn.Parameter(torch.zeros(8))]) is True
    reads, exact = spy_on_reads(monkeypatch)
    torch.manual_seed(0)
    for net in (
        nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)),
        nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 2)),
    ):
        with gpudiag.watch(net, "record", record_dir=False) as watcher:
            for step in range(3):
                if step == 2:
                    head = net[1]
                    assert isinstance(head, nn.Linear)
                    head.weight.register_hook(lambda g: g * math.nan)
                net(torch.randn(4, 8)).sum().backward()
                net.zero_grad()
        report = watcher.report
        assert watcher._one_pass is False and report is not None
        assert (report.step, report.phase, report.module) == (2, "backward", "1")
    assert reads == [] and len(exact) == 6


def test_a_model_of_one_parameter_is_watched_without_failing() -> None:
    """One gradient: its witness is a vector of one value, not a 0-d tensor whose
    ``tolist()`` is a float (``sum(float)``: a TypeError out of the user's backward, on every
    step whose loss was ``out.sum()`` and on any non-finite step)."""
    assert wt.grad_witness([torch.ones(3)]).shape == (1,)
    torch.manual_seed(0)
    lin = nn.Linear(4, 4, bias=False)
    with gpudiag.watch(lin, "record", record_dir=False) as watcher:
        for step in range(3):
            out = lin(torch.randn(3, 4))
            (out.sum() if step < 2 else (out * math.nan).pow(2).mean()).backward()
    report = watcher.report
    assert report is not None and (report.step, report.module) == (2, "<loss>")


def test_an_expanded_loss_gradient_is_witnessed_at_once_and_the_step_read_in_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``out.sum()``'s gradient into the output is one value expanded (strides of 0), which
    the one pass refuses: witnessed as it arrives, the step is still read in one pass (kept
    for the pass, as f75c278 did, it sent every clean step the exact way)."""
    reads, exact = spy_on_reads(monkeypatch)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with gpudiag.watch(net, "raise", record_dir=False) as watcher:
        for _ in range(3):
            net(torch.randn(3, 4)).sum().backward()
    assert watcher.report is None and reads == [True] * 3 and exact == []


class RefusesThePass(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` raises its own kind of error for an
    op it does not support (here GradScaler's pass)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "non_finite_check" in getattr(func, "__name__", ""):
            raise AssertionError(f"{func.__name__} is not supported")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_subclass_that_refuses_the_pass_goes_the_exact_way() -> None:
    """Whatever the subclass raises, the check says "cannot tell" (None), not an exception
    out of the user's ``loss.backward()``."""
    assert all_finite([torch.ones(3).as_subclass(RefusesThePass)]) is None
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    with gpudiag.watch(lin, "raise", record_dir=False) as watcher:
        for _ in range(2):
            lin(torch.randn(3, 4)).pow(2).mean().backward()
            lin.weight.grad = lin.weight.grad.as_subclass(RefusesThePass)  # type: ignore[union-attr]
    assert watcher.report is None and watcher.step == 2


class WritesItsGradient(torch.autograd.Function):
    """The identity whose backward changes its ``grad_output`` in place: multiplied by
    ``scale`` (an overflow of the backward's own), or cleaned of NaN/Inf (``nan_to_num_``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float | None) -> torch.Tensor:
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad.nan_to_num_(0.0, 0.0, 0.0) if ctx.scale is None else grad.mul_(ctx.scale)), None


class Writes(nn.Module):
    def __init__(self, scale: float | None) -> None:
        super().__init__()
        self.lin, self.scale = nn.Linear(4, 4), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return WritesItsGradient.apply(self.lin(x), self.scale)


def test_a_loss_gradient_changed_in_place_later_in_the_backward_is_not_read_as_it_was() -> None:
    """A loss gradient that the model's own backward overwrites later in the backward: its
    witness is taken as it arrives, before that (kept to the end of the backward, as
    f75c278 did, an overflow of the backward's own was named ``<loss>``, and a NaN loss the
    backward cleaned away was missed on every step): the overflow is named at the gradient
    it made, the NaN loss at the loss."""
    torch.manual_seed(0)
    net = Writes(1e38)
    with gpudiag.watch(net, "record", record_dir=False) as watcher:
        (net(torch.randn(3, 4)) * 1e3).sum().backward()
    report = watcher.report
    assert report is not None and (report.step, report.module) == (0, "lin")
    net = Writes(None)
    with gpudiag.watch(net, "record", record_dir=False) as watcher:
        for step in range(3):
            out = net(torch.randn(3, 4))
            (out * (math.nan if step == 2 else 1.0)).pow(2).mean().backward()
    report = watcher.report
    assert report is not None and (report.step, report.module, report.phase) == (2, "<loss>", "backward")


def test_an_inference_mode_gradient_given_to_backward_is_checked_without_failing() -> None:
    """An inference tensor keeps no version counter (``_version`` raises): given as the
    gradient of the model's output, it is still checked."""
    with torch.inference_mode():
        grad = torch.ones(3, 4)
    assert wt.tensor_version(grad) == -1
    lin = nn.Linear(4, 4)
    with gpudiag.watch(lin, "raise", record_dir=False) as watcher:
        lin(torch.randn(3, 4)).backward(grad)
    assert watcher.report is None and watcher.step == 1


class ReturnsItsParameter(nn.Module):
    """A model whose output is its own parameter (a leaf: no autograd node to pre-hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.ones(4))

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return self.table


def test_the_hook_on_an_output_that_is_a_leaf_is_removed_with_its_step() -> None:
    """The gradient into a leaf output is seen through a tensor hook, which lives on the
    parameter past the step: one was added every forward and never removed (hooks piling
    up, each step slower, still there after close()). Now only those of forwards awaiting
    their backward, none after close(), and a NaN loss still named."""
    net = ReturnsItsParameter()
    watcher = gpudiag.watch(net, "record", record_dir=False)
    for step in range(5):
        (net(torch.ones(1)) * (math.nan if step == 4 else 1.0)).sum().backward()
        assert len(net.table._backward_hooks or {}) == 0
    net(torch.ones(1))  # a forward whose backward never comes
    net(torch.ones(1))
    assert len(net.table._backward_hooks or {}) <= 2
    watcher.close()
    assert len(net.table._backward_hooks or {}) == 0
    report = watcher.report
    assert report is not None and (report.step, report.module) == (4, "<loss>")


def test_the_pass_runs_under_another_default_dtype() -> None:
    """``torch.set_default_dtype(torch.float64)`` (scientific code): the pass's float32
    arguments are made float32 explicitly (made in the default dtype, the pass refused them
    and every step went the exact way)."""
    wt._unit_scale.cache_clear()
    torch.set_default_dtype(torch.float64)
    try:
        assert all_finite([torch.ones(3), torch.ones(2, dtype=torch.float32)]) is True
        assert all_finite([torch.tensor([1.0, math.nan])]) is False
    finally:
        torch.set_default_dtype(torch.float32)
        wt._unit_scale.cache_clear()
