"""A plain tool-calling agent for the calculator's word problems, written with the `openai` SDK only:
nothing in it knows tracegym. tracegym evaluates and trains it unmodified (docs/harness.md):

    tracegym eval --env calculator --strategy harness --out runs/eval_agent \
        --strategy-option agent=examples/harness/openai_sdk_agent.py:run

`client` is an openai.AsyncOpenAI bound to one gateway session; the answer it returns is verified by
the calculator env (the agent never sees the reference).
"""

import ast
import json
import operator

SYSTEM = ("You solve arithmetic word problems. You have a calculator tool, `calculate`, that evaluates an "
          "expression such as (37 * 24) - 129. Work step by step: make one calculator call per operation "
          "and use its result in the next one. When you know the result, reply with the final number only, "
          "inside answer tags, for example <answer>42</answer>.")
TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression and return the result.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": 'Numbers with + - * / // % ** and parentheses, e.g. "(37 * 24) - 129".'}},
        "required": ["expression"]}}}]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calculate(expression: str) -> str:
    """Numbers and + - * / // % only (no eval of model-written text)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"unsupported expression {expression!r}")
    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


async def run(task, client, model: str = "policy", max_steps: int = 8) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.data["question"]}]
    for _ in range(max_steps):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                result = calculate(str(json.loads(call.function.arguments)["expression"]))
            except (ValueError, KeyError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""
