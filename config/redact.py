"""Keep credentials out of logs, configs written to disk, plans, MLflow params and Prefect parameters.

One rule for what a secret looks like, used everywhere a value is shown:
  - URLs: the user info (`https://user:pw@host` -> `https://***@host`) and query-string credentials
    (`?token=`, `&sig=`, `X-Amz-Signature=`, `api_key=`, ... -> `=***`), anywhere in a string;
  - environment maps: the value of a key that names a secret (a `_`-separated word TOKEN, KEY, SECRET,
    PASSWORD, CREDENTIAL(S), ...: HF_TOKEN, AWS_SECRET_ACCESS_KEY, but not TOKENIZERS_PARALLELISM).

Configs never hold a secret's value: a process environment names it as a reference, `"${HF_TOKEN}"`,
resolved from the launching process's environment at launch time only (`resolve_env`); `env_problems`
is the load-time check that refuses a secret written inline.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from config.script_text import ENV_KEY as ENV_KEY  # one definition of a variable name, re-exported

MASK = "***"
REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SECRET_WORDS = "TOKEN|KEY|APIKEY|SECRET|SECRETS|PASSWORD|PASSWD|CREDENTIAL|CREDENTIALS|AUTH|SIG|SIGNATURE"
SECRET_KEY = re.compile(rf"(^|[_.-])({_SECRET_WORDS})($|[_.-])", re.IGNORECASE)
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@?#]+@")
_QUERY = re.compile(r"([?&;])([^=&#?;\s]+)=([^&#;\s]*)")
ENV_MAPS = re.compile(r"env|.+_env_overrides")  # the config keys whose value is a process environment


def redact_text(text: str) -> str:
    """`text` with every URL's user info and every query-string credential replaced by ***."""
    if "@" in text:
        text = _USERINFO.sub(rf"\g<1>{MASK}@", text)
    if "=" in text:  # query parameters named like a secret: token, api_key, sig, X-Amz-Signature, ...
        text = _QUERY.sub(lambda m: f"{m[1]}{m[2]}={MASK}" if m[3] and is_secret_key(m[2]) else m[0], text)
    return text


def redact_url(url: str | None) -> str | None:
    """`https://user:pass@host/x?token=t` -> `https://***@host/x?token=***`; None stays None."""
    return url if not url else redact_text(url)


def is_redacted(value: str | None) -> bool:
    return bool(value) and MASK in str(value)


def is_secret_key(key: str) -> bool:
    return bool(SECRET_KEY.search(key))


def is_reference(value: str) -> bool:
    return REFERENCE.fullmatch(value) is not None


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment map as it may be shown: references as they are, secret-named values masked."""
    out = {}
    for key, value in env.items():
        if is_reference(value):
            out[key] = value
        else:
            out[key] = MASK if is_secret_key(key) and value else redact_text(value)
    return out


def redact_config(data: Any) -> Any:
    """A JSON-shaped config as it may be shown: every string through `redact_text`, and every environment map
    (a key `env` or `*_env_overrides`) through `redact_env`."""
    if isinstance(data, dict):
        return {
            k: redact_env(v) if ENV_MAPS.fullmatch(str(k)) and _is_str_map(v) else redact_config(v)
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [redact_config(v) for v in data]
    return redact_text(data) if isinstance(data, str) else data


def _is_str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def env_problems(where: str, env: Mapping[str, str]) -> list[str]:
    """What is wrong with an environment map a config writes (each line names `where`.KEY): keys a shell could
    not take, malformed references, and secrets written inline instead of referenced."""
    problems = []
    for key, value in env.items():
        if not ENV_KEY.fullmatch(key):
            problems.append(
                f"{where}.{key!s}: not an environment variable name (letters, digits, _; not first a digit)"
            )
        elif "${" in value and not is_reference(value):
            problems.append(f'{where}.{key} = {redact_text(value)!r}: a reference is the whole value, "${{NAME}}"')
        elif not is_reference(value) and (is_secret_key(key) and value or redact_text(value) != value):
            problems.append(
                f"{where}.{key} holds a secret written inline; it would be written to the run's configs, plans and "
                f'logs: write "${{{key}}}" (or "${{OTHER_NAME}}") to take it from the launching environment'
            )
    return problems


class MissingReference(KeyError):
    """A referenced environment variable is not set where the process is launched."""


def resolve_env(env: Mapping[str, str], environ: Mapping[str, str], where: str = "env") -> dict[str, str]:
    """`env` with every `"${NAME}"` replaced by NAME's value in `environ` (the launching process's)."""
    out = {}
    for key, value in env.items():
        ref = REFERENCE.fullmatch(value)
        if ref is None:
            out[key] = value
        elif ref[1] in environ:
            out[key] = environ[ref[1]]
        else:
            raise MissingReference(f"{where}.{key} = {value!r}: {ref[1]} is not set in the launching environment")
    return out
