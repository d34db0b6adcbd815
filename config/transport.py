"""How new weights reach the inference engine: the filesystem publication alone, or also a collective group."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from config.base import Strict

# The collective transport's shared secret: the `rl` flow draws one per attempt and gives it to the inference
# process and the trainer through this environment variable (never in a config file, argv or log). Both sides
# refuse to run the collective transport without it (engines/weight_transport.py).
TRANSPORT_SECRET_ENV = "ROLLFLOW_TRANSPORT_SECRET"


class WeightBroadcastConfig(Strict):
    """`filesystem`: the engine reads each publication (the default). `collective`: the trainer's rank 0 and
    the inference process form a 2-rank torch.distributed group and the trainer sends every new policy over
    it, tensor by tensor, before publishing it to the filesystem as always (docs/inference.md)."""

    type: Literal["filesystem", "collective"] = "filesystem"
    host: str = Field(
        "127.0.0.1",
        description="the address the engine's rendezvous store listens on (only there) and the trainer connects to",
    )
    port: int = Field(0, ge=0, le=65535, description="rendezvous port; 0: the flow picks a free one at launch")
    c10d_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        alias="backend",
        description="torch.distributed backend; auto: nccl when both sides have a CUDA device, else gloo",
    )
    timeout_s: float = Field(30.0, gt=0, description="bound on forming the group and on one transfer")
