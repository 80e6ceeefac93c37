"""muser-ti: chapter 16's decode-attention route ladder, rebuilt with Taichi kernels.

    import muser_ti as mt
    cfg = mt.load_config("glimmer.yaml")
    eng = mt.Engine(cfg, arch="auto", pinned="auto", graph="teacher")
"""

from . import backend  # noqa: F401  (first: it imports Taichi, with its banner off; backend.py says why)
from . import ladder, reference, tolerances
from .config import Geometry, geometry_from_dict, load_config
from .engine import Engine, pinned_library_status
from .errors import BackendError, ConfigError, EngineError, PinnedUnavailable, RouteError, SnapshotError
from .ladder import INTERLEAVED, LLAMA_VEC_NOPE, LLAMA_VEC_SWA, ROUTES, SPLITK
from .model_config import geometry_from_model_config

__all__ = [
    "BackendError", "ConfigError", "Engine", "EngineError", "Geometry", "INTERLEAVED", "LLAMA_VEC_NOPE", "LLAMA_VEC_SWA",
    "PinnedUnavailable", "ROUTES", "RouteError", "SPLITK", "SnapshotError", "geometry_from_dict",
    "geometry_from_model_config", "ladder",
    "load_config", "pinned_library_status", "reference", "tolerances",
]
__version__ = "0.1.0"
