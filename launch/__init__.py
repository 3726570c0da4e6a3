"""The entry points: the `asyncrl` command and its subcommands, the Ray launcher, run plans, `tune` and `plot`.
The only package that imports the roles (lazily, so that `asyncrl --help` stays instant)."""
