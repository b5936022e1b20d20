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

from .test_pallas_row_invariant import random_tree

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
    out, final = gated_delta_chunked(q, k, v, g, beta, state, chunk=8)  # 5 chunks, the last padded
    s = jnp.asarray(state)
    steps = []
    for t in range(37):
        o, s = gated_delta_step(*(x[:, t:t + 1] for x in (q, k, v, g, beta)), s)
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
    paths = random_tree(rng, nodes)
    ancestors = np.zeros((1, nodes, nodes), bool)
    for i, p in enumerate(paths):
        ancestors[0, i, p] = True
    depth = np.array([[len(p) - 1 for p in paths]])
    q, k, v, g, beta, state = random_inputs(rng, 1, nodes)
    x = np.float32(rng.standard_normal((1, nodes, CHANNELS)))
    conv_state = np.float32(rng.standard_normal((1, CHANNELS, WIDTH - 1)))
    weight = np.float32(rng.standard_normal((CHANNELS, WIDTH)))

    out, terms = _tree(q, k, v, g, beta, state, ancestors)
    path_table = position_path(jnp.asarray(depth), jnp.zeros((1,), jnp.int32), jnp.asarray(ancestors))
    conv = conv_tree(jnp.asarray(x), jnp.asarray(conv_state), jnp.asarray(weight), path_table, jnp.asarray(depth))
    for i, p in enumerate(paths):
        ref_out, ref_state = rule_reference(q[0, p], k[0, p], v[0, p], g[0, p], beta[0, p], state[0])
        np.testing.assert_allclose(out[0, i], ref_out[-1], rtol=1e-4, atol=1e-4, err_msg=f"seed {seed}, node {i}")
        np.testing.assert_allclose(conv[0, i], conv_reference(x[0, p], conv_state[0], weight), rtol=1e-5,
                                   atol=1e-5, err_msg=f"seed {seed}, node {i}")
    accepted = paths[int(rng.integers(0, nodes))]  # fold one path: the state of decoding it
    on = np.zeros((1, nodes), bool)
    on[0, accepted] = True
    np.testing.assert_allclose(fold(jnp.asarray(state), terms, jnp.asarray(on))[0], rule_reference(
        q[0, accepted], k[0, accepted], v[0, accepted], g[0, accepted], beta[0, accepted], state[0])[1],
        rtol=1e-4, atol=1e-4, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(fold(jnp.asarray(state), terms, jnp.zeros((1, nodes), bool)), state)
    padded = np.zeros((1, nodes), np.int32)
    padded[0, : len(accepted)] = accepted
    folded = fold_conv(jnp.asarray(conv_state), jnp.asarray(x), jnp.asarray(padded), jnp.asarray([len(accepted)]))
    expected = np.concatenate([conv_state[0], x[0, accepted].T], 1)[:, -(WIDTH - 1):]
    np.testing.assert_array_equal(folded[0], expected)


_tree = jax.jit(gated_delta_tree)
