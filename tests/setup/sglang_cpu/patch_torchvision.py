"""Make ``import torchvision`` work with a CPU torch in the SGLang venv.

The registry's torchvision 0.28.0 wheel is built against a CUDA torch; on torch+cpu its C ops do not load
and ``import torchvision`` fails in ``_meta_registrations`` ("operator torchvision::nms does not exist").
SGLang imports ``torchvision.transforms`` at import time, so the op registrations are made optional.
Idempotent. Usage: python patch_torchvision.py <site-packages dir>
"""

from __future__ import annotations

import os
import pathlib
import sys

ORIGINAL = """from torchvision import (
    _autograd_registrations,
    _meta_registrations,
    datasets,"""
PATCHED = """try:  # megarl CPU patch: a CUDA-built torchvision on torch+cpu has no C ops
    from torchvision import _autograd_registrations, _meta_registrations
except RuntimeError:
    pass
from torchvision import (
    datasets,"""


def main(site_packages: str) -> None:
    """Patch ``torchvision/__init__.py`` under ``site_packages`` in place."""
    path = pathlib.Path(site_packages) / "torchvision" / "__init__.py"
    text = path.read_text()
    if PATCHED in text:
        print(f"already patched: {path}")
    elif ORIGINAL in text:
        # a new file replaces the old one: the installed file may be a hard link into an installer's
        # cache (uv links by default), which an in-place write would change for every venv sharing it
        tmp = path.with_name(path.name + ".megarl-tmp")
        tmp.write_text(text.replace(ORIGINAL, PATCHED))
        os.replace(tmp, path)
        print(f"patched: {path}")
    else:
        sys.exit(f"{path}: unexpected layout, the import block to patch was not found")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python patch_torchvision.py <site-packages dir>")
    main(sys.argv[1])
