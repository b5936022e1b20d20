"""The Gated DeltaNet recurrence (`weaver_jax._gdn`) against an independent float64 NumPy recurrence:
the decode step and the chunked prefill (several chunks, a padded tail) equal it; every node of a
random tree verified in one pass equals running it along the node's own path, conv windows included
(a property test); folding the accepted path gives the state and conv state of decoding that path."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from weaver_jax._gdn import conv_tree, fold, fold_conv, gated_delta_chunked, gated_delta_step, gated_delta_tree
from weaver_jax._model import position_path

from .test_pallas_row_invariant import random_paths

H_K, H_V, D_K, D_V, WIDTH, CHANNELS = 2, 4, 8, 6, 4, 5


def rule_reference(q, k, v, g, beta, state):
    """float64 NumPy, token by token: q, k [T, H_k, d_k], v [T, H_v, d_v], g, beta [T, H_v], state
    [H_v, d_k, d_v] -> (outputs [T, H_v, d_v], final state)."""
    s = np.array(state, np.float64)
    out = np.zeros((len(q), H_V, D_V))
    for t in range(len(q)):
        for h in range(H_V):
            kh, qh = np.float64(k[t, h // (H_V // H_K)]), np.float64(q[t, h // (H_V // H_K)])
            s[h] *= np.exp(g[t, h])
            s[h] += np.outer(kh, beta[t, h] * (v[t, h] - kh @ s[h]))
            out[t, h] = qh @ s[h]
    return out, s


def conv_reference(inputs, state, weight):
    """float64: the conv (then SiLU) of the last input of `inputs [n, C]` after `state [C, W - 1]`."""
    window = np.concatenate([np.asarray(state, np.float64).T, inputs], 0)[-WIDTH:]  # [W, C]
    z = (window * np.asarray(weight, np.float64).T).sum(0)
    return z / (1 + np.exp(-z))


def random_inputs(rng, b, t):
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(rng.standard_normal((b, t, H_K, D_K))) / np.sqrt(D_K)
    k = unit(rng.standard_normal((b, t, H_K, D_K)))
    v = rng.standard_normal((b, t, H_V, D_V))
    g = -np.log1p(np.exp(rng.standard_normal((b, t, H_V))))  # -softplus: a decay in (0, 1)
    beta = 1 / (1 + np.exp(-rng.standard_normal((b, t, H_V))))
    state = 0.5 * rng.standard_normal((b, H_V, D_K, D_V))
    return [np.float32(x) for x in (q, k, v, g, beta, state)]


def test_step_and_chunked_prefill_equal_the_recurrence():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, state = random_inputs(rng, 2, 37)
    # 5 chunks, the last padded; jitted here and below: one compile each instead of one per eager op
    out, final = jax.jit(gated_delta_chunked, static_argnames="chunk")(q, k, v, g, beta, state, chunk=8)
    s = jnp.asarray(state)
    steps = []
    step = jax.jit(gated_delta_step)
    for t in range(37):
        o, s = step(*(x[:, t:t + 1] for x in (q, k, v, g, beta)), s)
        steps.append(o)
    for r in range(2):
        ref_out, ref_state = rule_reference(q[r], k[r], v[r], g[r], beta[r], state[r])
        np.testing.assert_allclose(out[r], ref_out, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(final[r], ref_state, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(jnp.concatenate(steps, 1)[r], ref_out, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(s[r], ref_state, rtol=1e-4, atol=1e-4)


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 12))
def test_tree_nodes_equal_their_paths_and_folding_equals_decoding(seed, nodes):
    rng = np.random.default_rng(seed)
    paths, ancestors = random_paths(rng, nodes)
    ancestors = ancestors[None]
    depth = np.array([[len(p) - 1 for p in paths]])
    q, k, v, g, beta, state = random_inputs(rng, 1, nodes)
    x = np.float32(rng.standard_normal((1, nodes, CHANNELS)))
    conv_state = np.float32(rng.standard_normal((1, CHANNELS, WIDTH - 1)))
    weight = np.float32(rng.standard_normal((CHANNELS, WIDTH)))

    accepted = paths[int(rng.integers(0, nodes))]  # fold one path: the state of decoding it
    on = np.zeros((1, nodes), bool)
    on[0, accepted] = True
    padded = np.zeros((1, nodes), np.int32)
    padded[0, : len(accepted)] = accepted
    out, conv, folded, unchanged, folded_conv = _tree_case(q, k, v, g, beta, state, ancestors, depth, x, conv_state,
                                                           weight, on, padded, np.array([len(accepted)]))
    for i, p in enumerate(paths):
        ref_out, ref_state = rule_reference(q[0, p], k[0, p], v[0, p], g[0, p], beta[0, p], state[0])
        np.testing.assert_allclose(out[0, i], ref_out[-1], rtol=1e-4, atol=1e-4, err_msg=f"seed {seed}, node {i}")
        np.testing.assert_allclose(conv[0, i], conv_reference(x[0, p], conv_state[0], weight), rtol=1e-5,
                                   atol=1e-5, err_msg=f"seed {seed}, node {i}")
    np.testing.assert_allclose(folded[0], rule_reference(
        q[0, accepted], k[0, accepted], v[0, accepted], g[0, accepted], beta[0, accepted], state[0])[1],
        rtol=1e-4, atol=1e-4, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(unchanged, state)
    expected = np.concatenate([conv_state[0], x[0, accepted].T], 1)[:, -(WIDTH - 1):]
    np.testing.assert_array_equal(folded_conv[0], expected)


@jax.jit
def _tree_case(q, k, v, g, beta, state, ancestors, depth, x, conv_state, weight, on, padded, length):
    """One example's every computation in one program (one compile per tree size, not one per eager op):
    the tree outputs, the conv of every node, the fold of the accepted path `on` and of no path, and the
    conv state after the accepted path's nodes `padded` (its first `length`)."""
    out, terms = gated_delta_tree(q, k, v, g, beta, state, ancestors)
    path_table = position_path(depth, jnp.zeros((1,), jnp.int32), ancestors)
    conv = conv_tree(x, conv_state, weight, path_table, depth)
    return (out, conv, fold(state, terms, on), fold(state, terms, jnp.zeros_like(on)),
            fold_conv(conv_state, x, padded, length))


def layer_reference(layer, x, recurrent, conv):
    """float64 NumPy, token by token, one sequence: the whole GDN layer. x [T, D], recurrent [H_v, d_k, d_v],
    conv [C, W - 1] -> (outputs [T, D], recurrent state, conv state)."""
    w = {name: np.asarray(getattr(layer, name)[...], np.float64) for name in
         ("in_qkv", "in_z", "in_b", "in_a", "conv", "A_log", "dt_bias", "norm", "out")}
    s, history = np.array(recurrent, np.float64), np.asarray(conv, np.float64).T  # history [W - 1, C]
    key = H_K * D_K
    ys = []
    for xt in np.asarray(x, np.float64):
        history = np.concatenate([history, (xt @ w["in_qkv"])[None]], 0)
        z = (history[-WIDTH:] * w["conv"].T).sum(0)
        mixed = z / (1 + np.exp(-z))
        q = mixed[:key].reshape(H_K, D_K)
        k = mixed[key:2 * key].reshape(H_K, D_K)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(D_K)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        v = mixed[2 * key:].reshape(H_V, D_V)
        beta = 1 / (1 + np.exp(-(xt @ w["in_b"])))
        g = -np.exp(w["A_log"]) * np.log1p(np.exp(xt @ w["in_a"] + w["dt_bias"]))
        o, s = rule_reference(q[None], k[None], v[None], g[None], beta[None], s)
        gate = (xt @ w["in_z"]).reshape(H_V, D_V)
        o = o[0] / np.sqrt((o[0] ** 2).mean(-1, keepdims=True) + 1e-6) * w["norm"] * gate / (1 + np.exp(-gate))
        ys.append(o.reshape(-1) @ w["out"])
    return np.stack(ys), s, history[-(WIDTH - 1):].T


def test_layer_prefill_tree_and_commit_equal_the_token_by_token_layer():
    from flax import nnx

    from weaver_jax._gdn import GatedDeltaNet, GDNState

    layer = GatedDeltaNet(16, H_K, H_V, D_K, D_V, WIDTH, 1e-6, jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    x = np.float32(rng.standard_normal((2, 13, 16)))
    state = GDNState(jnp.asarray(0.3 * rng.standard_normal((2, H_V, D_K, D_V)), jnp.float32),
                     jnp.asarray(rng.standard_normal((2, 2 * H_K * D_K + H_V * D_V, WIDTH - 1)), jnp.float32))
    lengths = np.array([13, 9])
    # jitted (one compile each, not one per eager op); layer_reference reads the same weights
    out, after = nnx.jit(lambda m, *a: m.prefill(*a, chunk=4))(layer, jnp.asarray(x), state, jnp.asarray(lengths))
    for r in range(2):
        ys, rec, conv = layer_reference(layer, x[r, : lengths[r]], state.recurrent[r], state.conv[r])
        np.testing.assert_allclose(out[r, : lengths[r]], ys, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(after.recurrent[r], rec, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(after.conv[r], conv, rtol=1e-6, atol=1e-6)

    paths, ancestors = random_paths(rng, 9)  # a tree after the prefilled state: each node as its path decoded
    ancestors = ancestors[None]
    depth = np.array([[len(p) - 1 for p in paths]])
    nodes = np.float32(rng.standard_normal((1, 9, 16)))
    committed = GDNState(after.recurrent[:1], after.conv[:1])
    out, pending = nnx.jit(lambda m, *a: m(*a))(layer, jnp.asarray(nodes), committed, jnp.asarray(depth),
                                                jnp.asarray(ancestors))
    for i, p in enumerate(paths):
        ys, _, _ = layer_reference(layer, nodes[0, p], committed.recurrent[0], committed.conv[0])
        np.testing.assert_allclose(out[0, i], ys[-1], rtol=2e-4, atol=2e-4, err_msg=f"node {i}")
    accepted = paths[int(np.argmax(depth[0]))]
    path_nodes = np.zeros((1, 9), np.int32)
    path_nodes[0, : len(accepted)] = accepted
    new = nnx.jit(lambda m, *a: m.commit(*a))(layer, committed, pending, jnp.asarray(path_nodes),
                                               jnp.asarray([len(accepted)]))
    _, rec, conv = layer_reference(layer, nodes[0, accepted], committed.recurrent[0], committed.conv[0])
    np.testing.assert_allclose(new.recurrent[0], rec, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(new.conv[0], conv, rtol=1e-6, atol=1e-6)
