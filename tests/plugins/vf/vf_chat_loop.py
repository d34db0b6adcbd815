"""An in-process verifiers harness: the OpenAI chat loop a `null`-style program runs, without a program.

verifiers' Harness contract allows it ("a harness may run its loop in-process instead of launching a
program, as long as every model call goes through `endpoint` + `secret`"). Tool calls the model makes are
answered by `vf_tools.call_tool` when the task's data names tools; a reply without a tool call ends the
loop, except that a task with tools gets a user turn asking again; at most `max_turns` model turns.
"""

from __future__ import annotations

import json

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult
from vf_tools import TOOLS, call_tool

__all__ = ["ChatLoopHarness"]


class ChatLoopConfig(vf.HarnessConfig):
    id: str = "vf_chat_loop"
    max_turns: int = 2


class ChatLoopHarness(vf.Harness[ChatLoopConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def setup(self, runtime) -> None:  # nothing to install: the loop runs in this process
        return None

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> ProgramResult:
        _, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "user", "content": prompt}]
        tools = [TOOLS[n] for n in getattr(data, "tools", [])] or None
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for _turn in range(self.config.max_turns):
                kwargs = {"tools": tools} if tools else {}
                r = await client.chat.completions.create(model=ctx.model, messages=messages, **kwargs)
                message = r.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    if not tools or _turn + 1 == self.config.max_turns:
                        break
                    # the tool was not called: ask again (a user turn between model turns)
                    messages.append({"role": "user", "content": "use lookup"})
                    continue
                for call in message.tool_calls:
                    args = json.loads(call.function.arguments or "{}")
                    content = call_tool(data, call.function.name, args)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
        return ProgramResult(exit_code=0, stdout="", stderr="")
