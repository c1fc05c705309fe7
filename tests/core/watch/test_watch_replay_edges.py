"""``localize="replay"`` against forwards that are harder to run twice: a forward that
changes its input in place, one that draws from Python's and NumPy's generators (or from
torch's only after its first forwards), and
gradient accumulation whose earlier micro-batch held a NaN the model itself cleaned away.
Each names what the hooks on every step (``localize="trail"``) name, and training goes on as
without the watcher."""

from __future__ import annotations

import random
from collections import UserDict
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch import nn

import gpudiag
from gpudiag.watch import replay as rp
from tests.helpers import models


def named(watcher: Any) -> tuple[int, str, str, str]:
    report = watcher.report
    assert report is not None
    return report.step, report.module, report.phase, report.detail


class Standardises(nn.Module):
    """Centres its input in place (``x.sub_``: a common first line), a NaN at step 1."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean())
        h = self.a(x)  # saves x for its weight's gradient: the version autograd checks
        return self.b(h * float("nan") if self.bad else h)


def standardises(localize: str) -> tuple[int, str, str, str]:
    torch.manual_seed(0)
    net = Standardises()
    with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
        for step in range(3):
            net.bad = step == 1
            net(torch.randn(3, 4)).sum().backward()  # the replay must not break this backward
    return named(watcher)


def test_a_forward_that_changes_its_input_in_place_replays_on_a_copy() -> None:
    """The replay ran ``x.sub_`` again on the batch the first forward saved for its
    backward: autograd's "modified by an inplace operation" out of the user's backward."""
    assert standardises("replay") == standardises("trail")


class LayerDrop(nn.Module):
    """Skips layers by Python's and NumPy's generators (as some HF models' LayerDrop does)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            skip = random.random() < 0.3 if i % 2 else np.random.random() < 0.3
            x = x if skip else layer(x)
        return x


def test_python_and_numpy_generators_go_on_as_without_the_replay() -> None:
    draws = []
    for localize in ("trail", "replay"):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        net = LayerDrop()
        with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
            for step in range(3):
                x = torch.randn(3, 4)
                if step == 1:
                    x[0, 0] = float("nan")
                net(x).sum().backward()
        assert watcher.report is not None and watcher.report.module == "<input>"
        draws.append((random.random(), float(np.random.random())))
    assert draws[0] == draws[1]


class DrawsToSkip(nn.Module):
    """LayerDrop by Python's or NumPy's generator (``draw() < 0.5``: skip the layer)."""

    def __init__(self, draw: Any) -> None:
        super().__init__()
        self.draw = draw
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            if not (self.training and self.draw() < 0.5):
                h = torch.tanh(layer(h))
        return self.out(h)


def drops_layers(draw: str, seed: int, localize: str) -> tuple[int, str, str, str] | None:
    """A NaN put into ``layers.2`` after the first step (what a broken optimizer does); None
    where the next three steps all skipped that layer."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(0)
    net = DrawsToSkip(random.random if draw == "python" else np.random.random)
    with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
        for step in range(4):
            net(torch.randn(4, 8)).pow(2).mean().backward()
            net.zero_grad()
            if step == 0:
                with torch.no_grad():
                    net.layers[2].weight[0, 0] = float("nan")
    return None if watcher.report is None else named(watcher)


@pytest.mark.parametrize("draw", ["python", "numpy"])
def test_a_forward_drawing_from_python_or_numpy_is_replayed_with_the_same_draws(draw: str) -> None:
    """The replay sets Python's and NumPy's generators back to the forward's start (read for
    a model seen to draw from them): it takes the layers the training forward took, and names
    what the hooks on every step name (before, in about half the seeds, the replay skipped
    ``layers.2`` and said the fault did not recur)."""
    found = [drops_layers(draw, seed, "trail") for seed in range(16)]
    assert [drops_layers(draw, seed, "replay") for seed in range(16)] == found
    assert sum(f is not None and f[1:3] == ("layers.2", "optimizer") for f in found) >= 8


def test_a_model_that_draws_from_neither_stops_having_them_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's and NumPy's states cost about 40 us a forward to read: read as the first
    PROBES training forwards begin and end, then as one in every PROBE_EVERY does."""
    reads: list[int] = []
    read = rp.host_states
    monkeypatch.setattr(rp, "host_states", lambda: reads.append(1) or read())
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 1))
    with gpudiag.watch(net, "raise", record_dir=False) as watcher:
        for _ in range(rp.PROBE_EVERY + 2):
            net(torch.randn(3, 4)).sum().backward()
    assert watcher.localize == "replay" and len(reads) == 2 * (rp.PROBES + 1)


def torch_reads(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For each training forward captured: whether torch's generator states were read."""
    reads: list[bool] = []
    begin = rp.Draws.begin

    def spied(draws: rp.Draws) -> Any:
        rng, host, probe = begin(draws)
        reads.append(bool(rng))
        return rng, host, probe

    monkeypatch.setattr(rp.Draws, "begin", spied)
    return reads


@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["draws-nothing", "dropout"])
def test_torchs_generator_is_read_at_every_forward_only_for_a_model_that_draws(
    monkeypatch: pytest.MonkeyPatch, dropout: float
) -> None:
    """A model without dropout has torch's generator state (a 5 KB copy, ~10 us inside a
    step) read only as the probed forwards begin; one with dropout at every forward, so its
    replay draws the masks the training forward drew."""
    reads = torch_reads(monkeypatch)
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(dropout), nn.Linear(4, 1))
    with gpudiag.watch(net, "raise", record_dir=False):
        for _ in range(rp.PROBE_EVERY + 2):
            net(torch.randn(3, 4)).sum().backward()
    probed = [n < rp.PROBES or n % rp.PROBE_EVERY == 0 for n in range(rp.PROBE_EVERY + 2)]
    assert reads == (probed if dropout == 0.0 else [True] * len(probed))


class LateDropout(nn.Module):
    """No dropout for its first forwards, then dropout (a schedule that turns it on), and a
    NaN out of ``mid`` once ``bad``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.p, self.bad = 0.0, False
        self.mid.register_forward_hook(lambda m, i, out: out * float("nan") if self.bad else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(nn.functional.dropout(self.inp(x), self.p, self.training)))


def test_a_model_that_starts_drawing_after_the_probes_trains_on_as_without_the_watcher() -> None:
    """Its generator state was not read for the faulty forward (its first forwards drew
    nothing): the replay draws other masks, yet sets torch's generator back — training draws
    afterwards what it would have drawn unwatched — and the fault is still named in ``mid``."""
    after = []
    for watched in (False, True):
        torch.manual_seed(0)
        net = LateDropout()
        watcher = gpudiag.watch(net, "record", record_dir=False) if watched else None
        for step in range(rp.PROBES + 4):
            net.p, net.bad = (0.5 if step > rp.PROBES else 0.0), step == rp.PROBES + 2
            net(torch.randn(3, 4)).sum().backward()
        after.append(torch.rand(4))
        if watcher is not None:
            watcher.close()
            assert named(watcher)[:3] == (rp.PROBES + 2, "mid", "forward")
    assert torch.equal(after[0], after[1])


class Breaks(nn.Module):
    """A linear layer whose output goes NaN once ``broken``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.broken = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.lin(h)
        return out * float("nan") if self.broken else out


class DrawsInOneMicroBatch(nn.Module):
    """Three micro-batches a step; the third draws from NumPy whether ``bad`` runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.bad = Breaks()
        self.head = nn.Linear(8, 1)
        self.micro = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.micro == 2 and np.random.random() < 0.5:
            h = h + self.bad(h)
        return self.head(h)


def accumulates_draws(localize: str) -> tuple[int, str, str, str] | None:
    np.random.seed(0)
    torch.manual_seed(0)
    net = DrawsInOneMicroBatch()
    with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
        for step in range(12):
            net.bad.broken = step >= 6
            for micro in range(3):
                net.micro = micro
                net(torch.randn(4, 8)).sum().backward()
    return None if watcher.report is None else named(watcher)


def test_a_model_drawing_in_one_micro_batch_of_three_is_replayed_with_its_draws() -> None:
    """Only the last of three micro-batches draws: the first forwards of the run that are
    compared include it, so the faulty step's replay takes the layer the training forward
    took (with only the first two compared it did not, and said the fault did not recur)."""
    found = accumulates_draws("trail")
    assert found is not None and found[1:3] == ("bad", "forward")
    assert accumulates_draws("replay") == found


def test_a_non_finite_loss_given_to_observe_says_the_models_outputs_were_finite() -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    with gpudiag.watch(net, "record", record_dir=False) as watcher:
        loss = net(torch.randn(2, 4)).mean() + float("nan")
        watcher.observe(loss)
        loss.backward()
    step, module, phase, detail = named(watcher)
    assert (step, module, phase) == (0, "<loss>", "forward")
    assert "the model's outputs finite" in detail and "no module" not in detail


class Cleans(nn.Module):
    """``a``'s NaNs are cleaned away by the model itself (``nan_to_num``): not a fault."""

    def __init__(self) -> None:
        super().__init__()
        self.a = models.ZeroToNaN()
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(torch.nan_to_num(self.a(x))))


def accumulates(localize: str) -> tuple[int, str, str, str]:
    """Two micro-batches, one backward: the first's ``a`` makes a NaN it cleans away, the
    second's ``b`` output goes NaN (its weight broke between the forwards)."""
    torch.manual_seed(0)
    net = Cleans()
    with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
        first = torch.randn(3, 4)
        first[0, 0] = 0.0
        loss = net(first).sum()
        with torch.no_grad():
            net.b.weight[0, 0] = float("nan")
        (loss + net(torch.randn(3, 4)).sum()).backward()
    return named(watcher)


def test_an_earlier_micro_batch_judged_clean_is_not_replayed_for_a_forward_fault() -> None:
    trail = accumulates("trail")
    assert trail[1] == "b" and accumulates("replay") == trail


@pytest.mark.parametrize("localize", ["trail", "replay"])
def test_a_gradient_fault_after_accumulation_is_ordered_by_every_micro_batch(localize: str) -> None:
    """The gradient's order comes from all the step's forwards, those judged clean too."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    net[1].register_full_backward_hook(
        lambda m, gi, go: (gi[0].index_fill(1, torch.tensor([0]), float("inf")),)
    )
    with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
        (net(torch.randn(3, 4)).sum() + net(torch.randn(3, 4)).sum()).backward()
    assert named(watcher)[1:3] == ("0", "backward")


class Autoencoder(nn.Module):
    """Used through its methods (``encode``/``decode``, as VAEs and CLIP are), never ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x)

    def decode(self, h: torch.Tensor) -> torch.Tensor:
        return self.dec(h)


def through_methods(localize: Any, bad_step: int) -> tuple[int, str, str, str]:
    torch.manual_seed(0)
    net = Autoencoder()
    with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
        for step in range(3):
            h = net.encode(torch.randn(3, 4))
            loss = net.decode(h * float("nan") if step == bad_step else h).sum()
            watcher.observe(loss)
            loss.backward()
    return named(watcher)


def test_a_model_called_through_its_methods_is_watched_module_by_module() -> None:
    """Nothing to replay: the watcher hooks its modules from the first loss on (as the
    hooks on every step do), and where it saw no module it does not say they were finite."""
    assert through_methods(True, bad_step=1) == through_methods("trail", bad_step=1)
    step, module, phase, detail = through_methods(True, bad_step=0)
    assert (step, module, phase) == (0, "<loss>", "forward")
    assert "every module output finite" not in detail and "no module" in detail


class Batch(NamedTuple):
    x: torch.Tensor
    scale: float


class StandardisesContainers(nn.Module):
    """Centres the tensors it is given in a named tuple and in a dict-like batch in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)
        self.bad = False

    def forward(self, batch: Batch, extra: UserDict) -> torch.Tensor:
        batch.x.sub_(batch.x.mean())
        extra["y"].sub_(extra["y"].mean())
        h = self.a(batch.x) * batch.scale + self.a(extra["y"])  # each saved for the weight's gradient
        return self.b(h * float("nan") if self.bad else h)


def containers(localize: str) -> tuple[int, str, str, str]:
    torch.manual_seed(0)
    net = StandardisesContainers()
    with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
        for step in range(3):
            net.bad = step == 1
            extra = UserDict(y=torch.randn(3, 4))
            net(Batch(torch.randn(3, 4), 0.5), extra).sum().backward()
    return named(watcher)


def test_tensors_in_named_tuples_and_dict_like_batches_are_copied_for_the_replay() -> None:
    replayed = containers("replay")  # (before: autograd's "modified by an inplace operation")
    assert replayed == containers("trail") and replayed[0] == 1 and replayed[2] == "forward"


class PhysicsInformed(nn.Module):
    """A forward that differentiates its output by its input (``autograd.grad``, as
    physics-informed networks do): it needs grad mode and an input that requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 8)
        self.b = nn.Linear(8, 1)
        self.c = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.b(torch.tanh(self.a(x)))
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return self.c(torch.cat([u, du], -1))  # (a module after the gradient: named only past it)


def physics_informed(localize: str) -> tuple[int, str, str, str]:
    torch.manual_seed(0)
    net = PhysicsInformed()
    models.poison(net.c, lambda: watcher.step == 1)
    with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
        for _ in range(3):
            net(torch.randn(5, 2, requires_grad=True)).pow(2).mean().backward()
    return named(watcher)


def test_a_forward_that_needs_gradients_is_replayed_with_them() -> None:
    """Under no_grad its autograd.grad raised: named at the output, "could not be replayed"."""
    replayed = physics_informed("replay")
    assert replayed == physics_informed("trail") and replayed[1:3] == ("c", "forward")


class TakesItsBatchApart(nn.Module):
    """Pops the labels out of the dict batch it is given (a common first line); ``nan``
    makes NaNs where its input is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.nan = models.ZeroToNaN()
        self.b = nn.Linear(4, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        y = batch.pop("labels")
        return nn.functional.mse_loss(self.b(self.nan(self.a(batch["x"]))), y)


def takes_apart(localize: str) -> tuple[int, str, str, str]:
    torch.manual_seed(0)
    net = TakesItsBatchApart()
    with gpudiag.watch(net, "record", record_dir=False, localize=localize) as watcher:
        for step in range(3):
            with torch.no_grad():
                net.a.bias.fill_(0.0 if step == 1 else 1.0)
            x = torch.randn(3, 4) if step != 1 else torch.zeros(3, 4)
            net({"x": x, "labels": torch.randn(3, 1)}).backward()
    return named(watcher)


def test_a_forward_that_takes_its_dict_batch_apart_is_replayed_on_the_batch_it_was_given() -> None:
    """The replay was given the dict the first forward had popped its labels from: a
    KeyError, and the fault named at the model's output instead of at ``nan``."""
    assert takes_apart("replay") == takes_apart("trail")
    assert takes_apart("replay")[:3] == (1, "nan", "forward")


class Uncopyable(dict):  # type: ignore[type-arg]
    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("no copies of me")


def test_arguments_that_cannot_be_copied_or_nest_too_deep_do_not_stop_training() -> None:
    """The capture copies its arguments' containers on every forward: one that cannot be
    copied, or nested past Python's recursion limit, is kept as given (the forward runs)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, batch: Any, nested: Any) -> torch.Tensor:
            return self.lin(batch["x"])

    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    net = Net()
    with gpudiag.watch(net, "raise", record_dir=False) as watcher:
        for _ in range(2):
            net(Uncopyable(x=torch.randn(3, 2)), deep).sum().backward()
    assert watcher.step == 2 and watcher.report is None
