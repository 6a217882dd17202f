"""Files and directories only their owner may read: the farm's runtime file (it may hold the
Redis password), the embedded Redis's config and data, its socket's directory."""

from __future__ import annotations

import os
from pathlib import Path


class PrivatePathError(OSError):
    """A path that should be private belongs to another user."""


def private_dir(path: Path) -> Path:
    """Create `path` (and its parents) and make it 0700; refuse one another user owns (it could
    read or replace what we put there)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PrivatePathError(f"{path} belongs to another user (uid {st.st_uid}), not to us")
    if st.st_mode & 0o077:
        path.chmod(0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Write a file that is 0600 from its creation (never readable by others, even for a
    moment), atomically: a reader sees the old or the new content, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    tmp.replace(path)
