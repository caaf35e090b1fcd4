"""Packages that the engine's and the router's processes keep transformers from importing.

transformers imports an optional package wherever it finds one installed, whether its caller
needs it or not. Loading any model's config (AutoConfig, and AutoTokenizer, which reads the
config too) imports its image and video helpers, which import torchvision, whose operators import
torch._dynamo; and its generation helpers import scikit-learn, which imports SciPy. The engine
and the router serve text and use none of them, yet on a machine where they are installed (a
development box, a shared environment) their imports made most of the engine's "config" phase.
The engine images do not install them.

A None entry in sys.modules is how Python marks a package absent: importlib.util.find_spec,
which transformers asks, answers None, and an import of it raises ImportError.
"""

from __future__ import annotations

import sys

UNUSED_PACKAGES = ("torchvision", "sklearn")


def keep_out_unused_packages() -> list[str]:
    """Mark each of UNUSED_PACKAGES that this process has not imported as absent; the ones it
    marked. For a process's entry point (a library caller may need them)."""
    marked = []
    for name in UNUSED_PACKAGES:
        if name not in sys.modules:
            # Typeshed types the values as modules only; the import system documents None.
            sys.modules[name] = None  # pyright: ignore[reportArgumentType]
            marked.append(name)
    return marked
