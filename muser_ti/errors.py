"""Every error the package raises at its public surface, in one place.

Each names what is wrong (file, field, argument, value, allowed range), and each is raised before
anything is written: a refused call leaves the engine and its cache exactly as they were.
"""


def shown(value, limit: int = 80) -> str:
    """repr(value), cut to ``limit`` characters: an error message never prints a whole hostile value."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class ConfigError(ValueError):
    """A geometry file or value is invalid; the message names file, field, value and allowed range."""


class PlaneError(ValueError):
    """A plane cannot do what was asked (hold a window, rewind that far, grow past its cap)."""


class RouteError(ValueError):
    """A route was forced whose predicate fails, or forced onto the wrong layer class."""


class EngineError(ValueError):
    """Bad input at the public API; the engine's state is unchanged."""


class SnapshotError(EngineError):
    """A snapshot cannot be written or is refused on load (the engine is unchanged)."""


class PinnedUnavailable(RuntimeError):
    """A pinned route was selected or requested but the pinned library is not loaded."""


class BackendError(RuntimeError):
    """The requested backend is not available on this machine."""
