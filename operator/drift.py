"""Is a live object still what the operator wants it to be? Pure: no I/O.

Reconciling an unchanged spec must issue no writes, and a child edited by hand must be restored.
``in_sync`` holds when the live object carries the desired object's hash (so a change that only
removes a field still counts) and contains every desired field with the same value, ignoring
what the API server and others add. Containment cannot see an added field, and server-side
apply does not remove one: where an addition changes what the child does (a selector key, a
``nodeSelector``), the operator owns the whole value, and ``excess`` finds what live has there
beyond the desired object. Values compare as the API server returns them ("1000m" == "1").
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

HASH_ANNOTATION = "kvfleet.dev/desired-hash"

_QUANTITY_RE = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
# Keys whose values are Kubernetes quantities in the objects the operator builds.
_QUANTITY_PARENTS = frozenset({"requests", "limits"})
_QUANTITY_KEYS = frozenset({"sizeLimit"})


def parse_quantity(value: str | int | float) -> Decimal:
    """A Kubernetes resource.Quantity as a number: "1500m" -> 1.5, "1Gi" -> 1073741824."""
    if isinstance(value, int | float):
        return Decimal(str(value))
    m = _QUANTITY_RE.match(value.strip())
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = Decimal(m[1]), m[2] or ""
    if suffix in _BINARY:
        return number * (Decimal(1024) ** _BINARY[suffix])
    if suffix[:1] in ("e", "E"):
        return number.scaleb(int(suffix[1:]))
    return number.scaleb(_DECIMAL[suffix])


def _same_quantity(a: Any, b: Any) -> bool:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except (ValueError, InvalidOperation, TypeError):
        return a == b


def desired_hash(obj: Mapping[str, Any]) -> str:
    """Hash of an object as built, without the hash annotation itself."""
    clean = copy.deepcopy(dict(obj))
    meta = clean.get("metadata", {})
    annotations = meta.get("annotations", {})
    annotations.pop(HASH_ANNOTATION, None)
    if not annotations:
        meta.pop("annotations", None)
    blob = json.dumps(clean, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def with_hash(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with its hash annotation set."""
    meta = obj.setdefault("metadata", {})
    meta.setdefault("annotations", {})[HASH_ANNOTATION] = desired_hash(obj)
    return obj


def contains(live: Any, desired: Any, key: str | None = None, parent: str | None = None) -> bool:
    """Whether ``live`` has every field of ``desired`` with an equal value.

    Lists of objects match when each desired item is contained in some live item: the API server
    merges such lists by key (containers by name, env by name) and others may add items.
    Lists of scalars (command, args) must be equal.
    """
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return False
        for k, v in desired.items():
            if k not in live:
                if v in ({}, [], None):
                    continue
                return False
            if not contains(live[k], v, k, key):
                return False
        return True
    if isinstance(desired, list):
        if not isinstance(live, list):
            return False
        if all(isinstance(d, Mapping) for d in desired):
            return all(any(contains(item, d, None, key) for item in live) for d in desired)
        return live == desired
    if parent in _QUANTITY_PARENTS or key in _QUANTITY_KEYS:
        return _same_quantity(live, desired)
    return live == desired


def in_sync(desired: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """``live`` carries ``desired``'s hash and every field of ``desired`` with the same value;
    what the API server or other controllers add (defaults, status, extra labels, other owners'
    fields: an env var, annotations) is theirs and ignored. An empty list or map asked for may
    come back absent."""
    want = desired.get("metadata", {}).get("annotations", {}).get(HASH_ANNOTATION)
    have = (live.get("metadata", {}).get("annotations") or {}).get(HASH_ANNOTATION)
    return want is not None and want == have and contains(live, desired)


# Where the operator owns a value exactly, by kind: (path, deep). Deep: nothing may be added
# anywhere below (a selector key, a toleration, an affinity term). Shallow: only the members are
# owned (a container the spec does not ask for goes; an env var added to the engine container
# stays).
_POD = ("spec", "template", "spec")
EXACT_PATHS: dict[str, tuple[tuple[tuple[str, ...], bool], ...]] = {
    "Service": ((("spec", "selector"), True),),
    # A key or expression added there would leave pods outside the budget.
    "PodDisruptionBudget": ((("spec", "selector"), True),),
    "Deployment": (
        ((*_POD, "nodeSelector"), True),
        ((*_POD, "nodeName"), True),
        ((*_POD, "tolerations"), True),
        ((*_POD, "affinity"), True),
        ((*_POD, "containers"), False),
        ((*_POD, "initContainers"), False),
    ),
}
_MISSING = object()


@dataclass(frozen=True)
class Excess:
    """What a live child has at the operator's exact-owned paths beyond the desired object."""

    paths: list[str]
    # A JSON merge patch that removes it, guarded by the live resourceVersion.
    patch: dict[str, Any]


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _match(item: Any, desired: list[Any]) -> Any:
    """The desired item a live list item stands for: by name for named items (containers),
    else the one it contains (tolerations, affinity terms); _MISSING if none."""
    for d in desired:
        if isinstance(item, Mapping) and isinstance(d, Mapping) and "name" in d:
            if item.get("name") == d["name"]:
                return d
        elif contains(item, d):
            return d
    return _MISSING


def _pruned(desired: Any, live: Any, deep: bool) -> Any:
    """``live`` without what ``desired`` lacks (at every level when deep, else at the first)."""
    if isinstance(live, Mapping):
        want = desired if isinstance(desired, Mapping) else {}
        return {k: _pruned(want[k], v, deep) if deep else v for k, v in live.items() if k in want}
    if isinstance(live, list):
        want = desired if isinstance(desired, list) else []
        kept = [(item, _match(item, want)) for item in live]
        return [_pruned(d, item, deep) if deep else item for item, d in kept if d is not _MISSING]
    return live if desired is not _MISSING else _MISSING


def _merge_patch(live: Any, target: Any) -> Any:
    """The JSON merge patch that turns ``live`` into ``target``, a subset of it (_MISSING: the
    field goes). Lists are replaced whole, as merge patches do."""
    if target is _MISSING:
        return None
    if isinstance(live, Mapping) and isinstance(target, Mapping):
        patch = {k: None for k in live if k not in target}
        patch |= {k: _merge_patch(live[k], v) for k, v in target.items() if live[k] != v}
        return patch
    return target


def excess(desired: Mapping[str, Any], live: Mapping[str, Any]) -> Excess | None:
    """What ``live`` has beyond ``desired`` where the operator owns the value exactly, with
    the merge patch that removes it; None when nothing is added there.

    Not server-side apply: a forced apply takes back an atomic map (a Service selector), but it
    never removes a list member or map key another manager owns in a granular field (a second
    container), so the fix is one merge patch computed from the live object. Lists go whole in a
    merge patch, so the patch carries the live members the operator keeps (with the fields others
    added to them), and the live resourceVersion, so that a concurrent write makes it a 409
    rather than lost.
    """
    paths: list[str] = []
    patch: dict[str, Any] = {}
    for path, deep in EXACT_PATHS.get(str(desired.get("kind")), ()):
        have = _get(live, path)
        if have is _MISSING:
            continue
        target = _pruned(_get(desired, path), have, deep)
        if target == have:
            continue
        paths.append(".".join(path))
        node = patch
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _merge_patch(have, target)
    if not paths:
        return None
    version = (live.get("metadata") or {}).get("resourceVersion")
    if version is not None:
        patch["metadata"] = {"resourceVersion": version}
    return Excess(paths, patch)
