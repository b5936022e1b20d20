"""Self-distillation data: the target's own responses to the training prompt mix (DESIGN 3.2).

Two passes with the project's jitted decoder, at fixed shapes so each compiles once:
  1. the target writes its own prompts from the meta-instructions (temperature 1);
  2. it answers every prompt: once greedily and `sampled_copies` times at temperature 1.
Work is cut into chunks of `batch` generations, each saved as `part-NNNNN.npz` when done (written
to a temporary name, then renamed), so an interrupted run resumes at the first missing part.

A part holds `tokens [n, L]` (prompt then response, -1 padded; L = max_prompt_tokens +
max_new_tokens), `prompt_lengths [n]`, `lengths [n]` (EOS included) and `source [n]` (index into
SOURCES). Token ids only: no text is stored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from weaver_jax._generate import _compiled, ar_generate, eos_array, sequence_keys
from weaver_jax._model import KVCache
from weaver_jax._prompts import clean_written_prompt
from weaver_jax._sampling import Sampling

SOURCES = ("chat", "written", "code")


def _decode_batch(bundle, prompts: list[list[int]], *, temperature: float, seeds: list[int], batch: int,
                  max_prompt_tokens: int, max_new_tokens: int) -> list[list[int]]:
    """Responses (EOS included) for up to `batch` prompts at fixed shapes: the batch is padded with
    copies of the first prompt, every prompt to `max_prompt_tokens`."""
    n = len(prompts)
    padded = prompts + [prompts[0]] * (batch - n)
    tokens = np.zeros((batch, max_prompt_tokens), np.int32)
    for i, p in enumerate(padded):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in padded], np.int32)
    keys = sequence_keys(list(seeds) + [0] * (batch - n), batch)
    graphdef, params = nnx.split(bundle.target)
    cache = KVCache.init(bundle.config, batch, max_prompt_tokens + max_new_tokens)
    static = dict(graphdef=graphdef, max_new_tokens=max_new_tokens, sampling=Sampling(temperature))
    args = (params, cache, jnp.asarray(tokens), jnp.asarray(lengths), keys, None, eos_array(bundle.eos_token_ids))
    out = _compiled(ar_generate, static, *args)(*args)
    counts, generated = np.asarray(out.num_tokens), np.asarray(out.tokens)
    return [generated[i, : counts[i]].tolist() for i in range(n)]


def _save_part(path: Path, arrays: dict) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def write_prompts(bundle, meta: list[str], out_dir: Path, *, batch: int, max_new_tokens: int, seed: int) -> list[str]:
    """Pass 1: the target's own prompts, one per meta-instruction (sampled), cleaned; cached in
    `out_dir/written_prompts.json`."""
    path = out_dir / "written_prompts.json"
    if path.exists():
        return json.loads(path.read_text())
    tok = bundle.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": m}]) for m in meta]
    longest = max(len(p) for p in ids)
    written = []
    for start in tqdm(range(0, len(ids), batch), desc="writing prompts"):
        chunk = ids[start : start + batch]
        responses = _decode_batch(bundle, chunk, temperature=1.0, seeds=[seed + start + i for i in range(len(chunk))],
                                  batch=batch, max_prompt_tokens=longest, max_new_tokens=max_new_tokens)
        for r in responses:
            text = clean_written_prompt(tok.decode(r, skip_special_tokens=True))
            if text is not None:
                written.append(text)
    written = sorted(set(written), key=written.index)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(written))
    os.replace(tmp, path)
    return written


def generate_dataset(bundle, prompts: dict[str, list[str]], out_dir: str | Path, *, batch: int = 256,
                     max_prompt_tokens: int = 256, max_new_tokens: int = 256, sampled_copies: int = 1,
                     meta_new_tokens: int = 96, seed: int = 0) -> Path:
    """prompts: {"chat": [...], "code": [...], "meta": [...]} (`_prompts.training_prompts`), texts
    sent as user messages through the chat template. Prompts longer than `max_prompt_tokens` are
    skipped. Resumable; -> out_dir."""
    if bundle.tokenizer is None:
        raise ValueError("data generation needs a bundle with a tokenizer")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = write_prompts(bundle, prompts.get("meta", []), out_dir, batch=batch, max_new_tokens=meta_new_tokens,
                            seed=seed + 1_000_000) if prompts.get("meta") else []
    texts = [(t, "chat") for t in prompts.get("chat", [])] + [(t, "written") for t in written] + [
        (t, "code") for t in prompts.get("code", [])]
    encoded = [(bundle.tokenizer.apply_chat_template([{"role": "user", "content": t}]), s) for t, s in texts]
    encoded = [(ids, s) for ids, s in encoded if len(ids) <= max_prompt_tokens]
    # One job per (prompt, copy): copy 0 greedy, the others sampled. Chunks never mix temperatures.
    jobs = [(i, 0) for i in range(len(encoded))] + [(i, c) for c in range(1, sampled_copies + 1)
                                                    for i in range(len(encoded))]
    chunks = [jobs[s : s + batch] for s in range(0, len(jobs), batch)]
    chunks = [c for chunk in chunks for c in ([chunk] if len({j[1] > 0 for j in chunk}) == 1 else
                                              [[j for j in chunk if j[1] == 0], [j for j in chunk if j[1] > 0]])]
    width = max_prompt_tokens + max_new_tokens
    (out_dir / "manifest.json").write_text(json.dumps(dict(
        prompts=len(encoded), sequences=len(jobs), parts=len(chunks), max_prompt_tokens=max_prompt_tokens,
        max_new_tokens=max_new_tokens, sampled_copies=sampled_copies, sources=SOURCES, seed=seed)))
    for k, chunk in enumerate(tqdm(chunks, desc="responses")):
        path = out_dir / f"part-{k:05d}.npz"
        if path.exists():
            continue
        ids = [encoded[i][0] for i, _ in chunk]
        temperature = 1.0 if chunk[0][1] else 0.0
        responses = _decode_batch(bundle, ids, temperature=temperature,
                                  seeds=[seed + i * 1000 + c for i, c in chunk], batch=batch,
                                  max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens)
        tokens = np.full((len(chunk), width), -1, np.int32)
        for row, (p, r) in enumerate(zip(ids, responses, strict=True)):
            tokens[row, : len(p) + len(r)] = p + r
        _save_part(path, dict(tokens=tokens, prompt_lengths=np.array([len(p) for p in ids], np.int32),
                              lengths=np.array([len(p) + len(r) for p, r in zip(ids, responses, strict=True)],
                                               np.int32),
                              source=np.array([SOURCES.index(encoded[i][1]) for i, _ in chunk], np.int8)))
    return out_dir


def load_dataset(directory: str | Path) -> dict[str, np.ndarray]:
    """All parts of a data directory concatenated: tokens `[N, L]` (-1 padded), prompt_lengths,
    lengths, source `[N]`. Refuses a directory whose parts are missing."""
    parts = [dict(np.load(p)) for p in complete_parts(directory)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def complete_parts(directory: str | Path) -> list[Path]:
    """The part files of a finished data directory, in order; FileNotFoundError naming what is missing."""
    directory = Path(directory)
    manifest_path = directory / "manifest.json"
    if not manifest_path.exists():
        raise FileNotFoundError(f"{directory} holds no training data (no manifest.json); run `weaver-jax train-data`")
    manifest = json.loads(manifest_path.read_text())
    paths = [directory / f"part-{k:05d}.npz" for k in range(manifest["parts"])]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{directory} is incomplete: {len(missing)} of {len(paths)} parts missing "
                                f"(first: {missing[0]}); rerun `weaver-jax train-data` to finish it")
    return paths


def spread(items: list, count: int) -> list:
    """`count` items evenly spaced over the whole list (all of it when it is shorter): prompt lists
    are ordered by topic and source, so a prefix would be a few topics."""
    n = len(items)
    return [items[i * n // count] for i in range(count)] if count < n else list(items)


def subset(data: dict[str, np.ndarray], count: int, seed: int = 0) -> dict[str, np.ndarray]:
    """`count` sequences drawn without replacement by `seed` (their order kept), for τ against data
    size: the parts are written by source, so a prefix would be one kind of prompt."""
    n = len(data["lengths"])
    if not 0 < count <= n:
        raise ValueError(f"a subset of {count} sequences: the data holds {n}")
    keep = np.sort(np.random.default_rng(seed).choice(n, count, replace=False))
    return {k: v[keep] for k, v in data.items()}
