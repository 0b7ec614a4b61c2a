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


def test_default_profile_is_the_embedded_default():
    cfg = config.load(REPO / "config" / "default.yaml")
    assert cfg.model.target == config.EMBEDDED and cfg.runtime.backend == "onnxruntime"


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


def test_relative_engine_dir_is_resolved_against_a_stable_base(tmp_path, monkeypatch):
    repo = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(tmp_path)  # never the current directory
    assert config.engine_root(Config()) == repo / "engines"
    assert config.engine_root(Config().replace(**{"runtime.engine_dir": str(tmp_path / "e")})) == tmp_path / "e"
    # an installed package without its source tree: a per-user folder under ROS_HOME
    installed = tmp_path / "site-packages" / "spec_edge"
    installed.mkdir(parents=True)
    monkeypatch.setenv("ROS_HOME", str(tmp_path / "ros_home"))
    assert config.engine_base(installed) == tmp_path / "ros_home" / "spec_edge"
    monkeypatch.delenv("ROS_HOME")
    assert config.engine_base(installed) == Path.home() / ".ros" / "spec_edge"
