"""A test's inference backend package: rollflow's embedded backend whose weight update to one version never
returns, once per run, standing in for a hung weight update (tests/integration/test_stalls.py).

Registered as the `rollflow.inference_backends` entry point `hang-update` (the test writes its dist-info).
`HANG_UPDATE_AT` (environment) is the version whose first update hangs; the marker file `hung-update` in the
run's output directory makes the hang happen once, so the restarted attempt updates normally.
"""

from engines.inference.backend import BackendSpec, Capabilities

BACKEND = BackendSpec(Capabilities(kept_support=True), create="hangbackend.backend:create")
