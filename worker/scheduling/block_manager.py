"""The KV cache's block pool: free list, ref counts and prefix caching.

Design note. The cache is a fixed pool of `num_blocks` blocks of `block_size` token slots,
allocated once. A sequence owns an ordered list of block ids; token i of the sequence lives
in block ``block_ids[i // block_size]`` at offset ``i % block_size``.

Prefix caching: once a block is full and its K/V computed, it is registered under a hash
that chains the previous block's hash with the block's tokens, so the hash names the whole
prefix up to the block's end. A new sequence whose prefix hashes match reuses those blocks
(ref count + 1) and skips computing them. A block whose ref count drops to 0 goes to the back
of the free queue but keeps its hash; it is only forgotten when the queue's front reaches it
and it is handed out again, so the least recently used cached blocks are evicted first.

New weights (or KV memory released and given back) make every cached block stale:
`reset_prefix_cache` forgets them all and starts a new epoch. A sequence belongs to the epoch
in which its KV computation began (admission with no blocks); one still holding blocks from
an earlier epoch (kept through a weight update) keeps them but never registers them, and a
sequence admitted later hashes afresh, so no request ever reuses KV of other weights.
A sequence with a LoRA adapter seeds its chain with the adapter's load number, so KV is
shared only among sequences of the same adapter load (or of the base model).

Beam search forks a sequence (`fork`): the child holds the parent's blocks (ref count + 1).
A sequence about to write into a block it shares (the partial last block of a fork) first
copies it to a fresh block of its own (copy-on-write); the copies a step needs are handed to
the runner with the step (`take_copies`) and run before its forward pass.

Sliding windows. Where every layer of the model attends within a window (``kv_window``), a
block wholly behind a sequence's window is never read again: `drop_behind_window` gives it
back after each step, so a long generation holds about ``window / block_size`` blocks. The
dropped ids stay at the front of ``seq.block_ids`` (``seq.num_dropped_blocks`` of them) so
block indices keep meaning positions; attention never reads them (see
`headrace.kernels.attention`). A dropped block keeps its prefix hash like any freed block.
"""

from __future__ import annotations

from collections import OrderedDict

from headrace.worker.sequence import Sequence

# The chain's seed for a sequence's first block; any fixed int works.
_ROOT_HASH = 0x6865616472616365


def _root_hash(lora_id: int) -> int:
    """The chain's seed: the base model's, or one per LoRA adapter load."""
    return _ROOT_HASH if lora_id == 0 else hash((_ROOT_HASH, lora_id))


def chain_hash(prev_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of everything before it."""
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        kv_window: int | None = None,
    ) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        #: The sliding window every layer keeps to (None: some layer reads all the KV).
        self.kv_window = kv_window
        self.ref_counts = [0] * num_blocks
        #: Registered hash of each block (None while the block is partial or unregistered).
        self.block_hashes: list[int | None] = [None] * num_blocks
        #: Token ids of each registered block, to rule out hash collisions.
        self.block_tokens: list[tuple[int, ...]] = [()] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        #: Blocks with ref count 0, least recently freed first (an ordered set).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        #: Prompt blocks served from the cache instead of computed, over the engine's life.
        self.num_prefix_hit_blocks = 0
        #: Full prompt blocks looked up in the cache at admission (hits / this = hit rate).
        self.num_prefix_queried_blocks = 0
        #: Bumped by every reset: sequences of an older epoch neither match nor register.
        self.epoch = 0
        #: (source, destination) block copies of copy-on-write, for the next step to run.
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -----------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached block ids holding a prefix of seq's tokens (at least one token left over).

        At least one token must still be computed so the step yields logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        self._join_epoch(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        matched: list[int] = []
        for i in range(max_blocks):
            block_id = self.hash_to_block.get(seq.block_hashes[i])
            if block_id is None or self.block_tokens[block_id] != self._block_tokens(seq, i):
                break
            matched.append(block_id)
        return matched

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix and start a new epoch (see the design note)."""
        self.hash_to_block.clear()
        self.block_hashes = [None] * self.num_blocks
        self.block_tokens = [()] * self.num_blocks
        self.epoch += 1

    def _join_epoch(self, seq: Sequence) -> None:
        """A sequence about to compute KV from scratch hashes in the current epoch."""
        if seq.hash_epoch != self.epoch and not seq.block_ids:
            seq.block_hashes.clear()
            seq.hash_epoch = self.epoch

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            prev = hashes[-1] if hashes else _root_hash(seq.lora_id)
            hashes.append(chain_hash(prev, self._block_tokens(seq, len(hashes))))

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(seq.token_ids[start : start + self.block_size])

    # --- allocation ---------------------------------------------------------------------

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        copy, num_appended = self._growth(seq, num_new_tokens)
        return copy + num_appended

    def _growth(self, seq: Sequence, num_new_tokens: int) -> tuple[bool, int]:
        """Whether the block that seq's next token goes into is shared (copy it first), and
        the blocks to append so that num_new_tokens more computed tokens fit. (One call: the
        scheduler asks it of every running sequence, every step.)"""
        block_ids, computed = seq.block_ids, seq.num_computed_tokens
        index = computed // self.block_size
        copy = index < len(block_ids) and self.ref_counts[block_ids[index]] > 1
        total = self.num_blocks_for(computed + num_new_tokens)
        return copy, max(0, total - len(block_ids))

    def cost_of(self, cached_block_ids: list[int], num_new_blocks: int) -> int:
        """Free blocks used up by taking these cached blocks plus num_new_blocks fresh ones."""
        return num_new_blocks + sum(1 for b in cached_block_ids if self.ref_counts[b] == 0)

    def can_allocate(self, num_free_blocks_needed: int) -> bool:
        return num_free_blocks_needed <= len(self.free_queue)

    def take_cached(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        """Give a sequence with no blocks yet the matched prefix blocks; mark them computed."""
        assert not seq.block_ids and seq.num_computed_tokens == 0
        self._join_epoch(seq)
        for block_id in cached_block_ids:
            self._ref(block_id)
        seq.block_ids = list(cached_block_ids)
        seq.num_computed_tokens = len(cached_block_ids) * self.block_size
        self.num_prefix_hit_blocks += len(cached_block_ids)
        if self.enable_prefix_caching and not seq.wants_prompt_logprobs:
            self.num_prefix_queried_blocks += (seq.num_tokens - 1) // self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append enough fresh blocks to hold num_new_tokens more computed tokens."""
        copy, num_new = self._growth(seq, num_new_tokens)
        assert copy + num_new <= len(self.free_queue), "caller must check can_allocate first"
        if copy:  # (in place: the runner's block table sees the change)
            index = seq.num_computed_tokens // self.block_size
            shared, own = seq.block_ids[index], self._take_free()
            self.ref_counts[shared] -= 1
            seq.block_ids[index] = own
            self._copies.append((shared, own))
        for _ in range(num_new):
            seq.block_ids.append(self._take_free())

    def _take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        self._forget(block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` (no blocks yet) the parent's blocks of its computed tokens, shared,
        and the parent's place in the prefix cache."""
        assert not child.block_ids
        num_blocks = self.num_blocks_for(parent.num_computed_tokens)
        child.block_ids = parent.block_ids[:num_blocks]
        child.num_dropped_blocks = parent.num_dropped_blocks
        for block_id in child.block_ids[child.num_dropped_blocks :]:
            self._ref(block_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.hash_epoch = parent.hash_epoch

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write block copies made since the last call, to run before the step."""
        copies, self._copies = self._copies, []
        return copies

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that this step filled, so later sequences can reuse them."""
        if not self.enable_prefix_caching or seq.hash_epoch != self.epoch:
            return  # (an older epoch's KV is never offered to others)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        self._extend_hashes(seq, num_full)
        for i in range(num_full - 1, seq.num_dropped_blocks - 1, -1):
            block_id = seq.block_ids[i]
            if self.block_hashes[block_id] is not None:
                break  # this block and every one before it are already registered
            block_hash = seq.block_hashes[i]
            if block_hash in self.hash_to_block:
                continue  # another sequence computed the same prefix first; keep theirs
            self.block_hashes[block_id] = block_hash
            self.block_tokens[block_id] = self._block_tokens(seq, i)
            self.hash_to_block[block_hash] = block_id

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; the tail goes to the free queue first, so it is evicted first."""
        for block_id in reversed(seq.block_ids[seq.num_dropped_blocks :]):
            self._unref(block_id)
        seq.block_ids = []
        seq.num_dropped_blocks = 0

    def drop_behind_window(self, seq: Sequence) -> None:
        """Give back the blocks wholly behind the window of seq's next token (the first not
        computed): the keys it and every later token see start at position
        ``num_computed_tokens - kv_window + 1``."""
        if self.kv_window is None:
            return
        first_seen = max(0, seq.num_computed_tokens - self.kv_window + 1)
        num_behind = min(first_seen // self.block_size, len(seq.block_ids))
        for block_id in seq.block_ids[seq.num_dropped_blocks : num_behind]:
            self._unref(block_id)
        seq.num_dropped_blocks = max(seq.num_dropped_blocks, num_behind)

    def num_held_blocks(self, seq: Sequence) -> int:
        """The blocks seq holds a reference to (its dropped ones not counted)."""
        return len(seq.block_ids) - seq.num_dropped_blocks

    def trim(self, seq: Sequence) -> None:
        """Free seq's blocks past those its tokens need (KV written for proposals that were
        then rejected: never computed tokens, never in the prefix cache)."""
        keep = self.num_blocks_for(seq.num_tokens)
        for block_id in reversed(seq.block_ids[keep:]):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] == 0, "a block past a sequence's tokens is its own"
            self.free_queue[block_id] = None
        del seq.block_ids[keep:]

    def _unref(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0
        if self.ref_counts[block_id] == 0:
            self.free_queue[block_id] = None

    def _ref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def _forget(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            if self.hash_to_block.get(block_hash) == block_id:
                del self.hash_to_block[block_hash]
            self.block_hashes[block_id] = None
            self.block_tokens[block_id] = ()
