"""Download an hf:// model for the engine: the init container of an InferenceService's engine pods.

It runs in the engine image (Python and huggingface_hub), never in the operator. The operator
ships this file to the pod in a ConfigMap, so the script matches the operator's version even when
an InferenceService pins an older engine image. The engine itself never downloads anything.

Environment: MODEL_REPO ("org/name"), MODEL_REVISION, MODEL_DIR, and HF_TOKEN for gated models.
With ``--adapters FILE`` it downloads the hf:// LoRA adapters FILE lists instead (the adapters
ConfigMap's JSON list of repo, revision, dir and, for an adapter with a token of its own, the
environment variable holding it; HF_TOKEN otherwise), each on its own: one that fails is logged and
the others still come; with ``--watch SECONDS`` it rereads FILE that often and fetches what is
new, beside the engine (kubelet refreshes a mounted ConfigMap in place).
Only the files the engine loads are fetched. A directory that is already complete (a model-cache
PVC shared by replicas and restarts) is used as is, without asking the hub again, and a lock on
the shared volume makes replicas that start together download once.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import sys
import time
from pathlib import Path

# What the engine reads: config, tokenizer, chat template, safetensors shards and their index.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.jinja"]
# Meta's repos also carry the original consolidated checkpoint, as large as the model again.
IGNORE_PATTERNS = ["original/*"]
# A PEFT adapter folder: its config and its weights.
ADAPTER_PATTERNS = ["adapter_config.json", "*.safetensors"]
COMPLETE_MARKER = ".kvfleet-complete"
# A folder to make on the volume for the engine's compile cache, which the engine mounts as a
# subPath: made here, it belongs to the pod's user rather than to root (kubelet's).
COMPILE_CACHE_ENV = "COMPILE_CACHE_DIR"

logger = logging.getLogger("kvfleet.model_download")


def download(
    repo: str, revision: str, target: Path, *, adapter: bool = False, token: str | None = None
) -> None:
    """token: the hub token for this repository; None: huggingface_hub's default (HF_TOKEN)."""
    marker = target / COMPLETE_MARKER
    target.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            logger.info("%s@%s is already in %s", repo, revision, target)
            return
        from huggingface_hub import snapshot_download

        logger.info("downloading %s@%s into %s", repo, revision, target)
        snapshot_download(
            repo_id=repo,
            revision=revision,
            local_dir=target,
            allow_patterns=ADAPTER_PATTERNS if adapter else ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
            token=token,
        )
        if adapter and not (target / "adapter_config.json").is_file():
            raise RuntimeError(f"{repo}@{revision} has no adapter_config.json: not a PEFT adapter")
        if not any(target.glob("*.safetensors")):
            raise RuntimeError(
                f"{repo}@{revision} has no *.safetensors files: the engine loads only safetensors"
            )
        marker.write_text(f"{repo}@{revision}\n")


def download_adapters(listing: Path) -> int:
    """Every adapter the listing names, each on its own; the number that failed."""
    failed = 0
    for item in json.loads(listing.read_text()):
        target = Path(item["dir"])
        if (target / COMPLETE_MARKER).exists():
            continue
        # An adapter's own token, by the variable its item names (its Secret optional: unset
        # when missing, and the hub's refusal is what the log says).
        token_env = item.get("token_env")
        token = os.environ.get(token_env) if token_env else None
        if token_env and token is None:
            logger.warning("%s is not set: %s@%s downloads without its token", token_env,
                           item["repo"], item["revision"])  # fmt: skip
        try:
            download(item["repo"], item["revision"], target, adapter=True, token=token)
        except Exception as e:  # the next pass (--watch) or the operator's load retries it
            failed += 1
            logger.error("adapter download of %s@%s failed: %s", item["repo"], item["revision"], e)
    return failed


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="download.py")
    parser.add_argument("--adapters", type=Path, help="the adapters ConfigMap's download list")
    parser.add_argument("--watch", type=float, help="reread it every this many seconds")
    args = parser.parse_args(argv)
    folder = os.environ.get(COMPILE_CACHE_ENV)
    if folder:
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as e:  # the engine then starts without its cache, no slower than cold
            logger.error("compile cache folder %s not made: %s", folder, e)
    if args.adapters is not None:
        while True:
            try:
                download_adapters(args.adapters)
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.error("adapter list %s unreadable: %s", args.adapters, e)
            if args.watch is None:
                # An adapter that failed must not keep the engine from starting: it is left out
                # of --lora-modules, and the engine gets it when a later pass brings it.
                return 0
            time.sleep(args.watch)
    try:
        download(
            os.environ["MODEL_REPO"],
            os.environ.get("MODEL_REVISION") or "main",
            Path(os.environ["MODEL_DIR"]),
        )
    except Exception as e:  # the message is what `kubectl logs` and the Degraded reason show
        logger.error("model download failed: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
