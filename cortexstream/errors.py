"""Exception types users can catch; every message names the file/argument and what is wrong."""


class CortexStreamError(Exception):
    """Base class for all errors raised on purpose by CortexStream."""


class ModelLoadError(CortexStreamError):
    """A model source could not be read (missing, truncated, malformed, no network)."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture or tensor quantisation is not supported."""


class InvalidArgumentError(CortexStreamError, ValueError):
    """A user-supplied argument (sampling value, size, policy string...) is out of range."""


class EngineNotRunningError(CortexStreamError, RuntimeError):
    """A call reached a ThreadedEngine that was never started or has been stopped; nothing was queued."""


class OutOfBlocksError(CortexStreamError, MemoryError):
    """The KV arena has no room for the requested blocks; nothing was allocated."""


class GenerationError(CortexStreamError, RuntimeError):
    """One request failed while generating (its sampler or a logits processor raised, a hook failed); the message
    gives the reason. Other requests in the same engine are not affected."""
