"""A conversation keeps its caches between turns: each turn prefills only what is new, and answers what a
fresh `generate` over the whole history answers (bitwise, with exact=True)."""

import functools

import weaver_jax as wj
from weaver_jax._chat import Conversation, repl


@functools.cache
def bundle():
    return wj.testing.random_bundle(0, tokenizer=True, eos_token_ids=(1,), block_size=6)


def test_turns_prefill_only_the_new_message_and_answer_as_generate_does():
    b = bundle()
    chat = Conversation(b, method="dflash", max_new_tokens=10, context=384, exact=True)
    first = len(b.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}]))
    for turn, message in enumerate(["hello", "and then?"]):
        answer = "".join(chunk.text for chunk in chat.reply(message))
        history = b.tokenizer.apply_chat_template(chat.messages[:-1])
        want = wj.generate(b, [history], method="dflash", max_new_tokens=10, exact=True, pad_to=128).tokens[0]
        assert answer == chat.messages[-1]["content"] == b.tokenizer.decode(want, skip_special_tokens=True)
        # the first turn's prompt is never prefilled again (past it: the answer, re-tokenized where its text
        # says other tokens than were generated - random bytes here - and the new message)
        assert chat.prefilled == (first if turn == 0 else chat.prefilled) <= len(history) - first * turn
    assert chat.stats["new_tokens"] == len(want) and "mean_accepted_length" in chat.stats


def test_the_terminal_loop_streams_answers_and_keeps_the_session_past_ctrl_c():
    chat = Conversation(bundle(), method="ar", max_new_tokens=6, context=256)
    lines = iter(["hi", "/stats", "stop me", "/bogus", "/reset", "", "/quit", "never read"])
    out, interrupted = [], []

    def write(text):  # Ctrl-C while the second answer streams
        if len(chat.messages) == 3 and not interrupted and text not in ("", "\n"):
            interrupted.append(text)
            raise KeyboardInterrupt
        out.append(text)

    repl(chat, read=lambda prompt: next(lines), write=write)
    text = "".join(out)
    assert "tokens/s" in text and "[stopped]" in text and "unknown command /bogus" in text
    assert "(the conversation starts over)" in text and next(lines) == "never read"
    assert chat.messages == []  # /reset
