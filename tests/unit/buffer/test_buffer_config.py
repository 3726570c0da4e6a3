from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config


def test_buffer_section_loads_with_overrides():
    config = load_config(None, ["buffer.fsync=always", "buffer.max_staleness=0", "buffer.port=5555"])
    assert (config.buffer.fsync, config.buffer.starting_staleness(), config.buffer.port) == ("always", 0, 5555)
    assert not config.buffer.paced


@pytest.mark.parametrize("start, expected", [(1, 2), (4, 4), (9, 6)])
def test_auto_staleness_starts_at_k_start_inside_the_bounds(start, expected):
    config = load_config(None, ["buffer.max_staleness=auto", "buffer.pacing.k_min=2", "buffer.pacing.k_max=6",
                                f"buffer.pacing.k_start={start}"])
    assert config.buffer.paced and config.buffer.starting_staleness() == expected


@pytest.mark.parametrize("override, key", [
    ("buffer.fsync=sometimes", "buffer.fsync"),
    ("buffer.max_staleness=-1", "buffer.max_staleness"),
    ("buffer.max_staleness=sometimes", "buffer.max_staleness"),
    ("buffer.max_staleness=2.5", "buffer.max_staleness"),
    ("buffer.pacing.k_min=9", "buffer.pacing.k_min"),  # above the default k_max of 8
    ("buffer.pacing.window=0", "buffer.pacing.window"),
    ("buffer.bind_host=0.0.0.0", "buffer.bind_host"),
    ("buffer.address=localhost:5555", "buffer.address"),
    ("buffer.no_such_key=1", "buffer.no_such_key"),
])
def test_invalid_buffer_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_non_loopback_bind_is_fine_with_keys():
    assert load_config(None, ["buffer.bind_host=0.0.0.0", "buffer.curve_dir=keys"]).buffer.curve_dir == "keys"


@pytest.mark.parametrize("host", ["::", "*", "0.0.0.0"])
def test_a_wildcard_bind_host_reaches_the_loopback_check(host):
    """YAML read `::` as a mapping and `*` as an alias: the override failed before the check could name it."""
    with pytest.raises(ConfigError, match=r"buffer\.bind_host: '.*' is not loopback"):
        load_config(None, [f"buffer.bind_host={host}"])


def test_override_values_keep_their_types():
    config = load_config(None, ["buffer.port=5555", "buffer.fsync=none", "buffer.client_timeout_s=2.5",
                                "buffer.address=tcp://h:1"])
    assert (config.buffer.port, config.buffer.fsync, config.buffer.client_timeout_s) == (5555, "none", 2.5)
    assert config.buffer.address == "tcp://h:1"


def test_a_curve_dir_without_keys_is_a_config_error_naming_the_key(tmp_path):
    import zmq

    from asyncrl.transport.sockets import ServerSecurity, connect_dealer

    with pytest.raises(ConfigError, match=r"buffer\.curve_dir.*keygen"):
        connect_dealer(zmq.Context.instance(), "tcp://127.0.0.1:1", str(tmp_path))
    with pytest.raises(ConfigError, match=r"buffer\.curve_dir.*server\.key_secret"):
        ServerSecurity(zmq.Context.instance(), str(tmp_path))


def test_a_study_lag_within_k_loads():
    config = load_config(None, ["buffer.max_staleness=4", "buffer.study_lag_versions=4"])
    assert (config.buffer.starting_staleness(), config.buffer.study_lag_versions) == (4, 4)


@pytest.mark.parametrize("overrides, problem", [
    (["buffer.max_staleness=2", "buffer.study_lag_versions=3"],
     r"buffer\.study_lag_versions: 3 exceeds buffer\.max_staleness=2: no group could start"),
    (["buffer.max_staleness=2", "buffer.study_lag_versions=2", "learner.sync_every=2"],
     r"buffer\.study_lag_versions: needs learner\.sync_every=1 \(is 2\)"),
    (["buffer.max_staleness=2", "buffer.study_lag_versions=2", "learner.mode=synchronous"],
     r"buffer\.study_lag_versions: learner\.mode=synchronous samples with the newest weights"),
])
def test_a_study_lag_that_cannot_hold_is_refused_naming_the_key(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(None, overrides)
