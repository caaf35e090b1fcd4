"""The settings of ``kvfleet-operator run``: what the operator gives an InferenceService that does
not say, and what it may choose (OperatorConfig), and how the operator runs (RunSettings). Its
flags are built from these fields (kvfleet.telemetry.settings_flags), each the flag of its name,
with a KVFLEET_* environment variable read when the flag is not given."""

from __future__ import annotations

import importlib.metadata
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvfleet.operator.spec import InferenceServiceSpec
from kvfleet.telemetry.settings_flags import COMMA_LIST, Flag


def _shipped(image: str) -> str:
    """An image of this kvfleet release, as the chart's appVersion tags name it."""
    return image.format(version=importlib.metadata.version("kvfleet"))


class OperatorConfig(BaseModel):
    """Operator-wide defaults that an InferenceService may override, and what it may choose.

    allowed_images: None, any image; else the engine and router images a spec may name (the
    defaults are always allowed): an entry ending in "/" allows every repository under it, any
    other entry exactly that repository, with any tag or digest. allowed_secrets: None, any
    Secret of the namespace; else the only Secret names a spec may reference (env
    valueFrom.secretKeyRef, apiKeySecretRef, hfTokenSecretRef).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_image: Annotated[str, Flag(env="KVFLEET_ENGINE_IMAGE")] = Field(
        default_factory=lambda: _shipped("ghcr.io/kvfleet/engine:{version}"),
        min_length=1,
        description="the engine image of a spec that names none and asks for GPUs",
    )
    # The CPU build, a fifth the size of the CUDA one, which a CPU node would pull for nothing;
    # none (""): such a spec gets engine_image too.
    engine_cpu_image: Annotated[str | None, Flag(env="KVFLEET_ENGINE_CPU_IMAGE")] = Field(
        default_factory=lambda: _shipped("ghcr.io/kvfleet/engine:{version}-cpu"),
        description="the engine image of a spec that names none and asks for no GPU",
    )
    router_image: Annotated[str, Flag(env="KVFLEET_ROUTER_IMAGE")] = Field(
        default_factory=lambda: _shipped("ghcr.io/kvfleet/operator:{version}"),
        min_length=1,
        description="the router image of a spec that names none",
    )
    allowed_images: Annotated[
        tuple[str, ...] | None, COMMA_LIST, Flag(env="KVFLEET_ALLOWED_IMAGES")
    ] = Field(
        default=None,
        description="comma-separated images a spec may choose (spec.engine.image, "
        "spec.routing.image) besides the defaults: 'repo/' allows every repository under it, "
        "anything else that exact repository, any tag; default: any image",
    )
    allowed_secrets: Annotated[
        tuple[str, ...] | None, COMMA_LIST, Flag(env="KVFLEET_ALLOWED_SECRETS")
    ] = Field(
        default=None,
        description="comma-separated Secret names a spec may reference (env secretKeyRef, "
        "apiKeySecretRef, hfTokenSecretRef); '' allows none; default: any Secret of the "
        "namespace",
    )

    def default_engine_image(self, spec: InferenceServiceSpec) -> str:
        """The engine image of a spec that names none: by whether it asks for GPUs."""
        if spec.resources.gpus == 0 and self.engine_cpu_image:
            return self.engine_cpu_image
        return self.engine_image


class RunSettings(BaseModel):
    """How the operator runs: the namespaces it serves, where it answers probes and metrics,
    its peering with other replicas, and the autoscaler's pace."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: Annotated[
        tuple[str, ...], COMMA_LIST, Flag(env="KVFLEET_NAMESPACES", short="-n")
    ] = Field(
        default=(),
        description="a namespace to serve; repeatable or comma-separated; default: all namespaces",
    )
    health_address: Annotated[str, Flag(env="KVFLEET_HEALTH_ADDRESS")] = Field(
        default="0.0.0.0:8081", description="where /healthz answers for liveness probes"
    )
    metrics_address: Annotated[str, Flag(env="KVFLEET_METRICS_ADDRESS")] = Field(
        default="0.0.0.0:8082",
        description="where /metrics answers with the operator's Prometheus metrics",
    )
    peering: Annotated[str | None, Flag(env="KVFLEET_PEERING")] = Field(
        default=None,
        description="kopf peering object name: one active replica, the others on standby; "
        "default: standalone",
    )
    autoscale_interval: Annotated[float, Flag(env="KVFLEET_AUTOSCALE_INTERVAL")] = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds between autoscaling decisions of a builtin-mode InferenceService",
    )
    scrape_timeout: Annotated[float, Flag(env="KVFLEET_SCRAPE_TIMEOUT")] = Field(
        default=2.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds a pod has to answer /metrics before it counts as unreachable",
    )

    @field_validator("health_address", "metrics_address")
    @classmethod
    def _host_port(cls, address: str) -> str:
        port = address.rpartition(":")[2]
        # Port 0 is any free one, as for the engine's and the router's --port.
        if not (port.isdigit() and int(port) < 65536):
            raise ValueError(f"{address!r} is not HOST:PORT")
        return address
