"""Real agent clients against ``kvmem serve`` on kvmem-default (issue 29, item 5).

* An OpenAI Agents SDK agent with two function tools runs a multi-step task (call a tool,
  read its result, call again or answer) through the Chat Completions API.
* A Claude-Code-shaped session through the Anthropic SDK: a long system prompt, a dozen
  tools with the kinds of schemas coding agents send (``$schema`` markers, enums, arrays
  of objects, optional fields), several streamed turns with tool results in between.

What a 135M model answers is not the point. Every request must be answered without a 4xx
or 5xx, every tool call must parse into arguments valid against its tool's schema, and
every turn after the first must reuse the agent's cache (hot, extending it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from gateway_helpers import default_model_server

from gateway.testing import ServerThread
from runtime.model.default_model import DEFAULT_MODEL


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2: Any) -> Iterator[ServerThread]:
    with default_model_server(tmp_path_factory) as running:
        yield running


# -- the OpenAI Agents SDK --------------------------------------------------------------


def test_an_openai_agents_sdk_agent_with_two_tools_completes_a_multi_step_task(server: ServerThread) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI
    answered: list[tuple[int, str | None]] = []

    async def record(response: httpx.Response) -> None:
        answered.append((response.status_code, response.headers.get("x-kvmem-match")))

    ran: list[tuple[str, Any]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now, in degrees Celsius.

        Args:
            city: the city's name.
        """
        ran.append(("get_weather", city))
        return f"Sunny, 21 C in {city}"

    @agents.function_tool
    def to_fahrenheit(celsius: float) -> str:
        """Convert a temperature from Celsius to Fahrenheit.

        Args:
            celsius: the temperature in degrees Celsius.
        """
        ran.append(("to_fahrenheit", celsius))
        return f"{celsius * 9 / 5 + 32:.0f} F"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0,
                         http_client=httpx.AsyncClient(timeout=120, event_hooks={"response": [record]}))
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the tools, then answer in one sentence.",
        tools=[get_weather, to_fahrenheit],
        model=agents.OpenAIChatCompletionsModel(model=DEFAULT_MODEL, openai_client=client),
        # The first step must call a tool (a 135M model rarely would); the SDK then resets the
        # choice to auto, so the model decides whether to call again or to answer.
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48,
                                            extra_headers={"X-Agent-ID": "agents-sdk"}),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris, in Fahrenheit?", max_turns=6)
    assert isinstance(result.final_output, str)
    assert ran and ran[0][0] in ("get_weather", "to_fahrenheit")
    for name, value in ran:  # the SDK validated and parsed every call's arguments into these
        assert isinstance(value, str if name == "get_weather" else float | int)
    assert len(answered) >= 2 and all(status == 200 for status, _ in answered), answered
    assert all(match == "extend" for _, match in answered[1:]), answered  # every later step extends the cache


# -- a Claude-Code-shaped session --------------------------------------------------------

SYSTEM = (
    "You are an interactive CLI tool that helps users with software engineering tasks. Use the instructions "
    "below and the tools available to you to assist the user.\n\n"
    "# Tone and style\nBe concise, direct, and to the point. Answer in fewer than 4 lines unless asked for detail.\n\n"
    "# Doing tasks\nUse the search tools to understand the codebase. Implement the solution using all tools "
    "available to you. Verify the solution with tests. Never commit changes unless the user asks.\n\n"
    "# Tool usage policy\nWhen doing file search, prefer the Glob and Grep tools. Read a file before editing it. "
    "Batch independent tool calls together.\n\n"
    "Here is useful information about the environment you are running in:\n<env>\nWorking directory: /repo\n"
    "Is directory a git repo: Yes\nPlatform: linux\n</env>\n"
) * 2
DRAFT7 = "http://json-schema.org/draft-07/schema#"


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False,
              "$schema": DRAFT7}
    return {"name": name, "description": description, "input_schema": schema}


STRING, INTEGER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
CLAUDE_CODE_TOOLS = [
    _tool("Bash", "Executes a bash command in a persistent shell session.",
          {"command": STRING, "timeout": {"type": "number", "maximum": 600000}, "description": STRING,
           "run_in_background": BOOLEAN}, ["command"]),
    _tool("Glob", "Fast file pattern matching tool.", {"pattern": STRING, "path": STRING}, ["pattern"]),
    _tool("Grep", "A powerful search tool built on ripgrep.",
          {"pattern": STRING, "path": STRING, "glob": STRING,
           "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
           "-i": BOOLEAN, "-n": BOOLEAN, "head_limit": {"type": "number"}, "multiline": BOOLEAN}, ["pattern"]),
    _tool("Read", "Reads a file from the local filesystem.",
          {"file_path": STRING, "offset": {"type": "number"}, "limit": {"type": "number"}}, ["file_path"]),
    _tool("Edit", "Performs exact string replacements in files.",
          {"file_path": STRING, "old_string": STRING, "new_string": STRING, "replace_all": BOOLEAN},
          ["file_path", "old_string", "new_string"]),
    _tool("Write", "Writes a file to the local filesystem.", {"file_path": STRING, "content": STRING},
          ["file_path", "content"]),
    _tool("NotebookEdit", "Replaces the contents of a cell in a Jupyter notebook.",
          {"notebook_path": STRING, "cell_id": STRING, "new_source": STRING,
           "cell_type": {"type": "string", "enum": ["code", "markdown"]},
           "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]}},
          ["notebook_path", "new_source"]),
    _tool("WebFetch", "Fetches content from a URL and processes it.",
          {"url": {"type": "string", "format": "uri"}, "prompt": STRING}, ["url", "prompt"]),
    _tool("TodoWrite", "Create and manage a structured task list for the session.",
          {"todos": {"type": "array", "items": {
              "type": "object", "additionalProperties": False, "required": ["content", "status", "activeForm"],
              "properties": {"content": {"type": "string", "minLength": 1},
                             "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                             "activeForm": {"type": "string", "minLength": 1}}}}}, ["todos"]),
    _tool("WebSearch", "Search the web.", {"query": {"type": "string", "minLength": 2},
                                           "allowed_domains": {"type": "array", "items": STRING}}, ["query"]),
    _tool("BashOutput", "Retrieves output from a running background bash shell.",
          {"bash_id": STRING, "filter": STRING}, ["bash_id"]),
    _tool("KillShell", "Kills a running background bash shell.", {"shell_id": STRING}, ["shell_id"]),
]
RESULTS = {  # what the "tools" return, by name
    "Bash": "README.md\nsetup.py\nsrc/\ntests/", "Glob": "src/app.py\nsrc/util.py", "Grep": "src/app.py:3:def main():",
    "Read": "     1\tdef main():\n     2\t    print('hello')\n", "TodoWrite": "Todos have been modified successfully",
}


def _valid_input(tool: dict[str, Any], value: Any) -> bool:
    """A tool_use input checked against its schema's required keys, known keys, types and enums."""
    schema = tool["input_schema"]
    props = schema["properties"]
    if not isinstance(value, dict) or not set(schema["required"]) <= set(value) or not set(value) <= set(props):
        return False
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}
    return all(isinstance(v, kinds[props[k]["type"]]) and v in props[k].get("enum", [v]) for k, v in value.items())


def test_a_claude_code_shaped_session_runs_against_the_anthropic_api(server: ServerThread) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=180)
    by_name = {t["name"]: t for t in CLAUDE_CODE_TOOLS}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List the files in this repository, then read "
                                                                  "src/app.py and tell me what it does."}]
    usages = []
    for step in range(3):
        with claude.messages.stream(model=DEFAULT_MODEL, max_tokens=64, system=SYSTEM, tools=CLAUDE_CODE_TOOLS,  # type: ignore[arg-type]
                                    messages=messages,  # type: ignore[arg-type]
                                    tool_choice={"type": "any"} if step < 2 else {"type": "auto"},
                                    metadata={"user_id": "claude-code-session"},
                                    extra_body={"temperature": 0}) as events:
            reply = events.get_final_message()
        usages.append(reply.usage)
        uses = [b for b in reply.content if b.type == "tool_use"]
        if step < 2:
            assert reply.stop_reason == "tool_use" and uses
        for use in uses:
            assert use.name in by_name and _valid_input(by_name[use.name], use.input), (use.name, use.input)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        if not uses:
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id, "content": RESULTS.get(u.name, "done")} for u in uses]})
    assert len(usages) >= 2
    for before, after in zip(usages, usages[1:]):  # every later turn reads all of the one before
        assert after.cache_read_input_tokens == before.input_tokens + before.cache_read_input_tokens + \
            before.output_tokens - 1
