"""The inference process: one OpenAI-compatible HTTP front end over a pluggable backend.

    server.py    the process entry (`python -m engines.inference --config inference.json`)
    frontend.py  the HTTP API, written once: routes, errors, admin auth, streaming, disconnects, bounds
    backend.py   the backend interface, its declared capabilities, and the load-time check of a run against them
    embedded/    rollflow's batched torch engine;  vllm/  vLLM servers and routers upstream

A backend is registered by name (config/registry.py, or an installed package's entry point in
`rollflow.inference_backends`); docs/inference.md says how to add one.
"""
