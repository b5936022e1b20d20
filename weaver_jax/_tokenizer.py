"""Tokenizers for the targets, built on the `tokenizers` library (no transformers, no torch).

Two sources, one class:
- a GGUF's byte-level BPE vocabulary (`tokenizer.ggml.model == "gpt2"`), its text split as llama.cpp splits it
  for the file's `tokenizer.ggml.pre`: each entry of `PRE_TOKENIZERS` is the list of regexes llama.cpp applies in
  turn (every piece split again by the next, matches and the text between them kept), then GPT-2's byte mapping;
- a Hugging Face directory's `tokenizer.json`, read as it is, with `tokenizer_config.json` / `chat_template.jinja`
  (chat template, special tokens) and `generation_config.json` (EOS ids). A converted checkpoint stores its
  tokenizer in these same files, so one reader serves both.

Chat templates render as transformers renders them: a sandboxed Jinja environment with trim_blocks and
lstrip_blocks, loop controls, a `tojson` that does not escape HTML, `raise_exception` and `strftime_now`, and the
special tokens (`bos_token`, `eos_token`, ...) as variables.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # combining marks stay with their letters

# llama.cpp's `tokenizer.ggml.pre` names (llama-vocab.cpp) -> the regexes it splits text with, in order.
PRE_TOKENIZERS = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "mpt", "olmo"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"), (r"\p{N}", _GPT2)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), (_QWEN2,)),
    "qwen35": (_QWEN35,),
}
# Those whose pieces are looked up whole before any merge (llama.cpp's `ignore_merges`, Llama 3's tokenizer.json).
WHOLE_PIECES_FIRST = {"llama-bpe", "llama3", "llama-v3", "falcon3"}

# GGUF token types (llama.cpp): 3 = control (special: skipped by `decode(skip_special_tokens=True)`), 4 = user
# defined (an added token such as `<tool_call>`, kept in decoded text). Both are matched whole in text.
_CONTROL, _USER_DEFINED = 3, 4
# Control tokens llama.cpp treats as ends of generation, besides the file's EOS / EOT / EOM ids: Qwen's
# `<|im_end|>` and `<|endoftext|>`, Llama 3's `<|eot_id|>`, `<|eom_id|>` and `<|end_of_text|>` (what their
# generation_config.json files list).
_END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<|end|>",
                      "<end_of_turn>", "<EOT>", "<end_of_utterance>")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """`encode(text)`, `decode(ids)` and `apply_chat_template(messages)` for a target.

    Built by `from_gguf_metadata` or `from_directory`; `save(directory)` writes Hugging Face files that
    `from_directory` (and transformers) read back.

    bos_token_id: int or None. eos_token_ids: every id that ends a generation, the primary EOS first.
    special_tokens: {"bos_token": "<|im_start|>", ...}, what a chat template sees under those names.

        tok = weaver_jax.Tokenizer.from_directory("Qwen3-8B/")  # tokenizer.json + tokenizer_config.json
        ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])  # ends with the assistant's turn
        tok.decode(ids, skip_special_tokens=True), tok.eos_token_ids
    """

    def __init__(self, backend, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None):
        self._tok = backend  # a tokenizers.Tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        """One past the highest id (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> list[int]:
        """Ids of the special (control) tokens, ascending."""
        return sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    # ---- building ----

    @classmethod
    def from_gguf_metadata(cls, m: dict) -> Tokenizer:
        """From a GGUF's `tokenizer.*` metadata (`convert.gguf.open_gguf(path).metadata`)."""
        model = m.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {model!r}: only byte-level BPE ('gpt2') is supported "
                             "(sentencepiece 'llama' vocabularies are not)")
        return cls.from_bpe(m["tokenizer.ggml.tokens"], m["tokenizer.ggml.merges"], m["tokenizer.ggml.token_type"],
                            m.get("tokenizer.ggml.pre", "default"),
                            bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
                            eos_token_ids=[m[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom")
                                           if m.get(f"tokenizer.ggml.{k}_token_id") is not None],
                            pad_token_id=m.get("tokenizer.ggml.padding_token_id"),
                            chat_template=m.get("tokenizer.chat_template"),
                            add_bos=bool(m.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_bpe(cls, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: str, *,
                 bos_token_id: int | None, eos_token_ids: Sequence[int], pad_token_id: int | None = None,
                 chat_template: str | None = None, add_bos: bool = False) -> Tokenizer:
        """A byte-level BPE vocabulary as a GGUF stores it: tokens in id order, merges as "left right" strings,
        llama.cpp token types, and the pre-tokenizer's name (a key of `PRE_TOKENIZERS`)."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as Backend

        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"unsupported pre-tokenizer {pre!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
        tokens, token_types = list(tokens), [int(t) for t in token_types]
        if len(tokens) != len(token_types):
            raise ValueError(f"{len(tokens)} tokens but {len(token_types)} token types")
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges],
                         fuse_unk=False, byte_fallback=False, ignore_merges=pre in WHOLE_PIECES_FIRST)
        tok = Backend(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, token_types, strict=True) if kind == _CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, token_types, strict=True) if kind == _USER_DEFINED])
        if add_bos and bos_token_id is not None:
            bos = tokens[bos_token_id]
            tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, bos_token_id)])
        eos = list(eos_token_ids) + [i for i, (t, kind) in enumerate(zip(tokens, token_types, strict=True))
                                     if kind == _CONTROL and t in _END_OF_GENERATION]
        named = {"bos_token": bos_token_id, "eos_token": eos[0] if eos else None, "pad_token": pad_token_id}
        return cls(tok, bos_token_id=bos_token_id, eos_token_ids=list(dict.fromkeys(eos)), chat_template=chat_template,
                   special_tokens={k: tokens[i] for k, i in named.items() if i is not None})

    @classmethod
    def from_directory(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer of a Hugging Face directory or a converted checkpoint: `tokenizer.json` (required; None
        when absent), `tokenizer_config.json` and `chat_template.jinja` (template, special tokens),
        `generation_config.json` (EOS ids, else the config's `eos_token`)."""
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        if not (path / "tokenizer.json").exists():
            slow = [n for n in ("tokenizer.model", "vocab.json", "merges.txt") if (path / n).exists()]
            if slow:
                warnings.warn(f"{path} has {', '.join(slow)} but no tokenizer.json: loaded without a tokenizer "
                              "(save it with transformers' fast tokenizer to get one)", stacklevel=3)
            return None
        text = (path / "tokenizer.json").read_text(encoding="utf-8")
        raw = json.loads(text)
        if {"tokens", "merges", "pre"} <= raw.keys():  # a checkpoint written before the Hugging Face files
            return cls.from_bpe(raw["tokens"], raw["merges"], raw["token_types"], raw["pre"],
                                bos_token_id=raw["bos_token_id"], chat_template=raw["chat_template"],
                                eos_token_ids=[raw["eos_token_id"]] if raw["eos_token_id"] is not None else [],
                                add_bos=raw["add_bos"])
        try:
            tok = Backend.from_str(text)
        except Exception as e:  # tokenizers raises its own Exception type
            raise ValueError(f"{path / 'tokenizer.json'} is not a tokenizers file: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if (path / "chat_template.jinja").exists():  # transformers saves the template here and reads it first
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        special = {}
        for name in _SPECIAL_NAMES:
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if value is None:
                continue
            if tok.token_to_id(value) is not None:
                special[name] = value
            elif name in ("bos_token", "eos_token"):  # the ids generation and templates rely on
                raise ValueError(f"{path / 'tokenizer_config.json'}: {name} {value!r} is not in the vocabulary")
            else:  # transformers would add it as a new token; nothing here needs it
                warnings.warn(f"{path / 'tokenizer_config.json'}: {name} {value!r} is not in the vocabulary; ignored",
                              stacklevel=3)
        eos = _read_json(path / "generation_config.json").get("eos_token_id")
        if eos is None:
            eos = [tok.token_to_id(special["eos_token"])] if "eos_token" in special else []
        eos = [eos] if isinstance(eos, int) else list(eos)
        return cls(tok, bos_token_id=tok.token_to_id(special["bos_token"]) if "bos_token" in special else None,
                   eos_token_ids=eos, chat_template=template, special_tokens=special)

    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json`, `tokenizer_config.json` (special tokens, chat template) and
        `generation_config.json` (EOS ids) into an existing directory."""
        directory = Path(directory)
        (directory / "tokenizer.json").write_text(self._tok.to_str(), encoding="utf-8")
        config = {**self.special_tokens, "tokenizer_class": "PreTrainedTokenizerFast"}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": list(self.eos_token_ids)}))

    # ---- use ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. Special tokens written in the text become their ids; `add_special_tokens` adds what the
        tokenizer adds around a text (a BOS for Llama 3 and for GGUFs that ask for one), as transformers does."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The chat template applied to `messages` ([{"role": ..., "content": ...}, ...]) as text. Extra keyword
        arguments (`tools=[...]`, `date_string=...`, `enable_thinking=False`) are template variables."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        variables = {"tools": None, "documents": None, **self.special_tokens, **template_kwargs}  # as transformers
        return _compiled(self.chat_template).render(messages=list(messages),
                                                    add_generation_prompt=add_generation_prompt, **variables)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        """`render_chat`, encoded without adding special tokens (the template writes its own), as transformers
        encodes it. -> ids"""
        return self.encode(self.render_chat(messages, add_generation_prompt, **template_kwargs),
                           add_special_tokens=False)


@functools.lru_cache(maxsize=16)
def _compiled(chat_template: str):
    """A chat template compiled once: compiling took ~3 ms, most of a prompt's encoding (data generation encodes
    ~10^5 prompts)."""
    import datetime

    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(chat_template)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
