"""A user's inference backend package, outside rollflow: it answers every request with the prompt echoed.

Registered as the `rollflow.inference_backends` entry point `echo` (tests write its dist-info), it declares
no capabilities: no replicas, no collective weights, no routed experts, no deployment keys, no launch plan.
This module is what the CLI imports at load, so it imports only the declaration types; the backend itself
(backend.py) is imported by the inference process.
"""

from engines.inference.backend import BackendSpec, Capabilities

BACKEND = BackendSpec(Capabilities(), create="echobackend.backend:create")
