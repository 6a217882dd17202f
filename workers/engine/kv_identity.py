"""What a KV blob must come from to be imported: the same weights, served under the same name.

The model fingerprint (config.py) covers the shape and the rope only: a base model and its
fine-tune share it, and their KV caches are not interchangeable. Every engine that makes or
imports blobs holds a `KVIdentity`, computed once when it loads its model; kv_format writes it
into each blob's header and refuses a blob whose identity differs (torch-free: the echo
stand-in and the emulated accelerator use it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from syshax.shared.config import derive_model_name
from syshax.shared.weights_digest import weights_digest

from .errors import KVIdentityError


@dataclass(frozen=True)
class KVIdentity:
    weights: str  # shared.weights_digest of the model files (a converted folder: its source's)
    served_model: str  # the model name the farm serves it as (the `model` of its jobs)

    @classmethod
    def of(cls, path: Path, served_model: str | None = None) -> KVIdentity:
        """The identity of the model at `path` (read once, at load: milliseconds), served as
        `served_model` (default: the name derived from the path, as the config derives it)."""
        return cls(weights_digest(path), served_model or derive_model_name(str(path)))

    def check(self, weights: str, served_model: str) -> None:
        """Refuse a blob of other weights or another served model, naming both sides."""
        if (weights, served_model) == (self.weights, self.served_model):
            return
        what = "weights" if weights != self.weights else "served model name"
        if weights != self.weights and served_model != self.served_model:
            what = "weights and served model name"
        raise KVIdentityError(
            f"KV blob comes from weights {weights} of model {served_model!r}, this worker "
            f"serves weights {self.weights} of {self.served_model!r}: the {what} differ"
        )
