"""The search env: generated corpus, BM25 index and its disk cache, browser tools, expert, splits."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections import Counter

import pytest

from tracegym.envs import make
from tracegym.environments.corpus import (
    RELATIONS,
    compose_question,
    generate_corpus,
    index_text,
    random_walk,
    tokenize,
)
from tracegym.envs.episode import run_episodes
from tracegym.types import Message, ToolCall

SIZE = 2000  # the default corpus size: builds in well under a second


@pytest.fixture(scope="session")
def search_cache(tmp_path_factory):
    """Index cache in a temporary folder for the whole session; the shared backend is built once."""
    folder = tmp_path_factory.mktemp("tg_cache")
    old = os.environ.get("TRACEGYM_CACHE")
    os.environ["TRACEGYM_CACHE"] = str(folder)
    from tracegym.environments import search

    search._backends.clear()
    yield folder
    search._backends.clear()
    if old is None:
        os.environ.pop("TRACEGYM_CACHE", None)
    else:
        os.environ["TRACEGYM_CACHE"] = old


@pytest.fixture(scope="session")
def backend(search_cache):
    from tracegym.environments.search import get_backend

    return get_backend(SIZE, 0)


def call(name: str, **arguments) -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name=name, arguments=arguments, id="c0"),))


def run(coro):
    return asyncio.run(coro)


# --- corpus ---------------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_seed_dependent():
    a, b, c = generate_corpus(300, 0), generate_corpus(300, 0), generate_corpus(300, 1)
    assert a.fingerprint == b.fingerprint
    assert [e.text for e in a] == [e.text for e in b]
    assert a.fingerprint != c.fingerprint
    assert len(a) == 300 and len({e.doc_id for e in a}) == 300


def test_corpus_golden_fingerprint():
    # If generation changes on purpose, bump CORPUS_VERSION (stale disk indexes are then ignored)
    # and update this value.
    assert generate_corpus(100, 0).fingerprint[:16] == GOLDEN_FINGERPRINT


GOLDEN_FINGERPRINT = "f33ee909fb865e2b"


def test_every_name_token_identifies_one_entity():
    corpus = generate_corpus(SIZE, 0)
    owners: dict[str, set[str]] = {}
    generic = {"mount", "lake", "river"}
    for e in corpus:
        words = e.name.split()
        invented = [w.lower() for w in words if w.lower() not in generic]
        if e.type in ("company", "university", "invention"):
            invented = invented[:1]  # the suffix ("Industries", "Lamp") is shared by design
        for w in invented:
            owners.setdefault(w, set()).add(e.doc_id)
    assert all(len(ids) == 1 for ids in owners.values())
    assert Counter(e.type for e in corpus)["person"] >= 0.3 * SIZE


def test_each_page_states_its_relations():
    corpus = generate_corpus(SIZE, 0)
    for e in corpus:
        rels = {r.name for r in RELATIONS if r.source_type == e.type}
        assert set(e.relations) == rels
        for target in e.relations.values():
            assert corpus.by_id[target].name in e.text  # the next hop is readable on the page


def test_compose_question_nests_relations():
    corpus = generate_corpus(SIZE, 0)
    company = next(e for e in corpus if e.type == "company")
    founder = corpus.by_id[company.relations["founder"]]
    city = corpus.by_id[founder.relations["birthplace"]]
    rel = {(r.source_type, r.name): r for r in RELATIONS}
    text = compose_question(corpus, [company.doc_id, founder.doc_id, city.doc_id],
                            [rel["company", "founder"], rel["person", "birthplace"]])
    assert text == f"In which city was the founder of {company.name} born?"


def test_random_walk_never_revisits():
    corpus = generate_corpus(SIZE, 0)
    rng = random.Random(0)
    for _ in range(300):
        q = random_walk(corpus, rng.choice(corpus.entities).doc_id, 4, rng)
        if q is not None:
            assert len(set(q.chain)) == len(q.chain) == 5
            assert q.answer == corpus.by_id[q.chain[-1]].name


def test_generation_is_fast():
    start = time.perf_counter()
    generate_corpus(20_000, 3)
    assert time.perf_counter() - start < 5.0  # 100k in a few seconds; see bench/search_index.py


def test_corpus_size_validated():
    with pytest.raises(ValueError, match="corpus_size"):
        generate_corpus(10, 0)


# --- index ----------------------------------------------------------------------------------------


def _reference_bm25_ranking(corpus, query: str, k1: float = 1.5, b: float = 0.75) -> list[str]:
    """BM25 (Lucene idf) written out by hand, to check the bm25s index against."""
    docs = [tokenize(index_text(e)) for e in corpus]
    avgdl = sum(len(d) for d in docs) / len(docs)
    terms = set(tokenize(query))
    df = {t: sum(1 for d in docs if t in d) for t in terms}
    scored = []
    for i, d in enumerate(docs):
        counts = Counter(d)
        s = 0.0
        for t in terms:
            if counts[t]:
                idf = math.log(1 + (len(docs) - df[t] + 0.5) / (df[t] + 0.5))
                s += idf * counts[t] / (counts[t] + k1 * (1 - b + b * len(d) / avgdl))
        if s > 0:
            scored.append((-s, i))
    scored.sort()
    return [corpus.entities[i].doc_id for _, i in scored[:5]]


def test_bm25_matches_hand_written_reference(backend):
    corpus = backend.corpus
    rng = random.Random(5)
    queries = ["river source mountain", "founded textile company"]
    for e in rng.sample(corpus.entities, 6):
        queries.append(e.name)
        queries.append(f"{e.name.split()[0]} born")
    for q in queries:
        assert [h.doc_id for h in backend.search(q)] == _reference_bm25_ranking(corpus, q), q


def test_search_is_deterministic_and_cached_index_agrees(backend, search_cache):
    from tracegym.environments.search import SearchBackend, index_dir

    folder = index_dir(0, SIZE)
    assert (folder / "meta.json").exists()
    assert json.loads((folder / "meta.json").read_text())["fingerprint"] == backend.corpus.fingerprint
    loaded = SearchBackend.build(SIZE, 0)
    fresh = SearchBackend.build(SIZE, 0, use_disk_cache=False)
    assert loaded.loaded_from_cache and not fresh.loaded_from_cache
    for e in backend.corpus.entities[:40]:
        hits = backend.search(e.name)
        assert hits == backend.search(e.name) == loaded.search(e.name)
        assert [h.doc_id for h in hits] == [h.doc_id for h in fresh.search(e.name)]
    # no temporary folders are left behind
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".")] == []


def test_stale_cache_is_rebuilt(search_cache):
    from tracegym.environments.search import SearchBackend, index_dir

    SearchBackend.build(300, 9)
    meta = index_dir(9, 300) / "meta.json"
    data = json.loads(meta.read_text())
    for key, stale_value in (("fingerprint", "something else"), ("bm25", {"k1": 1.2, "b": 0.75, "method": "lucene"})):
        meta.write_text(json.dumps({**data, key: stale_value}))
        assert not SearchBackend.build(300, 9).loaded_from_cache
    again = SearchBackend.build(300, 9)
    assert again.loaded_from_cache
    assert json.loads(meta.read_text())["fingerprint"] == again.corpus.fingerprint
    assert SearchBackend.build(300, 9).loaded_from_cache


def test_query_without_known_words_returns_nothing(backend):
    assert backend.search("qqqq zzzz") == []
    assert backend.search("the of and") == []


# --- env ------------------------------------------------------------------------------------------


def test_tasks_deterministic_and_splits_disjoint(search_cache):
    env = make("search")
    train, test = env.tasks("train", 300, 0), env.tasks("test", 200, 0)
    assert [t.model_dump() for t in train] == [t.model_dump() for t in env.tasks("train", 300, 0)]
    assert len({t.id for t in train}) == 300
    starts_train = {t.data["chain"][0] for t in train}
    starts_test = {t.data["chain"][0] for t in test}
    assert not starts_train & starts_test
    assert {t.data["hops"] for t in test} == {1, 2, 3, 4}
    assert env.tasks("train", 5, 1) != env.tasks("train", 5, 0)


def test_hops_option():
    from tracegym.environments.search import parse_hops

    assert parse_hops(3) == (3, 3) and parse_hops("1-4") == (1, 4) and parse_hops([2, 3]) == (2, 3)
    for bad in (0, "4-1", (1, 9), "x", True):
        with pytest.raises(ValueError):
            parse_hops(bad)


def test_hops_knob_controls_chain_length(search_cache):
    tasks = make("search", hops=3).tasks("train", 50, 0)
    assert all(t.data["hops"] == 3 and len(t.data["chain"]) == 4 for t in tasks)
    assert all(len(t.data["reference_calls"]) == 6 for t in tasks)


def test_expert_solves_test_tasks_and_its_searches_rank_gold_top5(backend):
    env = make("search")
    tasks = env.tasks("test", 200, 0)
    start = time.perf_counter()
    results = run(run_episodes(lambda: make("search"), tasks, lambda e: e.expert_action))
    elapsed = time.perf_counter() - start
    solved = sum(r.success for r in results)
    print(f"search expert: {solved}/200 test tasks in {elapsed:.2f} s")
    assert solved >= 190
    assert all(r.error is None and r.end_reason == "terminated" for r in results)
    for task in tasks:
        calls = task.data["reference_calls"]
        for searched, opened in zip(calls[::2], calls[1::2]):
            assert searched["name"] == "search" and opened["name"] == "open"
            rank = backend.rank_of(searched["arguments"]["query"], opened["arguments"]["doc_id"])
            assert rank is not None and rank <= 5


def test_expert_calls_are_the_reference_calls(search_cache):
    env = make("search")
    task = env.tasks("test", 1, 4)[0]
    result = run(run_episodes(lambda: make("search"), [task], lambda e: e.expert_action))[0]
    made = [{"name": c.name, "arguments": c.arguments} for m in result.messages for c in m.tool_calls]
    assert made == task.data["reference_calls"]


def test_open_find_and_errors(backend):
    env = make("search", page_chars=80)
    task = env.tasks("test", 1, 0)[0]
    run(env.reset(task))
    doc = task.data["chain"][0]
    page = run(env.step(call("open", doc_id=doc))).messages[0].content
    assert page.startswith(f"[{doc}] # ") and "[... truncated: showing 80 of" in page
    entity = backend.corpus.by_id[doc]
    first_word = entity.lines[1].split()[-1].rstrip(".")
    found = run(env.step(call("find", doc_id=doc, pattern=first_word.upper()))).messages[0].content
    assert entity.lines[1] in found and found.startswith("L")
    missing = run(env.step(call("find", doc_id=doc, pattern="no such text"))).messages[0].content
    assert missing.startswith("No line of")
    for bad in (call("open", doc_id="d999999x"), call("find", doc_id="nope", pattern="a"),
                call("find", doc_id=doc, pattern="  "), call("search", query=" "), call("open", id=doc)):
        result = run(env.step(bad))
        assert result.messages[0].content.startswith("Error:")
        assert not result.terminated
    assert "unknown doc id" in run(env.step(call("open", doc_id="d999999x"))).messages[0].content


def test_search_tool_output_lists_top5(search_cache):
    env = make("search")
    task = env.tasks("test", 1, 0)[0]
    run(env.reset(task))
    query = task.data["reference_calls"][0]["arguments"]["query"]
    text = run(env.step(call("search", query=query))).messages[0].content
    lines = [line for line in text.splitlines() if not line.startswith("   ")]
    assert 1 <= len(lines) <= 5
    assert lines[0] == f"1. [{task.data['chain'][0]}] {query}"


@pytest.mark.parametrize(
    "written, reward",
    [("{a}", 1.0), ("the {lower}.", 1.0), ("  {upper} ", 1.0), ("{a} x", 0.0), ("", 0.0)],
)
def test_answer_normalisation(search_cache, written, reward):
    env = make("search")
    task = env.tasks("train", 1, 0)[0]
    run(env.reset(task))
    a = task.data["answer"]
    text = written.format(a=a, lower=a.lower(), upper=a.upper())
    result = run(env.step(Message(role="assistant", content=f"<answer>{text}</answer>")))
    assert result.terminated and result.reward == reward and result.info["success"] == int(reward)


def test_no_answer_ends_with_zero(search_cache):
    env = make("search")
    run(env.reset(env.tasks("train", 1, 0)[0]))
    result = run(env.step(Message(role="assistant", content="I give up")))
    assert result.terminated and result.reward == 0.0


def test_task_for_other_corpus_is_rejected(search_cache):
    task = make("search", corpus_size=300).tasks("train", 1, 0)[0]
    with pytest.raises(ValueError, match="corpus"):
        run(make("search").reset(task))


def test_instances_share_the_index_but_not_episodes(search_cache):
    a, b = make("search"), make("search")
    ta, tb = a.tasks("train", 2, 0)
    run(a.reset(ta))
    run(b.reset(tb))
    assert a.backend is b.backend
    first_a = ta.data["reference_calls"][0]
    run(a.step(call(first_a["name"], **first_a["arguments"])))
    # a's progress moved a's expert on, and left b's where it was
    assert a.expert_action().tool_calls[0].arguments == ta.data["reference_calls"][1]["arguments"]
    assert b.expert_action().tool_calls[0].arguments == tb.data["reference_calls"][0]["arguments"]


def test_check_env(search_cache):
    from tracegym.envs.check import check_env

    report = check_env("search", n_tasks=30)
    assert report.ok and report.expert_success_rate == 1.0
