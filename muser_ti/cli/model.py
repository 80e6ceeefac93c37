"""muser-model: the whole Muse Glimmer generating text with the engine as its decode attention.

The model is transformers' own ``MuseGlimmerForConditionalGeneration`` or mlx-lm's own ``muse_glimmer.Model``:
a local checkpoint (``--checkpoint DIR``, nothing is downloaded), or else a Glimmer with random weights whose
attention geometry is the config's (glimmer.yaml: 52 layers, 32 query heads over 2 KV heads, head_dim 128,
window 2,048) and whose width is cut (muser_ti/random_glimmer.py).  The framework's own attention
computes the prompt, the engine ingests its K/V layer by layer, then every decoded token's 52 attentions run
on the engine (muser_ti/integrations/).  It prints the whole model's tokens/s and the attention's share of a
token, the routes, and the agreement with the framework's own attention: the same tokens run step by step
through the framework's own cache and attention (transformers' DynamicCache and sdpa; mlx-lm's own caches, its
batch caches for a batch), their logits against the engine's within the f16 planes' bound
(muser_ti/tolerances.py), the greedy choices, and that run's tokens/s beside the engine's.  ``--batch N`` decodes
N sequences at once (each its own random prompt), the engine holding them as a batch (muser_ti/batch.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from ..backend import ARCHS
from ..config import load_config
from . import (ArgumentParser, CommandError, guarded, install_hint, need, nonnegative_int, positive_int,
               progress_bars)

FRAMEWORKS = {"transformers": ("transformers", "hf"), "mlx": ("mlx_lm", "mlx")}
FRAMEWORK_OWNER = {"transformers": "transformers'", "mlx": "mlx-lm's"}


def _need_framework(name: str):
    module, extra = FRAMEWORKS[name]
    try:
        __import__(module)
    except ImportError:
        raise CommandError(f"--framework {name} needs {module}, which is not installed: {install_hint(extra)}") from None


def _timed(forward, name: str, spent: list | None = None, each=None):
    """Wrap ``forward.<name>`` (the integration's attend or store, integrations/forward.py): its wall time added
    into spent[0], and ``each()`` after every call."""
    inner = getattr(forward, name)

    def timed(*args):
        t0 = time.perf_counter()
        try:
            return inner(*args)
        finally:
            if spent is not None:
                spent[0] += time.perf_counter() - t0
            if each is not None:
                each()

    setattr(forward, name, timed)


class TransformersRun:
    name = "transformers"

    def __init__(self, geometry, checkpoint, arch: str, seed: int, device: str = "cpu", batch: int = 1):
        import inspect

        import torch

        from ..integrations import transformers as mt_hf
        from ..random_glimmer import transformers_model

        self.torch, self.mt_hf = torch, mt_hf
        mt_hf.register()
        if checkpoint:
            from transformers import MuseGlimmerForConditionalGeneration

            self.model = MuseGlimmerForConditionalGeneration.from_pretrained(checkpoint, local_files_only=True,
                                                                             dtype=torch.float32).eval()
        else:
            self.model = transformers_model(geometry, seed=seed)
        self.device = device
        self.model.to(device)
        # transformers 5.2x renames the forward's past_key_values to cache (the old name warns until 5.40)
        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.vocab = self.model.config.text_config.vocab_size
        self.cache = mt_hf.MuserCache(self.model.config, arch=arch, batch_size=batch)
        self.own_cache = None

    @property
    def forward(self):
        return self.cache.forward

    def _logits(self, ids: np.ndarray, cache, attn: str) -> np.ndarray:
        self.model.set_attn_implementation(attn)
        with self.torch.no_grad():
            out = self.model(input_ids=self.torch.from_numpy(ids).to(self.device), logits_to_keep=1,
                             **{self.cache_kw: cache})
        return out.logits[:, -1].float().cpu().numpy()

    def prompt(self, ids: np.ndarray) -> np.ndarray:
        return self._logits(ids, self.cache, "muser_ti")

    def step(self, tokens: np.ndarray) -> np.ndarray:
        return self._logits(tokens[:, None], self.cache, "muser_ti")

    def own_prompt(self, ids: np.ndarray) -> np.ndarray:
        """The framework's own cache and attention (DynamicCache, sdpa, f32 K/V), from the same prompt."""
        from transformers import DynamicCache

        self.own_cache = DynamicCache(config=self.model.config)
        return self._logits(ids, self.own_cache, "sdpa")

    def own_step(self, tokens: np.ndarray) -> np.ndarray:
        return self._logits(tokens[:, None], self.own_cache, "sdpa")


class MlxRun:
    name = "mlx"

    def __init__(self, geometry, checkpoint, arch: str, seed: int, device: str = "cpu", batch: int = 1):
        import mlx.core as mx

        from ..integrations import mlx_lm as mt_mlx
        from ..random_glimmer import mlx_model

        self.mx = mx
        if checkpoint:
            from mlx_lm.utils import load_model

            self.model = load_model(checkpoint)[0]
        else:
            self.model = mlx_model(geometry, seed=seed)
        self.vocab = self.model.args.vocab_size
        lists = [mt_mlx.make_cache(self.model, arch=arch) for _ in range(batch)]
        # a batch: each sequence's list merged layer by layer, as mlx-lm's batch generation merges them
        self.cache = lists[0] if batch == 1 else [lists[0][i].merge([c[i] for c in lists])
                                                  for i in range(len(lists[0]))]
        self.own_cache = None

    @property
    def forward(self):
        session = self.cache[0].session
        return getattr(session, "forward", session)  # a batch session's forward; a one-sequence session is one

    def _logits(self, ids, cache) -> np.ndarray:
        out = self.model(self.mx.array(ids), cache=cache)
        return np.array(out[:, -1].astype(self.mx.float32))

    def prompt(self, ids: np.ndarray) -> np.ndarray:
        return self._logits(ids, self.cache)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        return self._logits(tokens[:, None], self.cache)

    def own_prompt(self, ids: np.ndarray) -> np.ndarray:
        """mlx-lm's own caches (as its Glimmer makes them; its batch caches for a batch) and attention."""
        from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

        own = self.model.make_cache()
        if len(ids) > 1:
            own = [BatchRotatingKVCache(c.max_size, [0] * len(ids)) if isinstance(c, RotatingKVCache) else
                   BatchKVCache([0] * len(ids)) if isinstance(c, KVCache) else c for c in own]
        self.own_cache = own
        return self._logits(ids, own)

    def own_step(self, tokens: np.ndarray) -> np.ndarray:
        return self._logits(tokens[:, None], self.own_cache)


RUNS = {"transformers": TransformersRun, "mlx": MlxRun}


def _engines(forward) -> list:
    """The sequences' engines behind an integration's forward (one, or a batch's)."""
    batch = getattr(forward, "batch", None)
    return [batch.sequence(s) for s in forward.seqs] if batch is not None else [forward.engine]


def run(args) -> dict:
    _need_framework(args.framework)
    need("rich", "muser-model", "its progress bars")
    if args.checkpoint and not (Path(args.checkpoint) / "config.json").is_file():
        raise CommandError(f"--checkpoint {args.checkpoint}: no config.json there (a local checkpoint folder: "
                           f"config.json and the weights; nothing is downloaded)")
    if args.device != "cpu" and args.framework != "transformers":
        raise CommandError(f"--device {args.device}: only transformers' model moves to a device here (mlx runs where "
                           f"mlx runs: Metal on a Mac, the CPU elsewhere)")
    geometry = load_config(args.config)
    if args.layers:
        if args.layers > geometry.n_layers:
            raise CommandError(f"--layers {args.layers}: the config has {geometry.n_layers} layers")
        geometry = geometry.with_overrides(n_layers=args.layers)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    # as muser-decode's: on unless --json; on standard error, so standard output holds the report (or the JSON) alone
    with progress_bars(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(),
                       disable=args.json, console=Console(stderr=True)) as progress:
        return measure(args, geometry, progress)


def measure(args, geometry, progress) -> dict:
    """Build the model, run the prompt, decode, and check the agreement, each a progress task saying what it does."""
    from ..tolerances import model_logit_rtol_f16_planes

    owner = FRAMEWORK_OWNER[args.framework]
    what = "checkpoint" if args.checkpoint else f"Glimmer, {geometry.n_layers} random layers"
    N = args.batch
    task = progress.add_task(f"build: {owner} {what}" + (f", {N} sequences" if N > 1 else ""), total=1)
    build0 = time.perf_counter()
    r = RUNS[args.framework](geometry, args.checkpoint, args.arch, args.seed, args.device, N)
    built = time.perf_counter() - build0
    progress.update(task, completed=1)
    forward = r.forward
    n_layers = geometry.n_layers
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, r.vocab, size=(N, args.prompt_tokens), dtype=np.int64)  # a prompt a sequence
    spent = [0.0]
    # a layer a step: the framework's attention computes the layer's prompt, the engine takes its K/V
    rows = f"{N} x {args.prompt_tokens}" if N > 1 else f"{args.prompt_tokens}"
    task = progress.add_task(f"prompt: {rows} tokens; layers' K/V into the engine", total=n_layers)
    _timed(forward, "store", each=lambda: progress.advance(task))
    t0 = time.perf_counter()
    logits = [r.prompt(prompt)]
    prompt_s = time.perf_counter() - t0
    progress.update(task, completed=n_layers)
    _timed(forward, "attend", spent)
    tokens, times, attention = [], [], []
    task = progress.add_task(f"decode: the engine's attention on {_engines(forward)[0].arch}", total=args.tokens)
    for _ in range(args.tokens):
        tokens.append(np.argmax(logits[-1], axis=-1))
        spent[0] = 0.0
        t0 = time.perf_counter()
        logits.append(r.step(tokens[-1]))
        times.append(time.perf_counter() - t0)
        attention.append(spent[0])
        progress.advance(task)
    steady = times[1:] or times  # the first decoded token builds the kernels (or loads them from the cache)
    token_s, attention_s = float(np.median(steady)), float(np.median(attention[1:] or attention))
    engines = _engines(forward)
    routes: dict = {}
    for eng in engines:
        for k, v in eng.route_counts.items():
            routes[k] = routes.get(k, 0) + v
    generated = np.stack(tokens, axis=1).tolist() if tokens else [[] for _ in range(N)]
    summary = {
        "framework": r.name, "model": args.checkpoint or f"random-weight Glimmer on {Path(str(args.config)).name}'s attention geometry",
        "arch": engines[0].arch, "device": args.device, "layers": n_layers, "batch": N,
        "prompt_tokens": args.prompt_tokens, "decoded_tokens": args.tokens, "build_s": built, "prompt_s": prompt_s,
        "first_token_ms": times[0] * 1e3, "token_ms": token_s * 1e3, "tokens_per_s": N / token_s,
        "attention_ms": attention_s * 1e3, "attention_share": attention_s / token_s, "routes": routes,
        "generated": generated[0] if N == 1 else generated,
        "planes": {kind: dict(vars(ps.state)) for kind, ps in engines[0].planes.items()},
        "agreement": None, "framework_token_ms": None, "framework_tokens_per_s": None,
    }
    if args.check:
        # the same tokens through the framework's own cache and attention, step by step: its logits and its time
        steps = len(tokens)
        task = progress.add_task(f"check: {rows} + {steps} tokens on {owner} attention", total=steps + 1)
        ref = [r.own_prompt(prompt)]
        progress.advance(task)
        own_times = []
        for tok in tokens[:-1]:
            t0 = time.perf_counter()
            ref.append(r.own_step(tok))
            own_times.append(time.perf_counter() - t0)
            progress.advance(task)
        progress.update(task, completed=steps + 1)
        ref, got = np.stack(ref), np.stack(logits[:len(ref)])  # [steps, N, vocab]
        rel = np.abs(got - ref).max(axis=-1) / np.abs(ref).max(axis=-1)
        bound = model_logit_rtol_f16_planes(n_layers)
        top2 = np.sort(ref, axis=-1)[..., -2:]
        decided = (top2[..., 1] - top2[..., 0]) > bound * np.abs(ref).max(axis=-1)
        same = np.argmax(got, axis=-1) == np.argmax(ref, axis=-1)
        summary["agreement"] = {"steps": int(len(ref)), "sequences": N, "worst_relative_logit_error": float(rel.max()),
                                "bound": bound, "within_bound": bool((rel <= bound).all()),
                                "greedy_same": int(same.sum()), "greedy_decided_steps": int(decided.sum()),
                                "greedy_same_where_decided": int((same & decided).sum())}
        if len(own_times) > 1:
            own = float(np.median(own_times[1:]))
            summary["framework_token_ms"], summary["framework_tokens_per_s"] = own * 1e3, N / own
    return summary


def report(s: dict) -> None:
    owner = s["framework"] + ("'" if s["framework"].endswith("s") else "'s")
    batch = s.get("batch", 1)
    print(f"{s['framework']}: {s['model']}, {s['layers']} layers, the engine on {s['arch']} as its decode attention")
    rows = f"{batch} x {s['prompt_tokens']}" if batch > 1 else f"{s['prompt_tokens']}"
    print(f"prompt: {rows} tokens through the framework's own attention in {s['prompt_s']:.1f} s, "
          f"its K/V into the engine's planes")
    seqs = f" of {s['batch']} sequences" if s["batch"] > 1 else ""
    print(f"decode: {s['decoded_tokens']} tokens{seqs}, {s['tokens_per_s']:.2f} tokens/s "
          f"(median {s['token_ms']:.1f} ms "
          f"a step; first {s['first_token_ms']:.0f} ms, with the kernels built or loaded from Taichi's cache)")
    print(f"attention: {s['attention_ms']:.1f} ms a step on the engine, {100 * s['attention_share']:.0f}% of the step")
    every = ", every sequence's" if batch > 1 else ""
    print(f"routes (layer-steps{every}): " + ", ".join(f"{k} {v}" for k, v in sorted(s["routes"].items())))
    print(("planes (the first sequence's): " if batch > 1 else "planes: ") + "; ".join(f"{k} len {p['len']} / capacity {p['capacity']}, origin ({p['origin_logical']}, "
                                 f"{p['origin_physical']})" for k, p in s["planes"].items()))
    if s.get("framework_tokens_per_s"):
        print(f"the same model on {owner} own cache and attention: {s['framework_tokens_per_s']:.2f} tokens/s "
              f"(median {s['framework_token_ms']:.1f} ms a step, the same tokens teacher-forced)")
    a = s.get("agreement")
    if a:
        verdict = "within" if a["within_bound"] else "OUTSIDE"
        over = f"{a['steps']} steps" + (f" x {a['sequences']} sequences" if a.get("sequences", 1) > 1 else "")
        print(f"agreement with {owner} own attention over {over}: logits max |diff| / max |logit| "
              f"{a['worst_relative_logit_error']:.2e} ({verdict} the f16 planes' bound {a['bound']:.2e}); greedy "
              f"token the same at {a['greedy_same_where_decided']} of {a['greedy_decided_steps']} steps the bound "
              f"decides ({a['greedy_same']} of {a['steps'] * a.get('sequences', 1)} in all)")


def parser() -> ArgumentParser:
    ap = ArgumentParser(prog="muser-model", description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=sorted(FRAMEWORKS), default="transformers",
                    help="whose Glimmer runs: transformers' or mlx-lm's")
    ap.add_argument("--checkpoint", help="a local checkpoint folder (config.json and weights; nothing is downloaded) "
                    "(default: none: random weights on --config's attention geometry)")
    ap.add_argument("--config", default="glimmer.yaml",
                    help="the random model's attention geometry (a bare name resolves to configs/)")
    ap.add_argument("--layers", type=nonnegative_int, default=0,
                    help="keep the first N layers of the config's pattern (default: 0, all of them)")
    ap.add_argument("--prompt-tokens", type=positive_int, default=256,
                    help="prompt length: the framework's own attention computes it, the engine ingests its K/V")
    ap.add_argument("--tokens", type=positive_int, default=32, help="tokens to decode with the engine as the attention")
    ap.add_argument("--batch", type=positive_int, default=1,
                    help="sequences decoded at once, each its own random prompt of --prompt-tokens (a batch on the "
                         "engine: muser_ti.batch)")
    ap.add_argument("--arch", default="auto", choices=list(ARCHS), help="the engine's Taichi backend")
    ap.add_argument("--device", default="cpu",
                    help="where transformers' model runs: cpu, cuda or cuda:N (with --arch cuda the engine reads its "
                         "CUDA tensors in place)")
    ap.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random weights and the prompt")
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip the agreement check with the framework's own attention (default: checked)")
    ap.add_argument("--json", action="store_true", help="only the summary, as JSON, on stdout")
    return ap


@guarded()
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    summary = run(args)
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
    else:
        report(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
