"""Grid puzzles as text: FrozenLake and Sokoban, played through a ``move(direction)`` tool.

Two registered envs, ``"frozenlake"`` and ``"sokoban"``, sharing this module's grid machinery. They
are separate names rather than one env with a ``game`` option because they differ in everything a
caller sees (system prompt, legend, options, difficulty, solve rate), and ``tracegym envs expert``
and the eval report one line per env name.

Levels are generated procedurally from a seed and checked solvable by breadth-first search, which
also gives the shortest solution: the expert's plan and ``reference_calls``. The expert replans
with BFS from the current state at every step, so it also recovers from someone else's moves.
It makes one move per turn; a model may make several ``move`` calls in one message, run in order
(calls after the one that ends the episode are not run).

Rewards: 1 on reaching the goal (FrozenLake) or putting every box on a target (Sokoban), which ends
the episode; falling into a hole ends it with 0; a message without a move ends it with 0; the
env's ``max_turns`` truncates it.

Reward parts (option ``reward_parts``, ``tracegym.envs.rewards``): ``goal`` (the outcome above) and
``distance``, potential-based shaping (Ng, Harada & Russell 1999, "Policy invariance under reward
transformations"): each turn earns ``gamma * Phi(after) - Phi(before)`` (``shaping_gamma``, default
1), with ``Phi(s) = -min(d(s), d0) / d0`` in [-1, 0], where ``d0`` is ``d`` at the level's start and

- FrozenLake: ``d`` is the shortest safe path (BFS around the holes) from the agent to the goal; a
  hole counts as ``d0`` (back at the start), so falling in pays back the progress made;
- Sokoban: ``d`` is the sum over boxes of the Manhattan distance to the nearest target (0 exactly
  when solved; the BFS solution length would also price walking, but costs a search per turn).

With gamma = 1 the part sums over an episode to ``Phi(final) - Phi(start) = 1 + Phi(final)``: 1
when the level is solved (Phi(goal) = 0), 0 after a fall, the fraction of the way covered
otherwise. Any path to the goal earns the same total and every other ending earns less, so the
policies that are optimal for the goal alone stay optimal. Set ``shaping_gamma`` to the discount
of a turn-level estimator that discounts (GiGPO's 0.95) for Ng et al.'s guarantee to hold there.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, Callable, Hashable, Iterable, Literal, Sequence, TypeVar

from tracegym.envs.base import Task
from tracegym.envs.tasks import distinct_tasks
from tracegym.envs.tools import ToolEnv, tool
from tracegym.types import Message, StepResult, ToolCall

__all__ = ["FrozenLakeEnv", "SokobanEnv", "bfs_path", "generate_frozenlake", "generate_sokoban", "solve_sokoban"]

Direction = Literal["up", "down", "left", "right"]
DIRECTIONS: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
Cell = tuple[int, int]
State = TypeVar("State", bound=Hashable)


def bfs_path(start: State, is_goal: Callable[[State], bool], successors: Callable[[State], Iterable[tuple[str, State]]]) -> list[str] | None:
    """Shortest list of actions from ``start`` to a goal state, or None when no goal is reachable."""
    if is_goal(start):
        return []
    parent: dict[State, tuple[State, str] | None] = {start: None}
    queue: deque[State] = deque([start])
    while queue:
        state = queue.popleft()
        for action, nxt in successors(state):
            if nxt in parent:
                continue
            parent[nxt] = (state, action)
            if is_goal(nxt):
                path: list[str] = []
                cur: State = nxt
                while parent[cur] is not None:
                    prev, act = parent[cur]  # type: ignore[misc]
                    path.append(act)
                    cur = prev
                return path[::-1]
            queue.append(nxt)
    return None


def _step(cell: Cell, direction: str) -> Cell:
    dr, dc = DIRECTIONS[direction]
    return cell[0] + dr, cell[1] + dc


# --- FrozenLake -------------------------------------------------------------------------------------


def _lake_successors(grid: Sequence[str]) -> Callable[[Cell], Iterable[tuple[str, Cell]]]:
    size = len(grid)

    def successors(cell: Cell) -> Iterable[tuple[str, Cell]]:
        for direction in DIRECTIONS:
            r, c = _step(cell, direction)
            if 0 <= r < size and 0 <= c < size and grid[r][c] != "H":
                yield direction, (r, c)

    return successors


def _find(grid: Sequence[str], char: str) -> list[Cell]:
    return [(r, c) for r, row in enumerate(grid) for c, ch in enumerate(row) if ch == char]


def generate_frozenlake(rng: random.Random, size: int = 5, hole_fraction: float = 0.25) -> dict[str, Any]:
    """A solvable lake: ``S`` start, ``G`` goal, ``H`` holes, ``.`` ice; start and goal at least
    ``size - 1`` steps apart (Manhattan), so the shortest path is never trivial."""
    while True:
        cells = [(r, c) for r in range(size) for c in range(size)]
        start, goal = rng.sample(cells, 2)
        if abs(start[0] - goal[0]) + abs(start[1] - goal[1]) < size - 1:
            continue
        rows = [["H" if rng.random() < hole_fraction else "." for _ in range(size)] for _ in range(size)]
        rows[start[0]][start[1]] = "S"
        rows[goal[0]][goal[1]] = "G"
        grid = ["".join(row) for row in rows]
        path = bfs_path(start, lambda cell: cell == goal, _lake_successors(grid))
        if path is not None:
            return {"grid": grid, "solution": path}


LAKE_PROMPT = (
    "You are on a frozen lake, shown as a grid of characters: P is you, G is the goal, H is a hole, "
    ". is safe ice. Rows go from top to bottom, columns from left to right. Move one square at a time "
    "with the `move` tool (direction: up, down, left or right); each call returns the new grid. "
    "Moving off the grid leaves you in place. Falling into a hole ends the game. Reach G to win."
)


class _GridEnv(ToolEnv):
    """Shared task generation and scoring for the grid games."""

    game: str = "grid"
    system_prompt: str = ""
    branchable = True  # the board, the agent (and boxes) and the ToolEnv counters are plain data
    # Phi is in [-1, 0], so one turn's gamma * Phi' - Phi is in [-gamma, 1] within [-1, 1].
    offered_reward_parts = {"goal": (0.0, 1.0), "distance": (-1.0, 1.0)}

    def __init__(
        self, max_turns: int | None, test_fraction: float, reward_parts: dict[str, float] | None = None,
        shaping_gamma: float = 1.0,
    ) -> None:
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        if not 0.0 < shaping_gamma <= 1.0:
            raise ValueError(f"shaping_gamma must be in (0, 1], got {shaping_gamma}")
        self.test_fraction = test_fraction
        self.shaping_gamma = shaping_gamma
        super().__init__(max_turns=max_turns, reward_parts=reward_parts)
        self.task: Task | None = None
        self.start_distance = 1  # d0, the normaliser of Phi (set at reset)
        self.potential = -1.0  # Phi of the current state (distance part)

    def _generate(self, rng: random.Random) -> dict[str, Any]:
        raise NotImplementedError

    def _options_key(self) -> str:
        raise NotImplementedError

    def _load(self, grid: Sequence[str]) -> None:
        """Set the episode's state from a level's ``grid``."""
        raise NotImplementedError

    def _opening(self) -> str:
        """The first user message: the goal and the board."""
        raise NotImplementedError

    def distance_to_goal(self) -> int | None:
        """``d`` of the current state (module docstring); None where it is undefined (a hole)."""
        raise NotImplementedError

    def _potential(self) -> float:
        distance = self.distance_to_goal()
        if distance is None:
            return -1.0
        return -min(distance, self.start_distance) / self.start_distance

    def _shaping_on(self) -> bool:
        return self.reward_parts is not None and "distance" in self.reward_parts

    def step_reward_parts(self) -> dict[str, float]:
        if not self._shaping_on():
            return {}
        before, self.potential = self.potential, self._potential()
        return {"distance": self.shaping_gamma * self.potential - before}

    async def reset(self, task: Task) -> list[Message]:
        self.task = task
        self._load(task.data["grid"])
        if self._shaping_on():
            # Generated levels start unsolved, so d0 >= 1; the guard keeps a hand-made solved level finite.
            self.start_distance = max(self.distance_to_goal() or 1, 1)
            self.potential = self._potential()
        return [Message(role="system", content=self.system_prompt), Message(role="user", content=self._opening())]

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return distinct_tasks(
            split, n, random.Random(f"{self.game}/{seed}/{self._options_key()}"), self._generate_level,
            lambda level: "\n".join(level["grid"]), self.game, self.test_fraction,
            what=f"{self.game} levels; enlarge the grid",
        )

    def _generate_level(self, rng: random.Random) -> dict[str, Any]:
        """A level of ``_generate`` with its ``reference_calls`` (the moves of its solution)."""
        level = self._generate(rng)
        level["reference_calls"] = [{"name": "move", "arguments": {"direction": d}} for d in level["solution"]]
        return level

    def on_text(self, message: Message) -> StepResult:
        # No move: the agent gave up (grid games need no final answer).
        return StepResult(terminated=True, reward=0.0, info={"success": 0, "gave_up": 1})

    def _expert_plan(self) -> list[str] | None:
        raise NotImplementedError

    def state_key(self) -> str | None:
        """The rendered board (agent, boxes, holes, goal): equal boards of one level are one state."""
        if self.task is None:
            return None
        return f"{self.game}:{self.render()}"

    def expert_action(self) -> Message:
        if self.task is None:
            raise RuntimeError("expert_action called before reset")
        plan = self._expert_plan()
        if not plan:  # solved already, or no way out (a deadlock made by earlier moves): stop
            return Message(role="assistant", content="I cannot make progress.")
        call = ToolCall(name="move", arguments={"direction": plan[0]}, id=f"call_{self.turn}")
        return Message(role="assistant", tool_calls=(call,))


class FrozenLakeEnv(_GridEnv):
    """Walk from the start to the goal on a deterministic frozen lake without falling into a hole."""

    name = "frozenlake"
    description = "Text FrozenLake: reach G without falling into a hole, with a move(direction) tool."
    game = "frozenlake"
    system_prompt = LAKE_PROMPT
    default_max_turns = 30

    def __init__(
        self, size: int = 5, hole_fraction: float = 0.25, max_turns: int | None = None, test_fraction: float = 0.2,
        reward_parts: dict[str, float] | None = None, shaping_gamma: float = 1.0,
    ) -> None:
        """``reward_parts``: weights of ``goal`` and ``distance`` (module docstring), e.g. ``{"goal":
        1.0, "distance": 0.3}``; None: the goal alone, no parts reported."""
        if not 3 <= size <= 12:
            raise ValueError(f"size must be between 3 and 12, got {size}")
        if not 0.0 <= hole_fraction <= 0.5:
            raise ValueError(f"hole_fraction must be between 0 and 0.5, got {hole_fraction}")
        self.size, self.hole_fraction = size, hole_fraction
        super().__init__(max_turns=max_turns, test_fraction=test_fraction, reward_parts=reward_parts,
                         shaping_gamma=shaping_gamma)
        self.grid: list[str] = []
        self.position: Cell = (0, 0)
        self.goal: Cell = (0, 0)

    def _options_key(self) -> str:
        return f"{self.size}/{self.hole_fraction}"

    def _generate(self, rng: random.Random) -> dict[str, Any]:
        return generate_frozenlake(rng, self.size, self.hole_fraction)

    def _load(self, grid: Sequence[str]) -> None:
        self.grid = list(grid)
        self.position = _find(self.grid, "S")[0]
        self.goal = _find(self.grid, "G")[0]

    def _opening(self) -> str:
        return f"Reach the goal.\n\n{self.render()}"

    def render(self) -> str:
        rows = []
        for r, row in enumerate(self.grid):
            chars = ["." if ch == "S" else ch for ch in row]
            if self.position[0] == r:
                chars[self.position[1]] = "P"
            rows.append("".join(chars))
        return "\n".join(rows)

    @tool(timeout=2.0)
    def move(self, direction: Direction) -> str:
        """Move one square on the lake and return the new grid.

        Args:
            direction: One of "up", "down", "left", "right".
        """
        r, c = _step(self.position, direction)
        if not (0 <= r < self.size and 0 <= c < self.size):
            return f"{self.render()}\nYou cannot move {direction}: that is the edge of the lake."
        self.position = (r, c)
        if self.grid[r][c] == "H":
            self.end_episode(0.0, False, fell=1)
            return f"{self.render()}\nYou fell into a hole. Game over."
        if self.position == self.goal:
            self.end_episode(1.0, True)
            return f"{self.render()}\nYou reached the goal!"
        return self.render()

    def _expert_plan(self) -> list[str] | None:
        return bfs_path(self.position, lambda cell: cell == self.goal, _lake_successors(self.grid))

    def distance_to_goal(self) -> int | None:
        r, c = self.position
        if self.grid[r][c] == "H":
            return None
        path = self._expert_plan()
        return None if path is None else len(path)


# --- Sokoban ------------------------------------------------------------------------------------------

SokobanState = tuple[Cell, tuple[Cell, ...]]  # (player, sorted boxes)


def _sokoban_successors(walls: frozenset[Cell]) -> Callable[[SokobanState], Iterable[tuple[str, SokobanState]]]:
    def successors(state: SokobanState) -> Iterable[tuple[str, SokobanState]]:
        player, boxes = state
        box_set = set(boxes)
        for direction in DIRECTIONS:
            nxt = _step(player, direction)
            if nxt in walls:
                continue
            if nxt in box_set:
                beyond = _step(nxt, direction)
                if beyond in walls or beyond in box_set:
                    continue
                yield direction, (nxt, tuple(sorted((box_set - {nxt}) | {beyond})))
            else:
                yield direction, (nxt, boxes)

    return successors


def solve_sokoban(walls: frozenset[Cell], targets: frozenset[Cell], player: Cell, boxes: Iterable[Cell]) -> list[str] | None:
    """Shortest move sequence (pushes and walks) putting every box on a target, or None."""
    start: SokobanState = (player, tuple(sorted(boxes)))
    return bfs_path(start, lambda s: set(s[1]) == targets, _sokoban_successors(walls))


def parse_sokoban(grid: Sequence[str]) -> tuple[frozenset[Cell], frozenset[Cell], Cell, list[Cell]]:
    """(walls, targets, player, boxes) of a level in the usual characters."""
    walls, targets, boxes = set(), set(), []
    player: Cell | None = None
    for r, row in enumerate(grid):
        for c, ch in enumerate(row):
            if ch == "#":
                walls.add((r, c))
            if ch in ".*+":
                targets.add((r, c))
            if ch in "$*":
                boxes.append((r, c))
            if ch in "@+":
                player = (r, c)
    if player is None:
        raise ValueError("level has no player")
    return frozenset(walls), frozenset(targets), player, boxes


def render_sokoban(size: int, walls: frozenset[Cell], targets: frozenset[Cell], player: Cell, boxes: Iterable[Cell]) -> str:
    box_set = set(boxes)
    rows = []
    for r in range(size):
        row = []
        for c in range(size):
            cell = (r, c)
            if cell in walls:
                row.append("#")
            elif cell == player:
                row.append("+" if cell in targets else "@")
            elif cell in box_set:
                row.append("*" if cell in targets else "$")
            else:
                row.append("." if cell in targets else "_")
        rows.append("".join(row))
    return "\n".join(rows)


def generate_sokoban(
    rng: random.Random, size: int = 6, num_boxes: int = 2, min_moves: int = 4, max_moves: int = 30
) -> dict[str, Any]:
    """A solvable level by reverse play: boxes start on their targets and the player walks
    backwards, pulling boxes; the scrambled state is then solved forward by BFS, which confirms it
    and gives the shortest solution (kept only when its length is in [min_moves, max_moves])."""
    interior = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
    border = {(r, c) for r in range(size) for c in range(size)} - set(interior)
    while True:
        inner_walls = set(rng.sample(interior, rng.randint(0, max(0, len(interior) // 8))))
        walls = frozenset(border | inner_walls)
        free = [cell for cell in interior if cell not in walls]
        if len(free) < num_boxes + 3:
            continue
        picked = rng.sample(free, num_boxes + 1)
        targets = frozenset(picked[:num_boxes])
        boxes = set(targets)
        player = picked[-1]
        for _ in range(rng.randint(10, 60)):
            direction = rng.choice(list(DIRECTIONS))
            nxt = _step(player, direction)
            if nxt in walls or nxt in boxes:
                continue
            behind = _step(player, {"up": "down", "down": "up", "left": "right", "right": "left"}[direction])
            if behind in boxes and rng.random() < 0.75:  # pull the box behind into the player's cell
                boxes.remove(behind)
                boxes.add(player)
            player = nxt
        if boxes == set(targets):
            continue
        solution = solve_sokoban(walls, targets, player, boxes)
        if solution is None or not min_moves <= len(solution) <= max_moves:
            continue
        return {"grid": render_sokoban(size, walls, targets, player, boxes).split("\n"), "solution": solution}


SOKOBAN_PROMPT = (
    "You play Sokoban on a grid of characters: # is a wall, _ is floor, @ is you, $ is a box, "
    ". is a target, * is a box on a target, + is you standing on a target. Rows go from top to "
    "bottom, columns from left to right. Move one square at a time with the `move` tool (direction: "
    "up, down, left or right); walking into a box pushes it one square if the square behind it is "
    "free. Boxes cannot be pulled. Each call returns the new grid. Put every box on a target to win."
)


class SokobanEnv(_GridEnv):
    """Push every box onto a target in a small generated Sokoban level."""

    name = "sokoban"
    description = "Text Sokoban (6x6, 1-2 boxes): push every box onto a target with a move(direction) tool."
    game = "sokoban"
    system_prompt = SOKOBAN_PROMPT
    default_max_turns = 40

    def __init__(
        self,
        size: int = 6,
        num_boxes: int | Sequence[int] = (1, 2),
        min_moves: int = 6,
        max_moves: int = 30,
        max_turns: int | None = None,
        test_fraction: float = 0.2,
        reward_parts: dict[str, float] | None = None,
        shaping_gamma: float = 1.0,
    ) -> None:
        """``reward_parts``: weights of ``goal`` and ``distance`` (module docstring), e.g. ``{"goal":
        1.0, "distance": 0.3}``; None: the goal alone, no parts reported."""
        if not 5 <= size <= 10:
            raise ValueError(f"size must be between 5 and 10, got {size}")
        low, high = (num_boxes, num_boxes) if isinstance(num_boxes, int) else tuple(num_boxes)
        if not 1 <= low <= high <= 3:
            raise ValueError(f"num_boxes must be 1..3 or a (min, max) range within it, got {num_boxes!r}")
        if not 1 <= min_moves <= max_moves:
            raise ValueError(f"need 1 <= min_moves <= max_moves, got {min_moves}, {max_moves}")
        self.size, self.min_boxes, self.max_boxes = size, low, high
        self.min_moves, self.max_moves = min_moves, max_moves
        super().__init__(max_turns=max_turns, test_fraction=test_fraction, reward_parts=reward_parts,
                         shaping_gamma=shaping_gamma)
        self.walls: frozenset[Cell] = frozenset()
        self.targets: frozenset[Cell] = frozenset()
        self.player: Cell = (0, 0)
        self.boxes: set[Cell] = set()

    def _options_key(self) -> str:
        return f"{self.size}/{self.min_boxes}/{self.max_boxes}/{self.min_moves}/{self.max_moves}"

    def _generate(self, rng: random.Random) -> dict[str, Any]:
        return generate_sokoban(rng, self.size, rng.randint(self.min_boxes, self.max_boxes), self.min_moves, self.max_moves)

    def _load(self, grid: Sequence[str]) -> None:
        self.walls, self.targets, self.player, boxes = parse_sokoban(grid)
        self.boxes = set(boxes)

    def _opening(self) -> str:
        return f"Put every box on a target.\n\n{self.render()}\n{self._status()}"

    def render(self) -> str:
        return render_sokoban(self.size, self.walls, self.targets, self.player, self.boxes)

    def _status(self) -> str:
        on = len(self.boxes & self.targets)
        return f"Boxes on targets: {on}/{len(self.targets)}."

    @tool(timeout=2.0)
    def move(self, direction: Direction) -> str:
        """Move one square (pushing a box if there is one) and return the new grid.

        Args:
            direction: One of "up", "down", "left", "right".
        """
        nxt = _step(self.player, direction)
        if nxt in self.walls:
            return f"{self.render()}\nYou cannot move {direction}: there is a wall. {self._status()}"
        if nxt in self.boxes:
            beyond = _step(nxt, direction)
            if beyond in self.walls or beyond in self.boxes:
                return f"{self.render()}\nThe box cannot be pushed {direction}: it is blocked. {self._status()}"
            self.boxes.remove(nxt)
            self.boxes.add(beyond)
        self.player = nxt
        if self.boxes == set(self.targets):
            self.end_episode(1.0, True)
            return f"{self.render()}\nEvery box is on a target. You solved it!"
        return f"{self.render()}\n{self._status()}"

    def _expert_plan(self) -> list[str] | None:
        return solve_sokoban(self.walls, self.targets, self.player, self.boxes)

    def distance_to_goal(self) -> int | None:
        return sum(min(abs(br - tr) + abs(bc - tc) for tr, tc in self.targets) for br, bc in self.boxes)
