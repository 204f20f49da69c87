"""Text the command reads from its user (the prompt, chat's lines): checked before the tokenizer sees it."""

from __future__ import annotations


def check_text(text: str, what: str, error: type[Exception] = ValueError) -> None:
    """Text that was not UTF-8 reaches Python as lone surrogates (the command line's and chat's standard input decode
    undecodable bytes so), which the tokenizer cannot encode: refused with `error`, naming the first such byte."""
    for i, char in enumerate(text):
        if "\udc80" <= char <= "\udcff":
            raise error(f"{what} is not valid UTF-8 (byte 0x{ord(char) - 0xDC00:02x} at character {i}); give it in "
                        "UTF-8")
