"""examples/tls/: HTTPS in front of an InferenceService with an ingress-nginx Ingress, and with a
Gateway API Gateway and HTTPRoute. The Ingress is validated against Kubernetes' own schemas; the
Gateway API kinds are not among those, so they are held to the fields of the Gateway API's v1
types that they use. Both must reach the router Service the operator builds for the demo
service (its name and port computed by operator/resources.py), expose only the OpenAI API, and
keep a token stream flowing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvfleet.operator.resources import Owner, router_service
from kvfleet.router.request_body import BodyLimits
from kvfleet.router.settings import RouterSettings

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "tls"
DEMO = yaml.safe_load((ROOT / "examples" / "inferenceservice-cpu-demo.yaml").read_text())
# kubectl apply puts the demo, which names no namespace, in the default one.
NAMESPACE = DEMO["metadata"].get("namespace", "default")
# Paths the router answers besides the OpenAI API (router/proxy.py): in-cluster only.
INTERNAL_PATHS = ("/health", "/metrics")

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
HOSTNAME = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A Gateway API Duration (GEP-2257).
DURATION = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required or [],
            "additionalProperties": False}  # fmt: skip


METADATA = _object({"name": {"pattern": DNS_LABEL}, "namespace": {"pattern": DNS_LABEL}},
                   ["name", "namespace"])  # fmt: skip
# gateway.networking.k8s.io/v1 Gateway and HTTPRoute, the fields the examples use.
GATEWAY = _object({
    "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
    "kind": {"const": "Gateway"},
    "metadata": METADATA,
    "spec": _object({
        "gatewayClassName": {"type": "string", "pattern": DNS_LABEL},
        "listeners": {"type": "array", "minItems": 1, "items": _object({
            "name": {"type": "string", "pattern": DNS_LABEL},
            "protocol": {"enum": ["HTTP", "HTTPS", "TLS", "TCP", "UDP"]},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "hostname": {"type": "string", "pattern": HOSTNAME},
            "tls": _object({
                "mode": {"enum": ["Terminate", "Passthrough"]},
                "certificateRefs": {"type": "array", "items": _object({
                    "group": {"const": ""},
                    "kind": {"const": "Secret"},
                    "name": {"type": "string", "pattern": DNS_LABEL},
                    "namespace": {"type": "string", "pattern": DNS_LABEL},
                }, ["name"])},
            }),
            "allowedRoutes": _object({
                "namespaces": _object({"from": {"enum": ["All", "Same", "Selector"]}}),
            }),
        }, ["name", "protocol", "port"])},
    }, ["gatewayClassName", "listeners"]),
}, ["apiVersion", "kind", "metadata", "spec"])  # fmt: skip
HTTP_ROUTE = _object({
    "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
    "kind": {"const": "HTTPRoute"},
    "metadata": METADATA,
    "spec": _object({
        "parentRefs": {"type": "array", "minItems": 1, "items": _object({
            "name": {"type": "string", "pattern": DNS_LABEL},
            "namespace": {"type": "string", "pattern": DNS_LABEL},
            "sectionName": {"type": "string", "pattern": DNS_LABEL},
        }, ["name"])},
        "hostnames": {"type": "array", "items": {"type": "string", "pattern": HOSTNAME}},
        "rules": {"type": "array", "minItems": 1, "items": _object({
            "matches": {"type": "array", "items": _object({
                "path": _object({
                    "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                    "value": {"type": "string", "pattern": "^/"},
                }, ["type", "value"]),
            })},
            "backendRefs": {"type": "array", "items": _object({
                "name": {"type": "string", "pattern": DNS_LABEL},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            }, ["name", "port"])},
            "timeouts": _object({
                "request": {"type": "string", "pattern": DURATION},
                "backendRequest": {"type": "string", "pattern": DURATION},
            }),
        })},
    }, ["parentRefs", "rules"]),
}, ["apiVersion", "kind", "metadata", "spec"])  # fmt: skip


def docs(name: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d}


INGRESS = docs("ingress-nginx.yaml")["Ingress"]
GATEWAY_API = docs("gateway-api.yaml")


def the_router_service() -> dict[str, Any]:
    """The Service the operator creates in front of the demo service's routers."""
    return router_service(Owner(name=DEMO["metadata"]["name"], namespace=NAMESPACE, uid="u"))


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)(ms|h|m|s)", duration))


@pytest.mark.parametrize("kube_version", ["1.29", "1.35"])
def test_the_ingress_is_a_valid_kubernetes_object(kube_version):
    kubernetes_validate.validate(INGRESS, kube_version, strict=True)


def test_the_gateway_and_route_have_the_gateway_api_shape():
    assert set(GATEWAY_API) == {"Gateway", "HTTPRoute"}
    jsonschema.validate(GATEWAY_API["Gateway"], GATEWAY)
    jsonschema.validate(GATEWAY_API["HTTPRoute"], HTTP_ROUTE)
    # The shapes refuse what they do not know (a misspelt field fails).
    broken = yaml.safe_load(yaml.safe_dump(GATEWAY_API["HTTPRoute"]))
    broken["spec"]["rules"][0]["backendRef"] = broken["spec"]["rules"][0].pop("backendRefs")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, HTTP_ROUTE)


def test_both_send_the_api_to_the_router_service_the_operator_creates():
    service = the_router_service()
    meta, (port,) = service["metadata"], service["spec"]["ports"]
    assert INGRESS["metadata"]["namespace"] == meta["namespace"]
    for rule in INGRESS["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == meta["name"]
            assert backend["port"] in ({"name": port["name"]}, {"number": port["port"]})
    route = GATEWAY_API["HTTPRoute"]
    assert route["metadata"]["namespace"] == meta["namespace"]
    for rule in route["spec"]["rules"]:
        assert [(b["name"], b["port"]) for b in rule["backendRefs"]] == [
            (meta["name"], port["port"])
        ]


def _exposed() -> list[str]:
    paths = [p["path"] for r in INGRESS["spec"]["rules"] for p in r["http"]["paths"]]
    for rule in GATEWAY_API["HTTPRoute"]["spec"]["rules"]:
        paths += [m["path"]["value"] for m in rule["matches"]]
    return paths


def test_only_the_openai_api_is_exposed():
    assert _exposed() and set(_exposed()) == {"/v1"}
    for prefix in _exposed():
        assert not any(internal.startswith(prefix) for internal in INTERNAL_PATHS)
    assert all(p["pathType"] == "Prefix" for r in INGRESS["spec"]["rules"]
               for p in r["http"]["paths"])  # fmt: skip


def test_tls_ends_at_the_ingress_and_the_gateway():
    (tls,) = INGRESS["spec"]["tls"]
    hosts = {r["host"] for r in INGRESS["spec"]["rules"]}
    assert hosts <= set(tls["hosts"]) and tls["secretName"]
    annotations = INGRESS["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/ssl-redirect"] == "true"

    gateway, route = GATEWAY_API["Gateway"], GATEWAY_API["HTTPRoute"]
    listeners = {listener["name"]: listener for listener in gateway["spec"]["listeners"]}
    for parent in route["spec"]["parentRefs"]:
        assert parent["name"] == gateway["metadata"]["name"]
        assert (
            parent.get("namespace", route["metadata"]["namespace"])
            == (gateway["metadata"]["namespace"])
        )
        listener = listeners[parent["sectionName"]]
        assert (listener["protocol"], listener["port"]) == ("HTTPS", 443)
        assert listener["tls"]["mode"] == "Terminate" and listener["tls"]["certificateRefs"]
        assert set(route["spec"]["hostnames"]) == {listener["hostname"]}
        # The route is in the Gateway's namespace, which the listener admits.
        assert listener["allowedRoutes"]["namespaces"]["from"] == "Same"


def _nginx_bytes(size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([kKmMgG]?)", size).groups()  # type: ignore[union-attr]
    return int(number) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit.lower()]


def test_a_token_stream_flows_and_a_long_generation_is_not_cut():
    settings = RouterSettings()
    annotations = INGRESS["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    assert annotations[prefix + "proxy-buffering"] == "off"
    # nginx's timeouts run between two reads or writes: a non-streamed answer is silent until
    # its generation ends, which the router waits for up to its first-byte timeout.
    for timeout in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(annotations[prefix + timeout]) >= settings.upstream_first_byte_timeout
    assert _nginx_bytes(annotations[prefix + "proxy-body-size"]) >= BodyLimits().max_bytes
    # A Gateway API request timeout covers the whole exchange: 0s turns it off.
    for rule in GATEWAY_API["HTTPRoute"]["spec"]["rules"]:
        assert seconds(rule["timeouts"]["request"]) == 0


def test_the_docs_point_at_the_examples():
    for doc in ("operations.md", "security.md"):
        text = (ROOT / "docs" / doc).read_text()
        for name in ("ingress-nginx.yaml", "gateway-api.yaml"):
            assert f"../examples/tls/{name}" in text, (doc, name)
