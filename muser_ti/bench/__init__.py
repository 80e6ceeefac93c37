"""What the benchmarks measure with, in one home: never imported by the engine.

    timing.py          wall time of a call, CUPTI busy time (through torch.profiler), graph-replay device
                       time (Vulkan), a child process's environment, the machine's description
    fma_peak.py        this CPU's f32 FMA peak (the FLOP floor's denominator), by a kernel of our own
    ggml_cuda_peer.py  llama.cpp's CUDA flash-attention kernel (the pinned ggml built for CUDA), a peer

The bench command (muser_ti/cli/bench*.py), muser-decode's FLOP floor and the lab's tools (scripts/lab/)
import these; the engine and the ladder do not.
"""
