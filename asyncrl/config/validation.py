"""The `validation` section: periodic evaluation of the policy on the held-out `data.val_files`.

Rollout server 0 runs a pass whenever its weights reach a policy version that is a multiple of `every`,
and on the final version (`learner.total_steps`), and reports mean reward and pass@k (overall and per
data source) and the mean reward per response-length bucket to the learner, which logs `val/*`. With
`after_run` the job keeps the weights of those versions instead, and `asyncrl evaluate` scores them after it, on an
engine of its own (asyncrl/snapshots.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config.fields import bounded, items


@dataclass
class ValidationConfig:
    every: int = bounded(0, 0)  # policy versions between validation passes (version 0 included); 0 = off
    n: int = bounded(4, 1)  # samples per held-out prompt (pass@k needs n >= k)
    k: int = bounded(1, 1)  # k of the logged pass@k (unbiased estimator over the n samples)
    max_prompts: int = bounded(0, 0)  # held-out prompts per pass, the first ones of the files; 0 = all
    temperature: float = bounded(1.0, 0.0)  # sampling temperature of validation (0 = greedy)
    seeded: bool = True  # fixed sampling seeds per held-out sample (from run.seed): a policy scores the same every pass
    final_wait_s: float = bounded(120.0, 0.0)  # the learner holds its last record this long for the final version's pass
    length_buckets: list[int] = items()  # upper ends (response tokens, increasing) of the buckets of val/score/bucket/<lo>-<hi>, the mean score by response length; empty = none
    after_run: bool = False  # true: keep each due version's weights (RUN_DIR/snapshots) and score them after the job with `asyncrl evaluate`, off its clock and its engines, instead of on server 0 during it

    @property
    def during_run(self) -> bool:
        """Passes run inside the job: on rollout server 0 (the synchronous reference: between its steps)."""
        return bool(self.every) and not self.after_run

    def cross_checks(self) -> list[tuple[str, str]]:
        ends = self.length_buckets
        if self.after_run and not self.every:
            return [("validation.after_run", "needs validation.every > 0: it keeps the weights of the versions due")]
        if any(end < 1 for end in ends) or any(a >= b for a, b in zip(ends, ends[1:])):
            return [("validation.length_buckets", f"{ends} must be token counts >= 1 in increasing order")]
        return []
