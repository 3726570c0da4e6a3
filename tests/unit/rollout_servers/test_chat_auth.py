"""Reading the chat endpoint's API key: from a file or an environment variable, with errors naming the key."""

import pytest

from asyncrl.config.rollout import ChatEndpointConfig
from rollout_servers.chat.auth import ApiKeyError, load_api_key


def test_the_key_comes_from_a_file_or_an_environment_variable(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("sesame\n")
    assert load_api_key(ChatEndpointConfig(api_key_file=str(key_file))) == "sesame"
    monkeypatch.setenv("AGENT_KEY", "open")
    assert load_api_key(ChatEndpointConfig(api_key_env="AGENT_KEY")) == "open"
    assert load_api_key(ChatEndpointConfig()) is None


def test_a_key_that_cannot_be_read_names_its_config_key(tmp_path, monkeypatch):
    with pytest.raises(ApiKeyError, match=r"rollout\.chat\.api_key_file: cannot read '.*missing'"):
        load_api_key(ChatEndpointConfig(api_key_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ApiKeyError, match=r"rollout\.chat\.api_key_file: '.*empty' is empty"):
        load_api_key(ChatEndpointConfig(api_key_file=str(tmp_path / "empty")))
    monkeypatch.delenv("AGENT_KEY", raising=False)
    with pytest.raises(ApiKeyError, match=r"rollout\.chat\.api_key_env: the environment variable AGENT_KEY is not set"):
        load_api_key(ChatEndpointConfig(api_key_env="AGENT_KEY"))
