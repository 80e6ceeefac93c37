#!/bin/sh
# pin.sh METALLIB PIN [SOURCE_COMMIT]
# Writes PIN: comment lines describing what was pinned, then the metallib's sha256 on its own line.
# Refuses to replace an existing, different pin unless REPIN=1 (a pin is a decision, not a cache).
set -eu
lib=${1:?usage: pin.sh METALLIB PIN [SOURCE_COMMIT]}
pin=${2:?usage: pin.sh METALLIB PIN [SOURCE_COMMIT]}
commit=${3:-unknown}
[ -f "$lib" ] || { echo "pin.sh: no metallib at $lib (run make metallib first)" >&2; exit 1; }
if command -v shasum >/dev/null 2>&1; then
    sum=$(shasum -a 256 "$lib" | cut -d' ' -f1)
else
    sum=$(sha256sum "$lib" | cut -d' ' -f1)
fi
case "$sum" in
    *[!0-9a-f]*|"") echo "pin.sh: could not hash $lib" >&2; exit 1 ;;
esac
[ ${#sum} -eq 64 ] || { echo "pin.sh: unexpected digest '$sum'" >&2; exit 1; }
if [ -f "$pin" ]; then
    old=$(grep -v '^[[:space:]]*#' "$pin" | tr -d '[:space:]' || true)
    if [ -n "$old" ] && [ "$old" != "UNSET" ] && [ "$old" != "$sum" ] && [ "${REPIN:-0}" != 1 ]; then
        echo "pin.sh: $pin already pins $old; $lib is $sum." >&2
        echo "pin.sh: refusing to re-pin; run with REPIN=1 if replacing the pinned binary is intended." >&2
        exit 1
    fi
fi
toolchain=$( (xcrun -sdk macosx metal --version 2>/dev/null || echo "metal compiler: unknown") | head -n 1)
sdk=$(xcrun -sdk macosx --show-sdk-version 2>/dev/null || echo unknown)
tmp="$pin.tmp.$$"
{
    echo "# metal_pinned/PIN -- the sha256 of the pinned metallib that bridge.m verifies before loading it."
    echo "# metallib: $(basename "$lib"), $(wc -c < "$lib" | tr -d ' ') bytes"
    echo "# source: ggml v0.15.3 ($commit), src/ggml-metal/ggml-metal.metal, xcrun metal -O3, not embedded"
    echo "# toolchain: $toolchain; macOS SDK $sdk"
    echo "# pinned: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "$sum"
} > "$tmp"
mv "$tmp" "$pin"
echo "pinned $lib -> $pin: $sum"
