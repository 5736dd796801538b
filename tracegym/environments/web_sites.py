"""The generated websites of the ``web`` env: their content, their backend state (SQLite) and the
local HTTP server that serves them. No browser here (``web.py`` drives one).

Three families, each a small server-rendered site with forms (no JavaScript needed):

- ``shop``: a product list, product pages with a quantity and "Add to cart", a cart, a checkout form
  (name, address, shipping) that validates and places an order;
- ``booking``: one form (guest name, room, date, guests) under an availability table; a booking for
  more guests than the room holds, or on a date the room is full, is refused with the reason;
- ``admin``: a paginated users table (8 a page), an edit form per user (role, status).

A site's content comes from its task's seed; the train and test splits use disjoint seeds and
disjoint pools of people's names. The reward reads the backend state only (``Site.check``): the
orders, bookings or users tables, never the page text.
"""

from __future__ import annotations

import html
import json
import random
import sqlite3
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

__all__ = ["FAMILIES", "Site", "SiteServer", "make_goal"]

FAMILIES = ("shop", "booking", "admin")

_ADJECTIVES = ("Blue", "Red", "Green", "Quiet", "Bright", "Compact", "Classic", "Silver", "Rustic", "Nordic",
               "Golden", "Urban")
_NOUNS = ("Kettle", "Lamp", "Backpack", "Mug", "Notebook", "Chair", "Blanket", "Clock", "Speaker", "Teapot",
          "Vase", "Umbrella")
_TRAIN_FIRST = ("Ana", "Ben", "Chloe", "David", "Elena", "Felix", "Gina", "Henrik", "Iris", "Jakob", "Kira", "Leo")
_TEST_FIRST = ("Alma", "Bruno", "Clara", "Dario", "Edith", "Fabio", "Gemma", "Hamid", "Ilse", "Joel", "Karin", "Lars")
_LAST = ("Lopez", "Meyer", "Novak", "Okoro", "Park", "Quist", "Rossi", "Sato", "Tran", "Ueda", "Vidal", "Wong")
_STREETS = ("Oak Street", "Mill Road", "Harbour Lane", "Cedar Avenue", "Station Road", "Hill Street")
ROOMS = {"single": 1, "double": 2, "family": 4, "suite": 6}
ROLES = ("viewer", "editor", "admin")
STATUSES = ("active", "suspended")
USERS_PER_PAGE = 8
EXTERNAL_HELP = "https://help.example.com/"  # a link off the site: following it is an episode error


def _people(split: str) -> tuple[str, ...]:
    return _TRAIN_FIRST if split == "train" else _TEST_FIRST


def _rng(split: str, seed: int, index: int, what: str) -> random.Random:
    return random.Random(f"web-{what}-{split}-{seed}-{index}")


def site_content(family: str, split: str, seed: int, index: int) -> dict[str, Any]:
    """The site's initial data (deterministic in its arguments)."""
    rng = _rng(split, seed, index, "site")
    if family == "shop":
        names = rng.sample([f"{a} {n}" for a in _ADJECTIVES for n in _NOUNS], 10)
        return {"products": [{"id": i + 1, "name": name, "price": round(rng.uniform(4, 90), 2)}
                             for i, name in enumerate(names)]}
    if family == "booking":
        days = sorted(rng.sample(range(1, 29), 6))
        dates = [f"2027-03-{d:02d}" for d in days]
        full = {date: sorted(rng.sample(list(ROOMS), rng.randint(0, 2))) for date in dates}
        return {"dates": dates, "full": full}
    if family == "admin":
        people = _people(split)
        usernames = rng.sample([f"{f.lower()}.{l.lower()}" for f in people for l in _LAST], 26)
        return {"users": [{"id": i + 1, "username": u, "role": rng.choice(ROLES), "status": rng.choice(STATUSES)}
                          for i, u in enumerate(usernames)]}
    raise ValueError(f"unknown web family {family!r}; expected one of {', '.join(FAMILIES)}")


def make_goal(family: str, split: str, seed: int, index: int, content: dict[str, Any]) -> dict[str, Any]:
    """What the task asks for (the reward compares the backend state with it)."""
    rng = _rng(split, seed, index, "goal")
    person = f"{rng.choice(_people(split))} {rng.choice(_LAST)}"
    if family == "shop":
        picks = rng.sample(content["products"], rng.choice((1, 2)))
        items = {str(p["id"]): rng.randint(1, 3) for p in picks}
        address = f"{rng.randint(1, 99)} {rng.choice(_STREETS)}"
        return {"items": items, "name": person, "address": address, "shipping": rng.choice(("standard", "express"))}
    if family == "booking":
        guests = rng.randint(1, 5)
        # a date on which some room that fits is free: the answer is the smallest such room
        for date in rng.sample(content["dates"], len(content["dates"])):
            fits = [r for r, cap in sorted(ROOMS.items(), key=lambda rc: rc[1])
                    if cap >= guests and r not in content["full"][date]]
            if fits:
                return {"name": person, "date": date, "guests": guests, "room": fits[0]}
        raise AssertionError("every date is full for every room that fits")  # impossible: at most 2 full
    user = rng.choice(content["users"])
    role = rng.choice([r for r in ROLES if r != user["role"]])
    status = rng.choice(STATUSES)
    return {"user_id": user["id"], "username": user["username"], "role": role, "status": status}


def task_prompt(family: str, goal: dict[str, Any], content: dict[str, Any]) -> str:
    if family == "shop":
        names = {str(p["id"]): p["name"] for p in content["products"]}
        wanted = " and ".join(f"{qty} x {names[pid]}" for pid, qty in goal["items"].items())
        return (f"On this shop, buy {wanted} (nothing else), with {goal['shipping']} shipping, for "
                f"{goal['name']}, address: {goal['address']}. Place the order, then call submit_answer with its number.")
    if family == "booking":
        return (f"Book a room for {goal['guests']} guest{'s' if goal['guests'] > 1 else ''} on {goal['date']} under "
                f"the name {goal['name']}: the smallest room that holds them and is free that day. Then call "
                "submit_answer with the room you booked.")
    return (f"In the admin panel, set the user {goal['username']} to role {goal['role']} and status {goal['status']}, "
            "and change nobody else. Then call submit_answer with 'done'.")


# --- pages ----------------------------------------------------------------------------------------


def _page(title: str, body: str, nav: str = "") -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body>{nav}<main><h1>{html.escape(title)}</h1>{body}</main></body></html>")


def _select(name: str, label: str, options: list[str], selected: str | None = None) -> str:
    opts = "".join(f"<option value='{html.escape(o)}'{' selected' if o == selected else ''}>{html.escape(o)}</option>"
                   for o in options)
    return f"<p><label for='{name}'>{html.escape(label)}</label> <select id='{name}' name='{name}'>{opts}</select></p>"


def _input(name: str, label: str, value: str = "") -> str:
    return (f"<p><label for='{name}'>{html.escape(label)}</label> "
            f"<input id='{name}' name='{name}' type='text' value='{html.escape(value)}'></p>")


def _error(message: str | None) -> str:
    return f"<p role='alert'>Error: {html.escape(message)}</p>" if message else ""


@dataclass
class Response:
    status: int
    body: str = ""
    location: str | None = None


class Site:
    """One site's backend: SQLite in memory (one connection, used under a lock from the server's
    threads) and the pages. ``handle`` answers one request."""

    def __init__(self, family: str, content: dict[str, Any]):
        self.family, self.content = family, content
        self.db = sqlite3.connect(":memory:", check_same_thread=False)
        self.lock = threading.Lock()
        self._setup()

    def _setup(self) -> None:
        c = self.db
        if self.family == "shop":
            c.execute("CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, price REAL)")
            c.executemany("INSERT INTO products VALUES (?, ?, ?)",
                          [(p["id"], p["name"], p["price"]) for p in self.content["products"]])
            c.execute("CREATE TABLE cart (product_id INTEGER PRIMARY KEY, qty INTEGER)")
            c.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, name TEXT, address TEXT, shipping TEXT, items TEXT)")
        elif self.family == "booking":
            c.execute("CREATE TABLE bookings (id INTEGER PRIMARY KEY, name TEXT, room TEXT, date TEXT, guests INTEGER)")
        else:
            c.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, username TEXT, role TEXT, status TEXT)")
            c.executemany("INSERT INTO users VALUES (?, ?, ?, ?)",
                          [(u["id"], u["username"], u["role"], u["status"]) for u in self.content["users"]])
        c.commit()

    def close(self) -> None:
        self.db.close()

    def start_path(self) -> str:
        return "/users" if self.family == "admin" else "/"

    # -- the reward: backend state only --

    def state(self) -> dict[str, Any]:
        with self.lock:
            if self.family == "shop":
                return {"orders": [{"name": n, "address": a, "shipping": s, "items": json.loads(i)}
                                   for n, a, s, i in self.db.execute("SELECT name, address, shipping, items FROM orders ORDER BY id")],
                        "cart": dict(self.db.execute("SELECT product_id, qty FROM cart"))}
            if self.family == "booking":
                return {"bookings": [{"name": n, "room": r, "date": d, "guests": g}
                                     for n, r, d, g in self.db.execute("SELECT name, room, date, guests FROM bookings ORDER BY id")]}
            return {"users": {i: (r, s) for i, r, s in self.db.execute("SELECT id, role, status FROM users")}}

    def check(self, goal: dict[str, Any]) -> tuple[bool, str]:
        """Whether the backend state is the goal's, and why not."""
        state = self.state()
        if self.family == "shop":
            orders = state["orders"]
            if len(orders) != 1:
                return False, f"{len(orders)} orders placed (expected 1)"
            order = orders[0]
            wanted = {k: int(v) for k, v in goal["items"].items()}
            for key in ("name", "address", "shipping"):
                if order[key] != goal[key]:
                    return False, f"the order's {key} is {order[key]!r}, not {goal[key]!r}"
            if order["items"] != wanted:
                return False, f"the order holds {order['items']}, not {wanted}"
            return True, "the order matches"
        if self.family == "booking":
            bookings = state["bookings"]
            if len(bookings) != 1:
                return False, f"{len(bookings)} bookings made (expected 1)"
            wanted = {k: goal[k] for k in ("name", "room", "date", "guests")}
            return (bookings[0] == wanted, "the booking matches" if bookings[0] == wanted
                    else f"the booking is {bookings[0]}, not {wanted}")
        users = state["users"]
        for user in self.content["users"]:
            expected = (goal["role"], goal["status"]) if user["id"] == goal["user_id"] else (user["role"], user["status"])
            if users[user["id"]] != expected:
                return False, f"user {user['username']} is {users[user['id']]}, expected {expected}"
        return True, "the users match"

    # -- requests --

    def handle(self, method: str, path: str, form: dict[str, str]) -> Response:
        url = urllib.parse.urlsplit(path)
        query = dict(urllib.parse.parse_qsl(url.query))
        route: Callable[..., Response] | None = getattr(self, f"_{self.family}", None)
        with self.lock:
            response = route(method, url.path, query, form) if route else None
        return response or Response(404, _page("Not found", "<p>No such page.</p>", self._nav()))

    def _nav(self) -> str:
        links = {"shop": "<a href='/'>Home</a> <a href='/cart'>Cart</a>", "booking": "<a href='/'>Home</a>",
                 "admin": "<a href='/users'>Users</a>"}[self.family]
        return f"<nav>{links} <a href='{EXTERNAL_HELP}'>Help center</a></nav>"

    def _shop(self, method: str, path: str, query: dict[str, str], form: dict[str, str]) -> Response | None:
        db = self.db
        if path == "/" and method == "GET":
            rows = "".join(f"<li><a href='/product/{i}'>{html.escape(n)}</a> ${p:.2f}</li>"
                           for i, n, p in db.execute("SELECT id, name, price FROM products ORDER BY id"))
            return Response(200, _page("Shop", f"<ul>{rows}</ul>", self._nav()))
        if path.startswith("/product/") and method == "GET":
            row = db.execute("SELECT id, name, price FROM products WHERE id = ?", (path.rsplit("/", 1)[1],)).fetchone()
            if row is None:
                return None
            form_html = (f"<form method='post' action='/cart/add'><input type='hidden' name='product' value='{row[0]}'>"
                         f"{_select('qty', 'Quantity', ['1', '2', '3', '4', '5'], '1')}<button type='submit'>Add to cart</button></form>")
            return Response(200, _page(row[1], f"<p>Price: ${row[2]:.2f}</p>{form_html}", self._nav()))
        if path == "/cart/add" and method == "POST":
            product, qty = form.get("product", ""), form.get("qty", "1")
            if not qty.isdigit() or db.execute("SELECT 1 FROM products WHERE id = ?", (product,)).fetchone() is None:
                return Response(400, _page("Cart", _error("bad product or quantity"), self._nav()))
            db.execute("INSERT INTO cart VALUES (?, ?) ON CONFLICT(product_id) DO UPDATE SET qty = qty + excluded.qty",
                       (int(product), int(qty)))
            db.commit()
            return Response(303, location="/cart")
        if path == "/cart/remove" and method == "POST":
            db.execute("DELETE FROM cart WHERE product_id = ?", (form.get("product", ""),))
            db.commit()
            return Response(303, location="/cart")
        if path == "/cart" and method == "GET":
            items = db.execute("SELECT p.id, p.name, c.qty FROM cart c JOIN products p ON p.id = c.product_id ORDER BY p.id").fetchall()
            rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{q}</td><td><form method='post' action='/cart/remove'>"
                           f"<input type='hidden' name='product' value='{i}'><button type='submit'>Remove {html.escape(n)}</button>"
                           "</form></td></tr>" for i, n, q in items)
            body = (f"<table><tr><th>Product</th><th>Quantity</th><th></th></tr>{rows}</table>" if items
                    else "<p>Your cart is empty.</p>") + "<p><a href='/'>Continue shopping</a> <a href='/checkout'>Checkout</a></p>"
            return Response(200, _page("Cart", body, self._nav()))
        if path == "/checkout":
            error = None
            if method == "POST":
                name, address, shipping = (form.get(k, "").strip() for k in ("name", "address", "shipping"))
                cart = db.execute("SELECT product_id, qty FROM cart").fetchall()
                error = ("your cart is empty" if not cart else "enter a full name" if not name else
                         "enter an address" if not address else "pick a shipping method" if shipping not in ("standard", "express") else None)
                if error is None:
                    items = json.dumps({str(p): q for p, q in sorted(cart)})
                    cursor = db.execute("INSERT INTO orders (name, address, shipping, items) VALUES (?, ?, ?, ?)",
                                        (name, address, shipping, items))
                    db.execute("DELETE FROM cart")
                    db.commit()
                    number = 1000 + int(cursor.lastrowid or 0)
                    return Response(200, _page("Order placed", f"<p>Thank you! Your order number is {number}.</p>", self._nav()))
            body = (_error(error) + "<form method='post' action='/checkout'>" + _input("name", "Full name", form.get("name", ""))
                    + _input("address", "Address", form.get("address", ""))
                    + _select("shipping", "Shipping", ["standard", "express"], form.get("shipping", "standard"))
                    + "<button type='submit'>Place order</button></form>")
            return Response(200, _page("Checkout", body, self._nav()))
        return None

    def _booking(self, method: str, path: str, query: dict[str, str], form: dict[str, str]) -> Response | None:
        if path not in ("/", "/book"):
            return None
        error = message = None
        if path == "/book" and method == "POST":
            name, room, date, guests = (form.get(k, "").strip() for k in ("name", "room", "date", "guests"))
            if not name:
                error = "enter the guest name"
            elif room not in ROOMS or date not in self.content["dates"]:
                error = "pick a room and a date"
            elif not guests.isdigit() or int(guests) < 1:
                error = "enter the number of guests (1 or more)"
            elif int(guests) > ROOMS[room]:
                error = f"a {room} room holds at most {ROOMS[room]} guest{'s' if ROOMS[room] > 1 else ''}"
            elif room in self.content["full"][date]:
                error = f"no {room} room is free on {date}"
            else:
                self.db.execute("INSERT INTO bookings (name, room, date, guests) VALUES (?, ?, ?, ?)",
                                (name, room, date, int(guests)))
                self.db.commit()
                message = f"Booked: a {room} room on {date} for {name}."
        header = "".join(f"<th>{r} ({c})</th>" for r, c in ROOMS.items())
        rows = "".join(f"<tr><td>{d}</td>" + "".join(f"<td>{'full' if r in self.content['full'][d] else 'free'}</td>" for r in ROOMS)
                       + "</tr>" for d in self.content["dates"])
        body = (f"<h2>Availability</h2><table><tr><th>Date</th>{header}</tr>{rows}</table>"
                + (f"<p role='status'>{html.escape(message)}</p>" if message else _error(error))
                + "<h2>Your booking</h2><form method='post' action='/book'>" + _input("name", "Guest name", form.get("name", ""))
                + _select("room", "Room", list(ROOMS), form.get("room"))
                + _select("date", "Date", self.content["dates"], form.get("date"))
                + _input("guests", "Guests", form.get("guests", "")) + "<button type='submit'>Book</button></form>")
        return Response(200, _page("Book a room", body, self._nav()))

    def _admin(self, method: str, path: str, query: dict[str, str], form: dict[str, str]) -> Response | None:
        db = self.db
        total = db.execute("SELECT COUNT(*) FROM users").fetchone()[0]
        pages = (total + USERS_PER_PAGE - 1) // USERS_PER_PAGE
        if path == "/users" and method == "GET":
            page = int(query["page"]) if query.get("page", "").isdigit() else 1
            page = min(max(page, 1), pages)
            users = db.execute("SELECT id, username, role, status FROM users ORDER BY id LIMIT ? OFFSET ?",
                               (USERS_PER_PAGE, (page - 1) * USERS_PER_PAGE)).fetchall()
            rows = "".join(f"<tr><td><a href='/user/{i}'>{html.escape(u)}</a></td><td>{r}</td><td>{s}</td></tr>"
                           for i, u, r, s in users)
            links = (f"<a href='/users?page={page - 1}'>Previous page</a> " if page > 1 else "") + \
                    (f"<a href='/users?page={page + 1}'>Next page</a>" if page < pages else "")
            saved = "<p role='status'>Saved.</p>" if query.get("saved") else ""
            body = (f"{saved}<table><tr><th>User</th><th>Role</th><th>Status</th></tr>{rows}</table>"
                    f"<p>Page {page} of {pages}</p><p>{links}</p>")
            return Response(200, _page("Users", body, self._nav()))
        if path.startswith("/user/"):
            row = db.execute("SELECT id, username, role, status FROM users WHERE id = ?", (path.rsplit("/", 1)[1],)).fetchone()
            if row is None:
                return None
            if method == "POST":
                role, status = form.get("role", ""), form.get("status", "")
                if role in ROLES and status in STATUSES:
                    db.execute("UPDATE users SET role = ?, status = ? WHERE id = ?", (role, status, row[0]))
                    db.commit()
                    return Response(303, location=f"/users?page={(row[0] - 1) // USERS_PER_PAGE + 1}&saved=1")
                return Response(400, _page(f"Edit {row[1]}", _error("pick a role and a status"), self._nav()))
            body = ("<form method='post'>" + _select("role", "Role", list(ROLES), row[2])
                    + _select("status", "Status", list(STATUSES), row[3]) + "<button type='submit'>Save</button></form>")
            return Response(200, _page(f"Edit {row[1]}", body, self._nav()))
        return None


class SiteServer:
    """``site`` over HTTP on 127.0.0.1 at a free port, in a daemon thread; ``close`` stops it."""

    def __init__(self, site: Site):
        self.site = site
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                form: dict[str, str] = {}
                if method == "POST":
                    length = min(int(self.headers.get("Content-Length") or 0), 1 << 16)
                    form = dict(urllib.parse.parse_qsl(self.rfile.read(length).decode("utf-8", "replace")))
                response = owner.site.handle(method, self.path, form)
                self.send_response(response.status)
                if response.location:
                    self.send_header("Location", response.location)
                data = response.body.encode("utf-8")
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the browser gave up on the page (a deadline, a closed context)

            def do_GET(self) -> None:  # noqa: N802
                self._answer("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._answer("POST")

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="tracegym-web-site", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)
