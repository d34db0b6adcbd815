"""The environment library: the Environment protocol and the built-in string tasks (base.py), tool tasks
(tools.py), multi-turn episodes (episodes.py), plugin loading by import path or entry point (plugins.py),
reasoning-gym datasets (rgym.py), and verifiers environments (verifiers_env.py, verifiers_client.py).
Environments draw tasks and score completions into rows; the orchestrator computes every advantage."""
