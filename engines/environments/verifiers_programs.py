"""verifiers' shipped chat harnesses (`null`, `bash`) offline: their program runs on this interpreter.

Both harnesses launch verifiers' bundled chat program (`CHAT_PROGRAM_SOURCE`, a PEP 723 script) through
the runtime's `prepare_uv_script`: it makes sure `uv` exists (`pip install --user uv`, else the curl
installer), then `uv sync --script` resolves the script's dependencies from the package index into a
fresh environment. Offline, both steps fail, so no shipped harness can start.

The script's dependencies (openai, mcp, httpx, httpx2, tenacity, certifi) are verifiers' own
dependencies, so the interpreter running verifiers (the orchestrator's) already satisfies them; its
versions are checked against the script's requirements first. `use_local_interpreter` then does what
`prepare_uv_script` would have left behind for verifiers' host subprocess runtime (`SubprocessConfig`):
the script at its content-addressed path (written atomically) and this interpreter recorded as the one
that runs it, so every launch runs the program directly with no `uv`, no index and no network. Container
and sandbox runtimes keep verifiers' own path (their images bring their own interpreter).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

from storage.fs import write_text_atomic

_DEPENDENCIES = re.compile(r"^# dependencies = (\[.*\])$", re.MULTILINE)


def script_requirements(source: str) -> list[str]:
    """The `dependencies` of a PEP 723 script's metadata block."""
    match = _DEPENDENCIES.search(source.split("# ///\n", 1)[0])  # the block up to its closing `# ///`
    if match is None:
        raise ValueError("the script has no PEP 723 `# dependencies = [...]` line")
    return list(json.loads(match.group(1)))


def unmet(requirements: list[str]) -> list[str]:
    """The requirements this interpreter does not satisfy, each with what is installed."""
    missing = []
    for text in requirements:
        req = Requirement(text)
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(f"{text} (not installed)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            missing.append(f"{text} (installed: {version})")
    return missing


def use_local_interpreter() -> Path:
    """Prepare verifiers' chat program for its subprocess runtime on this interpreter; the script's path.
    Raises RuntimeError naming each unmet requirement (then only `uv` with an index could run it)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    missing = unmet(script_requirements(CHAT_PROGRAM_SOURCE))
    if missing:
        raise RuntimeError(
            "verifiers' chat program (the null and bash harnesses) needs packages this interpreter lacks: "
            f"{', '.join(missing)}; install them here (pip install -c requirements/constraints.txt ...)"
        )
    digest = hashlib.sha256(CHAT_PROGRAM_SOURCE.encode()).hexdigest()
    path = Path(SubprocessRuntime.scripts_dir) / f"{digest}.py"  # where prepare_uv_script keys it
    if not path.is_file() or path.read_text() != CHAT_PROGRAM_SOURCE:
        write_text_atomic(path, CHAT_PROGRAM_SOURCE)
    # The runtime's class-level cache of prepared scripts: an entry means "ready, run it with this".
    SubprocessRuntime._interpreters[str(path)] = sys.executable
    return path
