"""The ``web`` env in a real headless Chromium (Debian's ``chromium``, driven by Playwright): the
expert solves every family through the same tools, the reward reads the site's database, bad
actions are errors the model sees, a hung page, a dead browser and a navigation off the site end
the episode as an error, observations are capped and scroll, and no browser or server outlives
``close()``. Skipped without Chromium, except under CI (``CI`` set), where that is a failure."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request

import pytest

from tracegym.envs import make
from tracegym.environments import web_sites
from tracegym.environments.web import WebEnv, WebEpisodeError, _Browser, _descendants, find_chromium
from tracegym.types import Message, ToolCall

if find_chromium() is None:
    if os.environ.get("CI"):
        pytest.fail("chromium is not installed; the CI script must install Debian's 'chromium' package", pytrace=False)
    pytest.skip("chromium not installed (apt-get install chromium); required under CI", allow_module_level=True)


def _call(name: str, **arguments) -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name=name, arguments=arguments, id="c"),))


def _expert_episode(env: WebEnv, task) -> tuple[float, dict, int]:
    async def play():
        await env.reset(task)
        for _ in range(40):
            result = await env.step(env.expert_action())
            if result.terminated or result.truncated:
                return result.reward, result.info, env.turn
        raise AssertionError("the expert did not finish")
    return asyncio.run(play())


@pytest.fixture()
def env():
    instance = WebEnv(browser_timeout_s=5.0)
    yield instance
    instance.close()


def test_the_expert_solves_every_family_through_the_tools_and_the_db_decides(env):
    tasks = env.tasks("test", 6, seed=1)
    assert [t.data["family"] for t in tasks] == ["shop", "booking", "admin"] * 2
    for task in tasks:
        reward, info, turns = _expert_episode(env, task)
        assert reward == 1.0 and info["success"] == 1, (task.id, info)
        assert turns >= 5 and info["check"] in ("the order matches", "the booking matches", "the users match")
    # the page text is not the reward: a shop order with the wrong quantity fails on the database
    shop = tasks[0]

    async def wrong_quantity():
        await env.reset(shop)
        product, qty = next(iter(shop.data["goal"]["items"].items()))
        page = (await env.step(_call("goto", path=f"/product/{product}"))).messages[0].content
        quantity = next(i for i, e in env.elements.items() if e["name"] == "Quantity")
        await env.step(_call("select", element=quantity, option=str(qty % 5 + 1)))
        button = next(i for i, e in env.elements.items() if e["name"] == "Add to cart")
        cart = (await env.step(_call("click", element=button))).messages[0].content
        return page, cart, await env.step(_call("submit_answer", answer="1001"))

    page, cart, result = asyncio.run(wrong_quantity())
    assert "Page: " in page and '] select "Quantity": 1* | 2' in page
    assert cart.startswith("Page: Cart (/cart)") and "| " in cart
    assert result.terminated and result.reward == 0.0 and "0 orders placed" in result.info["check"]


def test_bad_actions_are_errors_the_model_sees(env):
    task = env.tasks("train", 3, seed=0)[1]  # booking

    async def go():
        await env.reset(task)
        unknown = await env.step(_call("click", element=99))
        wrong_role = await env.step(_call("click", element=next(i for i, e in env.elements.items() if e["role"] == "select")))
        bad_option = await env.step(_call("select", element=next(i for i, e in env.elements.items() if e["name"] == "Room"),
                                          option="penthouse"))
        offsite = await env.step(_call("goto", path="https://example.com/"))
        refused = await env.step(_call("click", element=next(i for i, e in env.elements.items() if e["name"] == "Book")))
        return unknown, wrong_role, bad_option, offsite, refused

    unknown, wrong_role, bad_option, offsite, refused = asyncio.run(go())
    assert "no element [99]" in unknown.messages[0].content and not unknown.terminated
    assert "this tool works on a link or button" in wrong_role.messages[0].content
    assert "has no option 'penthouse'" in bad_option.messages[0].content and "single, double, family, suite" in bad_option.messages[0].content
    assert "goto takes a path of this site" in offsite.messages[0].content
    assert "Error: enter the guest name" in refused.messages[0].content  # the site's own validation, on the page


def test_observations_are_capped_and_scroll():
    env = WebEnv(families="admin", max_observation_chars=200)
    try:
        async def go():
            first = (await env.reset(env.tasks("train", 1)[0]))[1].content
            down = (await env.step(_call("scroll", direction="down"))).messages[0].content
            up = (await env.step(_call("scroll", direction="up"))).messages[0].content
            return first, down, up
        first, down, up = asyncio.run(go())
    finally:
        env.close()
    page = first.split("\n\n", 1)[1]
    assert len(page) < 200 + 120 and "scroll down for more" in page
    assert down != page and "lines " in down and up == page


def test_a_hung_page_a_dead_browser_and_leaving_the_site_end_the_episode(monkeypatch):
    real_handle = web_sites.Site.handle

    def slow(self, method, path, form):
        if path.startswith("/checkout"):
            time.sleep(10)
        return real_handle(self, method, path, form)

    monkeypatch.setattr(web_sites.Site, "handle", slow)
    env = WebEnv(families="shop", browser_timeout_s=4.0)
    try:
        task = env.tasks("train", 1)[0]

        async def hang():
            await env.reset(task)
            await env.step(_call("goto", path="/checkout"))

        with pytest.raises(WebEpisodeError, match="did not respond within 4 s"):
            asyncio.run(hang())

        async def leave():
            await env.reset(task)
            help_link = next(i for i, e in env.elements.items() if e["name"] == "Help center")
            await env.step(_call("click", element=help_link))

        with pytest.raises(WebEpisodeError, match="left the site for https://help.example.com/"):
            asyncio.run(leave())

        async def crash():
            await env.reset(task)
            for pid in env.browser.pids:
                os.kill(pid, signal.SIGKILL)
            await env.step(_call("goto", path="/cart"))

        with pytest.raises(WebEpisodeError, match="the browser died"):
            asyncio.run(crash())
        # the same env starts over on a fresh browser at its next reset
        assert asyncio.run(env.reset(task))[1].content.count("Page: Shop (/)") == 1 and env.browser.alive()
    finally:
        env.close()


def test_the_rollout_runner_counts_a_browser_failure_as_one_failed_episode(tmp_path):
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    class LeavesTheSite(WebEnv):
        def expert_action(self):
            if self.task.data["index"] == 1:
                return _call("click", element=next(i for i, e in self.elements.items() if e["name"] == "Help center"))
            return super().expert_action()

    from tracegym.models import load_tokenizer
    from tracegym.render import get_renderer

    tasks = LeavesTheSite().tasks("train", 3)
    renderer = get_renderer("tiny-random", load_tokenizer("tiny-random"))
    result = run_rollouts_sync(lambda: LeavesTheSite(browser_timeout_s=5.0), tasks, "expert", renderer,
                               RolloutConfig(samples_per_task=1, max_turns=30, concurrency=3, max_context=None), progress=False)
    assert result.stats.kept == 2 and result.stats.failed == 1 and result.stats.success_rate == 1.0
    assert "left the site" in result.failed[0].error


def test_close_leaves_no_browser_server_or_process_behind(tmp_path):
    # a private Chromium (another executable path is another shared browser): envs of other tests
    # in this worker, not yet garbage-collected, may still hold the default one
    private = tmp_path / "chromium"
    private.symlink_to(find_chromium())
    users = _Browser.users()
    before = _descendants(os.getpid())
    env, other = make("web", families=["booking"], chromium=str(private)), make("web", families=["admin"], chromium=str(private))
    asyncio.run(env.reset(env.tasks("train", 1)[0]))
    asyncio.run(other.reset(other.tasks("train", 1)[0]))
    assert env.browser is other.browser and _Browser.users() == users + 2  # one Chromium for the two
    origin = env.server.origin
    started = _descendants(os.getpid()) - before
    assert env.browser.pids and env.browser.pids <= started
    urllib.request.urlopen(origin + "/", timeout=5).read()
    other.close()
    assert env.browser.alive()  # still in use
    del other
    env.close()
    deadline = time.time() + 10
    while time.time() < deadline and (_descendants(os.getpid()) - before):
        time.sleep(0.1)
    assert not (_descendants(os.getpid()) - before), "a browser or driver process outlived close()"
    with pytest.raises(OSError):
        urllib.request.urlopen(origin + "/", timeout=2)
    env.close()  # twice is fine


def test_tasks_are_seeded_and_the_splits_share_no_site_or_person():
    env = WebEnv()
    train, again, test = env.tasks("train", 12), env.tasks("train", 12), env.tasks("test", 12)
    assert [t.data for t in train] == [t.data for t in again]
    assert not {t.data["prompt"] for t in train} & {t.data["prompt"] for t in test}
    first = lambda tasks: {t.data["goal"].get("name", t.data["goal"].get("username", "")).split()[0].split(".")[0].lower()
                           for t in tasks}
    assert not first(train) & first(test)
    assert WebEnv(families="admin").tasks("test", 2)[0].data["family"] == "admin"
    with pytest.raises(ValueError, match="families must be a non-empty subset of shop, booking, admin"):
        WebEnv(families=["forum"])
    with pytest.raises(Exception, match="cannot branch: its page lives in a browser process"):
        env.snapshot()


def test_check_env_passes():
    from tracegym.envs.check import check_env

    report = check_env(lambda: WebEnv(browser_timeout_s=10.0), n_tasks=3, raise_on_failure=False)
    assert report.failures == {} and report.expert_success_rate == 1.0
    assert "branching" in report.skipped


def test_screenshots_land_in_the_turns_and_the_report(tmp_path):
    from tracegym.data.store import TrajectoryWriter
    from tracegym.eval.report import render_report
    from tracegym.models import load_tokenizer
    from tracegym.render import get_renderer
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    shots = tmp_path / "shots"
    env_factory = lambda: WebEnv(browser_timeout_s=5.0, screenshots=str(shots))  # noqa: E731
    tasks = WebEnv().tasks("test", 1)
    renderer = get_renderer("tiny-random", load_tokenizer("tiny-random"))
    result = run_rollouts_sync(env_factory, tasks, "expert", renderer,
                               RolloutConfig(samples_per_task=2, max_turns=30, concurrency=2, max_context=None),
                               progress=False)
    assert result.stats.success_rate == 1.0 and len(result.trajectories) == 2
    folders = set()
    for trajectory in result.trajectories:
        paths = [turn.artifacts["screenshot"] for turn in trajectory.turns]
        assert [p.rsplit("/", 1)[1] for p in paths] == [f"turn-{n:02d}.jpg" for n in range(1, len(paths) + 1)]
        assert all(open(p, "rb").read(3) == b"\xff\xd8\xff" for p in paths)  # JPEG
        folders.add(paths[0].rsplit("/", 1)[0])
    assert len(folders) == 2  # one folder per episode, even for two samples of one task
    with TrajectoryWriter(tmp_path / "trajectories.jsonl") as writer:
        writer.write_all(result.trajectories)
    page = render_report(tmp_path, max_trajectories=2)
    assert page.count('alt="page after turn 1"') == 2 and "data:image/jpeg;base64,/9j/" in page
    gone = result.trajectories[0].turns[0].artifacts["screenshot"]
    os.remove(gone)
    assert "1 not found or not shown" in render_report(tmp_path, max_trajectories=2)
