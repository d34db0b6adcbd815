"""The compute, one folder per owner.

    inference/ orchestrator/ trainer/   the three processes (`python -m engines.X --config FILE`); they never
                                        import each other
    environments/ models/               libraries the processes share (environments may use models)
    protocol.py seeds.py weight_transport.py entry.py registry.py
                                        contracts shared across processes: the HTTP types, torch-free seeds,
                                        the collective weight path, the entry preamble, extension lookup

Nothing here imports Prefect, `flows`, `tasks` or `runtime`; pyproject.toml's import-linter contracts hold it.
"""
