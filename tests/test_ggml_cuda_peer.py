"""Our CUDA routes against llama.cpp's own CUDA kernel (the pinned ggml, built for CUDA), on the same f16
rows: both within their documented bounds of the float64 reference, and so within the llama bound of
each other.  Runs where a CUDA build of the pinned ggml is importable (the lab's runner builds one on the
GPU machine); users and CI need none of it, and there the test skips saying so."""

import numpy as np
import pytest

import muser_ti as mt
from muser_ti import reference
from muser_ti.tolerances import F32_ROUTE_RTOL, LLAMA_CPU_VTOL
from sessions import Session


@pytest.mark.parametrize("route, dist", [("interleaved", "normal"), ("interleaved", "peaked"), ("splitk", "normal")])
def test_our_cuda_layer_agrees_with_llama_cpps_cuda_kernel(arch, route, dist):
    if arch != "cuda":
        pytest.skip(f"llama.cpp's CUDA kernel is a CUDA peer; {arch} has none")
    from muser_ti.bench import ggml_cuda_peer

    ok, why = ggml_cuda_peer.status()
    if not ok:
        pytest.skip(why)
    kind, rows = ("nope" if route == "interleaved" else "swa"), 4096
    cfg = mt.geometry_from_dict(dict(name="peer", n_heads=32, n_kv_heads=2, head_dim=128, n_layers=1, layer_pattern=[kind],
                                     window=rows, max_context=rows, attention_scale="auto", swa_ring_slack=0))
    s = Session(mt.Engine(cfg, arch=arch, pinned="off", force=route), seed=8, dist=dist)
    s.prefill(rows - 1)
    q, k, v = s.token()
    ours = s.eng.step(q, k, v)[0]
    kp, vp, st, layout = s.eng.plane_rows(0)
    logicals = reference.visible_logicals(rows - 1, 0)
    kr, vr = reference.gather(kp, st, logicals, layout), reference.gather(vp, st, logicals, layout)
    ref = reference.attention(q[0], kr, vr, cfg.attention_scale)
    peer = ggml_cuda_peer.GgmlCudaAttn(cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, rows, cfg.attention_scale)
    try:
        peer.load(np.swapaxes(kr, 0, 1), np.swapaxes(vr, 0, 1))
        theirs = peer.attend(q[0])
    finally:
        peer.close()
    vmax = float(np.abs(vr).max())
    # ours against the engine's reference (the interleaved route reads the current token in f32), llama's
    # against the f16 rows it read
    assert reference.relative_error(ours, s.eng.reference(q, k, v)[0]) <= F32_ROUTE_RTOL
    assert np.abs(theirs - ref).max() <= LLAMA_CPU_VTOL * vmax
    assert np.abs(ours - theirs).max() <= LLAMA_CPU_VTOL * vmax
