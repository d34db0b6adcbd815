"""The embedded backend: rollflow's batched torch engine (engine.py) behind the front end.

`create` builds the model from the run's model config, loads the newest committed publication and starts
the engine's worker thread (and, with weight_broadcast.type = "collective", the receiver that joins the
trainer's group, engines/weight_transport.py). Generation goes through serving.py; a weight update reads
the named publication (or takes the tensors the receiver staged for that version) and the engine applies
it between two decode steps, so requests in flight finish under the new policy and say so. A distillation
teacher (`role = "teacher"`) serves its model directory's own weights as version 0 and refuses updates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from engines import protocol as api
from engines.inference.backend import Backend, BackendError, Body, Generation, served_name
from engines.inference.embedded.serving import Prepared, Serving
from engines.models.vlm import is_vision

log = logging.getLogger("rollflow.inference")


class EmbeddedBackend(Backend):
    def __init__(self, engine, tokenizer, model_name: str, fs, root: str, receiver=None, fixed: bool = False):
        self.engine, self.fs, self.root, self.receiver, self.fixed = engine, fs, root, receiver, fixed
        self.serving = Serving(engine, tokenizer, model_name)
        self.model_name, self.max_model_len = model_name, self.serving.max_model_len
        self.vision_spec = engine.model.vision_spec if is_vision(engine.model) else None  # None: refuse images
        self.loaded: dict[str, dict] = {}  # the last publications loaded: a delta's base is not rebuilt each update

    async def _prepare(self, gen: Generation) -> Prepared:
        """The checked request; one with images off the event loop (their sizes are read by decoding them)."""
        return await asyncio.to_thread(self.serving.prepare, gen) if gen.images else self.serving.prepare(gen)

    async def generate(self, gen: Generation) -> Body:
        p = await self._prepare(gen)
        outs = await self.serving.run(p)
        return self.serving.chat(p, outs) if p.chat else self.serving.completion(p, outs)

    async def stream(self, gen: Generation) -> AsyncIterator[dict]:
        p = await self._prepare(gen)
        async with aclosing(self.serving.stream(p)) as chunks:  # closing it aborts the request
            async for chunk in chunks:
                yield chunk

    async def health(self) -> api.HealthResponse:
        return api.HealthResponse(status="ok", policy_version=self.engine.version, stats=self.engine.stats)

    async def update_weights(self, req: api.UpdateWeightsRequest) -> api.UpdateWeightsResponse:
        from storage import weights
        from storage.fs import CorruptError, is_committed

        if self.fixed:
            raise BackendError(409, "this server is the distillation teacher: its weights never change")
        t0 = time.perf_counter()
        directory = req.path or weights.version_dir(self.root, req.version or 0)
        if not await asyncio.to_thread(is_committed, self.fs, directory):
            raise BackendError(404, f"no committed weights at {directory}")
        try:
            version = await asyncio.to_thread(weights.read_version, self.fs, directory)
            if version < self.engine.version:
                raise BackendError(409, f"{directory} holds version {version}, older than served {self.engine.version}")
            staged = None
            if self.receiver is not None and req.version is not None:
                staged = await asyncio.to_thread(self.receiver.take, version)
            state = staged if staged is not None else await self._read(directory)
            t1 = time.perf_counter()
            served = await asyncio.to_thread(self.engine.update_weights, state, version)
        except (CorruptError, ValueError) as exc:
            raise BackendError(422, str(exc)) from exc
        source = "collective" if staged is not None else "filesystem"
        return api.UpdateWeightsResponse(
            policy_version=served, load_s=t1 - t0, apply_s=time.perf_counter() - t1, source=source
        )

    async def _read(self, directory: str) -> dict:
        from storage import weights

        return await asyncio.to_thread(weights.load, self.fs, directory, self.loaded)

    async def close(self) -> None:
        self.engine.stop()
        if self.receiver is not None:
            self.receiver.stop()


def load_engine(cfg, output_root_url: str, storage):
    """Build the model (engines/models/modeldir.py), load the newest committed weights (or what `serve_version`
    / `pretrained` name), wrap them in an `Engine`."""
    import torch

    from engines.inference.embedded.engine import Engine
    from engines.models import lora, modeldir

    torch.set_num_threads(cfg.inference.num_threads)
    loaded = modeldir.load(cfg.model, pretrained=cfg.pretrained)
    model, tokenizer = loaded.model, loaded.tokenizer
    version = 0
    if not cfg.pretrained:
        lora.attach_to(model, cfg.model.lora)  # adapter publications carry base + adapter tensors
        version, state = _publication(cfg, storage.open(output_root_url), output_root_url)
        model.load_published(state)
    # inference.dtype: the sampler may run in lower precision than the fp32 trainer (as vLLM serves bf16)
    model.to(getattr(torch, cfg.inference.dtype))
    if cfg.inference.onednn_linear:
        from engines.inference.embedded.packed import pack_linears

        log.info(f"inference.onednn_linear: {pack_linears(model)} Linear layers on oneDNN packed weights")
    inf = cfg.inference
    routes = inf.enable_return_routed_experts
    engine = Engine(model, version, tokenizer.eos_id, tokenizer.pad_id, inf.max_batch_size, cfg.seed, routes)
    return engine, tokenizer


def _publication(cfg, opened, output_root_url: str) -> tuple[int, dict]:
    """(version, state dict) of publication `cfg.serve_version`, or of the newest one."""
    from storage import weights
    from storage.fs import is_committed

    fs, root = opened
    if cfg.serve_version is not None:
        directory = weights.version_dir(root, cfg.serve_version)
        if not is_committed(fs, directory):
            raise SystemExit(f"no committed weights at {directory}")
        return weights.read_version(fs, directory), weights.load(fs, directory)
    latest = weights.load_latest(fs, root)
    if latest is None:
        raise SystemExit(f"no committed weights under {weights.weights_root(output_root_url)}; run the warm-up first")
    return latest


async def create(cfg) -> EmbeddedBackend:
    """The backend of an `InferenceProcessConfig`: the engine on the newest publication."""
    from storage.fs import Storage

    storage = Storage(cfg.run.storage)
    engine, tokenizer = load_engine(cfg, cfg.run.output_dir, storage)
    receiver = None
    if cfg.weight_broadcast.type == "collective" and cfg.role == "policy":
        from engines.weight_transport import Receiver

        # the only tensors the receiver accepts (and so allocates): the served model's own parameters
        params = {name: tuple(t.shape) for name, t in engine.model.weights_module().state_dict().items()}
        receiver = Receiver(cfg.weight_broadcast, params)
        log.info(f"weight transport: group store on {cfg.weight_broadcast.host}:{receiver.port}")
    fs, root = storage.open(cfg.run.output_dir)
    what = f"teacher {cfg.model.path}" if cfg.role == "teacher" else f"policy version {engine.version}"
    log.info(f"embedded engine on {what}")
    return EmbeddedBackend(engine, tokenizer, served_name(cfg), fs, root, receiver, fixed=cfg.role == "teacher")
