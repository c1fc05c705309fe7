"""gpudiag.watch under what real training does that looks like a fault and is not (issue 36):
masked logits and unused non-finite outputs (``-inf`` that never reaches the loss or the
gradients), a GradScaler that keeps skipping (a run of skips is the fault), and a record
path someone made a link or a FIFO (training goes on in "warn" and "record")."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpudiag
from gpudiag.watch import NonFiniteError, NonFiniteWarning
from tests.helpers import models


class Attention(nn.Module):
    """One causal self-attention head: scores masked with ``-inf`` before the softmax."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        return self.proj(scores.softmax(-1) @ v), scores


class TinyLM(nn.Module):
    """A small masked-attention transformer; ``forward`` returns a dict, as Hugging Face
    models do, with the masked attention scores beside the logits (``output_attentions``)."""

    def __init__(self, vocab: int = 11, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.attn = Attention(width)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 32), nn.GELU(), nn.Linear(32, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(tokens)
        a, scores = self.attn(h)
        h = self.norm(h + a)
        h = h + self.mlp(h)
        return {"logits": self.head(h), "scores": scores}


def lm_steps(model: nn.Module, steps: int, watcher: Any = None) -> list[float]:
    g = torch.Generator().manual_seed(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 11, (4, 6), generator=g)
        out = model(tokens)
        loss = nn.functional.cross_entropy(out["logits"][:, :-1].reshape(-1, 11), tokens[:, 1:].reshape(-1))
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_masked_attention_scores_in_the_output_are_not_a_fault() -> None:
    """The -inf of the causal mask is in the output's unused "scores" entry: the loss and
    every gradient are finite, so nothing is reported (the old watcher raised at step 0)."""
    torch.manual_seed(0)
    model = TinyLM()
    watcher = gpudiag.watch(model, "raise", record_dir=False)
    losses = lm_steps(model, 4)
    assert all(math.isfinite(v) for v in losses)
    assert watcher.report is None and watcher.events == [] and watcher.step == 4
    watcher.close()


def test_a_nan_in_a_masked_transformer_is_named_where_it_arose_not_at_the_mask() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    models.poison(model.mlp[2], lambda: watcher.step == 2)  # (before watch: its hook sees the NaN)
    watcher = gpudiag.watch(model, "record", record_dir=False)
    lm_steps_until_fault(model, watcher, 4)
    assert watcher.report is not None
    assert (watcher.report.step, watcher.report.phase, watcher.report.module) == (2, "forward", "mlp.2")
    watcher.close()


def lm_steps_until_fault(model: nn.Module, watcher: Any, steps: int) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        tokens = torch.randint(0, 11, (4, 6), generator=g)
        out = model(tokens)
        nn.functional.cross_entropy(out["logits"].reshape(-1, 11), tokens.reshape(-1)).backward()
        model.zero_grad()
        if watcher.report is not None:
            return


class Policy(nn.Module):
    """Action masking: illegal actions' logits are -inf, in the model's own output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 5))

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.body(obs).masked_fill(~legal, float("-inf"))


def policy_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    obs = torch.randn(8, 6, generator=g)
    legal = torch.rand(8, 5, generator=g) > 0.4
    legal[:, 0] = True
    action = torch.stack(
        [row.nonzero()[torch.randint(0, int(row.sum()), (1,), generator=g)][0, 0] for row in legal]
    )
    return obs, legal, action


@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_action_masked_logits_train_without_a_report(mode: str) -> None:
    torch.manual_seed(0)
    policy = Policy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with gpudiag.watch(policy, mode, record_dir=False) as watcher, warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWarning)
        for _ in range(3):
            obs, legal, action = policy_batch(g)
            loss = nn.functional.cross_entropy(policy(obs, legal), action)
            watcher.observe(loss)  # the loss given too: finite, so still nothing
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert watcher.report is None and watcher.step == 3


def test_an_inf_output_that_reaches_the_gradients_or_a_nan_anywhere_is_still_a_fault() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    obs, legal, _ = policy_batch(g)
    policy = Policy()
    watcher = gpudiag.watch(policy, "record", record_dir=False)
    policy(obs, legal).pow(2).mean().backward()  # -inf squared: an infinite loss, NaN gradients
    assert watcher.report is not None and watcher.report.phase == "forward"
    assert watcher.report.module == "", watcher.report  # the masking is the model's own code
    watcher.close()

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            y = self.lin(x)
            return {"used": y, "unused": torch.full_like(y, float("nan"))}

    net = Two()
    watcher = gpudiag.watch(net, "record", record_dir=False)
    net(torch.randn(2, 4))["used"].sum().backward()  # finite loss and gradients; a NaN beside them
    assert watcher.report is not None and watcher.report.phase == "forward"
    assert "NaN" in watcher.report.detail
    watcher.close()
    # an unused entry holding only Inf does not stop training
    net.forward = lambda x: {"used": net.lin(x), "unused": torch.full((2, 4), float("inf"))}  # type: ignore[method-assign]
    with gpudiag.watch(net, "raise", record_dir=False) as watcher:
        net(torch.randn(2, 4))["used"].sum().backward()
        assert watcher.report is None and watcher.step == 1


def _ddp_policy_rank(rank: int, world: int, bad_step: int) -> bytes:
    import json

    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    policy = Policy()
    models.poison(policy.body[2], lambda: rank == 1 and watcher.step == bad_step)
    ddp = DistributedDataParallel(policy)
    watcher = gpudiag.watch(ddp, "record", record_dir=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        obs, legal, action = policy_batch(g)
        nn.functional.cross_entropy(ddp(obs, legal), action).backward()
        opt.step()
        opt.zero_grad()
    report = watcher.report
    watcher.close()
    found = None if report is None else [report.step, report.rank, report.module, report.phase]
    return json.dumps(found).encode()


@pytest.mark.parametrize("bad_step", [-1, 2], ids=["clean", "nan-on-rank-1"])
def test_ddp_action_masked_logits_every_rank_agrees(bad_step: int) -> None:
    import json

    from gpudiag.runtime.launch import launch

    found = [
        json.loads(bytes(b))
        for b in launch(_ddp_policy_rank, 2, args=(bad_step,), timeout=120, method="fork")
    ]
    assert found == ([None, None] if bad_step < 0 else [[2, 1, "body.2", "forward"]] * 2)


# -- GradScaler: a run of skips ------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def scaled_steps(net: nn.Module, scaler: Any, watcher: Any, steps: int) -> int:
    """Train with the scaler; the number of steps run before the watcher raised."""
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        loss = net(torch.randn(4, 8, generator=g)).pow(2).mean()
        try:
            scaler.scale(loss).backward()
        except NonFiniteError:
            return i
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return steps


def test_a_persistent_nan_gradient_under_a_grad_scaler_is_reported_after_a_run_of_skips() -> None:
    """A NaN gradient in every step: each is a skip the scaler makes (its scale halving),
    but twenty in a row are the fault (the old watcher stayed silent for 55 and more)."""
    torch.manual_seed(0)
    net = Net()
    scaler = torch.amp.GradScaler("cpu")  # 65536
    models.poison(net.body[3], lambda: True, kind="grad")
    watcher = gpudiag.watch(net, "raise", scaler=scaler, record_dir=False)
    ran = scaled_steps(net, scaler, watcher, 60)
    assert ran == gpudiag.watch.core.MAX_SKIPS - 1  # raised out of the 20th skipped step's backward
    report = watcher.report
    assert report is not None and report.kind == "fault"
    assert (report.step, report.phase, report.module) == (0, "backward", "body.2")
    assert "skipped 20 optimizer step(s) in a row (backwards 0-19)" in report.detail
    assert [e.kind for e in watcher.events] == ["scaler-skip"] * 20 + ["fault"]
    watcher.close()


def test_skips_at_a_scale_below_the_floor_are_a_fault_even_between_clean_steps() -> None:
    """A NaN every other step: never two skips in a row, but the scale keeps falling."""
    torch.manual_seed(0)
    net = Net()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    models.poison(net.body[3], lambda: watcher.step % 2 == 1, kind="grad")
    watcher = gpudiag.watch(net, "record", scaler=scaler, record_dir=False, scale_floor=0.1)
    assert scaled_steps(net, scaler, watcher, 20) == 20  # "record": training went on
    report = watcher.report
    # skips at backwards 1, 3, 5...: scales 4, 2, 1... the seventh's 0.0625 is under the floor
    assert report is not None and report.kind == "fault" and report.step == 13
    assert "its scale fell to 0.0625, below the floor 0.1" in report.detail
    assert [e.kind for e in watcher.events] == ["scaler-skip"] * 7 + ["fault"]


def test_a_few_skips_are_the_scalers_business_and_max_skips_is_an_option() -> None:
    torch.manual_seed(0)
    net = Net()
    scaler = torch.amp.GradScaler("cpu")
    models.poison(net.body[3], lambda: watcher.step < 3, kind="grad")  # three, then clean
    watcher = gpudiag.watch(net, "raise", scaler=scaler, record_dir=False, max_skips=4)
    assert scaled_steps(net, scaler, watcher, 8) == 8
    assert watcher.report is None and [e.kind for e in watcher.events] == ["scaler-skip"] * 3
    watcher.close()
    watcher = gpudiag.watch(net, "raise", scaler=scaler, record_dir=False, max_skips=3)
    assert scaled_steps(net, scaler, watcher, 8) == 2
    watcher.close()
    for bad in ({"max_skips": 0}, {"max_skips": 2.5}, {"scale_floor": -1.0}, {"scale_floor": math.inf}):
        with pytest.raises(gpudiag.errors.InputError):
            gpudiag.watch(net, scaler=scaler, **bad)


# -- the record path ----------------------------------------------------------------------


def _fault_at_step_1(net: nn.Module, ran: list[int]) -> None:
    for _ in range(3):
        net(torch.randn(4, 8)).pow(2).mean().backward()
        ran.append(1)


@pytest.mark.parametrize("planted", ["symlink", "fifo", "symlinked-folder"])
@pytest.mark.parametrize("mode", ["warn", "record", "raise"])
def test_a_link_or_fifo_at_the_record_path_is_warned_and_training_goes_on(
    tmp_path: Path, planted: str, mode: str
) -> None:
    folder = tmp_path / "records"
    folder.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "precious.json"
    target.write_text("keep me\n")
    if planted == "symlink":
        (folder / "watch-rank0.json").symlink_to(target)
    elif planted == "fifo":
        os.mkfifo(folder / "watch-rank0.json")
    else:
        folder.rmdir()
        folder.symlink_to(elsewhere)
    torch.manual_seed(0)
    net = Net()
    models.poison(net.body[2], lambda: watcher.step == 1)
    watcher = gpudiag.watch(net, mode, record_dir=folder)
    ran: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if mode == "raise":
            with pytest.raises(NonFiniteError):
                _fault_at_step_1(net, ran)
        else:
            _fault_at_step_1(net, ran)
            assert len(ran) == 3  # training went on
    said = [str(w.message) for w in caught if "could not write its record" in str(w.message)]
    assert len(said) == 1 and ("symbolic link" in said[0] or "FIFO" in said[0]), said
    assert watcher.report is not None and watcher.report.step == 1
    assert target.read_text() == "keep me\n" and sorted(p.name for p in elsewhere.iterdir()) == [
        "precious.json"
    ]
    if planted == "symlink":
        assert (folder / "watch-rank0.json").is_symlink()
    watcher.close()


# -- the cheaper clean step misses nothing ------------------------------------------------


def test_a_nan_in_any_single_gradient_is_found_and_named_by_its_parameter() -> None:
    """The clean CPU step reads the gradients as one multi-tensor norm and one sum over the
    1-D ones: a NaN in any one gradient element (matrix, bias, norm weight, embedding)
    is still found at its step and named by its parameter's module."""
    torch.manual_seed(0)
    model = TinyLM()
    tokens = torch.randint(0, 11, (2, 5))
    names = [n for n, p in model.named_parameters()]
    for name in names:
        param = model.get_parameter(name)
        handle = param.register_hook(
            lambda g: g.flatten().index_fill(0, torch.tensor([0]), math.nan).view_as(g)
        )
        with gpudiag.watch(model, "record", record_dir=False) as watcher:
            out = model(tokens)
            nn.functional.cross_entropy(out["logits"].reshape(-1, 11), tokens.reshape(-1)).backward()
            report = watcher.report
            assert report is not None, name
            assert (report.step, report.phase) == (0, "backward"), (name, report)
            assert report.module == name.rpartition(".")[0], (name, report)
            assert f"gradient of {name}: 1 NaN/Inf" in report.detail, (name, report.detail)
        handle.remove()
        model.zero_grad()


def test_modules_that_could_name_nothing_are_not_hooked() -> None:
    net = nn.Sequential(
        nn.Linear(4, 4), nn.ReLU(), nn.ReLU(inplace=True), nn.Identity(), nn.GELU(), nn.Linear(4, 2)
    )
    before = {id(m): len(m._forward_hooks) for m in net.modules()}
    with gpudiag.watch(net, record_dir=False, localize="trail"):
        hooked = [type(m).__name__ for m in net.modules() if len(m._forward_hooks) > before[id(m)]]
    # the root Sequential has the watcher's own root hooks; inside it only what can name an origin
    assert hooked == ["Sequential", "Linear", "ReLU", "Linear"]
    # replayed (the default on one device): only the root's, the module hooks come with a replay
    with gpudiag.watch(net, record_dir=False) as watcher:
        hooked = [type(m).__name__ for m in net.modules() if len(m._forward_hooks) > before[id(m)]]
    assert watcher.localize == "replay" and hooked == ["Sequential"]
    assert net[2].inplace
