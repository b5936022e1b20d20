"""Training: the batched training forwards equal the inference paths they train, anchors stay in
the response, the losses go down, and an interrupted run resumes to the same parameters."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from weaver_jax import testing, training
from weaver_jax._adapter import Adapter, random_adapter_config
from weaver_jax._model import KVCache
from weaver_jax._train import (
    TrainConfig,
    _chain_tau,
    _optimizer,
    adapter_loss,
    batch_indices,
    drafter_loss,
    fit,
    read_log,
    sample_anchors,
)


def _bundle(seed=0, block_size=6):
    return testing.random_bundle(seed, vocab_size=96, block_size=block_size, tie_embeddings=bool(seed % 2))


def test_drafter_train_states_equal_propose():
    """One batched pass over many anchors == committing the context, then `propose`, per anchor."""
    bundle = _bundle()
    target, drafter = bundle.target, bundle.drafter
    t = 24
    tokens = jax.random.randint(jax.random.key(1), (2, t), 0, 96)
    layers = tuple(drafter.config.target_layer_ids)
    out = target(tokens, jnp.broadcast_to(jnp.arange(t), (2, t)), KVCache.init(target.config, 2, t),
                 hidden_layers=layers)
    anchors = jnp.array([[3, 10, 17], [1, 9, 12]])
    states = drafter.train_states(target.embed[...], tokens, drafter.context_features(out.hidden), anchors)
    trained = target.head(states[:, :, 1:])

    @jax.jit  # one program for every anchor: the whole row is committed, its first `a` tokens real
    def propose_at(row, a):
        cache = drafter.commit(drafter.init_cache(1, 64), tuple(h[row][None] for h in out.hidden),
                               jnp.arange(t)[None], a[None])
        return drafter.propose(target, None, tokens[row, a][None], cache)[0][0]

    for row in range(2):
        for j in range(3):
            np.testing.assert_allclose(trained[row, j], propose_at(row, anchors[row, j]), atol=2e-4, rtol=2e-4)


def test_adapter_teacher_forced_equals_node_steps():
    """The one-pass teacher-forced states == the prefix + one node step per depth along the path."""
    bundle = _bundle(1)
    target = bundle.target
    k = 5
    adapter = Adapter(random_adapter_config(target.config, depth=k), rngs=nnx.Rngs(3))
    keys = jax.random.split(jax.random.key(2), 3)
    root_state = jax.random.normal(keys[0], (2, target.config.hidden_size))
    states = jax.random.normal(keys[1], (2, k, target.config.hidden_size))
    path = jax.random.randint(keys[2], (2, k), 0, 96)
    tables = adapter.tables(target)
    forced = adapter.teacher_forced(tables, root_state, states, path)
    cache = adapter.prefix(root_state, states, KVCache.init(adapter.config.block_config, 2, 2 * k + 1))
    for t in range(k):
        visible = jnp.broadcast_to(jnp.arange(2 * k + 1) < k + 2 + t, (2, 1, 2 * k + 1))
        u, cache = adapter.node_states(tables, cache, path[:, t : t + 1], jnp.full((2, 1), t),
                                       jnp.full((2,), k + 1 + t), visible)
        np.testing.assert_allclose(forced[:, t], u[:, 0], atol=2e-5, rtol=2e-5)


def test_sample_anchors_stay_in_the_response():
    prompt_lengths, lengths = jnp.array([3, 5, 2, 7]), jnp.array([20, 8, 40, 9])
    for seed in range(5):
        anchors, ok = sample_anchors(jax.random.key(seed), prompt_lengths, lengths, 40, 6)
        anchors, ok = np.asarray(anchors), np.asarray(ok)
        for row in range(4):
            real = anchors[row][ok[row]]
            assert len(set(real.tolist())) == len(real) == min(6, int(lengths[row] - 1 - prompt_lengths[row]))
            assert (real >= prompt_lengths[row]).all() and (real <= lengths[row] - 2).all()


def test_batch_indices_are_epochs_of_permutations():
    seen = np.concatenate([batch_indices(10, s, 4, seed=3) for s in range(5)])  # 2 full epochs
    assert sorted(seen[:10].tolist()) == list(range(10)) and sorted(seen[10:20].tolist()) == list(range(10))
    assert (batch_indices(10, 2, 4, seed=3) == seen[8:12]).all()


def _data(bundle, n=12, t=40, seed=0):
    """The target's own greedy continuations of random prompts (self-distillation in miniature)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 96, int(rng.integers(3, 8))).tolist() for _ in range(n)]
    from weaver_jax import generate

    out = generate(bundle, prompts, max_new_tokens=t - 8, eos_token_id=[])
    tokens = np.full((n, t), -1, np.int32)
    for i, (p, r) in enumerate(zip(prompts, out.tokens, strict=True)):
        tokens[i, : len(p) + len(r)] = p + r
    return dict(tokens=tokens, prompt_lengths=np.array([len(p) for p in prompts], np.int32),
                lengths=np.array([len(p) + len(r) for p, r in zip(prompts, out.tokens, strict=True)], np.int32))


@pytest.fixture(scope="module")
def trained_setup():
    bundle = _bundle(2)
    return bundle, _data(bundle)


def test_drafter_training_lowers_the_loss_and_resumes_exactly(trained_setup, tmp_path):
    """Half hard labels, half KL from the target (`distill`): both the loss and its KL part fall."""
    bundle, data = trained_setup
    config = TrainConfig(steps=30, batch_size=4, anchors=6, learning_rate=3e-3, save_every=10, log_every=1,
                         distill=0.5)
    loss_fn = training.drafter_loss_fn(config)
    fresh = lambda: jax.tree.map(jnp.copy, bundle.drafter)  # noqa: E731
    held_out = {k: v[:5] for k, v in data.items()}  # evaluated at every checkpoint (5 rows: one wrapped batch)
    whole, info = fit(fresh(), loss_fn, data, config, tmp_path / "a", frozen=(bundle.target,), eval_data=held_out)
    assert info["finished"] and info["step"] == 30
    log = read_log(tmp_path / "a")
    for key in ("loss", "kl"):
        assert np.mean([r[key] for r in log[-5:]]) < 0.8 * np.mean([r[key] for r in log[:5]]), key
    evals = [r for r in log if "eval_tau_chain" in r]
    assert [r["step"] for r in evals] == [10, 20, 30] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert 1 <= evals[0]["eval_tau_chain"] < evals[-1]["eval_tau_chain"] and info["eval"] == {
        k: v for k, v in evals[-1].items() if k.startswith("eval_")}
    # Interrupted by its time budget after one step, then resumed: same parameters.
    short = dataclasses.replace(config, steps=30)
    part, info = fit(fresh(), loss_fn, data, short, tmp_path / "b", max_seconds=0.0, frozen=(bundle.target,))
    assert not info["finished"] and info["step"] == 1
    resumed, info = fit(fresh(), loss_fn, data, short, tmp_path / "b", frozen=(bundle.target,))
    assert info["finished"]
    for a, b in zip(jax.tree.leaves(nnx.state(whole)), jax.tree.leaves(nnx.state(resumed)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert [r["step"] for r in read_log(tmp_path / "b")] == list(range(1, 31))
    # A warm start from the parameters at step 20 (no optimiser state): its first step scores the loss
    # run "a" had there, interrupted and resumed it equals an uninterrupted warm start (the schedule's
    # offset is kept in the run), and it goes on learning.
    at_20 = lambda: training.restore(fresh(), tmp_path / "a", 20)  # noqa: E731
    _, info = fit(at_20(), loss_fn, data, config, tmp_path / "c", max_seconds=0.0, frozen=(bundle.target,),
                  start_step=20)
    assert info["step"] == 21 and not info["finished"]
    assert read_log(tmp_path / "c")[0]["loss"] == pytest.approx(log[20]["loss"], rel=1e-6)
    resumed, info = fit(fresh(), loss_fn, data, config, tmp_path / "c", frozen=(bundle.target,))
    assert info["finished"] and [r["step"] for r in read_log(tmp_path / "c")] == list(range(21, 31))
    whole, _ = fit(at_20(), loss_fn, data, config, tmp_path / "d", frozen=(bundle.target,), start_step=20)
    exported = training.restore(fresh(), tmp_path / "c")  # train-export reads a warm-started run alike
    for a, b, c in zip(*(jax.tree.leaves(nnx.state(m)) for m in (whole, resumed, exported)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(b, c)
    assert np.mean([r["loss"] for r in read_log(tmp_path / "c")[-5:]]) < 0.8 * np.mean([r["loss"] for r in log[:5]])
    with pytest.raises(ValueError, match="a warm start at step 30: the run has 30 steps"):
        fit(fresh(), loss_fn, data, config, tmp_path / "e", start_step=30)


def test_chain_tau_counts_leading_hits_plus_the_bonus():
    hit = jnp.array([[[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]]], bool)
    assert float(_chain_tau(hit, jnp.array([[True, True, False]]))) == (3 + 1) / 2
    assert float(_chain_tau(hit, jnp.array([[False, False, True]]))) == 5


def test_warm_start_schedule():
    """A fresh optimiser at a warm start's step S applies the schedule's rate at S + k, re-warmed
    linearly over the warmup length: with a constant gradient from zero, Adam's bias-corrected step is
    the learning rate itself (up to epsilon and the tiny weight decay)."""
    config = TrainConfig(steps=100, learning_rate=1e-2)  # warmup 4 steps, cosine to 1e-3 at step 100

    def rate(step):  # warmup-cosine, written out
        if step < 4:
            return 1e-2 * step / 4
        return 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + np.cos(np.pi * (step - 4) / 96))

    for start, expected in ((0, [rate(k) for k in range(8)]),
                            (50, [rate(50 + k) * min(1.0, (k + 1) / 4) for k in range(8)])):
        optimizer = _optimizer(config, start)
        params = {"w": jnp.zeros(())}
        state, steps = optimizer.init(params), []
        for _ in range(8):
            updates, state = optimizer.update({"w": jnp.float32(0.5)}, state, params)
            params = optax.apply_updates(params, updates)
            steps.append(-float(updates["w"]))
        np.testing.assert_allclose(steps, expected, rtol=2e-3)


def test_adapter_training_beats_the_drafter_alone(trained_setup, tmp_path):
    """With the drafter frozen (random here), the adapter learns to re-rank the pool: its top-1
    accuracy in the pool, and the chain of its top-1 choices, end above the drafter's own."""
    bundle, data = trained_setup
    k = bundle.drafter.config.block_size - 1
    adapter = Adapter(random_adapter_config(bundle.config, depth=k, pool=32), rngs=nnx.Rngs(5))
    config = TrainConfig(steps=40, batch_size=4, anchors=6, learning_rate=3e-3, save_every=40, log_every=1)

    _, info = fit(adapter, training.adapter_loss_fn(config, 32), data, config, tmp_path,
                  frozen=(bundle.target, bundle.drafter))
    log = read_log(tmp_path)
    assert np.mean([r["loss"] for r in log[-5:]]) < 0.8 * np.mean([r["loss"] for r in log[:5]])
    assert np.mean([r["acc"] - r["acc_drafter"] for r in log[-5:]]) > 0.1
    assert np.mean([r["tau_chain"] - r["tau_chain_drafter"] for r in log[-5:]]) > 0  # its top-1 path runs longer


def test_distillation_reads_the_targets_next_token_distribution(trained_setup):
    """On the target's own greedy data the teacher's argmax is the data's token at every scored
    position (the KL is aligned with the labels); the mixed loss is (1 - d) hard + d KL, KL > 0, for
    the drafter and the adapter (training on it: the drafter test above); a weight outside [0, 1] is
    refused."""
    bundle, data = trained_setup
    batch, key = {k: jnp.asarray(v[:4]) for k, v in data.items()}, jax.random.key(0)
    k = bundle.drafter.config.block_size - 1
    adapter = Adapter(random_adapter_config(bundle.config, depth=k, pool=32), rngs=nnx.Rngs(5))
    losses = {"drafter": lambda d: drafter_loss(bundle.drafter, bundle.target, batch, key, anchors=6, gamma=7.0,
                                                distill=d),
              "adapter": lambda d: adapter_loss(adapter, bundle.target, bundle.drafter, batch, key, anchors=6,
                                                gamma=7.0, pool_size=32, distill=d)}
    for name, loss in losses.items():
        hard, _ = loss(0.0)
        mixed, metrics = loss(0.25)
        assert metrics["kl"] > 0, name
        np.testing.assert_allclose(mixed, 0.75 * hard + 0.25 * metrics["kl"], rtol=1e-5, err_msg=name)
        if name == "drafter":
            assert metrics["teacher_acc"] == 1.0
    with pytest.raises(ValueError, match="distill"):
        TrainConfig(distill=1.5)


def test_losses_on_a_hybrid_target():
    """A Gated DeltaNet hybrid target trains drafters and adapters too: its hidden states come from its own
    prefill, so on its greedy data the teacher's argmax is the data's token everywhere, and both losses
    (hard labels and KL) are finite."""
    rb = testing.random_bundle(4, family="qwen3_5", vocab_size=96, block_size=5)
    data = _data(rb, n=3, t=24)
    batch, key = {k: jnp.asarray(v) for k, v in data.items()}, jax.random.key(0)
    # jitted, as training runs them: one compile each instead of one per eager op
    static = ("anchors", "gamma", "distill")
    loss, metrics = nnx.jit(drafter_loss, static_argnames=static)(rb.drafter, rb.target, batch, key, anchors=4,
                                                                  gamma=7.0, distill=0.5)
    assert np.isfinite(loss) and metrics["teacher_acc"] == 1.0
    loss, metrics = nnx.jit(adapter_loss, static_argnames=(*static, "pool_size"))(
        rb.adapter, rb.target, rb.drafter, batch, key, anchors=4, gamma=7.0, pool_size=16, distill=0.5)
    assert np.isfinite(loss) and metrics["kl"] > 0


def test_cli_trains_exports_and_resumes(trained_setup, tmp_path, capsys):
    """train-drafter and train-adapter from the command line on a saved target and a data
    directory; the exports load as a bundle whose Weaver generation equals plain decoding; a kept
    earlier step exports (train-export) as the parameters saved then; a rerun with another module
    shape is refused by name."""
    from weaver_jax import cli, load
    from weaver_jax.convert import checkpoint

    bundle, data = trained_setup
    target_dir = checkpoint.save(tmp_path / "target", bundle.target)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    np.savez(data_dir / "part-00000.npz", **data, source=np.zeros(len(data["lengths"]), np.int8))
    (data_dir / "manifest.json").write_text('{"parts": 1}')
    common = ["--model", str(target_dir), "--steps", "4", "--batch-size", "2", "--anchors", "3",
              "--export-dtype", "float32"]
    assert cli.main(["train-drafter", str(data_dir), str(tmp_path / "d_run"), *common, "--layers", "1",
                     "--block-size", "5", "--num-features", "2", "--save-every", "100", "--keep-every", "2",
                     "--export", str(tmp_path / "drafter")]) == 0
    assert cli.main(["train-adapter", str(data_dir), str(tmp_path / "a_run"), *common, "--drafter",
                     str(tmp_path / "drafter"), "--max-sequences", "8", "--d-rank", "32", "--heads", "2",
                     "--mlp-dim", "64", "--pool-size", "16", "--export", str(tmp_path / "adapter")]) == 0
    trained = load(target_dir, drafter=tmp_path / "drafter", adapter=tmp_path / "adapter")
    assert trained.drafter.config.block_size == 5 and trained.adapter.config.candidate_pool_size == 16
    prompts = [data["tokens"][i, :5].tolist() for i in range(3)]
    plain = _greedy(trained, prompts)
    assert _greedy(trained, prompts, method="weaver", budget=8) == plain
    assert (tmp_path / "d_run" / "4").exists() and len(read_log(tmp_path / "d_run")) == 1
    # --keep-every kept step 2 beside the last; train-export writes it, and only kept steps
    assert cli.main(["train-export", "drafter", str(tmp_path / "d_run"), str(tmp_path / "drafter_2"), "--step", "2",
                     "--export-dtype", "float32"]) == 0
    early = load(target_dir, drafter=tmp_path / "drafter_2").drafter
    restored = training.restore(jax.tree.map(jnp.copy, trained.drafter), tmp_path / "d_run", 2)
    for a, b in zip(jax.tree.leaves(nnx.state(early)), jax.tree.leaves(nnx.state(restored)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nnx.state(early)),
                                                        jax.tree.leaves(nnx.state(trained.drafter)), strict=True))
    capsys.readouterr()
    assert cli.main(["train-export", "drafter", str(tmp_path / "d_run"), str(tmp_path / "drafter_1"), "--step",
                     "1"]) == 2
    assert "no checkpoint at step 1; it holds steps [2, 4]" in capsys.readouterr().err
    assert cli.main(["train-export", "adapter", str(tmp_path / "d_run"), str(tmp_path / "adapter_2")]) == 2
    assert "holds no adapter training run" in capsys.readouterr().err
    drafter_flags = ["--block-size", "5", "--num-features", "2"]
    assert cli.main(["train-drafter", str(data_dir), str(tmp_path / "d_run"), *common, "--layers", "2",
                     *drafter_flags]) == 2
    assert "differs in ['num_layers']" in capsys.readouterr().err
    # A warm start from the step-2 export (parameters only) continues at step 3 with a fresh optimiser
    assert cli.main(["train-drafter", str(data_dir), str(tmp_path / "warm"), *common, "--layers", "1", *drafter_flags,
                     "--init", str(tmp_path / "drafter_2"), "--init-step", "2"]) == 0
    assert (tmp_path / "warm" / "4").exists() and not (tmp_path / "warm" / "2").exists()
    assert json.loads((tmp_path / "warm" / "warm_start.json").read_text()) == {"start_step": 2}
    capsys.readouterr()
    for flags, error in ((["--layers", "2", "--init", str(tmp_path / "drafter_2")], "differs from the run's in "
                                                                                    "['num_layers']"),
                         (["--layers", "1", "--init", str(tmp_path / "adapter")], "of kind 'adapter', not 'drafter'"),
                         (["--layers", "1", "--init-step", "2"], "--init-step needs --init"),
                         (["--layers", "1", "--export", str(tmp_path / "drafter")], "drafter already exists")):
        assert cli.main(["train-drafter", str(data_dir), str(tmp_path / "refused"), *common, *drafter_flags,
                         *flags]) == 2
        assert error in capsys.readouterr().err
        assert not (tmp_path / "refused" / "module.json").exists()  # a refused run leaves nothing to block a fix


def _greedy(bundle, prompts, **kwargs):
    from weaver_jax import generate

    return generate(bundle, prompts, max_new_tokens=12, eos_token_id=[], **kwargs).tokens
