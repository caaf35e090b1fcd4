"""Download an hf:// model for the engine: the init container of an InferenceService's engine pods.

It runs in the engine image (Python and huggingface_hub), never in the operator. The operator
ships this file to the pod in a ConfigMap, so the script matches the operator's version even when
an InferenceService pins an older engine image. The engine itself never downloads anything.

Environment: MODEL_REPO ("org/name"), MODEL_REVISION, MODEL_DIR, and HF_TOKEN for gated models.
Only the files the engine loads are fetched. A directory that is already complete (a model-cache
PVC shared by replicas and restarts) is used as is, without asking the hub again, and a lock on
the shared volume makes replicas that start together download once.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
from pathlib import Path

# What the engine reads: config, tokenizer, chat template, safetensors shards and their index.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.jinja"]
# Meta's repos also carry the original consolidated checkpoint, as large as the model again.
IGNORE_PATTERNS = ["original/*"]
COMPLETE_MARKER = ".kvfleet-complete"

logger = logging.getLogger("kvfleet.model_download")


def download(repo: str, revision: str, target: Path) -> None:
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
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        )
        if not any(target.glob("*.safetensors")):
            raise RuntimeError(
                f"{repo}@{revision} has no *.safetensors files: the engine loads only safetensors"
            )
        marker.write_text(f"{repo}@{revision}\n")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
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
