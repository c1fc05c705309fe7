"""Find the model state dicts inside a checkpoint and rename their keys safely.

A state dict is found by content, not by name: a dict whose keys are dotted strings and
whose values are all tensors (``_extra_state`` entries allowed), anywhere in the tree —
``state_dict``, ``model_state_dict``, ``model``, ``ema``… An optimizer's state (keyed by
position, under ``state``/``param_groups``) is never touched.

Renaming works on whole leading dot-separated segments only, keeps key order, refuses
collisions (``module.fc.weight`` next to ``fc.weight``) naming the keys, and renames the
state dict's ``_metadata`` module entries the same way, so versioned modules load the
same (the semantics of torch's ``consume_prefix_in_state_dict_if_present``, extended to
any prefix and to adding one).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from gpudiag.errors import InputError
from gpudiag.repro.checkpoint.pickles import is_tensor

#: Prefixes wrappers add: DataParallel/DDP, torch.compile, Lightning Fabric, FSDP,
#: activation checkpointing.
WRAPPER_PREFIXES = (
    "module.",
    "_orig_mod.",
    "_forward_module.",
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
)

Path = tuple[Any, ...]


class KeyCollision(InputError):
    """Renaming would map two keys onto one."""


def is_state_dict(value: Any) -> bool:
    if not isinstance(value, dict) or not value:
        return False
    if not all(isinstance(k, str) and k and " " not in k for k in value):
        return False
    tensors = sum(1 for v in value.values() if is_tensor(v))
    extra = sum(1 for k in value if k.endswith("_extra_state"))
    return tensors > 0 and tensors + extra == len(value)


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, dict) and "state" in value and "param_groups" in value


def find_state_dicts(tree: Any) -> list[tuple[Path, dict[str, Any]]]:
    """(path from the root, state dict) for every model state dict in ``tree``."""
    found: list[tuple[Path, dict[str, Any]]] = []

    def walk(value: Any, path: Path) -> None:
        if is_state_dict(value):
            found.append((path, value))
        elif isinstance(value, dict) and not _is_optimizer_state(value):
            for k, v in value.items():
                walk(v, (*path, k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, (*path, i))

    walk(tree, ())
    return found


def path_text(path: Path) -> str:
    return "".join(f"[{k!r}]" for k in path) or "(root)"


def leading_prefixes(keys: list[str]) -> list[str]:
    """The wrapper prefixes every key starts with, outermost first
    (``_orig_mod.module.``→ ["_orig_mod.", "module."])."""
    out = []
    rest = list(keys)
    while rest:
        for p in WRAPPER_PREFIXES:
            if all(k.startswith(p) for k in rest):
                out.append(p)
                rest = [k[len(p) :] for k in rest]
                break
        else:
            break
    return out


@dataclass
class Plan:
    """How one state dict's keys change: prefixes stripped (in order) then one added."""

    path: Path
    strip: list[str] = field(default_factory=list)
    add: str = ""
    notes: list[str] = field(default_factory=list)

    def rename(self, key: str) -> str:
        for p in self.strip:
            if key.startswith(p):
                key = key[len(p) :]
        return self.add + key

    @property
    def changes(self) -> bool:
        return bool(self.strip or self.add)


def auto_plan(path: Path, state: dict[str, Any]) -> Plan:
    """Peel the wrapper prefixes every key carries; a prefix only some keys carry is left
    alone — unless stripping it would collide, which is refused."""
    keys = list(state)
    plan = Plan(path, leading_prefixes(keys))
    renamed = [plan.rename(k) for k in keys]
    for p in WRAPPER_PREFIXES:
        some = [k for k in renamed if k.startswith(p)]
        if some and len(some) < len(renamed):
            clash = _collisions(renamed, [p])
            if clash:
                raise KeyCollision(_collision_message(path, clash))
            plan.notes.append(
                f"{len(some)} of {len(renamed)} keys start with {p!r}; left as they are "
                f"(--strip {p} strips them)"
            )
    return plan


def _collisions(keys: list[str], strip: list[str]) -> list[tuple[str, str]]:
    plan = Plan((), list(strip))
    seen: dict[str, str] = {}
    clashes = []
    for k in keys:
        new = plan.rename(k)
        if new in seen:
            clashes.append((seen[new], k))
        else:
            seen[new] = k
    return clashes


def _collision_message(path: Path, clashes: list[tuple[str, str]]) -> str:
    shown = "; ".join(f"{a!r} and {b!r}" for a, b in clashes[:3])
    more = f" (and {len(clashes) - 3} more)" if len(clashes) > 3 else ""
    return (
        f"refusing to rename keys of {path_text(path)}: they would collide — {shown}{more} "
        "(two copies of the model, e.g. an EMA merged in?)"
    )


def apply(state: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """A renamed copy of ``state`` (same type, same order, same tensors, ``_metadata``
    renamed consistently); refuses collisions."""
    keys = list(state)
    renamed = [plan.rename(k) for k in keys]
    if len(set(renamed)) != len(renamed):
        seen: dict[str, str] = {}
        clashes = []
        for old, new in zip(keys, renamed, strict=True):
            if new in seen:
                clashes.append((seen[new], old))
            seen.setdefault(new, old)
        raise KeyCollision(_collision_message(plan.path, clashes))
    out = type(state)() if isinstance(state, collections.OrderedDict) else {}
    for old, new in zip(keys, renamed, strict=True):
        out[new] = state[old]
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = _rename_metadata(metadata, plan)  # type: ignore[attr-defined]
    return out


def _rename_metadata(metadata: Any, plan: Plan) -> Any:
    """Module entries follow their keys: stripping ``module.`` maps ``module`` to the root
    ``""`` (replacing the wrapper's own root entry) and ``module.x`` to ``x``."""
    entries = list(metadata.items())
    for p in plan.strip:
        name = p.rstrip(".")
        if not any(k == name or k.startswith(p) for k, _ in entries):
            continue
        kept = []
        for k, v in entries:
            if k == name:
                kept.append(("", v))
            elif k.startswith(p):
                kept.append((k[len(p) :], v))
            elif k != "":
                kept.append((k, v))
        entries = kept
    if plan.add:
        name = plan.add.rstrip(".")
        root = [(k, v) for k, v in entries if k == ""]
        entries = root + [((f"{name}.{k}" if k else name), v) for k, v in entries]
    out = type(metadata)()
    for k, v in entries:
        out[k] = v
    return out


def replace_at(tree: Any, path: Path, value: Any) -> Any:
    """``tree`` with the object at ``path`` replaced (containers along the path copied)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        out = type(tree)() if isinstance(tree, collections.OrderedDict) else {}
        for k, v in tree.items():
            out[k] = replace_at(v, rest, value) if k == head else v
        if hasattr(tree, "_metadata"):
            out._metadata = tree._metadata  # type: ignore[attr-defined]
        return out
    items = list(tree)
    items[head] = replace_at(items[head], rest, value)
    return type(tree)(items)
