"""The ground layer: typed run and component configs, the profile loader and redaction.

Imports only pydantic and the standard library, so `rollflow --help`, validation and `--dry-run` are
instant, and every other layer (storage, engines, tasks, flows, the CLI) can import it.

    TOML profiles + CLI overrides --config.loader--> RunConfig (config.run; one model per component
    in config/<component>.py) --config.process.component_configs--> one *ProcessConfig per process.
"""
