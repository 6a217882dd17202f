"""Option values renamed since the seed, still accepted with a one-line warning: `--engine
model` (now native, as the config's xpu.engine says) and `--device-class gpu` (now xpu, the
device class in the config, the Redis keys and the code)."""

from __future__ import annotations

import sys
from collections.abc import Callable


def with_old_names(option: str, old_names: dict[str, str]) -> Callable[[str], str]:
    """An argparse `type` that maps an old value to its new name (warning once on stderr) and
    passes any other value on to the option's `choices` check."""

    def parse(text: str) -> str:
        if text in old_names:
            new = old_names[text]
            print(
                f"syshax: warning: {option} {text} is the old name of {option} {new}",
                file=sys.stderr,
            )
            return new
        return text

    return parse
