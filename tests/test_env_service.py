"""The service env: policy rules enforced and recorded, exact goal state, simulated user, expert."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import time
from collections import Counter

import pytest

from tracegym.envs import make
from tracegym.envs.episode import run_episodes
from tracegym.environments.service import KINDS, SimulatedUser, generate_scenario, goal_database
from tracegym.types import Message, ToolCall


def run(coro):
    return asyncio.run(coro)


def call(tool_name: str, /, **arguments) -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name=tool_name, arguments=arguments, id="c0"),))


def answer(text: str = "done") -> Message:
    return Message(role="assistant", content=f"<answer>{text}</answer>")


def started(kind: str, index: int = 0, **options):
    """A fresh env reset on the ``index``-th test task of ``kind``."""
    env = make("service", kinds=[kind], **options)
    task = env.tasks("test", index + 1, 0)[index]
    run(env.reset(task))
    return env, task


def tool_text(env, message: Message) -> str:
    result = run(env.step(message))
    assert not result.terminated
    return result.messages[0].content


def authenticate(env) -> None:
    g = env.goal
    assert json.loads(tool_text(env, call("find_user", name=g["name"], zip_code=g["zip_code"])))["authenticated"]


def confirm(env, text: str) -> str:
    return tool_text(env, call("ask_user", question=f"Please confirm: {text}. Shall I proceed (yes/no)?"))


# --- tasks and expert -----------------------------------------------------------------------------


def test_tasks_deterministic_and_splits_disjoint():
    env = make("service")
    train, test = env.tasks("train", 200, 0), env.tasks("test", 200, 0)
    assert [t.model_dump() for t in test] == [t.model_dump() for t in env.tasks("test", 200, 0)]
    assert not {t.id for t in train} & {t.id for t in test}

    def customers(tasks, split):
        return {generate_scenario(split, 0, t.data["index"], t.data["kind"])["goal"]["name"].split()[0] for t in tasks}

    assert not customers(train, "train") & customers(test, "test")
    assert set(Counter(t.data["kind"] for t in test)) == set(KINDS)


def test_expert_solves_test_tasks():
    tasks = make("service").tasks("test", 200, 0)
    start = time.perf_counter()
    results = run(run_episodes(lambda: make("service"), tasks, lambda e: e.expert_action))
    elapsed = time.perf_counter() - start
    solved = sum(r.success for r in results)
    print(f"service expert: {solved}/200 test tasks in {elapsed:.2f} s")
    assert solved >= 190
    assert all(r.metrics["violations"] == 0 and r.metrics["tool_errors"] == 0 for r in results)
    for task, result in zip(tasks, results):
        made = [{"name": c.name, "arguments": c.arguments} for m in result.messages for c in m.tool_calls]
        assert made == task.data["reference_calls"]


def test_expert_without_confirmation_rule():
    tasks = make("service", require_confirmation=False).tasks("train", 30, 0)
    results = run(run_episodes(lambda: make("service", require_confirmation=False), tasks, lambda e: e.expert_action))
    assert all(r.success for r in results)
    assert not any(c.arguments.get("question", "").startswith("Please confirm")
                   for r in results for m in r.messages for c in m.tool_calls)


def test_goal_database_changes_exactly_the_wanted_fields():
    s = generate_scenario("train", 0, 0, "cancel")
    goal_db, oid = goal_database(s["db"], s["goal"]), s["goal"]["order_id"]
    expected = copy.deepcopy(s["db"])
    expected["orders"][oid]["status"] = "cancelled"
    expected["orders"][oid]["reason"] = s["goal"]["reason"]
    assert goal_db == expected
    s = generate_scenario("train", 0, 1, "exchange")
    g = s["goal"]
    goal_db = goal_database(s["db"], g)
    stock = s["db"]["products"][g["new_product_id"]]["stock"]
    assert stock >= 1 and goal_db["products"][g["new_product_id"]]["stock"] == stock - 1
    items = {it["item_id"]: it["product_id"] for it in goal_db["orders"][g["order_id"]]["items"]}
    assert items[g["item_id"]] == g["new_product_id"]
    for kind in ("cancel_refused", "refund_refused", "exchange_refused"):
        s = generate_scenario("train", 0, 2, kind)
        assert goal_database(s["db"], s["goal"]) == s["db"]


def test_scenarios_satisfy_their_kind():
    for i in range(40):
        for kind in KINDS:
            s = generate_scenario("train", 1, i, kind)
            order = s["db"]["orders"][s["goal"]["order_id"]]
            status = order["status"]
            if kind == "cancel":
                assert status == "pending"
            if kind == "cancel_refused":
                assert status != "pending"
            if kind in ("refund", "exchange", "exchange_refused"):
                assert status == "delivered"
            if kind == "exchange_refused":
                assert s["db"]["products"][s["goal"]["new_product_id"]]["stock"] == 0
            if kind == "refund_refused" and status == "delivered":
                today = s["today"]
                days = (dt.date.fromisoformat(today) - dt.date.fromisoformat(order["delivered_on"])).days
                assert days > 30


# --- the simulated user ---------------------------------------------------------------------------


def test_user_reveals_only_what_is_asked():
    env, _ = started("cancel")
    g = env.goal
    opening = run(env.reset(env.task))[1].content
    zip_reply = tool_text(env, call("ask_user", question="What is your zip code?"))
    assert g["zip_code"] in zip_reply and g["name"] not in zip_reply
    name_reply = tool_text(env, call("ask_user", question="May I have your full name?"))
    assert g["name"] in name_reply and g["zip_code"] not in name_reply
    vague = tool_text(env, call("ask_user", question="How can I help you today?"))
    secrets = (g["name"], g["zip_code"], g["order_id"], g["reason"], g["item_description"])
    for secret in secrets:
        assert secret not in opening and secret not in vague
    assert [s for s in secrets if s in zip_reply + name_reply] == [g["name"], g["zip_code"]]
    assert env.user.revealed == {"name", "zip_code"}


def test_user_who_forgot_the_order_id_describes_the_item():
    for index in range(10):
        env, _ = started("refund", index)
        reply = tool_text(env, call("ask_user", question="What is your order number?"))
        if env.goal["knows_order_id"]:
            assert env.goal["order_id"] in reply
        else:
            assert env.goal["order_id"] not in reply and env.goal["item_description"] in reply


def test_user_confirms_only_its_own_request():
    s = generate_scenario("test", 0, 0, "cancel")
    user = SimulatedUser(s["goal"])
    oid = s["goal"]["order_id"]
    assert user.confirms(f"Please confirm: cancel order {oid}. Proceed?")
    assert not user.confirms(f"Please confirm: refund order {oid}. Proceed?")
    assert not user.confirms("Please confirm: cancel order #W0000000. Proceed?")
    assert not user.confirms(f"Please confirm: cancel order {oid} and order #W0000000. Proceed?")


# --- policy rules ---------------------------------------------------------------------------------


def test_account_tool_before_authentication_is_a_violation():
    env, _ = started("cancel")
    text = tool_text(env, call("get_order", order_id=env.goal["order_id"]))
    assert text.startswith("Error:") and "policy violation" in text and "authenticated" in text
    assert len(env.violations) == 1
    # even a perfect continuation earns nothing now
    while True:
        result = run(env.step(env.expert_action()))
        if result.terminated:
            break
    assert result.info["state_match"] == 1 and result.info["violations"] == 1 and result.reward == 0.0


def test_wrong_zip_does_not_authenticate():
    env, _ = started("cancel")
    text = tool_text(env, call("find_user", name=env.goal["name"], zip_code="00000"))
    assert text.startswith("Error:") and env.authenticated is None and not env.violations


def test_namesake_account_cannot_touch_the_customers_order():
    env, _ = started("cancel")
    g = env.goal
    namesake = next(u for u in env.db["users"].values() if u["name"] == g["name"] and u["user_id"] != g["user_id"])
    tool_text(env, call("find_user", name=namesake["name"], zip_code=namesake["zip_code"]))
    assert env.authenticated == namesake["user_id"]
    text = tool_text(env, call("get_order", order_id=g["order_id"]))
    assert "belongs to another customer" in text and len(env.violations) == 1
    assert "policy violation" in tool_text(env, call("list_orders", user_id=g["user_id"]))


@pytest.mark.parametrize("kind, tool, rule", [
    ("cancel_refused", "cancel_order", "only pending orders can be cancelled"),
    ("refund_refused", "refund_order", "refund"),
])
def test_forbidden_write_is_refused_recorded_and_leaves_state(kind, tool, rule):
    env, _ = started(kind)
    g = env.goal
    authenticate(env)
    before = copy.deepcopy(env.db)
    assert confirm(env, f"{tool.split('_')[0]} order {g['order_id']}").startswith("Yes")
    text = tool_text(env, call(tool, order_id=g["order_id"], reason=g["reason"]))
    assert "policy violation" in text and rule in text
    assert env.db == before and len(env.violations) == 1
    tool_text(env, call("get_order", order_id=g["order_id"]))
    result = run(env.step(answer("sorry")))
    assert result.terminated and result.info["state_match"] == 1 and result.reward == 0.0


def test_refund_window_is_thirty_days():
    for index in range(20):
        env, _ = started("refund_refused", index)
        order = env.db["orders"][env.goal["order_id"]]
        if order["status"] == "delivered":
            break
    else:
        pytest.fail("no delivered refund_refused order in 20 tasks")
    authenticate(env)
    confirm(env, f"refund order {env.goal['order_id']}")
    text = tool_text(env, call("refund_order", order_id=env.goal["order_id"], reason=env.goal["reason"]))
    assert "refunds only within 30 days" in text


def test_write_without_confirmation_is_a_violation():
    env, _ = started("cancel")
    g = env.goal
    authenticate(env)
    text = tool_text(env, call("cancel_order", order_id=g["order_id"], reason=g["reason"]))
    assert "no explicit customer confirmation" in text
    assert env.db["orders"][g["order_id"]]["status"] == "pending"


def test_exchange_rules():
    env, _ = started("exchange")
    g = env.goal
    authenticate(env)
    confirm(env, f"exchange item {g['item_id']} of order {g['order_id']}")
    other_type = next(p for p in env.db["products"].values() if p["type"] != g["product_type"])
    text = tool_text(env, call("exchange_item", order_id=g["order_id"], item_id=g["item_id"],
                               new_product_id=other_type["product_id"]))
    assert "can only be exchanged for another" in text and len(env.violations) == 1
    # unknown ids are plain errors, not violations
    text = tool_text(env, call("exchange_item", order_id=g["order_id"], item_id="I000000", new_product_id="P00000"))
    assert text.startswith("Error:") and len(env.violations) == 1

    env, _ = started("exchange_refused")
    g = env.goal
    authenticate(env)
    confirm(env, f"exchange item {g['item_id']} of order {g['order_id']} for product {g['new_product_id']}")
    text = tool_text(env, call("exchange_item", order_id=g["order_id"], item_id=g["item_id"],
                               new_product_id=g["new_product_id"]))
    assert "out of stock" in text and len(env.violations) == 1


def test_wrong_final_state_earns_nothing():
    env, _ = started("cancel")
    g = env.goal
    authenticate(env)
    wrong = "no longer needed" if g["reason"] == "ordered by mistake" else "ordered by mistake"
    assert confirm(env, f"cancel order {g['order_id']}").startswith("Yes")
    assert json.loads(tool_text(env, call("cancel_order", order_id=g["order_id"], reason=wrong)))["status"] == "cancelled"
    result = run(env.step(answer()))
    assert result.terminated and not env.violations
    assert result.info["state_match"] == 0 and result.reward == 0.0


def test_right_final_state_without_answer_tag_earns_nothing():
    env, _ = started("cancel")
    g = env.goal
    authenticate(env)
    confirm(env, f"cancel order {g['order_id']}")
    tool_text(env, call("cancel_order", order_id=g["order_id"], reason=g["reason"]))
    result = run(env.step(Message(role="assistant", content="Done, bye.")))
    assert result.terminated and result.info["state_match"] == 1 and result.reward == 0.0


def test_refusal_must_be_grounded():
    env, _ = started("cancel_refused")
    result = run(env.step(answer("Sorry, I cannot do that.")))  # refuses without looking
    assert result.info["state_match"] == 1 and result.info["grounded"] == 0 and result.reward == 0.0
    env, _ = started("cancel_refused")
    authenticate(env)
    tool_text(env, call("get_order", order_id=env.goal["order_id"]))
    result = run(env.step(answer("Sorry, it has already shipped.")))
    assert result.reward == 1.0


def test_transfer_ends_the_episode_with_nothing():
    env, _ = started("refund")
    result = run(env.step(call("transfer_to_human")))
    assert result.terminated and result.reward == 0.0 and result.info["transferred"] == 1


def test_bad_arguments_are_tool_errors():
    env, _ = started("cancel")
    authenticate(env)
    text = tool_text(env, call("cancel_order", order_id=env.goal["order_id"], reason="because"))
    assert text.startswith("Error: invalid arguments") and not env.violations
    assert tool_text(env, call("get_order", order_id="#W123")).startswith("Error: tool 'get_order' failed")


def test_episodes_are_isolated():
    a, task = started("cancel")
    b = make("service", kinds=["cancel"])
    run(b.reset(task))
    authenticate(a)
    confirm(a, f"cancel order {a.goal['order_id']}")
    tool_text(a, call("cancel_order", order_id=a.goal["order_id"], reason=a.goal["reason"]))
    assert a.db["orders"][a.goal["order_id"]]["status"] == "cancelled"
    assert b.db["orders"][b.goal["order_id"]]["status"] == "pending" and b.authenticated is None
    run(a.reset(task))  # a reset restores the initial database
    assert a.db == b.db and a.authenticated is None and not a.confirmed


def test_options_validated():
    with pytest.raises(ValueError, match="kinds"):
        make("service", kinds=["teleport"])


def test_check_env():
    from tracegym.envs.check import check_env

    report = check_env("service", n_tasks=30)
    assert report.ok and report.expert_success_rate == 1.0
    assert check_env(lambda: make("service", require_confirmation=False), n_tasks=10).ok
