"""A whole model's decode token: transformers' own Muse Glimmer with the engine as its attention, against the same
model on transformers' own attention, as a GPU user runs it.

The model is transformers' ``MuseGlimmerForConditionalGeneration`` with random weights (muser_ti/random_glimmer.py)
on Glimmer's attention geometry (52 layers by default) and a cut width (hidden 512 by default), in ``--dtype``
(bfloat16 by default: what a GPU user runs).  Each side holds its own cache of the same prompt (``--context``
tokens) and decodes the same tokens; one token a side in turn, wall time per token with the device synchronised
at its end, medians of ``--tokens`` tokens after a warm-up:

* ``dynamic``: sdpa over transformers' ``DynamicCache`` (each token concatenated onto each layer's K/V);
* ``static``: sdpa over transformers' ``StaticCache`` (preallocated to the context; sliding layers a ring of the
  window);
* ``engine``: ``attn_implementation="muser_ti"`` over ``MuserCache`` (the engine's planes; its per-layer kernels
  through Taichi's C-API where it loads, ``--launch``);
* ``none``: the same model with attention that does nothing and no cache: the token's cost without attention,
  so each side's attention share is its token less this one (``attention_ms``).

    python -m muser_ti.bench.model_token --arch cuda --context 2040 --context 32760 --tokens 20
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

SIDES = ("dynamic", "static", "engine", "none")
NULL_ATTENTION = "muser_ti_bench_none"


def _null_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention that reads nothing: zeros of the output's shape ([batch, tokens, heads, d])."""
    import torch

    b, h, n, d = query.shape
    return torch.zeros((b, n, h, d), dtype=query.dtype, device=query.device), None


class Side:
    """One side's cache and position over the shared model."""

    def __init__(self, name: str, model, context: int, tokens: int, arch: str, launch: str):
        import torch
        from transformers import DynamicCache, StaticCache

        from ..integrations import transformers as mt_hf

        self.name, self.model = name, model
        config = model.config
        if name == "dynamic":
            self.attn, self.cache = "sdpa", DynamicCache(config=config)
        elif name == "static":
            self.attn, self.cache = "sdpa", StaticCache(config=config, max_cache_len=context + tokens + 8)
        elif name == "engine":
            self.attn, self.cache = mt_hf.ATTN_IMPLEMENTATION, mt_hf.MuserCache(config, arch=arch, launch=launch)
        else:
            self.attn, self.cache = NULL_ATTENTION, None
        self.position = 0
        self.device = next(model.parameters()).device
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._torch = torch

    def forward(self, ids):
        """The model's forward over ``ids`` [1, n] on this side's cache: logits of the last token."""
        torch = self._torch
        self.model.set_attn_implementation(self.attn)
        n = ids.shape[1]
        kwargs = {"logits_to_keep": 1}
        if self.cache is not None:
            kwargs[self._cache_arg] = self.cache
        else:
            kwargs["use_cache"] = False
        kwargs["position_ids"] = torch.arange(self.position, self.position + n, device=self.device)[None]
        out = self.model(input_ids=ids, **kwargs).logits
        self.position += n
        return out

    def token(self, tok) -> tuple[float, object]:
        """One decode token: (its wall time in s, the device synchronised at its end; its logits)."""
        torch = self._torch
        self.model.set_attn_implementation(self.attn)  # outside the timing: a framework keeps one
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        logits = self.forward(tok)
        sync()
        return time.perf_counter() - t0, logits


def measure(arch: str, layers: int, hidden: int, dtype: str, context: int, tokens: int, sides, launch: str,
            seed: int = 0) -> dict:
    import torch

    from .. import random_glimmer
    from ..integrations import transformers as mt_hf
    from transformers import AttentionInterface

    mt_hf.register()
    AttentionInterface.register(NULL_ATTENTION, _null_attention)
    device = "cuda" if arch == "cuda" else "cpu"
    model = random_glimmer.transformers_model("glimmer.yaml", layers=layers, seed=seed, hidden=hidden,
                                              intermediate=2 * hidden)
    model = model.to(device=device, dtype=getattr(torch, dtype))
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, random_glimmer.VOCAB, (1, context), generator=gen).to(device)
    steps = torch.randint(0, random_glimmer.VOCAB, (tokens + 2, 1, 1), generator=gen).to(device)
    times = {name: [] for name in sides}
    first = {}  # each side's logits of the first decode token: the sides compute the same model
    with torch.no_grad():
        runs = []
        for name in sides:
            side = Side(name, model, context, tokens, arch, launch)
            if name != "none":
                side.forward(prompt)  # the prompt through the framework's own attention (the engine ingests it)
            else:
                side.position = context
            runs.append(side)
        for i in range(tokens + 2):
            order = runs if i % 2 else runs[::-1]
            for side in order:
                t, logits = side.token(steps[i])
                if i == 0:
                    first[side.name] = logits.float()
                if i >= 2:  # warm-up: the first tokens build kernels and graphs
                    times[side.name].append(t)
        routes = next((dict(s.cache.engine.route_counts) for s in runs if s.name == "engine"), None)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    # what each side's first token's logits differ by from the dynamic cache's (max |diff| / max |logit|): the
    # same model whatever the cache, within the engine's f16 planes' rounding
    agreement = {}
    if "dynamic" in first:
        ref = first["dynamic"]
        agreement = {name: float((got - ref).abs().max() / ref.abs().max()) for name, got in first.items()
                     if name not in ("dynamic", "none")}
    row = {"arch": arch, "dtype": dtype, "layers": layers, "hidden": hidden, "context": context, "tokens": tokens,
           "launch": launch, "token_ms": ms, "routes": routes, "logits_vs_dynamic": agreement}
    if "none" in ms:
        row["attention_ms"] = {name: ms[name] - ms["none"] for name in ms if name != "none"}
    for peer in ("static", "dynamic"):
        if "engine" in ms and peer in ms:
            row[f"engine_over_{peer}"] = ms["engine"] / ms[peer]
            if "attention_ms" in row and row["attention_ms"][peer] > 0:
                row[f"engine_attention_over_{peer}"] = row["attention_ms"]["engine"] / row["attention_ms"][peer]
    return row


def main(argv=None) -> int:
    from .timing import machine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="cuda", help="the engine's backend; the model runs on CUDA where it is cuda")
    ap.add_argument("--layers", type=int, default=52, help="the first N layers of Glimmer's pattern")
    ap.add_argument("--hidden", type=int, default=512, help="the model's width (intermediate twice it)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--context", type=int, action="append", help="prompt tokens (repeatable; default 2040, 32760)")
    ap.add_argument("--tokens", type=int, default=20, help="decode tokens per side (medians)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    ap.add_argument("--launch", default="auto", help="the engine's per-layer launch path: auto, capi or python")
    args = ap.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    for context in args.context or [2040, 32760]:
        row = measure(args.arch, args.layers, args.hidden, args.dtype, context, args.tokens, sides, args.launch)
        row["machine"] = machine()
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
