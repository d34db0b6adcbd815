"""vLLM worker extension (`--worker-extension-cls rollflow_vllm_worker.WeightLoader`): in-flight weight loads.

Runs inside vLLM's worker processes, in vLLM's own environment, so it imports only torch and safetensors
(nothing of rollflow): the launcher puts this directory, and only it, on the workers' PYTHONPATH.
rollflow's vLLM backend calls `rollflow_load` on every worker through vLLM's `/collective_rpc` while generation is
paused; each worker reads the publication's safetensors (a local file) and hands the tensors to vLLM's
in-place reload (`Worker.reload_weights`), which maps the Hugging Face names, shards for tensor
parallelism and redoes the kernel-format processing (e.g. the CPU backend's repacked linear weights;
calling the model's `load_weights` directly fails there on the already-processed parameters).
"""

from __future__ import annotations

import hashlib


class WeightLoader:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's."""

    def rollflow_load(self, path: str, version: int) -> dict:
        """Load every tensor of the safetensors file at `path`; returns what was loaded, for the caller to check."""
        from safetensors.torch import load_file

        state = load_file(path)
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        self._reprocess_tied_head()
        self.rollflow_version = version
        return {"version": version, "tensors": len(state)}

    def _reprocess_tied_head(self) -> None:
        """A tied lm_head shares embed_tokens' weight but is never loaded itself, so the reload does not redo
        its processing; on CPU that processing builds a packed GEMM copy of the weight, which would keep
        serving the old policy's output projection. Redo it from the (reloaded) shared weight."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)

    def rollflow_fingerprint(self) -> dict:
        """The served version and a digest of the parameters: a test can tell that a load changed them."""
        digest = hashlib.sha256()
        for name, param in sorted(self.model_runner.get_model().named_parameters()):  # type: ignore[attr-defined]
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
        return {"version": getattr(self, "rollflow_version", None), "sha256": digest.hexdigest()}
