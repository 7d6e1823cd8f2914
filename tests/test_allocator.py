"""zeroedu.allocator, against blocks worked out by hand."""

from __future__ import annotations

import pytest

from zeroedu.allocator import Arena, forward_pattern


def test_split_merge_and_best_fit():
    a = Arena(4096)
    assert a.malloc(100, "x") == 0            # rounded to 512
    assert a.malloc(1000, "y") == 512         # 1024 bytes
    assert a.malloc(512, "z") == 1536
    a.free("y")                               # a 1024-byte hole between x and z
    assert a.stats() == {"allocated": 1024, "free": 3072, "largest_free": 2048, "fragmentation": pytest.approx(1 / 3)}
    assert a.malloc(512, "w") == 512          # best fit: the hole, not the 2048-byte tail
    a.free("x")
    a.free("w")                               # x, w and the rest of the hole merge: 0..1536 free
    assert [(b.start, b.size, b.owner) for b in a.blocks] == [(0, 1536, None), (1536, 512, "z"), (2048, 2048, None)]
    with pytest.raises(KeyError):
        a.free("nobody")


def test_fragmentation_fails_a_request_that_fits_in_total():
    """Each layer's 2 KiB of activations, then its 1 KiB checkpoint behind them: best fit puts every layer's
    activations back in the first hole and the checkpoints march on behind it, leaving a 2 KiB hole in front
    and 3 KiB behind. 5 KiB are free and a 4 KiB request fails. In one contiguous buffer allocated first,
    the checkpoints leave one 5 KiB block."""
    a = Arena(8 * 1024)
    forward_pattern(a, layers=3, checkpoint_bytes=1024, activation_bytes=2048, contiguous=False)
    assert a.layout(8) == "..ccc..."
    assert a.free_bytes() == 5 * 1024 and a.largest_free() == 3 * 1024
    assert a.stats()["fragmentation"] == pytest.approx(1 - 3 / 5)
    with pytest.raises(MemoryError, match="fragmentation"):
        a.malloc(4 * 1024, "gradient bucket")
    b = Arena(8 * 1024)
    forward_pattern(b, layers=3, checkpoint_bytes=1024, activation_bytes=2048, contiguous=True)
    assert b.layout(8) == "ccc....." and b.largest_free() == 5 * 1024
    b.malloc(4 * 1024, "gradient bucket")
