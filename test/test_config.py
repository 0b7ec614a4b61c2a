"""Config: one set of defaults, YAML profiles map one-to-one to the dataclasses."""
from __future__ import annotations

from pathlib import Path

import pytest

from spec_edge import config
from spec_edge.config import Config, ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_dump_load_round_trip(tmp_path):
    cfg = Config().replace(**{"speculative.k": 3, "graphs.k_values": [3, 5], "sampling.temperature": 0.7})
    path = tmp_path / "p.yaml"
    path.write_text(config.dump(cfg))
    assert config.load(path) == cfg


def test_every_profile_in_config_loads():
    profiles = sorted((REPO / "config").glob("*.yaml"))
    assert (REPO / "config" / "default.yaml") in profiles
    for path in profiles:
        config.load(path)


def test_default_profile_is_the_embedded_default_in_4_bits_over_4_slots():
    cfg = Config()
    assert cfg.model.target == config.EMBEDDED and cfg.runtime.backend == "onnxruntime"
    assert (cfg.graphs.weights, cfg.graphs.batch_slots) == ("q4", 4)
    assert (cfg.speculative.drafter, cfg.speculative.k) == ("ngram", "auto")


@pytest.mark.parametrize("key,value,message", [
    ("speculative.drafter", "magic", "speculative.drafter 'magic' is unknown"),
    ("speculative.k", 9, "speculative.k=9 has no verify graph"),
    ("sampling.top_p", 0.0, "top_p"),
    ("sampling.top_p", float("nan"), "top_p"),
    ("sampling.temperature", float("inf"), "sampling.temperature must be a finite number"),
    ("sampling.temperature", float("nan"), "sampling.temperature must be a finite number"),
    ("sampling.min_p", 2.0, r"sampling.min_p must be in \[0, 1\]"),
    ("sampling.repetition_penalty", -1.0, "sampling.repetition_penalty must be a finite number > 0"),
    ("sampling.frequency_penalty", float("inf"), "sampling.frequency_penalty must be a finite number"),
    ("graphs.max_context", "big", "must be an integer"),
    ("graphs.k_values", [0], "k_values"),
])
def test_bad_values_are_refused(key, value, message):
    with pytest.raises(ConfigError, match=message):
        Config().replace(**{key: value})


def test_unknown_yaml_key_is_named(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("/**:\n  ros__parameters:\n    speculative:\n      kk: 3\n")
    with pytest.raises(ConfigError, match="speculative.kk"):
        config.load(path)


def test_relative_engine_dir_is_resolved_under_the_user_cache(tmp_path, monkeypatch):
    """One engines folder for every entry point, wherever it starts: $XDG_CACHE_HOME/spec_edge/<engine_dir>
    (~/.cache when XDG_CACHE_HOME is unset or relative, as the XDG spec says); an absolute engine_dir as it is."""
    monkeypatch.chdir(tmp_path)  # never the current directory
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert config.engine_root(Config()) == tmp_path / "cache" / "spec_edge" / "engines"
    other = Config().replace(**{"runtime.engine_dir": "other"})
    assert config.engine_root(other) == tmp_path / "cache" / "spec_edge" / "other"
    assert config.engine_root(Config().replace(**{"runtime.engine_dir": str(tmp_path / "e")})) == tmp_path / "e"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert config.engine_root(Config()) == Path.home() / ".cache" / "spec_edge" / "engines"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert config.engine_root(Config()) == Path.home() / ".cache" / "spec_edge" / "engines"
