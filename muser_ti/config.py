"""Model attention geometry, declared in YAML and validated on load.

The chapter's Muse Glimmer is ``configs/glimmer.yaml``: 32 query heads over 2 KV heads (GQA 32:2),
head_dim 128, 52 layers in a repeating pattern of three sliding-window (SWA) layers then one
full-context (NoPE) layer, window 2048, max_context 131072.  Every value is checked here, so a bad
file fails with one error naming the file, the field, the value and what is allowed, never with a
traceback from inside a kernel.
"""

from __future__ import annotations

import io
import math
import stat
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, shown

# The shipped configs: the wheel carries them as package data in muser_ti/configs/; in a checkout that is a
# link to the top-level configs/ (a checkout without links falls back to the folder itself)
_PACKAGED = Path(__file__).resolve().parent / "configs"
CONFIG_DIR = (_PACKAGED if _PACKAGED.is_dir() else _PACKAGED.parent.parent / "configs").resolve()
SWEEP_DIR = CONFIG_DIR / "sweeps"  # where muser-sweep resolves a bare sweep file name

SWA = "swa"
NOPE = "nope"
LAYER_KINDS = (SWA, NOPE)
HEAD_DIMS = (64, 128, 256)
KV_DTYPE_BYTES = 2  # K and V are stored as f16
F16_MAX = 65504.0  # the largest finite f16: what the planes (and so q, k and v) may hold
F32_MAX = 3.4028234663852886e38




@dataclass(frozen=True)
class Geometry:
    """Immutable attention geometry of one model (all fields validated)."""

    name: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_layers: int
    layer_pattern: tuple[str, ...]
    window: int
    max_context: int
    attention_scale: float
    weight_stream_bytes: int
    swa_ring_slack: int = 0
    n_ubatch: int = 512
    source: str = field(default="<inline>", compare=False)

    # ---- derived geometry -------------------------------------------------------------------
    @property
    def heads_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    @cached_property  # a step asks for these; the geometry is frozen
    def layer_kinds(self) -> tuple[str, ...]:
        """Kind of every layer: the pattern repeated cyclically over n_layers."""
        p = self.layer_pattern
        return tuple(p[i % len(p)] for i in range(self.n_layers))

    @cached_property
    def swa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == SWA)

    @cached_property
    def nope_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == NOPE)

    @property
    def swa_ring_capacity(self) -> int:
        """Default ring size: the window plus the slack that rollbacks may use."""
        return min(self.window + self.swa_ring_slack, self.max_context)

    @property
    def kv_bytes_per_row(self) -> int:
        """Bytes one token adds to one layer's cache: K and V for every KV head (1,024 B for Glimmer)."""
        return self.n_kv_heads * 2 * self.head_dim * KV_DTYPE_BYTES

    def visible(self, kind: str, position: int) -> int:
        """Rows a layer of this kind attends at absolute position (the current token included)."""
        return min(position + 1, self.window) if kind == SWA else position + 1

    def with_overrides(self, **changes: Any) -> "Geometry":
        """A new validated geometry with some fields replaced (sweeps vary geometry this way)."""
        raw = {f: getattr(self, f) for f in _FIELDS}
        raw.update(changes)
        if "head_dim" in changes and "attention_scale" not in changes:
            raw["attention_scale"] = "auto"
        return _validate(raw, self.source + " (overridden)")


_FIELDS = (
    "name",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "n_layers",
    "layer_pattern",
    "window",
    "max_context",
    "attention_scale",
    "weight_stream_bytes",
    "swa_ring_slack",
    "n_ubatch",
)
_REQUIRED = _FIELDS[:8]
_MAX_HEADS = 1024
_MAX_LAYERS = 4096
_MAX_CONTEXT = 1 << 24  # int32 row arithmetic in the kernels stays far from overflow
MAX_PLANE_ELEMENTS = 1 << 31  # a class's plane, indexed with 32 bits (see _validate; inputs.capacity)
_MAX_TOKEN_ELEMENTS = 1 << 26  # a token's q (and output): 256 MiB of f32, 12,800x Glimmer's


def plane_elements(geom: Geometry, layers, rows: int) -> int:
    """Elements of the plane the given layers share, at ``rows`` rows."""
    return len(layers) * geom.n_kv_heads * rows * geom.head_dim


def _fail(source: str, field_name: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{source}: field '{field_name}': got {shown(value)}; expected {expected}")


def _int_field(raw: dict, source: str, name: str, lo: int, hi: int) -> int:
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(source, name, value, f"an integer in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise _fail(source, name, value, f"an integer in [{lo}, {hi}]")
    return value


def top_level(raw: Any) -> str:
    """What a YAML document's top level holds, in words (an error names what it found)."""
    if raw is None:
        return "nothing (an empty document)"
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
        type(raw), type(raw).__name__) + f" ({shown(raw, 40)})"


def _validate(raw: Any, source: str) -> Geometry:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of fields at the top level (name: ..., n_heads: ...), got "
                          f"{top_level(raw)}")
    unknown = sorted((k for k in raw if k not in _FIELDS), key=repr)
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {shown(unknown)}; allowed fields are {list(_FIELDS)}")
    missing = [f for f in _REQUIRED if f not in raw]
    if missing:
        raise ConfigError(f"{source}: missing required field(s) {missing}")

    name = raw["name"]
    if not isinstance(name, str) or not name:
        raise _fail(source, "name", name, "a non-empty string")
    n_heads = _int_field(raw, source, "n_heads", 1, _MAX_HEADS)
    n_kv_heads = _int_field(raw, source, "n_kv_heads", 1, _MAX_HEADS)
    if n_heads % n_kv_heads:
        raise _fail(source, "n_kv_heads", n_kv_heads, f"a divisor of n_heads={n_heads} (grouped-query attention)")
    head_dim = raw["head_dim"]
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim not in HEAD_DIMS:
        raise _fail(source, "head_dim", head_dim, f"one of the integers {list(HEAD_DIMS)}")
    n_layers = _int_field(raw, source, "n_layers", 1, _MAX_LAYERS)
    pattern = raw["layer_pattern"]
    if isinstance(pattern, str):
        pattern = [pattern]
    if not isinstance(pattern, (list, tuple)) or not pattern:
        raise _fail(source, "layer_pattern", pattern, f"a non-empty list of layer kinds from {list(LAYER_KINDS)}")
    for i, kind in enumerate(pattern):
        if kind not in LAYER_KINDS:
            raise _fail(source, f"layer_pattern[{i}]", kind, f"one of {list(LAYER_KINDS)}")
    max_context = _int_field(raw, source, "max_context", 1, _MAX_CONTEXT)
    window = _int_field(raw, source, "window", 1, max_context)

    scale = raw["attention_scale"]
    if scale == "auto":
        scale = 1.0 / math.sqrt(head_dim)
    # the largest score the planes allow (|q|, |k| <= 65504, the f16 range) must stay a finite f32 after the scale,
    # or every output is NaN (inf - inf in the softmax)
    top = F32_MAX / (F16_MAX * F16_MAX * head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and 0 < scale <= top):
        raise _fail(source, "attention_scale", raw["attention_scale"],
                    f"'auto' (1/sqrt(head_dim)) or a number in (0, {top:.3g}] (larger turns the largest scores the f16 "
                    f"planes allow into inf in f32)")

    weight_bytes = _int_field(raw, source, "weight_stream_bytes", 0, 1 << 50) if "weight_stream_bytes" in raw else 0
    slack = _int_field(raw, source, "swa_ring_slack", 0, max_context) if "swa_ring_slack" in raw else 0
    n_ubatch = _int_field(raw, source, "n_ubatch", 1, 1 << 16) if "n_ubatch" in raw else 512

    geom = Geometry(
        name=name,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        n_layers=n_layers,
        layer_pattern=tuple(pattern),
        window=window,
        max_context=max_context,
        attention_scale=float(scale),
        weight_stream_bytes=weight_bytes,
        swa_ring_slack=slack,
        n_ubatch=n_ubatch,
        source=source,
    )
    # A token's q and output arrays [layers, heads, head_dim] f32, which every engine allocates
    tokens = n_layers * n_heads * head_dim
    if tokens > _MAX_TOKEN_ELEMENTS:
        raise _fail(source, "n_layers", n_layers, f"a token of at most {_MAX_TOKEN_ELEMENTS:,} elements (n_layers x n_heads "
                    f"x head_dim = {tokens:,}: its q and output arrays alone would take {8 * tokens / 2**30:.1f} GiB)")
    # One class's layers share a plane; Taichi indexes an ndarray with 32-bit arithmetic (and the GPU
    # producer with flat row indices, kernels/producer.py plane_flat), so a plane stays under 2**31 elements.
    for kind, layers, rows, field_name in ((NOPE, geom.nope_layers, max_context, "max_context"),
                                            (SWA, geom.swa_layers, geom.swa_ring_capacity, "window")):
        elements = plane_elements(geom, layers, rows)
        if elements >= MAX_PLANE_ELEMENTS:
            raise _fail(source, field_name, raw[field_name],
                        f"a {kind} plane under 2**31 elements ({len(layers)} layers x n_kv_heads={n_kv_heads} x "
                        f"{rows} rows x head_dim={head_dim} = {elements:,}); Taichi indexes planes with 32 bits")
    return geom


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A bare file name (no directory part) resolves to configs/; anything else is a path."""
    p = Path(name_or_path)
    if p.parent == Path(".") and not p.exists():
        p = CONFIG_DIR / p
    return p


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases and without duplicate keys.  An alias repeats a node, so a file
    of a few hundred bytes can expand to gigabytes (and an error message printing the value with it); YAML's
    specification refuses duplicate keys, which PyYAML would silently resolve to the last."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed here",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {shown(key)}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


MAX_YAML_BYTES = 1 << 20  # a geometry or sweep file is a few hundred bytes; past this it is not one of them


def _kind_of(mode: int) -> str:
    """What a path that is not a regular file is, in words."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def _read_text(path: Path, missing: str, error: type[Exception]) -> str:
    """The file's text, or ``error`` naming the path and what is wrong with it: absent, not a regular file (a
    FIFO would block the read and a device never end it, so neither is opened), too large, unreadable (a
    permission, or an I/O error such as /proc/self/mem's), or not UTF-8."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # absent, or under a path that is a file
        raise error(f"{path}: {missing}") from None
    except OSError as exc:
        raise error(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise error(f"{path}: is {_kind_of(mode)}, not a YAML file") from None
    try:
        with path.open("rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise error(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_YAML_BYTES:
        raise error(f"{path}: larger than {MAX_YAML_BYTES:,} bytes; expected a YAML file of a few hundred") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); expected a "
                    f"YAML file") from None


def read_yaml(path: Path, missing: str, error: type[Exception] = ConfigError):
    """Parse a YAML file (StrictLoader), or raise ``error`` naming the file and what is wrong (``missing`` says
    what absence means).  Every command reads its config and sweep files here, so each gets the same one-line
    refusal for every way a path can fail."""
    stream = io.StringIO(_read_text(path, missing, error))
    stream.name = path.name  # PyYAML's marks name the stream: "in 'x.yaml', line 3", not "<unicode string>"
    try:
        return yaml.load(stream, Loader=StrictLoader)
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from None


def load_config(name_or_path: str | Path) -> Geometry:
    """Load and validate a geometry file; a bare name like 'glimmer.yaml' resolves to configs/."""
    path = resolve_config_path(name_or_path)
    raw = read_yaml(path, f"no such config file (bare names resolve to {CONFIG_DIR})")
    return _validate(raw, str(path))


def geometry_from_dict(raw: dict, source: str = "<dict>") -> Geometry:
    """Validate a geometry given as a mapping (same rules as a file)."""
    return _validate(dict(raw), source)
