"""A token's log-probability with its rank and text, as vLLM's `Logprob` has them.

`Logprob` is a float (the log-probability itself) that also carries `.logprob`, `.rank` and
`.decoded_token`: code written for vLLM reads the attributes, and code that treats the values of a
logprobs dict as numbers (sums, comparisons, JSON) keeps working unchanged.
"""
from __future__ import annotations

from bisect import bisect_left


class Logprob(float):
    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> "Logprob":
        obj = super().__new__(cls, logprob)
        obj.rank = rank
        obj.decoded_token = decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return (Logprob, (float(self), self.rank, self.decoded_token))

    def __str__(self) -> str:  # f"{lp}" prints the number, as for a float
        return float.__repr__(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


def ranked(entry: dict[int, float], sampled_rank: int | None) -> dict[int, Logprob]:
    """One token's logprobs as the engine sends them (the sampled token first, then the top k) with
    ranks: the sampled token's comes from the engine (it may lie far below the top k); a top-k
    token's is 1 + the number of tokens more likely than it, all of which are in the top k too."""
    descending = sorted(-v for v in entry.values())
    out: dict[int, Logprob] = {}
    for i, (token, value) in enumerate(entry.items()):
        rank = sampled_rank if i == 0 and sampled_rank else bisect_left(descending, -value) + 1
        out[token] = Logprob(value, rank)
    return out
