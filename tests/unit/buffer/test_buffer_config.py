from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config


def test_buffer_section_loads_with_overrides():
    config = load_config(None, ["buffer.fsync=always", "buffer.max_staleness=0", "buffer.port=5555"])
    assert (config.buffer.fsync, config.buffer.max_staleness, config.buffer.port) == ("always", 0, 5555)


@pytest.mark.parametrize("override, key", [
    ("buffer.fsync=sometimes", "buffer.fsync"),
    ("buffer.max_staleness=-1", "buffer.max_staleness"),
    ("buffer.bind_host=0.0.0.0", "buffer.bind_host"),
    ("buffer.address=localhost:5555", "buffer.address"),
    ("buffer.no_such_key=1", "buffer.no_such_key"),
])
def test_invalid_buffer_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_non_loopback_bind_is_fine_with_keys():
    assert load_config(None, ["buffer.bind_host=0.0.0.0", "buffer.curve_dir=keys"]).buffer.curve_dir == "keys"
