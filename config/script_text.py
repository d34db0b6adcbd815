"""Which characters a value may have where rollflow writes it into a Slurm batch script.

The batch script (launch/slurm.py) is read twice: by sbatch, for its `#SBATCH` lines, and by bash. A
newline in any value would start a new line of it: a shell command, run on the cluster as the user who
submitted. So every value that reaches the script is checked here against a set of characters, at load
(pydantic validators in config/placement.py and config/run.py) and again by the Slurm worker for the job
variables the Prefect API sends it (flows/slurm_worker.py); the renderer quotes every value as well.
Each check raises ValueError naming the bad character and what is allowed; the caller names the key.

`setup` lines and the flow's command are shell by design and not checked here (docs/slurm.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Charset:
    """An allowed set of characters, as the regex class of the characters it refuses, and how a message
    describes it."""

    refused: str  # a regex [...] class
    described: str

    def first_bad(self, value: str) -> str | None:
        bad = re.search(self.refused, value)
        return bad.group() if bad else None


# Slurm partition, account and QOS names (a partition may be a comma-separated list).
SLURM_NAME = Charset(r"[^A-Za-z0-9_.,\-]", "letters, digits, '_', '.', ',', '-'")
# run_name: the Slurm job's name and the start of the run id, a directory name.
RUN_NAME = Charset(r"[^A-Za-z0-9_.+@\-]", "letters, digits, '_', '.', '+', '@', '-'")
# A Prefect flow run's name, which names its Slurm job: the same, and spaces.
FLOW_RUN_NAME = Charset(r"[^A-Za-z0-9_.+@ \-]", "letters, digits, spaces, '_', '.', '+', '@', '-'")
# The value of an extra sbatch option, e.g. --constraint=h100|a100, --nodelist=gpu[01-04], --gres=gpu:4.
OPTION_VALUE = Charset(r"[^A-Za-z0-9_.,:=@%+/\[\]|&*!\-]", "letters, digits and _ . , : = @ % + / [ ] | & * ! -")
# Paths (output_dir, the worker's directories): no control character, and no backslash, which sbatch
# reads as an escape even inside quotes.
PATH_TEXT = Charset(r"[\x00-\x1f\x7f-\x9f\\]", "any character except control characters and '\\'")
# An environment value is quoted exactly (shlex.quote); only NUL cannot be written at all.
ENV_VALUE = Charset(r"\x00", "any character except NUL")

ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SBATCH_OPTION = re.compile(r"(--[A-Za-z][A-Za-z0-9\-]*)(?:=(.+))?", re.S)


def check(value: str, charset: Charset) -> str:
    """`value` if every character is in `charset`; otherwise ValueError naming the first bad one."""
    bad = charset.first_bad(value)
    if bad is not None:
        raise ValueError(
            f"{value!r} has the character {bad!r}, which may not be written into the Slurm batch script; "
            f"allowed: {charset.described}"
        )
    return value


def check_name(value: str, charset: Charset) -> str:
    if not value:
        raise ValueError(f"must not be empty (allowed: {charset.described})")
    return check(value, charset)


def check_env_key(key: str) -> str:
    if not ENV_KEY.fullmatch(key):
        raise ValueError(
            f"environment variable name {key!r} is not [A-Za-z_][A-Za-z0-9_]* (a letter or '_', then letters, "
            "digits or '_')"
        )
    return key


def check_sbatch_option(line: str) -> str:
    """One long sbatch option, `--name` or `--name=value`, with a value of OPTION_VALUE characters."""
    m = SBATCH_OPTION.fullmatch(line)
    if m is None:
        raise ValueError(
            f"{line!r} must be one long sbatch option, '--name' or '--name=value' (e.g. '--exclusive', "
            "'--constraint=h100'); the name has letters, digits and '-'"
        )
    if m.group(2) is not None:
        check(m.group(2), OPTION_VALUE)
    return line
