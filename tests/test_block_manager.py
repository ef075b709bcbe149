"""BlockManager bookkeeping: allocation, reference counts, the prefix cache and its LRU."""

from __future__ import annotations

import random

import pytest

from fulcrum.bench.block_tables import long_run_tables
from fulcrum.core.block_manager import BlockManager
from fulcrum.core.request import Request
from fulcrum.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, tokens, max_tokens: int = 8) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens)


def compute(kv: BlockManager, request: Request, num_tokens: int) -> None:
    """What a forward pass over the request's tokens up to `num_tokens` leaves behind."""
    request.num_computed_tokens = num_tokens


def admit(kv: BlockManager, request: Request) -> int:
    """Admit a request as the scheduler does: share its hits, allocate the rest of the prompt,
    and compute the whole prompt. Returns the number of prefix-cache hit tokens."""
    computed = kv.get_computed_blocks(request)
    remaining = request.num_tokens - computed.num_tokens
    assert kv.allocate_slots(request, remaining, computed)
    compute(kv, request, request.num_tokens)
    return computed.num_tokens


def live(*requests: Request) -> list:
    return [r.request_id for r in requests]


@pytest.fixture
def kv() -> BlockManager:
    return BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)


# ------------------------------------------------------------------ allocation
def test_fresh_manager_has_every_block_but_the_null_one_free(kv):
    assert kv.num_free_blocks == 8
    assert kv.num_usable_blocks == 8
    assert kv.usage == 0.0
    assert 0 not in kv.free_queue
    kv.check_invariants()


def test_needs_a_block_besides_the_null_block():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=1, block_size=BS, enable_prefix_caching=False)


def test_allocation_rounds_up_to_whole_blocks_and_free_returns_them(kv):
    request = make_request("a", range(10))  # 10 tokens -> 3 blocks of 4
    assert kv.allocate_slots(request, 10)
    table = kv.block_table("a")
    assert len(table) == 3
    assert 0 not in table
    assert len(set(table)) == 3
    assert all(kv.ref_cnt[b] == 1 for b in table)
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    kv.check_invariants(live(request))

    kv.free(request)
    assert kv.block_table("a") == []
    assert kv.num_free_blocks == 8
    assert all(kv.ref_cnt[b] == 0 for b in table)
    kv.check_invariants()


def test_growth_allocates_only_when_a_block_fills(kv):
    request = make_request("a", range(4))
    assert kv.allocate_slots(request, 4)
    request.num_computed_tokens = 4
    assert len(kv.block_table("a")) == 1
    for step in range(4):  # decode tokens 5..8 go into a second block
        request.append_token(100 + step)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        assert len(kv.block_table("a")) == 2
    request.append_token(200)
    assert kv.allocate_slots(request, 1)
    assert len(kv.block_table("a")) == 3
    kv.check_invariants(live(request))


def test_allocation_failure_returns_false_and_changes_nothing(kv):
    hog = make_request("hog", range(24))  # 6 of the 8 blocks
    assert kv.allocate_slots(hog, 24)
    big = make_request("big", range(50, 62))  # needs 3, only 2 free
    before = (list(kv.ref_cnt), list(kv.free_queue), dict(kv.cached),
              {k: list(v) for k, v in kv.block_tables.items()})
    assert not kv.can_allocate(big, 12)
    assert not kv.allocate_slots(big, 12)
    after = (list(kv.ref_cnt), list(kv.free_queue), dict(kv.cached),
             {k: list(v) for k, v in kv.block_tables.items()})
    assert after == before
    assert "big" not in kv.block_tables
    kv.check_invariants(live(hog))
    # It fits exactly once it asks for what is free.
    assert kv.allocate_slots(big, 8)
    assert kv.num_free_blocks == 0
    kv.check_invariants(live(hog, big))


def test_free_twice_is_harmless_for_an_unknown_table(kv):
    request = make_request("a", range(5))
    assert kv.allocate_slots(request, 5)
    kv.free(request)
    kv.free(request)  # the table is gone: nothing to release again
    assert kv.num_free_blocks == 8
    kv.check_invariants()


# ---------------------------------------------------------------- prefix cache
def test_prefix_hit_covers_only_full_blocks(kv):
    first = make_request("a", range(10))  # blocks [0..3] [4..7] [8 9]
    admit(kv, first)
    kv.check_invariants(live(first))
    second = make_request("b", list(range(10)) + [77])
    computed = kv.get_computed_blocks(second)
    assert computed.num_tokens == 8
    assert computed.block_ids == kv.block_table("a")[:2]


def test_last_token_is_never_matched(kv):
    first = make_request("a", range(8))  # exactly two full blocks
    admit(kv, first)
    same = make_request("b", range(8))
    computed = kv.get_computed_blocks(same)
    # Both blocks are cached, but the newest token must be computed to get logits.
    assert computed.num_tokens == 4
    assert computed.block_ids == kv.block_table("a")[:1]


def test_hash_chain_requires_identical_prefix(kv):
    first = make_request("a", range(12))
    admit(kv, first)
    # Same second block, different first block: the chain must not match block 2.
    other = make_request("b", [99, 1, 2, 3] + list(range(4, 12)) + [5])
    assert kv.get_computed_blocks(other).num_tokens == 0
    # Diverging in the second block matches only the first.
    partial = make_request("c", list(range(4)) + [50, 51, 52, 53] + list(range(8, 13)))
    computed = kv.get_computed_blocks(partial)
    assert computed.num_tokens == 4
    assert computed.block_ids == kv.block_table("a")[:1]


def test_blocks_are_named_when_allocated_so_the_same_step_can_share_them(kv):
    a = make_request("a", range(13))
    assert kv.allocate_slots(a, 13)  # the step that computes them has not run yet
    probe = make_request("p", list(range(12)) + [99])
    hits = kv.get_computed_blocks(probe)
    assert hits.num_tokens == 12
    assert kv.allocate_slots(probe, 1, hits)
    probe.num_computed_tokens = hits.num_tokens
    # If "a" is now preempted before its step runs, "p" holds blocks nobody will compute.
    assert kv.uncomputed_shared_blocks(a) == set(kv.block_table("a")[:3])
    compute(kv, a, 13)
    assert kv.uncomputed_shared_blocks(a) == set()
    kv.check_invariants(live(a, probe))


def test_blocks_freed_before_being_computed_never_hit(kv):
    # A request preempted in the step that allocated its blocks never computes them.
    a = make_request("a", range(9))
    assert kv.allocate_slots(a, 9)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", range(9))).num_tokens == 0
    assert not kv.cached
    kv.check_invariants()


def test_no_hits_without_prefix_caching():
    kv = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=False)
    admit(kv, make_request("a", range(12)))
    assert kv.get_computed_blocks(make_request("b", range(13))).num_tokens == 0
    assert not kv.cached


def test_shared_prefix_blocks_are_the_same_ids_with_ref_count_two(kv):
    a = make_request("a", range(10))
    admit(kv, a)
    free_before = kv.num_free_blocks
    b = make_request("b", list(range(8)) + [40, 41, 42])
    assert admit(kv, b) == 8
    ta, tb = kv.block_table("a"), kv.block_table("b")
    assert ta[:2] == tb[:2]
    assert all(kv.ref_cnt[block] == 2 for block in ta[:2])
    assert ta[2] != tb[2]
    assert kv.ref_cnt[tb[2]] == 1
    assert kv.num_free_blocks == free_before - 1  # only b's own tail block is new
    kv.check_invariants(live(a, b))

    kv.free(a)
    assert all(kv.ref_cnt[block] == 1 for block in tb[:2])
    assert kv.ref_cnt[ta[2]] == 0
    kv.check_invariants(live(b))
    kv.free(b)
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_hits_on_free_cached_blocks_are_counted_against_free_space():
    kv = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)  # 3 usable
    a = make_request("a", range(9))  # 3 blocks
    admit(kv, a)
    kv.free(a)
    # b hits a's two full blocks (both free now) and needs one more block: 3 in all.
    b = make_request("b", list(range(8)) + [60])
    computed = kv.get_computed_blocks(b)
    assert computed.num_tokens == 8
    assert kv.can_allocate(b, 1, computed)
    # c hits the same two and needs two more: 4 > 3 usable, so it must not fit.
    c = make_request("c", list(range(8)) + [60, 61, 62, 63, 64])
    computed_c = kv.get_computed_blocks(c)
    assert computed_c.num_tokens == 8
    assert not kv.can_allocate(c, 5, computed_c)
    assert not kv.allocate_slots(c, 5, computed_c)
    kv.check_invariants()


def test_lazy_eviction_freed_block_still_hits_until_reused(kv):
    a = make_request("a", range(9))
    admit(kv, a)
    cached_ids = kv.block_table("a")[:2]
    kv.free(a)
    assert kv.num_free_blocks == 8  # free, yet still named
    b = make_request("b", list(range(8)) + [70])
    computed = kv.get_computed_blocks(b)
    assert computed.block_ids == cached_ids
    assert admit(kv, b) == 8
    assert kv.block_table("b")[:2] == cached_ids
    assert all(kv.ref_cnt[block] == 1 for block in cached_ids)
    kv.check_invariants(live(b))


def test_reused_block_loses_its_name(kv):
    a = make_request("a", range(8))
    admit(kv, a)
    kv.free(a)
    # Fill the whole cache with other tokens: every block, cached ones included, is reused.
    hog = make_request("hog", range(100, 132))
    assert kv.allocate_slots(hog, 32)
    assert kv.num_free_blocks == 0
    kv.free(hog)
    probe = make_request("p", list(range(8)) + [1])
    assert kv.get_computed_blocks(probe).num_tokens == 0
    kv.check_invariants()


def test_lru_evicts_least_recently_freed_first(kv):
    old = make_request("old", range(0, 5))  # one full block named
    new = make_request("new", range(20, 25))
    admit(kv, old)
    admit(kv, new)
    kv.free(old)
    kv.free(new)
    # Take free blocks until exactly one named block would be gone: the untouched blocks
    # come first (they were never used), then old's, then new's.
    untouched = 8 - 4
    filler = make_request("f", range(200, 200 + 4 * (untouched + 2)))
    assert kv.allocate_slots(filler, 4 * (untouched + 2))  # + old's two blocks
    assert kv.get_computed_blocks(make_request("o2", range(0, 5))).num_tokens == 0
    assert kv.get_computed_blocks(make_request("n2", range(20, 25))).num_tokens == 4
    kv.check_invariants(live(filler))


def test_tail_blocks_of_a_request_are_evicted_before_its_head(kv):
    a = make_request("a", range(13))  # 3 full blocks + 1 partial
    admit(kv, a)
    kv.free(a)
    # 4 never-used blocks go first, then a's tail (partial block, then block 3), ...
    filler = make_request("f", range(200, 200 + 4 * 6))
    assert kv.allocate_slots(filler, 24)
    # ... so the first two blocks of the prefix survive.
    probe = make_request("p", list(range(12)) + [5])
    assert kv.get_computed_blocks(probe).num_tokens == 8
    kv.check_invariants(live(filler))


def test_hit_refreshes_block_in_lru(kv):
    a = make_request("a", range(5))
    b = make_request("b", range(30, 35))
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    # Reuse a's prefix, then free it again: a's block is now the most recently freed.
    a2 = make_request("a2", list(range(4)) + [9])
    assert admit(kv, a2) == 4
    kv.free(a2)
    filler = make_request("f", range(200, 200 + 4 * 6))  # evicts 6 of 8 in LRU order
    assert kv.allocate_slots(filler, 24)
    assert kv.get_computed_blocks(make_request("a3", range(5))).num_tokens == 4
    assert kv.get_computed_blocks(make_request("b3", range(30, 35))).num_tokens == 0
    kv.check_invariants(live(filler))


def test_reset_prefix_cache_forgets_free_blocks(kv):
    a = make_request("a", range(9))
    admit(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", range(9))).num_tokens == 0
    assert not kv.cached
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_duplicate_content_is_cached_once_and_both_tables_stay_valid(kv):
    # Two requests computing the same prompt at once (no hits for the second: it was admitted
    # before the first named its blocks) each own separate copies.
    a = make_request("a", range(9))
    b = make_request("b", range(9))
    assert kv.allocate_slots(a, 9)
    assert kv.allocate_slots(b, 9)
    compute(kv, a, 9)
    compute(kv, b, 9)
    assert kv.get_computed_blocks(make_request("p", range(9))).block_ids == \
        kv.block_table("a")[:2]  # the first to be computed names the content
    kv.check_invariants(live(a, b))
    kv.free(a)
    kv.check_invariants(live(b))
    c = make_request("c", list(range(8)) + [3])
    assert kv.get_computed_blocks(c).num_tokens == 8
    kv.free(b)
    kv.check_invariants()


def test_check_invariants_detects_corruption(kv):
    a = make_request("a", range(5))
    assert kv.allocate_slots(a, 5)
    with pytest.raises(AssertionError):
        kv.check_invariants()  # "a" holds blocks but is not declared live
    kv.ref_cnt[kv.block_table("a")[0]] += 1
    with pytest.raises(AssertionError):
        kv.check_invariants(live(a))


# ------------------------------------------------------------------ keys and salts
def salted(request_id: str, tokens, salt):
    request = make_request(request_id, tokens)
    request.cache_salt = salt
    return request


def test_block_keys_are_sha256_chained_over_the_whole_prefix(kv):
    import hashlib
    from array import array

    from fulcrum.core.block_manager import root_key

    request = make_request("a", range(9))
    admit(kv, request)
    first = hashlib.sha256(root_key(None) + array("q", range(4)).tobytes()).digest()
    second = hashlib.sha256(first + array("q", range(4, 8)).tobytes()).digest()
    assert request.block_hashes == [first, second]
    assert [kv.block_key[b] for b in kv.block_table("a")[:2]] == [first, second]


def test_different_salts_never_share_blocks_and_equal_salts_do():
    kv = BlockManager(num_blocks=20, block_size=BS, enable_prefix_caching=True)
    tokens = list(range(13))
    assert admit(kv, salted("a", tokens, "tenant-1")) == 0
    assert admit(kv, salted("b", tokens, "tenant-2")) == 0
    assert admit(kv, salted("c", tokens, None)) == 0
    assert admit(kv, salted("d", tokens, "tenant-1")) == 12
    assert kv.block_table("d")[:3] == kv.block_table("a")[:3]
    assert not set(kv.block_table("b")) & set(kv.block_table("a"))
    kv.check_invariants(live(*[salted(i, [], None) for i in "abcd"]))


# ------------------------------------------------------------ physical adjacency
def test_a_table_grows_into_the_block_after_its_last_when_that_one_is_free():
    kv = BlockManager(num_blocks=9, block_size=BS, enable_prefix_caching=False)
    a, b, c = (make_request(name, range(4)) for name in "abc")
    for request in (a, b, c):
        admit(kv, request)
    assert [kv.block_table(r.request_id) for r in (a, b, c)] == [[1], [2], [3]]
    kv.free(b)  # queue: 4 5 6 7 8 2
    assert kv.allocate_slots(a, 1)  # a's fifth token: block 2, though 4 is the queue's front
    assert kv.block_table("a") == [1, 2]
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 1)  # block 3 is c's: the queue's front then
    assert kv.block_table("a") == [1, 2, 4]
    d = make_request("d", range(12))  # a new table starts at the front and runs on from it
    assert kv.allocate_slots(d, 12)
    assert kv.block_table("d") == [5, 6, 7]
    kv.check_invariants(live(a, c, d))


def test_a_cached_block_leaves_the_queue_out_of_order_only_from_its_older_half():
    kv = BlockManager(num_blocks=11, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", range(5))
    admit(kv, a)  # blocks 1 (named) and 2
    old = make_request("old", range(50, 54))
    new = make_request("new", range(100, 124))
    admit(kv, old)  # block 3
    admit(kv, new)  # blocks 4-9
    kv.free(old)
    kv.free(new)  # queue: 10 (never used), 3, then new's tail first: 9 8 7 6 5, 4 newest
    assert list(kv.free_queue) == [10, 3, 9, 8, 7, 6, 5, 4]

    def grow(request: Request) -> None:  # one more token fills its last block; one more
        while request.num_tokens < request.num_computed_tokens + 1 + BS:
            request.append_token(7)
        compute(kv, request, (request.num_computed_tokens // BS + 1) * BS)
        assert kv.allocate_slots(request, 1)

    grow(a)  # block 3: cached, but older than half the queue: taken before 10
    assert kv.block_table("a") == [1, 2, 3]
    grow(a)  # block 4: cached and the newest: left for its LRU turn, the front (10) taken
    assert kv.block_table("a") == [1, 2, 3, 10]
    assert kv.get_computed_blocks(make_request("p1", range(50, 55))).num_tokens == 0
    assert kv.get_computed_blocks(make_request("p2", range(100, 105))).num_tokens == 4
    kv.check_invariants(live(a))


def test_a_prompt_diverging_inside_a_cached_one_leaves_its_later_blocks_cached():
    """A fresh cache: the cached prompt's blocks sit behind hundreds never used, so the block
    after the shared prefix is no candidate to take out of turn; sent again, the first
    prompt finds all its blocks (it found the prefix alone)."""
    kv = BlockManager(num_blocks=400, block_size=BS, enable_prefix_caching=True)
    first = make_request("first", range(41))  # 10 full blocks
    admit(kv, first)
    kv.free(first)
    # 9 blocks shared; its next one would run on into the block after them, first's 10th
    # (freed second: a request's tail goes first), which holds first's tokens 36-39
    diverging = make_request("diverging", [*range(38), 99, 98, 97])
    assert admit(kv, diverging) == 36
    assert kv.get_computed_blocks(make_request("again", range(41))).num_tokens == 40
    kv.check_invariants(live(diverging))


def test_a_long_running_cache_keeps_sequences_in_runs_of_adjacent_blocks():
    """Requests of random lengths, 8 at a time, one token a step: after 400 of them, over a
    third of a running sequence's consecutive blocks still lie side by side (taking only the
    queue's front, 0-3% did over four seeds: its order scrambles within a few hundred
    requests)."""
    kv = BlockManager(num_blocks=400, block_size=BS, enable_prefix_caching=True)
    tables = long_run_tables(kv, batch=8, per=6, requests=400, rng=random.Random(0),
                             prompt_lens=(8, 120), output_lens=(4, 60))
    assert len(tables) == 8 and all(len(t) == 6 and len(set(t)) == 6 for t in tables)
    assert all(0 < block < 400 for table in tables for block in table)
    pairs = [(a, b) for table in tables for a, b in zip(table, table[1:])]
    assert sum(b == a + 1 for a, b in pairs) / len(pairs) > 0.25


def test_a_cached_block_whose_prefix_was_hit_keeps_its_place_in_the_queue():
    kv = BlockManager(num_blocks=11, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", range(5))
    admit(kv, a)  # blocks 1 (named) and 2
    old = make_request("old", range(50, 54))
    again = make_request("again", [*range(50, 54), 9])
    new = make_request("new", range(100, 124))
    admit(kv, old)  # block 3
    assert admit(kv, again) == 4  # a hit on block 3 (its own block 4 after it)
    assert kv.block_table("again") == [3, 4]
    admit(kv, new)  # blocks 5-10
    for request in (old, again, new):
        kv.free(request)
    # Block 3 is the oldest freed block, in the queue's older half, yet a hit made it shared:
    # a table ending in block 2 takes the front (again's block 4) instead.
    assert list(kv.free_queue)[:2] == [4, 3]
    a.append_token(5)
    for _ in range(3):
        a.append_token(6)
    compute(kv, a, 8)
    assert kv.allocate_slots(a, 1)
    assert kv.block_table("a") == [1, 2, 4]
    assert kv.get_computed_blocks(make_request("p", range(50, 55))).num_tokens == 4
    kv.check_invariants(live(a))
