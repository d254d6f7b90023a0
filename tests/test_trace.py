"""Trace replay: the format's errors, the references, the store's replay against them, the
eviction policies' chain invariant, disk admission, and ``cacheseek plan``."""

from __future__ import annotations

import itertools
import json
import random
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cacheseek.errors import ConfigError, InputError
from cacheseek.store.eviction import POLICIES, make_index
from cacheseek.store.tier import BlockInfo
from cacheseek.trace import blocksim, reference, synth
from cacheseek.trace.format import Request, load_trace, parse_lines
from cacheseek.trace.replay import ROOT as ROOT_KEY
from cacheseek.trace.replay import ReplaySpec, StandInFrames, build_store, key_of, replay
from redis_servers import RedisServer, needs_redis

ROOT = Path(__file__).resolve().parent.parent
EXCERPT = ROOT / "tests" / "data" / "mooncake_synthetic_excerpt.jsonl"
FULL = ROOT / "benchmarks" / "traces" / "mooncake_synthetic.jsonl"


# -- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("line, says", [
    ('{"hash_ids": [1, 2', "not valid JSON"),
    ('{"timestamp": 5, "input_length": 3}', "no 'hash_ids'"),
    ('{"hash_ids": [1, "2"]}', "found '2'"),
    ('{"hash_ids": [1, 2.5]}', "found 2.5"),
    ('{"hash_ids": [true]}', "found True"),
    ('{"hash_ids": 7}', "found 7"),
    ('[1, 2]', "expected a JSON object"),
    ('{"hash_ids": [1], "timestamp": -1}', "'timestamp'"),
    ('{"hash_ids": [%d]}' % ((1 << 128) - 1), "below 2^128 - 1 (the replay's root key)"),
    ('{"hash_ids": [%d]}' % (1 << 128), "below 2^128 - 1"),
    ('{"hash_ids": [' + "9" * 5000 + "]}", "cannot read the line (Exceeds the limit (4300"),  # (3.10 words the rest otherwise)
    ("[" * 100_000 + "]" * 100_000, "cannot read the line (nested too deeply)"),
    ('{"hash_ids": [5, 6, 5]}', "id 5 appears twice in 'hash_ids' (positions 0 and 2)"),
    ('{"hash_ids": [1]}', "id 1 is at the start, but line 1 has it after id 0"),
    ('{"hash_ids": [0, 2, 1]}', "id 1 is after id 2, but line 1 has it after id 0"),
])
def test_bad_line_is_named_by_number(tmp_path, line, says):
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [0, 1], "timestamp": 0}\n\n' + line + "\n" + '{"hash_ids": [0]}\n')
    with pytest.raises(InputError) as err:
        load_trace(path)
    assert f"{path}:3:" in str(err.value) and says in str(err.value)


def test_a_line_without_a_timestamp_after_lines_with_one_is_named_as_such(tmp_path):
    """It was "timestamp 0 is before the previous line's": a field it does not have."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [0], "timestamp": 5}\n{"hash_ids": [0, 1]}\n')
    with pytest.raises(InputError, match=rf"^{path}:2: no 'timestamp', after lines that have one"):
        load_trace(path)
    path.write_text('{"hash_ids": [0], "timestamp": 5}\n{"hash_ids": [0, 1], "timestamp": 0}\n')
    with pytest.raises(InputError, match=rf"^{path}:2: timestamp 0 is before the previous line's \(5\)"):
        load_trace(path)


@pytest.mark.parametrize("field", ['"hash_ids": "%s"', '"hash_ids": [[%s]]', '"hash_ids": [1], "timestamp": "%s"'])
def test_a_bad_field_megabytes_long_is_shown_cut_short(field):
    """The error quoted the bad value whole: a field of a megabyte made a megabyte-long
    message (a terminal flooded, the line number scrolled away)."""
    filler = "x" * (1 << 20) if field.endswith('"%s"') else ",".join(["1"] * (1 << 18))
    with pytest.raises(InputError) as err:
        parse_lines(['{"hash_ids": [0]}', "{" + field % filler + "}"])
    assert str(err.value).startswith("trace:2: ") and len(str(err.value)) < 200


def test_a_line_whose_length_takes_other_blocks_than_its_ids_is_named(tmp_path, capsys):
    """Read at one block size, a trace of another counted every block as full, with no
    error (blocks of 16 tokens read at 512: 435 ids for 6,955 tokens)."""
    lines = ['{"hash_ids": [0, 1], "input_length": 1000}', '{"hash_ids": [0, 1, 2], "input_length": 1024}',
             '{"hash_ids": [0], "input_length": 0}', '{"hash_ids": [], "input_length": 3}']
    with pytest.raises(InputError, match=r"^trace:2: 'input_length' 1024 takes 2 blocks of 512 tokens, but "
                                         r"'hash_ids' has 3: are its blocks of another size \(block_tokens\)\?"):
        parse_lines(lines, block_tokens=512)
    with pytest.raises(InputError, match=r"^trace:3: 'input_length' 3 takes 1 block of 512 tokens, but 'hash_ids' has 0"):
        parse_lines([lines[0], lines[2], lines[3]], block_tokens=512)
    # a length of 0 is a trace without lengths: every block full, as before
    assert len(parse_lines(lines[:3], block_tokens=500)) == 3
    assert len(parse_lines(lines)) == 4  # no block size, no check
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines[:2]) + "\n")
    assert _plan_main(tmp_path) == 2
    assert f"{trace}:2: 'input_length' 1024 takes 2 blocks of 512 tokens" in capsys.readouterr().err
    assert not (tmp_path / "rows.json").exists()
    assert _plan_main(tmp_path, "--block-tokens", "500") == 0  # 1000 and 1024 tokens: 2 and 3 blocks of 500


def test_ids_below_the_root_key_and_reused_with_their_prefix_are_accepted():
    top = (1 << 128) - 2
    trace = parse_lines(['{"hash_ids": [3, %d]}' % top, '{"hash_ids": [3, %d, 4]}' % top, '{"hash_ids": [3]}',
                         '{"hash_ids": [5, 6]}'])
    assert [r.hash_ids for r in trace] == [(3, top), (3, top, 4), (3,), (5, 6)]
    assert key_of(top) != ROOT_KEY


def test_plan_refuses_an_unchained_trace_before_replaying(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 1, "hash_ids": [7, 8]}\n'
                     '{"timestamp": 2, "hash_ids": [3, 2]}\n')
    assert _plan_main(tmp_path) == 2
    err = capsys.readouterr().err
    assert f"{trace}:3: id 2 is after id 3, but line 1 has it after id 1" in err and "Traceback" not in err
    assert not (tmp_path / "rows.json").exists()


def test_line_numbers_count_newlines_only_as_grep_does(tmp_path):
    path = tmp_path / "cr.jsonl"
    path.write_bytes(b'{"hash_ids": [1]}\r\r\n{"hash_ids": [1], "timestamp": 1}\r\nBROKEN\n')
    with pytest.raises(InputError, match=rf"^{path}:3: not valid JSON"):
        load_trace(path)
    path.write_bytes(b'{"hash_ids": [1]}\r\n\r\n{"hash_ids": [1, 2]}\r\n')  # CRLF, a blank line
    assert [r.hash_ids for r in load_trace(path)] == [(1,), (1, 2)]


def test_a_byte_that_is_not_utf8_is_named_by_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = b'{"hash_ids": [1], "timestamp": 0}\n'
    # Far enough down that a text stream's read-ahead chunk would already hold it.
    path.write_bytes(good * 500 + b'{"hash_ids": [1], "note": "caf\xe9"}\n' + good)
    with pytest.raises(InputError, match=rf"^{path}:501: not UTF-8 text \(invalid continuation byte at byte 31\)"):
        load_trace(path)


def test_timestamps_must_not_go_back_and_empty_traces_fail():
    with pytest.raises(InputError, match=r"trace:2: timestamp 3 is before"):
        parse_lines(['{"hash_ids": [0], "timestamp": 9}', '{"hash_ids": [0], "timestamp": 3}'])
    with pytest.raises(InputError, match="no requests"):
        parse_lines(["", "  "])
    with pytest.raises(InputError, match="cannot read"):
        load_trace("/nonexistent/trace.jsonl")


def test_plan_refuses_a_bad_trace_before_replaying(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(EXCERPT.read_text().splitlines()[0] + "\n" + '{"hash_ids": [1, "x"]}\n')
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "cacheseek.server.cli", "plan", "--trace", str(path), "--json", str(out),
                           "--plot", str(tmp_path / "p.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{path}:2:" in proc.stderr and "[" not in proc.stderr.split(":2:")[0][-3:]
    assert not out.exists()  # nothing ran on the half-read trace


# -- references and the store's replay -------------------------------------------------

@pytest.fixture(scope="module")
def excerpt():
    return load_trace(EXCERPT)


def test_store_lru_replay_equals_the_block_level_lru(excerpt):
    for blocks in (200, 1000, 3000):
        got = replay(excerpt, ReplaySpec(cpu_blocks=blocks, policy="lru"))
        want = reference.lru(excerpt, blocks)
        assert (got.hit_blocks, got.hit_tokens) == (want.hit_blocks, want.hit_tokens)
        assert got.hits_by_tier == ({"cpu": want.hit_blocks} if want.hit_blocks else {})


@pytest.mark.parametrize("block_tokens", [1, 16, 64, 128, 255, 256, 512])
def test_every_stand_in_frame_takes_the_bytes_a_tier_is_given_per_block(block_tokens):
    """A tier of N blocks holds N stand-in frames, at every position: frames of small
    blocks (vLLM's 16 tokens) near a chain's head were 320 bytes against 384 budgeted, so
    a tier held a fifth more blocks than the real one and the replay's hit rates were high."""
    frames = StandInFrames(block_tokens)
    for pos in (0, 1, 127, 128, 255, 256, 65535, 65536, 1 << 30):
        assert frames.frame(key_of(pos + 1), key_of(pos) if pos else ROOT_KEY, pos).meta.nbytes == frames.nbytes
    trace = parse_lines(['{"hash_ids": [0, 1, 2, 3, 4, 5]}'])
    for blocks in (1, 5):
        assert replay(trace, ReplaySpec(cpu_blocks=blocks, policy="lru"), block_tokens=block_tokens).tiers[0]["blocks"] == blocks


@pytest.mark.parametrize("blocks", [5461, 10922])
def test_a_replayed_cpu_tier_holds_its_whole_budget_of_blocks(blocks):
    """The CPU tier's arena maps its budget in power-of-two chunks, each ending in a gap
    smaller than a frame: at 5,461 and 10,922 stand-in blocks (int2 at 64 and 128 GiB) it
    held one block fewer than the budget, and every put into the full tier scanned it for
    room the arena could not give: the whole trace took 78 s at 10,922 blocks, not 3."""
    trace = parse_lines(['{"hash_ids": [%d, %d]}' % (2 * i, 2 * i + 1) for i in range(blocks // 2 + 50)])
    result = replay(trace, ReplaySpec(cpu_blocks=blocks, policy="lru"))
    assert result.tiers[0]["blocks"] == blocks and result.tiers[0]["evictions"] == 2 * len(trace) - blocks


def test_no_policy_beats_belady_and_belady_stays_below_the_ceiling(excerpt):
    shaped = synth.documents(requests=600, documents=40, seed=3)
    for trace in (excerpt, shaped):
        ceiling = reference.infinite(trace)
        for blocks in (300, 1500):
            best = reference.belady_prefix(trace, blocks)  # raises if the cached set is not prefix-closed
            assert best.hit_blocks <= ceiling.hit_blocks
            assert reference.min_fifo_ties(trace, blocks).hit_blocks <= best.hit_blocks
            for policy in POLICIES:
                assert replay(trace, ReplaySpec(cpu_blocks=blocks, policy=policy)).hit_blocks <= best.hit_blocks


def test_references_at_a_budget_of_no_block_hit_nothing():
    """``policy_sim --blocks 0`` stopped on an IndexError in Belady (and MIN with FIFO ties)."""
    trace = parse_lines(['{"hash_ids": [0, 1]}', '{"hash_ids": [0, 1]}'])
    for ref in (reference.belady_prefix, reference.min_fifo_ties, reference.lru):
        assert ref(trace, 0).hit_blocks == 0
    assert reference.belady_prefix(trace, 1).hit_blocks == 1


def test_anchor_figures_of_issue_19():
    trace = load_trace(FULL)
    assert round(100 * reference.infinite(trace).block_hit_rate, 1) == 64.0
    nxt = reference.next_uses(trace)
    lru = [round(100 * reference.lru(trace, c).block_hit_rate, 1) for c in (1024, 3277, 4096)]
    fifo_min = [round(100 * reference.min_fifo_ties(trace, c, nxt=nxt).block_hit_rate, 1) for c in (1024, 3277, 4096)]
    assert lru == [8.5, 20.1, 24.4]
    assert fifo_min == [26.5, 45.7, 49.1]  # issue 19 quotes 45.6 for the middle one


def test_tokens_count_the_partial_last_block():
    reqs = parse_lines(['{"hash_ids": [0, 1], "input_length": 600}', '{"hash_ids": [0, 1], "input_length": 600}'])
    inf = reference.infinite(reqs, block_tokens=512)
    assert (inf.hit_tokens, inf.requested_tokens) == (600, 1200)


def test_full_blocks_only_never_stores_nor_hits_a_partial_last_block():
    lines = ['{"hash_ids": [0, 1, 2], "input_length": 1100}',  # 2 full blocks + 76 tokens
             '{"hash_ids": [0, 1, 2], "input_length": 1100}',
             '{"hash_ids": [0, 1], "input_length": 1024}',  # both full
             '{"hash_ids": [0, 1], "input_length": 1024}',
             '{"hash_ids": [0, 1]}']  # no input_length: every block full
    reqs = parse_lines(lines)
    assert [reference.cached_blocks(r, 512, True) for r in reqs] == [2, 2, 2, 2, 2]
    assert [reference.cached_blocks(r, 512, False) for r in reqs] == [3, 3, 2, 2, 2]
    issue = reference.infinite(reqs)
    store = reference.infinite(reqs, full_blocks_only=True)
    assert (issue.hit_blocks, store.hit_blocks) == (3 + 2 + 2 + 2, 2 + 2 + 2 + 2)
    assert store.requested_blocks == issue.requested_blocks == 12  # the partial block is still requested
    assert store.hit_tokens == 1024 * 4
    for blocks in (2, 3, 5):  # (a tier smaller than one request's chain puts differently)
        got = replay(reqs, ReplaySpec(cpu_blocks=blocks, policy="lru", full_blocks_only=True))
        assert got.hit_blocks == reference.lru(reqs, blocks, full_blocks_only=True).hit_blocks
        assert got.hit_blocks <= reference.belady_prefix(reqs, blocks, full_blocks_only=True).hit_blocks
    # two blocks of room hold the whole reusable prefix when the partial block is not stored
    assert replay(reqs, ReplaySpec(cpu_blocks=2, policy="lru", full_blocks_only=True)).hit_blocks == 8
    assert replay(reqs, ReplaySpec(cpu_blocks=2, policy="lru")).tiers[0]["blocks"] == 2


def test_store_replay_follows_the_references_in_both_countings(excerpt):
    for full in (False, True):
        nxt = reference.next_uses(excerpt, full_blocks_only=full)
        for blocks in (300, 1500):
            best = reference.belady_prefix(excerpt, blocks, nxt=nxt, full_blocks_only=full)
            assert reference.min_fifo_ties(excerpt, blocks, nxt=nxt, full_blocks_only=full).hit_blocks <= best.hit_blocks
            assert best.hit_blocks <= reference.infinite(excerpt, full_blocks_only=full).hit_blocks
            got = replay(excerpt, ReplaySpec(cpu_blocks=blocks, policy="lru", full_blocks_only=full))
            assert got.hit_blocks == reference.lru(excerpt, blocks, full_blocks_only=full).hit_blocks
            for policy in POLICIES:
                assert replay(excerpt, ReplaySpec(cpu_blocks=blocks, policy=policy,
                                                  full_blocks_only=full)).hit_blocks <= best.hit_blocks


# -- tiny traces, brute force -------------------------------------------------------------

# A request: the branch taken at each depth of a prefix tree, and its last block's tokens.
_paths = st.lists(st.tuples(st.lists(st.integers(0, 1), max_size=5), st.integers(1, 4)), min_size=1, max_size=6)


def _chained(paths: list, block_tokens: int) -> list[Request]:
    ids: dict = {}
    out = []
    for branches, last in paths:
        chain, parent = [], None
        for b in branches:
            parent = ids.setdefault((parent, b), len(ids))
            chain.append(parent)
        length = (len(chain) - 1) * block_tokens + min(last, block_tokens) if chain else 0
        out.append(Request(0, length, 0, tuple(chain)))
    return out


def _cacheable(trace: list[Request], block_tokens: int, full: bool) -> list[tuple[int, ...]]:
    return [r.hash_ids[: reference.cached_blocks(r, block_tokens, full)] for r in trace]


def _best_prefix_hits(chains: list[tuple[int, ...]], budget: int) -> int:
    """The most prefix hits of any policy: after each request, the cache may become any set
    of at most ``budget`` blocks among what it held and the request's blocks (every
    eviction and bypass), keeping only blocks that some later request names."""
    later = [set().union(*chains[t + 1 :]) for t in range(len(chains))]
    best = {frozenset(): 0}
    for t, ids in enumerate(chains):
        nxt: dict[frozenset, int] = {}
        for held, hits in best.items():
            hits += reference.prefix_hits(ids, held)
            pool = sorted((held | set(ids)) & later[t])
            for k in range(min(budget, len(pool)) + 1):
                for kept in itertools.combinations(pool, k):
                    key = frozenset(kept)
                    nxt[key] = max(nxt.get(key, -1), hits)
        best = nxt
    return max(best.values())


@settings(max_examples=80, deadline=None)
@given(_paths, st.sampled_from([1, 2, 4]))
def test_the_references_count_what_they_say_on_tiny_traces(paths, block_tokens):
    """Belady's prefix hits are the best of every eviction and bypass choice; MIN with FIFO
    ties, LRU and the infinite cache are the plain algorithms their docstrings name; token
    counts weigh a partial last block by its tokens. Budgets of 0 to 6 blocks, both countings."""
    trace = _chained(paths, block_tokens)
    for full in (False, True):
        chains = _cacheable(trace, block_tokens, full)
        nxt = reference.next_uses(trace, block_tokens, full)
        seen: set[int] = set()
        inf_hits = []
        for ids in chains:
            inf_hits.append(reference.prefix_hits(ids, seen))
            seen.update(ids)
        inf = reference.infinite(trace, block_tokens, full)
        assert inf.hit_blocks == sum(inf_hits)
        for budget in range(7):
            belady = reference.belady_prefix(trace, budget, block_tokens, nxt=nxt, full_blocks_only=full)
            assert belady.hit_blocks == _best_prefix_hits(chains, budget), (budget, full)
            assert reference.min_fifo_ties(trace, budget, block_tokens, nxt=nxt, full_blocks_only=full).hit_blocks \
                == _min_fifo_ties(chains, budget)
            hits = []
            lru = reference.lru(trace, budget, block_tokens, full, observe=lambda t, n: hits.append(n))
            assert hits == _lru(chains, budget) and lru.hit_blocks == sum(hits)
            for result, per_request in ((lru, hits), (inf, inf_hits)):
                # a hit block is whole except a partial last one (input_length past the full blocks)
                assert result.hit_tokens == sum(min(n * block_tokens, r.input_length) for r, n in zip(trace, per_request))
                assert result.requested_tokens == sum(r.input_length for r in trace)


def _min_fifo_ties(chains: list[tuple[int, ...]], budget: int) -> int:
    """MIN over the blocks in arrival order, every block admitted: the block next named
    farthest ahead is evicted (a block of this request not yet reached is next named now),
    ties to the one cached earliest."""
    cached: dict[int, int] = {}  # block -> when it was cached
    hits = clock = 0
    for t, ids in enumerate(chains):
        hits += reference.prefix_hits(ids, cached)
        for i, x in enumerate(ids):
            if x not in cached and budget:
                if len(cached) >= budget:
                    def ahead(y: int) -> int:
                        if y in ids[i + 1 :]:
                            return t
                        return next((s for s in range(t + 1, len(chains)) if y in chains[s]), len(chains))
                    del cached[max(cached, key=lambda y: (ahead(y), -cached[y]))]
                clock += 1
                cached[x] = clock
    return hits


def _lru(chains: list[tuple[int, ...]], budget: int) -> list[int]:
    """LRU, each request's blocks used tail first (its head the most recent)."""
    order: list[int] = []
    hits = []
    for ids in chains:
        hits.append(reference.prefix_hits(ids, order))
        for x in reversed(ids):
            if x in order:
                order.remove(x)
            order.append(x)
            del order[: max(0, len(order) - budget)]
    return hits


@settings(max_examples=60, deadline=None)
@given(_paths, st.sampled_from([1, 2, 4]))
@example([([0, 0, 0, 0], 1), ([0, 0, 0, 0, 0], 2), ([0, 0, 0, 0, 0], 1), ([0, 0], 2)], 2)
def test_the_store_replay_equals_the_block_simulation_on_tiny_traces(paths, block_tokens):
    """Every policy, budgets of 1 to 6 blocks (a chain longer than the tier too), both
    countings: the store and ``blocksim`` (the calls PrefixCache makes, stored blocks
    touched before the puts) hit the same blocks, and neither beats Belady. The example:
    the replay touched them after its puts, which had evicted them (5 hits against 3)."""
    trace = _chained(paths, block_tokens)
    for full in (False, True):
        for blocks in range(1, 7):
            best = reference.belady_prefix(trace, blocks, block_tokens, full_blocks_only=full).hit_blocks
            for policy in POLICIES:
                want = blocksim.simulate(trace, policy, blocks, block_tokens=block_tokens, full_blocks_only=full)
                got = replay(trace, ReplaySpec(cpu_blocks=blocks, policy=policy, full_blocks_only=full),
                             block_tokens=block_tokens)
                assert (got.hit_blocks, got.hit_tokens) == (want.hit_blocks, want.hit_tokens), (policy, blocks, full)
                assert got.hit_blocks <= best
                assert got.hits_by_tier == ({"cpu": got.hit_blocks} if got.hit_blocks else {})
                if policy == "lru":  # (a chain longer than the tier too: its stored head spared)
                    assert got.hit_blocks == reference.lru(trace, blocks, block_tokens, full).hit_blocks, blocks


# -- eviction policies ---------------------------------------------------------------------

def _chains(rng: random.Random, n: int) -> list[list[int]]:
    """Requests over a random prefix tree (shared heads, branches, one-off tails)."""
    trees: list[list[int]] = []
    nxt = 0
    out = []
    for _ in range(n):
        if trees and rng.random() < 0.7:
            base = rng.choice(trees)
            cut = rng.randint(1, len(base))
            ids = base[:cut]
        else:
            ids = []
        extra = rng.randint(0 if ids else 1, 6)
        ids = ids + list(range(nxt, nxt + extra))
        nxt += extra
        trees.append(ids)
        out.append(ids)
    return out


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_evicts_leaves_only(policy):
    """A victim never has a child stored in the tier: a chain loses its tail before its head."""
    rng = random.Random(7)
    index = make_index(policy, 40 * 100)
    parents: dict[bytes, bytes] = {}
    evicted = 0
    for ids in _chains(rng, 400):
        keys = [key_of(x) for x in ids]
        present = index.contains_many(keys)
        for i in range(len(ids) - 1, -1, -1):  # tail first, as the store puts
            if not present[i]:
                while index.used_bytes + 100 > index.capacity_bytes:
                    victim = index.victim()
                    assert not any(parents.get(k) == victim for k in index.keys()), "evicted a head before its tail"
                    index.remove(victim, evicted=True)
                    evicted += 1
                parents[keys[i]] = keys[i - 1] if i else b"root"
                index.add(keys[i], BlockInfo(100, 200, parents[keys[i]], i))
        index.touch([k for k, p in zip(reversed(keys), reversed(present)) if p])
        assert index.used_bytes <= index.capacity_bytes
    assert evicted > 100


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_block_stored_again_under_another_parent_moves_its_child_link(policy):
    index = make_index(policy, 100)
    a, b, k = b"A" * 16, b"B" * 16, b"K" * 16
    index.add(a, BlockInfo(1, 1, bytes(16), 0))
    index.add(b, BlockInfo(1, 1, bytes(16), 0))
    index.add(k, BlockInfo(1, 1, a, 1))
    index.add(k, BlockInfo(1, 1, b, 1))  # the same key stored again, now under B
    assert index.children(a) == [] and index.children(b) == [k]
    index.remove(k)
    victim = index.victim()
    assert victim in (a, b) and index.remove(victim, evicted=True) is not None
    index.add(k, BlockInfo(1, 1, bytes(16), 0))
    index.add(k, BlockInfo(2, 2, bytes(16), 0))  # re-sized only: still a head, no link
    assert index.children(bytes(16)) == [] and index.used_bytes == 3


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_cycle_of_links_does_not_hang_the_walk_to_a_leaf(policy):
    """Links whose positions disagree (frames from outside the library; the server refuses
    them) can close into a cycle: the walk to a leaf still ends, and evicting breaks it."""
    index = make_index(policy, 10 * 100)
    a, b = key_of(1), key_of(2)
    index.add(a, BlockInfo(100, 100, b, 5))
    index.add(b, BlockInfo(100, 100, a, 6))
    victim = index.victim()
    assert victim in (a, b)
    index.remove(victim, evicted=True)
    assert index.victim() == ({a, b} - {victim}).pop()


def _arc_key(i: int) -> bytes:
    return bytes([i + 1]) * 16


def test_a_deleted_block_stored_while_pinned_is_no_ghost_of_arc():
    index = make_index("arc", 10)
    key, info = _arc_key(0), BlockInfo(1, 1, bytes(16), 0)
    index.add(key, info)
    index.remove(key, evicted=True)  # a ghost in B1
    index.pin([key])
    index.add(key, info)  # stored while pinned
    index.remove(key)  # a plain delete
    index.unpin([key])
    index.add(key, info)
    assert index.ghost_hits == 0 and index.p == 0 and index.describe()["ghost_bytes"] == 0


def test_an_arc_ghost_hit_on_a_larger_block_keeps_the_ghosts_within_2c():
    index = make_index("arc", 10)
    for i in range(10):  # ten blocks used twice (T2), then evicted: ten bytes of B2 ghosts
        index.add(_arc_key(i), BlockInfo(1, 1, bytes(16), 0))
        index.touch([_arc_key(i)])
    for i in range(10):
        index.remove(_arc_key(i), evicted=True)
    for i in range(10, 20):
        index.add(_arc_key(i), BlockInfo(1, 1, bytes(16), 0))
    index.remove(_arc_key(10), evicted=True)
    index.remove(_arc_key(11), evicted=True)
    index.add(_arc_key(0), BlockInfo(3, 3, bytes(16), 0))  # a B2 ghost back, three times larger
    assert index.ghost_hits == 1
    assert index._t1_bytes + index._t2_bytes + index._b1_bytes + index._b2_bytes <= 20


@settings(max_examples=500)
@given(st.lists(st.tuples(st.sampled_from(["add", "touch", "evict", "delete", "pin", "unpin"]), st.integers(0, 4),
                          st.integers(1, 4)), max_size=80))
def test_arc_ghosts_stay_within_2c_and_never_hold_a_deleted_block(ops):
    c = 6
    index = make_index("arc", c)
    deleted: set[bytes] = set()  # deleted since they were last evicted
    for op, i, n in ops:
        key = _arc_key(i)
        if op == "add" and key not in index:  # as a tier does: room first, then the block
            while index.used_bytes + n > c and (victim := index.victim()) is not None:
                index.remove(victim, evicted=True)
                deleted.discard(victim)
            if index.used_bytes + n <= c:
                index.add(key, BlockInfo(n, n, bytes(16), 0))
        elif op == "touch":
            index.touch([key])
        elif op == "evict" and (victim := index.victim()) is not None:
            index.remove(victim, evicted=True)
            deleted.discard(victim)
        elif op == "delete" and index.remove(key) is not None:
            deleted.add(key)
        elif op == "pin":
            index.pin([key])
        elif op == "unpin":
            index.unpin([key])
        t1, t2, b1, b2 = (sum(lst.values()) for lst in (index._t1, index._t2, index._b1, index._b2))
        assert (t1, t2, b1, b2) == (index._t1_bytes, index._t2_bytes, index._b1_bytes, index._b2_bytes)
        assert t1 + b1 <= c and t1 + t2 + b1 + b2 <= 2 * c, (op, t1, t2, b1, b2)
        assert not deleted & (index._b1.keys() | index._b2.keys()), "a deleted block is a ghost"


def test_an_arc_ghost_hit_moves_p_by_arcs_step_with_the_ghost_still_counted():
    """ARC's step on a B1 ghost hit is |B2| / |B1| with the hit still in B1. Taken after it
    left, the last ghost of B1 was divided by max(0, 1) byte: p went to the whole budget at
    once (here 1,000 instead of 100), and a B2 ghost hit took it to 0 the same way."""
    index = make_index("arc", 1000)
    k1, k2 = _arc_key(0), _arc_key(1)
    index.add(k1, BlockInfo(100, 100, bytes(16), 0))
    index.touch([k1])  # T2
    index.add(k2, BlockInfo(100, 100, bytes(16), 0))  # T1
    assert index.victim() == k2
    index.remove(k2, evicted=True)  # B1 = {k2}
    assert index.victim() == k1
    index.remove(k1, evicted=True)  # B2 = {k1}
    index.add(k2, BlockInfo(100, 100, bytes(16), 0))  # the B1 ghost: |B2| / |B1| = 1
    assert index.p == 100
    index.remove(k2, evicted=True)  # B2 = {k1, k2}
    index.add(k1, BlockInfo(100, 100, bytes(16), 0))  # a B2 ghost, B1 empty: one step down
    assert index.p == 0 and index.ghost_hits == 2
    index.add(_arc_key(2), BlockInfo(100, 100, bytes(16), 0))
    index.remove(_arc_key(2), evicted=True)  # B1 = {k3}, B2 = {k2}
    index.add(k2, BlockInfo(100, 100, bytes(16), 0))  # the last B2 ghost: p stays at 0, not below
    index.add(_arc_key(2), BlockInfo(100, 100, bytes(16), 0))  # the last B1 ghost, B2 empty: + 1 step
    assert index.p == 100


def test_an_arc_block_stored_again_larger_keeps_the_ghosts_within_2c():
    """A block stored again with a larger frame grew T1 or T2 without trimming the ghosts,
    which then held more than ARC's 2c in all (21 of 20 bytes here) until the next add."""
    index = make_index("arc", 10)
    k = [_arc_key(i) for i in range(4)]

    def add(i: int, n: int) -> None:
        index.add(k[i], BlockInfo(n, n, bytes(16), 0))

    add(1, 4)
    add(2, 3)
    index.remove(k[1], evicted=True)  # B1
    add(1, 5)  # a B1 ghost: T2
    index.remove(k[1], evicted=True)  # B2 = 5
    add(0, 4)
    add(2, 6)  # stored again larger: T2
    index.remove(k[2], evicted=True)  # B2 = 11
    add(3, 3)
    add(3, 6)  # stored again larger: T1 4 + T2 6 + B2 11 was 21
    assert index._t1_bytes + index._t2_bytes + index._b1_bytes + index._b2_bytes <= 20
    assert index._t1_bytes + index._t2_bytes == index.used_bytes == 10


class _ReferenceArc:
    """ARC as its paper gives it (Megiddo and Modha, FAST'03, figure 4), in bytes, written
    apart from ``ArcIndex``: what the tier does with it (evict until a block fits, then add
    it, so without the paper's tie rule), pinned blocks out of the four lists, a delete that
    forgets a stored block."""

    def __init__(self, c: int) -> None:
        from collections import OrderedDict

        self.c, self.p = c, 0.0
        self.t1, self.t2, self.b1, self.b2 = (OrderedDict() for _ in range(4))
        self.stored: dict[bytes, int] = {}
        self.pinned: set[bytes] = set()

    @staticmethod
    def _bytes(*lists) -> int:
        return sum(sum(lst.values()) for lst in lists)

    def victim(self) -> bytes | None:
        if self.t1 and (self._bytes(self.t1) > self.p or not self.t2):
            return next(iter(self.t1))
        return next(iter(self.t2), None)

    def _trim(self) -> None:
        while self.b1 and self._bytes(self.t1, self.b1) > self.c:
            self.b1.popitem(last=False)
        while self.b2 and self._bytes(self.t1, self.t2, self.b1, self.b2) > 2 * self.c:
            self.b2.popitem(last=False)

    def _admit(self, key: bytes, n: int) -> None:
        if key in self.b1:  # case II
            self.p = min(self.c, self.p + n * max(self._bytes(self.b2) / self._bytes(self.b1), 1))
            del self.b1[key]
            self.t2[key] = n
        elif key in self.b2:  # case III
            self.p = max(0.0, self.p - n * max(self._bytes(self.b1) / self._bytes(self.b2), 1))
            del self.b2[key]
            self.t2[key] = n
        else:  # case IV
            self.t1[key] = n
        self._trim()

    def evict(self, key: bytes) -> None:
        del self.stored[key]
        for t, b in ((self.t1, self.b1), (self.t2, self.b2)):
            if key in t:
                b[key] = t.pop(key)
        self._trim()

    def delete(self, key: bytes) -> None:
        if self.stored.pop(key, None) is not None:
            for lst in (self.t1, self.t2, self.b1, self.b2):
                lst.pop(key, None)

    def add(self, key: bytes, n: int) -> None:
        if key in self.stored:  # stored again (another size): a use
            self.stored[key] = n
            if key not in self.pinned:
                (self.t1 if key in self.t1 else self.t2)[key] = n
                self._trim()
                self.touch(key)
            return
        self.stored[key] = n
        if key in self.pinned:
            self.b1.pop(key, None)
            self.b2.pop(key, None)
        else:
            self._admit(key, n)

    def touch(self, key: bytes) -> None:
        if key in self.t1:
            self.t2[key] = self.t1.pop(key)
        elif key in self.t2:
            self.t2.move_to_end(key)

    def pin(self, key: bytes) -> None:
        if key not in self.pinned:
            self.pinned.add(key)
            self.t1.pop(key, None)
            self.t2.pop(key, None)

    def unpin(self, key: bytes) -> None:
        if key in self.pinned:
            self.pinned.discard(key)
            if key in self.stored:
                self._admit(key, self.stored[key])


class ArcAgainstTheReference(RuleBasedStateMachine):
    """``ArcIndex`` driven as a tier drives it (blocks of 1 to 12 bytes in a 40-byte budget,
    overwrites at another size, evictions, touches, deletes, pins), and the reference ARC
    beside it: the same victim every time, the same four lists in the same order, the same
    p; p within [0, c] and the stored bytes within c."""

    C = 40
    KEYS = [_arc_key(i) for i in range(10)]

    def __init__(self) -> None:
        super().__init__()
        self.index = make_index("arc", self.C)
        self.ref = _ReferenceArc(self.C)

    def _evict(self) -> bool:
        victim = self.index.victim()
        assert victim == self.ref.victim()
        if victim is None:
            return False
        self.index.remove(victim, evicted=True)
        self.ref.evict(victim)
        return True

    @rule(i=st.integers(0, 9), n=st.integers(1, 12))
    def add(self, i, n):
        key = self.KEYS[i]
        while self.index.used_bytes - self.ref.stored.get(key, 0) + n > self.C and self._evict():
            pass
        if self.index.used_bytes - self.ref.stored.get(key, 0) + n <= self.C:
            self.index.add(key, BlockInfo(n, n, bytes(16), 0))
            self.ref.add(key, n)

    @rule()
    def evict(self):
        self._evict()

    @rule(i=st.integers(0, 9))
    def touch(self, i):
        self.index.touch([self.KEYS[i]])
        self.ref.touch(self.KEYS[i])

    @rule(i=st.integers(0, 9))
    def delete(self, i):
        self.index.remove(self.KEYS[i])
        self.ref.delete(self.KEYS[i])

    @rule(i=st.integers(0, 9))
    def pin(self, i):
        self.index.pin([self.KEYS[i]])
        self.ref.pin(self.KEYS[i])

    @rule(i=st.integers(0, 9))
    def unpin(self, i):
        self.index.unpin([self.KEYS[i]])
        self.ref.unpin(self.KEYS[i])

    @invariant()
    def matches_the_reference(self):
        index, ref = self.index, self.ref
        assert [list(lst.items()) for lst in (index._t1, index._t2, index._b1, index._b2)] == \
            [list(lst.items()) for lst in (ref.t1, ref.t2, ref.b1, ref.b2)]
        assert index.p == pytest.approx(ref.p, abs=1e-9) and 0 <= index.p <= self.C
        t1, t2, b1, b2 = index._t1_bytes, index._t2_bytes, index._b1_bytes, index._b2_bytes
        assert t1 + t2 + index.pinned_bytes == index.used_bytes <= self.C
        assert (not b1 or t1 + b1 <= self.C) and (not b2 or t1 + t2 + b1 + b2 <= 2 * self.C)  # ARC's bounds


TestArcAgainstTheReference = ArcAgainstTheReference.TestCase
TestArcAgainstTheReference.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_arc_keeps_reused_blocks_through_a_scan():
    index = make_index("arc", 10 * 100)
    hot = [key_of(i) for i in range(4)]
    for k in hot:
        index.add(k, BlockInfo(100, 100, b"r", 0))
    index.touch(hot)  # used again: T2
    for i in range(100, 160):  # a one-off scan of 60 blocks
        while index.used_bytes + 100 > index.capacity_bytes:
            index.remove(index.victim(), evicted=True)
        index.add(key_of(i), BlockInfo(100, 100, b"r", 0))
    assert all(k in index for k in hot)
    lru = make_index("lru", 10 * 100)
    for k in hot:
        lru.add(k, BlockInfo(100, 100, b"r", 0))
    for i in range(100, 160):
        while lru.used_bytes + 100 > lru.capacity_bytes:
            lru.remove(lru.victim(), evicted=True)
        lru.add(key_of(i), BlockInfo(100, 100, b"r", 0))
    assert not any(k in lru for k in hot)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("reserve", ["1KiB", None, "8MiB"], ids=["reserve-tiny", "reserve-default", "reserve-whole"])
def test_an_ingest_keeps_every_block_it_stores_once_older_blocks_were_reused(policy, reserve):
    """Every older block read back once (ARC's T2), a fresh prompt's blocks are the only
    ones used once: added one by one, each evicting for itself, they gave up each other
    (the ingest answered "stored" for blocks already gone). Room is made for the whole
    call first: in place, with a reserve smaller than a call (its runs committed as they
    land) or holding it all, and through put_many."""
    import torch

    import cacheseek as cs

    layout, block, n = cs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16"), 32, 16
    frame = cs.Raw().encoded_nbytes(layout, block) + 4096
    tiers = cs.TierConfig(cpu_bytes=4 * n * frame, pin_memory=False, eviction=policy, cpu_reserve_bytes=reserve)
    gen = torch.Generator().manual_seed(0)
    with cs.PrefixCache(model_id="x", layout=layout, codec=cs.Raw(), block_tokens=block, tiers=tiers) as cache:
        for i in range(8):
            toks = list(range(i * 10_000, i * 10_000 + n * block))
            kv = [tuple(torch.randn(1, 2, n * block, 64, generator=gen).half() for _ in range(2)) for _ in range(2)]
            assert cache.ingest(toks, kv).stored == n
            assert cache.locate(toks).num_blocks == n, f"call {i}"
            assert cache.materialize(toks).num_blocks == n  # read back: T2
    # put_many (frames handed over whole: a server's PUT, demotions), stand-in frames
    frames = StandInFrames(512)
    store = build_store(ReplaySpec(cpu_blocks=4 * n, policy=policy), frames.nbytes, None)
    try:
        for i in range(8):
            chain = [key_of(i * 1000 + j) for j in range(n)]
            items = [(k, frames.frame(k, chain[j - 1] if j else b"\xff" * 16, j)) for j, k in enumerate(chain)][::-1]
            assert all(o.stored for o in store.put_many(items)), f"call {i}"
            assert store.locate(chain) == ["cpu"] * n, f"call {i}"
            store.touch_chain(chain)  # read back: T2
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["cpu", "gpu", "disk", "disk-one-by-one"])
def test_a_tier_makes_room_for_all_of_a_put_many_before_the_first_frame(kind, tmp_path):
    """The same on the tiers themselves (the GPU tier's code on CPU tensors): a batch of new
    frames never evicts its own frames, whatever the policy last reused. The disk tier's
    frames written one by one (no group commit) each evicted for itself: of 8 new blocks of
    an embedded disk-only cache, 1 was left."""
    from cacheseek.store.cpu import CpuTier
    from cacheseek.store.disk import DiskTier
    from cacheseek.store.gpu import GpuTier

    frames, n = StandInFrames(512), 8
    if kind.startswith("disk"):
        probe = DiskTier(tmp_path / "probe", 1 << 20, fsync=False)
        charge = probe.charge(frames.nbytes)
        probe.close()
        tier = DiskTier(tmp_path / "disk", 4 * n * charge, fsync=False, policy="arc", group_commit=kind == "disk")
    else:
        tier = CpuTier(4 * n * frames.nbytes, policy="arc") if kind == "cpu" else \
            GpuTier(4 * n * frames.nbytes, device="cpu", policy="arc")
    for i in range(6):
        chain = [key_of(i * 1000 + j) for j in range(n)]
        items = [(k, frames.frame(k, chain[j - 1] if j else b"\xff" * 16, j)) for j, k in enumerate(chain)][::-1]
        results = tier.put_many(items)
        assert all(r.stored is not None for r in results)
        assert all(tier.contains(k) for k in chain), f"call {i}"
        evicted = [k for r in results for k, _ in r.evicted]
        assert not set(evicted) & set(chain) and len(evicted) == (n if i >= 4 else 0)
        tier.touch(chain)  # used again: ARC's T2
    tier.close()


def test_unknown_policy_is_a_config_error():
    import cacheseek as cs

    with pytest.raises(ConfigError, match="eviction"):
        cs.TierConfig(cpu_bytes="1MiB", eviction="mru").build()
    with pytest.raises(ConfigError, match="disk_admit_after_uses"):
        cs.TierConfig(cpu_bytes="1MiB", disk_admit_after_uses=0).build()


def test_server_setting_names_every_policy():
    pytest.importorskip("pydantic_settings")
    from cacheseek.server.config import ServerSettings

    assert set(ServerSettings.model_fields["eviction"].annotation.__args__) == set(POLICIES)
    with pytest.raises(Exception, match="eviction"):
        ServerSettings(eviction="mru")


# -- disk admission --------------------------------------------------------------------------

def test_disk_admits_a_block_only_once_it_is_used_twice(tmp_path):
    frames = StandInFrames(512)
    store = build_store(ReplaySpec(cpu_blocks=2, disk_blocks=10, disk_admit_after_uses=2, policy="lru"), frames.nbytes, str(tmp_path))
    try:
        keys = [key_of(i) for i in range(4)]
        store.put_many([(keys[0], frames.frame(keys[0], b"\xff" * 16, 0))])
        disk = store.tier("disk")
        assert not disk.contains(keys[0])  # written through? not yet: used once
        store.touch_chain([keys[0]])  # a hit: its second use
        for i in (1, 2):  # push keys[0] out of the 2-block CPU tier
            store.put_many([(keys[i], frames.frame(keys[i], b"\xff" * 16, 0))])
        assert disk.contains(keys[0])  # handed down at eviction, now admitted
        assert not disk.contains(keys[1])  # used once, evicted from nowhere yet
        store.put_many([(keys[3], frames.frame(keys[3], b"\xff" * 16, 0))])
        assert not disk.contains(keys[1])  # evicted from the CPU tier, used once: not written
        adm = next(t for t in store.stats()["tiers"] if t["name"] == "disk")["admission"]
        assert adm["not_admitted"] == 1  # keys[1]: the others were admitted or are still above
    finally:
        store.close()


def test_disk_admission_counts_each_block_it_spares_once(tmp_path):
    """A block refused when written through (the CPU tier holds it) and again when the CPU
    tier hands it down was counted twice: on the replay, 24,518 refusals (and their bytes)
    for 12,833 blocks requested, about twice the writes spared. A refusal is counted where
    it is final: the blocks and bytes not written add up with those written."""
    frames = StandInFrames(512)
    store = build_store(ReplaySpec(cpu_blocks=2, disk_blocks=10, disk_admit_after_uses=2, policy="lru"), frames.nbytes,
                        str(tmp_path / "disk"))
    try:
        keys = [key_of(i) for i in range(6)]
        for key in keys:  # each used once: the CPU tier keeps the last two, the rest are dropped
            store.put_many([(key, frames.frame(key, b"\xff" * 16, 0))])
        disk = next(t for t in store.stats()["tiers"] if t["name"] == "disk")
        assert (disk["admission"]["not_admitted"], disk["admission"]["not_admitted_bytes"]) == (4, 4 * frames.nbytes)
        assert disk["bytes_in"] == 0
    finally:
        store.close()
    trace = load_trace(EXCERPT)
    spec = ReplaySpec(cpu_blocks=300, disk_blocks=600, disk_admit_after_uses=2, policy="lru")
    result = replay(trace, spec)
    cpu, disk = result.tiers
    spared = disk["admission"]["not_admitted"]
    # a block the CPU tier gave up was on disk already, written there (a demotion) or spared
    assert 0 < spared and spared + disk["demotions"] <= cpu["evictions"]
    assert disk["admission"]["not_admitted_bytes"] == spared * frames.nbytes


def test_disk_admission_counts_fade_over_ten_times_the_blocks_the_disk_holds(tmp_path):
    """TinyLFU's window is ten times the blocks the tier holds: counted by its budget over
    frame bytes, a disk tier whose blocks are charged whole file-system blocks (the replay's
    small stand-in frames: 384 bytes, 8 KiB on disk) had its counts halved 21 times too
    seldom, and admitted blocks whose uses had long faded."""
    frames = StandInFrames(512)
    store = build_store(ReplaySpec(cpu_blocks=2, disk_blocks=10, disk_admit_after_uses=2, policy="lru"), frames.nbytes,
                        str(tmp_path / "disk"))
    try:
        keys = [key_of(i) for i in range(5)]

        def put(i):
            store.put_many([(keys[i], frames.frame(keys[i], b"\xff" * 16, 0))])

        disk = store.tier("disk")
        put(0)
        store.touch_chain([keys[0]])
        put(1)
        put(2)  # keys[0], used twice, handed down: admitted (the filter's window set)
        assert disk.contains(keys[0])
        store.touch_chain([keys[1]])  # used twice
        store.touch_chain([key_of(100 + i) for i in range(150)])  # more than 10 x 10 uses: counts halved
        put(3)
        put(4)  # keys[1] handed down, its count faded to one use
        assert not disk.contains(keys[1])
    finally:
        store.close()


def test_disk_admission_counts_fade_over_the_blocks_the_disk_holds_after_a_refit(tmp_path):
    """A full filesystem lowers the disk tier's budget (a refit): the filter's window, ten
    times the blocks the tier holds, follows it, where it kept the window of the budget it
    read at start and let counts fade too seldom for the tier it had become."""
    frames = StandInFrames(512)
    store = build_store(ReplaySpec(cpu_blocks=2, disk_blocks=10, disk_admit_after_uses=2, policy="lru"), frames.nbytes,
                        str(tmp_path / "disk"))
    try:
        keys = [key_of(i) for i in range(4)]
        for i, key in enumerate(keys):
            store.put_many([(key, frames.frame(key, b"\xff" * 16, 0))])
            store.touch_chain([key])  # used twice: admitted once handed down
        disk = store.tier("disk")
        assert [disk.contains(k) for k in keys] == [True, True, False, False]

        def window() -> int:
            return next(t for t in store.stats()["tiers"] if t["name"] == "disk")["admission"]["window"]

        assert window() == 10 * 10
        disk._refit(full=True)  # what a write that met ENOSPC does: the budget is what is held
        assert disk.capacity_bytes == 2 * disk.charge(frames.nbytes)
        assert window() == 10 * 2
    finally:
        store.close()


@needs_redis
def test_disk_admission_holds_back_only_the_disks_writes(tmp_path):
    """A tier below the disk that is written through (Redis, the default write-through and
    then the store's acknowledging tier) gets every block, admitted to the disk or not."""
    import cacheseek as cs
    from store_helpers import raw_frame

    server = RedisServer(tmp_path / "redis").start()
    store = cs.TierConfig(cpu_bytes="16MiB", disk_path=str(tmp_path / "d"), disk_bytes="64MiB",
                          disk_admit_after_uses=2, redis_url=server.url, redis_bytes="64MiB").build()
    try:
        key, frame = raw_frame(5)
        outcome = store.put(key, frame)
        assert outcome.stored and not outcome.errors, outcome
        assert store.tier("redis").contains(key) and not store.tier("disk").contains(key)
        assert store.tier("redis").get(key).to_bytes() == frame.to_bytes()
    finally:
        store.close()
        server.stop()


@needs_redis
def test_a_block_the_disk_does_not_admit_is_still_handed_down_to_redis_under_write_back(tmp_path):
    """Write-back (no write-through), CPU over a disk that admits after two uses over Redis:
    a block used once, evicted from the CPU tier, was refused by the disk and dropped there,
    though Redis below had room and would have had it from the disk. The filter holds
    back only the disk's write: the block goes on to Redis."""
    import cacheseek as cs
    from store_helpers import raw_frame

    server = RedisServer(tmp_path / "redis").start()
    frame_bytes = raw_frame(1)[1].meta.nbytes
    store = cs.TierConfig(cpu_bytes=2 * frame_bytes, cpu_reserve_bytes=0, pin_memory=False,
                          disk_path=str(tmp_path / "d"), disk_bytes="64MiB", disk_admit_after_uses=2,
                          redis_url=server.url, redis_bytes="64MiB", write_through=()).build()
    try:
        keys = []
        for i in range(1, 5):
            key, frame = raw_frame(i)
            keys.append(key)
            assert store.put(key, frame).stored
        held = [[t.name for t in store.tiers if t.contains(k)] for k in keys]
        assert held == [["redis"], ["redis"], ["cpu"], ["cpu"]]
        assert store.tier("redis").get(keys[0]).to_bytes() == raw_frame(1)[1].to_bytes()
        tiers = {t["name"]: t for t in store.stats()["tiers"]}
        assert tiers["disk"]["blocks"] == 0 and tiers["disk"]["admission"]["not_admitted"] == 2
        assert tiers["redis"]["demotions"] == 2
    finally:
        store.close()
        server.stop()


def test_plan_runs_without_torch(tmp_path):
    code = (
        "import sys\n"
        "from cacheseek.server.cli import main\n"
        f"rc = main(['plan', '--trace', {str(EXCERPT)!r}, '--codec', 'int4', '--cpu-bytes', '32GiB',"
        f" '--policy', 'lru', '--json', {str(tmp_path / 'r.json')!r}, '--plot', {str(tmp_path / 'p.png')!r}])\n"
        "assert rc == 0, rc\n"
        "assert 'torch' not in sys.modules, 'plan imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert rows[0]["cpu_blocks"] == 1638 and rows[0]["policy"] == "lru"
    assert "|" in proc.stdout and "3993" not in proc.stdout


def test_plan_runs_without_the_server_extras(tmp_path):
    code = (
        "import sys\n"
        "class Refuse:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pydantic', 'pydantic_settings', 'fastapi', 'starlette', 'uvicorn',\n"
        "                                  'prometheus_client', 'yaml'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (blocked)', name=name)\n"
        "sys.meta_path.insert(0, Refuse)\n"
        "from cacheseek.server.cli import main\n"
        f"rc = main(['plan', '--trace', {str(EXCERPT)!r}, '--codec', 'int4', '--cpu-bytes', '32GiB',"
        f" '--policy', 'lru', '--json', {str(tmp_path / 'r.json')!r}, '--plot', {str(tmp_path / 'p.png')!r}])\n"
        "assert rc == 0, rc\n"
        "assert 'pydantic' not in sys.modules and 'prometheus_client' not in sys.modules\n"
        "assert main(['serve', '--port', '1']) == 2\n"
        "assert main(['top', '--iterations', '1']) == 2\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())[0]["cpu_blocks"] == 1638
    assert "cacheseek serve: needs the 'server' extra (pydantic is not installed)" in proc.stderr
    assert "cacheseek top: needs the 'server' extra (prometheus_client is not installed)" in proc.stderr


def test_plan_full_blocks_only_matches_the_store_counting(tmp_path, excerpt):
    from cacheseek.server.cli import main

    out = tmp_path / "r.json"
    assert main(["plan", "--trace", str(EXCERPT), "--codec", "int4", "--cpu-bytes", "8GiB", "--policy", "lru",
                 "--full-blocks-only", "--json", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    row = json.loads(out.read_text())[0]
    blocks = row["cpu_blocks"]
    assert row["full_blocks_only"] is True
    assert row["hit_blocks"] == reference.lru(excerpt, blocks, full_blocks_only=True).hit_blocks
    assert row["belady_block_hit_rate"] == reference.belady_prefix(excerpt, blocks, full_blocks_only=True).block_hit_rate


def test_plan_references_take_the_blocks_the_tiers_hold_together(tmp_path, capsys):
    """Written through, the disk holds every block the CPU tier holds: two raw blocks of CPU
    over two of disk hold two distinct blocks. The references (and the table's "blocks")
    took the sum, four, where Belady hits every reuse of a cycle over three prompts, and
    the policy's share of it read low. With a disk admission threshold the CPU tier hands
    the disk its victims, each block in one tier: the sum."""
    from cacheseek.store.disk import DEFAULT_ALLOC_UNIT, block_charge
    from cacheseek.trace.plan import codec_of, layout_of
    from cacheseek.trace.replay import frame_nbytes

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 512, "hash_ids": [i % 3]}) + "\n"
                             for i in range(30)))
    nbytes = frame_nbytes(layout_of("llama-3-8b"), codec_of("raw"), 512)
    cpu, disk = 2 * nbytes, 2 * block_charge(nbytes, DEFAULT_ALLOC_UNIT)
    for admit, ref in ((1, 2), (2, 4)):
        assert _plan_main(tmp_path, "--cpu-bytes", str(cpu), "--disk-bytes", str(disk), "--policy", "lru,arc",
                          "--disk-admit-after-uses", str(admit)) == 0
        best = reference.belady_prefix(load_trace(trace), ref)
        for row in json.loads((tmp_path / "rows.json").read_text()):
            assert (row["cpu_blocks"], row["disk_blocks"], row["reference_blocks"]) == (2, 2, ref)
            assert row["belady_block_hit_rate"] == best.block_hit_rate and row["hit_blocks"] <= best.hit_blocks
        header, _, *lines = capsys.readouterr().out.splitlines()[1:]
        assert header.startswith("| codec | cpu ") and "| ref blocks | policy |" in header
        assert [line.split("|")[3].strip() for line in lines[:2]] == [str(ref), str(ref)]
    assert reference.belady_prefix(load_trace(trace), 2).hit_blocks < reference.belady_prefix(load_trace(trace), 4).hit_blocks


def test_lru_tiers_hold_together_the_blocks_plan_gives_the_references(excerpt):
    """``reference_blocks``' count, checked on the store: under LRU, a disk written through
    holds every block of the smaller tier, and the tiers never hold more distinct blocks
    than the larger one (and fill it); with an admission threshold they hold more than
    the larger one (here), never more than both together."""
    from cacheseek.trace.plan import reference_blocks
    from cacheseek.trace.replay import StoreClient

    peak = 0

    class Counting(StoreClient):
        def request(self, ids):
            nonlocal peak
            tiers = super().request(ids)
            peak = max(peak, len(self.store.residency))  # distinct blocks, store-wide
            return tiers

    trace = excerpt[:300]
    beyond_the_larger = []
    for cpu, disk in ((60, 60), (40, 100), (100, 40)):
        for admit in (1, 2):
            spec = ReplaySpec(cpu_blocks=cpu, disk_blocks=disk, policy="lru", disk_admit_after_uses=admit)
            peak = 0
            replay(trace, spec, client_factory=Counting)
            if admit == 1:
                assert peak == reference_blocks(spec) == max(cpu, disk)
            else:
                assert peak <= reference_blocks(spec) == cpu + disk
                beyond_the_larger.append(peak > max(cpu, disk))
    assert any(beyond_the_larger)
    assert reference_blocks(ReplaySpec(cpu_blocks=40, disk_blocks=100, write_through=False)) == 140


# -- the block-level simulator and the policy candidates -----------------------------------

@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_blocksim_equals_the_store_replay(excerpt, policy):
    """``blocksim`` drives the index as the store does: the same hits, block for block."""
    shaped = synth.conversations(requests=300, seed=5)
    for trace in (excerpt, shaped):
        for full in (False, True):
            for blocks in (150, 900):
                got = blocksim.simulate(trace, policy, blocks, full_blocks_only=full)
                want = replay(trace, ReplaySpec(cpu_blocks=blocks, policy=policy, full_blocks_only=full))
                assert (got.hit_blocks, got.hit_tokens) == (want.hit_blocks, want.hit_tokens)


def test_lirs_candidate_keeps_part_of_a_loop_longer_than_the_cache():
    """The pattern LIRS is for: a loop over more blocks than fit, where LRU hits nothing and
    LIRS keeps its low-IRR share (99 of 150 blocks here) resident for every later cycle."""
    from benchmarks.policy_candidates import Lirs

    lines = [json.dumps({"timestamp": i, "input_length": 512, "output_length": 1, "hash_ids": [i % 150]})
             for i in range(1500)]
    trace = parse_lines(lines)
    assert blocksim.simulate(trace, "lru", 100).hit_blocks == 0
    assert blocksim.simulate(trace, Lirs, 100).hit_blocks >= 99 * 8


def test_hawkeye_candidate_learns_that_long_one_off_requests_are_cache_averse():
    """Short hot prompts (a single block, 10 of them in turn) between long one-off
    requests (64 fresh blocks each) in a tier of 100 blocks: under LRU each long request
    flushes the hot blocks; OPTgen finds their reuses hits and the long requests' blocks
    never reused, so Hawkeye learns the long requests' signature averse and keeps the hot
    ones."""
    from benchmarks.policy_candidates import Hawkeye

    fresh = itertools.count(1000)
    lines = []
    for i in range(1200):
        ids = [i // 2 % 10] if i % 2 else [next(fresh) for _ in range(64)]
        lines.append(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                                 "hash_ids": ids}))
    trace = parse_lines(lines)
    best = reference.belady_prefix(trace, 100).hit_blocks
    assert blocksim.simulate(trace, "lru", 100).hit_blocks == 0
    assert best * 0.9 <= blocksim.simulate(trace, Hawkeye, 100).hit_blocks <= best


def test_hawkeye_occupancy_tree_adds_and_takes_maxima_as_a_list_does():
    from benchmarks.policy_candidates import _MaxTree

    rng = random.Random(3)
    for n in (1, 3, 8, 13):
        tree, slots = _MaxTree(n), [0] * n
        for _ in range(500):
            lo = rng.randrange(n)
            hi = rng.randrange(lo + 1, n + 1)
            if rng.random() < 0.5:
                v = rng.randint(-2, 5)
                tree.add(lo, hi, v)
                slots[lo:hi] = [x + v for x in slots[lo:hi]]
            else:
                assert tree.max(lo, hi) == max(slots[lo:hi])


def test_policy_candidates_stay_below_belady_and_the_sim_writes_its_table(tmp_path):
    from benchmarks import policy_sim
    from benchmarks.policy_candidates import CANDIDATES

    trace = load_trace(EXCERPT)
    best = reference.belady_prefix(trace, 300).hit_blocks
    for name, make in CANDIDATES.items():
        got = blocksim.simulate(trace, make, 300)
        assert 0 < got.hit_blocks <= best, name
    assert policy_sim.main(["--trace", str(EXCERPT), "--no-shapes", "--blocks", "300", "--candidates",
                            "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "policy_sim.json").read_text())
    rows = doc["results"]["mooncake_synthetic_excerpt/store"]
    assert rows[0]["blocks"] == 300 and all(0 <= rows[0][f"{p} of belady"] <= 1 for p in doc["policies"])
    prof = doc["belady_profile"]
    assert prof["belady_hits"] == best == sum(prof["belady_hits_per_quarter"])
    assert sum(prof["lru_hits_per_quarter"]) == reference.lru(trace, 300).hit_blocks
    (bound,) = doc["reuse_bit_bound"]  # one budget: computed and written once, not twice
    assert bound["budget_blocks"] == 300 and 0 < bound["oracle_bit"]["4x"] <= 1
    assert all(0 <= v <= 1 for v in bound["guessed_bit"]["4x"].values())
    assert 0 < doc["static_oracle"]["300"]["of belady"] <= 1
    with pytest.raises(SystemExit):
        policy_sim.main(["--policies", "lru,nope"])


def test_the_static_oracle_and_family_arrivals_count_as_documented():
    from benchmarks.policy_sim import family_arrivals, static_oracle

    def req(i, ids):
        return json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids})

    # Family 1 (chain 1, 2) and family 9 (chain 9) take turns, three requests each; then 7 once.
    lines = [req(0, [1, 2]), req(1, [9]), req(2, [1, 2]), req(3, [9]), req(4, [1, 2]), req(5, [9]), req(6, [7])]
    trace = parse_lines(lines)
    static = static_oracle(trace, [1, 2])
    # One block: block 1 or 9 (three uses each; 1 seen first), hit twice. Two: 1 and its child
    # 2 before 9 (the parent comes first among equals): 4 hits of 10 requested blocks.
    assert static["1"]["hit %"] == round(100 * 2 / 10, 2) and static["2"]["hit %"] == round(100 * 4 / 10, 2)
    best = reference.belady_prefix(trace, 2).hit_blocks
    assert static["2"]["of belady"] == round(4 / best, 3)
    fam = family_arrivals(trace)
    assert (fam["families"], fam["single_request"], fam["families_with_3_gaps"]) == (3, 1, 0)
    assert fam["median_gap_cv"] is None and fam["median_gap_blocks"] == 3  # gaps 3, 3 (family 1), 3, 3 (9)


# -- cacheseek plan: flags ---------------------------------------------------------------

def _plan_main(tmp_path, *flags):
    from cacheseek.server.cli import main

    trace = tmp_path / "t.jsonl"
    if not trace.exists():
        trace.write_text('{"timestamp": 0, "input_length": 1000, "hash_ids": [1, 2]}\n'
                         '{"timestamp": 5, "input_length": 1500, "hash_ids": [1, 2, 3]}\n')
    return main(["plan", "--trace", str(trace), "--codec", "raw", "--cpu-bytes", "1GiB", "--policy", "lru",
                 "--json", str(tmp_path / "rows.json"), "--plot", str(tmp_path / "p.png"), *flags])


def test_plan_of_an_fp8_layout_replays_raw_by_default_and_names_codec_for_kivi(tmp_path, capsys):
    """An fp8 layout under the default --codec (raw,int8,int4,int2) failed with exit 2 on
    KIVI's refusal, which named no flag: the default is raw there, and a KIVI codec asked
    for is refused by --codec, before the trace is read."""
    from cacheseek.server.cli import main

    (tmp_path / "t.jsonl").write_text('{"hash_ids": [1, 2]}\n{"hash_ids": [1, 2, 3]}\n')
    flags = ["--trace", str(tmp_path / "t.jsonl"), "--cpu-bytes", "1GiB", "--policy", "lru",
             "--json", str(tmp_path / "rows.json"), "--plot", str(tmp_path / "p.png")]
    assert main(["plan", "--layout", "32,8,128,fp8_e4m3", *flags]) == 0
    assert [r["codec"] for r in json.loads((tmp_path / "rows.json").read_text())] == ["raw"]
    assert main(["plan", "--layout", "32,8,128", *flags]) == 0  # (16-bit: every codec, as before)
    assert [r["codec"] for r in json.loads((tmp_path / "rows.json").read_text())] == ["raw", "int8", "int4", "int2"]
    (tmp_path / "rows.json").unlink()
    capsys.readouterr()
    (tmp_path / "t.jsonl").write_text("BROKEN\n")  # (not read: the codec is refused first)
    assert main(["plan", "--layout", "32,8,128,e5m2", "--codec", "raw,int4", *flags]) == 2
    err = capsys.readouterr().err
    assert "--codec int4: KIVI" in err and "does not encode float8_e5m2 KV" in err and "Traceback" not in err
    assert not (tmp_path / "rows.json").exists()


def test_plan_draws_a_disk_only_row_on_its_plot(tmp_path):
    """A CPU budget of 0 over a disk tier (a disk-only store) sat on a log axis: matplotlib
    warned that it had no positive value and the plot showed no line; beside other budgets,
    the point was dropped."""
    pytest.importorskip("matplotlib")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _plan_main(tmp_path, "--cpu-bytes", "0,1GiB", "--disk-bytes", "1GiB") == 0
        assert _plan_main(tmp_path, "--cpu-bytes", "0", "--disk-bytes", "1GiB") == 0
    assert (tmp_path / "p.png").stat().st_size > 0


def test_the_progress_bar_redraws_on_a_terminal_only(tmp_path, capsys):
    """Into a file (a log, CI), the bar's fifty redraws a replay were carriage returns on
    one line: a replay now writes its last state, one line."""
    import io

    from cacheseek.trace.replay import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    trace = parse_lines(['{"hash_ids": [%d, %d]}' % (2 * i, 2 * i + 1) for i in range(200)])
    for stream, redraws in ((io.StringIO(), False), (Terminal(), True)):
        replay(trace, ReplaySpec(cpu_blocks=10, policy="lru"), progress=ProgressBar("lru", stream))
        text = stream.getvalue()
        assert "] 200/200 " in text.rsplit("\r", 1)[-1] and text.count("\n") == 1
        assert ("\r" in text) == redraws and (text.count("lru [") > 1) == redraws
    assert _plan_main(tmp_path, "--cpu-bytes", "1GiB,2GiB") == 0
    err = capsys.readouterr().err
    assert "\r" not in err and err.count("[#") == 2


def test_plan_table_shows_a_share_of_no_hits_as_a_dash(tmp_path, capsys):
    """A trace without reuse: Belady hits nothing, and the table printed 'None' for the
    share of it."""
    (tmp_path / "t.jsonl").write_text('{"hash_ids": [1, 2]}\n{"hash_ids": [3]}\n')
    assert _plan_main(tmp_path) == 0
    out = capsys.readouterr().out
    assert "None" not in out and " - |" in out
    assert json.loads((tmp_path / "rows.json").read_text())[0]["of_belady"] is None


def test_plan_replays_a_budget_codec_or_policy_given_twice_once(tmp_path):
    """``--cpu-bytes 1GiB,1024MiB`` replayed the same budget twice (minutes on a real trace)
    and printed the row twice."""
    assert _plan_main(tmp_path, "--cpu-bytes", "1GiB,1024MiB", "--codec", "raw,raw", "--policy", "lru,lru") == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["codec"], r["cpu_bytes"], r["policy"]) for r in rows] == [("raw", 1 << 30, "lru")]


@pytest.mark.parametrize("value", ["0", "-16", str(1 << 40)])
def test_plan_refuses_a_block_size_a_frame_cannot_carry(tmp_path, capsys, value):
    assert _plan_main(tmp_path, "--block-tokens=" + value) == 2
    err = capsys.readouterr().err
    assert "--block-tokens" in err and value in err and "Traceback" not in err
    assert not (tmp_path / "rows.json").exists()


def test_plan_says_a_budget_smaller_than_one_frame_holds_no_block(tmp_path, capsys):
    assert _plan_main(tmp_path, "--cpu-bytes", "1MiB") == 2
    err = capsys.readouterr().err
    assert "cpu_bytes 1048576" in err and "0 blocks of a" in err and "raw frame" in err
    assert "give a CPU or a disk budget" not in err and not (tmp_path / "rows.json").exists()


def test_plan_says_what_a_disk_budget_needs_to_hold_a_block(tmp_path, capsys):
    """A disk budget of one frame's bytes holds no block: the disk counts its sidecar and
    whole file-system blocks. The message asked for the frame's bytes, which were given."""
    from cacheseek.store.disk import DEFAULT_ALLOC_UNIT, block_charge
    from cacheseek.trace.plan import codec_of, layout_of
    from cacheseek.trace.replay import frame_nbytes

    nbytes = frame_nbytes(layout_of("llama-3-8b"), codec_of("raw"), 512)
    assert _plan_main(tmp_path, "--cpu-bytes", "0", "--disk-bytes", str(nbytes)) == 2
    err = capsys.readouterr().err
    assert f"disk_bytes {nbytes})" in err and "0 blocks of a" in err
    assert f"disk_bytes at least {block_charge(nbytes, DEFAULT_ALLOC_UNIT)}" in err
    assert not (tmp_path / "rows.json").exists()


def test_a_disk_budget_the_replays_filesystem_cannot_hold_is_refused_not_shrunk(tmp_path, capsys, monkeypatch):
    """The replay's disk tier keeps stand-in files in a temporary directory, and a disk tier
    clamps a budget its filesystem has no room for (a log line only): the replay held 820
    blocks of a 2,000-block disk (56 hits instead of 314) and reported 2,000. It is refused,
    and by ``cacheseek plan`` before any replay."""
    import os

    real = os.statvfs

    class OneMiBFree:
        def __init__(self, path):
            self.st = real(path)

        def __getattr__(self, name):
            return getattr(self.st, name)

        @property
        def f_bavail(self):
            return (1 << 20) // self.st.f_frsize

    monkeypatch.setattr(os, "statvfs", OneMiBFree)
    trace = load_trace(EXCERPT)
    with pytest.raises(ConfigError, match=r"a disk tier of 2000 blocks takes 15\.62 MiB of stand-in files .* but "
                                          r"that filesystem has room for .*: give the replay more room \(TMPDIR\)"):
        replay(trace, ReplaySpec(cpu_blocks=100, disk_blocks=2000, policy="lru"))
    assert replay(trace[:40], ReplaySpec(cpu_blocks=10, disk_blocks=100, policy="lru")).tiers[1]["blocks"] == 100
    assert _plan_main(tmp_path, "--disk-bytes", "64GiB") == 2
    err = capsys.readouterr().err
    assert "cacheseek plan: replay: a disk tier of 1023 blocks" in err and "Traceback" not in err
    assert "[#" not in err and not (tmp_path / "rows.json").exists()  # no replay ran


@pytest.mark.parametrize("name", ["myplot", "myplot.", ".myplot"])
def test_plan_refuses_a_plot_name_without_a_format_suffix(tmp_path, capsys, name):
    """matplotlib gives a name without a suffix its default format's: ``--plot myplot``
    wrote over ``myplot.png`` and the run said ``plot: myplot``, a file it never wrote."""
    pytest.importorskip("matplotlib")
    (tmp_path / "myplot.png").write_bytes(b"keep")
    path = f"{tmp_path}/{name}"
    assert _plan_main(tmp_path, "--plot", path) == 2
    err = capsys.readouterr().err
    assert f"--plot: {path}: no suffix names the format; give one matplotlib writes (" in err and "png" in err
    assert "[#" not in err and not (tmp_path / "rows.json").exists()  # no replay ran
    assert (tmp_path / "myplot.png").read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["myplot.png", "t.jsonl"]
    assert _plan_main(tmp_path, "--plot", f"{tmp_path}/myplot.svg") == 0  # the path given, written as given
    assert capsys.readouterr().out.endswith(f"plot: {tmp_path}/myplot.svg\n")
    assert (tmp_path / "myplot.svg").read_bytes().lstrip().startswith(b"<?xml")


def test_a_plot_name_without_a_suffix_is_refused_without_matplotlib_too(monkeypatch):
    """Without matplotlib the plot is skipped, and ``--plot plan`` passed: the same command
    then failed where matplotlib is installed."""
    import sys

    from cacheseek.trace.plan import plot_format_problem

    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # (its import fails)
    assert plot_format_problem("out/plan") == "no suffix names the format; give one (png, svg, pdf, ...)"
    assert plot_format_problem("out/plan.png") is None and plot_format_problem("out/plan.webp") is None


def test_plan_refuses_a_budget_past_the_replays_memory_before_replaying(tmp_path, capsys, monkeypatch):
    """A budget whose blocks take more memory than this process may use was refused by the
    replay's store only once the budgets before it had replayed (their rows thrown away), and
    in stand-in bytes (``--cpu-bytes 64GiB,5000TiB`` said "cpu_bytes: 93.75 GiB"). The count
    then took 384 bytes a block where the replay keeps about 2.5 KiB (the tier's bookkeeping
    beside the stand-in) and nothing for the disk tier's index, so a plan it let through could
    be killed for memory; and it refused a budget past the machine's memory on a trace that
    could never fill it."""
    import os

    from cacheseek.trace.plan import codec_of, layout_of
    from cacheseek.trace.replay import CPU_BLOCK_BOOKKEEPING, DISK_BLOCK_BOOKKEEPING, frame_nbytes
    from cacheseek.units import format_size

    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 256 if name == "SC_PHYS_PAGES" else real(name))
    limit = 256 * real("SC_PAGE_SIZE")  # (1 MiB of 4 KiB pages)
    nbytes, stand_in = frame_nbytes(layout_of("llama-3-8b"), codec_of("raw"), 512), StandInFrames(512).nbytes
    assert _plan_main(tmp_path, "--cpu-bytes", "1GiB,1TiB") == 0  # 3 distinct blocks: 1 TiB holds them all
    (tmp_path / "rows.json").unlink()
    many = tmp_path / "many.jsonl"  # 2,000 distinct blocks: 6 MiB of the replay's memory
    many.write_text("".join(f'{{"timestamp": {t}, "input_length": 512, "hash_ids": [{t}]}}\n' for t in range(2000)))
    capsys.readouterr()
    assert _plan_main(tmp_path, "--trace", str(many), "--cpu-bytes", f"{100 * nbytes},1TiB") == 2
    err = capsys.readouterr().err
    assert (f"cacheseek plan: cpu_bytes {1 << 40} (1.00 TiB) holds {(1 << 40) // nbytes:,} blocks of a {nbytes}-byte "
            f"raw frame; of the trace's 2,000 distinct blocks the replay would hold 2,000 in the CPU tier, more than "
            f"it can: it keeps {stand_in + CPU_BLOCK_BOOKKEEPING} bytes in memory for a CPU-tier block (a "
            f"{stand_in}-byte stand-in and the tier's bookkeeping), ") in err
    assert f"this process may use {format_size(limit)} (the machine's memory); give a smaller cpu_bytes\n" in err
    assert "[#" not in err and not (tmp_path / "rows.json").exists()  # no replay ran
    # The disk tier's index counts too: 2,000 blocks of it are past 1 MiB.
    assert _plan_main(tmp_path, "--trace", str(many), "--cpu-bytes", f"{100 * nbytes}", "--disk-bytes", "1TiB") == 2
    err = capsys.readouterr().err
    assert "and 2,000 on disk, more than it can" in err and f"and {DISK_BLOCK_BOOKKEEPING} for a disk-tier block" in err
    assert err.endswith("give a smaller cpu_bytes or disk_bytes\n") and not (tmp_path / "rows.json").exists()
    assert _plan_main(tmp_path, "--trace", str(many), "--cpu-bytes", f"{100 * nbytes}") == 0


def test_the_replays_memory_a_block_is_within_what_the_plan_counts(tmp_path):
    """The plan's memory check counts ``CPU_BLOCK_BOOKKEEPING`` and ``DISK_BLOCK_BOOKKEEPING``
    bytes a block beside the stand-in: measured here, so that a store that keeps more for a
    block is not let through to be killed for memory."""
    import gc
    import tracemalloc

    from cacheseek.trace.replay import CPU_BLOCK_BOOKKEEPING, DISK_BLOCK_BOOKKEEPING, StoreClient

    trace = load_trace(FULL)[:800]
    distinct = reference.distinct_blocks(trace)
    frames = StandInFrames(512)
    for spec, bound in ((ReplaySpec(cpu_blocks=distinct), CPU_BLOCK_BOOKKEEPING),
                        (ReplaySpec(cpu_blocks=0, disk_blocks=distinct), DISK_BLOCK_BOOKKEEPING)):
        gc.collect()
        tracemalloc.start()
        try:
            store = build_store(spec, frames.nbytes, str(tmp_path / f"d{spec.cpu_blocks}"))
            before = tracemalloc.get_traced_memory()[0]  # (the CPU tier's arena is a mapping: not counted)
            client = StoreClient(store, frames)
            for req in trace:
                client.request(req.hash_ids)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert sum(t["blocks"] for t in store.stats()["tiers"]) == distinct
        store.close()
        assert held / distinct <= bound, (spec, held / distinct)


def test_a_cpu_tier_past_the_traces_blocks_replays_as_one_of_their_number(tmp_path):
    """The replay builds a CPU tier at most the trace's distinct blocks: one that large never
    evicts, so every figure is what a tier built at the whole budget gives (run by hand here),
    and a budget past the machine's memory replays a trace that fits in it."""
    from cacheseek.trace.replay import StoreClient

    trace = load_trace(FULL)[:600]
    distinct = reference.distinct_blocks(trace)
    frames = StandInFrames(512)
    keep = ("blocks", "bytes_in", "bytes_out", "evictions", "hits", "misses")
    for disk, admit in ((0, 1), (distinct // 4, 2)):
        spec = ReplaySpec(cpu_blocks=4 * distinct, disk_blocks=disk, disk_admit_after_uses=admit)
        capped = replay(trace, spec)
        whole = build_store(spec, frames.nbytes, str(tmp_path / f"d{disk}") if disk else None)
        assert whole.tier("cpu").capacity_bytes == 4 * distinct * frames.nbytes  # (built at the whole budget)
        client = StoreClient(whole, frames)
        hits = sum(len(client.request(req.hash_ids)) for req in trace)
        tiers = whole.stats()["tiers"]
        whole.close()
        assert capped.spec.cpu_blocks == 4 * distinct and capped.hit_blocks == hits > 0
        assert [{k: t.get(k) for k in keep} for t in capped.tiers] == [{k: t.get(k) for k in keep} for t in tiers]
    huge = replay(trace, ReplaySpec(cpu_blocks=1 << 40))  # (1 << 40 blocks of stand-ins: past any memory)
    assert huge.hit_blocks == replay(trace, ReplaySpec(cpu_blocks=distinct)).hit_blocks


@pytest.mark.parametrize("json_as, plot_as, says", [
    ("{d}/t.jsonl", "{d}/p.png", "--json: {d}/t.jsonl: the same file as --trace {d}/t.jsonl"),
    ("t.jsonl", "{d}/p.png", "--json: t.jsonl: the same file as --trace {d}/t.jsonl"),  # (relative, from the cwd)
    ("{d}/link.jsonl", "{d}/p.png", "--json: {d}/link.jsonl: the same file as --trace {d}/t.jsonl"),
    ("{d}/hard.jsonl", "{d}/p.png", "--json: {d}/hard.jsonl: the same file as --trace {d}/t.jsonl"),
    ("{d}/same.png", "{d}/sub/../same.png", "--plot: {d}/sub/../same.png: the same file as --json {d}/same.png"),
    ("{d}/rows.json", "{d}/t.png", "--plot: {d}/t.png: the same file as --trace {d}/t.png"),
])
def test_plan_refuses_outputs_naming_the_trace_or_each_other(tmp_path, capsys, monkeypatch, json_as, plot_as, says):
    """``--json`` naming the trace wrote the rows over it, and ``--json`` naming ``--plot``'s
    file had the plot written over the rows, each with exit 0."""
    d = str(tmp_path)
    monkeypatch.chdir(tmp_path)
    trace = tmp_path / ("t.png" if plot_as.endswith("t.png") else "t.jsonl")
    text = '{"timestamp": 0, "input_length": 1000, "hash_ids": [1, 2]}\n{"timestamp": 5, "hash_ids": [1, 2, 3]}\n'
    trace.write_text(text)
    (tmp_path / "link.jsonl").symlink_to(trace)
    (tmp_path / "hard.jsonl").hardlink_to(trace)
    (tmp_path / "sub").mkdir()
    from cacheseek.server.cli import main

    assert main(["plan", "--trace", str(trace), "--codec", "raw", "--cpu-bytes", "1GiB", "--policy", "lru",
                 "--json", json_as.format(d=d), "--plot", plot_as.format(d=d)]) == 2
    err = capsys.readouterr().err
    assert f"cacheseek plan: {says.format(d=d)}; give another" in err and "Traceback" not in err
    assert "[#" not in err and trace.read_text() == text  # no replay ran, the trace untouched
    assert not (tmp_path / "same.png").exists() and not (tmp_path / "rows.json").exists()


@pytest.mark.parametrize("flags, says", [
    (["--codec", ""], "--codec: give at least one codec, got ''"),
    (["--cpu-bytes", ","], "--cpu-bytes: give at least one budget, got ','"),
    (["--policy", " "], "--policy: give at least one policy, got ' '"),
    (["--cpu-bytes", "9" * 400], "--cpu-bytes: '9999"),
    (["--cpu-bytes", "0.5GB,0.5"], "--cpu-bytes: '0.5' is not a whole number of bytes"),
    (["--json", "/nonexistent/x.json"], "--json: /nonexistent/x.json: no directory /nonexistent"),
    (["--plot", "/nonexistent/x.png"], "--plot: /nonexistent/x.png: no directory /nonexistent"),
    (["--json", "."], "--json: .: is a directory"),
    (["--plot", "plan.xyz"], "--plot: plan.xyz: format 'xyz' is not one matplotlib writes"),
    (["--disk-admit-after-uses", "0"], "--disk-admit-after-uses: must be an integer >= 1, got 0"),
    # the layout's own reason, where it only said the text was neither a name nor LAYERS,...
    (["--layout", "32,8,0"], "layout: '32,8,0': KVLayout.head_dim: must be a positive int, got 0"),
    (["--layout", "32,8,128,int8"], "layout: '32,8,128,int8': dtype: KV must be one of"),
])
def test_plan_refuses_empty_lists_and_unwritable_outputs_before_replaying(tmp_path, capsys, monkeypatch, flags, says):
    if "xyz" in flags[-1]:
        pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    assert _plan_main(tmp_path, *flags) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert "[#" not in err and not (tmp_path / "rows.json").exists()  # no replay ran


def test_plan_stopped_by_sigterm_leaves_no_temp_directory(tmp_path):
    """SIGTERM (a job's timeout) killed a replay where it stood: its temp disk directory, two
    files a block, stayed in TMPDIR. It ends as Ctrl-C does, the directory removed."""
    import signal

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = (
        "from cacheseek.server.cli import main\n"
        f"raise SystemExit(main(['plan', '--trace', {str(FULL)!r}, '--codec', 'raw,int8,int4,int2', "
        "'--cpu-bytes', '8GiB,16GiB,32GiB,64GiB', '--disk-bytes', '1TiB', "
        f"'--json', {str(tmp_path / 'r.json')!r}, '--plot', {str(tmp_path / 'p.png')!r}]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not any(tmp.glob("cacheseek-replay-*")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert any(tmp.glob("cacheseek-replay-*")), "no replay started"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    finally:
        proc.kill()
        proc.wait()
    assert "cacheseek plan: stopped by SIGTERM; nothing written" in err.decode() and b"Traceback" not in err
    assert list(tmp.iterdir()) == [] and not (tmp_path / "r.json").exists()


def test_a_replay_asked_to_stop_ends_between_two_requests_its_directory_removed(tmp_path, monkeypatch):
    """The plan's SIGTERM sets a flag that the replay reads before each request: raised from
    the signal handler instead, the exit could land in a garbage-collector callback, which
    swallows it, or inside a disk call before its guard, and the store's close waited for it
    for ever (a CI job saw no exit in 60 s)."""
    from cacheseek.trace.replay import ReplayStopped

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # (it caches TMPDIR on first use)
    trace = load_trace(FULL)
    asked = []

    def stop() -> bool:
        asked.append(any(tmp_path.glob("cacheseek-replay-*")))
        return len(asked) > 25

    with pytest.raises(ReplayStopped, match="after 25 of"):
        replay(trace, ReplaySpec(cpu_blocks=64, disk_blocks=64), stop=stop)
    assert all(asked) and len(asked) == 26  # asked inside the replay, once a request
    assert list(tmp_path.iterdir()) == []
