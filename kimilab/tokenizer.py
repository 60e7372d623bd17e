"""A byte-level tokenizer: every UTF-8 byte is a token, plus a few specials.

Ids 0..255 are the bytes themselves, so any text round-trips exactly and a
reader can type any prompt. The specials sit above them (BOS, EOS, PAD, UNK),
giving a vocabulary of 260 — the ``tiny`` model's ``vocab_size``.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["ByteTokenizer", "BOS", "EOS", "PAD", "UNK", "SPECIALS"]

BOS, EOS, PAD, UNK = 256, 257, 258, 259
SPECIALS = {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD, "<unk>": UNK}


class ByteTokenizer:
    """Text <-> token ids: UTF-8 bytes (0..255) and specials BOS/EOS/PAD/UNK (256..259)."""

    bos_id, eos_id, pad_id, unk_id = BOS, EOS, PAD, UNK
    specials = dict(SPECIALS)
    vocab_size = 260

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text`` (optionally framed by BOS / EOS)."""
        if not isinstance(text, str):
            raise ValueError(f"encode(text): expected str, got {type(text).__name__}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"encode(text): not encodable as UTF-8 ({err.reason} at {err.start})") from None
        return ([BOS] if bos else []) + list(data) + ([EOS] if eos else [])

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``. Specials are dropped (or shown as ``<bos>`` etc.); byte
        sequences that are not valid UTF-8 (an untrained model writes those) become U+FFFD."""
        out: list[str] = []
        run = bytearray()
        names = {v: k for k, v in SPECIALS.items()}
        for pos, t in enumerate(ids):
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise ValueError(f"decode(ids): ids[{pos}]={t!r} is not an int")
            t = int(t)
            if 0 <= t < 256:
                run.append(t)
            elif t in names:
                if not skip_special:
                    out.append(run.decode("utf-8", errors="replace"))
                    run.clear()
                    out.append(names[t])
            else:
                raise ValueError(f"decode(ids): ids[{pos}]={t} outside the vocabulary 0..{self.vocab_size - 1}")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_str(self, t: int) -> str:
        """A printable name for one token: its character if printable ASCII, else e.g. ``<0xe2>``."""
        t = int(t)
        if t in {v for v in SPECIALS.values()}:
            return {v: k for k, v in SPECIALS.items()}[t]
        if not 0 <= t < 256:
            raise ValueError(f"token_str(t={t}): outside the vocabulary 0..{self.vocab_size - 1}")
        return chr(t) if 32 <= t < 127 else f"<0x{t:02x}>"

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=260, bos=256, eos=257, pad=258, unk=259)"
