"""The run: what builds and starts a job on top of ``verl_ds.config``. ``startup.check_startup`` is the gate that
refuses a job before anything is built (``checks.check_config``: the config against the registries; ``limits``:
the config resolved for this run; ``ports``: the control server's address). docs/config.md lists what is refused."""
