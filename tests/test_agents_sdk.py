"""The OpenAI Agents SDK's default model (Responses API) runs a tool-using turn here."""

from __future__ import annotations

import openai
import pytest

agents = pytest.importorskip("agents")

from tests.server import DEFAULT_MODEL  # noqa: E402


async def test_agent_runs_one_tool_using_turn(server):
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"Sunny, 21 degrees in {city}"

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    agents.set_tracing_disabled(True)
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=DEFAULT_MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=200),
        tool_use_behavior="stop_on_first_tool",
    )
    result = await agents.Runner.run(agent, "What is the weather in Oslo?", max_turns=2)
    assert calls and isinstance(calls[0], str)
    assert result.final_output == f"Sunny, 21 degrees in {calls[0]}"
    await client.close()
