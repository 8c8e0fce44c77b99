"""Deterministic English sentences for the synthetic speech corpus, with numbers spelled out.

A text-to-speech engine (eSpeak NG) reads these sentences aloud and the sentences themselves become the ASR
targets, so every sentence is already in transcript form: lowercase letters ``a``-``z``, apostrophes inside words
(``don't``, ``sarah's``) and single spaces. Numbers never appear as digits; they are written the way they are
spoken:

- Cardinals use the British convention with "and" after "hundred" and before a final part below one hundred:
  ``105`` is "one hundred and five", ``2024`` is "two thousand and twenty four", ``1_000_005`` is
  "one million and five". Compound tens have no hyphen ("twenty three").
- Years are read in pairs ("nineteen eighty four", "twenty twenty four"; "two thousand and five" for
  2001..2009), phone numbers and codes digit by digit with "zero" for ``0``.

:class:`SentenceGenerator` builds sentences from about a hundred patterns (statements, questions, imperatives,
weather reports, times and dates, prices and counts, compound sentences and subordinate clauses) over a built-in
vocabulary of a few thousand words. Verbs carry all their forms explicitly (``take takes took taken taking``),
and so do irregular plurals, so no guessed inflection ends up in a transcript. The generator depends only on
:class:`random.Random` with an integer seed, never on Python's string hashing, so a seed gives the same
sentences in every process.

:func:`split_of` assigns a sentence to a split by a stable hash of its normalized text: the same sentence always
lands in the same split, which keeps the sentences of ``train``, ``dev`` and ``test`` disjoint.
"""

import functools
import hashlib
import math
import random
import re
import unicodedata
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = [
    "MAX_WORDS",
    "MIN_WORDS",
    "TEMPLATES",
    "SentenceGenerator",
    "normalize_transcript",
    "spell_digits",
    "spell_number",
    "spell_ordinal",
    "spell_year",
    "split_of",
]

MIN_WORDS = 4
MAX_WORDS = 20
MAX_NUMBER = 999_999_999

# ----------------------------------------------------------------------------------------------------------------
# Numbers
# ----------------------------------------------------------------------------------------------------------------

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((1_000_000, "million"), (1_000, "thousand"))
_ORDINAL_WORDS = {
    "zero": "zeroth",
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}


def _below_hundred(n: int) -> str:
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] if ones == 0 else f"{_TENS[tens]} {_ONES[ones]}"


def _below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    if hundreds == 0:
        return _below_hundred(rest)
    if rest == 0:
        return f"{_ONES[hundreds]} hundred"
    return f"{_ONES[hundreds]} hundred and {_below_hundred(rest)}"


def _check_int(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"expected an int, got {type(n).__name__}")
    return n


def spell_number(n: int) -> str:
    """English words for ``n`` in British style: "and" after "hundred" and before a final part below 100.

    Args:
        n: An integer in ``0 .. 999_999_999``.

    Returns:
        The number in words, e.g. ``"twenty three"``, ``"one hundred and five"``, ``"two thousand and twenty
        four"``, ``"one million"``. Words are separated by single spaces; there are no hyphens or commas.

    Raises:
        TypeError: If ``n`` is not an int (``bool`` is rejected too).
        ValueError: If ``n`` is outside ``0 .. 999_999_999``.
    """
    n = _check_int(n)
    if not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"spell_number supports 0..{MAX_NUMBER:,}, got {n}")
    if n < 1000:
        return _below_thousand(n)
    parts = []
    rest = n
    for value, name in _SCALES:
        group, rest = divmod(rest, value)
        if group:
            parts.append(f"{_below_thousand(group)} {name}")
    if rest:
        parts.append(f"and {_below_hundred(rest)}" if rest < 100 else _below_thousand(rest))
    return " ".join(parts)


def spell_ordinal(n: int) -> str:
    """English ordinal words for ``n`` (``0 .. 999_999_999``), e.g. ``"third"``, ``"twenty first"``.

    Raises:
        TypeError: If ``n`` is not an int.
        ValueError: If ``n`` is outside ``0 .. 999_999_999``.
    """
    words = spell_number(n).split(" ")
    last = words[-1]
    if last in _ORDINAL_WORDS:
        words[-1] = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        words[-1] = last[:-1] + "ieth"
    else:
        words[-1] = last + "th"
    return " ".join(words)


def spell_year(year: int) -> str:
    """A year the way it is usually said: ``1984`` "nineteen eighty four", ``1905`` "nineteen oh five".

    ``1900`` is "nineteen hundred", ``2000`` "two thousand", ``2001 .. 2009`` "two thousand and five" and from
    ``2010`` on "twenty ten", "twenty twenty four", ``1066`` "ten sixty six". Other years (before ``1010``, after
    ``2099``) fall back to :func:`spell_number`.

    Raises:
        TypeError: If ``year`` is not an int.
        ValueError: If ``year`` is outside ``0 .. 999_999_999``.
    """
    year = _check_int(year)
    if not (1010 <= year <= 1999 or 2010 <= year <= 2099):
        return spell_number(year)
    high, low = divmod(year, 100)
    if low == 0:
        return f"{_below_hundred(high)} hundred"
    if low < 10:
        return f"{_below_hundred(high)} oh {_ONES[low]}"
    return f"{_below_hundred(high)} {_below_hundred(low)}"


def spell_digits(digits: str) -> str:
    """Digits read one by one, ``"0712"`` -> ``"zero seven one two"``.

    Raises:
        ValueError: If ``digits`` is empty or holds anything but ASCII digits.
    """
    if not digits or not digits.isascii() or not digits.isdigit():
        raise ValueError(f"expected a non-empty string of digits, got {digits!r}")
    return " ".join(_ONES[ord(c) - 48] for c in digits)


# ----------------------------------------------------------------------------------------------------------------
# Normalization
# ----------------------------------------------------------------------------------------------------------------

_FOLD = str.maketrans(
    {"ß": "ss", "æ": "ae", "œ": "oe", "ø": "o", "ł": "l", "đ": "d", "ð": "d", "þ": "th", "ı": "i", "’": "'"}
)
_FOLD.update(str.maketrans({"‘": "'", "ʼ": "'", "`": "'", "´": "'", "%": " percent ", "&": " and "}))
_THOUSANDS_RE = re.compile(r"(?<![0-9.,])[0-9]{1,3}(?:,[0-9]{3})+(?![0-9]|,[0-9])", re.ASCII)
_ORDINAL_RE = re.compile(r"([0-9]+)(st|nd|rd|th)\b", re.ASCII)
_DECIMAL_RE = re.compile(r"([0-9]+)\.([0-9]+)", re.ASCII)
_DIGITS_RE = re.compile(r"[0-9]+", re.ASCII)
_NOT_ALLOWED_RE = re.compile(r"[^a-z']+")
_LOOSE_APOSTROPHE_RE = re.compile(r"(?<![a-z])'+|'+(?![a-z])")
_SPACES_RE = re.compile(r" {2,}")


def _spell_run(digits: str) -> str:
    """A run of digits as words: a number, or digit by digit when it has a leading zero or is too large."""
    if (len(digits) > 1 and digits[0] == "0") or len(digits) > 9:
        return spell_digits(digits)
    return spell_number(int(digits))


def _ordinal_sub(match: re.Match) -> str:
    digits = match.group(1)
    if len(digits) > 9 or (len(digits) > 1 and digits[0] == "0"):
        return f" {spell_digits(digits)} {match.group(2)} "
    return f" {spell_ordinal(int(digits))} "


def _decimal_sub(match: re.Match) -> str:
    return f" {_spell_run(match.group(1))} point {spell_digits(match.group(2))} "


def normalize_transcript(text: str) -> str:
    """The transcript form of ``text``: lowercase ``a``-``z``, apostrophes inside words and single spaces.

    Steps: accents are removed (``café`` -> ``cafe``); the text is lowercased; numbers are spelled out
    (``2024`` -> "two thousand and twenty four", thousands separators ``1,500`` and ordinals ``3rd`` ->
    "third" are understood, decimals ``2.5`` -> "two point five", runs with a leading zero or more than nine
    digits are read digit by digit, ``%`` -> "percent", ``&`` -> "and"); hyphens and every other character
    outside ``a``-``z`` and the apostrophe become spaces; apostrophes that are not between two letters (quote
    marks) are dropped; runs of spaces collapse to one and the ends are stripped.

    The sentences of :class:`SentenceGenerator` are already normalized: this function returns them unchanged.

    Args:
        text: Any text.

    Returns:
        The normalized transcript (possibly empty).
    """
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower().translate(_FOLD)
    if any(c.isdigit() for c in text):
        text = _THOUSANDS_RE.sub(lambda m: m.group(0).replace(",", ""), text)
        text = _ORDINAL_RE.sub(_ordinal_sub, text)
        text = _DECIMAL_RE.sub(_decimal_sub, text)
        text = _DIGITS_RE.sub(lambda m: f" {_spell_run(m.group(0))} ", text)
    text = _NOT_ALLOWED_RE.sub(" ", text)
    text = _LOOSE_APOSTROPHE_RE.sub(" ", text)
    return _SPACES_RE.sub(" ", text).strip()


# ----------------------------------------------------------------------------------------------------------------
# Splits
# ----------------------------------------------------------------------------------------------------------------


def split_of(sentence: str, fractions: Mapping[str, float], seed: int = 0) -> str:
    """The split a sentence belongs to, chosen by a stable hash of its normalized text.

    The hash (BLAKE2b of the seed and :func:`normalize_transcript` of the sentence) maps the sentence to a number
    in ``[0, 1)``; the splits take consecutive intervals of that range in the order of ``fractions``, each as
    wide as its fraction of the total. The same sentence (and every spelling that normalizes to it) therefore
    always lands in the same split, in any process and on any machine, which keeps the splits' sentences
    disjoint.

    Args:
        sentence: The sentence (normalized or not).
        fractions: Split name -> relative size, e.g. ``{"train": 0.9, "dev": 0.05, "test": 0.05}``. The sizes
            need not sum to one (they are divided by their total); a split of size zero gets no sentences.
        seed: Changes the assignment as a whole (each seed is a different, equally stable partition).

    Returns:
        The name of the split.

    Raises:
        ValueError: If ``fractions`` is empty, holds a negative or non-finite size, or sums to zero.
    """
    if not fractions:
        raise ValueError("fractions must name at least one split")
    total = 0.0
    for name, fraction in fractions.items():
        if not math.isfinite(fraction) or fraction < 0:
            raise ValueError(f"fraction of split {name!r} must be finite and >= 0, got {fraction}")
        total += fraction
    if total <= 0:
        raise ValueError("fractions must sum to more than zero")
    key = f"{seed}\x00{normalize_transcript(sentence)}".encode()
    point = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2.0**64 * total
    cumulative = 0.0
    chosen = ""
    for name, fraction in fractions.items():
        if fraction <= 0:
            continue
        chosen = name
        cumulative += fraction
        if point < cumulative:
            break
    return chosen


# ----------------------------------------------------------------------------------------------------------------
# Vocabulary tables (their text in sentence_tables.txt beside this file)
# ----------------------------------------------------------------------------------------------------------------
# Lists are comma separated. Nouns are "singular" (plural = singular + "s") or "singular/plural". Verbs are
# "base/third person/past/past participle/ing"; an ing form of "-" marks a stative verb that is not used in the
# progressive ("is knowing"). Activities are "verb forms: complement | complement | ...;" where a complement may
# hold {slots} (see SentenceGenerator).

_ENTRY_RE = re.compile(r"[a-z']+(?: [a-z']+)*")
_SECTION_RE = re.compile(r"^\[(\w+)\]$", re.M)


def _read_tables(path: Path) -> dict[str, str]:
    """The ``[NAME]`` sections of ``path`` as name -> text (``#`` lines before the first section are comments)."""
    parts = _SECTION_RE.split(path.read_text(encoding="utf-8"))
    return {name: text.strip() for name, text in zip(parts[1::2], parts[2::2], strict=True)}


_TABLES = _read_tables(Path(__file__).with_name("sentence_tables.txt"))


def _clean(item: str) -> str:
    item = " ".join(item.split())
    if not _ENTRY_RE.fullmatch(item):
        raise ValueError(f"bad vocabulary entry {item!r}")
    return item


def _words(text: str) -> tuple[str, ...]:
    items = (_clean(raw) for raw in text.split(",") if raw.strip())
    return tuple(dict.fromkeys(items))


def _nouns(text: str) -> tuple[tuple[str, str], ...]:
    out: dict[str, str] = {}
    for raw in text.split(","):
        if not raw.strip():
            continue
        forms = [_clean(f) for f in raw.split("/")]
        if len(forms) > 2:
            raise ValueError(f"bad noun entry {raw!r}")
        out[forms[0]] = forms[1] if len(forms) == 2 else forms[0] + "s"
    return tuple(out.items())


def _verb(raw: str) -> tuple[str, str, str, str, str]:
    forms = raw.split("/")
    if len(forms) != 5:
        raise ValueError(f"verb entry needs 5 forms (base/s/past/pp/ing): {raw!r}")
    base, third, past, participle, ing = (f.strip() for f in forms)
    return (_clean(base), _clean(third), _clean(past), _clean(participle), "" if ing == "-" else _clean(ing))


def _verbs(text: str) -> tuple[tuple[str, str, str, str, str], ...]:
    return tuple({v[0]: v for v in (_verb(raw) for raw in text.split(",") if raw.strip())}.values())


def _activities(text: str) -> tuple[tuple[tuple[str, str, str, str, str], tuple[str, ...]], ...]:
    out = []
    for raw in text.split(";"):
        if not raw.strip():
            continue
        head, _, tail = raw.partition(":")
        complements = tuple(" ".join(c.split()) for c in tail.split("|"))
        if not all(complements):
            raise ValueError(f"empty complement in activity {raw!r}")
        out.append((_verb(head), complements))
    return tuple(out)


FIRST_NAMES = _words(_TABLES["FIRST_NAMES"])

SURNAMES = _words(_TABLES["SURNAMES"])

TITLES = _words(_TABLES["TITLES"])

RELATIVES = _words(_TABLES["RELATIVES"])

RELATIVES_PLURAL = _words(_TABLES["RELATIVES_PLURAL"])

PROFESSIONS = _nouns(_TABLES["PROFESSIONS"])

ANIMALS = _nouns(_TABLES["ANIMALS"])

ANIMAL_ADJECTIVES = _words(_TABLES["ANIMAL_ADJECTIVES"])

OBJECTS = _nouns(_TABLES["OBJECTS"])

OBJECT_ADJECTIVES = _words(_TABLES["OBJECT_ADJECTIVES"])

THING_QUALITIES = _words(_TABLES["THING_QUALITIES"])

COLOURS = _words(_TABLES["COLOURS"])

CLOTHING = _words(_TABLES["CLOTHING"])

FOODS = _nouns(_TABLES["FOODS"])

MASS_FOODS = _words(_TABLES["MASS_FOODS"])

FOOD_ADJECTIVES = _words(_TABLES["FOOD_ADJECTIVES"])

FOOD_CONTAINERS = _words(_TABLES["FOOD_CONTAINERS"])

DRINKS = _words(_TABLES["DRINKS"])

DRINK_CONTAINERS = _words("a cup of, a glass of, a bottle of, a mug of, a jug of, some, the, more")

PLACES = _nouns(_TABLES["PLACES"])

PLACE_ADJECTIVES = _words(_TABLES["PLACE_ADJECTIVES"])

FURNITURE_SURFACES = _words(_TABLES["FURNITURE_SURFACES"])

CONTAINER_PLACES = _words(_TABLES["CONTAINER_PLACES"])

NEAR_PLACES = _words(_TABLES["NEAR_PLACES"])

ANIMAL_PLACES = _words(_TABLES["ANIMAL_PLACES"])

ANIMAL_VERBS_PAST = _words(_TABLES["ANIMAL_VERBS_PAST"])

# Countries with their capital (empty where the answer is contested or surprising) and more of their cities.


def _countries(text: str) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    out = []
    for raw in text.split(";"):
        country, capital, cities = (part.strip() for part in raw.split("|"))
        others = _words(cities) if cities else ()
        capital = _clean(capital) if capital else ""
        out.append((_clean(country), capital, ((capital,) if capital else ()) + others))
    return tuple(out)


COUNTRIES_WITH_CITIES = _countries(_TABLES["COUNTRIES"])

OTHER_COUNTRIES = _words(_TABLES["OTHER_COUNTRIES"])

LANGUAGES = _words(_TABLES["LANGUAGES"])

SCHOOL_SUBJECTS = _words(_TABLES["SCHOOL_SUBJECTS"])

SPORTS = _words(_TABLES["SPORTS"])

INSTRUMENTS = _words(_TABLES["INSTRUMENTS"])

TOPICS = _words(_TABLES["TOPICS"])

EVENTS = _words(_TABLES["EVENTS"])

PERSON_ADJECTIVES = _words(_TABLES["PERSON_ADJECTIVES"])

MANNER_ADVERBS = _words(_TABLES["MANNER_ADVERBS"])

FREQUENCY_ADVERBS = _words(_TABLES["FREQUENCY_ADVERBS"])

DAYS = _words("monday, tuesday, wednesday, thursday, friday, saturday, sunday")
MONTHS = _words(_TABLES["MONTHS"])
SEASONS = _words("spring, summer, autumn, winter")
PARTS_OF_DAY = _words("morning, afternoon, evening, night")

WEATHER_TEMPERATURES = _words(_TABLES["WEATHER_TEMPERATURES"])

WEATHER_SKIES = _words(_TABLES["WEATHER_SKIES"])

WEATHER_ADJECTIVES = WEATHER_TEMPERATURES + WEATHER_SKIES + _words("miserable, lovely, glorious, horrible")

WEATHER_NOUNS = _words(_TABLES["WEATHER_NOUNS"])

WEATHER_VERBS = _verbs(_TABLES["WEATHER_VERBS"])

REGIONS = _words(_TABLES["REGIONS"])

TOO_REASONS = _words(_TABLES["TOO_REASONS"])

SAID = _words(_TABLES["SAID"])

THINKS = _words(_TABLES["THINKS"])

GENERAL_ADVERBS = _words(_TABLES["GENERAL_ADVERBS"])

OPINIONS = _words(_TABLES["OPINIONS"])

OCCASIONS = _words(_TABLES["OCCASIONS"])

# Verbs whose object is a thing, food, drink, person, animal, place or destination.
THING_VERBS = _verbs(_TABLES["THING_VERBS"])

FOOD_VERBS = _verbs(_TABLES["FOOD_VERBS"])

DRINK_VERBS = _verbs(_TABLES["DRINK_VERBS"])

PERSON_VERBS = _verbs(_TABLES["PERSON_VERBS"])

ANIMAL_VERBS = _verbs(_TABLES["ANIMAL_VERBS"])

PLACE_VERBS = _verbs(_TABLES["PLACE_VERBS"])

TRAVEL_VERBS = _verbs(_TABLES["TRAVEL_VERBS"])

INTRANSITIVE_VERBS = _verbs(_TABLES["INTRANSITIVE_VERBS"])

ACTIVITIES = _activities(_TABLES["ACTIVITIES"])

_POSSESSIVES = ("my", "your", "his", "her", "our", "their")
_OBJECT_PRONOUNS = ("him", "her", "them")
_OWN_PARTNERS = ("wife", "husband", "girlfriend", "boyfriend", "partner")
_CLOCK_MINUTES = ((5, "five"), (10, "ten"), (20, "twenty"), (25, "twenty five"))
_CURRENCIES = (("pound", "pounds", "pence"), ("dollar", "dollars", "cents"), ("euro", "euros", "cents"))

# ----------------------------------------------------------------------------------------------------------------
# Sentence patterns
# ----------------------------------------------------------------------------------------------------------------
# (weight, pattern). A {slot} is filled by SentenceGenerator._slots[slot]; the rest is literal text.

_WEIGHTED_TEMPLATES: tuple[tuple[int, str], ...] = (
    # Clauses in many tenses, with a time expression.
    (6, "{clause_past}"),
    (4, "{clause_present}"),
    (3, "{clause_prog}"),
    (4, "{clause_future}"),
    (3, "{clause_perfect}"),
    (3, "{clause_modal}"),
    (2, "{subj_s} {vp_past} {general_adverb} {when_past}"),
    (1, "in {year} {clause_past_bare}"),
    (1, "on {date} {clause_past_bare}"),
    # People and places.
    (1, "{name} was born in {city_country} in {year}"),
    (1, "{subj_s} moved to {city} in {month} {year}"),
    (1, "{subj_s} has lived in {city} since {year}"),
    (1, "{subj_p} have lived in {city} for {count} years"),
    (1, "{name} works as {a_profession} in {city}"),
    (1, "{name}'s {relative} is {a_profession} at the {place_noun} in {city}"),
    (1, "my {relative} wants to become {a_profession}"),
    (1, "{subj_s} speaks {language} and a little {language}"),
    (1, "{name} is learning {language} before moving to {country}"),
    (1, "{subj_p} study {subject} at the university in {city}"),
    (1, "{name} plays {sport} every {day} after work"),
    (1, "{name} has been playing {instrument} for {count} years"),
    (1, "{capital_of}"),
    (1, "{city_is}"),
    (2, "the {animal_adj} {animal} {animal_did} {animal_place}"),
    (1, "{subj_s} spent {count} days in {city} last {season}"),
    (1, "{name} gave {a_thing} to {person} for {occasion}"),
    # Things and where they are.
    (1, "there is {a_thing} {loc}"),
    (1, "there are {count} {things} {loc}"),
    (1, "the {thing_noun} {loc} belongs to {name}"),
    (1, "the {colour} {thing_noun} is {loc}"),
    (1, "i can't find {poss} {things} anywhere"),
    (1, "the {place_noun} near our house is {place_adj}"),
    (1, "the {place_noun} in {city} was built in {historic_year}"),
    (1, "my favourite colour is {colour}"),
    (1, "we need {count} more {things} for the {event}"),
    # Times, dates and schedules.
    (1, "the {event} starts at {clock}"),
    (1, "the {event} has been moved to {day} at {clock}"),
    (1, "the train to {city} leaves from platform {small} at {clock}"),
    (1, "the flight {from_to} takes about {hours}"),
    (1, "the bus to the {place_noun} comes every {minutes}"),
    (1, "the {place_noun} closes at {clock} on {days}"),
    (1, "my birthday is on the {ordinal} of {month}"),
    (1, "{name}'s wedding is on {date}"),
    (1, "it is {clock} in {city} right now"),
    (1, "we left {city} at {clock} and arrived in {city} at {clock}"),
    # Quantities, prices and digit strings.
    (1, "this {thing_noun} costs {price}"),
    (1, "{subj_s} paid {price} for {a_thing}"),
    (1, "a kilo of {kilo_food} costs {small_price} at the market"),
    (1, "the tickets for the {event} cost {price} each"),
    (1, "my phone number is {phone}"),
    (1, "you can reach me on {phone}"),
    (1, "to book a table please call {phone}"),
    (1, "the code for the {code_lock} is {code}"),
    (1, "{name} is staying in room {room}"),
    (1, "the population of {city} is about {big}"),
    (1, "about {percent} percent of the {professions} agreed with the new plan"),
    (1, "the home team won by {score}"),
    (1, "the temperature in {city} is {temp} today"),
    # Weather.
    (1, "it will be {weather_adj} in {city} {when_future}"),
    (1, "it is {weather_temp} and {weather_sky} in {city} today"),
    (1, "expect {weather_noun} {region} {when_future}"),
    (1, "there will be {weather_noun} {region} {later}"),
    (1, "it {weather_past} all day in {city} {when_past}"),
    (1, "the forecast says it will {weather_base} on {day}"),
    (1, "{subj_s} wanted to {vp_base} but it was too {too_reason}"),
    # Questions.
    (2, "did {subj} {vp_base} {when_past}"),
    (1, "does {subj_s} {vp_base} {freq}"),
    (1, "do {subj_p} {vp_base} {freq}"),
    (1, "where did {subj} {vp_base}"),
    (1, "why did {subj} {vp_base} {when_past}"),
    (1, "when will {subj} {vp_base}"),
    (1, "have you ever {vp_pp}"),
    (1, "has {subj_s} ever {vp_pp}"),
    (1, "how many {things} did {subj} {count_verb}"),
    (1, "how many {things} are there {loc}"),
    (1, "how much does {a_thing} cost in {city}"),
    (1, "can you {vp_base} {when_future}"),
    (1, "could you please {vp_base} before {clock}"),
    (1, "why is {subj_s} {vp_ing} {when_now}"),
    (1, "who {vp_past} {when_past}"),
    (1, "what is the capital of {country}"),
    (1, "is it going to {weather_base} in {city} {when_future}"),
    (1, "would you like {food} or {food}"),
    (1, "what time does the {place_noun} open on {days}"),
    (1, "are you coming to the {event} on {day}"),
    (1, "what do you think about {topic}"),
    (1, "how long does it take to get {from_to}"),
    (1, "do you know where {subj} {vp_past}"),
    # Imperatives.
    (2, "please {vp_base} {when_future}"),
    (1, "don't forget to {vp_base} {when_future}"),
    (1, "{vp_base} and then {vp_base}"),
    (1, "turn {side} at the {place_noun} and walk for {minutes}"),
    (1, "put the {thing_noun} {loc}"),
    (1, "let's {vp_base} {when_future}"),
    (1, "try not to {vp_base} {when_future}"),
    (1, "remember to {vp_base} before you leave"),
    (1, "take the {ordinal_small} turning on the {side} after the {place_noun}"),
    (1, "never {vp_base} without asking {person} first"),
    # Compound sentences.
    (2, "{clause_past_bare} and {clause_past}"),
    (2, "{clause_past_bare} but {clause_past_bare}"),
    (1, "{clause_past} so {clause_past_bare}"),
    (1, "{clause_present_bare} but {clause_present_bare}"),
    (1, "i {opinion} {foods} but my {relative} prefers {foods}"),
    # Subordinate clauses.
    (2, "when {clause_past_bare} {clause_past_bare}"),
    (2, "{clause_past} because {clause_past_bare}"),
    (1, "{clause_past_bare} after {clause_past_bare}"),
    (1, "before {clause_past_bare} {clause_past_bare}"),
    (2, "{subj} {said} that {clause_past}"),
    (1, "{subj_s} {thinks} that {clause_future}"),
    (1, "if it {weather_s} {when_future} {clause_future_bare}"),
    (1, "although {clause_past_bare} {clause_past_bare}"),
    (1, "{clause_future_bare} as soon as {clause_present_bare}"),
    (1, "the {profession} who {vp_past} {when_past} is from {city}"),
    (1, "the {thing_noun} that {subj} bought in {city} was really {thing_quality}"),
    (1, "while {clause_past_prog} {clause_past_bare}"),
    (1, "unless {clause_present_bare} {clause_future_bare}"),
    (1, "i don't know why {clause_past}"),
    (1, "i wonder whether {clause_future}"),
    (1, "do you know if {clause_future}"),
)

TEMPLATES: tuple[str, ...] = tuple(pattern for _, pattern in _WEIGHTED_TEMPLATES)
"""The sentence patterns, ``{slot}`` marking the parts the generator fills in."""

_SLOT_RE = re.compile(r"\{(\w+)\}")
_Part = str | Callable[[], str]

_AN_EXCEPTIONS = ("hour", "honest", "honour", "heir")
_A_EXCEPTIONS = ("uni", "use", "usu", "uti", "eu", "ewe", "one ", "once", "ukr", "ura", "uga", "uro")


def _with_article(phrase: str) -> str:
    """``phrase`` with "a" or "an" by its first sound (a uniform, an hour, an umbrella)."""
    if phrase.startswith(_AN_EXCEPTIONS):
        return "an " + phrase
    if phrase.startswith(_A_EXCEPTIONS) and not phrase.startswith(("unin", "unim")):
        return "a " + phrase
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _glue(part: _Part, suffix: str) -> str:
    return (part if part.__class__ is str else part()) + suffix  # type: ignore[operator]


def _render(parts: tuple[_Part, ...]) -> str:
    out = []
    for part in parts:
        text = part if part.__class__ is str else part()  # type: ignore[operator]
        if text:
            out.append(text)
    return " ".join(out)


# Indices of the verb forms.
_BASE, _S, _PAST, _PP, _ING = range(5)


class SentenceGenerator:
    """Deterministic, natural English sentences for a synthetic speech corpus.

    Each sentence has 4 to 20 words and is already a normalized transcript (see :func:`normalize_transcript`):
    lowercase ``a``-``z``, apostrophes inside words, single spaces, numbers spelled out. Sentences come from the
    patterns in :data:`TEMPLATES` over the built-in vocabulary.

    The output depends only on ``seed`` (through :class:`random.Random`), never on Python's hash seed or on the
    machine. :meth:`sentences` never repeats a sentence over the life of the generator, so for a fresh generator
    ``sentences(a) + sentences(b) == sentences(a + b)``.

    Args:
        seed: Seed of the generator's random stream.

    Example:
        >>> gen = SentenceGenerator(seed=1)
        >>> batch = gen.sentences(3)
        >>> len(set(batch))
        3
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)
        self._random = self._rng.random
        self._choice = self._rng.choice
        self._randint = self._rng.randint
        self._seen: set[str] = set()
        self._slots = self._make_slots()
        self._verb_phrases = self._make_verb_phrases()
        self._templates = [self._compile(pattern) for pattern in TEMPLATES]
        weights = [weight for weight, _ in _WEIGHTED_TEMPLATES]
        self._cum_weights = [sum(weights[: i + 1]) for i in range(len(weights))]

    # -- public API ----------------------------------------------------------------------------------------------

    def sentence(self) -> str:
        """One sentence (it may repeat an earlier one; :meth:`sentences` never does)."""
        choices = self._rng.choices
        while True:
            parts = choices(self._templates, cum_weights=self._cum_weights)[0]
            text = _render(parts)
            words = text.count(" ") + 1
            if MIN_WORDS <= words <= MAX_WORDS:
                return text

    def sentences(self, n: int) -> list[str]:
        """``n`` sentences, none of them returned by this generator's :meth:`sentences` before.

        Args:
            n: How many sentences (``>= 0``).

        Returns:
            The sentences, in generation order.

        Raises:
            ValueError: If ``n`` is negative.
            RuntimeError: If the generator keeps producing only known sentences (not expected in practice: the
                space of sentences is astronomically larger than any corpus).
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out: list[str] = []
        seen = self._seen
        misses = 0
        while len(out) < n:
            text = self.sentence()
            if text in seen:
                misses += 1
                if misses > 100_000:
                    raise RuntimeError("the sentence generator ran out of new sentences")
                continue
            misses = 0
            seen.add(text)
            out.append(text)
        return out

    # -- construction ----------------------------------------------------------------------------------------

    def _compile(self, pattern: str) -> tuple[_Part, ...]:
        pieces = _SLOT_RE.split(pattern)
        parts: list[_Part] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                if piece not in self._slots:
                    raise KeyError(f"unknown slot {{{piece}}} in pattern {pattern!r}")
                parts.append(self._slots[piece])
                continue
            if parts and piece and not piece[0].isspace():
                # Text glued to the slot before it, as in "{name}'s": append it to that slot's words.
                glued, _, piece = piece.partition(" ")
                parts.append(functools.partial(_glue, parts.pop(), glued))
            if piece.strip():
                parts.append(" ".join(piece.split()))
        return tuple(parts)

    def _make_verb_phrases(self) -> list[list[tuple[tuple[str, ...], tuple[tuple[_Part, ...], ...]]]]:
        """Per verb form: (forms, complements) for every verb usable in that form."""
        groups: list[tuple[tuple[tuple[str, str, str, str, str], ...], tuple[str, ...]]] = [
            (THING_VERBS, ("{thing}",)),
            (FOOD_VERBS, ("{food}",)),
            (DRINK_VERBS, ("{drink_np}",)),
            (PERSON_VERBS, ("{person}",)),
            (ANIMAL_VERBS, ("{animal_np}",)),
            (PLACE_VERBS, ("{place}",)),
            (TRAVEL_VERBS, ("{destination}",)),
        ]
        entries = [(forms, complements) for verbs, complements in groups for forms in verbs]
        # Single-word intransitive verbs take an optional manner adverb ("waited patiently"); phrasal ones
        # ("work late", "stay at home") stand alone.
        entries.extend(
            (forms, ("",) if " " in forms[0] else ("", "{adverb}", "{adverb}")) for forms in INTRANSITIVE_VERBS
        )
        entries.extend(ACTIVITIES)
        compiled = [
            (forms, tuple(self._compile(c) if c else () for c in complements)) for forms, complements in entries
        ]
        return [[(forms, comps) for forms, comps in compiled if forms[f]] for f in range(5)]

    def _make_slots(self) -> dict[str, Callable[[], str]]:
        c = self._choice
        clause = self._clause
        slots: dict[str, Callable[[], str]] = {
            # people
            "name": lambda: c(FIRST_NAMES),
            "full_name": self._full_name,
            "person": self._person,
            "subj": self._any_subject,
            "subj_s": self._subject_singular,
            "subj_p": self._subject_plural,
            "relative": lambda: c(RELATIVES),
            "profession": lambda: c(PROFESSIONS)[0],
            "professions": lambda: c(PROFESSIONS)[1],
            "a_profession": lambda: _with_article(c(PROFESSIONS)[0]),
            "poss": lambda: c(_POSSESSIVES),
            # things, food, animals, places
            "thing": self._thing,
            "a_thing": self._a_thing,
            "thing_noun": lambda: c(OBJECTS)[0],
            "things": lambda: c(OBJECTS)[1],
            "obj_adj": lambda: c(OBJECT_ADJECTIVES),
            "colour": lambda: c(COLOURS),
            "clothing": lambda: c(CLOTHING),
            "food": self._food,
            "foods": self._foods,
            "kilo_food": self._kilo_food,
            "drink": lambda: c(DRINKS),
            "drink_np": self._drink,
            "animal": lambda: c(ANIMALS)[0],
            "animals": lambda: c(ANIMALS)[1],
            "a_animal": lambda: _with_article(c(ANIMALS)[0]),
            "animal_np": self._animal_np,
            "animal_adj": lambda: c(ANIMAL_ADJECTIVES),
            "animal_did": lambda: c(ANIMAL_VERBS_PAST),
            "animal_place": lambda: c(ANIMAL_PLACES),
            "place": self._place,
            "place_noun": lambda: c(PLACES)[0],
            "place_adj": lambda: c(PLACE_ADJECTIVES),
            "loc": self._location,
            "city": self._city,
            "country": self._country,
            "destination": self._destination,
            "city_country": self._city_country,
            "capital_of": self._capital_of,
            "city_is": self._city_is,
            "from_to": self._from_to,
            "topic": lambda: c(TOPICS),
            "language": lambda: c(LANGUAGES),
            "subject": lambda: c(SCHOOL_SUBJECTS),
            "sport": lambda: c(SPORTS),
            "instrument": lambda: c(INSTRUMENTS),
            "event": lambda: c(EVENTS),
            "occasion": lambda: c(OCCASIONS),
            "opinion": lambda: c(OPINIONS),
            "side": lambda: c(("left", "right")),
            "code_lock": lambda: c(("door", "gate", "safe", "front door", "bike lock", "alarm", "garage", "locker")),
            # time
            "when_past": self._when_past,
            "when_future": self._when_future,
            "when_now": self._when_now,
            "freq": self._frequency,
            "later": lambda: c(("later today", "this afternoon", "this evening", "tonight", "overnight")),
            "day": lambda: c(DAYS),
            "days": self._days,
            "month": lambda: c(MONTHS),
            "season": lambda: c(SEASONS),
            "clock": self._clock,
            "date": self._date,
            "year": self._year,
            "historic_year": self._historic_year,
            # numbers
            "count": self._count,
            "small": lambda: _ONES[self._randint(2, 12)],
            "ordinal": lambda: spell_ordinal(self._randint(1, 31)),
            "ordinal_small": lambda: spell_ordinal(self._randint(1, 5)),
            "hours": self._hours,
            "minutes": self._minutes,
            "big": self._big,
            "price": self._price,
            "small_price": self._small_price,
            "thing_quality": lambda: c(THING_QUALITIES),
            "phone": self._phone,
            "code": lambda: spell_digits(f"{self._randint(0, 9999):04d}"),
            "room": lambda: spell_number(self._randint(1, 9) * 100 + self._randint(1, 60)),
            "percent": lambda: spell_number(self._randint(5, 95)),
            "score": self._score,
            "temp": self._temperature,
            # weather
            "weather_adj": lambda: c(WEATHER_ADJECTIVES),
            "weather_temp": lambda: c(WEATHER_TEMPERATURES),
            "weather_sky": lambda: c(WEATHER_SKIES),
            "weather_noun": lambda: c(WEATHER_NOUNS),
            "weather_base": lambda: c(WEATHER_VERBS)[_BASE],
            "weather_s": lambda: c(WEATHER_VERBS)[_S],
            "weather_past": lambda: c(WEATHER_VERBS[:5])[_PAST],
            "region": lambda: c(REGIONS),
            "too_reason": lambda: c(TOO_REASONS),
            # verbs and clauses
            "vp_base": functools.partial(self._verb_phrase, _BASE),
            "vp_s": functools.partial(self._verb_phrase, _S),
            "vp_past": functools.partial(self._verb_phrase, _PAST),
            "vp_pp": functools.partial(self._verb_phrase, _PP),
            "vp_ing": functools.partial(self._verb_phrase, _ING),
            "adverb": lambda: c(MANNER_ADVERBS),
            "general_adverb": lambda: c(GENERAL_ADVERBS),
            "count_verb": lambda: c(("buy", "order", "find", "sell", "pack", "bring", "lose", "need", "count")),
            "said": lambda: c(SAID),
            "thinks": lambda: c(THINKS),
            "clause_past": functools.partial(clause, "past", True),
            "clause_past_bare": functools.partial(clause, "past", False),
            "clause_past_prog": functools.partial(clause, "past_prog", False),
            "clause_present": functools.partial(clause, "present", True),
            "clause_present_bare": functools.partial(clause, "present", False),
            "clause_prog": functools.partial(clause, "prog", True),
            "clause_future": functools.partial(clause, "future", True),
            "clause_future_bare": functools.partial(clause, "future", False),
            "clause_perfect": functools.partial(clause, "perfect", True),
            "clause_modal": functools.partial(clause, "modal", True),
        }
        return slots

    # -- noun phrases ---------------------------------------------------------------------------------------------

    def _full_name(self) -> str:
        return f"{self._choice(FIRST_NAMES)} {self._choice(SURNAMES)}"

    def _relative(self) -> str:
        """A possessive and a relative: "my sister", "our neighbour" (never "our wife")."""
        possessive = self._choice(_POSSESSIVES)
        relative = self._choice(RELATIVES)
        while possessive in ("our", "their") and relative in _OWN_PARTNERS:
            relative = self._choice(RELATIVES)
        return f"{possessive} {relative}"

    def _person(self) -> str:
        r = self._random()
        c = self._choice
        if r < 0.3:
            return c(FIRST_NAMES)
        if r < 0.4:
            return self._full_name()
        if r < 0.6:
            return self._relative()
        if r < 0.75:
            return f"the {c(PROFESSIONS)[0]}"
        if r < 0.85:
            return f"{c(TITLES)} {c(SURNAMES)}"
        if r < 0.93:
            return f"{c(FIRST_NAMES)}'s {c(RELATIVES)}"
        return c(_OBJECT_PRONOUNS)

    def _subject_singular(self) -> str:
        r = self._random()
        c = self._choice
        if r < 0.28:
            return c(FIRST_NAMES)
        if r < 0.38:
            return self._full_name()
        if r < 0.55:
            return self._relative()
        if r < 0.63:
            return f"the {c(PROFESSIONS)[0]}"
        if r < 0.7:
            return f"the {c(PERSON_ADJECTIVES)} {c(PROFESSIONS)[0]}"
        if r < 0.78:
            return c(("he", "she"))
        if r < 0.86:
            return f"{c(TITLES)} {c(SURNAMES)}"
        if r < 0.94:
            return f"{c(FIRST_NAMES)}'s {c(RELATIVES)}"
        return c(("someone", "everyone", "somebody"))

    def _subject_plural(self) -> str:
        r = self._random()
        c = self._choice
        if r < 0.15:
            return "we"
        if r < 0.27:
            return "they"
        if r < 0.35:
            return "you"
        if r < 0.55:
            return f"{c(_POSSESSIVES)} {c(RELATIVES_PLURAL)}"
        if r < 0.72:
            return f"the {c(PROFESSIONS)[1]}"
        if r < 0.87:
            return f"{c(FIRST_NAMES)} and {c(FIRST_NAMES)}"
        return c(("my parents", "the children", "our neighbours", "the students", "the tourists", "the guests"))

    def _subject(self) -> tuple[str, int]:
        """A subject and its person: 0 for "i", 1 for third person singular, 2 for plural and "you"."""
        r = self._random()
        if r < 0.14:
            return "i", 0
        if r < 0.66:
            return self._subject_singular(), 1
        return self._subject_plural(), 2

    def _any_subject(self) -> str:
        return self._subject()[0]

    def _thing(self) -> str:
        c = self._choice
        r = self._random
        singular, plural = c(OBJECTS)
        adjective = ""
        if r() < 0.5:
            adjective = c(COLOURS) if r() < 0.3 else c(OBJECT_ADJECTIVES)
        if r() < 0.7:
            noun = f"{adjective} {singular}" if adjective else singular
            d = r()
            if d < 0.4:
                return f"the {noun}"
            if d < 0.7:
                return _with_article(noun)
            if d < 0.9:
                return f"{c(_POSSESSIVES)} {noun}"
            if d < 0.95:
                return f"{c(('this', 'that'))} {noun}"
            return f"{c(FIRST_NAMES)}'s {noun}"
        noun = f"{adjective} {plural}" if adjective else plural
        d = r()
        if d < 0.3:
            return f"the {noun}"
        if d < 0.5:
            return f"some {noun}"
        if d < 0.7:
            return f"{_ONES[self._randint(2, 12)]} {noun}"
        if d < 0.9:
            return f"{c(_POSSESSIVES)} {noun}"
        return f"{c(('these', 'those'))} {noun}"

    def _a_thing(self) -> str:
        singular = self._choice(OBJECTS)[0]
        if self._random() < 0.6:
            adjective = self._choice(OBJECT_ADJECTIVES) if self._random() < 0.7 else self._choice(COLOURS)
            singular = f"{adjective} {singular}"
        return _with_article(singular)

    def _food(self) -> str:
        c = self._choice
        r = self._random
        adjective = c(FOOD_ADJECTIVES) if r() < 0.45 else ""
        if r() < 0.5:
            noun = c(MASS_FOODS)
            noun = f"{adjective} {noun}" if adjective else noun
            d = r()
            if d < 0.3:
                return f"some {noun}"
            if d < 0.55:
                return f"the {noun}"
            if d < 0.85:
                return f"{c(FOOD_CONTAINERS)} {noun}"
            return f"{c(_POSSESSIVES)} {noun}"
        singular, plural = c(FOODS)
        d = r()
        if d < 0.45:
            noun = f"{adjective} {singular}" if adjective else singular
            return f"the {noun}" if d < 0.2 else _with_article(noun)
        noun = f"{adjective} {plural}" if adjective else plural
        if d < 0.65:
            return f"some {noun}"
        if d < 0.85:
            return f"{_ONES[self._randint(2, 12)]} {noun}"
        return f"the {noun}"

    def _foods(self) -> str:
        """Food in general: a bare plural or mass noun ("fresh strawberries", "rice")."""
        noun = self._choice(FOODS)[1] if self._random() < 0.6 else self._choice(MASS_FOODS)
        return f"{self._choice(FOOD_ADJECTIVES)} {noun}" if self._random() < 0.3 else noun

    def _kilo_food(self) -> str:
        return self._choice(FOODS)[1] if self._random() < 0.6 else self._choice(MASS_FOODS)

    def _drink(self) -> str:
        return f"{self._choice(DRINK_CONTAINERS)} {self._choice(DRINKS)}"

    def _animal_np(self) -> str:
        c = self._choice
        singular, plural = c(ANIMALS)
        adjective = c(ANIMAL_ADJECTIVES) if self._random() < 0.5 else ""
        d = self._random()
        if d < 0.4:
            return f"the {adjective} {singular}" if adjective else f"the {singular}"
        if d < 0.6:
            return _with_article(f"{adjective} {singular}" if adjective else singular)
        noun = f"{adjective} {plural}" if adjective else plural
        if d < 0.8:
            return f"the {noun}"
        return f"{_ONES[self._randint(2, 9)]} {noun}"

    def _place(self) -> str:
        c = self._choice
        noun = c(PLACES)[0]
        d = self._random()
        if d < 0.35:
            return f"the {noun}"
        if d < 0.6:
            return f"the {c(PLACE_ADJECTIVES)} {noun}"
        if d < 0.75:
            return _with_article(f"{c(PLACE_ADJECTIVES)} {noun}")
        if d < 0.9:
            return f"the {noun} in {self._city()}"
        return f"the {noun} near {c(_POSSESSIVES)} house"

    def _location(self) -> str:
        c = self._choice
        d = self._random()
        if d < 0.35:
            return f"{c(('on', 'under', 'on', 'beside'))} the {c(FURNITURE_SURFACES)}"
        if d < 0.7:
            return f"in the {c(CONTAINER_PLACES)}"
        return f"{c(('next to', 'near', 'behind', 'in front of', 'by'))} the {c(NEAR_PLACES)}"

    def _city(self) -> str:
        return self._choice(self._choice(COUNTRIES_WITH_CITIES)[2])

    def _country(self) -> str:
        if self._random() < 0.8:
            return self._choice(COUNTRIES_WITH_CITIES)[0]
        return self._choice(OTHER_COUNTRIES)

    def _destination(self) -> str:
        return self._city() if self._random() < 0.65 else self._country()

    def _country_and_city(self) -> tuple[str, str]:
        while True:
            country, _, cities = self._choice(COUNTRIES_WITH_CITIES)
            if cities:
                return country, self._choice(cities)

    def _city_country(self) -> str:
        country, city = self._country_and_city()
        return city if city == country else f"{city} in {country}"

    def _capital_of(self) -> str:
        while True:
            country, capital, _ = self._choice(COUNTRIES_WITH_CITIES)
            if capital and capital != country:
                break
        if self._random() < 0.5:
            return f"{capital} is the capital of {country}"
        return f"the capital of {country} is {capital}"

    def _city_is(self) -> str:
        while True:
            country, city = self._country_and_city()
            if city != country:
                break
        adjective = self._choice(PLACE_ADJECTIVES)
        return f"{city} is {_with_article(adjective)} city in {country}"

    def _from_to(self) -> str:
        start = self._city()
        end = self._city()
        while end == start:
            end = self._city()
        return f"from {start} to {end}"

    # -- time ---------------------------------------------------------------------------------------------------

    def _days(self) -> str:
        if self._random() < 0.15:
            return self._choice(("weekdays", "weekends", "bank holidays"))
        return self._choice(DAYS) + "s"

    def _when_past(self) -> str:
        c = self._choice
        k = self._randint(0, 19)
        if k == 0:
            return f"last {c(DAYS)}"
        if k == 1:
            return f"on {c(DAYS)} {c(PARTS_OF_DAY[:3])}"
        if k == 2:
            return f"{_ONES[self._randint(2, 12)]} {c(('days', 'weeks', 'months', 'years'))} ago"
        if k == 3:
            return f"in {c(MONTHS)}"
        if k == 4:
            return f"in {self._year()}"
        if k == 5:
            return f"last {c(SEASONS)}"
        if k == 6:
            return f"at {self._clock()}"
        if k == 7:
            return f"on {self._date()}"
        return c(
            (
                "yesterday",
                "last night",
                "last week",
                "this morning",
                "earlier today",
                "the day before yesterday",
                "a few minutes ago",
                "after lunch",
                "before breakfast",
                "during the holidays",
                "over the weekend",
                "last year",
            )
        )

    def _when_future(self) -> str:
        c = self._choice
        k = self._randint(0, 19)
        if k == 0:
            return f"next {c(DAYS)}"
        if k == 1:
            return f"on {c(DAYS)} {c(PARTS_OF_DAY[:3])}"
        if k == 2:
            return f"in {_ONES[self._randint(2, 12)]} {c(('minutes', 'days', 'weeks', 'months'))}"
        if k == 3:
            return f"next {c(SEASONS)}"
        if k == 4:
            return f"at {self._clock()}"
        if k == 5:
            return f"on the {spell_ordinal(self._randint(1, 31))} of {c(MONTHS)}"
        if k == 6:
            return f"tomorrow {c(PARTS_OF_DAY[:3])}"
        if k == 7:
            return f"in {c(MONTHS)}"
        return c(
            (
                "tomorrow",
                "next week",
                "this evening",
                "tonight",
                "later today",
                "the day after tomorrow",
                "next month",
                "next year",
                "soon",
                "after lunch",
                "before the weekend",
                "at the weekend",
            )
        )

    def _when_now(self) -> str:
        return self._choice(("right now", "at the moment", "today", "this week", "this afternoon", "again", ""))

    def _frequency(self) -> str:
        c = self._choice
        k = self._randint(0, 9)
        if k == 0:
            return f"every {c(DAYS)}"
        if k == 1:
            return f"on {self._days()}"
        if k == 2:
            return f"{c(('three', 'four', 'five', 'six'))} times a {c(('week', 'month', 'year'))}"
        if k == 3:
            return f"on {c(DAYS)} {c(('mornings', 'afternoons', 'evenings'))}"
        return c(
            (
                "every day",
                "every morning",
                "at the weekend",
                "twice a week",
                "once a month",
                "every summer",
                "in the evenings",
                "after work",
                "most mornings",
                "every other day",
                "",
            )
        )

    def _clock(self) -> str:
        hour = self._randint(1, 12)
        nxt = hour % 12 + 1
        k = self._randint(0, 9)
        if k == 0:
            text = f"{_ONES[hour]} o'clock"
        elif k == 1:
            text = f"half past {_ONES[hour]}"
        elif k == 2:
            text = f"quarter past {_ONES[hour]}"
        elif k == 3:
            text = f"quarter to {_ONES[nxt]}"
        elif k == 4:
            text = f"{self._choice(_CLOCK_MINUTES)[1]} past {_ONES[hour]}"
        elif k == 5:
            text = f"{self._choice(_CLOCK_MINUTES)[1]} to {_ONES[nxt]}"
        elif k == 6:
            return self._choice(("midday", "midnight", "noon"))
        else:
            minute = self._choice((5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55))
            text = f"{_ONES[hour]} {'oh five' if minute == 5 else _below_hundred(minute)}"
        if self._random() < 0.25:
            text += " " + self._choice(("in the morning", "in the afternoon", "in the evening", "at night"))
        return text

    def _date(self) -> str:
        day = spell_ordinal(self._randint(1, 28))
        month = self._choice(MONTHS)
        k = self._randint(0, 3)
        if k == 0:
            return f"the {day} of {month}"
        if k == 1:
            return f"{month} the {day}"
        if k == 2:
            return f"{self._choice(DAYS)} the {day} of {month}"
        return f"{month} {day}"

    def _year(self) -> str:
        """A year in living memory (1925..2024): these years appear in past-tense sentences."""
        r = self._random()
        return spell_year(self._randint(1990, 2024) if r < 0.6 else self._randint(1925, 1989))

    def _historic_year(self) -> str:
        """A year a building may date from (1100..2024)."""
        r = self._random()
        if r < 0.5:
            return spell_year(self._randint(1900, 2024))
        if r < 0.85:
            return spell_year(self._randint(1700, 1899))
        return spell_year(self._randint(1100, 1699))

    # -- numbers --------------------------------------------------------------------------------------------------

    def _count(self) -> str:
        r = self._random()
        if r < 0.7:
            return spell_number(self._randint(2, 20))
        if r < 0.9:
            return spell_number(self._randint(21, 99))
        return spell_number(self._randint(100, 999))

    def _hours(self) -> str:
        k = self._randint(0, 5)
        if k == 0:
            return self._choice(("an hour", "half an hour", "an hour and a half", "forty minutes"))
        return f"{_ONES[self._randint(2, 16)]} hours"

    def _minutes(self) -> str:
        return f"{spell_number(self._choice((2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 45)))} minutes"

    def _big(self) -> str:
        k = self._randint(0, 3)
        if k == 0:
            return f"{spell_number(self._randint(10, 999))} thousand people"
        if k == 1:
            return f"{spell_number(self._randint(2, 30))} million people"
        if k == 2:
            return f"{_ONES[self._randint(1, 9)]} point {_ONES[self._randint(1, 9)]} million people"
        return f"{spell_number(self._randint(1, 999) * 1000 + self._randint(1, 9) * 100)} people"

    def _price(self) -> str:
        one, many, cents = self._choice(_CURRENCIES)
        k = self._randint(0, 4)
        units = self._randint(1, 99) if self._random() < 0.85 else self._randint(100, 2000)
        cents_value = self._randint(2, 99)
        main = f"{spell_number(units)} {one if units == 1 else many}"
        if k == 0:
            return f"{spell_number(cents_value)} {cents}"
        if k == 1 and one == "pound":
            return f"{main} {spell_number(cents_value)}"
        if k == 2:
            return f"{main} and {spell_number(cents_value)} {cents}"
        return main

    def _small_price(self) -> str:
        one, many, cents = self._choice(_CURRENCIES)
        units = self._randint(1, 15)
        main = f"{spell_number(units)} {one if units == 1 else many}"
        if self._random() < 0.5:
            return main
        if one == "pound" and self._random() < 0.5:
            return f"{main} {spell_number(self._randint(2, 99))}"
        return f"{main} and {spell_number(self._randint(2, 99))} {cents}"

    def _phone(self) -> str:
        if self._random() < 0.6:
            digits = "07" + "".join(str(self._randint(0, 9)) for _ in range(9))
        else:
            digits = "".join(str(self._randint(0, 9)) for _ in range(self._randint(6, 8)))
        return spell_digits(digits)

    def _score(self) -> str:
        winner = self._randint(1, 6)
        loser = self._randint(0, winner - 1)
        goals = "goal" if winner == 1 else "goals"
        return f"{_ONES[winner]} {goals} to {'nil' if loser == 0 else _ONES[loser]}"

    def _temperature(self) -> str:
        value = self._randint(-15, 40)
        unit = "degree" if abs(value) == 1 else "degrees"
        return f"minus {_ONES[-value]} {unit}" if value < 0 else f"{spell_number(value)} {unit}"

    # -- verbs and clauses ----------------------------------------------------------------------------------------

    def _verb_phrase(self, form: int) -> str:
        forms, complements = self._choice(self._verb_phrases[form])
        complement = _render(self._choice(complements)) if complements else ""
        return f"{forms[form]} {complement}" if complement else forms[form]

    def _clause(self, tense: str, timed: bool) -> str:
        """A full clause: subject, verb phrase in ``tense`` and, when ``timed``, often a time expression."""
        subject, person = self._subject()
        # Clauses inside larger sentences ("when ...", "before ...") stay affirmative: a negated clause there
        # rarely sounds natural.
        r = self._random() if timed else 0.12 + 0.88 * self._random()
        c = self._choice
        vp = self._verb_phrase
        time = ""
        if tense == "past":
            if r < 0.12:
                core = f"{subject} didn't {vp(_BASE)}"
            elif r < 0.2:
                core = f"{subject} {'were' if person == 2 else 'was'} {vp(_ING)}"
            else:
                core = f"{subject} {vp(_PAST)}"
            if timed:
                time = self._when_past()
        elif tense == "past_prog":
            core = f"{subject} {'were' if person == 2 else 'was'} {vp(_ING)}"
        elif tense == "present":
            form = _S if person == 1 else _BASE
            if r < 0.12:
                core = f"{subject} {'doesn' if person == 1 else 'don'}'t {vp(_BASE)}"
            elif r < 0.4:
                core = f"{subject} {c(FREQUENCY_ADVERBS)} {vp(form)}"
            else:
                core = f"{subject} {vp(form)}"
                if timed:
                    time = self._frequency()
        elif tense == "prog":
            be = ("am", "is", "are")[person]
            if r < 0.1:
                be = ("am not", "isn't", "aren't")[person]
            elif r < 0.4 and subject in ("i", "we", "you", "they"):
                subject, be = f"{subject}'{('m', 're')[person // 2]}", ""
            core = " ".join(p for p in (subject, be, vp(_ING)) if p)
            if timed:
                time = self._when_now()
        elif tense == "future":
            if r < 0.12:
                core = f"{subject} won't {vp(_BASE)}"
            elif r < 0.3:
                be = ("am", "is", "are")[person]
                core = f"{subject} {be} going to {vp(_BASE)}"
            elif r < 0.45 and subject in ("i", "we", "you", "they", "he", "she"):
                core = f"{subject}'ll {vp(_BASE)}"
            else:
                core = f"{subject} will {vp(_BASE)}"
            if timed:
                time = self._when_future()
        elif tense == "perfect":
            have = "has" if person == 1 else "have"
            if r < 0.12:
                return f"{subject} {have}n't {vp(_PP)} yet"
            if r < 0.55:
                core = f"{subject} {have} {c(('just', 'already', 'never', 'recently', 'finally', 'often'))} {vp(_PP)}"
            else:
                core = f"{subject} {have} {vp(_PP)}"
                if timed:
                    time = c(("this week", "this year", "today", "twice", "before", "many times", "this month", ""))
        else:  # modal
            modal = c(("can", "could", "should", "must", "might", "may", "would", "can't", "shouldn't", "couldn't"))
            core = f"{subject} {modal} {vp(_BASE)}"
            if timed and self._random() < 0.5:
                time = self._when_future()
        if time and self._random() < 0.8:
            return f"{core} {time}"
        return core
