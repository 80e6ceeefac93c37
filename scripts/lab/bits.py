"""A digest of a seeded session's outputs, to compare two trees' kernels bit for bit.

A kernel change that claims "the same bits" (a reordering of loads and stores, not of any sum) is
checked by running this on the old tree and on the new one and comparing the digests:

    PYTHONPATH=build/ab_old python3 scripts/lab/bits.py --arch vulkan
    PYTHONPATH=$PWD python3 scripts/lab/bits.py --arch vulkan

The session is Glimmer's group shape (16 query heads per KV head, head_dim 128) on 4 layers: a
prefill, then decode steps whose outputs are digested.  MUSER_GPU_TILE picks the tile as in the
engine; MUSER_GPU_TARGET_WORKGROUPS=2 makes each workgroup walk several warp tiles.
"""

import argparse
import hashlib
import os

import numpy as np

import muser_ti as mt  # the tree PYTHONPATH names (run.sh's ab mode sets it per side)


def digest(arch: str, tokens: int, steps: int, seed: int) -> str:
    cfg = mt.geometry_from_dict(dict(
        name="bits", n_heads=32, n_kv_heads=2, head_dim=128, n_layers=4, layer_pattern=["swa", "swa", "swa", "nope"],
        window=64, max_context=4096, attention_scale="auto", swa_ring_slack=0))
    eng = mt.Engine(cfg, arch=arch, pinned="off")
    rng = np.random.default_rng(seed)
    h = hashlib.sha256()

    def token():
        shape_kv = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
        return (rng.standard_normal((cfg.n_layers, cfg.n_heads, cfg.head_dim)).astype(np.float32),
                rng.standard_normal(shape_kv).astype(np.float32), rng.standard_normal(shape_kv).astype(np.float32))

    shape = (tokens, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    eng.prefill(rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32))
    for _ in range(steps):
        h.update(np.ascontiguousarray(eng.step(*token()), dtype=np.float32).tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="vulkan")
    ap.add_argument("--tokens", type=int, default=300, help="prefilled tokens before the digested steps")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    print(f"{mt.__file__}  arch={a.arch}  tile={os.environ.get('MUSER_GPU_TILE', '')!r}  "
          f"workgroups={os.environ.get('MUSER_GPU_TARGET_WORKGROUPS', 'default')}  "
          f"sha256={digest(a.arch, a.tokens, a.steps, a.seed)}")


if __name__ == "__main__":
    main()
