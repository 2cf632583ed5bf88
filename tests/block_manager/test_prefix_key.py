"""BlockKey: chained content keys never alias different content, even on hash collisions."""

from pagedray.block_manager import BlockKey


def test_equal_content_gives_equal_keys_across_separate_chains():
    a = BlockKey(BlockKey(None, (1, 2)), (3, 4))
    b = BlockKey(BlockKey(None, (1, 2)), (3, 4))
    assert a == b and hash(a) == hash(b)
    assert a.depth() == 2 and a.parent.parent is None


def test_parent_and_tokens_both_distinguish_keys():
    root = BlockKey(None, (1, 2))
    assert BlockKey(root, (3, 4)) != BlockKey(BlockKey(None, (1, 9)), (3, 4))
    assert BlockKey(root, (3, 4)) != BlockKey(root, (3, 5))
    assert BlockKey(None, (3, 4)) != BlockKey(root, (3, 4))  # root vs child with the same tokens


def test_forced_hash_collision_does_not_alias():
    a = BlockKey(None, (1, 2))
    b = BlockKey(None, (3, 4))
    b._hash = a._hash  # simulate a full 64-bit hash collision
    assert hash(a) == hash(b) and a != b
    table = {a: "block 0"}
    assert b not in table
    table[b] = "block 1"
    assert table[a] == "block 0" and table[b] == "block 1"


def test_natural_tuple_hash_collision_does_not_alias():
    # CPython hashes -1 and -2 alike, so these token tuples collide for real
    a = BlockKey(None, (-1, -1))
    b = BlockKey(None, (-2, -2))
    assert hash(a) == hash(b)
    assert a != b
    # the collision propagates to children with equal tokens; content still tells them apart
    assert hash(BlockKey(a, (5, 5))) == hash(BlockKey(b, (5, 5)))
    assert BlockKey(a, (5, 5)) != BlockKey(b, (5, 5))


def test_equality_of_very_long_chains_is_iterative():
    def chain(length):
        key = None
        for i in range(length):
            key = BlockKey(key, (i % 7, i % 5))
        return key

    long_a, long_b = chain(20_000), chain(20_000)  # deeper than the recursion limit
    assert long_a is not long_b and long_a == long_b
    assert long_a.depth() == 20_000


def test_block_hashes_are_the_same_in_another_process():
    """A router compares a prompt's block hashes with those an engine replica reports from another process:
    they must not depend on the process (hash(None) is an address on Python 3.11; the chain's root was it,
    so no reported summary ever matched a router's prompt)."""
    import subprocess
    import sys

    from pagedray.block_manager import prefix_block_hashes

    tokens = list(range(40, 88))
    code = "from pagedray.block_manager import prefix_block_hashes; print(prefix_block_hashes(list(range(40, 88)), 16))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(prefix_block_hashes(tokens, 16))
