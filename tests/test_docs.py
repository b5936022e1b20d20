"""The docs run: every Python snippet of README.md and docs/*.md, each file's in order in one namespace, so no
snippet can drift from the code. Cheaply: a small random bundle wherever a snippet loads a model, a one-device
mesh where it asks for more devices than the CPU has, at most 8 new tokens a call, and method="auto" with round
times that make it decode plainly (its measuring and switching are tests/test_auto.py's)."""

import re
import textwrap
from pathlib import Path

import jax
import pytest

import weaver_jax
from weaver_jax import _auto
from weaver_jax.testing import random_bundle

ROOT = Path(__file__).parents[1]
SNIPPET = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)


def snippets(path: Path) -> list[str]:
    return [textwrap.dedent(code) for _, code in SNIPPET.findall(path.read_text())]


def test_the_docs_have_their_snippets_and_links():
    """The README and every guide it links exist, and the guides' links between each other resolve."""
    readme = (ROOT / "README.md").read_text()
    guides = sorted((ROOT / "docs").glob("*.md"))
    assert guides and all(f"docs/{g.name}" in readme for g in guides)
    for guide in guides:
        for target in re.findall(r"\]\(([\w.-]+\.md)\)", guide.read_text()):
            assert (guide.parent / target).exists(), (guide.name, target)
    assert len(readme.encode()) <= 12_000  # a front page read in minutes (issue 43)
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    assert len(benchmarks.encode()) <= 30_000  # the current figures only; past passes in bench/HISTORY.md
    for raw in re.findall(r"bench/results/([\w.-]+\.json)", benchmarks):  # every raw file named is there
        assert (ROOT / "bench" / "results" / raw).exists(), raw


def test_every_public_name_has_a_docstring_with_an_example():
    """`help(weaver_jax.X)` shows what X is and an example: an indented line of code (issue 43)."""
    import inspect

    for name in weaver_jax.__all__:
        doc = inspect.getdoc(getattr(weaver_jax, name)) or ""
        examples = [line for line in doc.splitlines()[1:] if line.startswith("    ") and "(" in line]
        assert examples, f"weaver_jax.{name}: no example in its docstring"


@pytest.mark.parametrize("path", [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
                                  if snippets(p)], ids=lambda p: p.name)
def test_snippets_run(path, monkeypatch):
    small = random_bundle(0, tokenizer=True, eos_token_ids=(1,), block_size=6)  # tests/test_stream.py's bundle
    monkeypatch.setattr(weaver_jax, "load", lambda *args, **kwargs: small)
    make_mesh = jax.make_mesh
    monkeypatch.setattr(jax, "make_mesh", lambda shape, names, **kwargs: make_mesh(
        (1,) * len(shape), names, devices=jax.devices()[:1]))
    for name in ("generate", "stream"):
        call = getattr(weaver_jax, name)
        monkeypatch.setattr(weaver_jax, name, lambda *args, call=call, max_new_tokens, **kwargs: call(
            *args, max_new_tokens=min(max_new_tokens, 8), **kwargs))
    monkeypatch.setattr(_auto, "known_costs", lambda bundle, tiers, **where: {
        t.name: 1.0 if t.method == "ar" else None for t in tiers})
    namespace: dict = {}
    for code in snippets(path):
        exec(compile(code, str(path), "exec"), namespace)  # noqa: S102
