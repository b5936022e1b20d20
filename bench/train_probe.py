"""Training step time at the SmolLM2-135M shape (random weights and data), to size the GPU runs.

    python bench/train_probe.py --json probe.json

Runs `fit` for a few steps of the drafter loss and of the adapter loss with the CLI's default
module shapes and reports seconds per step (steps 5..N, compilation excluded).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import weaver_jax as wj  # noqa: E402
from weaver_jax import training  # noqa: E402
from weaver_jax._adapter import Adapter, AdapterConfig  # noqa: E402
from weaver_jax._drafter import Drafter, DrafterConfig  # noqa: E402
from weaver_jax._train import TrainConfig, fit, read_log  # noqa: E402
from weaver_jax.testing import random_target  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--drafter-batches", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--adapter-batches", type=int, nargs="+", default=[16])
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    c = wj.smollm2_135m("float32")
    target = random_target(c)
    rng = np.random.default_rng(0)
    n, t = 128, args.seq_len
    data = dict(tokens=rng.integers(0, c.vocab_size, (n, t)).astype(np.int32),
                prompt_lengths=np.full(n, 100, np.int32), lengths=np.full(n, t, np.int32))
    dconfig = DrafterConfig.like(c, num_layers=2, num_features=3, mask_token_id=16)  # the CLI's defaults
    aconfig = AdapterConfig.like(c, d_rank=192, num_layers=2, num_heads=3, mlp_dim=512, K=15)
    rows = []

    def probe(kind, batch, module, loss_for, frozen):
        config = TrainConfig(steps=args.steps, batch_size=batch, anchors=args.anchors, save_every=10**6, log_every=2)
        with tempfile.TemporaryDirectory() as tmp:
            fit(module, loss_for(config), data, config, tmp, frozen=frozen)
            log = read_log(tmp)
        per_step = (log[-1]["seconds"] - log[0]["seconds"]) / (log[-1]["step"] - log[0]["step"])
        rows.append(dict(kind=kind, batch=batch, anchors=args.anchors, seq_len=t, seconds_per_step=per_step))
        print(json.dumps(rows[-1]), flush=True)

    drafter = Drafter(dconfig, rngs=nnx.Rngs(0))
    for batch in args.drafter_batches:
        probe("drafter", batch, Drafter(dconfig, rngs=nnx.Rngs(0)), training.drafter_loss_fn, (target,))
    for batch in args.adapter_batches:
        probe("adapter", batch, Adapter(aconfig, rngs=nnx.Rngs(0)),
              lambda config: training.adapter_loss_fn(config, 512), (target, drafter))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
