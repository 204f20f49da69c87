"""`TextStream`, the server's detokenizer: fed random tokens one at a time (arbitrary bytes: incomplete and invalid
UTF-8), its pieces concatenate to the full decode, a stop string ends the output at exactly the token plain decoding
completes it with, and no piece ever holds the start of a stop string that then completes."""

import random

import pytest

from helpers import save_tiny_tokenizer
from lookahead.serve import TextStream
from lookahead.serve.text import TokenText


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer")))


def decode(tokenizer, tokens):
    return tokenizer.decode(tokens, skip_special_tokens=True)


def sequences(tokenizer, count: int, seed: int):
    """Random byte tokens and specials, and real text's tokens (multi-byte characters split across tokens)."""
    rng = random.Random(seed)
    text = tokenizer("héllo wörld ✓ 日本語, ab ab ab\n")["input_ids"] * 3
    for i in range(count):
        if i % 3 == 0:
            start = rng.randrange(len(text))
            yield text[start : start + rng.randrange(1, 40)]
        else:
            yield [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 50))]


def run(tokenizer, tokens, stops):
    """Feed tokens until a stop; the pieces handed out after each token, and where it stopped."""
    stream, pieces = TextStream(tokenizer, stops), []
    for i, token in enumerate(tokens):
        if stream.feed(token):
            pieces.append(stream.take(final=True))
            return pieces, i
        pieces.append(stream.take())
    pieces.append(stream.take(final=True))
    return pieces, None


@pytest.mark.parametrize("seed", range(4))
def test_pieces_concatenate_to_the_full_decode(tokenizer, seed):
    for tokens in sequences(tokenizer, 150, seed):
        pieces, stopped = run(tokenizer, tokens, ())
        assert stopped is None and "".join(pieces) == decode(tokenizer, tokens)


@pytest.mark.parametrize("seed", range(4))
def test_a_stop_string_ends_the_output_where_plain_decoding_completes_it(tokenizer, seed):
    rng = random.Random(seed)
    for tokens in sequences(tokenizer, 150, 10 + seed):
        full = decode(tokenizer, tokens)
        if not full:
            continue
        at = rng.randrange(len(full))
        stop = full[at : at + rng.randrange(1, 4)]
        if "\ufffd" in stop:  # the stand-in for bytes not yet a character: no one's stop string
            continue
        pieces, stopped = run(tokenizer, tokens, [stop, "\x00never\x00"])
        first = next(k for k in range(1, len(tokens) + 1) if stop in decode(tokenizer, tokens[:k]))
        assert stopped == first - 1, (tokens, stop)
        text = decode(tokenizer, tokens[:first])
        assert "".join(pieces) == text[: text.index(stop)]
        streamed = ""
        for piece in pieces[:-1]:  # nothing handed out before the end holds the stop string's start
            streamed += piece
            assert len(streamed) <= text.index(stop)


@pytest.mark.parametrize("seed", range(3))
def test_several_stop_strings_that_overlap_themselves_and_each_other(tokenizer, seed):
    """Up to four stop strings from the text (self-overlapping ones too: "abab"), matched incrementally: the output
    ends at the first token whose decode holds any of them, cut before the earliest, and what was handed out before
    the end never holds the start of the one that completes."""
    rng = random.Random(seed)
    alphabet = "ab ✓"
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 5))]
        pieces, stopped = run(tokenizer, tokens, stops)
        first = next((k for k in range(1, len(tokens) + 1) if any(s in decode(tokenizer, tokens[:k]) for s in stops)),
                     None)
        assert stopped == (None if first is None else first - 1), (text, stops)
        whole = decode(tokenizer, tokens[:first] if first else tokens)
        cut = min((whole.index(s) for s in stops if s in whole), default=len(whole))
        assert "".join(pieces) == whole[:cut], (text, stops)
        streamed = "".join(pieces[:-1])
        assert len(streamed) <= cut


def test_token_text_gives_each_tokens_bytes(tokenizer):
    text = TokenText(tokenizer)
    assert text(ord("a")) == ("a", [97])
    assert text(0xC3) == ("\ufffd", [0xC3])  # half of a character: its byte, from the byte-level alphabet
    assert text(257) == ("<|im_end|>", list(b"<|im_end|>"))
