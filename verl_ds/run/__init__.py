"""The run: what builds and starts a job on top of ``verl_ds.config``. ``startup.check_startup`` is the gate that
refuses a job before anything is built (``checks.check_config``: the config against the registries; ``ports``: the
control server's address); ``verl_ds.resolved_config`` resolves the config for this run. docs/config.md lists what
is refused."""
