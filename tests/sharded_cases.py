"""Sharded bundles on 8 fake CPU devices; run by test_sharding.py in its own process (the device count is fixed
when jax starts): `python -m tests.sharded_cases`. Each case asserts; the first failure ends the run non-zero."""

import os

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"])
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import weaver_jax  # noqa: E402
from weaver_jax import _generate, cli  # noqa: E402
from weaver_jax._model import module_params  # noqa: E402
from weaver_jax._sharding import check_rules  # noqa: E402
from weaver_jax._stream import Slots  # noqa: E402
from weaver_jax.testing import random_bundle  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # float32 products in full, as the suite's

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]  # ragged, and 3 rows: padded over `data`
BUNDLE = random_bundle(0, num_heads=8, num_kv_heads=4, intermediate_size=128, eos_token_ids=(5,))
HYBRID = random_bundle(2, family="qwen3_5", eos_token_ids=(5,))  # two GDN layers, one gated attention


def mesh(data: int, model: int):
    return jax.make_mesh((data, model), ("data", "model"), devices=jax.devices()[: data * model])


def tokens(bundle, method, **options):
    if method in ("ddtree", "weaver"):
        options.setdefault("budget", 8)
    return weaver_jax.generate(bundle, PROMPTS, method=method, max_new_tokens=10, **options).tokens


def check(condition, what):
    if not condition:
        raise AssertionError(what)
    print("ok", what, flush=True)


def greedy_equals_unsharded():
    """Every method's greedy tokens on each mesh are the unsharded bundle's (float32)."""
    # (1, 8) does not divide this target's 4 KV heads (layout_and_errors); weaver on (2, 2): sampled
    # (sampled_is_seed_identical), and on the hybrid target with the kernels (kernels_run_per_shard).
    # no_weight_is_gathered reads the (2, 2) programs.
    cases = {(1, 1): ["ar"], (2, 2): ["ar"], (2, 1): ["weaver"], (1, 2): ["dflash", "ddtree"], (2, 4): ["ar"]}
    reference = {m: tokens(BUNDLE, m) for m in ("ar", "dflash", "ddtree", "weaver")}
    for shape, methods in cases.items():
        # the drafter's 2 KV heads do not divide over 4 devices: replicated there, as a user would
        replicate = ("drafter", "adapter") if shape[1] > 2 else ("adapter",)
        sharded = weaver_jax.shard(BUNDLE, mesh(*shape), replicate=replicate)
        for m in methods:
            check(tokens(sharded, m) == reference[m], f"{m} greedy {shape}")


def streaming_and_serving_slots_run_sharded():
    """`stream` and the server's slots on a (2, 2) mesh: a stream's tokens are `generate`'s (unsharded), and
    sequences joining slots (a batch of one padded over `data`, rows 1 and 0 of two) emit theirs. (A stream of
    one is padded to two rows over `data`: the slots' programs.)"""
    sharded = weaver_jax.shard(BUNDLE, mesh(2, 2), replicate=("adapter",))
    want = tokens(BUNDLE, "dflash")  # the three prompts as one batch (compiled by greedy_equals_unsharded)
    stream = weaver_jax.stream(sharded, PROMPTS[0], method="dflash", max_new_tokens=10)
    check([t for chunk in stream for t in chunk.tokens] == want[0], "dflash stream (2, 2)")
    slots = Slots(sharded, 2, method="dflash", max_new_tokens=10, context=128, rounds_per_call=1)
    got = {"a": [], "b": []}
    slots.insert([1], ["a"], [PROMPTS[0]], [0], pad_to=32)
    for step in range(14):
        if step == 2:  # while "a" runs
            slots.insert([0], ["b"], [PROMPTS[1]], [0], pad_to=32)
        for name, new in slots.step():
            got[name] += new
    check([got["a"], got["b"]] == want[:2], "dflash slots (2, 2)")


def sharded_hybrid():
    return weaver_jax.shard(HYBRID, mesh(2, 2), replicate=("drafter", "adapter"))


def kernels_run_per_shard():
    """The Pallas kernels (interpret mode here) forced on, as a GPU runs them: each runs per device under
    `shard_map` on its sequences and heads, and the tokens are the unsharded XLA path's. On the hybrid Gated
    DeltaNet target: tree and adapter attention in its gated attention layer, the acceptance walk and K/V moves,
    the tree GDN (its GDN layers split by key / value heads, the recurrent and conv states with them); on the
    dense target: `ar`'s decode steps through attention_from_qkv (q / k norms, rotation and cache writes inside
    the kernel, each device reading its block of qkv's grouped columns). (Each interpret-mode program costs the
    suite ~15 s to compile: one method a target.)"""
    from weaver_jax.pallas_kernels import tree_attention as module
    from weaver_jax.pallas_kernels import use_kernels

    reference = tokens(HYBRID, "weaver")
    sharded = sharded_hybrid()
    check(sharded.target.layers[0].mixer.groups == 2, "GDN layers grouped per device")
    same = all(np.array_equal(a, module_params(HYBRID.target)[k]) for k, a in module_params(sharded.target).items())
    check(same, "module_params of a sharded hybrid target is the unsharded layout (conv rows too)")
    reference_ar = tokens(BUNDLE, "ar")  # compiled by greedy_equals_unsharded
    from_qkv, traced = module.tree_attention_from_qkv, []
    module.tree_attention_from_qkv = lambda *a, **k: traced.append(k["heads"]) or from_qkv(*a, **k)
    use_kernels(True)
    try:
        check(tokens(sharded, "weaver") == reference, "hybrid weaver with the kernels (2, 2)")
        # a dense target's decode steps through attention_from_qkv, each device its 4 of 8 query heads
        check(tokens(weaver_jax.shard(BUNDLE, mesh(2, 2)), "ar") == reference_ar and set(traced) == {4},
              "dense ar with the kernels (2, 2), steps through attention_from_qkv per device")
    finally:
        use_kernels(None)
        module.tree_attention_from_qkv = from_qkv


def sampled_is_seed_identical():
    """Sampled: the sharded bundle draws what the unsharded one draws, and every method what `ar` draws."""
    sharded = weaver_jax.shard(BUNDLE, mesh(2, 2))
    ar = tokens(BUNDLE, "ar", temperature=1.0, seed=3)
    check(tokens(sharded, "weaver", temperature=1.0, seed=3) == ar, "weaver sampled (2, 2) equals unsharded ar")


def exact_is_bitwise_ar():
    """exact=True on a sharded bfloat16 bundle: every method bitwise its own `ar`."""
    bf16 = random_bundle(1, num_heads=8, num_kv_heads=4, intermediate_size=128, dtype="bfloat16")
    sharded = weaver_jax.shard(bf16, mesh(1, 2))
    ar = tokens(sharded, "ar", exact=True)
    check(tokens(sharded, "weaver", exact=True) == ar, "exact weaver (1, 2) bitwise ar")


def compiled_hlo(bundle, method: str, kernels: bool = False) -> str:
    """The optimized HLO of `tokens(bundle, method)`'s program (compiled by an earlier case: cached)."""
    from weaver_jax.pallas_kernels import use_kernels

    use_kernels(kernels or None)
    try:
        fn, static, args = _generate._prepare(bundle, PROMPTS, method, 10, 0.0, 0, 1.0, 0, None,
                                              {"budget": 8} if method in ("ddtree", "weaver") else {})
    finally:
        use_kernels(None)
    return _generate._compiled(fn, static, *args).as_text()


def no_weight_is_gathered():
    """The compiled decode holds no all-gather whose result is a whole weight matrix: each device multiplies by
    its own columns / rows, and XLA all-reduces activations (weaver: the hybrid target with the kernels, as on
    a GPU, GDN layers included)."""
    for name, bundle, sharded, method in (("dense", BUNDLE, weaver_jax.shard(BUNDLE, mesh(2, 2)), "ar"),
                                          ("hybrid", HYBRID, sharded_hybrid(), "weaver")):
        weights = {tuple(w.shape) for m in (bundle.target, bundle.drafter) for w in module_params(m).values()
                   if w.ndim == 2}
        hlo = compiled_hlo(sharded, method, kernels=method == "weaver")  # as greedy / kernels_run_per_shard ran it
        gathered = {tuple(int(d) for d in dims.split(",")) for dims in
                    re.findall(r"= \w+\[([\d,]+)\]\S* all-gather\(", hlo)}
        check(not gathered & weights, f"{name} {method}: no weight all-gathered ({sorted(gathered & weights)})")
        check(len(re.findall(r" all-reduce\(", hlo)) > 0, f"{name} {method}: tensor parallel (all-reduces present)")
    # Over `data` alone each device keeps its sequences: the tree's and the round's bookkeeping (row-indexed
    # gathers and scatters, `_tree.row_get` / `row_set`) gathers no batch; what remains gathered is the few
    # float rows XLA's CPU top_k takes whole (the drafter's pool, the adapter's children)
    hlo = compiled_hlo(weaver_jax.shard(BUNDLE, mesh(2, 1)), "weaver")  # greedy_equals_unsharded compiled it
    gathered = re.findall(r"= (\w+)\[[\d,]*\]\S* all-gather\(", hlo)
    check(not [g for g in gathered if g != "f32"], f"weaver (2, 1): no index or token all-gathered ({gathered})")


def training_resumes_on_another_mesh():
    """A drafter trained data-parallel on a (2, 2) mesh (the target split over `model`), interrupted after a
    step, resumed on (4, 1): the same loss curve and parameters as the whole run on one device."""
    import tempfile

    from flax import nnx

    from weaver_jax import training
    from weaver_jax._train import TrainConfig, fit, read_log

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 96, int(rng.integers(3, 8))).tolist() for _ in range(8)]
    out = weaver_jax.generate(BUNDLE, prompts, max_new_tokens=24, eos_token_id=[])
    tokens = np.full((8, 32), -1, np.int32)
    for i, (p, r) in enumerate(zip(prompts, out.tokens, strict=True)):
        tokens[i, : len(p) + len(r)] = p + r
    data = dict(tokens=tokens, prompt_lengths=np.array([len(p) for p in prompts], np.int32),
                lengths=np.array([len(p) + len(r) for p, r in zip(prompts, out.tokens, strict=True)], np.int32))
    config = TrainConfig(steps=6, batch_size=4, anchors=4, learning_rate=3e-3, save_every=3, log_every=1)
    loss_fn = training.drafter_loss_fn(config)
    fresh = lambda: jax.tree.map(jax.numpy.copy, BUNDLE.drafter)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        whole, _ = fit(fresh(), loss_fn, data, config, f"{tmp}/one", frozen=(BUNDLE.target,))
        _, info = fit(fresh(), loss_fn, data, config, f"{tmp}/mesh", frozen=(BUNDLE.target,), max_seconds=0.0,
                      mesh=mesh(2, 2))
        check(info["step"] == 1, "interrupted after one step on (2, 2)")
        resumed, info = fit(fresh(), loss_fn, data, config, f"{tmp}/mesh", frozen=(BUNDLE.target,), mesh=mesh(4, 1))
        check(info["finished"], "resumed on (4, 1) and finished")
        one, sharded = read_log(f"{tmp}/one"), read_log(f"{tmp}/mesh")
        check(np.allclose([r["loss"] for r in one], [r["loss"] for r in sharded], rtol=1e-4),
              f"the same loss curve: {[round(r['loss'], 4) for r in sharded]}")
        check(all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(
            jax.tree.leaves(nnx.state(whole)), jax.tree.leaves(nnx.state(resumed)), strict=True)),
            "the same parameters")
    try:
        fit(fresh(), loss_fn, data, dataclasses.replace(config, batch_size=3), "/nonexistent/run", mesh=mesh(2, 1),
            frozen=(BUNDLE.target,))
    except ValueError as e:
        check("batch size 3 does not divide over the mesh's 'data' axis of 2" in str(e), f"error: {e}")


def layout_and_errors():
    sharded = weaver_jax.shard(BUNDLE, mesh(2, 2))
    qkv = sharded.target.layers[0].attn.qkv[...]
    check(qkv.sharding.spec == jax.sharding.PartitionSpec(None, "model"), "qkv split over model by columns")
    same = all(np.array_equal(a, module_params(BUNDLE.target)[k]) for k, a in module_params(sharded.target).items())
    check(same, "module_params of a sharded target is the unsharded layout (checkpoints unchanged)")
    loaded = weaver_jax.load(Path(__file__).parent / "fixtures" / "hf" / "qwen2", dtype="float32", mesh=mesh(1, 2))
    check(loaded.mesh.shape["model"] == 2 and loaded.target.layers[0].attn.groups == 2, "load(..., mesh=) shards")
    check(cli._mesh("2x4").shape == {"data": 2, "model": 4}, "--mesh 2x4")
    # a target drawn straight into its shards (the benchmarks' random 70B over 4 GPUs) takes shard()'s layout
    import bench.decode

    drawn = bench.decode.random_target(BUNDLE.config, mesh(2, 2))
    layout = lambda m: {k: (v.shape, v.sharding.spec) for k, v in nnx.to_flat_state(nnx.state(m))}  # noqa: E731
    check(layout(drawn) == layout(sharded.target) and drawn.layers[0].mlp.groups == 2,
          "a random target drawn into its shards has shard()'s layout")
    resharded = weaver_jax.shard(sharded, mesh(1, 4), replicate=("drafter", "adapter"))
    check(tokens(resharded, "ar") == tokens(BUNDLE, "ar"), "a sharded bundle resharded to (1, 4)")
    for call, message in [
        (lambda: weaver_jax.shard(BUNDLE, mesh(1, 8)), "target layers.0.attn.qkv: 4 KV heads do not divide over "
                                                      "the mesh's 'model' axis of 8 devices"),
        (lambda: weaver_jax.shard(BUNDLE, mesh(1, 4)), "drafter layers.0.attn.qkv: 2 KV heads"),
        (lambda: weaver_jax.shard(BUNDLE, jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])),
         "a mesh with axes ('data', 'model')"),
        (lambda: check_rules({"attn.out": ("heads", "ffn")}), "attn.out: two dimensions on one mesh axis"),
        (lambda: cli._mesh("4x4"), "--mesh 4x4: 16 devices asked for, 8 present"),
    ]:
        try:
            call()
        except ValueError as e:
            check(message in str(e), f"error names the problem: {e}")
        else:
            raise AssertionError(f"no error: expected {message!r}")


if __name__ == "__main__":
    check(jax.device_count() == 8, "8 fake devices")
    for case in (layout_and_errors, greedy_equals_unsharded, kernels_run_per_shard, sampled_is_seed_identical,
                 no_weight_is_gathered, exact_is_bitwise_ar, streaming_and_serving_slots_run_sharded,
                 training_resumes_on_another_mesh):
        start = time.perf_counter()
        case()
        print(f"{case.__name__}: {time.perf_counter() - start:.1f} s", flush=True)
    print("all sharded cases passed")
