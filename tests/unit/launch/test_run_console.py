"""What `asyncrl run` repeats on the console from a role's log when the role gives up."""

from __future__ import annotations

from launch.commands.run import last_errors

LOG = """\
20:14:40 [rollout] INFO asyncrl.rollout: starting 1 servers
20:14:45 [rollout0] ERROR rollout_servers.supervisor: server-0 cannot start: DataError: malformed rows:
  data/a.jsonl, row 0: field 'reward_model' must be an object with 'ground_truth'
  data/a.jsonl, row 3: field 'prompt' must be a list of messages
Traceback (most recent call last):
  File "rollout_servers/supervisor.py", line 125, in _serve
    server = RolloutServer(config, index, endpoints, state_dir)
asyncrl.data.rows.DataError: malformed rows:
  data/a.jsonl, row 0: field 'reward_model' must be an object with 'ground_truth'
20:14:47 [rollout] ERROR asyncrl.rollout: server-0 cannot start from this config (not restarted)
20:14:47 [rollout] INFO asyncrl.rollout: stopped
"""


def test_an_error_comes_with_the_lines_that_continue_it_and_without_its_traceback(tmp_path):
    log = tmp_path / "rollout.log"
    log.write_text(LOG)
    assert last_errors(log) == [
        "20:14:45 [rollout0] ERROR rollout_servers.supervisor: server-0 cannot start: DataError: malformed rows:",
        "  data/a.jsonl, row 0: field 'reward_model' must be an object with 'ground_truth'",
        "  data/a.jsonl, row 3: field 'prompt' must be a list of messages",
        "20:14:47 [rollout] ERROR asyncrl.rollout: server-0 cannot start from this config (not restarted)",
    ]


def test_only_the_last_records_are_shown(tmp_path):
    log = tmp_path / "rollout.log"
    log.write_text("".join(f"10:00:0{index} [rollout] ERROR x: failure {index}\n" for index in range(5)))
    assert last_errors(log, count=2) == ["10:00:03 [rollout] ERROR x: failure 3", "10:00:04 [rollout] ERROR x: failure 4"]
    assert last_errors(tmp_path / "absent.log") == []
