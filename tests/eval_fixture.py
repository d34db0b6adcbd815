"""A small real run directory for the evaluation tests: config/run.json, state.json and policy version 0 of the
tiny profile's model, freshly initialized (seeded) or from a short warm-up (the real `engines.trainer` process,
`config/sft.json`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from config.loader import load_run_config
from runtime.rundir import write_configs
from storage.fs import CONFIG_STORAGE_ENV, get_fs
from storage.runstate import RunState, write_state

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "profiles" / "tiny-cpu.toml"


def make_run(out: Path, sft_steps: int = 0) -> Path:
    """A run in `out` whose weights/step=000000 is the warm-up's result after `sft_steps` steps (0: the model as
    initialized from seed 0, published in this process)."""
    cfg = load_run_config([TINY], [("output_dir", str(out)), ("sft.steps", str(sft_steps))])
    urls = write_configs(cfg, "evaltest", "http://127.0.0.1:0")
    fs, root = get_fs(str(out))
    write_state(fs, root, RunState("evaltest", None, status="finished"))
    if sft_steps == 0:
        import torch

        from engines.models import modeldir
        from storage import weights

        torch.manual_seed(0)
        loaded = modeldir.load(cfg.model, pretrained=False)
        weights.publish(fs, root, 0, loaded.model.publishable_state_dict(), loaded.publication_files())
        return out
    env = {**os.environ, "PYTHONPATH": str(ROOT), CONFIG_STORAGE_ENV: cfg.storage.model_dump_json()}
    proc = subprocess.run(
        [sys.executable, "-m", "engines.trainer", "--config", urls["sft"]], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out
