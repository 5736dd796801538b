"""``service``: a stateful customer-service backend with a written policy and a simulated user.

In the style of tau-bench: each episode has its own in-memory database (users, orders, products),
generated from the task's seed. A simulated customer with a hidden goal ("cancel order #W1234567
because I ordered it by mistake", "exchange the blue t-shirt for the red one") opens with a vague
request and reveals a fact only when the agent asks for it with ``ask_user``.

The policy (shown in the system prompt) is compiled into the tools: a call that would break a rule is
refused with an error *and recorded as a violation*; trying counts. Reward is 1 iff the final database
equals the goal database exactly, no rule was broken, and the agent closed the conversation with
``<answer>...</answer>``. In the ``*_refused`` tasks the policy forbids what the customer wants, so the
goal database is the initial one: the agent must look, then refuse. A refusal counts only when it is
grounded: the agent read the order (``get_order``) and, for an exchange, the wanted product's stock
(``list_products`` or ``get_product``); otherwise "refuse everything without looking" would earn
the reward on half of the tasks.

Rules:
1. Authenticate the customer with ``find_user(name, zip_code)`` before any account tool
   (``list_orders``, ``get_order``, ``cancel_order``, ``refund_order``, ``exchange_item``); only the
   authenticated customer's orders may be read or changed.
2. Only pending orders can be cancelled.
3. Only delivered orders, within 30 days of delivery, can be refunded.
4. Only delivered orders can have an item exchanged, for a product of the same type, with stock.
5. Before a write (cancel, refund, exchange) the customer must confirm it explicitly (ask_user).
6. Transfer to a human agent only when the customer asks for one (ours never do).
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import random
import re
from typing import Any, Literal

from tracegym.envs.base import Task
from tracegym.envs.tools import ToolEnv, extract_answer, tool
from tracegym.types import Message, StepResult, ToolCall

__all__ = ["KINDS", "ServiceEnv", "SimulatedUser", "generate_scenario"]

GENERATOR_VERSION = 1
REFUND_WINDOW_DAYS = 30

KINDS = ("cancel", "cancel_refused", "refund", "refund_refused", "exchange", "exchange_refused")
CancelReason = Literal["ordered by mistake", "no longer needed"]
RefundReason = Literal["defective", "wrong item", "no longer needed"]
_CANCEL_REASONS = ("ordered by mistake", "no longer needed")
_REFUND_REASONS = ("defective", "wrong item", "no longer needed")
# How the customer words each reason (the agent maps it to the tool's enum value).
_REASON_WORDS = {
    "ordered by mistake": "I ordered it by mistake.",
    "no longer needed": "I don't need it anymore.",
    "defective": "It arrived defective, it doesn't work.",
    "wrong item": "I received the wrong item.",
}

_PRODUCT_TYPES: dict[str, tuple[str, ...]] = {  # type -> sizes
    "t-shirt": ("S", "M", "L", "XL"),
    "hoodie": ("S", "M", "L"),
    "sneakers": ("40", "42", "44"),
    "backpack": ("20L", "30L"),
    "water bottle": ("500ml", "1L"),
    "desk lamp": ("small", "large"),
    "jacket": ("M", "L", "XL"),
    "headphones": ("standard", "pro"),
}
_COLORS = ("black", "white", "blue", "red", "green", "grey", "yellow")
# First names are split between train and test so test customers are never seen in training.
_TRAIN_FIRST = ("Amara", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jana",
                "Kofi", "Lena", "Marco", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara")
_TEST_FIRST = ("Aiko", "Boris", "Carmen", "Diego", "Elif", "Finn", "Greta", "Hugo", "Ines", "Jonas",
               "Kenji", "Luca", "Mira", "Nils", "Olga", "Pavel", "Rania", "Sami", "Tomas", "Uma")
_LAST = ("Alvarez", "Becker", "Costa", "Dubois", "Eriksen", "Fischer", "Garcia", "Horvat", "Ito",
         "Jensen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Rossi", "Silva",
         "Tanaka", "Varga", "Weber", "Yilmaz", "Zhang")

_ORDER_ID_RE = re.compile(r"#?W\d{7}", re.IGNORECASE)
_PRODUCT_ID_RE = re.compile(r"\bP\d{5}\b", re.IGNORECASE)


# --- scenario generation -------------------------------------------------------------------------


def _iso(day: dt.date) -> str:
    return day.isoformat()


class _ScenarioDb:
    """One scenario's database while it is generated: products (with ``variants``, the product ids
    of each type), users and orders, every random draw from the scenario's ``rng``."""

    def __init__(self, rng: random.Random, today: dt.date) -> None:
        self.rng = rng
        self.today = today
        self.used_ids: set[str] = set()
        self.products: dict[str, dict[str, Any]] = {}
        self.variants: dict[str, list[str]] = {}
        self.users: dict[str, dict[str, Any]] = {}
        self.orders: dict[str, dict[str, Any]] = {}

    def new_id(self, prefix: str, digits: int) -> str:
        """A random id no other record of the scenario has."""
        while True:
            candidate = prefix + "".join(self.rng.choice("0123456789") for _ in range(digits))
            if candidate not in self.used_ids:
                self.used_ids.add(candidate)
                return candidate

    def add_catalogue(self) -> None:
        """5 product types, 3 colours each, every size; one product per variant."""
        rng = self.rng
        for ptype in rng.sample(sorted(_PRODUCT_TYPES), 5):
            price = round(rng.randint(12, 180) + 0.99, 2)
            self.variants[ptype] = []
            for color in rng.sample(_COLORS, 3):
                for size in _PRODUCT_TYPES[ptype]:
                    pid = self.new_id("P", 5)
                    self.products[pid] = {"product_id": pid, "type": ptype, "color": color, "size": size,
                                          "price": price, "stock": rng.choice((0, 1, 2, 3, 5, 8))}
                    self.variants[ptype].append(pid)

    def add_user(self, first_name: str, last_name: str) -> str:
        uid = f"{first_name.lower()}_{last_name.lower()}_{self.new_id('', 4)}"
        zip_code = self.new_id("", 5)
        self.users[uid] = {"user_id": uid, "name": f"{first_name} {last_name}", "zip_code": zip_code, "orders": []}
        return uid

    def add_customers(self, split: str) -> str:
        """The target customer, a namesake with another zip code (the name alone does not identify
        the customer) and three others; returns the target's user id."""
        rng = self.rng
        first_names = _TEST_FIRST if split == "test" else _TRAIN_FIRST
        first, last = rng.choice(first_names), rng.choice(_LAST)
        target_user = self.add_user(first, last)
        self.add_user(first, last)
        for _ in range(3):
            self.add_user(rng.choice(first_names), rng.choice(_LAST))
        return target_user

    def add_order(self, uid: str, status: str, items: list[str], delivered_days_ago: int | None) -> str:
        oid = self.new_id("#W", 7)
        placed_ago = (delivered_days_ago or 0) + self.rng.randint(2, 9)
        today = self.today
        self.orders[oid] = {
            "order_id": oid,
            "user_id": uid,
            "status": status,
            "placed_on": _iso(today - dt.timedelta(days=placed_ago)),
            "delivered_on": _iso(today - dt.timedelta(days=delivered_days_ago)) if delivered_days_ago is not None else None,
            "items": [{"item_id": self.new_id("I", 6), "product_id": pid} for pid in items],
            "reason": None,
        }
        self.users[uid]["orders"].append(oid)
        return oid

    def random_status(self) -> tuple[str, int | None]:
        """A random order status and, for a delivered order, how many days ago it was delivered."""
        status = self.rng.choice(("pending", "processed", "delivered", "delivered", "cancelled"))
        return status, (self.rng.randint(1, 90) if status == "delivered" else None)

    def random_items(self, types: list[str], low: int, high: int) -> list[str]:
        """One random product of each of ``low`` to ``high`` of ``types``."""
        rng = self.rng
        return [rng.choice(self.variants[t]) for t in rng.sample(types, rng.randint(low, high))]

    def add_customer_orders(self, uid: str, target_items: list[str], status: str, ago: int | None,
                            other_types: list[str]) -> str:
        """The customer's orders: the target order among 1-3 others (of ``other_types`` products only)
        at a random position; returns the target order's id."""
        n_other = self.rng.randint(1, 3)
        target_position = self.rng.randint(0, n_other)
        target_order = ""
        for k in range(n_other + 1):
            if k == target_position:
                target_order = self.add_order(uid, status, target_items, ago)
            else:
                st, days = self.random_status()
                self.add_order(uid, st, self.random_items(other_types, 1, 2), days)
        return target_order

    def add_other_orders(self, target_user: str) -> None:
        """One or two random orders for every other user."""
        for uid in list(self.users):
            if uid != target_user:
                for _ in range(self.rng.randint(1, 2)):
                    st, days = self.random_status()
                    self.add_order(uid, st, self.random_items(sorted(self.variants), 1, 2), days)


def _target_status(rng: random.Random, kind: str) -> tuple[str, int | None]:
    """The status of the order the customer calls about (and days since delivery): one the policy
    allows the request on, or, for a ``*_refused`` kind, one it forbids it on."""
    if kind == "cancel":
        return "pending", None
    if kind == "cancel_refused":
        status = rng.choice(("processed", "delivered"))
        return status, rng.randint(1, 60) if status == "delivered" else None
    if kind == "refund":
        return "delivered", rng.randint(1, REFUND_WINDOW_DAYS)
    if kind == "refund_refused":
        status = rng.choice(("processed", "delivered", "delivered"))
        return status, rng.randint(REFUND_WINDOW_DAYS + 1, 90) if status == "delivered" else None
    return "delivered", rng.randint(1, 60)  # exchanges


def _customer_goal(db: _ScenarioDb, kind: str, target_user: str, target_order: str, target_pid: str) -> dict[str, Any]:
    """What the customer wants and knows: the order and item, the reason, for an exchange the wanted
    product (out of stock in ``exchange_refused``), and their name and zip code."""
    rng, item = db.rng, db.products[target_pid]
    target_type = item["type"]
    goal: dict[str, Any] = {
        "kind": kind,
        "user_id": target_user,
        "order_id": target_order,
        "item_id": next(i["item_id"] for i in db.orders[target_order]["items"] if i["product_id"] == target_pid),
        "product_type": target_type,
        "item_description": f"{item['color']} {target_type}",
        "knows_order_id": rng.random() < 0.5,
    }
    if kind.startswith("cancel"):
        goal["reason"] = rng.choice(_CANCEL_REASONS)
    elif kind.startswith("refund"):
        goal["reason"] = rng.choice(_REFUND_REASONS)
    else:
        choices = [p for p in db.variants[target_type]
                   if db.products[p]["size"] == item["size"] and db.products[p]["color"] != item["color"]]
        wanted = rng.choice(choices)
        db.products[wanted]["stock"] = rng.randint(1, 5) if kind == "exchange" else 0
        goal["new_product_id"] = wanted
        goal["new_color"] = db.products[wanted]["color"]
        goal["size"] = item["size"]
    user = db.users[target_user]
    goal["name"], goal["zip_code"] = user["name"], user["zip_code"]
    return goal


def generate_scenario(split: str, seed: int, index: int, kind: str) -> dict[str, Any]:
    """One task's world: ``db`` (users, orders, products), the customer's hidden ``goal`` and
    ``today``. Deterministic in (split, seed, index, kind)."""
    if kind not in KINDS:
        raise ValueError(f"unknown service task kind {kind!r}; known: {', '.join(KINDS)}")
    # One stream for the whole scenario: the steps below must draw from it in this order.
    rng = random.Random(f"service-v{GENERATOR_VERSION}-{split}-{seed}-{index}-{kind}")
    today = dt.date(2024, 1, 1) + dt.timedelta(days=rng.randrange(366))
    db = _ScenarioDb(rng, today)
    db.add_catalogue()
    target_user = db.add_customers(split)

    # The order the customer is calling about. No other order of the customer, and no other item of
    # this one, has the target's product type, so "the order with the blue t-shirt" picks out
    # exactly one order and item.
    target_type = rng.choice(sorted(db.variants))
    target_pid = rng.choice(db.variants[target_type])
    status, ago = _target_status(rng, kind)
    other_types = [t for t in sorted(db.variants) if t != target_type]
    target_items = [target_pid, *db.random_items(other_types, 0, 2)]
    rng.shuffle(target_items)
    target_order = db.add_customer_orders(target_user, target_items, status, ago, other_types)
    db.add_other_orders(target_user)

    goal = _customer_goal(db, kind, target_user, target_order, target_pid)
    return {"db": {"users": db.users, "orders": db.orders, "products": db.products}, "goal": goal, "today": _iso(today)}


def goal_database(db: dict[str, Any], goal: dict[str, Any]) -> dict[str, Any]:
    """The database as it must be at the end: the initial one with the wanted change applied, or
    unchanged when the policy forbids the request."""
    out = copy.deepcopy(db)
    kind, order = goal["kind"], out["orders"][goal["order_id"]]
    if kind == "cancel":
        order["status"], order["reason"] = "cancelled", goal["reason"]
    elif kind == "refund":
        order["status"], order["reason"] = "refunded", goal["reason"]
    elif kind == "exchange":
        for item in order["items"]:
            if item["item_id"] == goal["item_id"]:
                item["product_id"] = goal["new_product_id"]
        order["status"] = "exchange requested"
        out["products"][goal["new_product_id"]]["stock"] -= 1
    return out


# --- the simulated customer ----------------------------------------------------------------------

_OPENINGS = {
    "cancel": ("Hi, I'd like to cancel an order.", "Hello! I need to cancel something I ordered."),
    "refund": ("Hi, I want to return something I bought and get my money back.",
               "Hello, I'd like a refund for an order."),
    "exchange": ("Hi, I want to exchange an item I received.", "Hello! Can I swap something from my order?"),
}
_CONFIRM_WORDS = ("confirm", "proceed", "go ahead", "yes/no", "shall i", "should i", "do you want me to")
_ACTION_WORDS = {"cancel": ("cancel",), "refund": ("refund", "return"), "exchange": ("exchange", "swap")}


class SimulatedUser:
    """A rule-based customer. It knows its goal and its facts, and tells each fact only when a
    question asks for it (by keyword); it confirms exactly the action it wants."""

    def __init__(self, goal: dict[str, Any]) -> None:
        self.goal = goal
        self.action = goal["kind"].split("_")[0]  # cancel | refund | exchange
        self.revealed: set[str] = set()

    def opening(self, variant: int = 0) -> str:
        """The first message: the intent, vaguely, and the customer's first name only (first names
        come from split-specific pools, so no test conversation starts like a train one)."""
        options = _OPENINGS[self.action]
        first_name = self.goal["name"].split()[0]
        return f"{options[variant % len(options)]} This is {first_name}."

    def answer(self, question: str) -> str:
        q = question.lower()
        words = set(re.findall(r"[a-z0-9]+", q))
        if any(phrase in q for phrase in _CONFIRM_WORDS):
            return self._confirm(q)
        parts: list[str] = []
        if words & {"name", "names"}:
            parts.append(f"My name is {self.goal['name']}.")
            self.revealed.add("name")
        if words & {"zip", "zipcode", "postal", "postcode"}:
            parts.append(f"My zip code is {self.goal['zip_code']}.")
            self.revealed.add("zip_code")
        if "order" in words and (words & {"id", "number", "which"}):
            if self.goal["knows_order_id"]:
                parts.append(f"The order id is {self.goal['order_id']}.")
                self.revealed.add("order_id")
            else:
                parts.append(f"I don't remember the order number. It's the order with the {self.goal['item_description']}.")
                self.revealed.add("item")
        if words & {"reason", "why"}:
            if "reason" in self.goal:
                parts.append(_REASON_WORDS[self.goal["reason"]])
                self.revealed.add("reason")
            else:
                parts.append("I'd just prefer a different colour.")
        if words & {"item", "items", "product", "colour", "color", "size"}:
            parts.append(self._describe_item())
        if not parts:
            return f"Sorry, I'm not sure what you mean. {_OPENINGS[self.action][0]}"
        return " ".join(parts)

    def _describe_item(self) -> str:
        self.revealed.add("item")
        g = self.goal
        if self.action == "exchange":
            self.revealed.add("wanted")
            return (f"It's the {g['item_description']} (size {g['size']}). "
                    f"I'd like the same one in {g['new_color']} instead, same size.")
        return f"It's the order with the {g['item_description']}."

    def _confirm(self, q: str) -> str:
        g = self.goal
        order_ids = {m.upper().lstrip("#") for m in _ORDER_ID_RE.findall(q)}
        product_ids = {m.upper() for m in _PRODUCT_ID_RE.findall(q)}
        right_action = any(w in q for w in _ACTION_WORDS[self.action]) and not any(
            w in q for a, words in _ACTION_WORDS.items() if a != self.action for w in words)
        right_order = order_ids == {g["order_id"].lstrip("#")}
        right_product = self.action != "exchange" or not product_ids or product_ids == {g["new_product_id"]}
        if right_action and right_order and right_product:
            return "Yes, please go ahead."
        return "No, that's not what I want."

    def confirms(self, question: str) -> bool:
        return self.answer(question).startswith("Yes")


# --- the environment -----------------------------------------------------------------------------

_POLICY = f"""You are a customer-service agent of an online shop. Today is {{today}}.
Talk to the customer only with ask_user(question); the customer tells you a fact only when you ask for it.
Policy (the tools refuse calls that break it, and every attempt counts against you):
1. Authenticate the customer with find_user(name, zip_code) before any account action (list_orders, get_order, cancel_order, refund_order, exchange_item). Only the authenticated customer's orders may be read or changed.
2. Only pending orders can be cancelled.
3. Only delivered orders can be refunded, and only within {REFUND_WINDOW_DAYS} days of delivery.
4. An item can be exchanged only in a delivered order, for a product of the same type that is in stock.
5. Before cancelling, refunding or exchanging, describe the action (order id, and product id for exchanges) and get the customer's explicit confirmation with ask_user.
6. Transfer to a human agent only if the customer asks for one.
If the policy forbids the request, do not call the tool: explain why to the customer.
When the conversation is over, write your closing message to the customer inside <answer>...</answer>."""


class ServiceEnv(ToolEnv):
    """tau-bench-style customer service: authenticate, look up, act or refuse, under a written policy."""

    name = "service"
    description = "Stateful customer-service backend (orders, refunds, exchanges) with a policy and a simulated customer."
    default_max_turns = 30
    # The backend (database, confirmations, violations) and the simulated user are plain data on the
    # instance (a rule-based user with no RNG): the generic deep copy captures the whole episode.
    branchable = True

    def __init__(self, kinds: list[str] | tuple[str, ...] | None = None, require_confirmation: bool = True,
                 max_turns: int | None = None, max_tool_output_chars: int | None = None) -> None:
        super().__init__(max_turns=max_turns, max_tool_output_chars=max_tool_output_chars)
        chosen = tuple(kinds) if kinds is not None else KINDS
        unknown = [k for k in chosen if k not in KINDS]
        if unknown or not chosen:
            raise ValueError(f"kinds must be a non-empty subset of {', '.join(KINDS)}; got {list(chosen)}")
        self.kinds = chosen
        self.require_confirmation = bool(require_confirmation)
        self.task: Task | None = None
        self.db: dict[str, Any] = {}
        self.goal: dict[str, Any] = {}
        self.violations: list[str] = []
        self.user: SimulatedUser | None = None
        self.authenticated: str | None = None
        self.confirmed: set[tuple[str, str]] = set()
        self.seen_orders: set[str] = set()
        self.seen_products: set[str] = set()
        self._calls_made: set[str] = set()
        self.initial_db: dict[str, Any] = {}
        self.goal_db: dict[str, Any] = {}

    # -- tasks --

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        """Seeded tasks; train and test customers come from disjoint first-name pools and disjoint
        generator seeds, so no test customer or database appears in training."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out = []
        for index in range(n):
            kind = self.kinds[random.Random(f"service-kind-{split}-{seed}-{index}").randrange(len(self.kinds))]
            scenario = generate_scenario(split, seed, index, kind)
            data = {
                "split_seed": seed,
                "index": index,
                "kind": kind,
                "generator_version": GENERATOR_VERSION,
                "opening_variant": index % 2,
                "require_confirmation": self.require_confirmation,
            }
            data["reference_calls"] = [
                {"name": c.name, "arguments": dict(c.arguments)} for c in _expert_plan(scenario, self.require_confirmation)
                if c.name != "__answer__"
            ]
            out.append(Task(id=f"service-{split}-{seed}-{index}-{kind}", split=split, data=data))
        return out

    def _scenario(self, task: Task) -> dict[str, Any]:
        d = task.data
        if d.get("generator_version") != GENERATOR_VERSION:
            raise ValueError(f"task {task.id!r} comes from service generator v{d.get('generator_version')}, "
                             f"this is v{GENERATOR_VERSION}")
        return generate_scenario(task.split, d["split_seed"], d["index"], d["kind"])

    # -- episode --

    async def reset(self, task: Task) -> list[Message]:
        for key in ("split_seed", "index", "kind"):
            if key not in task.data:
                raise ValueError(f"service task {task.id!r} has no {key!r}")
        scenario = self._scenario(task)
        self.task = task
        self.today = dt.date.fromisoformat(scenario["today"])
        self.db = scenario["db"]
        self.initial_db = copy.deepcopy(self.db)
        self.goal = scenario["goal"]
        self.goal_db = goal_database(self.db, self.goal)
        self.violations = []
        self.user = SimulatedUser(self.goal)
        self.authenticated = None
        self.confirmed = set()
        self.seen_orders = set()
        self.seen_products = set()
        self._calls_made = set()
        self._plan = _expert_plan(scenario, task.data.get("require_confirmation", self.require_confirmation))
        system = _POLICY.format(today=scenario["today"])
        return [Message(role="system", content=system),
                Message(role="user", content=self.user.opening(task.data.get("opening_variant", 0)))]

    def _record(self, tool_name: str, **arguments: Any) -> None:
        self._calls_made.add(_call_key(tool_name, arguments))

    def _violation(self, rule: str) -> PermissionError:
        """Record a broken rule and return the error the tool raises (the call is refused)."""
        self.violations.append(rule)
        return PermissionError(f"policy violation: {rule}")

    def _require_auth(self) -> str:
        if self.authenticated is None:
            raise self._violation("the customer must be authenticated with find_user before account actions")
        return self.authenticated

    def _own_order(self, order_id: str) -> dict[str, Any]:
        uid = self._require_auth()
        order = self.db["orders"].get(_normalize_order_id(order_id))
        if order is None:
            raise ValueError(f"no order {order_id!r}; order ids look like '#W1234567'")
        if order["user_id"] != uid:
            raise self._violation(f"order {order['order_id']} belongs to another customer")
        return order

    def _require_confirmation(self, action: str, order_id: str) -> None:
        if self.require_confirmation and (action, order_id) not in self.confirmed:
            raise self._violation(f"no explicit customer confirmation to {action} order {order_id}")

    # -- tools --

    @tool
    def ask_user(self, question: str) -> str:
        """Ask the customer a question (for facts such as their name, zip code, order id, or a confirmation).

        Args:
            question: The question to the customer.
        """
        self._record("ask_user", question=question)
        assert self.user is not None
        if not question.strip():
            raise ValueError("question is empty")
        reply = self.user.answer(question)
        if reply.startswith("Yes"):
            order_ids = {_normalize_order_id(m) for m in _ORDER_ID_RE.findall(question)}
            for oid in order_ids:
                self.confirmed.add((self.user.action, oid))
        return reply

    @tool
    def find_user(self, name: str, zip_code: str) -> str:
        """Authenticate a customer by full name and zip code; returns their user id.

        Args:
            name: The customer's full name, e.g. "Lena Weber".
            zip_code: The customer's 5-digit zip code.
        """
        self._record("find_user", name=name, zip_code=zip_code)
        wanted = " ".join(name.lower().split())
        for user in self.db["users"].values():
            if user["name"].lower() == wanted and user["zip_code"] == zip_code.strip():
                self.authenticated = user["user_id"]
                return json.dumps({"user_id": user["user_id"], "name": user["name"], "authenticated": True})
        raise ValueError("no customer with this name and zip code")

    @tool
    def list_orders(self, user_id: str) -> str:
        """List a customer's orders (order id, status, date placed).

        Args:
            user_id: The user id returned by find_user.
        """
        self._record("list_orders", user_id=user_id)
        uid = self._require_auth()
        if user_id.strip() not in self.db["users"]:
            raise ValueError(f"no user {user_id!r}")
        if user_id.strip() != uid:
            raise self._violation("only the authenticated customer's orders may be listed")
        orders = [self.db["orders"][o] for o in self.db["users"][uid]["orders"]]
        return json.dumps([{"order_id": o["order_id"], "status": o["status"], "placed_on": o["placed_on"]} for o in orders])

    @tool
    def get_order(self, order_id: str) -> str:
        """Details of an order: status, dates and items (item id, product id, type, colour, size, price).

        Args:
            order_id: The order id, e.g. "#W1234567".
        """
        self._record("get_order", order_id=order_id)
        order = self._own_order(order_id)
        view = {k: order[k] for k in ("order_id", "status", "placed_on", "delivered_on")}
        if order["delivered_on"] is not None:
            view["days_since_delivery"] = (self.today - dt.date.fromisoformat(order["delivered_on"])).days
        view["items"] = [
            {"item_id": it["item_id"], **{k: self.db["products"][it["product_id"]][k]
                                          for k in ("product_id", "type", "color", "size", "price")}}
            for it in order["items"]
        ]
        self.seen_orders.add(order["order_id"])
        return json.dumps(view)

    @tool
    def get_product(self, product_id: str) -> str:
        """Details of a product: type, colour, size, price and stock.

        Args:
            product_id: The product id, e.g. "P12345".
        """
        self._record("get_product", product_id=product_id)
        product = self.db["products"].get(product_id.strip().upper())
        if product is None:
            raise ValueError(f"no product {product_id!r}")
        self.seen_products.add(product["product_id"])
        return json.dumps(product)

    @tool
    def list_products(self, product_type: str) -> str:
        """All products of one type (e.g. "t-shirt") with their colour, size, price and stock.

        Args:
            product_type: The product type, as shown in an order's items.
        """
        self._record("list_products", product_type=product_type)
        wanted = product_type.strip().lower()
        found = [p for p in self.db["products"].values() if p["type"] == wanted]
        if not found:
            types = sorted({p["type"] for p in self.db["products"].values()})
            raise ValueError(f"no product type {product_type!r}; types: {', '.join(types)}")
        self.seen_products.update(p["product_id"] for p in found)
        return json.dumps(found)

    @tool
    def cancel_order(self, order_id: str, reason: CancelReason) -> str:
        """Cancel a pending order.

        Args:
            order_id: The order id, e.g. "#W1234567".
            reason: Why the customer cancels.
        """
        self._record("cancel_order", order_id=order_id, reason=reason)
        order = self._own_order(order_id)
        if order["status"] != "pending":
            raise self._violation(f"order {order['order_id']} is {order['status']}; only pending orders can be cancelled")
        self._require_confirmation("cancel", order["order_id"])
        order["status"], order["reason"] = "cancelled", reason
        return json.dumps({"order_id": order["order_id"], "status": "cancelled"})

    @tool
    def refund_order(self, order_id: str, reason: RefundReason) -> str:
        """Refund a delivered order (within the refund window).

        Args:
            order_id: The order id, e.g. "#W1234567".
            reason: Why the customer returns it.
        """
        self._record("refund_order", order_id=order_id, reason=reason)
        order = self._own_order(order_id)
        if order["status"] != "delivered":
            raise self._violation(f"order {order['order_id']} is {order['status']}; only delivered orders can be refunded")
        days = (self.today - dt.date.fromisoformat(order["delivered_on"])).days
        if days > REFUND_WINDOW_DAYS:
            raise self._violation(f"order {order['order_id']} was delivered {days} days ago; refunds only within {REFUND_WINDOW_DAYS} days")
        self._require_confirmation("refund", order["order_id"])
        order["status"], order["reason"] = "refunded", reason
        return json.dumps({"order_id": order["order_id"], "status": "refunded"})

    @tool
    def exchange_item(self, order_id: str, item_id: str, new_product_id: str) -> str:
        """Exchange one item of a delivered order for another product of the same type.

        Args:
            order_id: The order id, e.g. "#W1234567".
            item_id: The item id inside the order (from get_order).
            new_product_id: The product the customer wants instead.
        """
        self._record("exchange_item", order_id=order_id, item_id=item_id, new_product_id=new_product_id)
        order = self._own_order(order_id)
        item = next((it for it in order["items"] if it["item_id"] == item_id.strip()), None)
        if item is None:
            raise ValueError(f"order {order['order_id']} has no item {item_id!r}")
        new = self.db["products"].get(new_product_id.strip().upper())
        if new is None:
            raise ValueError(f"no product {new_product_id!r}")
        old = self.db["products"][item["product_id"]]
        if order["status"] != "delivered":
            raise self._violation(f"order {order['order_id']} is {order['status']}; only delivered orders can be exchanged")
        if new["type"] != old["type"]:
            raise self._violation(f"a {old['type']} can only be exchanged for another {old['type']}, not a {new['type']}")
        if new["product_id"] == old["product_id"]:
            raise ValueError("the new product is the one already in the order")
        if new["stock"] <= 0:
            raise self._violation(f"product {new['product_id']} is out of stock")
        self._require_confirmation("exchange", order["order_id"])
        item["product_id"] = new["product_id"]
        new["stock"] -= 1
        order["status"] = "exchange requested"
        return json.dumps({"order_id": order["order_id"], "item_id": item["item_id"],
                           "new_product_id": new["product_id"], "status": order["status"]})

    @tool
    def transfer_to_human(self) -> str:
        """Hand the conversation to a human agent (only when the customer asks for one). Ends the episode."""
        self._record("transfer_to_human")
        self.violations.append("transferred to a human although the customer did not ask for one")
        self.end_episode(0.0, False, **self._outcome_info(transferred=1))
        return "Transferred to a human agent."

    # -- ending --

    def state_matches_goal(self) -> bool:
        return self.db == self.goal_db

    def refusal_grounded(self) -> bool:
        """For a task the policy forbids: did the agent read the evidence the refusal rests on?
        (Always True for the other tasks, where the final state is the evidence.)"""
        kind = self.goal.get("kind", "")
        if not kind.endswith("_refused"):
            return True
        if self.goal["order_id"] not in self.seen_orders:
            return False
        return kind != "exchange_refused" or self.goal["new_product_id"] in self.seen_products

    def _outcome_info(self, **extra: Any) -> dict[str, Any]:
        return {"violations": len(self.violations), "state_match": int(self.state_matches_goal()),
                "grounded": int(self.refusal_grounded()), "kind": self.goal.get("kind", ""), **extra}

    def on_text(self, message: Message) -> StepResult:
        """Any message without tool calls closes the conversation. Reward 1 iff it has an
        ``<answer>`` closing message, the database equals the goal, no rule was broken and (for a
        refusal) the agent read the order it refuses."""
        closing = extract_answer(message.content)
        ok = (closing is not None and not self.violations and self.state_matches_goal()
              and self.refusal_grounded())
        info = self._outcome_info(no_answer=int(closing is None))
        return StepResult(terminated=True, reward=float(ok), info={"success": int(ok), **info})

    # -- expert --

    def expert_action(self) -> Message:
        """The next step of the policy-following plan that has not been done yet in this episode."""
        if self.task is None:
            raise RuntimeError("expert_action called before reset(task)")
        for call in self._plan:
            if call.name == "__answer__":
                return Message(role="assistant", content=f"<answer>{call.arguments['text']}</answer>")
            if _call_key(call.name, call.arguments) not in self._calls_made:
                return Message(role="assistant", content="",
                               tool_calls=(ToolCall(name=call.name, arguments=dict(call.arguments), id=f"call_{self.turn}_0"),))
        raise AssertionError("expert plan has no final answer")


def _normalize_order_id(order_id: str) -> str:
    text = order_id.strip().upper()
    return text if text.startswith("#") else "#" + text


def _call_key(name: str, arguments: dict[str, Any]) -> str:
    return name + json.dumps(arguments, sort_keys=True)


def _expert_plan(scenario: dict[str, Any], require_confirmation: bool) -> list[ToolCall]:
    """The calls a policy-following agent makes for this scenario, then its closing message
    (``__answer__``). Written from the goal, but only uses facts the conversation reveals by then."""
    goal, db = scenario["goal"], scenario["db"]
    order_id, kind = goal["order_id"], goal["kind"]
    order = db["orders"][order_id]
    plan = [
        ToolCall(name="ask_user", arguments={"question": "To verify your identity, what is your full name and zip code?"}),
        ToolCall(name="find_user", arguments={"name": goal["name"], "zip_code": goal["zip_code"]}),
        ToolCall(name="ask_user", arguments={"question": "What is the order id of the order in question?"}),
    ]
    if goal["knows_order_id"]:
        plan.append(ToolCall(name="get_order", arguments={"order_id": order_id}))
    else:  # read the customer's orders one by one until the one with the described item
        plan.append(ToolCall(name="list_orders", arguments={"user_id": goal["user_id"]}))
        for oid in db["users"][goal["user_id"]]["orders"]:
            plan.append(ToolCall(name="get_order", arguments={"order_id": oid}))
            if oid == order_id:
                break

    def confirm(text: str) -> None:
        if require_confirmation:
            plan.append(ToolCall(name="ask_user", arguments={"question": f"Please confirm: {text}. Shall I proceed (yes/no)?"}))

    def answer(text: str) -> None:
        plan.append(ToolCall(name="__answer__", arguments={"text": text}))

    if kind == "cancel":
        plan.append(ToolCall(name="ask_user", arguments={"question": "What is the reason for the cancellation?"}))
        confirm(f"cancel order {order_id} (reason: {goal['reason']})")
        plan.append(ToolCall(name="cancel_order", arguments={"order_id": order_id, "reason": goal["reason"]}))
        answer(f"Your order {order_id} has been cancelled.")
    elif kind == "refund":
        plan.append(ToolCall(name="ask_user", arguments={"question": "What is the reason for the refund?"}))
        confirm(f"refund order {order_id} (reason: {goal['reason']})")
        plan.append(ToolCall(name="refund_order", arguments={"order_id": order_id, "reason": goal["reason"]}))
        answer(f"Your order {order_id} has been refunded.")
    elif kind == "cancel_refused":
        answer(f"I'm sorry, order {order_id} is {order['status']}; only pending orders can be cancelled.")
    elif kind == "refund_refused":
        if order["status"] != "delivered":
            answer(f"I'm sorry, order {order_id} is {order['status']}; only delivered orders can be refunded.")
        else:
            answer(f"I'm sorry, order {order_id} was delivered more than {REFUND_WINDOW_DAYS} days ago, so it cannot be refunded.")
    else:
        plan.append(ToolCall(name="ask_user", arguments={"question": "Which item would you like to exchange, and for which colour or size?"}))
        plan.append(ToolCall(name="list_products", arguments={"product_type": goal["product_type"]}))
        if kind == "exchange":
            confirm(f"exchange item {goal['item_id']} of order {order_id} for product {goal['new_product_id']}")
            plan.append(ToolCall(name="exchange_item", arguments={
                "order_id": order_id, "item_id": goal["item_id"], "new_product_id": goal["new_product_id"]}))
            answer(f"The {goal['item_description']} in order {order_id} will be exchanged for the {goal['new_color']} one.")
        else:
            answer(f"I'm sorry, the {goal['new_color']} {goal['product_type']} in size {goal['size']} is out of stock, so I cannot exchange it.")
    return plan
