"""GTM index build and CPU matcher against an independent brute-force reference (docs/design.md §3, §4, §6).

Random small specs, catalogs, SIDs (tiny level sizes, so middle tokens are shared) and requests;
the reference below re-derives eligibility from the definition and matcher bits from mmh3 directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from operator import or_
from types import SimpleNamespace

import mmh3
import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidindex.errors import ConfigError
from sidindex.exact import build_exact_index, eligible_mask
from sidindex.matchers.bitmask import bitmask_layout
from sidindex.matchers.bitmask import encode_ad_rows as bitmask_rows
from sidindex.matchers.bloom import BLOOM_SEED, bloom_layout
from sidindex.matchers.bloom import encode_ad_rows as bloom_rows
from sidindex.matchers.kinds import KINDS
from sidindex.request_encoding import encode_requests
from sidindex.requests import Requests, requests_from
from sidindex.targeting import BITMASK, BLOOM, Attribute, TargetingSpec
from sidindex.trie import build_gtm
from sidindex.trie.kway import KWayConfig
from sidindex.trie.match import passing_tokens
from sidindex.trie.stats import gtm_stats

VOCAB = [f"loc{i}" for i in range(12)]


@dataclass
class Scenario:
    spec: TargetingSpec
    ads: list[dict]            # attribute name -> list[str] | None
    sids: list[tuple]          # SID rows
    sid_ads: list[int]         # ad of each SID row
    level_sizes: tuple[int, ...]
    requests: list[dict]       # attribute name -> str | None (bitmask) or list[str] (bloom)
    kway: KWayConfig = KWayConfig(k=(2, 2, 1))
    values: list[float] | None = None  # each ad's value (docs/design.md §16), or none


# --- independent reference ---------------------------------------------------------------------

def eligible(spec: TargetingSpec, ad: dict, req: dict) -> bool:
    for a in spec.attributes:
        restrict = ad[a.name]
        if not restrict:
            continue
        if a.kind == BITMASK and req[a.name] not in restrict:
            return False
        if a.kind == BLOOM and not set(req[a.name] or []) & set(restrict):
            return False
    return True


def ref_bitmask_row(spec: TargetingSpec, ad: dict) -> int:
    """The ad's bitmask row as one Python int (bit b = segment bit b)."""
    row, off = 0, 0
    for a in spec.bitmask:
        seg = len(a.values) + 1
        if not ad[a.name]:
            row |= ((1 << seg) - 1) << off
        else:
            for v in ad[a.name]:
                row |= 1 << (off + a.values.index(v))
        off += seg
    return row


def ref_bloom_row(spec: TargetingSpec, ad: dict) -> int:
    row, off = 0, 0
    for a in spec.bloom:
        if not ad[a.name]:
            row |= ((1 << a.bits) - 1) << off
        else:
            for v in ad[a.name]:
                for i in range(a.hashes):
                    row |= 1 << (off + mmh3.hash(v, BLOOM_SEED + i, signed=False) % a.bits)
        off += a.bits
    return row


def as_int(row: np.ndarray) -> int:
    return sum(int(w) << (64 * i) for i, w in enumerate(row))


# --- scenarios ---------------------------------------------------------------------------------

def draw_catalog(draw, attrs, level_sizes, max_ads: int, vocab=VOCAB, max_values: int = 6, max_sids: int = 3):
    """(ads, sids, sid_ads) of a random catalog: per ad and attribute no restriction (None or []) or
    up to `max_values` values (bloom ones from `vocab`), each ad under 1..max_sids distinct SIDs."""
    def restriction(a: Attribute):
        pool = list(a.values) if a.kind == BITMASK else vocab
        return draw(st.one_of(st.none(), st.just([]),
                              st.lists(st.sampled_from(pool), min_size=1, max_size=max_values, unique=True)))

    n_ads = draw(st.integers(1, max_ads))
    ads = [{a.name: restriction(a) for a in attrs} for _ in range(n_ads)]
    sid = st.tuples(*[st.integers(0, k - 1) for k in level_sizes])
    sids, sid_ads = [], []
    for ad in range(n_ads):
        for s in draw(st.lists(sid, min_size=1, max_size=max_sids, unique=True)):
            sids.append(s)
            sid_ads.append(ad)
    return ads, sids, sid_ads


@st.composite
def scenarios(draw, max_ads: int = 20) -> Scenario:
    n_bl = draw(st.integers(0, 2))
    n_bm = draw(st.integers(0 if n_bl else 1, 2))
    attrs = [Attribute(f"b{i}", BITMASK, values=tuple(f"v{j}" for j in range(draw(st.integers(1, 5)))))
             for i in range(n_bm)]
    attrs += [Attribute(f"l{i}", BLOOM, bits=draw(st.sampled_from([64, 128])), hashes=draw(st.integers(1, 3)))
              for i in range(n_bl)]
    spec = TargetingSpec(tuple(attrs))
    level_sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=2, max_size=4)))

    ads, sids, sid_ads = draw_catalog(draw, attrs, level_sizes, max_ads)

    def request_value(a: Attribute):
        if a.kind == BITMASK:
            return draw(st.one_of(st.none(), st.just("undeclared"), st.sampled_from(a.values)))
        return draw(st.lists(st.sampled_from(VOCAB + ["nowhere"]), max_size=5, unique=True))

    requests = [{a.name: request_value(a) for a in attrs} for _ in range(draw(st.integers(1, 4)))]
    kway = draw(st.one_of(
        st.builds(KWayConfig, k=st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)),
        st.builds(KWayConfig, mode=st.just("dynamic"), k_max=st.integers(1, 4), target_fill=st.floats(0.05, 1.0))))
    return Scenario(spec, ads, sids, sid_ads, level_sizes, requests, kway)


def frame(spec: TargetingSpec, rows: list[dict], bitmask_type) -> pl.DataFrame:
    cols = {}
    for a in spec.attributes:
        dtype = bitmask_type if a.kind == BITMASK else pl.List(pl.String)
        cols[a.name] = pl.Series(a.name, [r[a.name] for r in rows], dtype=dtype)
    return pl.DataFrame(cols, height=len(rows))


def requests_of(sc: Scenario) -> Requests:
    """The scenario's requests as a validated request table."""
    rows = frame(sc.spec, sc.requests, pl.String)
    ids = pl.int_range(0, len(sc.requests), eager=True)  # scenarios may bring more values than a request file may
    return requests_from(rows.with_columns(request_id=ids), sc.spec, max_values=1 << 20)


MANIFEST = SimpleNamespace(id="test")  # what an in-memory Snapshot of a scenario reads of its manifest


def build(sc: Scenario):
    """(GTM index, ad bitmask rows, ad Bloom rows, exact index, the requests' encoding)."""
    cat = frame(sc.spec, sc.ads, pl.List(pl.String))
    bm = bitmask_rows(sc.spec.bitmask_layout, cat)
    bl = bloom_rows(sc.spec.bloom_layout, cat)
    ad_rows = {k.name: k.encode_ads(layout, cat) for k, layout in zip(KINDS, sc.spec.layouts)}  # every plane
    bits = sum(layout.bits for layout in sc.spec.layouts)
    index = build_gtm(np.array(sc.sids, dtype=np.int16), np.array(sc.sid_ads, dtype=np.int64),
                      sc.level_sizes, ad_rows, kway=sc.kway, matcher_bits=bits,
                      ad_value=None if sc.values is None else np.array(sc.values, dtype=np.float64))
    exact = build_exact_index(sc.spec, cat, ad_rows)
    return index, bm, bl, exact, encode_requests(requests_of(sc), sc.spec)


# --- the checks --------------------------------------------------------------------------------

def check(sc: Scenario) -> None:
    index, bm, bl, exact, enc = build(sc)
    L = len(sc.level_sizes)
    sid_set = set(sc.sids)

    # encoders equal the reference bits
    for ad, row in enumerate(sc.ads):
        assert as_int(bm[ad]) == ref_bitmask_row(sc.spec, row)
        assert as_int(bl[ad]) == ref_bloom_row(sc.spec, row)

    # structure: node ids depth by depth, children contiguous and sorted, tokens in range
    assert np.all(np.diff(index.node_offsets) >= 0) and index.node_offsets[-1] == index.num_nodes - 1
    np.testing.assert_array_equal(index.csr_child_nodes, np.arange(1, index.num_nodes))
    for node in range(index.num_nodes):
        toks = index.csr_tokens[index.node_offsets[node]:index.node_offsets[node + 1]]
        assert np.all(np.diff(toks.astype(int)) > 0)

    # (5) the trie holds exactly the catalog's SIDs, each leaf with exactly its ads
    leaves = [tuple(int(t) for t in s) for s in index.leaf_sids()]
    assert leaves == sorted(sid_set)
    for leaf, s in enumerate(leaves):
        ads = index.leaf_ads[index.leaf_ad_offsets[leaf]:index.leaf_ad_offsets[leaf + 1]]
        assert list(ads) == sorted(a for a, t in zip(sc.sid_ads, sc.sids) if t == s)

    # (2) + (4) every entry's matchers equal the OR over its subtree's ads; tables have unique rows
    bm_plane, bl_plane = index.planes[:2]  # the planes the scenarios' attributes fill
    assert len({r.tobytes() for r in bm_plane.table}) == len(bm_plane.table)
    assert len({r.tobytes() for r in bl_plane.table}) == len(bl_plane.table)
    prefix_of_node = {0: ()}
    for node in range(index.num_nodes):
        for e in range(index.node_offsets[node], index.node_offsets[node + 1]):
            child = int(index.csr_child_nodes[e])
            prefix = prefix_of_node[node] + (int(index.csr_tokens[e]),)
            prefix_of_node[child] = prefix
            ads = {a for a, s in zip(sc.sid_ads, sc.sids) if s[:len(prefix)] == prefix}
            assert ads, "every node lies on a real SID"
            want_bm = want_bl = 0
            for a in ads:
                want_bm |= ref_bitmask_row(sc.spec, sc.ads[a])
                want_bl |= ref_bloom_row(sc.spec, sc.ads[a])
            assert as_int(bm_plane.table[bm_plane.index[e]]) == want_bm
            assert as_int(bl_plane.table[bl_plane.index[e]]) == want_bl
            # (6) k-way: 1..k partitions that OR to the union, each ad wholly inside one of them
            parts = range(index.part_offsets[e], index.part_offsets[e + 1])
            assert 1 <= len(parts) <= sc.kway.k_at(len(prefix) - 1)
            p_bm = [as_int(bm_plane.table[bm_plane.part_index[p]]) for p in parts]
            p_bl = [as_int(bl_plane.table[bl_plane.part_index[p]]) for p in parts]
            assert reduce(or_, p_bm) == want_bm and reduce(or_, p_bl) == want_bl
            for a in ads:
                a_bm, a_bl = ref_bitmask_row(sc.spec, sc.ads[a]), ref_bloom_row(sc.spec, sc.ads[a])
                assert any(a_bm & ~pb == 0 and a_bl & ~pl_ == 0 for pb, pl_ in zip(p_bm, p_bl))

    for r, req in enumerate(sc.requests):
        truth = [eligible(sc.spec, ad, req) for ad in sc.ads]
        # (3) the exact ad filter equals the eligibility definition
        assert list(eligible_mask(exact, enc, r, np.arange(len(sc.ads)))) == truth
        # (1) no false negative, and CD passes exactly the real continuations
        for node, prefix in prefix_of_node.items():
            if len(prefix) == L:
                continue
            real = sorted({s[len(prefix)] for s in sid_set if s[:len(prefix)] == prefix})
            assert list(passing_tokens(index, enc, r, node, "cd")) == real
            gtm = set(passing_tokens(index, enc, r, node, "cd+gtm").tolist())
            kway = set(passing_tokens(index, enc, r, node, "cd+gtm+kway").tolist())
            assert kway <= gtm <= set(real)
            need = {s[len(prefix)] for a, s in zip(sc.sid_ads, sc.sids) if s[:len(prefix)] == prefix and truth[a]}
            assert need <= kway, f"eligible prefix {prefix} + token rejected"


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_gtm_index_against_brute_force(sc):
    check(sc)


# --- edge cases ----------------------------------------------------------------------------------

SPEC = TargetingSpec((Attribute("country", BITMASK, values=("US", "CA", "GB")),
                      Attribute("locations", BLOOM, bits=256, hashes=2)))


def scenario(ads, sids, sid_ads, level_sizes=(3, 2, 4), requests=None) -> Scenario:
    requests = requests or [{"country": c, "locations": locs} for c in ("US", "GB", None, "XX")
                            for locs in ([], ["loc1"], ["loc3", "nowhere"], VOCAB)]
    return Scenario(SPEC, ads, sids, sid_ads, level_sizes, requests)


def test_one_ad():
    check(scenario([{"country": ["CA"], "locations": ["loc1"]}], [(2, 1, 3)], [0]))


def test_all_ads_unrestricted_share_one_matcher_row():
    ads = [{"country": None, "locations": []} for _ in range(6)]
    sc = scenario(ads, [(i % 3, i % 2, i % 4) for i in range(6)], list(range(6)))
    check(sc)
    index = build(sc)[0]
    assert [len(p.table) for p in index.planes] == [1] * len(index.planes)


def test_all_ads_share_one_sid():
    ads = [{"country": [c], "locations": [f"loc{i}"]} for i, c in enumerate(["US", "CA", "GB", "US"])]
    sc = scenario(ads, [(1, 1, 1)] * 4, [0, 1, 2, 3])
    check(sc)
    assert build(sc)[0].num_leaves == 1


def test_ad_with_hundreds_of_locations_and_requests_with_0_and_64_locations():
    many = [f"geo{i}" for i in range(300)]
    ads = [{"country": ["US"], "locations": many}, {"country": None, "locations": ["loc2"]}]
    requests = [{"country": "US", "locations": []}, {"country": "US", "locations": many[:64]},
                {"country": "US", "locations": [f"far{i}" for i in range(64)]}]
    sc = scenario(ads, [(0, 0, 0), (0, 1, 2)], [0, 1], requests=requests)
    check(sc)
    index, _, _, exact, enc = build(sc)
    assert list(eligible_mask(exact, enc, 1, np.array([0, 1]))) == [True, False]
    assert list(eligible_mask(exact, enc, 0, np.array([0, 1]))) == [False, False]


def test_levels_of_different_sizes():
    ads = [{"country": [c], "locations": None} for c in ("US", "CA", "GB")]
    check(scenario(ads, [(0, 6, 1, 299), (4, 6, 0, 0), (4, 2, 1, 299)], [0, 1, 2], level_sizes=(5, 7, 2, 300)))


def test_stats_count_entries_and_dedup():
    ads = [{"country": None, "locations": None}, {"country": ["US"], "locations": ["loc1"]}]
    sc = scenario(ads, [(0, 0, 0), (0, 0, 1), (1, 1, 1)], [0, 1, 1])
    index = build(sc)[0]
    st_ = gtm_stats([index], (4, 256))
    assert [p.entries for p in st_.positions] == [2, 2, 3]
    assert [p.parents for p in st_.positions] == [1, 2, 2]
    # position 0: child 0 holds both ads (all-ones union), child 1 only ad 1 -> 2 distinct rows
    bm0 = st_.positions[0].planes["bitmask"]
    assert bm0.bytes_before == 16 and bm0.bytes_after == 16
    assert st_.positions[2].planes["bitmask"].bytes_after == 16  # leaves: unrestricted row, ad 1's row
    assert bm0.fill == pytest.approx((4 / 4 + 1 / 4) / 2)
    assert st_.ads_per_sid_max == 1 and st_.sids == 3 and st_.sids_per_ad_max == 2
    assert st_.table_bytes["bitmask"] == len(index.planes[0].table) * 8
    # k-way (2, 2, 1): ad 0's all-ones rows cover ad 1, so no entry needs a second partition
    assert [p.partitions for p in st_.positions] == [2, 2, 3]
    assert bm0.part_fill == pytest.approx((4 / 4 + 1 / 4) / 2)
    flat = st_.to_dict()["positions"][0]  # how a manifest names them
    assert flat["bitmask_bytes_after"] == 16 and flat["part_bitmask_fill"] == bm0.part_fill


def test_build_rejects_bad_arguments():
    bm = np.zeros((2, 1), dtype=np.uint64)
    with pytest.raises(ValueError, match="level 1 tokens"):
        build_gtm(np.array([[0, 5]], dtype=np.int16), np.array([0]), (2, 3), {"bitmask": bm, "bloom": bm})
    with pytest.raises(ValueError, match="ad_index must index"):
        build_gtm(np.array([[0, 1]], dtype=np.int16), np.array([7]), (2, 3), {"bitmask": bm, "bloom": bm})


@pytest.mark.parametrize("kway", [KWayConfig(k=(2, 2, 2)), KWayConfig(mode="dynamic", k_max=4, target_fill=0.015)])
def test_kway_rejects_what_the_union_cannot(kway):
    """Ads (US, loc1) and (CA, loc2) under one prefix: their union passes (US, loc2), no ad matches.
    Each ad sets 3 of 260 matcher bits, both 6: above the dynamic target of 0.015, so it splits."""
    ads = [{"country": ["US"], "locations": ["loc1"]}, {"country": ["CA"], "locations": ["loc2"]}]
    requests = [{"country": "US", "locations": ["loc2"]}, {"country": "CA", "locations": ["loc2"]}]
    sc = Scenario(SPEC, ads, [(0, 0, 0), (0, 1, 1)], [0, 1], (3, 2, 4), requests, kway)
    check(sc)
    index, _, _, _, enc = build(sc)
    assert list(passing_tokens(index, enc, 0, 0, "cd+gtm")) == [0]
    assert list(passing_tokens(index, enc, 0, 0, "cd+gtm+kway")) == []
    assert list(passing_tokens(index, enc, 1, 0, "cd+gtm+kway")) == [0]
    assert np.diff(index.part_offsets)[0] == 2  # the root's child split its two leaves


def test_single_level_sids_with_kway():
    ads = [{"country": [c], "locations": None} for c in ("US", "CA")]
    check(Scenario(SPEC, ads, [(0,), (2,), (2,)], [0, 0, 1], (3,), [{"country": "CA", "locations": []}],
                   KWayConfig(k=(2,))))


def test_the_spec_carries_its_layouts_and_the_matcher_parses_its_mode():
    assert SPEC.bitmask_layout is SPEC.bitmask_layout and SPEC.bitmask_layout == bitmask_layout(SPEC.bitmask)
    assert SPEC.bloom_layout is SPEC.bloom_layout and SPEC.bloom_layout == bloom_layout(SPEC.bloom)
    index, *_, enc = build(scenario([{"country": ["CA"], "locations": ["loc1"]}], [(2, 1, 3)], [0]))
    with pytest.raises(ConfigError, match="mode must be one of"):
        passing_tokens(index, enc, 0, 0, "cd+bogus")
    with pytest.raises(ConfigError, match="does not walk the trie"):
        passing_tokens(index, enc, 0, 0, "none")


def test_bitmask_encoder_refuses_undeclared_values():
    cat = pl.DataFrame({"country": [["US"], ["UK"]], "locations": [None, None]},
                       schema={"country": pl.List(pl.String), "locations": pl.List(pl.String)})
    with pytest.raises(ValueError, match="outside its declared values"):
        bitmask_rows(SPEC.bitmask_layout, cat)
