"""The TCP receiver's pool of frame buffers: a request is served by a buffer
of its size class, as a view of exactly the asked size, and the buffer goes
back to the pool through that view's ``obj``; frames of different chunk
sizes in one class share buffers; when the sizes asked for change (a chunk
size fitted to the link), idle buffers of the old classes give way, so the
pool keeps hitting instead of staying full of a size nobody asks for."""

from __future__ import annotations

from kvbridge.transport.tcp.bufpool import BufferPool, size_class

K = 256 << 10
MIB = 1 << 20


def test_size_classes() -> None:
    assert [size_class(n) for n in (1, 2, 3, K, K + 1, MIB)] == [1, 2, 4, K, 2 * K, MIB]
    assert size_class(MIB + 52) == 2 * MIB and size_class(4 * MIB + 52) == 5 * MIB
    assert size_class(int(1.25 * MIB) + 52) == size_class(int(1.5 * MIB) + 52) == 2 * MIB


def test_a_returned_buffer_is_served_again_as_a_view_of_the_asked_size() -> None:
    pool = BufferPool(max_bytes=16 * MIB, min_size=K)
    a = pool.get(int(1.25 * MIB) + 52)
    assert len(a) == int(1.25 * MIB) + 52 and not a.readonly
    a[:3] = b"abc"
    pool.put(a.obj)  # what the receiver hands back: the view's buffer
    b = pool.get(int(1.5 * MIB) + 52)  # another chunk size, the same class
    assert b.obj is a.obj and len(b) == int(1.5 * MIB) + 52
    assert (pool.hits, pool.misses) == (1, 1)
    pool.put(bytearray(K // 2))  # below min_size: not kept
    pool.put(b"x" * K)  # not a bytearray: not kept
    pool.put(bytearray(3 * K))  # not a class size (not one of ours): not kept
    assert pool.idle_bytes == 0


def test_idle_buffers_of_old_classes_give_way_to_the_class_asked_for_now() -> None:
    pool = BufferPool(max_bytes=8 * MIB, min_size=K)
    old = [pool.get(2 * MIB) for _ in range(4)]
    for v in old:
        pool.put(v.obj)
    assert pool.idle_bytes == 8 * MIB  # full of the old class
    new = [pool.get(4 * MIB) for _ in range(2)]  # the chunk size grew
    for v in new:
        pool.put(v.obj)
    assert pool.idle_bytes == 8 * MIB  # the old class gave way ...
    hits = pool.hits
    got = [pool.get(4 * MIB) for _ in range(2)]
    assert pool.hits == hits + 2  # ... so it hits
    assert {id(v.obj) for v in got} == {id(v.obj) for v in new}
    misses = pool.misses
    again = pool.get(2 * MIB)  # the old buffers are gone: a fresh one
    assert pool.misses == misses + 1 and all(again.obj is not v.obj for v in old)


def test_a_pool_full_of_one_class_keeps_its_bound() -> None:
    pool = BufferPool(max_bytes=4 * MIB, min_size=K)
    for _ in range(3):
        pool.put(bytearray(2 * MIB))
    assert pool.idle_bytes == 4 * MIB
    pool.put(bytearray(8 * MIB))  # larger than the whole pool: not kept
    assert pool.idle_bytes == 4 * MIB
