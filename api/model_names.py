"""Which of the models a farm serves a request's `model` names (config `models:`): the one
rule the gateway and the batch client route by, and the 404 (OpenAI's error format) for a
name none of them answers to."""

from __future__ import annotations

from .errors import APIError
from .prepare import Preparer


class ModelNames:
    def __init__(self, preparers: list[Preparer]) -> None:
        """`preparers`: one per served model, the default (first) one first."""
        self.served = [p.model_name for p in preparers]
        self._index: dict[str, int] = {}
        for i in reversed(range(len(preparers))):  # a name two accept: the earlier one's
            for name in preparers[i].accepted_names:
                self._index[name] = i

    def index(self, model: str | None) -> int:
        """The position of the model a request names (None = the default's); APIError 404
        naming the models served when none answers to it."""
        if model is None:
            return 0
        i = self._index.get(model)
        if i is None:
            served = ", ".join(f"`{name}`" for name in self.served)
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves {served}.",
                param="model",
                code="model_not_found",
            )
        return i

    def of_stored(self, model: str) -> int:
        """The position of a stored request's model (a resume); the default's if none serves it."""
        return self._index.get(model, 0)
