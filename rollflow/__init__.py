"""rollflow: asynchronous RL post-training with durable rollouts, supervised by Prefect."""

__version__ = "0.1.0"
