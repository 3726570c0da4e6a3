"""Config validation: unknown keys, wrong types and out-of-range values fail, naming the key."""

import subprocess
import sys

import pytest

from asyncrl.config import ConfigError, load_config, save_config


def test_defaults_load_and_overrides_apply():
    config = load_config(None, ["run.seed=7", "data.train_files=[a.jsonl,b.parquet]", "data.weights=[1,3]"])
    assert config.run.seed == 7
    assert config.data.train_files == ["a.jsonl", "b.parquet"]
    assert config.data.weights == [1.0, 3.0]


def test_micro_batch_tokens_take_auto_or_a_number_from_a_file_or_an_override(tmp_path):
    assert load_config().learner.micro_batch_budget() is None  # auto by default
    path = tmp_path / "job.yaml"
    path.write_text("learner:\n  micro_batch_tokens: 4096\n")
    assert load_config(path).learner.micro_batch_budget() == 4096
    assert load_config(path, ["learner.micro_batch_tokens=auto"]).learner.micro_batch_budget() is None


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("run:\n  seed: 3\n  name: from-file\nmodel:\n  tiny:\n    num_layers: 2\n")
    config = load_config(path, ["run.seed=5"])
    assert (config.run.seed, config.run.name, config.model.tiny.num_layers) == (5, "from-file", 2)


@pytest.mark.parametrize(
    "override, named",
    [
        ("run.sed=1", "run.sed"),
        ("nosection.key=1", "nosection"),
        ("run.seed=abc", "run.seed"),
        ("model.tiny.hidden_size=1.5", "model.tiny.hidden_size"),
        ("run.seed=-1", "run.seed"),
        ("run.gpu_memory_gib=-1", "run.gpu_memory_gib"),
        ("reward.timeout_s=0", "reward.timeout_s"),
        ("model.dtype=int8", "model.dtype"),
        ("task.operators=/", "task.operators"),
        ("model.tiny.num_heads=3", "model.tiny.num_heads"),
        ("data.weights=[1,2]", "data.weights"),
        ("data.weights=[-1]", "data.weights"),
        ("+run.extra=1", "+run.extra=1"),
        ("learner.micro_batch_tokens=lots", "learner.micro_batch_tokens"),
        ("learner.micro_batch_tokens=0", "learner.micro_batch_tokens"),
        ("learner.activation_checkpointing=some", "learner.activation_checkpointing"),
        ("learner.packing=yes", "learner.packing"),
    ],
)
def test_bad_override_names_the_key(override, named):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert named in str(error.value)


def test_unknown_key_in_file_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  seeed: 1\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert "run.seeed" in str(error.value) and "bad.yaml" in str(error.value)


def test_missing_and_unparseable_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(broken)


def test_saved_config_reloads_identically(tmp_path):
    config = load_config(None, ["run.seed=11", "task.max_digits=3"])
    saved = save_config(config, tmp_path / "run")
    assert load_config(saved) == config


def test_cli_rejects_bad_key_before_any_work(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "data", f"task.out_dir={tmp_path}", "task.max_digitz=2"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "task.max_digitz" in result.stderr
    assert not any(tmp_path.iterdir())


def test_chat_sessions_are_dropped_before_the_learner_gives_up_waiting():
    with pytest.raises(ConfigError, match=r"rollout.chat.session_idle_s: must be below learner.batch_timeout_s=600"):
        load_config(None, ["rollout.chat.enabled=true", "rollout.chat.session_idle_s=600"])
    load_config(None, ["rollout.chat.enabled=true", "rollout.chat.session_idle_s=599"])
    load_config(None, ["rollout.chat.session_idle_s=600"])  # no endpoint, no sessions to wait for


def test_a_non_loopback_chat_endpoint_needs_an_api_key():
    exposed = ["rollout.chat.enabled=true", "rollout.chat.host=0.0.0.0"]
    with pytest.raises(ConfigError, match=r"rollout\.chat\.host: '0\.0\.0\.0' is not loopback: set "
                                          r"rollout\.chat\.api_key_file or rollout\.chat\.api_key_env"):
        load_config(None, exposed)
    assert load_config(None, [*exposed, "rollout.chat.api_key_env=AGENT_KEY"]).rollout.chat.api_key_env == "AGENT_KEY"
    load_config(None, [*exposed, "rollout.chat.api_key_file=key.txt"])
    load_config(None, ["rollout.chat.enabled=true", "rollout.chat.host=localhost"])  # loopback needs none
    with pytest.raises(ConfigError, match=r"rollout\.chat\.api_key_env: set api_key_file or api_key_env, not both"):
        load_config(None, ["rollout.chat.api_key_file=k", "rollout.chat.api_key_env=K"])


def test_a_non_loopback_control_bind_needs_the_jobs_curve_keys():
    bind = "rollout.weight_sync.control_bind=tcp://0.0.0.0:0"
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync\.control_bind.*buffer\.curve_dir"):
        load_config(None, [bind])
    assert load_config(None, [bind, "buffer.curve_dir=keys"]).buffer.curve_dir == "keys"
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync\.control_bind.*tcp://host:port"):
        load_config(None, ["rollout.weight_sync.control_bind=127.0.0.1:5000"])


def test_the_synchronous_reference_runs_one_engine_per_rank():
    with pytest.raises(ConfigError, match=r"rollout\.num_servers.*one engine in each learner rank"):
        load_config(None, ["learner.mode=synchronous", "rollout.num_servers=2"])
    load_config(None, ["rollout.num_servers=2"])  # the async job takes any number of servers
    assert load_config(None, ["learner.mode=synchronous", "learner.nproc=4", "buffer.batch_groups=4"]).learner.nproc == 4


@pytest.mark.parametrize("overrides, message", [
    (["buffer.batch_groups=3"], r"buffer\.batch_groups: must be at least learner\.nproc=4"),
    (["rollout.engine.tensor_parallel_size=2"], r"rollout\.engine\.tensor_parallel_size: must be 1 .*learner\.nproc=4"),
    (["rollout.placement=apart"], r"rollout\.placement: .*learner\.nproc=4 runs each rank's engine beside it"),
])
def test_colocated_synchronous_ranks_need_a_share_of_prompts_and_an_engine_on_their_gpu(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["learner.mode=synchronous", "learner.nproc=4", *overrides])
    load_config(None, ["learner.nproc=4", *overrides])  # the async learner's ranks have no engine of their own
