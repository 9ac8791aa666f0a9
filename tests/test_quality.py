"""The SID quality report against counts computed by hand, and its fail thresholds."""

from __future__ import annotations

import numpy as np
import pytest

from sidindex.config import QualityThresholds, SIDConfig
from sidindex.sid import Codebook, sid_quality
from sidindex.sid.assign import SIDAssignment


def make(sids, ad_index, first_ratio, sizes=(4, 3, 5)):
    sids = np.asarray(sids, dtype=np.int16)
    ad_index = np.asarray(ad_index, dtype=np.int64)
    path = np.zeros(len(ad_index), dtype=np.int8)
    for i in range(1, len(ad_index)):
        path[i] = path[i - 1] + 1 if ad_index[i] == ad_index[i - 1] else 0
    cents = tuple(np.eye(k, 2, dtype=np.float32) for k in sizes[:-1])
    cb = Codebook(cents, sizes[-1], ("k",), 2, None, SIDConfig(levels=sizes[:-1], hash_size=sizes[-1]), ("a note",))
    return SIDAssignment(ad_index, path, sids, np.asarray(first_ratio, dtype=np.float32), sizes), cb


def test_counts_match_a_hand_computation():
    # 4 ads, 6 SID rows; SID (0,0,1) is held by ads 0, 1 and 2; (1,2,1) by ad 0 only, ...
    a, cb = make([[0, 0, 1], [1, 2, 1], [0, 0, 1], [0, 0, 1], [3, 1, 4], [2, 1, 4]],
                 [0, 0, 1, 2, 3, 3], [1.01, 1.2, 1.05, 2.0])
    x = np.array([[1, 0], [0, 1], [1, 1], [0, 0]], dtype=np.float32)
    r = sid_quality(a, cb, x)
    assert r.n_ads == 4 and r.n_sid_rows == 6
    assert r.sids_per_ad_counts == {1: 2, 2: 2} and r.sids_per_ad_mean == 1.5
    assert r.distinct_sids == 4
    assert r.ads_per_sid_max == 3 and r.largest_group_sid == (0, 0, 1) and r.largest_group_share == 0.75
    assert r.ads_per_sid_p50 == 1.0
    assert r.collision_rate == pytest.approx(3 / 6)
    lv0 = r.levels[0]  # codes 0,1,0,0,3,2 over size 4
    assert (lv0.size, lv0.used, lv0.dead) == (4, 4, 0)
    p = np.array([3, 1, 1, 1]) / 6
    assert lv0.perplexity == pytest.approx(np.exp(-(p * np.log(p)).sum()))
    lv2 = r.levels[2]  # hash level: codes 1,1,1,1,4,4 over size 5
    assert (lv2.kind, lv2.used, lv2.dead) == ("hash", 2, 3)
    assert lv2.gini == pytest.approx(2 / 3)  # sorted [0,0,0,2,4]: sum((2i-6) x_i) / (5 * 6) = 20/30
    assert r.near_second_share == 0.5
    # path-0 reconstruction with centroids eye(k, 2): ad0 (0,0) -> [1,0]+[1,0]; ad1 -> same; ad2 -> same;
    # ad3 (3,1) -> [0,0]+[0,1]
    rec = np.array([[2, 0], [2, 0], [2, 0], [0, 1]], dtype=np.float64)
    lvl1 = np.array([[1, 0], [1, 0], [1, 0], [0, 0]], dtype=np.float64)
    assert r.mse[0] == pytest.approx(((x - lvl1) ** 2).sum(1).mean())
    assert r.mse[1] == pytest.approx(((x - rec) ** 2).sum(1).mean())
    assert r.notes == ("a note",) and r.failures == ()


def test_gates_fail_on_collapse_and_concentration():
    a, cb = make([[0, 0, 1], [0, 1, 1], [0, 2, 2]], [0, 1, 2], [1.5, 1.5, 1.5])
    x = np.zeros((3, 2), dtype=np.float32)
    r = sid_quality(a, cb, x, QualityThresholds(min_level_codes=2, max_sid_share=0.3))
    assert r.failures == ("level 0 uses 1 of 4 codes (min_level_codes = 2): the codebook collapsed",
                          "SID [0, 0, 1] holds 33.3% of the ads (max_sid_share = 0.3)")
    assert sid_quality(a, cb, x, QualityThresholds(min_level_codes=1)).failures == ()
    # level 0 uses one code (perplexity 1), level 1 three codes evenly (perplexity 3)
    r = sid_quality(a, cb, x, QualityThresholds(min_level_codes=None, min_level_perplexity=2.5))
    assert r.failures == ("level 0 perplexity 1.00 < min_level_perplexity 2.5",)
