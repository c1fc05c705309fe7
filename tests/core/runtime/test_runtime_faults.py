"""The --inject grammar and what each fault kind does to a tensor."""

from __future__ import annotations

import math

import pytest
import torch

from gpudiag.runtime.faults import Fault, FaultPlan, InjectSpecError, corrupt, parse_fault, quoted, rehearsal


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        ("5->6:nan", Fault(5, 6, "nan", 1, None)),
        ("5->6:nan@3", Fault(5, 6, "nan", 3, None)),
        ("*->1:bitflip x2", Fault(None, 1, "bitflip", 1, 2)),
        ("0->*:scale=1e4@2x1", Fault(0, None, "scale", 2, 1, 1e4)),
        (" 2 -> 3 : zero ", Fault(2, 3, "zero", 1, None)),
        ("*->*:inf@10", Fault(None, None, "inf", 10, None)),
        ("5-6:nan@3", Fault(5, 6, "nan", 3, None)),  # (issue 47: what survives an unquoted shell)
        ("*-1:zero", Fault(None, 1, "zero", 1, None)),
    ],
)
def test_grammar(spec: str, fault: Fault) -> None:
    assert parse_fault(spec) == fault
    assert parse_fault(fault.text) == fault


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "5->6",
        "56:nan",
        "5=>6:nan",
        "5->6:boom",
        "a->6:nan",
        "5->6:nan@0",
        "5->6:nan x0",
        "5->6:scale=abc",
    ],
)
def test_bad_specs_are_usage_errors_showing_the_grammar(spec: str) -> None:
    with pytest.raises(InjectSpecError) as info:
        parse_fault(spec)
    assert info.value.exit_code == 2
    assert "SRC->DST:KIND" in str(info.value)
    assert "quote the spec (--inject '5->6:nan@3')" in str(info.value)


@pytest.mark.parametrize("cut", ["5-", "5 -", "*-"])
def test_a_spec_the_shell_cut_at_its_redirection_says_to_quote_it(cut: str) -> None:
    """Issue 47: unquoted, ``--inject 5->6:nan@3`` reaches gpudiag as ``5-`` (the shell writes
    a file ``6:nan@3``); the error said only ``bad --inject '5-'``."""
    with pytest.raises(InjectSpecError) as info:
        parse_fault(cut)
    text = str(info.value)
    assert "the shell took '>' for a redirection" in text and "--inject 5-6:nan@3" in text


def test_specs_are_printed_quoted_for_the_shell() -> None:
    """Issue 47: gpudiag printed ``--inject 5->6:nan@3`` bare, which a shell turns into a file."""
    assert quoted("5->6:nan@3") == "'5->6:nan@3'" and quoted("5-6:nan@3") == "5-6:nan@3"
    sentence = rehearsal(["5->6:nan@3", "*->1:zero"]) or ""
    assert "--inject '5->6:nan@3' --inject '*->1:zero'" in sentence


def test_plan_counts_hits_from_the_first_step() -> None:
    plan = FaultPlan.parse(["0->1:nan@2x2"])
    assert plan.due(0, 1, 1) == []
    assert len(plan.due(0, 1, 2)) == 1
    assert plan.due(1, 0, 2) == []  # other direction
    assert len(plan.due(0, 1, 3)) == 1
    assert plan.due(0, 1, 4) == []  # count used up


def test_wildcards_match_any_device() -> None:
    plan = FaultPlan.parse(["*->3:zero"])
    assert plan.due(0, 3, 1) and plan.due(7, 3, 1)
    assert not plan.due(3, 0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_each_kind_corrupts_a_copy(dtype: torch.dtype) -> None:
    x = torch.ones(4, dtype=dtype)
    assert math.isnan(corrupt(x, parse_fault("0->1:nan"))[0].item())
    assert math.isinf(corrupt(x, parse_fault("0->1:inf"))[0].item())
    assert corrupt(x, parse_fault("0->1:zero")).abs().sum().item() == 0
    assert corrupt(x, parse_fault("0->1:scale=8")).tolist() == [8.0] * 4
    flipped = corrupt(x, parse_fault("0->1:bitflip"))
    assert flipped[0].item() != 1.0 and flipped[1:].tolist() == [1.0] * 3
    assert x.tolist() == [1.0] * 4  # the source is untouched


def test_integer_tensors_are_left_alone() -> None:
    x = torch.arange(4)
    assert corrupt(x, parse_fault("0->1:nan")) is x
