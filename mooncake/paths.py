"""Whether a folder the command line names can take files, checked before any work starts."""

from __future__ import annotations

import os


def unusable_directory(path: str, create: bool = True) -> str | None:
    """Why files cannot be written under `path` (None: they can). create: `path` may be missing if
    its nearest existing ancestor is a writable folder (it will be made); else it must exist."""
    existing = os.path.abspath(path)
    while create and not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory" if os.path.exists(existing) else f"{existing} does not exist"
    if any(existing == root or existing.startswith(root + "/") for root in ("/proc", "/sys")):
        return f"{existing} is a kernel file system, not a disk"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    return None
