"""Targeting spec, build config and the contract documentation."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas import render_markdown
from sidindex.config import BuildConfig, QualityThresholds, SIDConfig, load_config
from sidindex.errors import ConfigError, InputError
from sidindex.targeting import BITMASK, BLOOM, load_targeting, spec_from_dict, write_targeting


def test_contracts_doc_is_generated_from_the_contracts():
    doc = Path(__file__).parents[1] / "schemas" / "CONTRACTS.md"
    assert doc.read_text() == render_markdown(), "regenerate with: python -m schemas > schemas/CONTRACTS.md"


def test_spec_round_trips_through_toml(tmp_path, spec):
    path = tmp_path / "t.toml"
    write_targeting(spec, path)
    again = load_targeting(path)
    assert again == spec
    assert [a.kind for a in again.attributes] == [BITMASK] * 5 + [BLOOM]
    assert again.bloom[0].bits == 256 and again.bloom[0].hashes == 2


def test_spec_values_with_quotes_round_trip(tmp_path):
    spec = spec_from_dict({"attribute": [{"name": "n", "kind": "bitmask", "values": ['a"b', "c\\d", "é"]}]})
    write_targeting(spec, tmp_path / "t.toml")
    assert load_targeting(tmp_path / "t.toml").attributes[0].values == ('a"b', "c\\d", "é")


@pytest.mark.parametrize("doc,message", [
    ({}, "declares no attributes"),
    ({"attribute": [{"name": "a", "kind": "set", "values": ["x"]}]}, "kind must be 'bitmask' or 'bloom'"),
    ({"attribute": [{"name": "a", "kind": "bitmask"}]}, "needs a non-empty 'values' list"),
    ({"attribute": [{"name": "a", "kind": "bitmask", "values": ["x", "x"]}]}, "value 'x' is declared twice"),
    ({"attribute": [{"name": "a", "kind": "bloom", "bits": 100}]}, "'bits' must be a positive multiple of 64"),
    ({"attribute": [{"name": "a", "kind": "bloom", "hashes": 0}]}, "'hashes' must be an integer in 1..16"),
    ({"attribute": [{"name": "a", "kind": "bloom", "values": ["x"]}]}, "'values' applies to bitmask only"),
    ({"attribute": [{"name": "a", "kind": "bitmask", "values": ["x"], "bits": 64}]}, "apply to bloom attributes only"),
    ({"attribute": [{"name": "a", "kind": "bloom"}, {"name": "a", "kind": "bloom"}]}, "declared twice"),
    ({"attribute": [{"name": "ad_id", "kind": "bloom"}]}, "reserved"),
    ({"attribute": [{"name": "a", "kind": "bloom", "bitz": 64}]}, "unknown key 'bitz'"),
    ({"version": 2, "attribute": [{"name": "a", "kind": "bloom"}]}, "version 2 is not supported"),
])
def test_bad_specs(doc, message):
    with pytest.raises(InputError, match=message):
        spec_from_dict(doc, "t.toml")


def test_bad_toml_names_the_file(tmp_path):
    (tmp_path / "t.toml").write_text("[[attribute]\nname=")
    with pytest.raises(InputError, match=r"t.toml: not valid TOML"):
        load_targeting(tmp_path / "t.toml")


def test_config_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[sid]\nlevels = [64, 32]\npaths = 3\nbalanced = true\n[quality]\nmax_sid_share = 0.2\n")
    cfg = load_config(p)
    assert cfg.sid.levels == (64, 32) and cfg.sid.paths == 3 and cfg.sid.balanced and cfg.sid.sid_length == 3
    assert cfg.quality.max_sid_share == 0.2 and cfg.quality.min_level_codes == 2
    assert load_config(None) == BuildConfig()


@pytest.mark.parametrize("text,message", [
    ("[sid]\nlevels = []\n", "levels: expected a non-empty list"),
    ("[sid]\nlevels = [40000]\n", "levels: expected a non-empty list of sizes in 1..32768"),
    ("[sid]\npaths = 0\n", "paths: expected an integer in 1..8"),
    ("[sid]\ncapacity = 0.5\n", "capacity: expected a number in"),
    ("[sid]\npath_ratio = -1\n", "path_ratio: expected a number >= 0"),
    ("[sid]\nlevels = [32768, 32768, 32768, 32768]\n", "below 2\\^63"),
    ("[sid]\nlevelz = [8]\n", "unknown key 'levelz'"),
    ("[quality]\nmax_sid_share = 2\n", "max_sid_share: expected a number in \\(0, 1\\]"),
    ("[search]\nbeams = 1\n", "unknown key 'search'"),
])
def test_bad_configs(tmp_path, text, message):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(p)


def test_config_objects_validate_directly():
    with pytest.raises(ConfigError):
        SIDConfig(hash_keys=())
    with pytest.raises(ConfigError):
        QualityThresholds(min_level_perplexity=0.5)
