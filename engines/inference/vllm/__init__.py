"""The vLLM backend (`inference.backend = "vllm"`): vLLM servers (and a vllm-router per replica) upstream.

    backend.py    the Backend the front end serves: routing to replicas, policy versions, weight updates
    processes.py  the vLLM processes of a local run: materialize a publication, launch, wait, stop
    worker/       the worker extension vLLM loads (rollflow_vllm_worker.WeightLoader: in-flight weight loads)
launch/vllm.py renders the commands (also what `--dry-run` writes, this backend's launch plan).

This module is the backend's registration (config/registry.py): import-light, read at load time.
"""

from engines.inference.backend import DEPLOYMENT_KEYS, BackendSpec, Capabilities

BACKEND = BackendSpec(
    Capabilities(
        replicas=True,
        routed_experts=True,  # vLLM's GPU build (Model Runner V2); the CPU build is refused at launch
        # kept_support: no. vLLM returns the sampled token's logprob (raw, or with --logprobs-mode
        # processed_logprobs renormalised over the kept set) and at most --max-logprobs alternatives, never
        # the size of the support top-k / top-p kept (docs/algorithm.md "Keep sampling mask")
        deployment_keys=frozenset(DEPLOYMENT_KEYS),
        launch_plan="launch.vllm:plan_files",
    ),
    create="engines.inference.vllm.backend:create",
)
