"""A small MCP server (stdio) for the `mcp_units` example env: a unit converter.

Run by the env as `python server.py`; try it alone with any MCP client. Tools:

- `list_units(dimension)`: the units of a dimension ("length", "mass", "volume"), or all of them;
- `convert(value, from_unit, to_unit)`: the value in the other unit (an unknown unit or two units of
  different dimensions is a tool error, which the model sees as `Error: ...`).
"""

from __future__ import annotations

from typing import Optional

from mcp.server.fastmcp import FastMCP

# Factor of each unit to the dimension's base unit (metre, kilogram, litre).
UNITS: dict[str, dict[str, float]] = {
    "length": {"m": 1.0, "km": 1000.0, "cm": 0.01, "mm": 0.001, "mi": 1609.344, "yd": 0.9144, "ft": 0.3048, "in": 0.0254},
    "mass": {"kg": 1.0, "g": 0.001, "lb": 0.45359237, "oz": 0.028349523125, "t": 1000.0},
    "volume": {"l": 1.0, "ml": 0.001, "gal": 3.785411784, "qt": 0.946352946, "cup": 0.2365882365},
}
DIMENSION = {unit: dim for dim, units in UNITS.items() for unit in units}

mcp = FastMCP("units", log_level="WARNING")


@mcp.tool()
def list_units(dimension: Optional[str] = None) -> str:
    """List the known units, of one dimension ("length", "mass", "volume") or of all."""
    if dimension is None:
        return "; ".join(f"{dim}: {', '.join(units)}" for dim, units in UNITS.items())
    if dimension not in UNITS:
        raise ValueError(f"unknown dimension {dimension!r}; known: {', '.join(UNITS)}")
    return ", ".join(UNITS[dimension])


@mcp.tool()
def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a quantity from one unit to another of the same dimension, e.g. 3 mi to km."""
    for unit in (from_unit, to_unit):
        if unit not in DIMENSION:
            raise ValueError(f"unknown unit {unit!r}; call list_units to see the known units")
    if DIMENSION[from_unit] != DIMENSION[to_unit]:
        raise ValueError(f"cannot convert {DIMENSION[from_unit]} ({from_unit}) to {DIMENSION[to_unit]} ({to_unit})")
    result = value * UNITS[DIMENSION[from_unit]][from_unit] / UNITS[DIMENSION[to_unit]][to_unit]
    return f"{result:.6g}"


if __name__ == "__main__":
    mcp.run()  # stdio
