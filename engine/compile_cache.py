"""Where what an engine compiles at start (Triton's kernels) and what it measures there (the
memory profile, engine/memory_profile_cache.py) are kept between starts: a folder under the
cache root (--compile-cache-dir, or $KVFLEET_COMPILE_CACHE_DIR) named for everything that
makes them valid, the GPU model, the driver, CUDA, torch, Triton and kvfleet. A change of any
of them starts a folder of its own, so nothing stale is ever read; the folders of old versions
are left for whoever owns the volume to prune."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ROOT_ENV = "KVFLEET_COMPILE_CACHE_DIR"
_DRIVER_FILE = Path("/proc/driver/nvidia/version")


@dataclass(frozen=True)
class BuildFacts:
    """What compiled kernels and a memory profile depend on beyond the model and its settings."""

    gpu: str
    driver: str
    cuda: str
    torch: str
    triton: str
    kvfleet: str


def folder_name(facts: BuildFacts) -> str:
    """The GPU's name for a reader, then a digest of every fact: distinct facts, distinct
    folders."""
    digest = hashlib.sha256(repr(sorted(asdict(facts).items())).encode()).hexdigest()[:16]
    gpu = re.sub(r"[^A-Za-z0-9.]+", "-", facts.gpu).strip("-")[:40] or "gpu"
    return f"{gpu}-{digest}"


def driver_version(text: str) -> str | None:
    """The kernel module's version from /proc/driver/nvidia/version's text."""
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]*)", text)
    return found.group(1) if found else None


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def build_facts(device: torch.device) -> BuildFacts:
    """This machine's facts for a CUDA device. The driver's version comes from the kernel
    module, which containers on NVIDIA's runtime show; "unknown" where it is hidden."""
    import torch

    try:
        driver = driver_version(_DRIVER_FILE.read_text()) or "unknown"
    except OSError:
        driver = "unknown"
    major, minor = torch.cuda.get_device_capability(device)
    return BuildFacts(
        gpu=f"{torch.cuda.get_device_name(device)} sm_{major}{minor}",
        driver=driver,
        cuda=str(torch.version.cuda),
        torch=torch.__version__,
        triton=_version("triton"),
        kvfleet=_version("kvfleet"),
    )


def cache_root(flag: str | None) -> Path | None:
    """The root the engine was given: the flag, else the environment variable; None for none."""
    root = flag or os.environ.get(ROOT_ENV)
    return Path(root) if root else None


def open_compile_cache(root: Path, facts: BuildFacts) -> Path | None:
    """The folder for these facts under `root`, made if needed, with Triton's cache pointed
    into it (Triton reads TRITON_CACHE_DIR when it first compiles, and tensor-parallel workers
    inherit it); None, with a warning, when it cannot be made or written: the engine then
    starts as it would without a cache."""
    folder = root / folder_name(facts)
    triton = folder / "triton"
    try:
        triton.mkdir(parents=True, exist_ok=True)
        if not os.access(triton, os.W_OK | os.X_OK):
            raise PermissionError(f"{triton} is not writable")
    except OSError as e:
        logger.warning("compile cache off: %s", e)
        return None
    os.environ["TRITON_CACHE_DIR"] = str(triton)
    described = ", ".join(f"{k} {v}" for k, v in asdict(facts).items())
    logger.info("compile cache: %s (%s)", folder, described)
    return folder
