"""A seeded encyclopedia of fictional entities, for offline multi-hop search tasks.

Every entity (country, mountain, lake, river, city, university, person, company, invention) gets an
invented name built from syllables, so no fact can come from a model's pre-training: the answer to
"Who founded Zorvani Industries?" is only on the generated page. Entities are linked by functional
relations (each entity has exactly one target per relation), e.g.::

    company --founder--> person --birthplace--> city --river--> river --source--> mountain --country--> country

and each page states its entity's relations in plain sentences, one fact per line, along with
distractor facts (years, numbers, a second city mentioned for another reason) so that reading the
right line matters.

Multi-hop questions follow a random walk of ``hops`` relations from a start entity; the answer is the
name of the entity at the end of the walk. All randomness comes from ``random.Random`` seeded with
ints or strings (deterministic across processes and platforms; ``hash()`` is never used).

Generation is pure Python and linear in the corpus size (100,000 documents take a few seconds).
"""

from __future__ import annotations

import hashlib
import random
import re
import zlib
from dataclasses import dataclass, field
from typing import Iterator

CORPUS_VERSION = 1  # bump when generation changes: the on-disk index cache is keyed on it

# --- entity types and relations ------------------------------------------------------------------

# Share of the corpus per entity type (sums to 1). Persons absorb the rounding remainder.
TYPE_SHARES: dict[str, float] = {
    "country": 0.01,
    "mountain": 0.05,
    "lake": 0.03,
    "river": 0.07,
    "city": 0.16,
    "university": 0.05,
    "person": 0.35,
    "company": 0.17,
    "invention": 0.11,
}
MIN_CORPUS_SIZE = 100


@dataclass(frozen=True)
class Relation:
    """A functional link ``source_type --name--> target_type`` and how questions phrase it.

    ``noun_phrase`` describes the target given the source (``{x}``), for nesting inside a longer
    question; ``question`` asks for the target directly (used for the outermost hop).
    """

    source_type: str
    name: str
    target_type: str
    noun_phrase: str
    question: str


RELATIONS: tuple[Relation, ...] = (
    Relation("person", "birthplace", "city", "the birthplace of {x}", "In which city was {x} born?"),
    Relation("person", "alma_mater", "university", "the university where {x} studied",
             "At which university did {x} study?"),
    Relation("person", "employer", "company", "the company that employed {x}",
             "Which company employed {x}?"),
    Relation("company", "founder", "person", "the founder of {x}", "Who founded {x}?"),
    Relation("company", "headquarters", "city", "the city where {x} is headquartered",
             "In which city is {x} headquartered?"),
    Relation("city", "country", "country", "the country in which {x} lies",
             "In which country does {x} lie?"),
    Relation("city", "river", "river", "the river that flows through {x}",
             "Which river flows through {x}?"),
    Relation("river", "source", "mountain", "the mountain where {x} has its source",
             "On which mountain does {x} have its source?"),
    Relation("river", "mouth", "lake", "the lake into which {x} flows", "Into which lake does {x} flow?"),
    Relation("mountain", "country", "country", "the country in which {x} stands",
             "In which country does {x} stand?"),
    Relation("lake", "country", "country", "the country in which {x} lies",
             "In which country does {x} lie?"),
    Relation("university", "city", "city", "the city where {x} is located",
             "In which city is {x} located?"),
    Relation("university", "founder", "person", "the founder of {x}", "Who founded {x}?"),
    Relation("invention", "inventor", "person", "the inventor of {x}", "Who invented {x}?"),
    Relation("invention", "manufacturer", "company", "the company that first manufactured {x}",
             "Which company first manufactured {x}?"),
    Relation("country", "capital", "city", "the capital of {x}", "What is the capital of {x}?"),
)
RELATIONS_BY_TYPE: dict[str, tuple[Relation, ...]] = {
    t: tuple(r for r in RELATIONS if r.source_type == t) for t in TYPE_SHARES
}

# --- invented names ------------------------------------------------------------------------------

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr",
           "tr", "th", "sh", "st", "gr", "vl", "j", "h", "y", "kh", "pr", "sk", "zh")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "i", "ai", "ei", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "m", "th", "x", "nd", "rk", "sh")

_COMPANY_SUFFIXES = ("Industries", "Works", "Holdings", "Group", "Labs", "Trading", "Foundries",
                     "Systems", "Company", "Manufacturing")
_UNIVERSITY_SUFFIXES = ("University", "Institute", "College", "Academy")
_INVENTION_KINDS = ("lamp", "loom", "engine", "press", "valve", "compass", "turbine", "telegraph",
                    "pump", "kiln", "lens", "clock", "sextant", "battery", "furnace", "winch")
_SECTORS = ("textile", "shipping", "mining", "glassmaking", "printing", "railway", "brewing",
            "optics", "chemicals", "timber", "shipbuilding", "instrument-making", "ceramics")
_PROFESSIONS = ("engineer", "chemist", "architect", "merchant", "physician", "cartographer",
                "astronomer", "economist", "inventor", "surveyor", "botanist", "mathematician")

_WORD_RE = re.compile(r"\w\w+")
# Every word the page templates use; invented names avoid them.
_TEMPLATE_WORDS = (
    "about average became birthplace born branch built campus capital cargo carries charter city "
    "climbed company country covering cubic decade depth device employed employs first flows "
    "founded founder freshwater graduated granted greatest grew handles headquartered headquarters "
    "high holds independent inhabitants invented kilometres lake largest later library lies located "
    "long manufactured metres million mount mountain mouth moved office opened patented people "
    "population port river second settled slopes source square stands students studied through "
    "tonnes town units university volumes water worked year"
)


@dataclass
class Entity:
    """One encyclopedia entry. ``relations`` maps a relation name to the target's doc id."""

    doc_id: str
    type: str
    name: str  # the gold answer string when this entity ends a question
    mention: str  # how it reads inside a sentence ("the Tavrin Lamp" vs "Tavrin Lamp")
    relations: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)  # the page body, one fact per line

    @property
    def title(self) -> str:
        return self.name

    @property
    def text(self) -> str:
        """The full page as ``open`` shows it (before truncation)."""
        return "\n".join([f"# {self.name}", *self.lines])


@dataclass
class Corpus:
    seed: int
    size: int
    entities: list[Entity]  # index i has doc id ``doc_ids[i]``
    by_id: dict[str, Entity]
    fingerprint: str  # sha256 over every page; the index cache checks it

    def __len__(self) -> int:
        return len(self.entities)

    def __iter__(self) -> Iterator[Entity]:
        return iter(self.entities)

    def get(self, doc_id: str) -> Entity | None:
        return self.by_id.get(doc_id)

    def is_test_entity(self, doc_id: str) -> bool:
        """Deterministic 80/20 train/test split of question start entities."""
        return zlib.crc32(f"{self.seed}:{doc_id}".encode()) % 5 == 0


class _NameMaker:
    """Unique capitalised words from syllables; no word is ever handed out twice, so every name
    token identifies exactly one entity (searching a name finds its page, not a namesake)."""

    def __init__(self, rng: random.Random, reserved: set[str]) -> None:
        self.rng = rng
        self.used: set[str] = set(reserved)

    def word(self) -> str:
        rng = self.rng
        while True:
            n_syllables = rng.choice((2, 2, 3))
            parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n_syllables)]
            parts.append(rng.choice(_CODAS))
            w = "".join(parts)
            if 4 <= len(w) <= 11 and w not in self.used:
                self.used.add(w)
                return w.capitalize()


def _type_counts(size: int) -> dict[str, int]:
    counts = {t: max(1, int(size * share)) for t, share in TYPE_SHARES.items()}
    counts["country"] = max(4, counts["country"])
    counts["person"] += size - sum(counts.values())
    return counts


def _reserved_words() -> set[str]:
    """Words of the page templates: no invented name may collide with them."""
    words = set()
    for seq in (_COMPANY_SUFFIXES, _UNIVERSITY_SUFFIXES, _INVENTION_KINDS, _SECTORS, _PROFESSIONS):
        words.update(w.lower() for w in seq)
    words.update(_TEMPLATE_WORDS.split())
    words.update(STOPWORDS)
    return words


def _doc_ids(rng: random.Random, size: int) -> Iterator[str]:
    """Doc ids in the order entities are created: a shuffled numbering, so an id says nothing about
    the entity's type."""
    numbers = list(range(size))
    rng.shuffle(numbers)
    width = max(6, len(str(size)))
    return iter(f"d{n:0{width}d}" for n in numbers)


def _name_and_mention(etype: str, names: _NameMaker, rng: random.Random) -> tuple[str, str]:
    """An invented name for a new entity of ``etype`` and how a sentence mentions it."""
    w = names.word()
    if etype == "person":
        name = f"{w} {names.word()}"
        return name, name
    if etype == "mountain":
        return f"Mount {w}", f"Mount {w}"
    if etype == "lake":
        return f"Lake {w}", f"Lake {w}"
    if etype == "river":
        return f"{w} River", f"the {w} River"
    if etype == "company":
        name = f"{w} {rng.choice(_COMPANY_SUFFIXES)}"
        return name, name
    if etype == "university":
        name = f"{w} {rng.choice(_UNIVERSITY_SUFFIXES)}"
        return name, name
    if etype == "invention":
        name = f"{w} {rng.choice(_INVENTION_KINDS).capitalize()}"
        return name, f"the {name}"
    return w, w  # country, city


def _named_entities(rng: random.Random, size: int) -> dict[str, list[Entity]]:
    """``size`` named, not yet linked entities, by type (in ``TYPE_SHARES`` order)."""
    names = _NameMaker(rng, _reserved_words())
    counts = _type_counts(size)
    ids = _doc_ids(rng, size)
    by_type: dict[str, list[Entity]] = {t: [] for t in TYPE_SHARES}
    for etype, count in counts.items():
        for _ in range(count):
            name, mention = _name_and_mention(etype, names, rng)
            by_type[etype].append(Entity(next(ids), etype, name, mention))
    return by_type


def _country_of_each_city(rng: random.Random, countries: list[Entity], cities: list[Entity]) -> dict[str, Entity]:
    """City doc id -> its country. Every country gets at least one city (the first, which becomes
    its capital); the other cities are spread at random."""
    return {city.doc_id: countries[i] if i < len(countries) else rng.choice(countries) for i, city in enumerate(cities)}


class _PageWriter:
    """Links each entity to its relation targets and writes its page, one fact per line.

    Every random draw comes from the corpus's ``rng``: the pages must be written in ``TYPE_SHARES``
    order, entity by entity, and each page's draws happen in the order its lines read.
    """

    def __init__(self, rng: random.Random, by_type: dict[str, list[Entity]], city_country: dict[str, Entity]) -> None:
        self.rng = rng
        self.by_type = by_type
        self.city_country = city_country
        self.cities_of: dict[str, list[Entity]] = {c.doc_id: [] for c in by_type["country"]}
        for city in by_type["city"]:
            self.cities_of[city_country[city.doc_id].doc_id].append(city)

    def write(self, entity: Entity) -> None:
        """Link ``entity`` and write its page (with the method named after its type, ``_<type>``)."""
        getattr(self, f"_{entity.type}")(entity)

    def pick(self, etype: str, avoid: Entity | None = None) -> Entity:
        """A random entity of ``etype``, other than ``avoid`` unless it is the only one."""
        pool = self.by_type[etype]
        while True:
            e = self.rng.choice(pool)
            if e is not avoid or len(pool) == 1:
                return e

    def year(self, lo: int = 1650, hi: int = 1990) -> int:
        return self.rng.randint(lo, hi)

    def _country(self, c: Entity) -> None:
        rng, year = self.rng, self.year
        capital = self.cities_of[c.doc_id][0]
        c.relations["capital"] = capital.doc_id
        c.lines = [
            f"{c.name} is a country with a population of about {rng.randint(1, 90)}.{rng.randint(0, 9)} million.",
            rng.choice((f"Its capital is {capital.mention}.", f"The capital city of {c.name} is {capital.mention}.")),
            f"{c.name} became independent in {year(1700, 1980)}.",
            f"Its largest port handles about {rng.randint(2, 80)} million tonnes of cargo a year.",
        ]

    def _mountain(self, m: Entity) -> None:
        rng, year = self.rng, self.year
        country = rng.choice(self.by_type["country"])
        m.relations["country"] = country.doc_id
        m.lines = [
            f"{m.name} is a mountain {rng.randint(900, 7900)} metres high.",
            rng.choice((f"It stands in {country.mention}.", f"{m.name} is located in {country.mention}.")),
            f"It was first climbed in {year(1780, 1970)}.",
        ]

    def _lake(self, lake: Entity) -> None:
        rng = self.rng
        country = rng.choice(self.by_type["country"])
        lake.relations["country"] = country.doc_id
        lake.lines = [
            f"{lake.name} is a freshwater lake covering {rng.randint(12, 4000)} square kilometres.",
            rng.choice((f"It lies in {country.mention}.", f"{lake.name} is located in {country.mention}.")),
            f"Its greatest depth is {rng.randint(8, 600)} metres.",
        ]

    def _river(self, river: Entity) -> None:
        rng, pick = self.rng, self.pick
        source, mouth = pick("mountain"), pick("lake")
        river.relations["source"] = source.doc_id
        river.relations["mouth"] = mouth.doc_id
        river.lines = [
            f"{river.mention[0].upper()}{river.mention[1:]} is a river {rng.randint(40, 3200)} kilometres long.",
            rng.choice((f"It has its source on {source.mention}.", f"Its source is on the slopes of {source.mention}.")),
            rng.choice((f"It flows into {mouth.mention}.", f"Its mouth is at {mouth.mention}.")),
            f"It carries on average {rng.randint(20, 9000)} cubic metres of water per second.",
        ]

    def _city(self, city: Entity) -> None:
        rng, year = self.rng, self.year
        country, river = self.city_country[city.doc_id], self.pick("river")
        city.relations["country"] = country.doc_id
        city.relations["river"] = river.doc_id
        city.lines = [
            rng.choice((f"{city.name} is a city in {country.mention}.", f"{city.name} is a city located in {country.mention}.")),
            f"It has about {rng.randint(12, 3500) * 1000} inhabitants.",
            rng.choice((f"{river.mention[0].upper()}{river.mention[1:]} flows through {city.name}.",
                        f"The city lies on {river.mention}.")),
            f"{city.name} was granted a town charter in {year(1100, 1900)}.",
        ]

    def _university(self, uni: Entity) -> None:
        rng, pick, year = self.rng, self.pick, self.year
        city, founder = pick("city"), pick("person")
        uni.relations["city"] = city.doc_id
        uni.relations["founder"] = founder.doc_id
        uni.lines = [
            f"{uni.name} is a university with about {rng.randint(2, 60) * 1000} students.",
            rng.choice((f"It is located in {city.mention}.", f"Its campus is in {city.mention}.")),
            rng.choice((f"It was founded by {founder.mention} in {year()}.", f"{founder.mention} founded it in {year()}.")),
            f"Its library holds {rng.randint(1, 90) * 10000} volumes.",
        ]

    def _person(self, person: Entity) -> None:
        rng, pick, year = self.rng, self.pick, self.year
        born = pick("city")
        moved = pick("city", avoid=born)
        uni, employer = pick("university"), pick("company")
        person.relations["birthplace"] = born.doc_id
        person.relations["alma_mater"] = uni.doc_id
        person.relations["employer"] = employer.doc_id
        y = year(1700, 1960)
        person.lines = [
            f"{person.name} ({y}-{y + rng.randint(40, 95)}) was a {rng.choice(_PROFESSIONS)}.",
            rng.choice((f"{person.name} was born in {born.mention}.", f"Born in {born.mention}, {person.name} grew up there.")),
            rng.choice((f"{person.name} studied at {uni.mention}.", f"{person.name} graduated from {uni.mention}.")),
            rng.choice((f"{person.name} later moved to {moved.mention}.", f"In {y + rng.randint(20, 35)} {person.name} settled in {moved.mention}.")),
            rng.choice((f"{person.name} worked for {employer.mention}.", f"{person.name} was employed by {employer.mention}.")),
        ]

    def _company(self, company: Entity) -> None:
        rng, pick, year = self.rng, self.pick, self.year
        founder, hq = pick("person"), pick("city")
        branch = pick("city", avoid=hq)
        company.relations["founder"] = founder.doc_id
        company.relations["headquarters"] = hq.doc_id
        company.lines = [
            f"{company.name} is a {rng.choice(_SECTORS)} company founded in {year()}.",
            rng.choice((f"It was founded by {founder.mention}.", f"Its founder was {founder.mention}.")),
            rng.choice((f"Its headquarters are in {hq.mention}.", f"{company.name} is headquartered in {hq.mention}.")),
            f"In {year(1850, 2000)} it opened a branch office in {branch.mention}.",
            f"It employs about {rng.randint(1, 400) * 50} people.",
        ]

    def _invention(self, inv: Entity) -> None:
        rng, pick, year = self.rng, self.pick, self.year
        inventor, maker = pick("person"), pick("company")
        inv.relations["inventor"] = inventor.doc_id
        inv.relations["manufacturer"] = maker.doc_id
        cap = f"{inv.mention[0].upper()}{inv.mention[1:]}"
        inv.lines = [
            f"{cap} is a device patented in {year(1750, 1990)}.",
            rng.choice((f"It was invented by {inventor.mention}.", f"{inventor.mention} invented it.")),
            rng.choice((f"{maker.mention} first manufactured it.", f"It was first manufactured by {maker.mention}.")),
            f"About {rng.randint(1, 900) * 100} units were built in the first decade.",
        ]


def _fingerprint(entities: list[Entity]) -> str:
    """sha256 over every page (doc id and text), in doc id order."""
    digest = hashlib.sha256()
    for e in entities:
        digest.update(e.doc_id.encode())
        digest.update(e.text.encode())
    return digest.hexdigest()


def generate_corpus(size: int = 2000, seed: int = 0) -> Corpus:
    """Generate ``size`` linked entity pages from ``seed`` (same inputs, same corpus, byte for byte)."""
    if not isinstance(size, int) or size < MIN_CORPUS_SIZE:
        raise ValueError(f"corpus_size must be an int >= {MIN_CORPUS_SIZE}, got {size!r}")
    # One stream for the whole corpus: the steps below must draw from it in this order.
    rng = random.Random(f"tracegym-corpus-v{CORPUS_VERSION}-{seed}")
    by_type = _named_entities(rng, size)
    city_country = _country_of_each_city(rng, by_type["country"], by_type["city"])
    pages = _PageWriter(rng, by_type, city_country)
    for etype in TYPE_SHARES:
        for entity in by_type[etype]:
            pages.write(entity)

    entities = sorted((e for etype in TYPE_SHARES for e in by_type[etype]), key=lambda e: e.doc_id)
    return Corpus(seed=seed, size=size, entities=entities, by_id={e.doc_id: e for e in entities},
                  fingerprint=_fingerprint(entities))


# --- tokenisation shared by the index and the queries --------------------------------------------

STOPWORDS = frozenset(
    "a an and are as at be by for from has have he her his in into is it its of on or that the their "
    "there they this to was were which who with what where when how does did do".split()
)


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens (2+ characters), stop words removed. Used for documents and queries."""
    return [t for t in _WORD_RE.findall(text.lower()) if t not in STOPWORDS]


def index_text(entity: Entity) -> str:
    """What BM25 indexes for a page: the title twice (titles weigh more, as in web search) + body."""
    return f"{entity.name}\n{entity.name}\n" + "\n".join(entity.lines)


# --- multi-hop questions -------------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    """A multi-hop question: ``chain[0]`` is named in the question, ``chain[-1]`` is the answer."""

    text: str
    answer: str
    chain: tuple[str, ...]  # doc ids, hops + 1 of them
    relations: tuple[str, ...]  # relation names, one per hop


def compose_question(corpus: Corpus, chain: list[str], relations: list[Relation]) -> str:
    """Nest the relations' noun phrases around the start entity; the last hop asks the question."""
    phrase = corpus.by_id[chain[0]].mention
    for rel in relations[:-1]:
        phrase = rel.noun_phrase.format(x=phrase)
    text = relations[-1].question.format(x=phrase)
    return text[0].upper() + text[1:]


def random_walk(corpus: Corpus, start: str, hops: int, rng: random.Random) -> Question | None:
    """Follow ``hops`` random relations from ``start`` without revisiting an entity (a revisit would
    make the question trivial, e.g. "the founder of the company founded by X"). None on a dead end."""
    chain, rels = [start], []
    for _ in range(hops):
        here = corpus.by_id[chain[-1]]
        options = [r for r in RELATIONS_BY_TYPE[here.type] if here.relations[r.name] not in chain]
        if not options:
            return None
        rel = rng.choice(options)
        chain.append(here.relations[rel.name])
        rels.append(rel)
    return Question(
        text=compose_question(corpus, chain, rels),
        answer=corpus.by_id[chain[-1]].name,
        chain=tuple(chain),
        relations=tuple(r.name for r in rels),
    )
