"""Synthetic request traces of known shapes, in the Mooncake trace format.

Each generator is a small workload model with its parameters in the signature, seeded, so
that a policy can be checked on shapes other than the one trace it was looked at on:

- ``shared_prefixes``: a Zipf-popular set of system prompts, each request one prompt plus a
  user suffix of its own (chatbots, agents with a few tool prompts);
- ``conversations``: multi-turn chats that grow by a few blocks a turn, turns separated by
  exponential think times, many chats interleaved (Poisson starts);
- ``documents``: long documents each asked about a few times at random later points, mixed
  with a stream of one-off long documents read once (scans that flush an LRU).

Ids are chained (an id names a whole prefix), as in the Mooncake release.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .format import Request


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _request(ts_ms: float, ids: list[int], block_tokens: int, rng: random.Random) -> Request:
    tail = rng.randint(1, block_tokens)  # the last block is partial, as in real prompts
    return Request(timestamp=int(ts_ms), input_length=(len(ids) - 1) * block_tokens + tail,
                   output_length=rng.randint(16, 512), hash_ids=tuple(ids))


def _zipf_sampler(n: int, alpha: float, rng: random.Random) -> Callable[[], int]:
    weights = [1.0 / (i + 1) ** alpha for i in range(n)]
    population = list(range(n))
    return lambda: rng.choices(population, weights)[0]


def shared_prefixes(*, requests: int = 4000, prompts: int = 200, alpha: float = 1.0, prompt_blocks: tuple[int, int] = (4, 40),
                    suffix_blocks: tuple[int, int] = (1, 16), rate_per_s: float = 4.0, block_tokens: int = 512,
                    seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    ids = _Ids()
    heads = [ids.fresh(rng.randint(*prompt_blocks)) for _ in range(prompts)]
    pick = _zipf_sampler(prompts, alpha, rng)
    out, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate_per_s) * 1000
        out.append(_request(t, heads[pick()] + ids.fresh(rng.randint(*suffix_blocks)), block_tokens, rng))
    return out


def conversations(*, requests: int = 4000, first_blocks: tuple[int, int] = (2, 24), turn_blocks: tuple[int, int] = (1, 4),
                  mean_turns: float = 6.0, think_s: float = 60.0, rate_per_s: float = 4.0, block_tokens: int = 512,
                  seed: int = 0) -> list[Request]:
    """Chats start at rate ``rate_per_s / mean_turns`` (so requests arrive at about
    ``rate_per_s``); each has a geometric number of turns; turn k+1 comes an exponential
    think time after turn k and extends its prompt (the answer and a new question)."""
    rng = random.Random(seed)
    ids = _Ids()
    events: list[tuple[float, int, list[int], int]] = []  # (time, seq, prefix, turns left)
    import heapq

    t, seq = 0.0, 0
    out: list[Request] = []
    while len(out) < requests:
        t += rng.expovariate(rate_per_s / mean_turns) * 1000
        turns = 1
        while rng.random() > 1.0 / mean_turns:
            turns += 1
        heapq.heappush(events, (t, seq, ids.fresh(rng.randint(*first_blocks)), turns))
        seq += 1
        while events and events[0][0] <= t and len(out) < requests:
            when, _, prefix, left = heapq.heappop(events)
            out.append(_request(when, prefix, block_tokens, rng))
            if left > 1:
                grown = prefix + ids.fresh(rng.randint(*turn_blocks))
                heapq.heappush(events, (when + rng.expovariate(1.0 / think_s) * 1000, seq, grown, left - 1))
                seq += 1
    return out


def documents(*, requests: int = 4000, documents: int = 300, doc_blocks: tuple[int, int] = (16, 96), scan_share: float = 0.5,
              alpha: float = 0.8, question_blocks: tuple[int, int] = (1, 2), rate_per_s: float = 4.0,
              block_tokens: int = 512, seed: int = 0) -> list[Request]:
    """A ``scan_share`` of requests read a fresh long document once; the rest ask a question
    about one of ``documents`` shared documents (Zipf popularity ``alpha``)."""
    rng = random.Random(seed)
    ids = _Ids()
    docs = [ids.fresh(rng.randint(*doc_blocks)) for _ in range(documents)]
    pick = _zipf_sampler(documents, alpha, rng)
    out, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate_per_s) * 1000
        if rng.random() < scan_share:
            body = ids.fresh(rng.randint(*doc_blocks))
        else:
            body = docs[pick()]
        out.append(_request(t, body + ids.fresh(rng.randint(*question_blocks)), block_tokens, rng))
    return out


GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "shared-prefixes": shared_prefixes,
    "conversations": conversations,
    "documents": documents,
}
