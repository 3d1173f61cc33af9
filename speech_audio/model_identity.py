"""A model's identity for the prompt cache: a digest of what its files are, without reading them.

The digest covers every file under the given directories by relative name, size and modification time, and a
frontend version (the gateway's package version: a new release may normalise text differently). A new checkpoint,
an enrolled, replaced or removed voice, or an upgrade gives a new identity, so cache entries made by the old model
are never played again (they age out of the store's LRU). Stat only: cheap enough to run at every start.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path


def frontend_version() -> str:
    try:
        return metadata.version("cosyvoice-gateway")
    except metadata.PackageNotFoundError:
        return "unknown"


def files_identity(name: str, *directories: Path | None) -> str:
    """`name:<16 hex digits>` over the files under `directories` (a missing one counts as missing)."""
    digest = hashlib.sha256(f"{name}\0{frontend_version()}".encode())
    for directory in directories:
        if directory is None:
            continue
        digest.update(f"\0dir {directory.name}".encode())
        if not directory.is_dir():
            digest.update(b"\0missing")
            continue
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            stat = path.stat()
            digest.update(f"\0{path.relative_to(directory)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return f"{name}:{digest.hexdigest()[:16]}"
