"""The auditor's cache of the trainer's verified leaves: it survives a reopen, a torn tail is
cut off, and leaves verified under one commitment are dropped when the trainer signs another."""

from __future__ import annotations

import os

from auditor_node.leafcache import CACHE_FILE, CachedClaims, LeafCache
from protocol.commit.commitments import Commitment, sign_commitment
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf

KEY = KeyPair.generate()


def _signed(root_byte: int):
    return sign_commitment(Commitment(bytes(32), 5, bytes([root_byte]) * 32, bytes(32),
                                      KEY.public_key, "trainer", 0), KEY)


def _leaf(step: int) -> Leaf:
    return Leaf(step, bytes([step]) * 32, bytes([100 + step]) * 32)


def _filled(path, commitment, steps):
    cache = LeafCache(path, commitment)
    for step in steps:
        cache.add(_leaf(step))
    cache.close()


def test_leaves_survive_a_reopen(tmp_path):
    _filled(tmp_path / CACHE_FILE, _signed(1), range(4))
    cache = LeafCache(tmp_path / CACHE_FILE, _signed(1))
    assert len(cache) == 4 and cache.get(3) == _leaf(3) and cache.get(4) is None
    cache.close()


def test_a_torn_tail_is_cut_off_and_appending_goes_on(tmp_path):
    path = tmp_path / CACHE_FILE
    _filled(path, _signed(1), range(4))
    os.truncate(path, path.stat().st_size - 5)  # the crash came mid-append of leaf 3
    cache = LeafCache(path, _signed(1))
    assert len(cache) == 3 and cache.get(3) is None
    cache.add(_leaf(3))
    cache.close()
    assert len(LeafCache(path, _signed(1))) == 4


def test_leaves_under_another_commitment_are_dropped(tmp_path):
    _filled(tmp_path / CACHE_FILE, _signed(1), range(4))
    cache = LeafCache(tmp_path / CACHE_FILE, _signed(2))
    assert len(cache) == 0
    cache.close()


class _Source:
    def __init__(self):
        self.asked: list[int] = []

    def commitment(self):
        return _signed(1)

    def leaf(self, step):
        self.asked.append(step)
        return _leaf(step)


def test_cached_claims_ask_the_source_once_per_leaf(tmp_path):
    source = _Source()
    claims = CachedClaims(source, tmp_path)
    assert [claims.leaf(s) for s in (0, 1, 0, 1)] == [_leaf(0), _leaf(1)] * 2
    claims.close()
    again = CachedClaims(source, tmp_path)
    assert again.leaf(1) == _leaf(1) and again.leaf(2) == _leaf(2)
    again.close()
    assert source.asked == [0, 1, 2]
