"""The trainer: supervised warm-up (policy version 0) and the RL loop that consumes rollout shards."""
