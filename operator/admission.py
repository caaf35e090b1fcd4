"""The operator's admission policy: which images and Secrets a spec may use, as the operator's
allow-lists (OperatorConfig.allowed_images, allowed_secrets) say. Pure: no I/O.

A spec the policy refuses is not applied: the children of the last applied spec keep serving
while the Degraded condition names the refused field (reconciler.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.spec import InferenceServiceSpec


@dataclass(frozen=True)
class Violation:
    """A spec the operator's allow-lists refuse; reason as in the Degraded condition."""

    reason: str
    message: str


def image_repository(image: str) -> str:
    """The repository of an image reference: without its digest and tag."""
    name = image.split("@", 1)[0]
    colon = name.rfind(":")
    # A colon before the last slash belongs to a registry's port, not a tag.
    return name[:colon] if colon > name.rfind("/") else name


def image_allowed(image: str, allowed: tuple[str, ...]) -> bool:
    repo = image_repository(image)
    return any(repo == a or (a.endswith("/") and repo.startswith(a)) for a in allowed)


def referenced_secrets(spec: InferenceServiceSpec) -> list[tuple[str, str]]:
    """(field, Secret name) for every Secret the spec puts into a pod."""
    found = []
    for e in spec.engine.env:
        ref = (e.value_from or {}).get("secretKeyRef")
        if ref is not None:
            name = ref.get("name") if isinstance(ref, dict) else None
            found.append((f"spec.engine.env[{e.name}].valueFrom.secretKeyRef", str(name)))
    if spec.api_key_secret_ref is not None:
        found.append(("spec.apiKeySecretRef", spec.api_key_secret_ref.name))
    if spec.model.hf_token_secret_ref is not None:
        found.append(("spec.model.hfTokenSecretRef", spec.model.hf_token_secret_ref.name))
    for a in spec.adapters:
        if a.hf_token_secret_ref is not None:
            found.append((f"spec.adapters[{a.name}].hfTokenSecretRef", a.hf_token_secret_ref.name))
    return found


def policy_violations(spec: InferenceServiceSpec, config: OperatorConfig) -> list[Violation]:
    """What the operator's allow-lists refuse in a spec; empty when it may be applied."""
    found = []
    if config.allowed_images is not None:
        engine_defaults = (config.engine_image, config.engine_cpu_image)
        for field, image, defaults in (
            ("spec.engine.image", spec.engine.image, engine_defaults),
            ("spec.routing.image", spec.routing.image, (config.router_image,)),
        ):
            if image is None or image in defaults or image_allowed(image, config.allowed_images):
                continue
            found.append(
                Violation(
                    "ImageNotAllowed",
                    f"{field} {image!r} is not in the operator's allowed images "
                    f"({', '.join(config.allowed_images) or 'none but the defaults'})",
                )
            )
    if config.allowed_secrets is not None:
        for field, name in referenced_secrets(spec):
            if name not in config.allowed_secrets:
                found.append(
                    Violation(
                        "SecretNotAllowed",
                        f"{field}: Secret {name!r} is not in the operator's allowed secrets "
                        f"({', '.join(config.allowed_secrets) or 'none'})",
                    )
                )
    return found
