"""The command line: overrides wherever they stand after the command, and clear errors for the rest."""

from __future__ import annotations

import pytest

from launch import cli


def test_overrides_may_follow_a_commands_options():
    args = cli.parse(["export", "runs/a", "model.path=/m", "--out", "/tmp/x", "model.dtype=bfloat16"])
    assert (args.run_dir, args.out) == ("runs/a", "/tmp/x")
    assert args.overrides == ["model.path=/m", "model.dtype=bfloat16"]


@pytest.mark.parametrize("argv, named", [
    (["export", "runs/a", "--out", "/tmp/x", "--bogus"], "--bogus"),
    (["export", "runs/a", "--out", "/tmp/x", "stray"], "stray"),
    (["plot", "runs/a", "run.seed=1"], "run.seed=1"),  # plot reads no config
])
def test_anything_else_is_an_error_that_names_it(argv, named, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.parse(argv)
    assert raised.value.code == 2
    assert f"unrecognized arguments: {named}" in capsys.readouterr().err
