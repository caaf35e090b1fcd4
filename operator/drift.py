"""Is a live object still what the operator wants it to be? Pure: no I/O.

Reconciling an unchanged spec must issue no writes, and a child edited by hand must be restored.
Both come from one test, ``in_sync(desired, live)``, which holds when

* the live object carries the hash of the desired object (so a spec change that only *removes* a
  field, invisible to a containment check, still counts as a change), and
* every field of the desired object is present in the live one with the same value, ignoring what
  the API server or other controllers add (defaults, status, extra labels, other owners' fields).

Values are compared as the API server returns them: quantities numerically ("1000m" == "1"),
and an empty list or map we ask for may come back absent.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping
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
    want = desired.get("metadata", {}).get("annotations", {}).get(HASH_ANNOTATION)
    have = (live.get("metadata", {}).get("annotations") or {}).get(HASH_ANNOTATION)
    return want is not None and want == have and contains(live, desired)
