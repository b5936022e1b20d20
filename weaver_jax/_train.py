"""Training the drafter (DESIGN 3.2) and the Weaver adapter (DESIGN 3.3) on self-distilled data.

Both losses read the frozen target's hidden states of a batch of sequences, then sample up to
`anchors` positions per sequence inside the response. Each anchor a opens a block `[x_a, MASK...]`
that sees the context before a; the drafter is scored on `x_{a+1..a+b-1}` with cross-entropy
weighted by `exp(-(k - 1) / gamma)`. The adapter, with the drafter frozen, walks the true
continuation as a path (teacher forcing) and is scored, at every depth whose true token lies in
the drafter's top-P pool, on the pool's cross-entropy, depth-decayed the same way. With `distill`
> 0 each loss mixes in the KL divergence from the target's own distribution of the same token (its
logits at the position before it; for the adapter, renormalised over the pool, at every depth of the
path): loss = (1 - distill) * hard + distill * KL, so the student learns the target's whole
distribution, which sampled verification (T > 0) accepts by, not only its argmax.

`fit` is the shared loop: optax AdamW with warmup and cosine decay and global-norm clipping, an
orbax `CheckpointManager` (parameters, optimiser state and step; resumes from the latest; with
`keep_every`, the steps kept for a τ-against-steps curve, read back by `restore`), a
deterministic batch order (a function of the step, so a resumed run sees the batches an
uninterrupted one would), a progress bar, a JSON-lines loss log, and a time budget after which it
checkpoints and returns. A warm start (`start_step`) continues a run from its parameters alone: the
optimiser state (Adam's moments, twice the parameters) is what a run carried between machines can
leave behind.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from weaver_jax._tree import chunked_top_k


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    batch_size: int = 16  # sequences per step
    anchors: int = 32  # per sequence (DESIGN: up to 512)
    learning_rate: float = 6e-4
    warmup: float = 0.04  # fraction of steps
    weight_decay: float = 0.01
    clip: float = 1.0
    gamma: float = 7.0  # depth decay of the loss weights (7 for blocks of 16)
    distill: float = 0.0  # weight of the KL to the target's distribution (0: hard labels only)
    seed: int = 0
    save_every: int = 250
    keep_every: int = 0  # also save and keep every checkpoint at a multiple of this (0: the last two only)
    log_every: int = 10

    def __post_init__(self):
        if not 0.0 <= self.distill <= 1.0:
            raise ValueError(f"distill = {self.distill}: the KL's weight must be in [0, 1]")


def sample_anchors(key: jax.Array, prompt_lengths: jax.Array, lengths: jax.Array, width: int, count: int):
    """Up to `count` distinct anchors per sequence of `width` slots, uniform among the response
    positions a with prompt_len <= a <= len - 2 (x_a and x_{a+1} exist).
    -> anchors `[B, A]` (sorted), ok `[B, A]` (False for padding when a response is shorter)."""
    b = lengths.shape[0]
    pos = jnp.arange(width)[None, :]
    allowed = (pos >= prompt_lengths[:, None]) & (pos <= lengths[:, None] - 2)
    score = jnp.where(allowed, jax.random.uniform(key, (b, width)), -1.0)
    top, anchors = jax.lax.top_k(score, count)
    order = jnp.argsort(anchors, axis=1)
    return jnp.take_along_axis(anchors, order, 1).astype(jnp.int32), jnp.take_along_axis(top >= 0, order, 1)


def _target_hidden(target, tokens: jax.Array, layers: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """The frozen target's outputs of `layers` at every position of `tokens [B, T]` (-1 padded: the padding
    comes after a sequence's tokens, so it changes none of theirs), through the prefill every target kind
    has (a hybrid target's GDN layers by their chunked form)."""
    b, t = tokens.shape
    out = target.prefill(jnp.maximum(tokens, 0), target.init_cache(b, t), jnp.full((b,), t),
                         logits_rows=jnp.zeros((b, 1), jnp.int32), hidden_layers=layers)
    return jax.lax.stop_gradient(out.hidden)


def _block_labels(tokens, lengths, anchors, ok, size: int):
    """Labels `x_{a+1..a+size}` `[B, A, size]` and whether each exists."""
    idx = anchors[:, :, None] + 1 + jnp.arange(size)
    valid = ok[:, :, None] & (idx < lengths[:, None, None])
    labels = jnp.take_along_axis(tokens, jnp.minimum(idx, tokens.shape[1] - 1).reshape(tokens.shape[0], -1), axis=1)
    return jnp.maximum(labels.reshape(idx.shape), 0), valid


def _decay(size: int, gamma: float) -> jax.Array:
    return jnp.exp(-jnp.arange(size) / gamma)


def _teacher_log_probs(target, final_hidden, anchor_pos, size: int) -> jax.Array:
    """The target's log-distribution of x_{a+1..a+size} `[B, A, size, V]` (its logits at positions
    a..a+size-1), from its last layer's outputs `final_hidden [B, T, D]`."""
    b, a = anchor_pos.shape
    idx = jnp.minimum(anchor_pos[:, :, None] + jnp.arange(size), final_hidden.shape[1] - 1).reshape(b, -1)
    h = jnp.take_along_axis(final_hidden, idx[:, :, None], axis=1).reshape(b, a, size, -1)
    return jax.lax.stop_gradient(jax.nn.log_softmax(target.head(target.final_state(h)), -1))


def _kl(teacher_log_probs, logits) -> jax.Array:
    """KL(teacher || softmax(logits)) over the last axis."""
    return jnp.sum(jnp.exp(teacher_log_probs) * (teacher_log_probs - jax.nn.log_softmax(logits, -1)), -1)


def _weighted_mean(x, weights) -> jax.Array:
    return jnp.sum(x * weights) / jnp.maximum(jnp.sum(weights), 1e-6)


def _chain_tau(hit, ok) -> jax.Array:
    """Tokens per verification of a chain proposal, teacher-forced: at each anchor, the bonus token plus
    the leading block positions proposed right. hit `[B, A, K]`, ok `[B, A]`. On greedy data (the
    target's own argmax continuation) this is the chain's τ at temperature 0 averaged over positions
    (decoding averages over round starts instead)."""
    accepted = jnp.sum(jnp.cumprod(hit.astype(jnp.int32), -1), -1)
    return jnp.sum((1 + accepted) * ok) / jnp.maximum(jnp.sum(ok), 1)


def _drafter_blocks(target, drafter, batch, key, anchors: int):
    """Shared by both losses: -> (drafter states `[B, A, b-1, D]`, anchors, ok, labels, valid, hidden)."""
    tokens, prompt_lengths, lengths = batch["tokens"], batch["prompt_lengths"], batch["lengths"]
    layer_ids = tuple(drafter.config.target_layer_ids)
    final = target.config.num_layers - 1
    hidden = _target_hidden(target, tokens, layer_ids + (final,))
    anchor_pos, ok = sample_anchors(key, prompt_lengths, lengths, tokens.shape[1], anchors)
    features = drafter.context_features(hidden[: len(layer_ids)])
    states = drafter.train_states(target.embed[...], jnp.maximum(tokens, 0), features, anchor_pos)[:, :, 1:]
    labels, valid = _block_labels(tokens, lengths, anchor_pos, ok, drafter.config.block_size - 1)
    return states, anchor_pos, ok, labels, valid, hidden[-1]


def drafter_loss(drafter, target, batch: dict, key: jax.Array, *, anchors: int, gamma: float, distill: float = 0.0):
    """DESIGN 3.2's loss (module docstring: `distill`). batch: tokens `[B, T]` (-1 padded),
    prompt_lengths, lengths `[B]`. -> (loss, metrics: accuracy of the first block position, weighted
    accuracy; with distill: the KL and how often the target's argmax is the data's token)."""
    states, anchor_pos, ok, labels, valid, final_hidden = _drafter_blocks(target, drafter, batch, key, anchors)
    logits = target.head(states)  # [B, A, b-1, V] float32
    ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    weights = valid * _decay(labels.shape[-1], gamma)
    loss = _weighted_mean(ce, weights)
    hit = jnp.argmax(logits, -1) == labels
    metrics = {"acc_1": jnp.sum(hit[..., 0] & valid[..., 0]) / jnp.maximum(jnp.sum(valid[..., 0]), 1),
               "acc": jnp.sum(hit * valid) / jnp.maximum(jnp.sum(valid), 1),
               "tau_chain": _chain_tau(hit & valid, ok)}
    if distill:
        teacher = _teacher_log_probs(target, final_hidden, anchor_pos, labels.shape[-1])
        kl = _weighted_mean(_kl(teacher, logits), weights)
        loss = (1 - distill) * loss + distill * kl
        metrics.update(kl=kl, teacher_acc=jnp.sum((jnp.argmax(teacher, -1) == labels) & valid)
                       / jnp.maximum(jnp.sum(valid), 1))
    return loss, metrics


def adapter_loss(adapter, target, drafter, batch: dict, key: jax.Array, *, anchors: int, gamma: float,
                 pool_size: int, distill: float = 0.0):
    """DESIGN 3.3's loss, drafter frozen: along the true continuation of each anchor, the pool
    cross-entropy of `drafter_logits[pool] + residual` at every depth whose true token is in the
    pool (module docstring: `distill`, over every depth of the path). -> (loss, metrics: top-1
    accuracy in the pool with and without the residual; with distill: the KL)."""
    states, anchor_pos, ok, labels, valid, final_hidden = _drafter_blocks(target, drafter, batch, key, anchors)
    states = jax.lax.stop_gradient(states)
    k = min(adapter.config.K, states.shape[2])
    states, labels, valid = states[:, :, :k], labels[:, :, :k], valid[:, :, :k]
    b, a = anchor_pos.shape
    marginals = target.head(states)  # [B, A, K, V]
    pool_logits, pool_ids = chunked_top_k(marginals, pool_size)  # [B, A, K, P], as generate's pool
    root_hidden = jnp.take_along_axis(final_hidden, jnp.maximum(anchor_pos - 1, 0)[:, :, None], axis=1)
    root_state = target.final_state(root_hidden)  # [B, A, D]
    tokens = jnp.maximum(batch["tokens"], 0)
    path = jnp.concatenate([jnp.take_along_axis(tokens, anchor_pos, 1)[:, :, None], labels[:, :, : k - 1]], axis=2)
    tables = adapter.tables(target)
    r = b * a
    u = adapter.teacher_forced(tables, root_state.reshape(r, -1), states.reshape(r, k, -1), path.reshape(r, k))
    residual_all = jnp.einsum("rkd,vd->rkv", u, tables.candidate, preferred_element_type=jnp.float32)
    residual = jnp.take_along_axis(residual_all, pool_ids.reshape(r, k, -1), axis=2).reshape(pool_ids.shape)
    scores = pool_logits + residual
    match = pool_ids == labels[..., None]
    in_pool = jnp.any(match, -1) & valid
    target_idx = jnp.argmax(match, -1)
    pick = lambda x: jnp.take_along_axis(x, target_idx[..., None], -1)[..., 0]  # noqa: E731
    ce = jax.nn.logsumexp(scores, -1) - pick(scores)
    loss = _weighted_mean(ce, in_pool * _decay(k, gamma))
    count = jnp.maximum(jnp.sum(in_pool), 1)
    hit = (jnp.argmax(scores, -1) == target_idx) & in_pool
    drafter_hit = (target_idx == 0) & in_pool  # the pool is ranked by the drafter: its top-1 is index 0
    metrics = {"acc": jnp.sum(hit) / count, "acc_drafter": jnp.sum(drafter_hit) / count,
               "in_pool": jnp.sum(in_pool) / jnp.maximum(jnp.sum(valid), 1),
               "tau_chain": _chain_tau(hit, ok), "tau_chain_drafter": _chain_tau(drafter_hit, ok)}
    if distill:
        teacher = _teacher_log_probs(target, final_hidden, anchor_pos, k)  # [B, A, K, V]
        pool_teacher = jax.nn.log_softmax(jnp.take_along_axis(teacher, pool_ids, -1), -1)
        kl = _weighted_mean(_kl(pool_teacher, scores), valid * _decay(k, gamma))
        loss = (1 - distill) * loss + distill * kl
        metrics["kl"] = kl
    return loss, metrics


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _optimizer(config: TrainConfig, start_step: int = 0):
    """AdamW on the warmup-cosine schedule; from a warm start at `start_step` the fresh optimiser's
    count 0 is that step of the schedule, re-warmed over the warmup length (a fresh Adam's first
    updates are sign-like: full size for every parameter)."""
    warmup = max(1, int(config.warmup * config.steps))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, warmup, max(config.steps, 2), end_value=0.1 * config.learning_rate)
    if start_step:
        base = schedule
        schedule = lambda count: base(count + start_step) * jnp.minimum(1.0, (count + 1) / warmup)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(config.clip),
                       optax.adamw(schedule, weight_decay=config.weight_decay))


@functools.lru_cache(maxsize=8)
def _train_step(graphdef, frozen_graphdefs: tuple, loss_fn: Callable, config: TrainConfig, start_step: int):
    """The jitted step of `fit`, shared by fits of the same module, loss and schedule (a resumed or
    repeated run compiles once)."""
    optimizer = _optimizer(config, start_step)

    def loss(params, frozen, batch, key):
        frozen_modules = (nnx.merge(g, f) for g, f in zip(frozen_graphdefs, frozen, strict=True))
        return loss_fn(nnx.merge(graphdef, params), *frozen_modules, batch, key)

    @jax.jit
    def train_step(state, frozen, batch, step):
        key = jax.random.fold_in(jax.random.key(config.seed), step)
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(state["params"], frozen, batch, key)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return ({"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state},
                {"loss": value, "grad_norm": _global_norm(grads), **metrics})

    @jax.jit
    def eval_step(params, frozen, batch, index):  # the same anchors at every evaluation
        value, metrics = loss(params, frozen, batch, jax.random.fold_in(jax.random.key(config.seed + 1), index))
        return {"loss": value, **metrics}

    return train_step, eval_step


def batch_indices(n: int, step: int, batch_size: int, seed: int) -> np.ndarray:
    """The sequences of step `step`: epochs are fresh permutations of `range(n)` from `seed`."""
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        out.extend(perm[offset : offset + batch_size - len(out)].tolist())
    return np.asarray(out)


def fit(module: nnx.Module, loss_fn: Callable, data: dict, config: TrainConfig, checkpoint_dir: str | Path, *,
        max_seconds: float | None = None, desc: str = "train", frozen: tuple = (),
        start_step: int = 0, eval_data: dict | None = None, mesh=None) -> tuple[nnx.Module, dict]:
    """Train `module` (its nnx.Param leaves) to minimise `loss_fn(module, *frozen, batch, key)`
    -> (loss, metrics). Resumes from the latest checkpoint in `checkpoint_dir`; when there is none
    and `start_step` > 0, warm-starts: training begins at that step from `module`'s parameters with a
    fresh optimiser (`_optimizer`), recorded in `checkpoint_dir/warm_start.json` so that resuming the
    run rebuilds the same schedule. With `eval_data` (held-out sequences, same form as `data`), every
    checkpoint also logs the loss's metrics on all of them as `eval_*` (fixed anchors: a curve).
    data: arrays with a leading sequence axis (`_train_data.load_dataset`). mesh: a `jax.sharding.Mesh` with axes
    ("data", "model"): data parallel, each batch split over `data` (XLA sums the gradients), the trained module
    whole on every device (so its checkpoints do not depend on the mesh, and a run resumes on any other), the
    frozen modules (the target) split over `model` where they divide (`weaver_jax.shard`'s rules). Returns the
    module and {"step", "finished", "last": the last logged metrics, "eval": the last evaluation (with
    eval_data)}."""
    import orbax.checkpoint as ocp

    if not 0 <= start_step < config.steps:
        raise ValueError(f"a warm start at step {start_step}: the run has {config.steps} steps")
    checkpoint_dir = Path(checkpoint_dir).absolute()
    manager = ocp.CheckpointManager(checkpoint_dir, options=ocp.CheckpointManagerOptions(
        max_to_keep=2, keep_period=config.keep_every or None, create=True))
    warm_start = checkpoint_dir / "warm_start.json"
    resumed = manager.latest_step()
    if resumed:  # the schedule's offset is the run's own, whatever start_step says now
        offset = json.loads(warm_start.read_text())["start_step"] if warm_start.exists() else 0
        if start_step:
            print(f"{desc}: resuming {checkpoint_dir} at its step {resumed}; the warm start applies to a new run "
                  "only", file=sys.stderr)
    else:
        offset = start_step
        warm_start.unlink(missing_ok=True)
        if start_step:
            warm_start.write_text(json.dumps({"start_step": start_step}))
    start = resumed or start_step
    placed = lambda x: x  # noqa: E731
    if mesh is not None:
        from weaver_jax._sharding import auto_mesh, batch_sharding, shard_module

        mesh = auto_mesh(mesh)
        if config.batch_size % mesh.shape["data"]:
            raise ValueError(f"batch size {config.batch_size} does not divide over the mesh's 'data' axis of "
                             f"{mesh.shape['data']} devices")
        module = shard_module(module, mesh, replicate=True)
        frozen = tuple(shard_module(m, mesh, label="frozen") for m in frozen)
        placed = lambda x: jax.device_put(x, batch_sharding(mesh, x.ndim))  # noqa: E731
    graphdef, params = nnx.split(module, nnx.Param)
    state = {"params": params, "opt_state": _optimizer(config, offset).init(params)}
    if mesh is not None:  # the trained state whole on every device (the optimiser's step count too): the restore
        # below reads a checkpoint onto these shardings, whatever mesh wrote it
        state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    if resumed:
        state = manager.restore(resumed, args=ocp.args.StandardRestore(state))
    log_path = checkpoint_dir / "log.jsonl"
    kept = [line for line in (log_path.read_text().splitlines() if log_path.exists() else [])
            if json.loads(line)["step"] <= start]
    log_path.write_text("".join(line + "\n" for line in kept))
    n = len(data["lengths"])

    frozen_graphdefs = tuple(nnx.graphdef(m) for m in frozen)
    frozen = tuple(nnx.state(m) for m in frozen)
    train_step, eval_step = _train_step(graphdef, frozen_graphdefs, loss_fn, config, offset)
    keys = ("tokens", "prompt_lengths", "lengths")
    if eval_data is not None:  # whole batches: the last one wraps around to the first sequences
        count = len(eval_data["lengths"])
        wrap = np.arange(-(-count // config.batch_size) * config.batch_size) % count
        eval_batches = [{k: placed(jnp.asarray(eval_data[k][wrap[i : i + config.batch_size]])) for k in keys}
                        for i in range(0, len(wrap), config.batch_size)]

    def evaluate(params) -> dict:
        metrics = [eval_step(params, frozen, b, jnp.int32(i)) for i, b in enumerate(eval_batches)]
        return {f"eval_{k}": float(np.mean([m[k] for m in metrics])) for k in metrics[0]}

    began, last, last_eval, step = time.monotonic(), {}, {}, start
    with tqdm(total=config.steps, initial=start, desc=desc) as bar, open(log_path, "a") as log:
        while step < config.steps:
            idx = batch_indices(n, step, config.batch_size, config.seed)
            batch = {k: placed(jnp.asarray(data[k][idx])) for k in keys}
            state, metrics = train_step(state, frozen, batch, jnp.int32(step))
            step += 1
            bar.update(1)
            record = {}
            if step % config.log_every == 0 or step == config.steps:
                record = last = {"step": step, **{k: float(v) for k, v in metrics.items()}}
                if not np.isfinite(last["loss"]):
                    raise FloatingPointError(f"{desc}: loss is {last['loss']} at step {step}; checkpoint kept at "
                                             f"step {manager.latest_step()}")
                bar.set_postfix(loss=f"{last['loss']:.3f}")
            out_of_time = max_seconds is not None and time.monotonic() - began > max_seconds
            kept = config.keep_every and step % config.keep_every == 0
            if step % config.save_every == 0 or kept or step == config.steps or out_of_time:
                manager.save(step, args=ocp.args.StandardSave(state))
                if eval_data is not None:
                    last_eval = evaluate(state["params"])
                    record = {"step": step, **record, **last_eval}
            if record:
                log.write(json.dumps({**record, "seconds": time.monotonic() - began}) + "\n")
                log.flush()
            if out_of_time:
                break
    manager.wait_until_finished()
    manager.close()
    info = {"step": step, "finished": step >= config.steps, "last": last}
    return nnx.merge(graphdef, state["params"]), {**info, "eval": last_eval} if last_eval else info


def restore(module: nnx.Module, checkpoint_dir: str | Path, step: int | None = None) -> nnx.Module:
    """`module` (the run's architecture) with the parameters `fit` saved at `step` (None: the latest)."""
    import orbax.checkpoint as ocp

    graphdef, params = nnx.split(module, nnx.Param)
    state = {"params": params, "opt_state": _optimizer(TrainConfig()).init(params)}  # the structure fit saves
    manager = ocp.CheckpointManager(Path(checkpoint_dir).absolute())
    try:
        steps = sorted(manager.all_steps())
        step = steps[-1] if step is None and steps else step
        if step not in steps:
            raise ValueError(f"{checkpoint_dir}: no checkpoint at step {step}; it holds steps {steps} "
                             "(train with --keep-every to keep more)")
        state = manager.restore(step, args=ocp.args.StandardRestore(state))
    finally:
        manager.close()
    return nnx.merge(graphdef, state["params"])


def read_log(checkpoint_dir: str | Path) -> list[dict]:
    """The JSON-lines log of a run directory (or the log file itself)."""
    path = Path(checkpoint_dir)
    path = path / "log.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plot_log(checkpoint_dir: str | Path, out: str | Path, keys: tuple[str, ...] | None = None) -> Path:
    """Curves of a training run (directory or log file) as a PNG (needs matplotlib): `keys`, by
    default every metric in the log (`eval_*` ones at the steps they were measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_log(checkpoint_dir)
    if keys is None:
        keys = tuple(k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("step", "seconds"))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        ax.plot([r["step"] for r in rows if key in r], [r[key] for r in rows if key in r])
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    fig.suptitle(Path(checkpoint_dir).stem)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)
