"""The built-in training corpus: seeded arithmetic text and a character tokenizer.

The corpus needs no download and is a pure function of (seed, length): lines such as
``12+7=19;`` and ``40-13=27;``. A small model learns the format and the digits' statistics
within a few dozen steps, so loss visibly falls, which makes it a useful smoke test.
"""

from __future__ import annotations

import numpy as np

ALPHABET = "0123456789+-=;\n"
"""Every character the arithmetic corpus can contain; its index is the token id."""


class CharTokenizer:
    """Maps characters of a fixed alphabet to token ids and back."""

    def __init__(self, alphabet: str = ALPHABET) -> None:
        self.alphabet = alphabet
        self._index = {ch: i for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> np.ndarray:
        """Token ids (uint16) of ``text``; raises ``ValueError`` on a foreign character."""
        try:
            return np.fromiter((self._index[ch] for ch in text), dtype=np.uint16, count=len(text))
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the alphabet") from None

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return "".join(self.alphabet[int(i)] for i in ids)


def arithmetic_text(seed: int, n_chars: int) -> str:
    """Deterministic arithmetic exercises, exactly ``n_chars`` long.

    Each line holds a few ``a+b=c;`` or ``a-b=c;`` facts with operands below 100
    (subtraction never goes negative), so the answer is learnable from the context.
    The random draws are made in bulk (one batch of facts at a time): drawing them
    one by one is many times slower, a cost paid again at every restart.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xA817]))
    parts: list[str] = []
    size = 0
    while size < n_chars:
        batch = max(64, (n_chars - size) // 6 + 64)  # facts are 6-9 chars (+ newline)
        operands = rng.integers(0, 100, size=(batch, 2)).tolist()
        plus = (rng.random(batch) < 0.5).tolist()
        newline = (rng.random(batch) < 0.2).tolist()
        for (a, b), is_plus, nl in zip(operands, plus, newline, strict=True):
            if is_plus:
                fact = f"{a}+{b}={a + b};"
            else:
                a, b = max(a, b), min(a, b)
                fact = f"{a}-{b}={a - b};"
            if nl:
                fact += "\n"
            parts.append(fact)
            size += len(fact)
            if size >= n_chars:
                break
    return "".join(parts)[:n_chars]


def arithmetic_tokens(seed: int, n_chars: int) -> tuple[np.ndarray, CharTokenizer]:
    """Token ids of the built-in corpus and the tokenizer that produced them."""
    tokenizer = CharTokenizer()
    return tokenizer.encode(arithmetic_text(seed, n_chars)), tokenizer
