"""A chat whose prompts keep the tokens the model generated.

A prompt built from the messages' text encodes every answer again, and where the model's own tokens
differ from that encoding (SmolLM2 writes "\\n\\n" as one token, which the text encodes as two), the
next turn's prompt leaves the tokens the cache holds there, and the rest of the conversation is
prefilled again. A :class:`Conversation` builds each next prompt as the previous prompt, the answer's
own tokens and the encoded rest of the template (the end of the answer, the new user turn, the
assistant's opening), so it extends what the target committed token for token. It falls back to
encoding the whole conversation where the template does not render the answer's text verbatim after
the previous prompt, the answer's tokens do not decode to its text (a stop string cut it), or the
spliced prompt does not decode to the conversation's text (tokenizers that add a space when a piece
is encoded on its own, as SentencePiece does).
"""

from __future__ import annotations

from jetflow.decoding.prompt import check_unicode, encode_prompt, render_chat
from jetflow.decoding.result import GenerationResult


class Conversation:
    def __init__(self, tokenizer, system: str | None = None):
        self.tokenizer = tokenizer
        self._start = [{"role": "system", "content": system}] if system else []
        self.reset()

    def reset(self) -> None:
        """Start again (with the system message, if any)."""
        self.messages: list[dict] = list(self._start)
        self._last: tuple[str, list[int]] | None = None  # the previous prompt and its answer: text, ids
        self._asked: tuple[list[dict], str, list[int]] | None = None  # the prompt awaiting its answer

    def _render(self, messages: list[dict]) -> str:
        return render_chat(self.tokenizer, messages)

    def prompt(self, text: str) -> list[int]:
        """The token ids of the next turn's prompt, the user saying ``text``."""
        check_unicode(text, "the message")
        messages = self.messages + [{"role": "user", "content": text}]
        rendered = self._render(messages)
        ids = self._spliced(rendered) or encode_prompt(self.tokenizer, messages, chat=True)
        self._asked = (messages, rendered, ids)
        return ids

    def _spliced(self, rendered: str) -> list[int] | None:
        """The previous prompt's and answer's ids and the rest of ``rendered`` encoded, when that
        decodes to ``rendered``; else None."""
        if self._last is None or not rendered.startswith(self._last[0]):
            return None
        before, before_ids = self._last
        spliced = before_ids + list(self.tokenizer(rendered[len(before):], add_special_tokens=False)["input_ids"])
        return spliced if self.tokenizer.decode(spliced) == rendered else None

    def add_answer(self, result: GenerationResult) -> None:
        """The answer to the latest :meth:`prompt`; a turn that got none (an error) leaves the
        conversation as it was."""
        if self._asked is None:
            raise RuntimeError("add_answer() without a prompt()")
        messages, rendered, ids = self._asked
        self._asked = None
        self.messages = messages + [{"role": "assistant", "content": result.text}]
        answer, decode = list(result.token_ids), self.tokenizer.decode
        if answer and decode(answer) != result.text and decode(answer[:-1]) == result.text:
            answer = answer[:-1]  # a stop token ended it: the template writes its own end of turn
        if decode(answer) == result.text:
            self._last = (rendered + result.text, ids + answer)
        else:  # tokens and text disagree (a stop string cut the text): the next prompt is encoded whole
            self._last = None
