"""The paged KV cache's bookkeeping: which block holds which request's tokens.

Blocks are numbered 0..num_blocks-1; the tensors live in the model runner. Each request owns
a block table (a list of block ids). A block has a reference count; with prefix caching a full
block is also named by a hash chain of its tokens, so a later request with the same prefix
reuses it. A block whose count drops to zero goes to the tail of a least-recently-used free
queue but keeps its contents and name until it is taken again (lazy eviction), so a prefix
can hit even after every request that wrote it has finished.

A request's next block is, where it can be, the block physically after its last one: the
attention kernels read a sequence's blocks in table order, and adjacent blocks read as one
longer run of memory. Taken only from the free queue's front, blocks scramble within a few
hundred requests of a long-running server (almost no two consecutive blocks of a table
adjacent), and decode attention reads blocks in random order much slower than runs of them
(benchmarks/results/attention_layout-avx2.md: "random" against "runs", and "server", the
tables this policy leaves after a long run). The block after is taken out of the queue's
order only if it holds no cached prefix, or one that no request has hit and that was freed
before half the queue was: that one waited unused for half its time to eviction, while a
newer one, or one a prefix hit has shown to be shared, keeps its LRU chance.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional, Sequence, Set

from fulcrum.core.request import Request

# A block's name: SHA-256 over its parent's name and its token ids, so a name stands for the
# whole prefix up to the block's end. Python's hash() would do for correctness against honest
# traffic, but its collisions can be built on purpose (vLLM's GHSA-rm76-4mrf-v9r8): a client
# could then make another tenant's request read its KV blocks. The first block's parent is a
# root derived from the request's cache_salt, so requests with different salts never share.
BlockKey = bytes
_ROOT = hashlib.sha256(b"fulcrum-prefix-cache").digest()


def root_key(cache_salt: Optional[str]) -> BlockKey:
    if cache_salt is None:
        return _ROOT
    return hashlib.sha256(_ROOT + cache_salt.encode("utf-8", "surrogatepass")).digest()


def block_key(parent: BlockKey, token_ids: Sequence[int]) -> BlockKey:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


@dataclass
class ComputedBlocks:
    """Prefix-cache hits for a request about to be admitted."""

    block_ids: List[int]
    num_tokens: int


NO_HITS = ComputedBlocks([], 0)


class BlockManager:
    """Hands out blocks 1..num_blocks-1; block 0 is the runner's null block, never allocated."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least one block besides the null block")
        self.num_blocks = num_blocks
        self.num_usable_blocks = num_blocks - 1
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_key: List[Optional[BlockKey]] = [None] * num_blocks
        self.free_queue: "OrderedDict[int, None]" = OrderedDict.fromkeys(range(1, num_blocks))
        # When each block last entered the free queue, counted in blocks freed so far: the
        # queue's front holds the oldest, so (stamp - front's) / (frees - front's) is where a
        # block sits in the queue, front 0, back 1 (blocks taken from the middle aside). The
        # blocks never used count as freed in their order: stamped all 0, a fresh cache's
        # thousands of them counted for nothing, and a cached block near the queue's back
        # passed for one in its older half (a prompt diverging inside a cached one's blocks
        # then took the next of them, which a re-sent prompt missed, the cache 3% full).
        self._freed_at = list(range(num_blocks))
        self._frees = num_blocks - 1
        self._hit = [False] * num_blocks  # its prefix was hit since it was named
        self.cached: Dict[BlockKey, int] = {}
        self.block_tables: Dict[str, List[int]] = {}
        self._num_named: Dict[str, int] = {}

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def block_table(self, request_id: str) -> List[int]:
        return self.block_tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request: Request,
                            excluding: Collection[int] = ()) -> ComputedBlocks:
        """The longest cached prefix of the request, leaving at least one token to compute.

        Blocks in `excluding` end the prefix: the scheduler names those that a preemption it
        is weighing would drop before they are computed.
        """
        if not self.enable_prefix_caching or request.prompt_logprobs is not None:
            return NO_HITS
        max_blocks = (request.num_tokens - 1) // self.block_size
        keys = self._block_keys(request, max_blocks)
        hits: List[int] = []
        for key in keys:
            block_id = self.cached.get(key)
            if block_id is None or block_id in excluding:
                break
            hits.append(block_id)
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def _block_keys(self, request: Request, num_blocks: int) -> List[BlockKey]:
        keys = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(keys), num_blocks):
            parent = keys[i - 1] if i else root_key(request.cache_salt)
            keys.append(block_key(parent, tokens[i * bs:(i + 1) * bs]))
        return keys[:num_blocks]

    # -------------------------------------------------------------- allocation
    def admission_hits(self, request: Request, freeing: Sequence[Request]) -> ComputedBlocks:
        """The request's prefix hits as they will be once `freeing` gave their blocks back.

        Freeing a request drops the names of its blocks not computed yet, so hits on those
        would hand the newcomer a block nobody will fill.
        """
        dropped = {b for r in freeing
                   for b in self.block_table(r.request_id)[r.num_computed_tokens // self.block_size:]}
        return self.get_computed_blocks(request, excluding=dropped)

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed: ComputedBlocks = NO_HITS, freeing: Sequence[Request] = ()) -> bool:
        """Whether allocate_slots would succeed, once the `freeing` requests were freed."""
        if not freeing:
            return self._num_new_blocks(request, num_new_tokens, computed) <= \
                self.num_free_blocks - sum(1 for b in computed.block_ids if self.ref_cnt[b] == 0)
        released = Counter(b for r in freeing for b in self.block_table(r.request_id))
        freed = {b for b, count in released.items() if self.ref_cnt[b] == count}
        free_hits = sum(1 for b in computed.block_ids if self.ref_cnt[b] == 0 or b in freed)
        return self._num_new_blocks(request, num_new_tokens, computed) <= \
            self.num_free_blocks + len(freed) - free_hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks = NO_HITS) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; False if they don't fit.

        `computed` are prefix-cache hits for a request being admitted: they are shared, not
        copied, and the caller advances num_computed_tokens past them.
        """
        table = self.block_tables.get(request.request_id)
        if table is not None and not computed.block_ids:
            return self._grow(request, table, num_new_tokens)
        if not self.can_allocate(request, num_new_tokens, computed):
            return False
        num_new = self._num_new_blocks(request, num_new_tokens, computed)
        table = self.block_tables.setdefault(request.request_id, [])
        for block_id in computed.block_ids:
            self._touch(block_id)
        table.extend(computed.block_ids)
        for _ in range(num_new):
            table.append(self._take_block_after(table))
        if self.enable_prefix_caching:
            total = request.num_computed_tokens + computed.num_tokens + num_new_tokens
            self._name_full_blocks(request, table, total)
        return True

    def append_slot(self, request: Request) -> bool:
        """Room for a running request's next token when that needs nothing done: its last
        block has room and the token does not fill it (so no block is taken or named). The
        check every decode passes through, every step; False sends it to allocate_slots."""
        computed = request.num_computed_tokens + 1
        return computed % self.block_size != 0 and \
            computed <= len(self.block_tables[request.request_id]) * self.block_size

    def _grow(self, request: Request, table: List[int], num_new_tokens: int) -> bool:
        """allocate_slots for a request that holds blocks and has no new hits: the path of
        every decode, every step, kept short (the scheduler's cost is per running request)."""
        total = request.num_computed_tokens + num_new_tokens
        num_new = -(-total // self.block_size) - len(table)
        if num_new > len(self.free_queue):
            return False
        for _ in range(num_new):
            table.append(self._take_block_after(table))
        if self.enable_prefix_caching and \
                min(total, request.num_tokens) // self.block_size > \
                self._num_named.get(request.request_id, 0):
            self._name_full_blocks(request, table, total)
        return True

    def uncomputed_shared_blocks(self, request: Request) -> Set[int]:
        """Blocks named for this step's tokens, not computed yet, that another request holds.

        Naming a block when it is allocated lets a request admitted in the same step share it
        (the forward pass writes keys before any attention reads them). If the request that
        was to compute it is then preempted in that step, the sharers must go too."""
        table = self.block_tables.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        return {b for b in table[first:] if self.block_key[b] is not None and self.ref_cnt[b] > 1}

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's blocks, tail first.

        Freeing the tail first puts a request's last blocks nearest the front of the LRU
        queue, so they are evicted before the shared prefix blocks at its head.
        """
        table = self.block_tables.pop(request.request_id, [])
        self._num_named.pop(request.request_id, None)
        first_uncomputed = request.num_computed_tokens // self.block_size
        for index in range(len(table) - 1, -1, -1):
            block_id = table[index]
            if index >= first_uncomputed:
                self._unname(block_id)  # named for a step that will not run
            self.ref_cnt[block_id] -= 1
            assert self.ref_cnt[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None
                self._frees += 1
                self._freed_at[block_id] = self._frees

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        for block_id in self.free_queue:
            self.block_key[block_id] = None

    # ---------------------------------------------------------------- internals
    def _num_new_blocks(self, request: Request, num_new_tokens: int,
                        computed: ComputedBlocks) -> int:
        held = len(self.block_tables.get(request.request_id, ())) + len(computed.block_ids)
        total = request.num_computed_tokens + computed.num_tokens + num_new_tokens
        return max(0, self.blocks_needed(total) - held)

    def _touch(self, block_id: int) -> None:
        self._hit[block_id] = True
        if self.ref_cnt[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_cnt[block_id] += 1

    def _take_block_after(self, table: List[int]) -> int:
        """A free block to append to `table`: the block after its last where that is free
        and may leave the queue out of order (see the module's docstring), else the queue's
        front (the least recently used)."""
        block_id = table[-1] + 1 if table else -1
        if block_id not in self.free_queue or not self._may_jump_queue(block_id):
            block_id = next(iter(self.free_queue))
        del self.free_queue[block_id]
        self._unname(block_id)
        self.ref_cnt[block_id] = 1
        return block_id

    def _may_jump_queue(self, block_id: int) -> bool:
        if self.block_key[block_id] is None:
            return True
        if self._hit[block_id]:
            return False
        oldest = self._freed_at[next(iter(self.free_queue))]
        return 2 * (self._freed_at[block_id] - oldest) <= self._frees - oldest

    def _unname(self, block_id: int) -> None:
        self._hit[block_id] = False
        key = self.block_key[block_id]
        if key is not None:
            if self.cached.get(key) == block_id:
                del self.cached[key]
            self.block_key[block_id] = None

    def _name_full_blocks(self, request: Request, table: List[int], num_tokens: int) -> None:
        """Register the blocks that will be full of known tokens after this step."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_named.get(request.request_id, 0)
        if num_full <= start:
            return
        keys = self._block_keys(request, num_full)
        for i in range(start, num_full):
            block_id = table[i]
            if self.block_key[block_id] is None:
                self.block_key[block_id] = keys[i]
                self.cached.setdefault(keys[i], block_id)
        self._num_named[request.request_id] = num_full

    # ------------------------------------------------------------------- checks
    def check_invariants(self, live_request_ids: Sequence[str] = ()) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        counts = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                counts[block_id] += 1
        assert counts == self.ref_cnt, "reference counts differ from the block tables"
        free = set(self.free_queue)
        assert counts[0] == 0 and 0 not in free, "the null block was handed out"
        for block_id, count in enumerate(counts[1:], start=1):
            assert (count == 0) == (block_id in free), f"block {block_id} free-queue mismatch"
        for key, block_id in self.cached.items():
            assert self.block_key[block_id] == key, f"block {block_id} cached under a stale key"
        stray = set(self.block_tables) - set(live_request_ids)
        assert not stray, f"blocks held by requests no longer live: {sorted(stray)}"
