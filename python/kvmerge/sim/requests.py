"""The requests an engine serves: prompts that share prefixes, arriving over time.

Deterministic from the seed. A prompt is one of ``documents`` shared prefixes
(2 to 8 blocks: a system prompt, a document many users ask about) followed by
its own question (a few blocks and a partial one); it asks for 2 to 24 tokens.
Arrivals per step follow a Poisson law of mean ``rate``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from .model import BLOCK_SIZE, VOCAB


@dataclass(frozen=True)
class Prompt:
    req_id: str
    token_ids: list[int]
    max_tokens: int


class Arrivals:
    """The prompts that arrive at each step."""

    def __init__(self, seed: int = 0, rate: float = 1.0, documents: int = 8) -> None:
        self.rng = random.Random(f"kvmerge-sim/requests/{seed}")
        self.rate = rate
        self.prefixes = [
            [
                self.rng.randrange(VOCAB)
                for _ in range(self.rng.randint(2, 8) * BLOCK_SIZE)
            ]
            for _ in range(documents)
        ]
        self.count = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def _poisson(self) -> int:
        # Knuth's: fine for the small rates of a simulation.
        limit, k, p = math.exp(-self.rate), 0, 1.0
        while True:
            p *= self.rng.random()
            if p <= limit:
                return k
            k += 1

    def prompt(self) -> Prompt:
        rng = self.rng
        prefix = rng.choice(self.prefixes)
        own = rng.randrange(BLOCK_SIZE // 2, 3 * BLOCK_SIZE)
        tokens = prefix + self._tokens(own)
        self.count += 1
        return Prompt(f"req-{self.count}", tokens, rng.randint(2, 24))

    def step(self) -> Iterator[Prompt]:
        for _ in range(self._poisson()):
            yield self.prompt()
