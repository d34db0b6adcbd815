"""The lookup tool of `vf_lookup` and the text format the tiny model calls it with.

The char-level model has no native tool-call syntax, so its replies are parsed here (rollflow's verifiers
adapter takes `parse_calls` as its `tool_parser`).
"""

from __future__ import annotations

import json
import random
import string

TOOLS = {
    "lookup": {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The value stored under a key.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
}


def value(salt: int, key: str) -> str:
    rng = random.Random(f"{salt}/{key}")
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 4)))


def call_tool(data, name: str, args: dict) -> str:
    if name != "lookup":
        return f"no tool {name}"
    return f"is:{value(data.salt, str(args.get('key', '')))}"


def parse_calls(text: str) -> list[tuple[str, str]]:
    """(tool name, JSON arguments) of each call in a reply: `?KEY` anywhere in it calls lookup with the
    text after the last `?` (lenient, so an untrained model calls the tool now and then)."""
    return [("lookup", json.dumps({"key": text.rsplit("?", 1)[1].strip()}))] if "?" in text else []
