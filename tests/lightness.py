"""Import lightness: what a module pulls in when it loads, checked in a fresh interpreter (this
one has long since imported torch)."""

from __future__ import annotations

import subprocess
import sys


def assert_loads_without(code: str, forbidden: tuple[str, ...]) -> None:
    """Run `code` (imports and calls) in a fresh Python; fail if it imported any of `forbidden`."""
    check = f"{code}\nimport sys\nbad = [m for m in {forbidden!r} if m in sys.modules]\nassert not bad, f'imported: {{bad}}'\n"  # fmt: skip
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)
