"""New tokens as text while they come: incremental detokenization and stop strings.

A token is not a piece of text: a byte-level tokenizer may split one UTF-8 character over several tokens, and
a decoder may write a token differently at the start of a text (SentencePiece drops the first space). So text
is never made token by token. ``Detokenizer`` decodes the window of tokens since its last stable boundary and
hands out only the part of that text that later tokens cannot change (nothing while it ends in an incomplete
character, U+FFFD); ``flush`` reconciles with ``tokenizer.decode(all tokens)``, so the pieces always join to
exactly that text.

``StopStrings`` holds back any end of the text that could still become a stop string, and cuts the text before
the first stop string found (the stop string itself is not part of the answer, as with OpenAI's API).
``TokenText`` joins the two: token ids in, ``(token id, text piece)`` pairs out.

Pure functions of a tokenizer object (``tokenizers.Tokenizer`` or anything with ``decode(ids)``): no device.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Token ids in, stable text out.

        d = Detokenizer(tokenizer)
        pieces = [d.push(t) for t in ids] + [d.flush()]
        assert "".join(pieces) == tokenizer.decode(ids)

    ``push`` decodes the tokens from ``start`` (the last boundary where the text was complete, kept one emission
    behind so that the decoder sees a token of context) and returns the text past what was handed out, without
    a trailing U+FFFD (an incomplete UTF-8 character that the next token may finish). Two decodes per token, of
    a few tokens each.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.text = ""              # handed out so far
        self._start = 0             # window start (a complete boundary)
        self._read = 0              # tokens[start:read] are complete and handed out; their text is _base
        self._base = ""
        self._extra = 0             # characters handed out past _base (a stable prefix of later tokens)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, token: int) -> str:
        """Add one token; return the text it makes stable (may be "")."""
        self.tokens.append(int(token))
        window = self._decode(self.tokens[self._start:])
        if not window.startswith(self._base):   # a decoder that rewrites earlier text: compare whole texts
            return self._whole()
        stable = window.rstrip(REPLACEMENT)
        done = len(self._base) + self._extra
        piece = stable[done:] if len(stable) > done else ""
        self._extra += len(piece)
        self.text += piece
        if len(stable) == len(window) and len(stable) == len(self._base) + self._extra:
            # complete: this is the next boundary; the window moves up, keeping the last complete tokens as context
            start, read = self._read, len(self.tokens)
            # the context must decode to some text: tokens that decode to nothing (special tokens, skipped) give
            # a decoder that strips the first space or marker nothing to strip it from
            while start > 0 and not self._decode(self.tokens[start:read]):
                start -= 1
            self._start, self._read = start, read
            self._base = self._decode(self.tokens[self._start:self._read])
            self._extra = 0
        return piece

    def _whole(self) -> str:
        full = self._decode(self.tokens)
        stable = full.rstrip(REPLACEMENT)
        piece = stable[len(self.text):] if stable.startswith(self.text) else ""
        self.text += piece
        if len(stable) == len(full) and full == self.text:
            self._start = self._read = len(self.tokens)
            self._base, self._extra = "", 0
        else:
            # keep the window at the start: the next push compares whole texts again
            self._start, self._read, self._base, self._extra = 0, 0, "", len(self.text)
        return piece

    def flush(self) -> str:
        """At the end: what ``decode(all tokens)`` has past the text handed out (a trailing incomplete character
        as U+FFFD, as ``decode`` writes it)."""
        full = self._decode(self.tokens)
        piece = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += piece
        self._start = self._read = len(self.tokens)
        self._base, self._extra = "", 0
        return piece


def check_stop_strings(stop) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings: None, one string, or a sequence of strings."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Sequence):
        raise TypeError(f"stop={stop!r}: expected a string or a list of strings, got {type(stop).__name__}")
    wrong = [s for s in stop if not isinstance(s, str)]
    if wrong:
        raise TypeError(f"stop: {wrong!r} are not strings; expected a string or a list of strings")
    if any(s == "" for s in stop):
        raise ValueError("stop: an empty stop string would end every answer at once; give non-empty strings")
    return tuple(dict.fromkeys(stop))


class StopStrings:
    """Text in, text safe to show out: the end of the text that could still grow into a stop string is held
    back; once a stop string is complete, the text before its first occurrence is the end (``stopped``)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = check_stop_strings(stops)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        buf = self._held + piece
        # every occurrence of a stop string starts inside buf: the emitted text never ends in a stop's prefix
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            self.stopped, self.matched, self._held = True, s, ""
            return buf[:i]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if s.startswith(buf[len(buf) - k:]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class TokenText:
    """The text of new tokens as they come, with stop strings: ``feed(ids, last)`` returns a ``(token id, text
    piece)`` pair per token, up to the token that completes a stop string (then ``stopped``); the pieces join to
    the answer (``text``): ``tokenizer.decode(tokens)``, cut before the first stop string."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.detok = Detokenizer(tokenizer)
        self.stops = StopStrings(stop) if stop else None
        self.text = ""
        self.tokens: list[int] = []

    @property
    def stopped(self) -> bool:
        return self.stops is not None and self.stops.stopped

    def feed(self, ids, last: bool = False) -> list[tuple[int, str]]:
        """Pieces for ``ids``; ``last``: no tokens follow, so everything held back is let out with the last one."""
        out = []
        ids = list(ids)
        for k, t in enumerate(ids):
            if self.stopped:
                break
            piece = self.detok.push(t)
            if last and k == len(ids) - 1:
                piece += self.detok.flush()
            if self.stops is not None:
                piece = self.stops.feed(piece)
                if last and k == len(ids) - 1:
                    piece += self.stops.flush()
            self.tokens.append(int(t))
            self.text += piece
            out.append((int(t), piece))
        return out

    def finish(self) -> str:
        """The rest of the text when decoding ended without a last ``feed`` (nothing more comes)."""
        if self.stopped:
            return ""
        piece = self.detok.flush()
        if self.stops is not None:
            piece = self.stops.feed(piece) + self.stops.flush()
        self.text += piece
        return piece
