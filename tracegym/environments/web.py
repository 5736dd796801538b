"""``web``: tasks on small generated websites, in a real headless Chromium driven through Playwright.

Each env instance serves its site from a local HTTP server on 127.0.0.1 (a free port) with the site's
state in SQLite (``web_sites.py``: a shop, a booking form, an admin panel); the reward reads that
backend state, never the page text. The browser is Debian's ``chromium`` (or ``$TRACEGYM_CHROMIUM``,
or the ``chromium`` option) launched by Playwright with ``executable_path``: no browser download.

The model sees a text snapshot of the page: its title and path, its text, and every link, button,
text box and select as ``[n] role "name"`` (a select lists its options, the chosen one starred; a
text box shows its value), at most ``max_observation_chars`` characters of it at a time (``scroll``
moves that window). Tools: ``click(element)``, ``type(element, text)``, ``select(element, option)``,
``scroll(direction)``, ``goto(path)`` (a path of this site only) and ``submit_answer(answer)``,
which ends the episode; the reward is 1 when the backend holds exactly what the task asked.

Playwright runs on a thread and event loop of its own, so an episode's calls from any event loop
wait with a deadline: a hung page, a crashed browser or a navigation off the site ends the episode
as an error (the run goes on). The envs of a process share one Chromium (each episode in a browser
context of its own); the last env's ``close`` stops it and Playwright's driver and kills any of
their processes still alive; each env's ``close`` stops its site's server. Branching is refused:
the page lives in another process.

With ``screenshots`` (a folder) every step also saves a JPEG of the page after the action, as
``<folder>/<task id>-<episode>/turn-<n>.jpg``; its path rides in the step's ``info["artifacts"]``
into ``Turn.artifacts["screenshot"]``, and ``tracegym report`` shows it with the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import threading
import itertools
import urllib.parse
import weakref
from pathlib import Path
from typing import Any

from tracegym.envs.base import Task
from tracegym.envs.tools import ToolEnv, tool
from tracegym.environments.web_sites import FAMILIES, Site, SiteServer, USERS_PER_PAGE, make_goal, site_content, task_prompt
from tracegym.types import Message, StepResult, ToolCall

__all__ = ["WebEnv", "WebEpisodeError", "find_chromium"]

GENERATOR_VERSION = 1

SYSTEM_PROMPT = """You operate a web browser to do a task on a website. Each page is shown as text: links, buttons, text boxes and selects appear as [n] role "name", where n is the element's number. Use the tools: click(element) for links and buttons, type(element, text) for text boxes, select(element, option) for selects, scroll(direction) to see more of a long page, goto(path) to open a path of this site. When the task is done, call submit_answer with what the task asks for."""

# The page as text: every visible text run, and each interactive element numbered (data-tg) in
# document order; table rows on one line with " | " between cells.
_SNAPSHOT_JS = r"""() => {
  const out = [], elements = []; let line = [], n = 0;
  const BLOCK = new Set(['P','DIV','LI','TR','H1','H2','H3','FORM','TABLE','UL','OL','NAV','MAIN','SECTION','BODY','TBODY','THEAD']);
  const flush = () => { const t = line.join(' ').replace(/\s+/g, ' ').trim(); if (t) out.push(t); line = []; };
  const labelOf = (el) => {
    if (el.id) { const l = document.querySelector(`label[for="${el.id}"]`); if (l) return l.innerText.trim(); }
    return el.getAttribute('aria-label') || el.getAttribute('placeholder') || el.name || '';
  };
  const walk = (node) => {
    if (node.nodeType === 3) { line.push(node.textContent); return; }
    if (node.nodeType !== 1) return;
    const el = node, tag = el.tagName;
    if (['SCRIPT', 'STYLE', 'NOSCRIPT', 'TEMPLATE', 'HEAD'].includes(tag)) return;
    if ((tag === 'INPUT' && el.type === 'hidden') || (tag === 'LABEL' && el.htmlFor)) return;
    const style = getComputedStyle(el);
    if (style.display === 'none' || style.visibility === 'hidden') return;
    let role = null, name = '', extra = '', options = null;
    if (tag === 'A' && el.hasAttribute('href')) { role = 'link'; name = el.innerText.trim(); }
    else if (tag === 'BUTTON' || (tag === 'INPUT' && ['submit', 'button'].includes(el.type))) { role = 'button'; name = (el.innerText || el.value || '').trim(); }
    else if (tag === 'INPUT' || tag === 'TEXTAREA') { role = 'textbox'; name = labelOf(el); extra = ` value="${el.value}"`; }
    else if (tag === 'SELECT') {
      role = 'select'; name = labelOf(el); options = Array.from(el.options).map(o => o.text);
      extra = ': ' + Array.from(el.options).map(o => o.text + (o.selected ? '*' : '')).join(' | ');
    }
    if (role) {
      n += 1; el.setAttribute('data-tg', String(n));
      elements.push({id: n, role: role, name: name, href: el.getAttribute('href'), options: options});
      line.push(`[${n}] ${role} "${name}"${extra}`); return;
    }
    const block = BLOCK.has(tag);
    if (block) flush();
    if (tag === 'H1') line.push('#'); else if (tag === 'H2' || tag === 'H3') line.push('##');
    if (tag === 'TR') { Array.from(el.children).forEach((cell, i) => { if (i) line.push('|'); walk(cell); }); flush(); return; }
    for (const child of el.childNodes) walk(child);
    if (block) flush();
  };
  walk(document.body); flush();
  return {lines: out, elements: elements, title: document.title};
}"""


class WebEpisodeError(RuntimeError):
    """The browser crashed or hung, or the page left the site: this episode ends as an error."""


def find_chromium(explicit: str | None = None) -> str | None:
    """The Chromium executable: ``explicit``, ``$TRACEGYM_CHROMIUM``, then ``chromium`` on PATH."""
    for name in (explicit, os.environ.get("TRACEGYM_CHROMIUM"), "chromium", "chromium-browser"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _descendants(pid: int, depth: int | None = None) -> set[int]:
    """Every live process below ``pid`` (from /proc), at most ``depth`` levels down (None: all)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [(pid, 0)]
    while todo:
        parent, level = todo.pop()
        if depth is not None and level >= depth:
            continue
        for child in children.get(parent, []):
            if child not in found:
                found.add(child)
                todo.append((child, level + 1))
    return found


class _Browser:
    """Playwright's async API on a thread and event loop of its own (Playwright objects belong to the
    loop that made them; the env's callers may run on any loop, or none). ``call`` runs a coroutine
    there with a deadline. One per process and executable, shared by the envs that use it (each
    episode has its own browser context: no cookies or pages in common), started by the first and
    stopped when the last one closes (``acquire``/``release``): a run of many concurrent episodes
    holds one Chromium, not one each."""

    _lock = threading.Lock()
    _shared: dict[str, tuple["_Browser", int]] = {}  # executable -> (browser, users)

    @classmethod
    def acquire(cls, executable: str) -> "_Browser":
        with cls._lock:
            browser, users = cls._shared.get(executable, (None, 0))
            if browser is not None and not browser.alive():  # crashed: its users fail, new ones get a fresh one
                cls._shared.pop(executable)
                browser, users = None, 0
            if browser is None:
                browser = _Browser(executable)
            cls._shared[executable] = (browser, users + 1)
            return browser

    @classmethod
    def release(cls, browser: "_Browser") -> None:
        with cls._lock:
            entry = cls._shared.get(browser.executable)
            if entry is not None and entry[0] is browser:
                if entry[1] > 1:
                    cls._shared[browser.executable] = (browser, entry[1] - 1)
                    return
                cls._shared.pop(browser.executable)
        browser.close()  # the last user (or a crashed browser no longer shared)

    @classmethod
    def users(cls) -> int:
        with cls._lock:
            return sum(users for _, users in cls._shared.values())

    def __init__(self, executable: str):
        self.executable = executable
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tracegym-web-browser", daemon=True)
        self.thread.start()
        self.playwright: Any = None
        self.browser: Any = None
        self.pids: set[int] = set()
        self.core_pids: set[int] = set()
        before, core_before = _descendants(os.getpid()), _descendants(os.getpid(), depth=2)
        try:
            self.call_sync(self._start(executable), 60.0)
        except Exception:
            self.close()
            raise
        self.pids = _descendants(os.getpid()) - before  # the driver and the browser's processes
        # Playwright's driver and Chromium's main process: if either is gone, so is the browser
        # (its helpers and renderers come and go on their own)
        self.core_pids = _descendants(os.getpid(), depth=2) - core_before

    async def _start(self, executable: str) -> None:
        try:
            from playwright.async_api import async_playwright
        except ImportError:
            raise RuntimeError("the web env needs the playwright package: pip install 'tracegym[web]' "
                               "(make installs it); the browser itself is Debian's chromium") from None
        self.playwright = await async_playwright().start()
        # Chromium's own sandbox needs user namespaces, which root in a container lacks; the pages
        # are this env's own generated sites, served from loopback, and every other request is refused.
        self.browser = await self.playwright.chromium.launch(
            executable_path=executable, headless=True, chromium_sandbox=os.geteuid() != 0,
            args=["--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking", "--no-first-run"])

    def alive(self) -> bool:
        return (self.thread.is_alive() and self.browser is not None and self.browser.is_connected()
                and all(_running(pid) for pid in self.core_pids))

    def call_sync(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def call(self, coro: Any, timeout_s: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        async def stop() -> None:
            if self.browser is not None:
                await self.browser.close()
            if self.playwright is not None:
                await self.playwright.stop()

        try:
            if self.thread.is_alive():
                self.call_sync(stop(), 15.0)
        except Exception:
            pass  # a hung or dead browser: its processes are killed below
        finally:
            for pid in self.pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)


class WebEnv(ToolEnv):
    """Do a task on a generated website (a shop, a booking form, an admin panel) in a real browser."""

    name = "web"
    description = "Generated websites (shop, booking, admin) in headless Chromium: click, type, select; reward from the site's database."
    default_max_turns = 24

    def __init__(self, families: list[str] | tuple[str, ...] | str | None = None, max_turns: int | None = None,
                 max_observation_chars: int = 3_000, browser_timeout_s: float = 20.0, chromium: str | None = None,
                 max_tool_output_chars: int | None = None, screenshots: str | None = None) -> None:
        super().__init__(max_turns=max_turns, max_tool_output_chars=max_tool_output_chars)
        chosen = (families,) if isinstance(families, str) else tuple(families) if families is not None else FAMILIES
        unknown = [f for f in chosen if f not in FAMILIES]
        if unknown or not chosen:
            raise ValueError(f"families must be a non-empty subset of {', '.join(FAMILIES)}; got {list(chosen)}")
        if max_observation_chars < 200:
            raise ValueError(f"max_observation_chars must be >= 200, got {max_observation_chars}")
        self.families = chosen
        self.max_observation_chars = int(max_observation_chars)
        self.browser_timeout_s = float(browser_timeout_s)
        self.chromium = chromium
        self.screenshots = Path(screenshots) if screenshots else None  # a JPEG of every step's page
        self.episode_dir: Path | None = None
        self.task: Task | None = None
        self.goal: dict[str, Any] = {}
        self.site: Site | None = None
        self.server: SiteServer | None = None
        self.browser: _Browser | None = None
        self._release_on_gc: Any = None
        self.context: Any = None
        self.page: Any = None
        self.elements: dict[int, dict[str, Any]] = {}
        self.lines: list[str] = []
        self.title = ""
        self.offset = 0
        self.scrolled: list[int] = []  # the offsets scrolled down from
        self.fatal: str | None = None
        self.offsite: str | None = None
        self.plan: list[tuple[Any, ...]] = []
        self.expert_progress = 0

    # -- tasks --

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        """Seeded tasks, the families in turn; the splits use disjoint site seeds and name pools."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        out = []
        for index in range(n):
            family = self.families[index % len(self.families)]
            content = site_content(family, split, seed, index)
            goal = make_goal(family, split, seed, index, content)
            out.append(Task(id=f"web-{split}-{seed}-{index}-{family}", split=split, data={
                "family": family, "split_seed": seed, "index": index, "generator_version": GENERATOR_VERSION,
                "goal": goal, "prompt": task_prompt(family, goal, content)}))
        return out

    # -- the browser --

    def branch_refusal(self) -> str | None:
        return "its page lives in a browser process (the site's database could be copied, the page's state cannot)"

    def _ensure_browser(self) -> _Browser:
        if self.browser is not None and not self.browser.alive():  # it crashed in an earlier episode: a fresh one
            self._release_on_gc.detach()
            _Browser.release(self.browser)
            self.browser, self.context, self.page = None, None, None
        if self.browser is None:
            executable = find_chromium(self.chromium)
            if executable is None:
                raise RuntimeError("the web env needs Chromium: install Debian's 'chromium' package, or set "
                                   "$TRACEGYM_CHROMIUM (or the chromium option) to its path")
            self.browser = _Browser.acquire(executable)
            # an env dropped without close() still gives its share of the browser back
            self._release_on_gc = weakref.finalize(self, _Browser.release, self.browser)
        return self.browser

    async def _new_page(self, origin: str) -> None:
        browser = self._ensure_browser()

        async def open_page() -> tuple[Any, Any]:
            if self.context is not None:
                with contextlib.suppress(Exception):  # the last episode's page may be gone with its browser
                    await self.context.close()
            context = await browser.browser.new_context()

            async def only_this_site(route: Any) -> None:
                request = route.request
                if request.url.startswith(origin + "/") or request.url == origin:
                    await route.continue_()
                else:  # nothing leaves the machine; leaving the site is an episode error
                    if request.is_navigation_request() and request.frame == request.frame.page.main_frame:
                        self.offsite = request.url
                    await route.abort()

            await context.route("**/*", only_this_site)
            return context, await context.new_page()

        self.context, self.page = await browser.call(open_page(), self.browser_timeout_s)

    async def _act(self, action: Any, path: str | None = None) -> str:
        """Run ``action(page)`` in the browser (a deadline, off-site navigation checked), then show the page."""
        assert self.browser is not None and self.server is not None

        async def run() -> dict[str, Any]:
            if path is not None:
                await self.page.goto(self.server.origin + path, wait_until="load")
            if action is not None:
                await action(self.page)
                await self.page.wait_for_load_state("load")
            return await self.page.evaluate(_SNAPSHOT_JS)

        try:
            snapshot = await self.browser.call(run(), self.browser_timeout_s)
        except asyncio.TimeoutError:
            self.fatal = f"the page did not respond within {self.browser_timeout_s:g} s"
            raise WebEpisodeError(self.fatal) from None
        except Exception as exc:  # the model's mistakes are refused before this: what is left is the browser's
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.fatal = (f"the page left the site for {self.offsite}" if self.offsite is not None
                          else f"the browser died ({type(exc).__name__}: {detail})"
                          if not self.browser.alive() or type(exc).__name__ == "TargetClosedError"
                          else f"the browser failed: {type(exc).__name__}: {detail}")
            raise WebEpisodeError(self.fatal) from None
        if self.offsite is not None:
            self.fatal = f"the page left the site for {self.offsite}"
            raise WebEpisodeError(self.fatal)
        self.elements = {e["id"]: e for e in snapshot["elements"]}
        self.lines = snapshot["lines"]
        self.title = snapshot["title"]
        self.offset, self.scrolled = 0, []
        return self._observation()

    def _path(self) -> str:
        url = urllib.parse.urlsplit(self.page.url if self.page is not None else "")
        return url.path + (f"?{url.query}" if url.query else "")

    def _window(self) -> list[str]:
        """The page's lines from ``offset``: as many whole lines as fit ``max_observation_chars``."""
        shown, size = [], 0
        for line in self.lines[self.offset:]:
            if shown and size + len(line) + 1 > self.max_observation_chars:
                break
            shown.append(line[: self.max_observation_chars])
            size += len(line) + 1
        return shown

    def _observation(self) -> str:
        """The page as the model sees it: its title and path, then the lines of ``_window``."""
        shown = self._window()
        end = self.offset + len(shown)
        more = (f"\n(lines {self.offset + 1}-{end} of {len(self.lines)}: scroll down for more)" if end < len(self.lines)
                else f"\n(lines {self.offset + 1}-{end} of {len(self.lines)})" if self.offset else "")
        return f"Page: {self.title} ({self._path()})\n" + "\n".join(shown) + more

    def _element(self, element: Any, roles: tuple[str, ...]) -> dict[str, Any]:
        try:
            number = int(element)
        except (TypeError, ValueError):
            raise ValueError(f"element must be a number from the page, e.g. 3 for [3]; got {element!r}") from None
        found = self.elements.get(number)
        if found is None:
            raise ValueError(f"there is no element [{number}] on this page")
        if found["role"] not in roles:
            raise ValueError(f"[{number}] is a {found['role']}; this tool works on a {' or '.join(roles)}")
        return found

    # -- episode --

    async def reset(self, task: Task) -> list[Message]:
        data = task.data
        if data.get("generator_version") != GENERATOR_VERSION or data.get("family") not in FAMILIES:
            raise ValueError(f"web task {task.id!r} is not a web task of generator v{GENERATOR_VERSION}")
        self.task, self.goal, self.fatal, self.offsite = task, data["goal"], None, None
        content = site_content(data["family"], task.split, data["split_seed"], data["index"])
        if self.site is not None:
            self.site.close()
        self.site = Site(data["family"], content)
        if self.server is None:
            self.server = SiteServer(self.site)
        self.server.site = self.site
        self.plan = _expert_plan(data["family"], self.goal, content)
        self.expert_progress = 0
        await self._new_page(self.server.origin)
        page = await self._act(None, path=self.site.start_path())
        if self.screenshots is not None:  # a folder per episode: one env plays many episodes of a task
            self.episode_dir = self.screenshots / f"{task.id}-{os.getpid()}-{next(_EPISODES)}"
        return [Message(role="system", content=SYSTEM_PROMPT),
                Message(role="user", content=f"{data['prompt']}\n\n{page}")]

    async def step(self, message: Message, parse_errors: Any = ()) -> StepResult:
        result = await super().step(message, parse_errors)
        if self.fatal is not None:  # the browser, not the model: this episode fails, the run goes on
            raise WebEpisodeError(self.fatal)
        if self.episode_dir is not None and self.page is not None:  # (ToolEnv.step counted the turn)
            path = await self._screenshot(self.episode_dir / f"turn-{self.turn:02d}.jpg")
            result = result.model_copy(update={"info": {**result.info, "artifacts": {"screenshot": str(path)}}})
        return result

    async def _screenshot(self, path: Path) -> Path:
        """A JPEG of the visible page, written atomically to ``path``."""
        from tracegym.files import atomic_write_bytes

        assert self.browser is not None
        try:
            data = await self.browser.call(self.page.screenshot(type="jpeg", quality=60), self.browser_timeout_s)
        except asyncio.TimeoutError:
            self.fatal = f"the page did not respond within {self.browser_timeout_s:g} s (screenshot)"
            raise WebEpisodeError(self.fatal) from None
        except Exception as exc:  # noqa: BLE001 - the browser's failure, not the model's
            self.fatal = f"the screenshot failed: {type(exc).__name__}: {str(exc).strip()[:200]}"
            raise WebEpisodeError(self.fatal) from None
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
        return path

    def _advance(self, *signature: Any) -> None:
        if self.expert_progress < len(self.plan) and self.plan[self.expert_progress][:len(signature)] == signature:
            self.expert_progress += 1

    @tool(timeout=60.0)
    async def click(self, element: int) -> str:
        """Click a link or a button of the page.

        Args:
            element: The element's number, e.g. 4 for [4] button "Add to cart".
        """
        found = self._element(element, ("link", "button"))
        self._advance("click", found["role"], found["name"])
        timeout_ms = self.browser_timeout_s * 1000
        return await self._act(lambda page: page.locator(f'[data-tg="{int(element)}"]').click(timeout=timeout_ms))

    @tool(timeout=60.0)
    async def type(self, element: int, text: str) -> str:
        """Type text into a text box (what it held before is replaced).

        Args:
            element: The text box's number, e.g. 5 for [5] textbox "Full name".
            text: The text to enter.
        """
        found = self._element(element, ("textbox",))
        self._advance("type", found["name"], str(text))
        timeout_ms = self.browser_timeout_s * 1000
        return await self._act(lambda page: page.locator(f'[data-tg="{int(element)}"]').fill(str(text), timeout=timeout_ms))

    @tool(timeout=60.0)
    async def select(self, element: int, option: str) -> str:
        """Choose an option of a select.

        Args:
            element: The select's number, e.g. 6 for [6] select "Shipping".
            option: The option's text, one of those the select lists.
        """
        found = self._element(element, ("select",))
        match = next((o for o in found["options"] or [] if o == str(option)), None) or \
            next((o for o in found["options"] or [] if o.lower() == str(option).strip().lower()), None)
        if match is None:
            raise ValueError(f"[{int(element)}] select \"{found['name']}\" has no option {option!r}; "
                             f"its options: {', '.join(found['options'] or [])}")
        self._advance("select", found["name"], match)
        timeout_ms = self.browser_timeout_s * 1000
        return await self._act(lambda page: page.locator(f'[data-tg="{int(element)}"]').select_option(label=match, timeout=timeout_ms))

    @tool(timeout=10.0)
    async def scroll(self, direction: str = "down") -> str:
        """Show the next (or previous) part of a long page.

        Args:
            direction: "down" or "up".
        """
        if direction not in ("down", "up"):
            raise ValueError(f"direction must be 'down' or 'up', got {direction!r}")
        if direction == "down":
            end = self.offset + len(self._window())
            if end < len(self.lines):
                self.scrolled.append(self.offset)  # "up" goes back to exactly this window
                self.offset = end
        elif self.scrolled:
            self.offset = self.scrolled.pop()
        return self._observation()

    @tool(timeout=60.0)
    async def goto(self, path: str) -> str:
        """Open a page of this site by its path.

        Args:
            path: A path of this site, e.g. "/cart" or "/users?page=2" (not a full URL).
        """
        path = str(path).strip()
        parsed = urllib.parse.urlsplit(path)
        if not path.startswith("/") or path.startswith("//") or parsed.scheme or parsed.netloc:
            raise ValueError(f"goto takes a path of this site starting with '/', e.g. '/cart'; got {path!r}")
        self._advance("goto", path)
        return await self._act(None, path=path)

    @tool(timeout=10.0)
    def submit_answer(self, answer: str) -> str:
        """Finish the task: the site's database is checked. Call it once the task is done.

        Args:
            answer: What the task asks you to report (an order number, the room you booked, "done").
        """
        assert self.site is not None
        passed, why = self.site.check(self.goal)
        self.end_episode(1.0 if passed else 0.0, passed, answer=str(answer), check=why)
        return "Submitted."

    def on_text(self, message: Message) -> StepResult:
        return StepResult(messages=(Message(role="user", content="Use the tools to act on the page; when the task is "
                                                                 "done, call submit_answer."),))

    def expert_action(self) -> Message:
        """The next step of the expert's plan, on the elements of the page as it is now."""
        if self.task is None:
            raise RuntimeError("expert_action called before reset")
        if self.expert_progress >= len(self.plan):
            return Message(role="assistant", content="The plan is done.")
        step = self.plan[self.expert_progress]
        kind = step[0]
        if kind == "goto":
            return _call("goto", {"path": step[1]}, self.expert_progress)
        if kind == "submit":
            answer = step[1]
            if answer is None:  # the shop's order number, from the confirmation page
                found = re.search(r"order number is (\d+)", "\n".join(self.lines))
                answer = found.group(1) if found else "unknown"
            return _call("submit_answer", {"answer": answer}, self.expert_progress)
        role = {"click": step[1] if kind == "click" else None, "type": "textbox", "select": "select"}[kind]
        name = step[2] if kind == "click" else step[1]
        number = next((i for i, e in self.elements.items() if e["role"] == role and e["name"] == name), None)
        if number is None:
            return Message(role="assistant", content=f"The expert cannot find {role} {name!r} on this page.")
        arguments: dict[str, Any] = {"element": number}
        if kind == "type":
            arguments["text"] = step[2]
        elif kind == "select":
            arguments["option"] = step[2]
        return _call(kind, arguments, self.expert_progress)

    def close(self) -> None:
        """Close this env's page, release the shared browser (the last user stops it and kills what is
        left of its processes), then stop the site's server."""
        browser, context, self.browser, self.context, self.page = self.browser, self.context, None, None, None
        if browser is not None:
            if context is not None and browser.alive():
                try:
                    browser.call_sync(context.close(), 10.0)
                except Exception:
                    pass  # the browser is going anyway when this was its last user
            self._release_on_gc.detach()
            _Browser.release(browser)
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.site is not None:
            self.site.close()
            self.site = None


_EPISODES = itertools.count()  # numbers the episodes of this process (screenshot folders)


def _call(name: str, arguments: dict[str, Any], index: int) -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name=name, arguments=arguments, id=f"call_{index}"),))


def _expert_plan(family: str, goal: dict[str, Any], content: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The expert's steps: ``("goto", path)``, ``("click", role, name)``, ``("type", label, text)``,
    ``("select", label, option)``, ``("submit", answer or None)``."""
    if family == "shop":
        plan: list[tuple[Any, ...]] = []
        for product, qty in goal["items"].items():
            plan += [("goto", f"/product/{product}"), ("select", "Quantity", str(qty)), ("click", "button", "Add to cart")]
        return plan + [("goto", "/checkout"), ("type", "Full name", goal["name"]), ("type", "Address", goal["address"]),
                       ("select", "Shipping", goal["shipping"]), ("click", "button", "Place order"), ("submit", None)]
    if family == "booking":
        return [("type", "Guest name", goal["name"]), ("select", "Room", goal["room"]), ("select", "Date", goal["date"]),
                ("type", "Guests", str(goal["guests"])), ("click", "button", "Book"), ("submit", goal["room"])]
    page = (goal["user_id"] - 1) // USERS_PER_PAGE + 1
    return ([("click", "link", "Next page")] * (page - 1)
            + [("click", "link", goal["username"]), ("select", "Role", goal["role"]),
               ("select", "Status", goal["status"]), ("click", "button", "Save"), ("submit", "done")])
