"""The calculator agent written with the OpenAI Agents SDK (`pip install openai-agents==0.24.0`, the
`agents` extra): an `Agent` with a `function_tool`, run by `Runner`, nothing in it knows tracegym.
tracegym evaluates and trains it unmodified (docs/harness.md):

    tracegym eval --env calculator --strategy harness --out runs/eval_agents_sdk \
        --strategy-option agent=examples/harness/agents_sdk_agent.py:run

The SDK talks Chat Completions to the gateway session through `OpenAIChatCompletionsModel`; its
tracing (which uploads to OpenAI by default) is switched off, so nothing leaves the machine.
"""

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

from openai_sdk_agent import SYSTEM, calculate as evaluate  # the same prompt and safe arithmetic

set_tracing_disabled(True)


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Numbers with + - * / // % and parentheses, e.g. "(37 * 24) - 129".
    """
    return evaluate(expression)


async def run(task, client, model: str = "policy", max_turns: int = 8) -> str:
    agent = Agent(name="calculator", instructions=SYSTEM, tools=[calculate],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client))
    try:
        result = await Runner.run(agent, task.data["question"], max_turns=max_turns)
    except (MaxTurnsExceeded, ModelBehaviorError):  # no answer in the budget, or a reply cut off empty:
        return ""  # the model's failure, so an unanswered episode (reward 0), not an error of the agent
    return str(result.final_output or "")
