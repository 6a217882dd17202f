"""Errors the engine raises; every message names the file or the numbers that are wrong."""


class EngineError(Exception):
    """Base class for engine errors."""


class ModelLoadError(EngineError):
    """A model file or folder cannot be loaded; the message names the file and what is wrong."""


class RequestError(EngineError, ValueError):
    """A request the engine cannot run as given (too long, bad sampling parameters)."""


class KVFormatError(EngineError, ValueError):
    """A KV-cache blob is corrupt or does not fit the model that tries to import it."""


class KVIdentityError(KVFormatError):
    """A KV-cache blob made by another model (shape, weights or served name differ): the
    request cannot continue here, not even recomputed, without mixing two models' text."""


class CapacityError(EngineError):
    """The engine has no free sequence slot left."""


class ExportError(EngineError):
    """A model cannot be written out as asked (e.g. `syshax convert` into a non-empty folder)."""
