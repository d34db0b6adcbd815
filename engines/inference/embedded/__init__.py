"""The embedded backend (`inference.backend = "embedded"`): rollflow's own batched torch engine.

    backend.py   the Backend the front end serves: model load, generation, weight updates
    serving.py   an OpenAI request -> an engine request; completions -> response bodies and stream chunks
    engine.py    the worker thread: a continuous batch, in-flight weight updates, aborts
    generate.py  the decode loop (prefill, KV cache, per-row sampling);  sampling.py  the per-row draws
    prefill.py   the prefill's inputs: padding, mask, distinct prompts (ids and images), vision encoder inputs
    shared.py    a shared deployment's server: tenants' adapters in slots (adapters.py reads their publications)
    factory.py   which of the two a process config asks for

This module is the backend's registration (config/registry.py): import-light, read at load time.
"""

from engines.inference.backend import BackendSpec, Capabilities

BACKEND = BackendSpec(
    Capabilities(collective_weights=True, routed_experts=True, kept_support=True, vision=True, shared=True),
    create="engines.inference.embedded.factory:create",
)
