"""The data sources that the rollout servers' built-in scorers know by name (`rollout_servers.rewards.builtin`),
and the form of answer each reads: the words shared with the demo's tasks that write those rows
(`demo.tasks.arithmetic`, `demo.tasks.scratchpad`)."""

EXACT_MATCH_SOURCE = "arithmetic"  # the synthetic arithmetic task: the completion is the answer, exactly
SCRATCHPAD_SOURCE = "scratchpad"  # the worked-addition task: the last line of the completion holds the answer
FINAL_ANSWER_MARK = "="  # a worked solution's last line: this mark, then the answer
