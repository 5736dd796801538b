"""Vault: a probe where memory across episodes helps by construction (the ``memory`` option).

Every task is a visit to the vault of one of ``families`` buildings, whose code is fixed for good (a
hash of the building's name) and listed among ``candidates`` decoys in the task:

    "You are at the vault of Amber Hall. Its code is one of: 4821, 1930, 7702, 5518, 0264, 3391.
     The keeper is at the desk. ..."  -> the agent answers <answer>4821</answer> (one try)

The one way to learn the code in an episode is ``ask_keeper()``, and the keeper is at the desk only
in some train visits (the first visit of each building, then every other one); never in a test
visit. So an agent without memory answers a test visit by guessing (1 in ``candidates``), and one
that wrote the keeper's answer down (``remember``) on a train visit can ``recall`` it: the gap
between the two is what memory is worth, by construction. Test visits are the same buildings with
other decoys, in another order.

The expert asks the keeper when it is there and answers; with ``expert_memory`` (the env wrapped
by the ``memory`` option) it also remembers the code after asking and, with nobody at the desk,
recalls it first, which is the behaviour SFT on its episodes teaches (``bench/memory_probe.py``).
Without the keeper and without memory the expert answers from the env's privileged state (an upper
reference, as every expert). Reward 1 for the right code in ``<answer>...</answer>``.
"""

from __future__ import annotations

import hashlib
import random

from tracegym.envs.base import Task
from tracegym.envs.tools import ToolEnv, tool
from tracegym.types import Message, ToolCall

__all__ = ["BUILDINGS", "VaultEnv", "vault_code"]

BUILDINGS = ("Amber Hall", "Birch House", "Cedar Court", "Dune Tower", "Elm Lodge", "Fern Manor", "Granite Keep",
             "Harbor Point", "Iris Villa", "Juniper Yard", "Kestrel Barn", "Linden Mill", "Maple Forge",
             "Nettle Abbey", "Oak Exchange", "Pine Depot", "Quarry Gate", "Rowan Inn", "Slate Works", "Thistle Farm",
             "Umber Dock", "Vine Cellar", "Willow Bank", "Yarrow Hut")

SYSTEM_PROMPT = ("You open vaults. Each task names a building and lists candidate codes; exactly one is right "
                 "and you get one try: write it as <answer>CODE</answer>. When the keeper is at the desk, "
                 "ask_keeper() tells you the code. A building's code never changes.")


def vault_code(building: str) -> str:
    """The building's code, the same in every visit, split and run (4 digits from a hash)."""
    return f"{int(hashlib.sha256(f'vault/{building}'.encode()).hexdigest(), 16) % 10_000:04d}"


class VaultEnv(ToolEnv):
    """Visits to building vaults whose codes never change; the keeper only helps on some train visits."""

    name = "vault"
    description = "Memory probe: a building's fixed vault code, told by a keeper on some train visits only; answer <answer>CODE</answer>."
    reward_range = (0.0, 1.0)
    branchable = True  # the episode's state (task, asked, plan step) is plain data

    def __init__(self, families: int = 16, candidates: int = 6, max_turns: int = 4, expert_memory: bool = False) -> None:
        if not 1 <= families <= len(BUILDINGS):
            raise ValueError(f"families must be in [1, {len(BUILDINGS)}], got {families}")
        if not 2 <= candidates <= 20:
            raise ValueError(f"candidates must be in [2, 20], got {candidates}")
        super().__init__(max_turns=max_turns)
        self.buildings = BUILDINGS[:families]
        self.candidates = int(candidates)
        self.expert_memory = bool(expert_memory)
        self.task: Task | None = None
        self.asked = self.remembered = self.recalled = False

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        """Visits cycling through the buildings; the keeper is at the desk for a train visit whose
        index is below ``families`` (each building's first visit) or even, never for a test visit."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        out = []
        for index in range(n):
            building = self.buildings[index % len(self.buildings)]
            code = vault_code(building)
            rng = random.Random(f"vault/{split}/{seed}/{index}")
            decoys: set[str] = set()
            while len(decoys) < self.candidates - 1:
                decoy = f"{rng.randrange(10_000):04d}"
                if decoy != code:
                    decoys.add(decoy)
            shown = sorted(decoys) + [code]
            rng.shuffle(shown)
            keeper = split == "train" and (index < len(self.buildings) or index % 2 == 0)
            out.append(Task(id=f"vault-{split}-{seed}-{index}", split=split,
                            data={"family": building, "candidates": shown, "keeper": keeper, "answer": code}))
        return out

    async def reset(self, task: Task) -> list[Message]:
        self.task = task
        self.asked = self.remembered = self.recalled = False
        data = task.data
        desk = "The keeper is at the desk." if data["keeper"] else "Nobody is at the desk today."
        question = f"You are at the vault of {data['family']}. Its code is one of: {', '.join(data['candidates'])}. {desk}"
        return [Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=question)]

    @tool(timeout=2.0)
    def ask_keeper(self) -> str:
        """Ask the keeper for this building's vault code (works only when the keeper is at the desk)."""
        assert self.task is not None
        self.asked = True
        if not self.task.data["keeper"]:
            return "Nobody is at the desk."
        return f"The keeper says: the code of {self.task.data['family']} is {self.task.data['answer']}."

    def score_answer(self, answer: str) -> float:
        assert self.task is not None
        return 1.0 if answer.strip() == self.task.data["answer"] else 0.0

    def on_memory_calls(self, names: list[str]) -> None:
        """The memory wrapper answered these calls (``remember``/``recall``) without stepping this env:
        the expert's progress through its plan."""
        self.remembered |= "remember" in names
        self.recalled |= "recall" in names

    def expert_action(self) -> Message:
        """Ask the keeper (then, with ``expert_memory``, remember the code), or with nobody at the desk
        recall it (``expert_memory``); then answer. Computed from the episode's state."""
        if self.task is None:
            raise RuntimeError("expert_action called before reset")
        family, code = self.task.data["family"], self.task.data["answer"]

        def call(name: str, **arguments: str) -> Message:
            return Message(role="assistant", tool_calls=(ToolCall(name=name, arguments=arguments, id=f"call_{name}"),))

        if self.task.data["keeper"]:
            if not self.asked:
                return call("ask_keeper")
            if self.expert_memory and not self.remembered:
                return call("remember", text=f"Vault code of {family}: {code}")
        elif self.expert_memory and not self.recalled:
            return call("recall", query=f"vault code of {family}")
        return Message(role="assistant", content=f"<answer>{code}</answer>")
