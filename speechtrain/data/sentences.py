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
# Vocabulary tables
# ----------------------------------------------------------------------------------------------------------------
# Lists are comma separated. Nouns are "singular" (plural = singular + "s") or "singular/plural". Verbs are
# "base/third person/past/past participle/ing"; an ing form of "-" marks a stative verb that is not used in the
# progressive ("is knowing"). Activities are "verb forms: complement | complement | ...;" where a complement may
# hold {slots} (see SentenceGenerator).

_ENTRY_RE = re.compile(r"[a-z']+(?: [a-z']+)*")


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


FIRST_NAMES = _words("""
olivia, emma, ava, sophia, isabella, mia, amelia, harper, evelyn, abigail, emily, elizabeth, ella, madison,
scarlett, victoria, grace, chloe, camila, penelope, riley, layla, lillian, nora, zoe, mila, hannah, lily, eleanor,
natalie, luna, savannah, leah, stella, hazel, ellie, audrey, violet, claire, bella, aurora, lucy, anna, samantha,
caroline, allison, maya, sarah, madeline, alexa, ariana, elena, gabriella, naomi, alice, sadie, hailey, eva,
emilia, autumn, quinn, piper, ruby, willow, cora, lydia, melanie, julia, valentina, clara, vivian, delilah, isla,
katherine, sophie, josephine, ivy, jade, maria, taylor, faith, alexandra, ashley, brianna, bailey, mary, athena,
andrea, jasmine, margaret, alyssa, rose, ariel, melody, rachel, diana, helen, jessica, laura, rebecca, susan,
karen, nancy, linda, patricia, barbara, jennifer, michelle, amanda, stephanie, nicole, heather, christina, angela,
kimberly, deborah, sharon, cynthia, kathleen, amy, shirley, brenda, pamela, joanna, fiona, kate, megan, lauren,
jenny, holly, poppy, daisy, matilda, phoebe, imogen, freya, harriet, beatrice, florence, edith, agnes, dorothy,
martha, ruth, judith, esther, miriam, irene, joan, carol, janet, wendy, paula, gloria, teresa, monica, veronica,
priya, anjali, deepa, sunita, kavya, fatima, aisha, amina, leila, nadia, yasmin, zara, carmen, lucia, rosa,
isabel, pilar, giulia, francesca, chiara, camille, amelie, juliette, greta, ingrid, astrid, freja, yuki, hana,
sakura, mei, lin, xin, kwame, amara, chioma, ngozi, olga, anya, katya, irina, tanya, ana, beatriz, mariana,
liam, noah, william, james, oliver, benjamin, elijah, lucas, mason, logan, alexander, ethan, jacob, michael,
daniel, henry, jackson, sebastian, aiden, matthew, samuel, david, joseph, carter, owen, wyatt, john, jack, luke,
dylan, grayson, levi, isaac, gabriel, julian, anthony, lincoln, joshua, christopher, andrew, theodore, caleb,
ryan, asher, nathan, thomas, leo, isaiah, charles, hudson, christian, hunter, connor, eli, ezra, aaron, landon,
adrian, jonathan, nolan, jeremiah, elias, colton, cameron, carson, robert, nicholas, dominic, adam, ian, austin,
jordan, cooper, roman, evan, xavier, jason, george, edward, richard, peter, paul, mark, steven, kevin, brian,
timothy, frank, gregory, raymond, patrick, harold, arthur, walter, albert, frederick, hugo, oscar, felix, max,
tom, harry, alfie, archie, freddie, toby, rory, finn, callum, jamie, lewis, stanley, reggie, teddy, louie, ronnie,
simon, stuart, graham, martin, neil, colin, keith, barry, dennis, gordon, douglas, kenneth, ralph, eugene, victor,
ravi, arjun, rahul, deepak, sanjay, vikram, anil, mohammed, ahmed, omar, yusuf, hassan, tariq, karim, ibrahim,
carlos, diego, pablo, javier, miguel, alejandro, fernando, marco, luca, giovanni, matteo, pierre, louis, antoine,
hans, klaus, lars, sven, erik, magnus, hiroshi, kenji, akira, takeshi, wei, chen, jun, kofi, chidi, emeka,
ivan, dmitri, sasha, boris, pedro, joao, rafael, tiago
""")

SURNAMES = _words("""
smith, johnson, williams, brown, jones, garcia, miller, davis, rodriguez, martinez, hernandez, lopez, gonzalez,
wilson, anderson, taylor, moore, jackson, martin, lee, perez, thompson, white, harris, sanchez, clark, ramirez,
lewis, robinson, walker, young, allen, king, wright, scott, torres, nguyen, hill, flores, green, adams, nelson,
baker, hall, rivera, campbell, mitchell, carter, roberts, patel, shah, singh, kumar, khan, ali, chen, wang, zhang,
liu, kim, park, tanaka, sato, suzuki, murphy, kelly, o'brien, o'connor, evans, edwards, collins, stewart, morris,
rogers, reed, cook, morgan, bell, cooper, richardson, cox, howard, ward, peterson, gray, watson, brooks, price,
bennett, wood, barnes, ross, henderson, coleman, jenkins, perry, powell, patterson, hughes, butler, foster,
bryant, russell, griffin, hayes, myers, ford, hamilton, sullivan, wallace, west, cole, hunt, palmer, fisher,
ellis, harrison, gibson, mcdonald, cruz, marshall, ortiz, gomez, murray, freeman, wells, webb, simpson, stevens,
tucker, porter, hicks, crawford, boyd, warren, dixon, ramos, reyes, burns, shaw, holmes, rice, robertson, black,
mills, nichols, knight, ferguson, stone, hawkins, dunn, perkins, spencer, gardner, payne, pierce, berry,
matthews, arnold, wagner, willis, watkins, olson, carroll, duncan, snyder, hart, cunningham, bradley, lane,
andrews, harper, fox, armstrong, carpenter, weaver, lawrence, elliott, chavez, franklin, lawson, fletcher,
chapman, barker, webster, turner, phillips, parker, johnston, mackenzie, fraser, macleod, jensen, hansen,
schmidt, schneider, fischer, weber, becker, rossi, russo, ferrari, esposito, bianchi, dubois, moreau, laurent,
silva, santos, oliveira, costa, pereira, novak, kowalski, nowak, ivanov, petrov, yamamoto, nakamura, ito, okafor,
mensah, mwangi, abara, haddad, nasser, hussein
""")

TITLES = _words("mister, missus, doctor, professor, captain, detective, officer, nurse, judge, coach")

RELATIVES = _words("""
mother, father, brother, sister, aunt, uncle, cousin, grandmother, grandfather, grandma, grandpa, mum, dad, son,
daughter, niece, nephew, wife, husband, neighbour, friend, boss, colleague, flatmate, roommate, classmate,
partner, best friend, girlfriend, boyfriend, stepfather, stepmother, godmother, godfather, twin brother,
twin sister, little sister, little brother, older brother, older sister, landlord, landlady, teammate, pen pal
""")

RELATIVES_PLURAL = _words("""
brothers, sisters, cousins, aunts, uncles, grandparents, parents, friends, neighbours, colleagues, classmates,
children, kids, sons, daughters, nieces, nephews, flatmates, teammates, best friends, old school friends
""")

PROFESSIONS = _nouns("""
doctor, nurse, teacher, engineer, lawyer, farmer, baker, butcher, chef, cook, pilot, driver, taxi driver,
bus driver, mechanic, plumber, electrician, carpenter, builder, painter, artist, musician, singer, dancer, actor,
writer, journalist, photographer, dentist, pharmacist, vet, scientist, chemist, physicist, biologist, architect,
accountant, banker, cashier, waiter, waitress/waitresses, receptionist, secretary/secretaries, librarian,
firefighter, police officer, soldier, sailor, fisherman/fishermen, gardener, cleaner, tailor, hairdresser,
barber, shopkeeper, manager, director, designer, programmer, software developer, translator, interpreter, judge,
professor, student, surgeon, therapist, psychologist, economist, historian, politician, mayor, postman/postmen,
courier, security guard, coach/coaches, athlete, footballer, referee, lifeguard, zookeeper, tour guide, astronaut,
inventor, editor, reporter, novelist, poet, sculptor, potter, jeweller, florist, optician, paramedic,
midwife/midwives, priest, lecturer, tutor, nanny/nannies, babysitter, detective, miner, welder, captain, clerk,
salesman/salesmen, estate agent, caretaker, surveyor, geologist, astronomer, mathematician, statistician,
analyst, consultant, entrepreneur, investor, locksmith, shepherd, beekeeper, brewer, winemaker, flight attendant,
social worker, carer, cyclist, lorry driver, train driver, plasterer, decorator, bricklayer, roofer, glazier
""")

ANIMALS = _nouns("""
dog, cat, horse, cow, pig, sheep/sheep, goat, chicken, duck, goose/geese, rabbit, mouse/mice, rat, hamster,
parrot, owl, eagle, hawk, crow, pigeon, sparrow, robin, swan, penguin, flamingo, peacock, turkey, deer/deer,
fox/foxes, wolf/wolves, bear, lion, tiger, leopard, cheetah, elephant, giraffe, zebra, monkey, gorilla,
chimpanzee, kangaroo, koala, panda, camel, donkey, bull, ox/oxen, squirrel, hedgehog, badger, otter, beaver, bat,
frog, toad, snake, lizard, turtle, tortoise, crocodile, whale, dolphin, shark, octopus/octopuses, seal,
walrus/walruses, crab, lobster, goldfish/goldfish, butterfly/butterflies, bee, spider, beetle, ladybird, moth,
snail, puppy/puppies, kitten, pony/ponies, lamb, calf/calves, hippo, rhino, moose/moose, raccoon, hare, mole,
jellyfish/jellyfish, hummingbird, woodpecker, seagull, heron, stork, ostrich/ostriches, jaguar, panther, hyena,
llama, alpaca, yak, reindeer/reindeer, bison/bison, buffalo/buffalo, chipmunk, ferret, guinea pig, tortoise,
magpie, blackbird, pelican, puffin
""")

ANIMAL_ADJECTIVES = _words("""
small, big, old, young, hungry, sleepy, lazy, playful, friendly, fluffy, noisy, curious, shy, clever, tired,
wild, tame, brave, nervous, grumpy, gentle, fat, skinny, muddy, wet, little, huge, beautiful, spotted, striped,
injured, lost, lonely, restless, tiny, elderly, cheeky, scruffy, graceful, proud
""")

OBJECTS = _nouns("""
umbrella, lamp, chair, book, key, bag, bottle, box/boxes, camera, jacket, coat, hat, scarf/scarves, glove, shoe,
boot, sock, shirt, sweater, dress/dresses, skirt, belt, wallet, purse, watch/watches, ring, necklace, bracelet,
mirror, clock, pillow, blanket, towel, cup, mug, plate, bowl, spoon, fork, knife/knives, frying pan, saucepan,
kettle, toaster, phone, laptop, computer, keyboard, screen, printer, tablet, radio, television, speaker, charger,
cable, battery/batteries, torch/torches, candle, vase, painting, picture, photo, poster, map, letter, envelope,
parcel, package, ticket, passport, notebook, pen, pencil, marker, crayon, ruler, stapler, folder,
diary/diaries, calendar, newspaper, magazine, dictionary/dictionaries, novel, guitar, violin, drum, flute,
trumpet, ball, kite, doll, puzzle, toy, bicycle, helmet, skateboard, suitcase, backpack, basket, bucket, ladder,
hammer, screwdriver, drill, shovel, rake, hose, broom, mop, sponge, brush/brushes, comb,
toothbrush/toothbrushes, razor, jar, carpet, rug, curtain, cushion, fan, heater, tent, sleeping bag,
compass/compasses, telescope, microscope, magnet, globe, coin, stamp, card, gift, trophy/trophies, medal, flag,
badge, button, needle, rope, chain, padlock, bell, whistle, lantern, sandal, slipper, raincoat, cap, tie,
uniform, apron, mask, handbag, briefcase, receipt, report, contract, leaflet, brochure, menu, recipe, label,
sticker, balloon, ribbon, feather, shell, pebble, brick, tile, plank, pipe, remote control, calculator,
thermometer, teapot, jug, tray, napkin, tablecloth, candlestick, picture frame, photo album, jigsaw, board game,
paintbrush/paintbrushes, easel, canvas/canvases, sketchbook, clipboard, postcard, earring,
hairbrush/hairbrushes, lunchbox/lunchboxes, water bottle, flask, doormat, coat hanger, alarm clock, lightbulb,
shopping bag, wheelbarrow, watering can, flowerpot, birdcage, fishing rod, tennis racket, football, basketball,
baseball bat, golf club, snowboard, surfboard, sledge, scooter, pram, trolley, wagon, saddle, microphone,
headset, mouse mat, memory stick, hard drive, projector, whiteboard, blender, kettle, teacup, saucer, sieve,
grater, rolling pin, corkscrew, tin opener, cheese board, chopping board, cookbook, jewellery box/jewellery boxes,
music box/music boxes, snow globe, sculpture, statue, vinyl record, cassette, violin case, lampshade, doorknob,
keyring, pocket knife/pocket knives, penknife/penknives, magnifying glass/magnifying glasses, hourglass/hourglasses
""")

OBJECT_ADJECTIVES = _words("""
big, small, large, little, tiny, huge, heavy, light, old, new, ancient, modern, cheap, expensive, broken, clean,
dirty, shiny, dusty, wet, dry, soft, hard, smooth, rough, strange, beautiful, ugly, useful, useless, fancy, plain,
simple, elegant, wooden, metal, plastic, glass, leather, woollen, cotton, silk, paper, rusty, brand new,
second hand, antique, lovely, nice, pretty, ordinary, unusual, special, favourite, spare, empty, full, lost,
borrowed, cracked, torn, striped, spotted, round, square, long, short, tall, thin, thick, wide, narrow, flat,
sharp, blunt, bright, dark, pale, colourful, fragile, sturdy, enormous, miniature, portable, electric, digital,
famous, precious, valuable, handmade, comfortable, uncomfortable, waterproof, warm, cosy, vintage, fashionable,
ridiculous, mysterious, odd, shabby, sparkling, stylish, practical, solid, hollow, curved, folded, polished,
damaged, perfect, heavy duty, lightweight, oversized, decorative, delicate, battered, faded
""")

THING_QUALITIES = _words("""
cheap, expensive, heavy, light, old, useful, beautiful, ugly, strange, small, big, comfortable, uncomfortable,
fragile, dirty, dusty, rusty, shiny, elegant, practical, useless, pretty, odd, delicate, sturdy, noisy, reliable,
good value, well made, badly made, old fashioned, lovely, nice, special, unusual, valuable, popular, clever
""")

COLOURS = _words("""
red, blue, green, yellow, orange, purple, pink, brown, black, white, grey, silver, gold, golden, navy, turquoise,
beige, cream, violet, crimson, scarlet, maroon, teal, lilac, lavender, olive, khaki, ivory, bronze, copper,
emerald, indigo, magenta, peach, dark blue, light blue, dark green, light green, bright red, pale yellow,
sky blue, bright orange, deep purple
""")

CLOTHING = _words("""
hat, coat, scarf, jacket, dress, shirt, sweater, jumper, suit, tie, cap, raincoat, skirt, blouse, cardigan,
hoodie, waistcoat, tracksuit, uniform, apron, gown, bow tie, swimsuit, dressing gown, t shirt, anorak, beret
""")

FOODS = _nouns("""
apple, banana, orange, pear, peach/peaches, plum, grape, cherry/cherries, strawberry/strawberries,
blueberry/blueberries, raspberry/raspberries, lemon, lime, mango/mangoes, pineapple, melon, watermelon, kiwi,
apricot, coconut, avocado, tomato/tomatoes, potato/potatoes, carrot, onion, cucumber, pepper, mushroom, cabbage,
egg, sandwich/sandwiches, burger, pizza, pie, cake, biscuit, cookie, muffin, croissant, bagel, pancake, waffle,
doughnut, sausage, pastry/pastries, taco, burrito, dumpling, omelette, salad, steak, pickle, olive, peanut,
almond, walnut, chestnut, fig, radish/radishes, turnip, courgette, aubergine, sweet potato/sweet potatoes,
pumpkin, bean, pea, pretzel, cupcake, lollipop, chocolate bar, scone, crumpet, tart, brownie, meatball, samosa,
spring roll, kebab, curry/curries, hot dog, cheeseburger, fish cake, jacket potato/jacket potatoes, flapjack,
macaroon, cracker, sardine, prawn, oyster, mussel, clementine, tangerine, nectarine, grapefruit, pomegranate,
lychee, papaya, gooseberry/gooseberries, blackberry/blackberries, cauliflower, leek, parsnip, beetroot,
cinnamon roll, sponge cake, lemon tart, apple pie, pork pie, sausage roll, chicken wing, veggie burger
""")

MASS_FOODS = _words("""
rice, bread, cheese, butter, soup, pasta, spaghetti, chicken, beef, pork, lamb, fish, salmon, tuna, ham, bacon,
honey, jam, yoghurt, cereal, porridge, toast, popcorn, chocolate, ice cream, cream, sugar, salt, flour, garlic,
ginger, broccoli, spinach, celery, sweetcorn, tofu, hummus, sushi, chilli, mustard, ketchup, mayonnaise, vinegar,
olive oil, granola, muesli, pudding, custard, jelly, fudge, toffee, caramel, cinnamon, vanilla, paprika,
oatmeal, couscous, quinoa, lentil soup, tomato soup, tomato sauce, peanut butter, cheesecake, lasagne, risotto,
paella, goulash, chowder, stew, fruit salad, coleslaw, mashed potato, fried rice, noodle soup, garlic bread,
shortbread, marmalade, treacle, syrup, gravy, stuffing, pesto, guacamole, salsa, feta, mozzarella, cheddar,
parmesan, brie, duck, turkey, venison, trout, cod, haddock, mackerel, lobster, crab, squid, seaweed, kale,
asparagus, lettuce, rocket, watercress, basil, parsley, mint, coriander, thyme, rosemary
""")

FOOD_ADJECTIVES = _words("""
fresh, warm, hot, cold, spicy, sweet, sour, salty, delicious, tasty, crunchy, creamy, juicy, ripe, homemade,
organic, frozen, expensive, leftover, raw, smoked, roasted, grilled, fried, boiled, baked, sliced, chopped,
crispy, soft, tender, rich, plain, local, imported, tiny, huge, mild, fancy, vegan, tinned, dried, sugary,
chewy, zesty, tangy, buttery, fluffy, gooey, steaming, chilled, seasonal, wholemeal, traditional
""")

FOOD_CONTAINERS = _words("""
a bowl of, a plate of, a slice of, a piece of, a bag of, a box of, a jar of, a tin of, a kilo of, half a kilo of,
a packet of, a spoonful of, a handful of, a portion of, a tub of, a tray of, a pot of, a little, a lot of, plenty of
""")

DRINKS = _words("""
water, tea, coffee, milk, juice, orange juice, apple juice, lemonade, hot chocolate, cola, wine, red wine,
white wine, beer, cider, green tea, mint tea, sparkling water, cocoa, milkshake, iced tea, ginger beer,
tomato juice, cranberry juice, mango juice, herbal tea, espresso, cappuccino, lemon squash
""")

DRINK_CONTAINERS = _words("a cup of, a glass of, a bottle of, a mug of, a jug of, some, the, more")

PLACES = _nouns("""
library/libraries, station, airport, museum, hospital, school, university/universities, bank, bakery/bakeries,
supermarket, market, pharmacy/pharmacies, post office, cinema, theatre, restaurant, cafe, hotel, park,
beach/beaches, church/churches, mosque, temple, stadium, gym, swimming pool, zoo, farm, factory/factories,
office, shop, bookshop, garage, petrol station, bus stop, harbour, castle, palace, gallery/galleries,
concert hall, town hall, police station, fire station, courthouse, bridge, tower, lighthouse, village, forest,
lake, river, mountain, hill, valley, island, field, garden, playground, car park, shopping centre,
train station, clinic, laboratory/laboratories, studio, warehouse, pub, canteen, ice rink, bowling alley,
aquarium, botanical garden, campsite, marina, pier, square, tunnel, cathedral, monastery/monasteries,
skyscraper, market square, leisure centre, sports centre, youth hostel, bus station, harbour wall, windmill,
vineyard, orchard, allotment, nature reserve, car wash/car washes, launderette, hardware shop, flower shop, toy shop,
antique shop, butcher's/butchers, greengrocer's/greengrocers, newsagent's/newsagents, bakery counter, town centre,
art gallery/art galleries, science museum,
city hall, village hall, community centre, primary school, secondary school, nursery/nurseries, kindergarten,
dentist's/dentists, vet's/vets, cottage, farmhouse, mill, barn, chapel, fountain, statue, monument, embassy/embassies,
observatory/observatories, planetarium, water park, theme park, football ground, cricket ground, tennis court,
golf course, racecourse, ferry terminal, railway bridge, motorway bridge, old quarter, food market, flea market
""")

PLACE_ADJECTIVES = _words("""
busy, quiet, crowded, empty, old, new, modern, historic, famous, beautiful, ugly, small, large, huge, tiny, local,
nearby, popular, expensive, cheap, clean, dirty, noisy, peaceful, friendly, dark, bright, cosy, elegant, ancient,
colourful, charming, lovely, grand, narrow, spacious, remote, lively, sleepy, picturesque, run down, freshly
painted, brand new, little, huge, well known, hidden, abandoned, impressive, magnificent, gloomy, welcoming
""")

FURNITURE_SURFACES = _words("""
table, kitchen table, desk, shelf, top shelf, chair, sofa, bed, bench, counter, windowsill, floor, piano, fridge,
radiator, bookcase, dresser, coffee table, bedside table, stool, doorstep, car seat, mantelpiece, balcony
""")

CONTAINER_PLACES = _words("""
drawer, cupboard, wardrobe, kitchen, bedroom, bathroom, hallway, attic, basement, garage, car, garden,
living room, dining room, office, shed, cellar, loft, spare room, boot of the car, laundry basket, toy box,
glove box, kitchen drawer, hall cupboard, greenhouse, porch, conservatory, pantry, utility room
""")

NEAR_PLACES = _words("""
door, front door, back door, sofa, fridge, window, television, bookcase, curtains, stairs, fireplace, sink,
washing machine, radiator, mirror, coat rack, piano, bed, desk, wardrobe, cooker, dishwasher, gate
""")

ANIMAL_PLACES = _words("""
in the garden, under the table, near the river, behind the barn, on the roof, by the fence, in the field,
at the zoo, in the forest, on the beach, next to the pond, under the bridge, in the shade, on the sofa,
in the long grass, near the farmhouse, in the sun, by the lake, in the stable, on the hill, in the snow,
under a tree, in the hedge, on the wall, behind the shed, in the meadow, near the stream, on the doorstep,
in the barn, by the gate
""")

ANIMAL_VERBS_PAST = _words("""
slept, ran away, jumped, swam, hid, played, rested, waited, disappeared, appeared, wandered off, escaped, sat,
stood still, lay down, fell asleep, woke up, ate, drank, climbed, splashed about, rolled over, stretched, yawned,
shivered, sniffed around, curled up, dozed, sunbathed, kept watch, stayed quiet, looked around, sat quietly,
made a nest, waited patiently, trotted past, wandered around, ran in circles
""")

# Countries with their capital (empty where the answer is contested or surprising) and more of their cities.
_COUNTRIES_TABLE = """
the united kingdom | london | manchester, birmingham, liverpool, leeds, bristol, oxford, cambridge, edinburgh,
    glasgow, cardiff, belfast, york, brighton, newcastle, sheffield, nottingham, leicester, bath;
france | paris | lyon, marseille, nice, bordeaux, toulouse, lille, nantes, strasbourg;
germany | berlin | munich, hamburg, frankfurt, cologne, stuttgart, dresden, leipzig, dusseldorf;
spain | madrid | barcelona, valencia, seville, bilbao, malaga, granada, zaragoza;
italy | rome | milan, naples, florence, venice, turin, bologna, genoa, palermo, verona;
portugal | lisbon | porto, faro, coimbra;
the netherlands | amsterdam | rotterdam, utrecht, eindhoven, groningen;
belgium | brussels | antwerp, ghent, bruges;
switzerland | bern | zurich, geneva, basel, lausanne;
austria | vienna | salzburg, innsbruck, graz;
ireland | dublin | cork, galway, limerick;
sweden | stockholm | gothenburg, malmo, uppsala;
norway | oslo | bergen, trondheim, stavanger;
denmark | copenhagen | aarhus, odense;
finland | helsinki | tampere, turku;
iceland | reykjavik | ;
poland | warsaw | krakow, gdansk, wroclaw, poznan;
the czech republic | prague | brno;
hungary | budapest | debrecen;
greece | athens | thessaloniki, heraklion;
turkey | ankara | istanbul, izmir, antalya;
russia | moscow | saint petersburg, kazan, novosibirsk;
ukraine | kyiv | lviv, odesa, kharkiv;
romania | bucharest | constanta;
croatia | zagreb | dubrovnik;
serbia | belgrade | novi sad;
bulgaria | sofia | plovdiv, varna;
egypt | cairo | alexandria, luxor;
morocco | rabat | casablanca, marrakesh, fez, tangier;
nigeria | abuja | lagos, kano, ibadan;
kenya | nairobi | mombasa, kisumu;
south africa | | cape town, johannesburg, durban, pretoria;
ethiopia | addis ababa | ;
ghana | accra | kumasi;
tanzania | dodoma | dar es salaam, arusha, zanzibar;
the united states | washington | new york, los angeles, chicago, houston, phoenix, philadelphia, san antonio,
    san diego, dallas, san francisco, seattle, boston, denver, miami, atlanta, detroit, portland, nashville,
    las vegas, new orleans, austin, minneapolis;
canada | ottawa | toronto, montreal, vancouver, calgary, edmonton, quebec, winnipeg, halifax;
mexico | mexico city | guadalajara, monterrey, cancun, puebla;
brazil | brasilia | rio de janeiro, sao paulo, salvador, recife, fortaleza, manaus;
argentina | buenos aires | cordoba, rosario, mendoza;
chile | santiago | valparaiso;
peru | lima | cusco, arequipa;
colombia | bogota | medellin, cali, cartagena;
venezuela | caracas | ;
cuba | havana | ;
jamaica | kingston | montego bay;
india | new delhi | mumbai, bangalore, chennai, kolkata, hyderabad, pune, jaipur, ahmedabad;
pakistan | islamabad | karachi, lahore;
bangladesh | dhaka | chittagong;
sri lanka | | colombo, kandy;
nepal | kathmandu | pokhara;
china | beijing | shanghai, guangzhou, shenzhen, chengdu, wuhan, hangzhou, nanjing;
japan | tokyo | osaka, kyoto, yokohama, nagoya, sapporo, kobe, hiroshima, fukuoka;
south korea | seoul | busan, incheon, daegu;
vietnam | hanoi | ho chi minh city, da nang;
thailand | bangkok | chiang mai, phuket, pattaya;
malaysia | kuala lumpur | penang;
indonesia | | jakarta, surabaya, bandung, yogyakarta;
the philippines | manila | cebu, davao;
australia | canberra | sydney, melbourne, brisbane, perth, adelaide, hobart, darwin;
new zealand | wellington | auckland, christchurch, queenstown, dunedin;
saudi arabia | riyadh | jeddah;
the united arab emirates | abu dhabi | dubai;
qatar | doha | ;
iran | tehran | isfahan, shiraz;
jordan | amman | ;
lebanon | beirut |
"""


def _countries(text: str) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    out = []
    for raw in text.split(";"):
        country, capital, cities = (part.strip() for part in raw.split("|"))
        others = _words(cities) if cities else ()
        capital = _clean(capital) if capital else ""
        out.append((_clean(country), capital, ((capital,) if capital else ()) + others))
    return tuple(out)


COUNTRIES_WITH_CITIES = _countries(_COUNTRIES_TABLE)

OTHER_COUNTRIES = _words("""
bolivia, ecuador, uruguay, paraguay, panama, costa rica, guatemala, honduras, nicaragua, estonia, latvia,
lithuania, slovakia, slovenia, albania, malta, cyprus, luxembourg, monaco, armenia, mongolia, cambodia, laos,
rwanda, zambia, zimbabwe, botswana, namibia, senegal, tunisia, madagascar, mauritius, fiji, samoa, kazakhstan,
uzbekistan, oman, kuwait, bahrain, scotland, wales, england, northern ireland
""")

LANGUAGES = _words("""
english, french, german, spanish, italian, portuguese, dutch, swedish, norwegian, danish, finnish, polish, greek,
turkish, russian, arabic, hindi, urdu, bengali, chinese, mandarin, cantonese, japanese, korean, vietnamese, thai,
indonesian, swahili, hebrew, persian, welsh, irish, latin, ukrainian, czech, hungarian, romanian, tamil, punjabi,
malay, icelandic, gujarati
""")

SCHOOL_SUBJECTS = _words("""
maths, history, geography, biology, chemistry, physics, economics, philosophy, music, art, literature,
engineering, medicine, law, psychology, sociology, computer science, architecture, astronomy, statistics,
politics, drama, accounting, nursing, journalism, anthropology, archaeology, geology, linguistics, marketing
""")

SPORTS = _words("""
football, tennis, basketball, cricket, rugby, golf, hockey, baseball, volleyball, badminton, table tennis, chess,
squash, netball, darts, snooker, handball, water polo, ice hockey, lacrosse, softball, bowls, croquet, polo
""")

INSTRUMENTS = _words("""
the piano, the guitar, the violin, the drums, the flute, the trumpet, the cello, the saxophone, the clarinet,
the harp, the trombone, the ukulele, the harmonica, the accordion, the bagpipes, the organ, the recorder,
the double bass, the oboe, the banjo, the tuba, the xylophone
""")

TOPICS = _words("""
history, the ocean, space, dinosaurs, climate change, ancient rome, the weather, politics, cooking, gardening,
travel, music, art, science, football, money, the future, the election, the new bridge, their holiday,
the economy, robots, medicine, volcanoes, the moon, the stars, insects, birds, trains, architecture, fashion,
philosophy, friendship, love, family, childhood, sleep, happiness, mathematics, languages, the internet,
computers, electricity, farming, the sea, mountains, deserts, forests, rivers, castles, kings and queens,
pirates, ghosts, crime, the brain, memory, dreams, the human body, nutrition, exercise, photography, poetry,
painting, sculpture, democracy, education, health, energy, transport, cities, islands, bees, whales, ancient egypt,
the vikings, the romans, the industrial revolution, the solar system, black holes, the rainforest, coral reefs,
recycling, renewable energy, wildlife, the olympic games, jazz, opera, chocolate, coffee, tea, bread, wine,
cheese, small businesses, the local council, public transport, housing, tourism, the stock market, inflation,
artificial intelligence, social media, video games, board games, the arctic, antarctica, the desert, earthquakes,
hurricanes, the tides, migration, evolution, genetics, vaccines, the heart, bones, the seasons, the calendar
""")

EVENTS = _words("""
meeting, concert, match, lecture, class, lesson, party, wedding, film, show, conference, interview, appointment,
exam, game, rehearsal, ceremony, parade, festival, workshop, seminar, tour, race, auction, dinner, lunch,
presentation, debate, quiz, opening, premiere, performance, exhibition, fair, barbecue, picnic, reunion,
graduation, celebration, competition, tournament, recital, play, ballet, opera, training session, book launch,
job fair, birthday party, dinner party, staff meeting, school play, football match, charity run, book club,
car boot sale, jumble sale, press conference, board meeting, talent show, fashion show, open day, parents evening,
carol service, fireworks display, art class, cookery class, yoga class, swimming lesson, piano lesson
""")

PERSON_ADJECTIVES = _words("""
kind, friendly, tall, short, young, old, busy, tired, happy, sad, angry, nervous, excited, quiet, loud, clever,
brave, shy, polite, rude, funny, serious, patient, honest, generous, lazy, hardworking, calm, cheerful, grumpy,
proud, worried, lonely, famous, helpful, careful, confident, curious, gentle, strict, wise, sleepy, hungry,
thirsty, bored, surprised, confused, pleased, grateful, jealous, anxious, relaxed, energetic, talented, elderly,
healthy, strong, rich, poor, smart, silly, charming, modest, ambitious, stubborn, sensible, thoughtful, cheeky,
new, retired, local, experienced, young, enthusiastic
""")

MANNER_ADVERBS = _words("""
quickly, slowly, carefully, quietly, loudly, happily, sadly, easily, suddenly, finally, eventually, gently,
politely, nervously, patiently, immediately, secretly, proudly, angrily, calmly, eagerly, reluctantly, properly,
again, together, alone, on purpose, by accident, in a hurry, without a word, with a smile,
for the first time, at last, in the end, as usual, gladly, silently, cheerfully, anxiously, bravely, casually,
clumsily, confidently, deliberately, efficiently, elegantly, fiercely, foolishly, generously, gracefully,
honestly, kindly, lazily, neatly, perfectly, rapidly, safely, seriously, smoothly, softly, swiftly,
thoughtfully, warmly, wisely, willingly, hurriedly, noisily, awkwardly, boldly, brilliantly, carelessly,
cautiously, correctly, doubtfully, enthusiastically, faithfully, frankly, gratefully, hastily, innocently,
joyfully, loyally, merrily, mysteriously, obediently, openly, painfully, playfully, promptly, quietly,
randomly, readily, regularly, repeatedly, rudely, sensibly, shyly, sleepily, solemnly, speedily, steadily,
sternly, tenderly, tightly, truthfully, unexpectedly, vaguely, wearily, wildly, without complaining,
in silence, in secret, with great care, once again
""")

FREQUENCY_ADVERBS = _words(
    "always, usually, often, sometimes, rarely, never, occasionally, normally, generally, seldom, regularly, "
    "hardly ever, nearly always, frequently"
)

DAYS = _words("monday, tuesday, wednesday, thursday, friday, saturday, sunday")
MONTHS = _words("january, february, march, april, may, june, july, august, september, october, november, december")
SEASONS = _words("spring, summer, autumn, winter")
PARTS_OF_DAY = _words("morning, afternoon, evening, night")

WEATHER_TEMPERATURES = _words("""
cold, warm, hot, mild, chilly, freezing, humid, muggy, sweltering, cool, bitterly cold, fresh, baking hot,
pleasant, close
""")

WEATHER_SKIES = _words("""
sunny, cloudy, rainy, windy, foggy, misty, stormy, snowy, dry, wet, grey, bright, clear, overcast, frosty, icy,
breezy, gloomy, damp, dull, blustery, drizzly, changeable, unsettled, fine, showery, calm
""")

WEATHER_ADJECTIVES = WEATHER_TEMPERATURES + WEATHER_SKIES + _words("miserable, lovely, glorious, horrible")

WEATHER_NOUNS = _words("""
heavy rain, strong winds, light snow, thunderstorms, sunny spells, scattered showers, thick fog, freezing fog,
hail, sleet, frost, gales, drizzle, bright sunshine, low cloud, patchy mist, icy roads, high temperatures,
a few showers, clear skies, heavy snow, light winds, black ice, torrential rain, blustery showers,
hot sunshine, some sunshine, outbreaks of rain, long sunny spells, cold winds, a sharp frost, a heatwave,
thunder and lightning, flooding, strong gusts, light rain, snow showers, mist and fog, warm sunshine,
cloudy skies, rain and sleet
""")

WEATHER_VERBS = _verbs("""
rain/rains/rained/rained/raining, snow/snows/snowed/snowed/snowing, pour/pours/poured/poured/pouring,
drizzle/drizzles/drizzled/drizzled/drizzling, hail/hails/hailed/hailed/hailing,
freeze/freezes/froze/frozen/freezing, clear up/clears up/cleared up/cleared up/clearing up,
brighten up/brightens up/brightened up/brightened up/brightening up,
get colder/gets colder/got colder/got colder/getting colder,
get warmer/gets warmer/got warmer/got warmer/getting warmer,
stay dry/stays dry/stayed dry/stayed dry/staying dry, cloud over/clouds over/clouded over/clouded over/clouding over
""")

REGIONS = _words("""
in the north, in the south, in the east, in the west, along the coast, in the mountains, across the country,
in the city centre, over the hills, in the valleys, near the border, on the islands, in the northeast,
in the northwest, in the southeast, in the southwest, across the region, in the highlands, on high ground,
in coastal areas, in most places, further inland, across the whole country, in the capital
""")

TOO_REASONS = _words(
    "cold, hot, wet, windy, foggy, stormy, icy, dark, late, early, expensive, far, crowded, noisy, busy, "
    "tiring, complicated, risky, muddy, slippery, difficult"
)

SAID = _words("""
said, thought, explained, mentioned, heard, knew, noticed, remembered, claimed, admitted, realised, believed,
suspected, guessed, felt, complained, announced, wrote, whispered, insisted, read, discovered, found out, learned,
agreed, replied, joked, doubted, worried, told me, told us, pointed out, confirmed, reported
""")

THINKS = _words("""
says, thinks, believes, knows, hopes, expects, imagines, reckons, promises, suspects, feels, doubts, worries,
insists, agrees, claims, guesses, warns, is sure, is afraid, is worried, tells me, keeps saying, still believes
""")

GENERAL_ADVERBS = _words("""
again, together, alone, early, recently, for the first time, at last, in the end, as usual, in a hurry, quickly,
happily, finally, eventually, immediately, secretly, reluctantly, willingly, on purpose, by accident,
without complaining, once again, with a smile, gladly, proudly, nervously, carefully, quietly, slowly, suddenly,
twice, first, without asking, without any help, just in time, by mistake
""")

OPINIONS = _words(
    "like, love, really like, quite like, enjoy, adore, don't like, can't stand, prefer, really love, hate, "
    "don't mind, am fond of, never eat"
)

OCCASIONS = _words(
    "christmas, the wedding, the new year, eid, diwali, the holidays, the housewarming, the leaving party, "
    "valentine's day, mother's day, father's day, the christening, the anniversary, the graduation"
)

# Verbs whose object is a thing, food, drink, person, animal, place or destination.
THING_VERBS = _verbs("""
buy/buys/bought/bought/buying, find/finds/found/found/finding, lose/loses/lost/lost/losing,
carry/carries/carried/carried/carrying, clean/cleans/cleaned/cleaned/cleaning, fix/fixes/fixed/fixed/fixing,
move/moves/moved/moved/moving, sell/sells/sold/sold/selling, borrow/borrows/borrowed/borrowed/borrowing,
check/checks/checked/checked/checking, wrap/wraps/wrapped/wrapped/wrapping, drop/drops/dropped/dropped/dropping,
hide/hides/hid/hidden/hiding, break/breaks/broke/broken/breaking, replace/replaces/replaced/replaced/replacing,
order/orders/ordered/ordered/ordering, pack/packs/packed/packed/packing, keep/keeps/kept/kept/keeping,
choose/chooses/chose/chosen/choosing, pick up/picks up/picked up/picked up/picking up,
put away/puts away/put away/put away/putting away, throw away/throws away/threw away/thrown away/throwing away,
give away/gives away/gave away/given away/giving away, bring/brings/brought/brought/bringing,
take/takes/took/taken/taking, send/sends/sent/sent/sending, need/needs/needed/needed/-,
want/wants/wanted/wanted/-, forget/forgets/forgot/forgotten/forgetting,
return/returns/returned/returned/returning, wash/washes/washed/washed/washing, dry/dries/dried/dried/drying,
weigh/weighs/weighed/weighed/weighing, repair/repairs/repaired/repaired/repairing,
decorate/decorates/decorated/decorated/decorating, polish/polishes/polished/polished/polishing,
examine/examines/examined/examined/examining,
photograph/photographs/photographed/photographed/photographing, draw/draws/drew/drawn/drawing,
describe/describes/described/described/describing, look for/looks for/looked for/looked for/looking for,
look at/looks at/looked at/looked at/looking at, search for/searches for/searched for/searched for/searching for,
deliver/delivers/delivered/delivered/delivering, share/shares/shared/shared/sharing,
steal/steals/stole/stolen/stealing, rent/rents/rented/rented/renting,
collect/collects/collected/collected/collecting, display/displays/displayed/displayed/displaying,
inspect/inspects/inspected/inspected/inspecting, swap/swaps/swapped/swapped/swapping,
hold/holds/held/held/holding, grab/grabs/grabbed/grabbed/grabbing, lift/lifts/lifted/lifted/lifting,
shake/shakes/shook/shaken/shaking, throw/throws/threw/thrown/throwing, catch/catches/caught/caught/catching,
fold/folds/folded/folded/folding, drag/drags/dragged/dragged/dragging, sort/sorts/sorted/sorted/sorting,
touch/touches/touched/touched/touching, notice/notices/noticed/noticed/noticing,
admire/admires/admired/admired/admiring, test/tests/tested/tested/testing, use/uses/used/used/using,
own/owns/owned/owned/-, mend/mends/mended/mended/mending, unpack/unpacks/unpacked/unpacked/unpacking,
recycle/recycles/recycled/recycled/recycling, donate/donates/donated/donated/donating,
win/wins/won/won/winning, receive/receives/received/received/receiving, label/labels/labelled/labelled/labelling,
measure/measures/measured/measured/measuring, paint/paints/painted/painted/painting,
hang up/hangs up/hung up/hung up/hanging up, design/designs/designed/designed/designing,
sketch/sketches/sketched/sketched/sketching, misplace/misplaces/misplaced/misplaced/misplacing,
accept/accepts/accepted/accepted/accepting, spot/spots/spotted/spotted/spotting,
give back/gives back/gave back/given back/giving back, bring back/brings back/brought back/brought back/bringing back,
leave behind/leaves behind/left behind/left behind/leaving behind, like/likes/liked/liked/-,
love/loves/loved/loved/-, hate/hates/hated/hated/-, insure/insures/insured/insured/insuring,
guard/guards/guarded/guarded/guarding, lock away/locks away/locked away/locked away/locking away
""")

FOOD_VERBS = _verbs("""
eat/eats/ate/eaten/eating, cook/cooks/cooked/cooked/cooking, buy/buys/bought/bought/buying,
order/orders/ordered/ordered/ordering, taste/tastes/tasted/tasted/tasting, share/shares/shared/shared/sharing,
prepare/prepares/prepared/prepared/preparing, try/tries/tried/tried/trying,
enjoy/enjoys/enjoyed/enjoyed/enjoying, finish/finishes/finished/finished/finishing,
serve/serves/served/served/serving, sell/sells/sold/sold/selling, bring/brings/brought/brought/bringing,
make/makes/made/made/making, heat up/heats up/heated up/heated up/heating up,
devour/devours/devoured/devoured/devouring, freeze/freezes/froze/frozen/freezing,
warm up/warms up/warmed up/warmed up/warming up, smell/smells/smelled/smelled/smelling,
pay for/pays for/paid for/paid for/paying for, like/likes/liked/liked/-, love/loves/loved/loved/-,
hate/hates/hated/hated/-, want/wants/wanted/wanted/-, need/needs/needed/needed/-,
pack/packs/packed/packed/packing, deliver/delivers/delivered/delivered/delivering,
nibble/nibbles/nibbled/nibbled/nibbling, reheat/reheats/reheated/reheated/reheating,
save/saves/saved/saved/saving, offer/offers/offered/offered/offering,
recommend/recommends/recommended/recommended/recommending, weigh/weighs/weighed/weighed/weighing,
throw away/throws away/threw away/thrown away/throwing away, grab/grabs/grabbed/grabbed/grabbing
""")

DRINK_VERBS = _verbs("""
drink/drinks/drank/drunk/drinking, pour/pours/poured/poured/pouring, sip/sips/sipped/sipped/sipping,
spill/spills/spilled/spilled/spilling, order/orders/ordered/ordered/ordering, bring/brings/brought/brought/bringing,
make/makes/made/made/making, buy/buys/bought/bought/buying, share/shares/shared/shared/sharing,
finish/finishes/finished/finished/finishing, want/wants/wanted/wanted/-, offer/offers/offered/offered/offering,
serve/serves/served/served/serving, heat up/heats up/heated up/heated up/heating up,
taste/tastes/tasted/tasted/tasting, carry/carries/carried/carried/carrying
""")

PERSON_VERBS = _verbs("""
meet/meets/met/met/meeting, call/calls/called/called/calling, visit/visits/visited/visited/visiting,
help/helps/helped/helped/helping, thank/thanks/thanked/thanked/thanking, invite/invites/invited/invited/inviting,
phone/phones/phoned/phoned/phoning, hug/hugs/hugged/hugged/hugging, teach/teaches/taught/taught/teaching,
follow/follows/followed/followed/following, ask/asks/asked/asked/asking,
remember/remembers/remembered/remembered/-, miss/misses/missed/missed/missing,
recognise/recognises/recognised/recognised/-, warn/warns/warned/warned/warning,
interview/interviews/interviewed/interviewed/interviewing, pay/pays/paid/paid/paying,
greet/greets/greeted/greeted/greeting, trust/trusts/trusted/trusted/-,
surprise/surprises/surprised/surprised/surprising, wake up/wakes up/woke up/woken up/waking up,
pick up/picks up/picked up/picked up/picking up, join/joins/joined/joined/joining,
text/texts/texted/texted/texting, email/emails/emailed/emailed/emailing,
contact/contacts/contacted/contacted/contacting, encourage/encourages/encouraged/encouraged/encouraging,
congratulate/congratulates/congratulated/congratulated/congratulating,
comfort/comforts/comforted/comforted/comforting, wait for/waits for/waited for/waited for/waiting for,
look after/looks after/looked after/looked after/looking after, talk to/talks to/talked to/talked to/talking to,
listen to/listens to/listened to/listened to/listening to, write to/writes to/wrote to/written to/writing to,
argue with/argues with/argued with/argued with/arguing with,
dance with/dances with/danced with/danced with/dancing with,
chat with/chats with/chatted with/chatted with/chatting with,
believe/believes/believed/believed/-, forgive/forgives/forgave/forgiven/forgiving,
hire/hires/hired/hired/hiring, support/supports/supported/supported/supporting,
ignore/ignores/ignored/ignored/ignoring, interrupt/interrupts/interrupted/interrupted/interrupting,
praise/praises/praised/praised/praising, rescue/rescues/rescued/rescued/rescuing,
protect/protects/protected/protected/protecting, blame/blames/blamed/blamed/blaming,
inform/informs/informed/informed/informing, remind/reminds/reminded/reminded/reminding,
bother/bothers/bothered/bothered/bothering, impress/impresses/impressed/impressed/impressing,
tease/teases/teased/teased/teasing, see/sees/saw/seen/seeing, watch/watches/watched/watched/watching,
meet up with/meets up with/met up with/met up with/meeting up with,
catch up with/catches up with/caught up with/caught up with/catching up with,
say goodbye to/says goodbye to/said goodbye to/said goodbye to/saying goodbye to,
say hello to/says hello to/said hello to/said hello to/saying hello to,
shout at/shouts at/shouted at/shouted at/shouting at, smile at/smiles at/smiled at/smiled at/smiling at,
wave at/waves at/waved at/waved at/waving at,
apologise to/apologises to/apologised to/apologised to/apologising to,
agree with/agrees with/agreed with/agreed with/agreeing with,
work with/works with/worked with/worked with/working with,
travel with/travels with/travelled with/travelled with/travelling with,
have lunch with/has lunch with/had lunch with/had lunch with/having lunch with,
have dinner with/has dinner with/had dinner with/had dinner with/having dinner with,
go out with/goes out with/went out with/gone out with/going out with,
cheer up/cheers up/cheered up/cheered up/cheering up, calm down/calms down/calmed down/calmed down/calming down,
rely on/relies on/relied on/relied on/-, take care of/takes care of/took care of/taken care of/taking care of,
stay with/stays with/stayed with/stayed with/staying with, vote for/votes for/voted for/voted for/voting for,
ring/rings/rang/rung/ringing, look for/looks for/looked for/looked for/looking for
""")

ANIMAL_VERBS = _verbs("""
feed/feeds/fed/fed/feeding, walk/walks/walked/walked/walking, chase/chases/chased/chased/chasing,
photograph/photographs/photographed/photographed/photographing, watch/watches/watched/watched/watching,
draw/draws/drew/drawn/drawing, stroke/strokes/stroked/stroked/stroking, follow/follows/followed/followed/following,
scare/scares/scared/scared/scaring, spot/spots/spotted/spotted/spotting, rescue/rescues/rescued/rescued/rescuing,
see/sees/saw/seen/seeing, hear/hears/heard/heard/hearing, catch/catches/caught/caught/catching,
wash/washes/washed/washed/washing, train/trains/trained/trained/training, adopt/adopts/adopted/adopted/adopting,
film/films/filmed/filmed/filming, look after/looks after/looked after/looked after/looking after,
count/counts/counted/counted/counting, frighten/frightens/frightened/frightened/frightening,
find/finds/found/found/finding, lose/loses/lost/lost/losing, hold/holds/held/held/holding,
brush/brushes/brushed/brushed/brushing, study/studies/studied/studied/studying,
sketch/sketches/sketched/sketched/sketching, notice/notices/noticed/noticed/noticing,
buy/buys/bought/bought/buying, sell/sells/sold/sold/selling,
search for/searches for/searched for/searched for/searching for
""")

PLACE_VERBS = _verbs("""
visit/visits/visited/visited/visiting, leave/leaves/left/left/leaving, reach/reaches/reached/reached/reaching,
explore/explores/explored/explored/exploring, clean/cleans/cleaned/cleaned/cleaning,
paint/paints/painted/painted/painting, find/finds/found/found/finding,
photograph/photographs/photographed/photographed/photographing, enter/enters/entered/entered/entering,
draw/draws/drew/drawn/drawing, describe/describes/described/described/describing,
walk past/walks past/walked past/walked past/walking past, drive past/drives past/drove past/driven past/driving past,
look for/looks for/looked for/looked for/looking for, return to/returns to/returned to/returned to/returning to,
go to/goes to/went to/gone to/going to, walk to/walks to/walked to/walked to/walking to,
drive to/drives to/drove to/driven to/driving to, hurry to/hurries to/hurried to/hurried to/hurrying to,
arrive at/arrives at/arrived at/arrived at/arriving at, stay at/stays at/stayed at/stayed at/staying at,
work at/works at/worked at/worked at/working at,
wait outside/waits outside/waited outside/waited outside/waiting outside,
design/designs/designed/designed/designing, build/builds/built/built/building,
recommend/recommends/recommended/recommended/recommending, avoid/avoids/avoided/avoided/avoiding,
love/loves/loved/loved/-, like/likes/liked/liked/-, sketch/sketches/sketched/sketched/sketching,
search/searches/searched/searched/searching, renovate/renovates/renovated/renovated/renovating,
run/runs/ran/run/running, manage/manages/managed/managed/managing, own/owns/owned/owned/-,
rebuild/rebuilds/rebuilt/rebuilt/rebuilding, cycle to/cycles to/cycled to/cycled to/cycling to,
head to/heads to/headed to/headed to/heading to, get to/gets to/got to/got to/getting to
""")

TRAVEL_VERBS = _verbs("""
visit/visits/visited/visited/visiting, fly to/flies to/flew to/flown to/flying to,
drive to/drives to/drove to/driven to/driving to, travel to/travels to/travelled to/travelled to/travelling to,
move to/moves to/moved to/moved to/moving to, return to/returns to/returned to/returned to/returning to,
go back to/goes back to/went back to/gone back to/going back to,
come back from/comes back from/came back from/come back from/coming back from, go to/goes to/went to/gone to/going to,
leave/leaves/left/left/leaving, explore/explores/explored/explored/exploring,
cycle to/cycles to/cycled to/cycled to/cycling to, sail to/sails to/sailed to/sailed to/sailing to,
take the train to/takes the train to/took the train to/taken the train to/taking the train to,
emigrate to/emigrates to/emigrated to/emigrated to/emigrating to,
arrive in/arrives in/arrived in/arrived in/arriving in, stay in/stays in/stayed in/stayed in/staying in,
live in/lives in/lived in/lived in/living in, work in/works in/worked in/worked in/working in,
study in/studies in/studied in/studied in/studying in,
spend a week in/spends a week in/spent a week in/spent a week in/spending a week in,
go on holiday to/goes on holiday to/went on holiday to/gone on holiday to/going on holiday to,
hitchhike to/hitchhikes to/hitchhiked to/hitchhiked to/hitchhiking to, tour/tours/toured/toured/touring,
backpack around/backpacks around/backpacked around/backpacked around/backpacking around
""")

INTRANSITIVE_VERBS = _verbs("""
sleep/sleeps/slept/slept/sleeping, laugh/laughs/laughed/laughed/laughing, smile/smiles/smiled/smiled/smiling,
arrive/arrives/arrived/arrived/arriving, wait/waits/waited/waited/waiting, cry/cries/cried/cried/crying,
dance/dances/danced/danced/dancing, sing/sings/sang/sung/singing, swim/swims/swam/swum/swimming,
run/runs/ran/run/running, walk home/walks home/walked home/walked home/walking home,
cough/coughs/coughed/coughed/coughing, sneeze/sneezes/sneezed/sneezed/sneezing,
shout/shouts/shouted/shouted/shouting, rest/rests/rested/rested/resting, relax/relaxes/relaxed/relaxed/relaxing,
work late/works late/worked late/worked late/working late,
study hard/studies hard/studied hard/studied hard/studying hard, win/wins/won/won/winning,
lose/loses/lost/lost/losing, travel abroad/travels abroad/travelled abroad/travelled abroad/travelling abroad,
fall asleep/falls asleep/fell asleep/fallen asleep/falling asleep,
wake up early/wakes up early/woke up early/woken up early/waking up early,
get up early/gets up early/got up early/got up early/getting up early,
stay at home/stays at home/stayed at home/stayed at home/staying at home,
stay in bed/stays in bed/stayed in bed/stayed in bed/staying in bed, go home/goes home/went home/gone home/going home,
come home/comes home/came home/come home/coming home, leave early/leaves early/left early/left early/leaving early,
sit down/sits down/sat down/sat down/sitting down, stand up/stands up/stood up/stood up/standing up,
give up/gives up/gave up/given up/giving up, hurry up/hurries up/hurried up/hurried up/hurrying up,
show up/shows up/showed up/shown up/showing up, set off/sets off/set off/set off/setting off,
turn around/turns around/turned around/turned around/turning around,
complain/complains/complained/complained/complaining, apologise/apologises/apologised/apologised/apologising,
agree/agrees/agreed/agreed/agreeing, disagree/disagrees/disagreed/disagreed/disagreeing,
succeed/succeeds/succeeded/succeeded/succeeding, improve/improves/improved/improved/improving,
practise/practises/practised/practised/practising, exercise/exercises/exercised/exercised/exercising,
meditate/meditates/meditated/meditated/meditating, volunteer/volunteers/volunteered/volunteered/volunteering,
panic/panics/panicked/panicked/panicking, hesitate/hesitates/hesitated/hesitated/hesitating,
whisper/whispers/whispered/whispered/whispering, yawn/yawns/yawned/yawned/yawning,
shiver/shivers/shivered/shivered/shivering, nod/nods/nodded/nodded/nodding, wave/waves/waved/waved/waving,
clap/claps/clapped/clapped/clapping, jog/jogs/jogged/jogged/jogging, skate/skates/skated/skated/skating,
ski/skis/skied/skied/skiing, sail/sails/sailed/sailed/sailing, dive/dives/dived/dived/diving,
climb/climbs/climbed/climbed/climbing, cycle/cycles/cycled/cycled/cycling, knit/knits/knitted/knitted/knitting,
bake/bakes/baked/baked/baking, read/reads/read/read/reading, write/writes/wrote/written/writing,
cook/cooks/cooked/cooked/cooking, tidy up/tidies up/tidied up/tidied up/tidying up,
pray/prays/prayed/prayed/praying, vote/votes/voted/voted/voting,
celebrate/celebrates/celebrated/celebrated/celebrating, graduate/graduates/graduated/graduated/graduating,
retire/retires/retired/retired/retiring, recover/recovers/recovered/recovered/recovering,
disappear/disappears/disappeared/disappeared/disappearing, stay calm/stays calm/stayed calm/stayed calm/staying calm,
listen/listens/listened/listened/listening, hurry/hurries/hurried/hurried/hurrying,
queue/queues/queued/queued/queueing, garden/gardens/gardened/gardened/gardening,
camp/camps/camped/camped/camping, fish/fishes/fished/fished/fishing, hike/hikes/hiked/hiked/hiking,
sunbathe/sunbathes/sunbathed/sunbathed/sunbathing, snore/snores/snored/snored/snoring,
blush/blushes/blushed/blushed/blushing, frown/frowns/frowned/frowned/frowning, sigh/sighs/sighed/sighed/sighing,
giggle/giggles/giggled/giggled/giggling, grin/grins/grinned/grinned/grinning,
stretch/stretches/stretched/stretched/stretching, kneel/kneels/knelt/knelt/kneeling, bow/bows/bowed/bowed/bowing,
stumble/stumbles/stumbled/stumbled/stumbling, trip/trips/tripped/tripped/tripping,
fall over/falls over/fell over/fallen over/falling over, slip/slips/slipped/slipped/slipping,
escape/escapes/escaped/escaped/escaping, survive/survives/survived/survived/surviving,
concentrate/concentrates/concentrated/concentrated/concentrating, revise/revises/revised/revised/revising,
commute/commutes/commuted/commuted/commuting, oversleep/oversleeps/overslept/overslept/oversleeping,
sleep in/sleeps in/slept in/slept in/sleeping in, eat out/eats out/ate out/eaten out/eating out,
move house/moves house/moved house/moved house/moving house, settle in/settles in/settled in/settled in/settling in,
wake up/wakes up/woke up/woken up/waking up, calm down/calms down/calmed down/calmed down/calming down,
cheer up/cheers up/cheered up/cheered up/cheering up, slow down/slows down/slowed down/slowed down/slowing down,
speed up/speeds up/sped up/sped up/speeding up, warm up/warms up/warmed up/warmed up/warming up,
work from home/works from home/worked from home/worked from home/working from home
""")

ACTIVITIES = _activities("""
play/plays/played/played/playing: {sport} | {instrument} | cards | hide and seek | a board game | a game of chess
    | {sport} with {person} | in the garden | in the park | a trick on {person} | a duet with {person};
learn/learns/learned/learned/learning: {language} | to swim | to drive | to cook | to play {instrument} | to ski
    | to knit | to dance | how to juggle | about {topic} | the alphabet | some new words in {language} | the rules;
study/studies/studied/studied/studying: {subject} | {subject} at the university in {city} | for the exam
    | {language} | the map | the timetable | the menu | the results;
speak/speaks/spoke/spoken/speaking: {language} | {language} at home | to the {profession} | to the manager
    | at the {event} | to a lawyer | to the press;
teach/teaches/taught/taught/teaching: {subject} | {language} | {subject} at a school in {city}
    | the children to swim | music | yoga | a cookery class | drama at the local school;
watch/watches/watched/watched/watching: a film about {topic} | the news | a documentary about {topic} | the match
    | the sunset | the fireworks | a comedy | the parade | the rain | the birds | the {event} on television
    | a cartoon | the boats in the harbour | a western | the tennis final;
read/reads/read/read/reading: a book about {topic} | the newspaper | a novel by {full_name}
    | a letter from {person} | the instructions | the menu | a story to the children | the {ordinal} chapter
    | the contract | a poem | the small print | a magazine article about {topic};
write/writes/wrote/written/writing: a letter to {person} | an email to {person} | a story about {topic}
    | a report on {topic} | a poem about {topic} | a song about {topic} | a shopping list
    | a postcard from {city} | a book about {topic} | a speech for the {event} | a thank you note;
listen to/listens to/listened to/listened to/listening to: music | the radio | a podcast about {topic}
    | the news | the rain | the birds | an old record | classical music | jazz | the weather forecast
    | the football on the radio;
talk about/talks about/talked about/talked about/talking about: {topic} | the trip to {city} | the {event};
think about/thinks about/thought about/thought about/thinking about: {topic} | the future | moving to {city}
    | {person} | the {event};
dream about/dreams about/dreamed about/dreamed about/dreaming about: {topic} | living in {city}
    | a house by the sea | winning the lottery;
go/goes/went/gone/going: shopping | swimming | fishing | hiking | skiing | running | cycling | camping | sailing
    | dancing | bowling | skating | climbing | home | to bed early | to the {place_noun} | to {city}
    | for a walk | for a run | on holiday | abroad | to work | to school | to the doctor's | for a swim
    | to the {event} | on a school trip | to the seaside;
take/takes/took/taken/taking: a taxi | the bus | the train to {city} | a photo of the {place_noun} | a nap
    | a shower | a long walk | a short break | an exam | the dog for a walk | the children to school
    | some medicine | a day off | the lift | the stairs | a deep breath | the wrong turning;
have/has/had/had/having: breakfast | lunch | dinner | a picnic | a party | a bath | a shower
    | a cup of {drink} | a meeting with {person} | a chat with {person} | a rest | a good time | a haircut
    | an argument with {person} | a barbecue | a late supper | a day off | a lie in;
do/does/did/done/doing: the washing up | the laundry | the shopping | the homework | the dishes
    | some exercise | yoga | the crossword | the ironing | the gardening | a puzzle | the cleaning
    | some research on {topic} | a good job | the accounts | a course in {subject} | a sponsored walk;
make/makes/made/made/making: a cake | dinner | a phone call | a mistake | a list | a decision | a sandwich
    | a plan | some tea | a reservation | a speech | a cup of coffee | a snowman | a mess | a new friend | a wish
    | breakfast | a dress | a video about {topic} | a model of the {place_noun} | a birthday card for {person};
catch/catches/caught/caught/catching: the bus | the train | the early flight | the last ferry | a cold | a fish
    | the ball | the night bus | the last train home;
clean/cleans/cleaned/cleaned/cleaning: the kitchen | the bathroom | the windows | the car | the garage | the house
    | the oven | the fridge | the carpets;
win/wins/won/won/winning: the race | the match | a prize | the lottery | the competition | an award | the game
    | the election | a medal | the cup | the quiz;
miss/misses/missed/missed/missing: the bus | the train | the flight | the last ferry | the meeting
    | the deadline | the start of the film | home | the old days;
plan/plans/planned/planned/planning: a trip to {city} | a party for {person} | a holiday in {country}
    | the wedding | the meeting | a surprise for {person} | the route | a new garden;
book/books/booked/booked/booking: a table for {small} | a room in {city} | tickets for the {event}
    | a flight to {city} | a taxi | an appointment with the {profession} | a holiday in {country}
    | a hotel near the {place_noun};
organise/organises/organised/organised/organising: a party | a meeting | a concert | the trip to {city}
    | a picnic | a charity event | the {event} | the files | the wardrobe;
attend/attends/attended/attended/attending: the {event} | the {event} in {city} | a course on {topic}
    | a wedding | a conference in {city} | evening classes;
cancel/cancels/cancelled/cancelled/cancelling: the {event} | the order | the trip to {city}
    | the subscription | the appointment | the flight | the booking | the delivery;
celebrate/celebrates/celebrated/celebrated/celebrating: the new year | the wedding anniversary | the victory
    | the good news | the end of the exams | the birth of the baby | {name}'s birthday | {occasion};
practise/practises/practised/practised/practising: {instrument} | {sport} | the speech | {language}
    | the song | the dance | the lines for the play;
fill in/fills in/filled in/filled in/filling in: the form | the application | the survey | the questionnaire;
sign/signs/signed/signed/signing: the contract | the form | the letter | the petition | the card | the lease;
open/opens/opened/opened/opening: the window | the door | the parcel | the letter | a bank account
    | a new shop in {city} | the box | the curtains | the presents | a restaurant in {city} | the gate;
close/closes/closed/closed/closing: the window | the door | the shop | the curtains | the gate | the account
    | the lid;
turn off/turns off/turned off/turned off/turning off: the lights | the television | the radio | the oven
    | the heating | the computer | the alarm | the tap | the engine | the music;
turn on/turns on/turned on/turned on/turning on: the lights | the television | the radio | the oven
    | the heating | the computer | the kettle | the fan | the dishwasher;
lock/locks/locked/locked/locking: the door | the car | the gate | the bike | the drawer | the front door | the shed;
grow/grows/grew/grown/growing: tomatoes | potatoes | sunflowers | roses | herbs | a beard | strawberries
    | vegetables | carrots | pumpkins | tulips;
plant/plants/planted/planted/planting: trees | flowers | a tree | roses | tulips | seeds | an apple tree
    | vegetables | daffodils | an oak tree | a hedge;
water/waters/watered/watered/watering: the plants | the garden | the flowers | the lawn | the tomatoes;
mow/mows/mowed/mowed/mowing: the lawn | the grass | the field;
wash/washes/washed/washed/washing: the car | the dishes | the dog | the windows | the clothes | the floor
    | the sheets | the vegetables;
drive/drives/drove/driven/driving: a {colour} car | the bus | a taxi | a lorry | the children to school
    | {person} to the {place_noun} | a tractor | an electric car | to work | to the coast;
ride/rides/rode/ridden/riding: a bike | a horse | a motorbike | a camel | an elephant | a scooter
    | the roller coaster | a donkey;
fix/fixes/fixed/fixed/fixing: the car | the roof | the sink | the bike | the heater | the leak
    | the broken window | the fence | the washing machine;
build/builds/built/built/building: a house | a shed | a fence | a sandcastle | a bridge | a snowman
    | a treehouse | a website | a wall | a boat | a robot;
sing/sings/sang/sung/singing: a song | a lullaby | the national anthem | in the choir | at the {event}
    | in the shower | a duet with {person} | an old folk song;
climb/climbs/climbed/climbed/climbing: the mountain | the hill | the stairs | a tree | the ladder | the wall
    | the tower | the rocks;
cross/crosses/crossed/crossed/crossing: the road | the river | the bridge | the border | the street
    | the desert | the ocean | the square | the finish line;
check/checks/checked/checked/checking: the weather | the time | the timetable | the map | the results
    | the emails | the tyres | the bill | the address | the spelling;
forget/forgets/forgot/forgotten/forgetting: the password | the address | the keys | the tickets
    | the name of the {place_noun} | the date of the {event} | the shopping list | the answer
    | {name}'s birthday;
answer/answers/answered/answered/answering: the phone | the question | the door | the email | the letter
    | all the questions;
explain/explains/explained/explained/explaining: the rules | the problem | the plan | the joke | the results
    | the situation | the new system | the recipe;
solve/solves/solved/solved/solving: the problem | the puzzle | the mystery | the riddle | the equation
    | the crossword | the case;
pass/passes/passed/passed/passing: the exam | the test | the driving test | the salt | the ball | the interview;
fail/fails/failed/failed/failing: the exam | the test | the driving test | the interview;
start/starts/started/started/starting: a new job | a business | a blog | a new course | the engine | a diet
    | a band | a garden | the car | a new book;
leave/leaves/left/left/leaving: the party early | the office | a message | a tip | the house | the country
    | a note on the table | school;
save/saves/saved/saved/saving: money | time | the file | the document | energy | the date
    | the last slice of cake | the photos;
spend/spends/spent/spent/spending: the weekend in {city} | the summer in {country} | a lot of money
    | the afternoon at the {place_noun} | the evening with {person} | {count} hours on the phone
    | the night at a hotel | the whole day at the beach;
wear/wears/wore/worn/wearing: a {colour} {clothing} | a hat | a warm coat | a uniform | a suit and tie
    | sunglasses | a big smile | a costume | odd socks | the {colour} {clothing};
paint/paints/painted/painted/painting: the fence | the kitchen | a portrait of {person}
    | a picture of the {place_noun} | the ceiling | the walls | the front door | a landscape;
draw/draws/drew/drawn/drawing: a map | a picture of {a_animal} | a portrait | a plan of the house | a circle
    | a cartoon | a line | a picture for {person};
count/counts/counted/counted/counting: the money | the votes | the chairs | the sheep | the days | the guests
    | the stars;
push/pushes/pushed/pushed/pushing: the button | the pram | the door | the trolley | the car | the swing;
pull/pulls/pulled/pulled/pulling: the rope | the lever | the door | the curtains | a muscle | the plug;
ring/rings/rang/rung/ringing: the bell | the doorbell | {person} | the office | the hospital | the police;
feed/feeds/fed/fed/feeding: the cat | the dog | the ducks | the baby | the birds | the fish | the chickens
    | the horses | the goats | the pigeons;
walk/walks/walked/walked/walking: the dog | home | to school | to work | along the beach | in the park
    | for hours | across the bridge;
deliver/delivers/delivered/delivered/delivering: the parcel | the letters | the pizza | a baby | the news
    | a speech | the furniture;
collect/collects/collected/collected/collecting: stamps | coins | shells | old postcards
    | the children from school | the rubbish | the post | the tickets | the rent | the keys;
borrow/borrows/borrowed/borrowed/borrowing: some money | a pen | a book from the library | the car | a ladder
    | an umbrella;
show/shows/showed/shown/showing: the photos to {person} | {person} the way | the new kitchen to {person}
    | {person} around {city} | the tickets at the gate;
find/finds/found/found/finding: a job | a new flat | the answer | a solution | the way to the {place_noun}
    | a good restaurant | a parking space | a four leaf clover;
buy/buys/bought/bought/buying: a new flat | a house in {city} | a car | tickets for the {event}
    | a present for {person} | a newspaper | a round of drinks | flowers for {person};
sell/sells/sold/sold/selling: the house | the old car | tickets for the {event} | vegetables at the market
    | homemade jam | flowers | the business | the farm;
rent/rents/rented/rented/renting: a flat in {city} | a car | a bike | a cottage by the sea | a boat | a room
    | a house near the {place_noun};
empty/empties/emptied/emptied/emptying: the bins | the dishwasher | the fridge | the bath | the box | the drawer;
load/loads/loaded/loaded/loading: the dishwasher | the van | the washing machine | the car | the lorry;
pay/pays/paid/paid/paying: the bill | the rent | the taxi driver | the fine | the electricity bill | by card
    | in cash | for dinner | for the tickets;
order/orders/ordered/ordered/ordering: a taxi | a pizza | a new phone online | dessert | the fish | more chairs
    | a coffee | some books | a takeaway;
tell/tells/told/told/telling: a story | a joke | the truth | {person} a secret | {person} the news
    | the children a story | a funny story about {topic};
ask/asks/asked/asked/asking: a question | for help | for directions | for the bill | {person} for advice
    | about the price | about the {event};
bake/bakes/baked/baked/baking: a cake | bread | cookies | a pie | a birthday cake | some biscuits | scones
    | a loaf of bread;
cook/cooks/cooked/cooked/cooking: dinner | lunch | breakfast | a curry | a roast | pasta | soup
    | for the family | a meal for {small} people;
look after/looks after/looked after/looked after/looking after: the children | the garden | the baby
    | the plants | the neighbour's cat | {person};
help/helps/helped/helped/helping: {person} | with the dishes | with the shopping | at the {place_noun}
    | an elderly man | out at the {event};
recycle/recycles/recycled/recycled/recycling: the bottles | old newspapers | the plastic | the glass
    | the cardboard;
sort out/sorts out/sorted out/sorted out/sorting out: the problem | the paperwork | the garage | the mess
    | the tickets | the bills;
return/returns/returned/returned/returning: the books to the library | the dress to the shop
    | the phone call | the money | the keys | home | the favour;
carry/carries/carried/carried/carrying: the shopping | the bags upstairs | the baby | the boxes
    | the heavy suitcase | the chairs outside;
fly/flies/flew/flown/flying: a kite | a plane | to {city} | home | first class | over the mountains;
run/runs/ran/run/running: a marathon | a business | a bath | a small shop | the meeting | for the bus | a race
    | a hotel in {city} | {count} kilometres | a bakery | late;
meet/meets/met/met/meeting: {person} | {person} at the {place_noun} | the new {profession} | some old friends
    | the deadline | at the {place_noun} | for coffee | in {city};
send/sends/sent/sent/sending: a letter | a parcel to {person} | a message to {person} | an email
    | a postcard from {city} | flowers to {person} | the invitations | a photo of the {place_noun};
receive/receives/received/received/receiving: a letter | a parcel | a prize | a warm welcome | good news
    | a phone call from {person} | an invitation to the {event} | a bill;
pack/packs/packed/packed/packing: a suitcase | a bag | the car | lunch for the children | the boxes | a picnic
    | for the trip;
unpack/unpacks/unpacked/unpacked/unpacking: the shopping | the boxes | the suitcase | the car;
lose/loses/lost/lost/losing: the match | the game | the race | the key | the tickets | the way | weight
    | interest | the election | money;
join/joins/joined/joined/joining: a club | the choir | the army | a gym | the team | a band | the queue
    | a book club | {person} for lunch;
enjoy/enjoys/enjoyed/enjoyed/enjoying: the film | the concert | the meal | the trip to {city} | the party
    | the sunshine | the view | the weekend | the match | the holiday;
hate/hates/hated/hated/-: waiting | the rain | mornings | traffic | loud music | cold weather | shopping;
like/likes/liked/liked/-: {foods} | {sport} | jazz | the new {place_noun} | {animals} | reading | swimming
    | {topic} | the film;
love/loves/loved/loved/-: {foods} | {sport} | music | the sea | the mountains | {animals} | dancing | {city}
    | the view | old films;
prefer/prefers/preferred/preferred/-: tea | coffee | the bus | the train | {sport} | {foods} | cats | dogs
    | summer | winter | the city | the countryside;
need/needs/needed/needed/-: a holiday | some help | a new {thing_noun} | more time | a doctor | a break
    | a haircut | some advice | a new job | a bigger flat;
want/wants/wanted/wanted/-: a new {thing_noun} | a puppy | a bigger house | to go home
    | to see the {place_noun} | to visit {city} | some {drink} | a quiet life;
remember/remembers/remembered/remembered/-: the old days | the address | {name}'s birthday | the password
    | the way home | {person} | the name of the {place_noun};
understand/understands/understood/understood/-: the question | the problem | the rules | {language}
    | the instructions | the joke | the map;
know/knows/knew/known/-: the answer | the way | the truth | {person} | {city} very well | the rules
    | a good restaurant | a lot about {topic};
believe/believes/believed/believed/-: the story | the news | {person} | in ghosts | every word;
own/owns/owned/owned/-: a boat | a small shop | a farm | a cottage in {country} | two cars
    | a restaurant in {city} | a horse | a vineyard;
stay/stays/stayed/stayed/staying: at a hotel | with {person} | in {city} | at home | in bed | for dinner
    | up late | awake | calm;
describe/describes/described/described/describing: the {place_noun} | the accident | the problem | the view
    | {person} | the journey;
discuss/discusses/discussed/discussed/discussing: {topic} | the plan | the problem | the budget
    | the results | the news;
keep/keeps/kept/kept/keeping: a diary | a secret | the change | the receipt | calm | chickens | bees
    | the window open | a promise | quiet;
break/breaks/broke/broken/breaking: a window | the record | a glass | a promise | the news to {person}
    | the rules | a leg | the silence;
support/supports/supported/supported/supporting: the local team | {person} | the new plan | the charity
    | the idea;
hear/hears/heard/heard/hearing: a noise | the news | a strange sound | the thunder | the birds | music
    | the doorbell | a rumour about {topic};
see/sees/saw/seen/seeing: a film | the doctor | a ghost | a shooting star | the sea | {person}
    | the {place_noun} | a rainbow | the sunrise | the northern lights | an old friend | a play at the theatre;
smell/smells/smelled/smelled/smelling: smoke | gas | something burning | fresh bread | the flowers | the roses;
try/tries/tried/tried/trying: the soup | a new recipe | {food} | to help | again | hard | yoga | skiing
    | the new restaurant;
sweep/sweeps/swept/swept/sweeping: the floor | the kitchen | the path | the chimney | the yard | the leaves;
iron/irons/ironed/ironed/ironing: the shirts | a shirt | the sheets | the clothes | the tablecloth;
hang/hangs/hung/hung/hanging: the washing out | the picture on the wall | a mirror in the hall
    | the coats in the hall | the lights on the tree;
set/sets/set/set/setting: the table | the alarm | a new record | the clocks | a trap
    | the date for the {event} | a goal;
knock on/knocks on/knocked on/knocked on/knocking on: the door | the window | the wall;
light/lights/lit/lit/lighting: the candles | a fire | the barbecue | the lamp | the stove | the fireworks;
blow out/blows out/blew out/blown out/blowing out: the candles | the match;
tidy/tidies/tidied/tidied/tidying: the room | the bedroom | the desk | the kitchen | the garden | the cupboards;
decorate/decorates/decorated/decorated/decorating: the tree | the cake | the living room | the hall
    | the kitchen | the house for the party;
invite/invites/invited/invited/inviting: {person} to the {event} | {person} for dinner | the neighbours
    | everyone | the whole class;
lead/leads/led/led/leading: the team | the way | the meeting | the parade | the tour | the band | the project;
finish/finishes/finished/finished/finishing: the book | the report | the race | the painting | the homework
    | the puzzle | the marathon | the project | work early;
prepare/prepares/prepared/prepared/preparing: dinner | a speech | the room | the presentation
    | for the exam | the garden for winter | the report | a picnic;
improve/improves/improved/improved/improving: the website | the design | the recipe | the garden | the plan
    | the system;
change/changes/changed/changed/changing: the plan | the tyres | the bed | the lightbulb | the date
    | the password | trains in {city} | the channel | the rules | jobs | clothes;
cut/cuts/cut/cut/cutting: the grass | the cake | the bread | the hedge | a ribbon | the vegetables
    | the string | costs;
chop/chops/chopped/chopped/chopping: the onions | the carrots | the wood | the vegetables | the herbs
    | some garlic;
peel/peels/peeled/peeled/peeling: the potatoes | an orange | the apples | the carrots | the eggs | a banana;
boil/boils/boiled/boiled/boiling: the kettle | the eggs | some water | the potatoes | the rice;
fry/fries/fried/fried/frying: the eggs | some onions | the fish | the bacon | the mushrooms;
mix/mixes/mixed/mixed/mixing: the paint | the salad | the drinks | the ingredients | the colours;
stir/stirs/stirred/stirred/stirring: the soup | the sauce | the coffee | the paint | the porridge | the tea;
serve/serves/served/served/serving: dinner | the guests | breakfast | the soup | drinks | customers
    | the dessert | {food};
milk/milks/milked/milked/milking: the cows | the goats;
sew/sews/sewed/sewn/sewing: a dress | a quilt | a costume | curtains | a button on the coat;
knit/knits/knitted/knitted/knitting: a scarf | a jumper | a hat | some socks | a blanket;
fold/folds/folded/folded/folding: the laundry | the towels | the map | the letter | the napkins | the sheets;
print/prints/printed/printed/printing: the tickets | the report | the photos | the boarding pass | the map
    | the document | the invitations;
type/types/typed/typed/typing: the letter | the password | a message | the address | the report;
download/downloads/downloaded/downloaded/downloading: the file | the app | a film | the photos | the new map
    | a book;
upload/uploads/uploaded/uploaded/uploading: the photos | the video | the file | the document;
delete/deletes/deleted/deleted/deleting: the email | the message | the photos | the file | the app
    | the old files;
update/updates/updated/updated/updating: the website | the software | the map | the list | the calendar
    | the records;
install/installs/installed/installed/installing: the new software | a new kitchen | solar panels
    | the printer | a shower | a smoke alarm;
charge/charges/charged/charged/charging: the phone | the laptop | the car | the batteries | the camera;
record/records/recorded/recorded/recording: a song | an album | the meeting | a video | the match
    | the interview | a podcast;
post/posts/posted/posted/posting: the letter | the parcel | the invitations | a photo online | the cards;
share/shares/shared/shared/sharing: the photos | a flat with {person} | the bill | the cake | the news
    | a taxi;
review/reviews/reviewed/reviewed/reviewing: the report | the film | the contract | the notes | the book
    | the new restaurant;
present/presents/presented/presented/presenting: the results | the report | the prize | the news
    | a new idea | the award;
translate/translates/translated/translated/translating: the letter | the book into {language} | the menu
    | the song | the document | the poem;
publish/publishes/published/published/publishing: a book | a novel | the results
    | an article about {topic} | a report | a cookbook;
invent/invents/invented/invented/inventing: a new game | a machine | a story | an excuse | a new recipe
    | a word;
discover/discovers/discovered/discovered/discovering: a hidden room | an old map | the truth
    | a small island | a secret garden | a great cafe | a new planet;
direct/directs/directed/directed/directing: a film | a play | the traffic | the orchestra | the show;
compose/composes/composed/composed/composing: a song | a symphony | a piece for {instrument};
perform/performs/performed/performed/performing: a song | a play | a dance | a magic trick | an experiment
    | at the {event} | in {city};
reach/reaches/reached/reached/reaching: the top of the hill | the station | the coast | an agreement
    | {city} | the end of the road | a decision;
measure/measures/measured/measured/measuring: the room | the table | the window | the distance
    | the temperature | the garden;
weigh/weighs/weighed/weighed/weighing: the luggage | the flour | the parcel | the baby | the apples;
guess/guesses/guessed/guessed/guessing: the answer | the password | the price | the number | the ending
    | the weight of the cake;
pick/picks/picked/picked/picking: apples | strawberries | flowers | a card | a team | a winner | a number
    | a date;
wrap/wraps/wrapped/wrapped/wrapping: the presents | a gift for {person} | the sandwiches | the parcel;
unwrap/unwraps/unwrapped/unwrapped/unwrapping: the presents | the parcel | the chocolate | a gift;
scrub/scrubs/scrubbed/scrubbed/scrubbing: the floor | the bath | the pots | the kitchen table | the steps;
polish/polishes/polished/polished/polishing: the shoes | the silver | the car | the table | the floor
    | the mirror | the trophy;
vacuum/vacuums/vacuumed/vacuumed/vacuuming: the carpet | the stairs | the living room | the car;
dust/dusts/dusted/dusted/dusting: the shelves | the furniture | the piano | the bookcase | the pictures
""")

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
