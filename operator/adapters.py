"""Where each LoRA adapter of a spec is inside an engine pod, and what the engine is told of
them. Pure: no I/O.

The adapters reach a pod in three ways, none of them its template, so that editing
spec.adapters restarts nothing: the adapters ConfigMap (``<name>-adapters``, mounted into the
pod; kubelet refreshes a mounted ConfigMap in place) lists them, the engine container reads the
list when it starts (``--lora-modules``), a downloader beside it fetches hf:// adapters named
there into the model cache volume, and the operator loads and unloads them in running engines
through their endpoints (adapter_sync.py). What the template holds depends only on whether the
spec has adapters at all, on the claims its pvc:// adapters mount and on the Secrets their
hfTokenSecretRefs name (the downloader's environment).
"""

from __future__ import annotations

import hashlib
import json

from kvfleet.operator.spec import AdapterSpec, HFTokenSecretRef, InferenceServiceSpec

MODELS_DIR = "/models"
PVC_MOUNT = "/mnt/model"
# pvc:// adapters' claims, each mounted read-only at ADAPTER_CLAIMS_DIR/<claim>.
ADAPTER_CLAIMS_DIR = "/mnt/adapters"
# The adapters ConfigMap, mounted in the engine and downloader containers.
ADAPTERS_DIR = "/etc/kvfleet/adapters"
MODULES_FILE = "lora-modules"
DOWNLOADS_FILE = "downloads.json"


def adapters_config_name(name: str) -> str:
    return f"{name}-adapters"


def hf_dir(repo: str, revision: str, *, under: str = MODELS_DIR) -> str:
    """The directory of an hf:// download in the model cache volume."""
    return f"{under}/{repo.replace('/', '--')}/{revision.replace('/', '--')}"


def claim_volume(claim: str) -> str:
    """The pod volume of a pvc:// adapter's claim: a DNS label whatever the claim's length."""
    return "adapters-" + hashlib.sha256(claim.encode()).hexdigest()[:12]


def adapter_claims(spec: InferenceServiceSpec) -> list[str]:
    """The claims pvc:// adapters need mounted, the model's own excepted (already mounted)."""
    model = spec.model.parsed_source
    return sorted(
        {
            a.parsed_source.claim
            for a in spec.adapters
            if a.parsed_source.kind == "pvc"
            and not (model.kind == "pvc" and model.claim == a.parsed_source.claim)
        }
    )


def adapter_path(spec: InferenceServiceSpec, adapter: AdapterSpec) -> str:
    """The adapter folder's path inside the engine container."""
    src = adapter.parsed_source
    match src.kind:
        case "hf":
            return hf_dir(src.repo, src.revision, under=f"{MODELS_DIR}/adapters")
        case "pvc":
            model = spec.model.parsed_source
            root = (
                PVC_MOUNT
                if model.kind == "pvc" and model.claim == src.claim
                else f"{ADAPTER_CLAIMS_DIR}/{src.claim}"
            )
            return f"{root}/{src.path}".rstrip("/")
        case _:
            return src.path


def adapter_paths(spec: InferenceServiceSpec) -> dict[str, str]:
    """Every adapter's name: its path in the engine container, in spec order."""
    return {a.name: adapter_path(spec, a) for a in spec.adapters}


def token_env(ref: HFTokenSecretRef) -> str:
    """The downloader's environment variable holding an adapter's own hfTokenSecretRef: one per
    Secret key, named by a hash (Secret names and keys are not all variable names)."""
    digest = hashlib.sha256(f"{ref.name}/{ref.key}".encode()).hexdigest()[:12]
    return f"HF_TOKEN_{digest.upper()}"


def token_refs(spec: InferenceServiceSpec) -> list[HFTokenSecretRef]:
    """The adapters' own token Secret keys, each once, in a stable order: the downloader's
    environment has them all. (The model's, when it has one, is its HF_TOKEN, the default
    token of every hf:// adapter.)"""
    refs = {(r.name, r.key): r for a in spec.adapters if (r := a.hf_token_secret_ref) is not None}
    return [refs[k] for k in sorted(refs)]


def downloads(spec: InferenceServiceSpec) -> list[dict[str, str]]:
    """The hf:// adapters the downloader fetches: repo, revision and target directory, and the
    variable holding the adapter's own token when it has one."""
    out = []
    for a in spec.adapters:
        src = a.parsed_source
        if src.kind != "hf":
            continue
        item = {"repo": src.repo, "revision": src.revision, "dir": adapter_path(spec, a)}
        if a.hf_token_secret_ref is not None:
            item["token_env"] = token_env(a.hf_token_secret_ref)
        out.append(item)
    return out


def config_data(spec: InferenceServiceSpec) -> dict[str, str]:
    """The adapters ConfigMap's files: NAME=PATH lines for the engine's --lora-modules, and the
    downloader's list."""
    return {
        MODULES_FILE: "".join(f"{name}={path}\n" for name, path in adapter_paths(spec).items()),
        DOWNLOADS_FILE: json.dumps(downloads(spec), indent=1) + "\n",
    }


# The engine container's command when the spec has adapters: the engine's own arguments ("$@")
# plus --lora-modules for the adapters of the ConfigMap whose folder is there. One not there yet
# (an hf:// download still running, a path mistyped) is left out rather than failing the start;
# the operator loads it once it is. Names and paths hold no whitespace (the CRD's patterns), and
# globbing is off, so the words arrive as written.
ENGINE_START_SCRIPT = f"""set -f
modules=""
for m in $(cat {ADAPTERS_DIR}/{MODULES_FILE}); do
  if [ -f "${{m#*=}}/adapter_config.json" ]; then modules="$modules $m"; fi
done
exec kvfleet-engine "$@" ${{modules:+--lora-modules $modules}}
"""
