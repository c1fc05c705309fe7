"""Localisation: once a witness is not finite, what went non-finite first on this rank —
an input, the first module output in the order they ran (the forward trail the watcher's
hooks kept), a parameter the optimizer broke, a gradient in backward order, or a
DataParallel transfer. Each function returns what it found (a :class:`Local`, or None);
the watcher (:class:`gpudiag.watch.core.Watcher`, passed in: not imported) decides what to
say."""

import math
from typing import Any

import torch
from torch import nn

from gpudiag.hw.cuda import cuda_link
from gpudiag.runtime.stats import nonfinite_count
from gpudiag.watch.found import Local, Seen, transfer_json
from gpudiag.watch.replay import DID_NOT_RECUR, param_versions, replay
from gpudiag.watch.witness import (
    bad_count,
    float_tensors,
    grad_witness,
    has_nan,
    one_pass_fits,
    step_clean,
)


def check_local(watcher: Any) -> Local | None:
    """Single device, DataParallel, or a DDP ``no_sync`` micro-step: this process's
    values only, one read-back; what went non-finite first, or None."""
    if not watcher._fwd_device and watcher._one_pass is None:  # (lazy parameters: sized at last)
        watcher._one_pass = one_pass_fits(watcher._all_params)
    if (  # the usual CPU step of a model that is not large: one pass (step_clean), then done
        not watcher._fwd_device
        and watcher._one_pass
        and step_clean(watcher._all_params, watcher._out_grads)
        and (math.isfinite(sum(watcher._fwd_host)) or forward_verdict(watcher._outputs) != "nan")
    ):
        return None  # every gradient finite; the outputs too, or Inf alone (masked logits)
    every = [p.grad for p in watcher._all_params]
    if any(g is None for g in every):
        params = [p for p, g in zip(watcher._all_params, every, strict=True) if g is not None]
        grads: list[torch.Tensor] = [g for g in every if g is not None]
    else:
        params, grads = watcher._all_params, every
    if not watcher._fwd_device and not any(g.is_cuda for g in watcher._out_grads[:1] + grads[:1]):
        # The CPU, the exact way: the forward was read as it ended; a value per gradient.
        fwd = watcher._fwd_host
        out_grads = [float(g) for g in watcher._out_grads]  # (each exact: output_grad_witness)
        values = grad_witness(grads).tolist()
        if math.isfinite(sum(values) + sum(out_grads) + sum(fwd)):
            return None  # (a sum that overflowed on finite values goes on: counted below)
    else:
        outs = [w.reshape(-1) for w, _, _ in watcher._outputs]
        witness = grad_witness(grads)
        parts = [*outs, *(g.reshape(-1) for g in watcher._out_grads)]
        device = parts[0].device if parts else witness.device
        flat = torch.cat([*(t.to(device) for t in parts), witness.to(device)]).tolist()
        n_out = sum(o.numel() for o in outs)
        fwd, out_grads = flat[:n_out], flat[n_out : len(flat) - len(params)]
        values = flat[len(flat) - len(params) :]
    suspects = [p for p, v in zip(params, values, strict=True) if not math.isfinite(v)]
    bad_grads = [(p, c) for p in suspects if p.grad is not None and (c := nonfinite_count(p.grad))]
    return diagnose(watcher, fwd, out_grads, bad_grads)


def diagnose(
    watcher: Any, fwd: list[float], out_grads: list[float], bad_grads: list[tuple[Any, int]]
) -> Local | None:
    """What went non-finite first on this rank this step, or None (a witness that
    overflowed on finite values)."""
    transfer = corrupted_transfer(watcher)
    if transfer is not None:
        return transfer
    if any(not math.isfinite(v) for v in fwd):
        # A NaN in the model's outputs (or a non-finite loss given to observe()) is a
        # fault; an Inf alone (masked logits, an unused entry) only if it reached the
        # loss's gradient: the gradient flowing into the outputs went non-finite. (Other
        # non-finite gradients beside a masked output are the backward's, named below.)
        verdict = forward_verdict(watcher._outputs)
        reached = any(not math.isfinite(v) for v in out_grads)
        if verdict == "nan" or (verdict == "inf" and reached):
            found = first_bad_output(watcher, nan_only=verdict == "nan")
            if found is not None:
                return found
    if any(not math.isfinite(v) for v in out_grads):
        return scaler_skip(
            watcher,
            local_at(
                watcher,
                "backward",
                "<loss>",
                "the gradient flowing into the model's output from the loss was non-finite: "
                "the loss, computed outside the model, is non-finite",
            ),
        )
    if bad_grads:
        return bad_gradient(watcher, bad_grads)
    return None


def scaler_enabled(watcher: Any) -> bool:
    """Whether the watcher was given a GradScaler that is on."""
    return watcher.scaler is not None and bool(getattr(watcher.scaler, "is_enabled", lambda: True)())


def scaler_skip(watcher: Any, local: Local) -> Local:
    """A backward fault under an enabled GradScaler is its overflow: the scaler skips
    the step and lowers its scale (what it is for), noted, not a fault."""
    if scaler_enabled(watcher):
        local.kind = "scaler-skip"
        local.detail += "; the GradScaler skips this step and lowers its scale"
    return local


def device_label(watcher: Any, seen: Seen | None = None) -> str:
    if seen is not None and seen.replica is not None and watcher.vdp is not None:
        return f"virtual GPU{seen.replica}"
    if seen is not None:
        t = next(float_tensors(seen.output), None)
        if t is not None:
            return str(t.device)
    if watcher.vdp is not None:
        return f"virtual GPU{watcher.vdp.transport.devices.ids[0]}"
    return str(watcher.device)


def local_at(
    watcher: Any, phase: str, module: str, detail: str, seen: Seen | None = None, step: int | None = None
) -> Local:
    return Local(
        watcher.step if step is None else step,
        phase,
        module,
        device_label(watcher, seen),
        detail,
        watcher.rank,
        kind="fault",
        blind=list(watcher.blind),
    )


def forward_verdict(outputs: list[tuple[torch.Tensor, Any, str]]) -> str:
    """``"nan"``: a model output holds a NaN, or a loss given to :meth:`observe` is
    non-finite (a fault); ``"inf"``: the model's outputs hold Infs and no NaN (masked
    logits, an unused entry of a dict: a fault only if the gradients go non-finite);
    ``"clean"``. An output let go (an eval-mode forward) is judged by its witness, whose
    NaN may also be two Infs of opposite signs: taken as a NaN."""
    verdict = "clean"
    for witness, output, name in outputs:
        if bool(torch.isfinite(witness).all()):
            continue
        if name or (has_nan(output) if output is not None else bool(torch.isnan(witness).any())):
            return "nan"
        verdict = "inf"
    return verdict


def seen_calls(watcher: Any, every: bool = False) -> list[Seen]:
    """This step's module calls, in the order they returned: the hooks' trail — which, under
    ``localize="replay"``, the step's forwards replayed with the hooks on make now, once:
    those not judged clean as they ended, or ``every`` one (a gradient's order)."""
    captures = [c for c in watcher._captures if every or not c.settled]
    if watcher.localize == "replay" and not watcher._replayed and captures:
        watcher._replayed, watcher._replaying, evaluating = True, True, watcher._eval
        watcher._eval = False
        try:
            mark = len(watcher._trail)
            watcher._replay_error = replay(watcher.model, captures, watcher._module_hook, gens=watcher._gens)
            if watcher._replay_error is not None:  # once more in grad mode (autograd.grad inside)
                del watcher._trail[mark:]
                watcher._replay_error = replay(
                    watcher.model, captures, watcher._module_hook, True, watcher._gens
                )
        finally:
            watcher._replaying, watcher._eval = False, evaluating
    return [Seen(*seen) for seen in watcher._trail]


def unnamed(watcher: Any) -> str:
    """Why a forward fault is named at the model's output, not at a module."""
    if watcher._replay_error is not None:
        return f"; the forward could not be replayed to find the module ({watcher._replay_error})"
    if watcher._replayed:
        return f"; {DID_NOT_RECUR}"
    return " (modules not watched one by one)"


def nan_arose_from_finite(watcher: Any) -> bool:
    """Whether the first kept module output holding a NaN had finite inputs: the NaN
    arose there, and an Inf before it (a masked score) is not its origin."""
    for seen in seen_calls(watcher):
        if has_nan(seen.output):
            return not bad_count(seen.inputs)[0]
    return False


def first_bad_output(watcher: Any, nan_only: bool = False) -> Local | None:
    """The first input or module output, in the order they ran, that was non-finite.
    ``nan_only`` (the step's outputs hold a NaN): if the first module output holding a
    NaN made it from finite inputs, Infs before it (masking) are not blamed."""
    if watcher._early is not None:
        return watcher._early
    nan_only = nan_only and nan_arose_from_finite(watcher)
    for inputs in watcher._inputs:
        bad, total = bad_count(inputs, nan_only)
        if bad:
            return local_at(watcher, "input", "<input>", f"{bad} of {total} input values were non-finite")
    suspects: list[str] = []
    trail = seen_calls(watcher)
    for i, seen in enumerate(trail):
        bad, total = bad_count(seen.output, nan_only)
        if not bad:
            continue
        if seen.changed_since(trail[i + 1 :]):
            suspects.append(seen.path)  # changed in place later: judged by what came after
            continue
        stale = bad_parameter(watcher, seen.module)
        if stale is not None:
            name, pbad = stale
            path = f"{seen.path}.{name}" if seen.path else name
            if watcher.step == 0:
                return local_at(
                    watcher,
                    "forward",
                    seen.path,
                    f"parameter {path} was non-finite before the first step",
                    seen,
                )
            return local_at(
                watcher,
                "optimizer",
                seen.path,
                f"parameter {path} ({pbad} non-finite) became non-finite in the optimizer step "
                f"after backward {watcher.step - 1}, whose gradients were finite",
                seen,
                step=watcher.step - 1,
            )
        in_bad, _ = bad_count(seen.inputs)
        kind = type(seen.module).__name__
        if in_bad:
            parent = seen.path.rpartition(".")[0]
            also = (
                f" (or in {', '.join(suspects)}, whose output that code changed in place afterwards)"
                if suspects
                else ""
            )
            return local_at(
                watcher,
                "forward",
                parent,
                f"the input of {seen.path or 'the model'} ({kind}) was already non-finite: it arose "
                f"in {parent or 'the model'}'s own forward code, outside its submodules{also}",
                seen,
            )
        where = f" on replica {device_label(watcher, seen)}" if watcher.placement.startswith("dp") else ""
        local = local_at(
            watcher,
            "forward",
            seen.path,
            f"forward output of {seen.path or 'the model'} ({kind}){where}: {bad} NaN/Inf of {total}",
            seen,
        )
        local.transfer = carrier(watcher, seen)
        return local
    for _, out, name in watcher._outputs:
        bad, total = bad_count(out, nan_only and not name)
        if bad and name:
            return local_at(
                watcher,
                "forward",
                name,
                f"{name} was non-finite ({bad} of {total}), "
                + (
                    "every module output finite"
                    if trail
                    else "the model's outputs finite"
                    if watcher._forwards
                    else "no module output seen on this step"
                ),
            )
        if bad:
            return local_at(
                watcher, "forward", "", f"the model's output: {bad} NaN/Inf of {total}{unnamed(watcher)}"
            )
    return None


def bad_parameter(watcher: Any, module: nn.Module) -> tuple[str, int] | None:
    for name, p in module.named_parameters(recurse=False):
        bad = int((~torch.isfinite(p.detach())).sum())
        if bad:
            return name, bad
    return None


def bad_gradient(watcher: Any, bad_grads: list[tuple[Any, int]]) -> Local:
    """The first module in backward order (the last in forward order) whose
    parameters' own gradients were non-finite. The order is the forward trail's; a
    GradScaler's overflow (a skip, noted and not raised, and normal in fp16 training) is not
    worth a replay of its forward: there the parameters' own order stands in."""
    skip = scaler_enabled(watcher) and watcher.localize == "replay" and not watcher._replayed
    order: dict[str, int] = {}
    for path in [
        *(p for paths in watcher._order for p in paths),
        *(seen.path for seen in ([] if skip else seen_calls(watcher, every=True))),
    ]:
        order.setdefault(path, len(order))

    def rank(item: tuple[Any, int]) -> tuple[int, int]:
        return order.get(watcher.owner.get(id(item[0]), ""), -1), watcher.index.get(id(item[0]), -1)

    param, bad = max(bad_grads, key=rank)
    name = watcher.names.get(id(param), "?")
    module = watcher.owner.get(id(param), "")
    count = f"{bad} NaN/Inf of {param.numel()}" if bad >= 0 else "non-finite"
    return scaler_skip(watcher, local_at(watcher, "backward", module, f"gradient of {name}: {count}"))


def transfers(watcher: Any) -> list[Any]:
    if watcher.vdp is None or watcher.vdp.transport.recorder is None:
        return []
    step = watcher.vdp.transport.step
    return [t for t in watcher.vdp.transport.recorder.transfers if t.step == step]


def corrupted_transfer(watcher: Any) -> Local | None:
    for t in transfers(watcher):
        if t.nonfinite and t.corrupted and math.isfinite(t.sent_checksum or 0.0):
            local = Local(
                watcher.step,
                "transfer",
                t.name if t.name not in ("input", "output") else f"<{t.name}>",
                f"virtual GPU{t.dst}",
                f"{t.nonfinite} value(s) arrived non-finite on GPU{t.dst} from GPU{t.src} although "
                f"they were finite when sent ({t.phase})",
                watcher.rank,
                blind=list(watcher.blind),
            )
            local.transfer = transfer_json(t, corrupted=True)
            return local
    return None


def carrier(watcher: Any, seen: Seen) -> dict[str, Any] | None:
    """The DataParallel copy that carried a replica's non-finite value on."""
    if watcher.vdp is not None and seen.replica is not None:
        for t in transfers(watcher):
            if t.nonfinite and t.src == seen.replica:
                return transfer_json(t, corrupted=False)
        return None
    if watcher.dp is not None:
        t = next(float_tensors(seen.output), None)
        out = torch.device("cuda", watcher.dp.output_device) if watcher.dp.device_ids else None
        if t is not None and out is not None and t.device != out:
            src, dst = t.device.index or 0, out.index or 0
            return {
                "kind": "gather",
                "src": str(t.device),
                "dst": str(out),
                "link": cuda_link(src, dst),
                "corrupted": False,
                "name": "output",
            }
    return None


def settle_forward(watcher: Any, witness: torch.Tensor) -> None:
    """On the CPU a witness is read without a sync: the forward is judged as it ends
    (its fault named now, while its module outputs are at hand) and what it kept is let
    go before the backward, so the allocator can reuse it. On CUDA that read would stall
    the queue: the outputs are kept to the end of the backward and read only if a
    witness read with everything else there is not finite."""
    values = witness.tolist()  # one op: a float, or a list for several tensors
    values = values if isinstance(values, list) else [values]
    watcher._fwd_host.extend(values)
    clean = math.isfinite(sum(values))  # (float32 sums: their float64 total cannot overflow)
    verdict = "clean" if clean else forward_verdict(watcher._outputs[-1:])
    if verdict == "nan" and watcher._early is None:
        watcher._early = first_bad_output(watcher, nan_only=True)
    if verdict == "inf":
        watcher._holding = True  # judged by the gradients at the end of the backward
        for c in watcher._captures:  # (replayed then, if at all: on these parameters)
            if c.versions is None:
                c.versions = param_versions(watcher._all_params)
    if watcher._holding:
        return
    if watcher._trail:  # (replayed: none)
        watcher._order.append([seen[0] for seen in watcher._trail])
    for c in watcher._captures:  # (replay: as the trail is let go)
        c.settled = True
    watcher._trail.clear()
    watcher._inputs.clear()
    if clean:
        watcher._outputs[-1] = (witness, None, watcher._outputs[-1][2])
