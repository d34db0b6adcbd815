"""The compute: models, environments, the inference engine, the orchestrator and the trainer.

Nothing here imports Prefect or `flows`; each process has one entry module (`python -m engines.X`).
"""
