"""The models one gateway serves and how a request finds its own (config `models:`).

Each served model is a `ModelRoute`: its tokenizer and request checks (a `Preparer`), and the
broker client that queues on its job streams (`Keys.for_model`). A one-model farm has one
route on the farm's plain streams, as before. `Router.pick` maps a request's `model` to its
route; an unknown one is a 404 in OpenAI's error format naming the models served.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syshax.api.model_names import ModelNames
from syshax.api.prepare import Preparer
from syshax.api.settings import ApiSettings
from syshax.broker.client import BrokerClient
from syshax.broker.keys import DEVICE_CLASSES, Keys
from syshax.shared.tokenizer import Tokenizer


@dataclass
class ModelRoute:
    key: str  # the name in its job streams ("" = the one-model farm's streams)
    settings: ApiSettings  # this model's: its path, served name, max_model_len
    tokenizer: Tokenizer
    preparer: Preparer
    keys: Keys
    broker: BrokerClient | None = None  # set when the gateway starts

    @property
    def name(self) -> str:
        return self.preparer.model_name

    @property
    def max_model_len(self) -> int:
        return self.preparer.max_model_len


def build_routes(
    settings: ApiSettings, keys: Keys, tokenizer: Tokenizer | None = None
) -> list[ModelRoute]:
    """A route per served model, the default first. `tokenizer`: the default model's, already
    loaded (tests); models sharing a file share one tokenizer."""
    loaded: dict[Path, Tokenizer] = {}
    routes = []
    for i, (key, s) in enumerate(settings.per_model()):
        path = s.model_path()
        if i == 0 and tokenizer is not None:
            loaded.setdefault(path, tokenizer)
        tok = loaded.get(path) or loaded.setdefault(path, Tokenizer.from_model_path(path))
        preparer = Preparer(s, tok, s.resolved_max_model_len())
        routes.append(ModelRoute(key, s, tok, preparer, keys.for_model(key)))
    return routes


class Router:
    def __init__(self, routes: list[ModelRoute]) -> None:
        self.routes = routes
        self.default = routes[0]
        self.names = ModelNames([r.preparer for r in routes])

    def pick(self, model: str | None) -> ModelRoute:
        """The route of a request's `model` (None = the default model's); APIError 404."""
        return self.routes[self.names.index(model)]

    def of_name(self, name: str) -> ModelRoute:
        """The route of a stored request's model (a resume); the default if none serves it."""
        return self.routes[self.names.of_stored(name)]

    def job_streams(self) -> dict[str, str]:
        """Display name -> key of every job stream (/metrics): a farm of several models names
        each one's streams after it ("smol prefill")."""
        streams = {}
        for route in self.routes:
            k, model = route.keys, f"{route.key} " if route.key else ""
            streams[f"{model}prefill"] = k.prefill_stream
            streams[f"{model}prefill:batch"] = k.prefill_batch_stream
            streams.update({f"{model}decode:{c}": k.decode_stream(c) for c in DEVICE_CLASSES})
        return streams

    def cards(self, live_models: set[str] | None) -> list[dict[str, Any]]:
        """/v1/models: one card per model. `live_models`: the models some live worker serves
        (a farm of several lists only those); None = every route (the one-model farm)."""
        now = int(time.time())
        return [
            {
                "id": r.name,
                "object": "model",
                "created": now,
                "owned_by": "syshax",
                "root": str(r.settings.model_path()),
                "max_model_len": r.max_model_len,
            }
            for r in self.routes
            if live_models is None or r.name in live_models
        ]
