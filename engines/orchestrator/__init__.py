"""The orchestrator: draws prompts, samples groups from inference, scores them, commits rollout shards."""
