"""Package discovery for pyproject.toml's package-dir mapping: kvfleet.<folder> for each source
folder and every package below it, so no module is left out of a wheel by a hand-kept list."""

from pathlib import Path

from setuptools import setup

FOLDERS = ("engine", "kernels", "operator", "router", "protocol", "telemetry")


def packages() -> list[str]:
    found = []
    for folder in FOLDERS:
        found.append(f"kvfleet.{folder}")
        for init in sorted(Path(folder).rglob("__init__.py")):
            parts = init.parent.relative_to(folder).parts
            if parts:
                found.append(".".join(("kvfleet", folder, *parts)))
    return found


setup(packages=packages())
