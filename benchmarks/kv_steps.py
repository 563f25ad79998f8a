"""How fast a stored KV cache reads back: SmolLM2's one-token steps over caches of each SPEC against the exact cache,
with issue 49's goals (q4_0 and q8_0 at >= 0.5x the exact cache's steps / s, e8:3 at >= 0.25x).

    python benchmarks/kv_steps.py [--ctx 8192] [--steps 3] [--specs q4_0 q8_0 e8:3]

A step's cost depends on the cache's length, not on what its values are, so each cache is filled with random K/V
(what a prefill would put there, minus the prefill's minutes) straight through its windowed hook, 512 positions at a
time; then one step is run to settle (the decoded pages it keeps), then --steps timed ones. One thread, as
`run.py generate` runs small models. `run.py generate --kv-cache SPEC` on a real prompt (benchmarks/kv_cache.py
--memory) is the measurement; this one is for iterating.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoints.models import load_model  # noqa: E402
from engine.cli_checks import model_argument  # noqa: E402
from engine.formats.kv.kv_store import install, parse_kv_spec  # noqa: E402
from engine.qwen3 import KVCache  # noqa: E402

GOALS = {"q4_0": 0.5, "q8_0": 0.5, "e8:3": 0.25}


@torch.no_grad()
def step_seconds(model, spec, ctx, steps, generator):
    """Seconds per one-token step at ctx positions (spec None: the exact cache), and the stored cache's bytes."""
    cfg = model.cfg
    quantizer = None if spec is None else parse_kv_spec(spec)
    if quantizer is None:
        model.set_kv_transform(None)
        cache = KVCache(cfg.num_hidden_layers)
    else:
        cache = install(model, quantizer)
    for first in range(0, ctx, 512):
        shape = (1, cfg.num_key_value_heads, min(512, ctx - first), cfg.head_dim)
        for layer in range(cfg.num_hidden_layers):
            k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
            if quantizer is None:
                cache.update(layer, k, v)
            else:
                cache.windowed(layer, k, v, quantizer, quantizer.window)
    token = torch.tensor([[42]])
    model(token, cache)
    start = time.perf_counter()
    for _ in range(steps):
        model(token, cache)
    seconds = (time.perf_counter() - start) / steps
    model.set_kv_transform(None)
    return seconds, None if quantizer is None else cache.nbytes()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--specs", nargs="+", default=list(GOALS))
    args = parser.parse_args(argv)
    for spec in args.specs:
        parse_kv_spec(spec)                                     # a bad SPEC stops here, before the model loads
    torch.set_num_threads(1)
    model = load_model(model_argument(args.model), torch.float32, dense=True)
    model.set_fast()                      # as `generate` runs a model (the exact cache's fast path)
    generator = torch.Generator().manual_seed(0)
    exact, _ = step_seconds(model, None, args.ctx, args.steps, generator)
    print(f"exact float32  ctx {args.ctx}: {1 / exact:.2f} steps/s", flush=True)
    for spec in args.specs:
        seconds, held = step_seconds(model, spec, args.ctx, args.steps, generator)
        goal = GOALS.get(spec)
        verdict = "" if goal is None else f" (goal >= {goal}x: {'met' if exact / seconds >= goal else 'not met'})"
        print(f"{spec:14s} ctx {args.ctx}: {1 / seconds:.2f} steps/s = {exact / seconds:.2f}x the exact cache"
              f"{verdict}; held {held['total'] / 2 ** 20:.1f} MiB, {held['decoded'] / 2 ** 20:.1f} MiB kept decoded",
              flush=True)


if __name__ == "__main__":
    main()
