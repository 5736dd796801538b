"""`mcp_units`: a tracegym env whose tools come from an MCP server (`server.py`, next to this file).

    tracegym envs expert mcp_units --plugin examples/mcp/env.py --tasks 50
    tracegym rollout --plugin examples/mcp/env.py --env mcp_units --policy expert --tasks 20 --out runs/mcp_units

A task adds quantities given in mixed units and asks for the total in one unit ("3.5 mi plus
1200 m, in km?"). The tools (`convert`, `list_units`) are the server's; `MCPToolEnv` lists them,
validates arguments against their input schemas and shows server errors as `Error:` tool messages.
The expert converts each quantity with `convert` (one call per turn) and answers the sum of the
results it got back. Reward 1 iff the answer is within 0.1% of the true total.
"""

from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path

from tracegym.envs import Task, extract_answer, register
from tracegym.envs.mcp import MCPServerConfig, MCPToolEnv
from tracegym.types import Message, StepResult, ToolCall

SERVER = Path(__file__).resolve().parent / "server.py"
FACTORS = {  # the same table as the server's; the env needs it only to score answers
    "length": {"m": 1.0, "km": 1000.0, "cm": 0.01, "mi": 1609.344, "yd": 0.9144, "ft": 0.3048, "in": 0.0254},
    "mass": {"kg": 1.0, "g": 0.001, "lb": 0.45359237, "oz": 0.028349523125},
    "volume": {"l": 1.0, "ml": 0.001, "gal": 3.785411784, "cup": 0.2365882365},
}
SYSTEM = ("You add quantities given in different units. Convert each one with the `convert` tool, one call "
          "per turn, then reply with the total as <answer>NUMBER</answer> (4 significant digits or more).")


class UnitsEnv(MCPToolEnv):
    name = "mcp_units"
    description = "Add quantities in mixed units with an MCP unit-converter server's tools."
    default_max_turns = 6
    mcp_servers = (MCPServerConfig("units", sys.executable, [str(SERVER)]),)

    def __init__(self, num_quantities: int = 2, scope: str = "shared", max_turns: int | None = None) -> None:
        if num_quantities < 1:
            raise ValueError(f"num_quantities must be >= 1, got {num_quantities}")
        super().__init__(max_turns=max_turns, scope=scope)  # type: ignore[arg-type]
        self.num_quantities = num_quantities

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        rng, found = random.Random(seed), {}
        while len(found) < n:
            dim = rng.choice(sorted(FACTORS))
            units = sorted(FACTORS[dim])
            target = rng.choice(units)
            items = [(round(rng.uniform(0.5, 500.0), 1), rng.choice([u for u in units if u != target]))
                     for _ in range(self.num_quantities)]
            key = " + ".join(f"{v} {u}" for v, u in items) + f" -> {target}"
            if (hashlib.sha256(key.encode()).digest()[0] < 52) == (split == "test"):  # ~20% test
                found[key] = Task(id=key, split=split, data={"items": items, "target": target, "dimension": dim})
        return list(found.values())

    async def reset(self, task: Task) -> list[Message]:
        self.task, self.results = task, []
        quantities = " plus ".join(f"{v} {u}" for v, u in task.data["items"])
        return [Message(role="system", content=SYSTEM),
                Message(role="user", content=f"What is {quantities}, in {task.data['target']}?")]

    async def _run_tool(self, call: ToolCall) -> Message:
        reply = await super()._run_tool(call)
        if call.name == "convert" and not reply.content.startswith("Error"):
            self.results.append(float(reply.content))
        return reply

    def truth(self) -> float:
        factors = FACTORS[self.task.data["dimension"]]
        base = sum(v * factors[u] for v, u in self.task.data["items"])
        return base / factors[self.task.data["target"]]

    def on_text(self, message: Message) -> StepResult:
        answer = extract_answer(message.content)
        try:
            value = float(answer) if answer is not None else None
        except ValueError:
            value = None
        truth = self.truth()
        solved = value is not None and abs(value - truth) <= 1e-3 * max(abs(truth), 1e-9)
        return StepResult(reward=float(solved), terminated=True, info={"success": int(solved)})

    def expert_action(self) -> Message:
        items = self.task.data["items"]
        if len(self.results) < len(items):
            value, unit = items[len(self.results)]
            args = {"value": value, "from_unit": unit, "to_unit": self.task.data["target"]}
            return Message(role="assistant", tool_calls=(ToolCall(name="convert", arguments=args, id=f"call_{self.turn}"),))
        return Message(role="assistant", content=f"<answer>{sum(self.results):.6g}</answer>")


register("mcp_units", UnitsEnv)
