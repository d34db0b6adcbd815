"""The trainer: supervised fine-tuning (the RL warm-up, policy version 0, and `rollflow sft` runs) and the RL
loop that consumes rollout shards."""
