from headrace.worker.scheduling.block_manager import BlockManager

from tests.worker.seqs import make_seq


def admit(bm: BlockManager, seq, num_new: int | None = None) -> list[int]:
    """Admit seq the way the scheduler does: cached prefix, then fresh blocks, then compute."""
    cached = bm.match_prefix(seq)
    bm.take_cached(seq, cached)
    num_new = seq.num_tokens - seq.num_computed_tokens if num_new is None else num_new
    bm.allocate(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.commit_full_blocks(seq)
    return cached


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(10)))
    admit(bm, seq)
    assert len(seq.block_ids) == 3 and len(set(seq.block_ids)) == 3
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_ids == []


def test_second_sequence_with_shared_prefix_reuses_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(10)))
    admit(bm, first)
    second = make_seq(list(range(9)) + [99, 100])
    cached = admit(bm, second)
    # Tokens 0..7 fill two full blocks; the third block differs at token 9.
    assert cached == first.block_ids[:2]
    assert second.block_ids[:2] == first.block_ids[:2]
    assert bm.ref_counts[first.block_ids[0]] == 2
    assert bm.num_prefix_hit_blocks == 2


def test_a_whole_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(8)))
    admit(bm, first)
    again = make_seq(list(range(8)))
    cached = bm.match_prefix(again)
    # Two full blocks are cached, but one must be left so the step yields logits.
    assert len(cached) == 1


def test_freed_cached_blocks_are_reused_until_evicted_lru_first():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    a_blocks = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks == 4
    # A freed, cached block can still be matched.
    b = make_seq([1, 2, 3, 4, 9])
    assert admit(bm, b) == a_blocks[:2]
    bm.free(b)
    # Fill the pool with unrelated tokens: the cached blocks are evicted and forgotten.
    c = make_seq([7] * 8)
    admit(bm, c)
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5])) == []
    bm.free(c)
    assert bm.num_free_blocks == 4


def test_cost_counts_cached_blocks_that_sit_in_the_free_queue():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    again = make_seq([1, 2, 3, 4, 6])
    cached = bm.match_prefix(again)
    assert len(cached) == 2
    assert bm.cost_of(cached, num_new_blocks=1) == 3


def test_after_a_reset_no_sequence_reuses_blocks_computed_before_it():
    """New weights make cached KV stale: a prompt admitted after `reset_prefix_cache`
    computes everything again, though the old blocks are still in the free queue."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    before = make_seq(list(range(10)))
    admit(bm, before)
    bm.free(before)
    bm.reset_prefix_cache()
    after = make_seq(list(range(10)))
    assert admit(bm, after) == []
    assert bm.num_prefix_hit_blocks == 0
    # What the new epoch computes is cached again.
    assert admit(bm, make_seq(list(range(10)))) == after.block_ids[:2]


def test_a_sequence_kept_through_a_reset_never_offers_its_old_blocks():
    """A sequence holding blocks across a weight update goes on with them, but its KV (of
    the old weights) is never registered for a later request to reuse."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    kept = make_seq(list(range(6)))
    admit(bm, kept)
    bm.reset_prefix_cache()
    kept.token_ids.extend([6, 7, 8, 9])  # it decodes on into a second full block
    bm.allocate(kept, 4)
    kept.num_computed_tokens += 4
    bm.commit_full_blocks(kept)
    assert bm.hash_to_block == {}
    assert admit(bm, make_seq(list(range(10)))) == []


def test_a_preempted_sequence_rejoins_the_new_epoch():
    """Preempted across a reset, a sequence recomputes from scratch with the new weights, so
    it hashes and registers in the new epoch like any new one."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    seq = make_seq(list(range(10)))
    admit(bm, seq)
    bm.free(seq)
    seq.num_computed_tokens = 0
    bm.reset_prefix_cache()
    assert admit(bm, seq) == []
    assert seq.hash_epoch == bm.epoch
    assert admit(bm, make_seq(list(range(10)))) == seq.block_ids[:2]


def test_a_fork_shares_blocks_and_copies_the_partial_one_before_writing():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    parent = make_seq(list(range(10)))  # blocks: 4 + 4 + 2 tokens
    admit(bm, parent)
    child = make_seq(list(range(10)))
    bm.fork(parent, child)
    assert child.block_ids == parent.block_ids and child.num_computed_tokens == 10
    assert [bm.ref_counts[b] for b in parent.block_ids] == [2, 2, 2]
    for seq, token in ((parent, 50), (child, 60)):
        seq.token_ids.append(token)
    # The first writer into the shared partial block copies it; the last one writes in place.
    assert bm.num_new_blocks_needed(parent, 1) == 1
    bm.allocate(parent, 1)
    shared = child.block_ids[2]
    assert parent.block_ids[:2] == child.block_ids[:2] and parent.block_ids[2] != shared
    assert bm.take_copies() == [(shared, parent.block_ids[2])] and bm.take_copies() == []
    assert bm.num_new_blocks_needed(child, 1) == 0
    bm.allocate(child, 1)
    assert child.block_ids[2] == shared and bm.take_copies() == []
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8 and all(count == 0 for count in bm.ref_counts)


def test_a_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = make_seq(list(range(8)))
    admit(bm, parent)
    child = make_seq(list(range(8)))
    bm.fork(parent, child)
    child.token_ids.append(1)
    bm.allocate(child, 1)
    assert child.block_ids[:2] == parent.block_ids and len(child.block_ids) == 3
    assert bm.take_copies() == []


def test_trim_frees_the_blocks_past_a_sequences_tokens():
    """Blocks allocated for proposals a step then rejected go back; the ones the tokens use
    stay, and nothing trimmed was ever offered by the prefix cache."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    seq = make_seq(list(range(6)))
    admit(bm, seq, 5)  # 5 computed, the sixth token next
    bm.allocate(seq, 1 + 6)  # it and 6 proposals: positions 5..11, 3 blocks
    assert len(seq.block_ids) == 3
    kept, past = seq.block_ids[:2], seq.block_ids[2]
    seq.token_ids.append(42)  # one proposal kept and the model's token: 7 tokens
    seq.num_computed_tokens = 6
    bm.trim(seq)
    assert seq.block_ids == kept and bm.ref_counts[past] == 0
    assert bm.num_free_blocks == 6 and past not in bm.hash_to_block.values()
    bm.free(seq)
    assert bm.num_free_blocks == 8


def decode_one(bm: BlockManager, seq) -> None:
    """One decode step as the scheduler runs it: a block for the token, then drop behind."""
    seq.token_ids.append(7)
    bm.allocate(seq, 1)
    seq.num_computed_tokens += 1
    bm.commit_full_blocks(seq)
    bm.drop_behind_window(seq)


def test_a_windowed_sequence_holds_at_most_its_window_of_blocks():
    window, block_size = 10, 4
    bm = BlockManager(
        num_blocks=16, block_size=block_size, enable_prefix_caching=True, kv_window=window
    )
    seq = make_seq(list(range(6)))
    admit(bm, seq)
    bm.drop_behind_window(seq)
    bound = -(-window // block_size) + 1
    for _ in range(60):  # far past the window and past the pool's size
        decode_one(bm, seq)
        assert bm.num_held_blocks(seq) <= bound
        # The next token (position num_computed_tokens) sees back to this position.
        first_seen = seq.num_computed_tokens - window + 1
        assert seq.num_dropped_blocks == max(0, first_seen) // block_size
        assert bm.num_free_blocks == 16 - bm.num_held_blocks(seq)
    assert len(seq.block_ids) == -(-seq.num_computed_tokens // block_size)  # ids stay put
    bm.free(seq)
    assert bm.num_free_blocks == 16 and all(count == 0 for count in bm.ref_counts)


def test_without_a_window_nothing_is_dropped():
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(6)))
    admit(bm, seq)
    for _ in range(40):
        decode_one(bm, seq)
    assert seq.num_dropped_blocks == 0 and bm.num_held_blocks(seq) == len(seq.block_ids) == 12


def test_dropped_blocks_stay_cached_and_a_fork_shares_only_held_blocks():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, kv_window=5)
    parent = make_seq(list(range(14)))
    admit(bm, parent)
    bm.drop_behind_window(parent)
    # The next token is 14; it sees 10..14, so blocks 0 and 1 (tokens 0..7) are dropped.
    assert parent.num_dropped_blocks == 2
    dropped = parent.block_ids[:2]
    assert all(bm.ref_counts[b] == 0 for b in dropped)
    child = make_seq(list(range(14)))
    bm.fork(parent, child)
    assert child.num_dropped_blocks == 2
    assert all(bm.ref_counts[b] == 0 for b in dropped)
    assert all(bm.ref_counts[b] == 2 for b in parent.block_ids[2:])
    # A new prompt with the same start still finds the dropped blocks in the prefix cache.
    again = make_seq(list(range(14)) + [99])
    assert admit(bm, again)[:2] == dropped
    for seq in (parent, child, again):
        bm.free(seq)
    assert bm.num_free_blocks == 16 and all(count == 0 for count in bm.ref_counts)


def test_a_dropped_block_handed_to_another_sequence_is_never_registered_again():
    """Regression: registering walks back over a sequence's unregistered full blocks (those
    another sequence computed first); it must stop at its dropped ones, which may since have
    gone to another sequence."""
    bm = BlockManager(num_blocks=10, block_size=2, enable_prefix_caching=True, kv_window=2)
    first = make_seq([1, 2, 3, 4, 5, 6, 7])
    admit(bm, first)  # blocks 0-3, the three full ones registered
    twin = make_seq([1, 2, 3, 4, 5, 6])
    bm.allocate(twin, 6)  # the same tokens in blocks of its own (4-6): never registered
    twin.num_computed_tokens = 6
    bm.commit_full_blocks(twin)
    bm.drop_behind_window(twin)  # its next token sees 5..6: blocks 4 and 5 dropped
    assert twin.num_dropped_blocks == 2
    bm.free(first)
    other = make_seq(list(range(100, 114)))
    bm.allocate(other, 14)  # every free block: first's (their hashes forgotten) and twin's two
    assert set(twin.block_ids[:2]) <= set(other.block_ids)
    bm.free(other)  # (back in the queue, unregistered)
    decode_one(bm, twin)
    assert all(bm.block_hashes[b] is None for b in twin.block_ids[:2])
    assert bm.block_hashes[twin.block_ids[2]] is not None  # its held full block registered
