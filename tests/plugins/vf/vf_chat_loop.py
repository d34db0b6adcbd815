"""An in-process verifiers harness: the OpenAI chat loop a `null`-style program runs, without a program.

verifiers' Harness contract allows it ("a harness may run its loop in-process instead of launching a
program, as long as every model call goes through `endpoint` + `secret`"). Tool calls the model makes are
answered by `vf_tools.call_tool` when the task's data names tools; a reply without a tool call ends the
loop, except that a task with tools gets a user turn asking again; at most `max_turns` model turns.
`stream = true` asks for every model turn streamed (`stream=True`, `include_usage`), as verifiers' shipped
`null` and `bash` harnesses do, and reads it with the `openai` SDK's own accumulator. It can host a user
(an env that talks between model turns, as TextArena's does): its prompt may be the conversation so far
(verifiers' default `resume()` relaunches it on that), so it declares SUPPORTS_RESUME.
"""

from __future__ import annotations

import json

import verifiers.v1 as vf
from openai import AsyncOpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult
from vf_tools import TOOLS, call_tool

__all__ = ["ChatLoopHarness"]


class ChatLoopConfig(vf.HarnessConfig):
    id: str = "vf_chat_loop"
    max_turns: int = 2
    stream: bool = False


async def _complete(client: AsyncOpenAI, model: str, messages: list[dict], stream: bool, **kwargs):
    if not stream:
        return await client.chat.completions.create(model=model, messages=messages, **kwargs)
    chunks = await client.chat.completions.create(
        model=model, messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    state = ChatCompletionStreamState()
    async for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion()


class ChatLoopHarness(vf.Harness[ChatLoopConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True

    async def setup(self, runtime) -> None:  # nothing to install: the loop runs in this process
        return None

    def _opening(self, data) -> list[dict]:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, list):  # a resumed exchange: the conversation so far
            return messages + [message_to_wire(m) for m in prompt]
        return messages + [{"role": "user", "content": prompt}]

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> ProgramResult:
        messages = self._opening(data)
        tools = [TOOLS[n] for n in getattr(data, "tools", [])] or None
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for _turn in range(self.config.max_turns):
                kwargs = {"tools": tools} if tools else {}
                r = await _complete(client, ctx.model, messages, self.config.stream, **kwargs)
                message = r.choices[0].message
                messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
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
