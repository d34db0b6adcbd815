"""The orchestrator: draws prompts, samples groups from inference, has the environments score them, computes
every group's advantages and commits rollout shards. It never imports torch."""
