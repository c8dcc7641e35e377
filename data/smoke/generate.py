"""Generate the smoke dataset: a small synthetic English->German parallel corpus.

    python data/smoke/generate.py [OUT_DIR]      (default: the folder of this script)

writes train/valid/test .en/.de, byte for byte the same on every run (one seeded
random.Random; lists only, never the iteration order of a set). The grammar is small but
German: gender and case agreement of determiners and adjectives (weak, mixed and strong
endings), weak nouns, dative plurals, preposition contractions (im, am, zum, ins), verb
second with fronted adverbs, verb-final subordinate clauses, the perfect's verb bracket,
modal verbs, "kein", "gern", "fressen" for animals. It is learnable by a tiny model in a
few CPU minutes and reads like translation in the demo. Test and valid English sentences
never occur in train.
"""

# The lexicon tables below hold one entry a line, however long: easier to read than wrapped.
# ruff: noqa: E501

from __future__ import annotations

import functools
import random
import sys
from dataclasses import dataclass
from pathlib import Path

SEED = 2017
SIZES = {"valid": 300, "test": 300, "train": 9000}

# --------------------------------------------------------------------------- lexicon

# English singular, English plural, German singular, German plural, gender, kinds.
# "weak" marks German n-declension nouns (den Jungen, dem Bären): oblique singular = plural.
NOUNS = """
man men Mann Männer m person
woman women Frau Frauen f person
child children Kind Kinder n person
boy boys Junge Jungen m person weak
girl girls Mädchen Mädchen n person
teacher teachers Lehrer Lehrer m person
doctor doctors Arzt Ärzte m person
student students Student Studenten m person weak
friend friends Freund Freunde m person
neighbour neighbours Nachbar Nachbarn m person weak
farmer farmers Bauer Bauern m person weak
cook cooks Koch Köche m person
king kings König Könige m person
queen queens Königin Königinnen f person
mother mothers Mutter Mütter f person
father fathers Vater Väter m person
brother brothers Bruder Brüder m person
sister sisters Schwester Schwestern f person
baker bakers Bäcker Bäcker m person
tourist tourists Tourist Touristen m person weak
singer singers Sänger Sänger m person
pupil pupils Schüler Schüler m person
dog dogs Hund Hunde m animal
cat cats Katze Katzen f animal
horse horses Pferd Pferde n animal
bird birds Vogel Vögel m animal flyer
mouse mice Maus Mäuse f animal
cow cows Kuh Kühe f animal
pig pigs Schwein Schweine n animal
sheep sheep Schaf Schafe n animal
fish fish Fisch Fische m animal
duck ducks Ente Enten f animal flyer
bear bears Bär Bären m animal weak
lion lions Löwe Löwen m animal weak
elephant elephants Elefant Elefanten m animal weak
monkey monkeys Affe Affen m animal weak
wolf wolves Wolf Wölfe m animal
fox foxes Fuchs Füchse m animal
goat goats Ziege Ziegen f animal
frog frogs Frosch Frösche m animal
owl owls Eule Eulen f animal flyer
bee bees Biene Bienen f animal flyer
ball balls Ball Bälle m thing
book books Buch Bücher n thing readable openable
letter letters Brief Briefe m thing readable openable
newspaper newspapers Zeitung Zeitungen f thing readable
magazine magazines Zeitschrift Zeitschriften f thing readable
map maps Karte Karten f thing readable
cup cups Tasse Tassen f thing container
glass glasses Glas Gläser n thing container
bottle bottles Flasche Flaschen f thing container openable
box boxes Kiste Kisten f thing container openable
bag bags Tasche Taschen f thing container openable
key keys Schlüssel Schlüssel m thing
hat hats Hut Hüte m thing wearable
shoe shoes Schuh Schuhe m thing wearable
coat coats Mantel Mäntel m thing wearable
dress dresses Kleid Kleider n thing wearable
shirt shirts Hemd Hemden n thing wearable
ring rings Ring Ringe m thing wearable
lamp lamps Lampe Lampen f thing
picture pictures Bild Bilder n thing
flower flowers Blume Blumen f thing
pen pens Stift Stifte m thing
clock clocks Uhr Uhren f thing
phone phones Telefon Telefone n thing
umbrella umbrellas Regenschirm Regenschirme m thing
bicycle bicycles Fahrrad Fahrräder n thing vehicle
car cars Auto Autos n thing vehicle landmark
plate plates Teller Teller m thing
knife knives Messer Messer n thing
spoon spoons Löffel Löffel m thing
toy toys Spielzeug Spielzeuge n thing
stone stones Stein Steine m thing
chair chairs Stuhl Stühle m thing landmark surface
table tables Tisch Tische m thing landmark surface
bed beds Bett Betten n thing landmark surface
bench benches Bank Bänke f landmark surface
door doors Tür Türen f landmark openable
window windows Fenster Fenster n landmark openable
tree trees Baum Bäume m landmark
wall walls Mauer Mauern f landmark surface
bridge bridges Brücke Brücken f landmark
apple apples Apfel Äpfel m food
bread breads Brot Brote n food
cake cakes Kuchen Kuchen m food
egg eggs Ei Eier n food
banana bananas Banane Bananen f food
orange oranges Orange Orangen f food
soup soups Suppe Suppen f food
sausage sausages Wurst Würste f food
carrot carrots Karotte Karotten f food
potato potatoes Kartoffel Kartoffeln f food
pear pears Birne Birnen f food
tomato tomatoes Tomate Tomaten f food
cookie cookies Keks Kekse m food
pizza pizzas Pizza Pizzen f food
water - Wasser - n drink
milk - Milch - f drink
coffee - Kaffee - m drink
tea - Tee - m drink
juice - Saft - m drink
"""

# Places: English noun, German noun and plural, gender, then the English and German
# preposition of location ("in the garden" = "im Garten", "at the station" = "am Bahnhof").
PLACES = """
garden Garten Gärten m in in
house Haus Häuser n in in
park Park Parks m in in
kitchen Küche Küchen f in in
school Schule Schulen f in in
forest Wald Wälder m in in
city Stadt Städte f in in
village Dorf Dörfer n in in
room Zimmer Zimmer n in in
shop Laden Läden m in in
restaurant Restaurant Restaurants n in in
hotel Hotel Hotels n in in
church Kirche Kirchen f in in
castle Schloss Schlösser n in in
library Bibliothek Bibliotheken f in in
office Büro Büros n in in
museum Museum Museen n in in
hospital Krankenhaus Krankenhäuser n in in
train Zug Züge m on in
bus Bus Busse m on in
street Straße Straßen f on auf
field Feld Felder n in auf
market Markt Märkte m at auf
mountain Berg Berge m on auf
boat Boot Boote n on auf
station Bahnhof Bahnhöfe m at an
beach Strand Strände m on an
lake See Seen m at an
river Fluss Flüsse m at an
"""

# English, German stem, predicative German (if it differs), kinds it describes.
ADJECTIVES = """
big groß - person animal thing landmark food place
small klein - person animal thing landmark food place
old alt - person animal thing landmark place
young jung - person animal
new neu - thing landmark place
red rot - thing landmark food
blue blau - thing landmark
green grün - thing landmark food
yellow gelb - thing landmark food
black schwarz - animal thing landmark
white weiß - animal thing landmark
brown braun - animal thing
grey grau - animal thing landmark
beautiful schön - person thing landmark place
friendly freundlich - person animal
happy glücklich - person animal
sad traurig - person animal
tired müde - person animal
hungry hungrig - person animal
clever klug - person animal
lazy faul - person animal
fast schnell - animal vehicle
heavy schwer - thing
cheap billig - thing food
expensive teur teuer thing food place
clean sauber - thing landmark place
dirty schmutzig - thing landmark place
empty leer - container
fresh frisch - food drink
sweet süß - food
cold kalt - food drink
hot heiß - food drink
quiet ruhig - person animal place
"""

# English base, 3sg, past, participle | German ich, du, er, wir, participle, auxiliary |
# subject kinds | object kinds ("-" = intransitive) | object case. "+" joins a multiword
# English form ("looks+for"). An "@" verb is "fressen" when an animal eats.
VERBS = """
see sees saw seen | sehe siehst sieht sehen gesehen haben | person animal | person animal thing food landmark place | acc
have has had had | habe hast hat haben gehabt haben | person | animal thing | acc
buy buys bought bought | kaufe kaufst kauft kaufen gekauft haben | person | thing food drink | acc
sell sells sold sold | verkaufe verkaufst verkauft verkaufen verkauft haben | person | thing food animal | acc
eat eats ate eaten | esse isst isst essen gegessen haben | person animal | food | acc
drink drinks drank drunk | trinke trinkst trinkt trinken getrunken haben | person animal | drink | acc
read reads read read | lese liest liest lesen gelesen haben | person | readable | acc
write writes wrote written | schreibe schreibst schreibt schreiben geschrieben haben | person | readable | acc
carry carries carried carried | trage trägst trägt tragen getragen haben | person | thing | acc
wear wears wore worn | trage trägst trägt tragen getragen haben | person | wearable | acc
find finds found found | finde findest findet finden gefunden haben | person animal | thing animal food | acc
look+for looks+for looked+for looked+for | suche suchst sucht suchen gesucht haben | person animal | person animal thing | acc
need needs needed needed | brauche brauchst braucht brauchen gebraucht haben | person | thing food drink | acc
like likes liked liked | mag magst mag mögen gemocht haben | person animal | person animal thing food drink | acc
love loves loved loved | liebe liebst liebt lieben geliebt haben | person | person animal | acc
visit visits visited visited | besuche besuchst besucht besuchen besucht haben | person | person place | acc
wash washes washed washed | wasche wäschst wäscht waschen gewaschen haben | person | animal thing vehicle | acc
paint paints painted painted | male malst malt malen gemalt haben | person | person animal thing landmark place | acc
open opens opened opened | öffne öffnest öffnet öffnen geöffnet haben | person | openable | acc
close closes closed closed | schließe schließt schließt schließen geschlossen haben | person | openable | acc
cook cooks cooked cooked | koche kochst kocht kochen gekocht haben | person | food | acc
feed feeds fed fed | füttere fütterst füttert füttern gefüttert haben | person | animal | acc
catch catches caught caught | fange fängst fängt fangen gefangen haben | person animal | animal thing | acc
throw throws threw thrown | werfe wirfst wirft werfen geworfen haben | person | thing food | acc
forget forgets forgot forgotten | vergesse vergisst vergisst vergessen vergessen haben | person | thing | acc
lose loses lost lost | verliere verlierst verliert verlieren verloren haben | person | thing | acc
call calls called called | rufe rufst ruft rufen gerufen haben | person | person animal | acc
meet meets met met | treffe triffst trifft treffen getroffen haben | person | person | acc
hear hears heard heard | höre hörst hört hören gehört haben | person animal | person animal | acc
help helps helped helped | helfe hilfst hilft helfen geholfen haben | person animal | person animal | dat
follow follows followed followed | folge folgst folgt folgen gefolgt sein | person animal | person animal | dat
thank thanks thanked thanked | danke dankst dankt danken gedankt haben | person | person | dat
sleep sleeps slept slept | schlafe schläfst schläft schlafen geschlafen haben | person animal | - | -
run runs ran run | laufe läufst läuft laufen gelaufen sein | person animal | - | -
play plays played played | spiele spielst spielt spielen gespielt haben | person animal | - | -
sit sits sat sat | sitze sitzt sitzt sitzen gesessen haben | person animal | - | -
wait waits waited waited | warte wartest wartet warten gewartet haben | person animal | - | -
laugh laughs laughed laughed | lache lachst lacht lachen gelacht haben | person | - | -
sing sings sang sung | singe singst singt singen gesungen haben | person flyer | - | -
work works worked worked | arbeite arbeitest arbeitet arbeiten gearbeitet haben | person | - | -
swim swims swam swum | schwimme schwimmst schwimmt schwimmen geschwommen sein | person animal | - | -
dance dances danced danced | tanze tanzt tanzt tanzen getanzt haben | person | - | -
cry cries cried cried | weine weinst weint weinen geweint haben | person | - | -
live lives lived lived | wohne wohnst wohnt wohnen gewohnt haben | person | - | -
fly flies flew flown | fliege fliegst fliegt fliegen geflogen sein | flyer | - | -
"""

# Motion verbs with a destination: "goes to the park" = "geht in den Park".
MOTION = """
go goes went gone | gehe gehst geht gehen gegangen sein | person animal
drive drives drove driven | fahre fährst fährt fahren gefahren sein | person
run runs ran run | laufe läufst läuft laufen gelaufen sein | person animal
"""

# Giving verbs: "gives the child a ball" = "gibt dem Kind einen Ball" (dative, accusative).
GIVING = """
give gives gave given | gebe gibst gibt geben gegeben haben
show shows showed shown | zeige zeigst zeigt zeigen gezeigt haben
bring brings brought brought | bringe bringst bringt bringen gebracht haben
send sends sent sent | schicke schickst schickt schicken geschickt haben
"""

NAMES = [
    "Anna",
    "Peter",
    "Maria",
    "Thomas",
    "Lisa",
    "Paul",
    "Julia",
    "Max",
    "Sophie",
    "Jonas",
    "Lena",
    "Felix",
    "Emma",
    "Tom",
    "Laura",
    "David",
]

# English, German: adverbs of time, for present-tense and for past-tense clauses.
PRESENT_TIMES = [("today", "heute"), ("now", "jetzt"), ("every day", "jeden Tag"),
                 ("in the morning", "am Morgen"), ("in the evening", "am Abend"),
                 ("on Sunday", "am Sonntag"), ("on Monday", "am Montag"),
                 ("sometimes", "manchmal"), ("often", "oft")]  # fmt: skip
PAST_TIMES = [("yesterday", "gestern"), ("last week", "letzte Woche"),
              ("last year", "letztes Jahr"), ("on Saturday", "am Samstag")]  # fmt: skip
NUMBERS = [("two", "zwei"), ("three", "drei"), ("four", "vier"), ("five", "fünf"),
           ("six", "sechs"), ("seven", "sieben"), ("eight", "acht"), ("ten", "zehn"),
           ("many", "viele"), ("some", "einige")]  # fmt: skip
SPATIAL = [("under", "unter"), ("behind", "hinter"), ("next to", "neben"),
           ("in front of", "vor")]  # fmt: skip
THINKING = [("think", "thinks", "glaube glaubst glaubt glauben"),
            ("say", "says", "sage sagst sagt sagen"),
            ("know", "knows", "weiß weißt weiß wissen"),
            ("hope", "hopes", "hoffe hoffst hofft hoffen")]  # fmt: skip
CONJUNCTIONS = [("because", "weil"), ("although", "obwohl"), ("when", "wenn"),
                ("while", "während")]  # fmt: skip

# --------------------------------------------------------------------------- German morphology

SLOT = {"m": 0, "f": 1, "n": 2, "pl": 3}  # column in the tables below
DEFINITE = {"nom": "der die das die", "acc": "den die das die", "dat": "dem der dem den"}
THIS = {"nom": "dieser diese dieses diese", "acc": "diesen diese dieses diese",
        "dat": "diesem dieser diesem diesen"}  # fmt: skip
EIN_ENDINGS = {"nom": "- e - e", "acc": "en e - e", "dat": "em er em en"}  # ein, kein, mein
WEAK = {"nom": "e e e en", "acc": "en e e en", "dat": "en en en en"}  # after der, dieser
MIXED = {"nom": "er e es en", "acc": "en e es en", "dat": "en en en en"}  # after ein, mein
STRONG = {"nom": "er e es e", "acc": "en e es e", "dat": "em er em en"}  # no determiner
POSSESSIVES = [("my", "mein"), ("your", "dein"), ("his", "sein"), ("her", "ihr"), ("our", "unser")]
PRONOUNS = [("I", "ich", 0), ("you", "du", 1), ("he", "er", 2), ("she", "sie", 2),
            ("we", "wir", 3), ("they", "sie", 4)]  # fmt: skip
SEIN = ["bin", "bist", "ist", "sind", "sind"]
WAR = ["war", "warst", "war", "waren", "waren"]
HABEN = ["habe", "hast", "hat", "haben", "haben"]
MODALS = {"can": ["kann", "kannst", "kann", "können", "können"],
          "want": ["will", "willst", "will", "wollen", "wollen"],
          "must": ["muss", "musst", "muss", "müssen", "müssen"]}  # fmt: skip
CONTRACT = {("in", "dem"): "im", ("an", "dem"): "am", ("zu", "dem"): "zum",
            ("zu", "der"): "zur", ("in", "das"): "ins"}  # fmt: skip


def cell(table: dict[str, str], case: str, slot: str) -> str:
    return table[case].split()[SLOT[slot]]


@dataclass(frozen=True)
class Noun:
    en: str
    en_pl: str | None
    de: str
    de_pl: str | None
    gender: str
    kinds: tuple[str, ...]
    weak: bool = False
    en_prep: str = ""  # places only
    de_prep: str = ""

    def german(self, plural: bool, case: str) -> str:
        if plural:
            # Dative plural adds -n, unless the plural already ends in -n or -s.
            dative_n = case == "dat" and not self.de_pl.endswith(("n", "s"))
            return self.de_pl + ("n" if dative_n else "")
        return self.de_pl if self.weak and case != "nom" else self.de


@dataclass(frozen=True)
class Adjective:
    en: str
    de_stem: str
    de_pred: str
    kinds: tuple[str, ...]


@dataclass(frozen=True)
class Verb:
    en: tuple[str, str, str, str]  # base, 3sg, past, participle
    de: tuple[str, ...]  # ich, du, er, wir, sie (plural)
    de_pp: str
    aux: str  # "haben" | "sein"
    subj: tuple[str, ...] = ()
    obj: tuple[str, ...] = ()
    case: str = "acc"

    def finite(self, person: int) -> str:
        return self.de[person]

    @property
    def infinitive(self) -> str:
        return self.de[3]


def parse_nouns() -> list[Noun]:
    nouns = []
    for line in NOUNS.strip().splitlines():
        en, en_pl, de, de_pl, gender, *kinds = line.split()
        weak = "weak" in kinds
        kinds = tuple(k for k in kinds if k != "weak")
        nouns.append(Noun(en, none(en_pl), de, none(de_pl), gender, kinds, weak))
    return nouns


def parse_places() -> list[Noun]:
    places = []
    for line in PLACES.strip().splitlines():
        en, de, de_pl, gender, en_prep, de_prep = line.split()
        plural = en + ("es" if en.endswith(("s", "ch")) else "s")
        places.append(Noun(en, plural, de, de_pl, gender, ("place",), False, en_prep, de_prep))
    return places


def parse_adjectives() -> list[Adjective]:
    adjectives = []
    for line in ADJECTIVES.strip().splitlines():
        en, stem, pred, *kinds = line.split()
        adjectives.append(Adjective(en, stem, stem if pred == "-" else pred, tuple(kinds)))
    return adjectives


def parse_verbs(table: str) -> list[Verb]:
    """Rows of VERBS, MOTION or GIVING (the latter two stop after the subject kinds or the
    German forms: their objects are built by motion_clause and giving_clause)."""
    verbs = []
    for line in table.strip().splitlines():
        fields = [f.strip() for f in line.split("|")]
        fields += ["person", "-", "acc"][len(fields) - 2 :]  # defaults for short rows
        en = tuple(form.replace("+", " ") for form in fields[0].split())
        ich, du, er, wir, pp, aux = fields[1].split()
        subj = tuple(fields[2].split())
        obj = () if fields[3] == "-" else tuple(fields[3].split())
        case = "acc" if fields[4] == "-" else fields[4]
        verbs.append(Verb(en, (ich, du, er, wir, wir), pp, aux, subj, obj, case))
    return verbs


def none(value: str) -> str | None:
    return None if value == "-" else value


LEX_NOUNS = parse_nouns()
LEX_PLACES = parse_places()
LEX_ADJECTIVES = parse_adjectives()
LEX_VERBS = parse_verbs(VERBS)
LEX_MOTION = parse_verbs(MOTION)
LEX_GIVING = parse_verbs(GIVING)
FRESSEN = Verb(("eat", "eats", "ate", "eaten"), ("fresse", "frisst", "frisst", "fressen",
               "fressen"), "gefressen", "haben")  # fmt: skip


@functools.cache
def nouns_of(kinds: tuple[str, ...]) -> list[Noun]:
    return [n for n in LEX_NOUNS + LEX_PLACES if any(k in n.kinds for k in kinds)]


@functools.cache
def adjectives_for(kinds: tuple[str, ...]) -> list[Adjective]:
    return [a for a in LEX_ADJECTIVES if any(k in a.kinds for k in kinds)]


# --------------------------------------------------------------------------- phrases


@dataclass
class Phrase:
    """Parallel token lists; `person` is 0..4 (ich, du, er/sie/es, wir, sie) for subjects."""

    en: list[str]
    de: list[str]
    person: int = 2
    animal: bool = False
    noun: Noun | None = None
    plural: bool = False


class Grammar:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, items):
        return self.rng.choice(items)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    # ---------------------------------------------------------------- noun phrases

    def noun_of(self, kinds: tuple[str, ...]) -> Noun:
        return self.pick(nouns_of(kinds))

    def adjective_for(self, noun: Noun) -> Adjective | None:
        fitting = adjectives_for(noun.kinds)
        return self.pick(fitting) if fitting else None

    def noun_phrase(
        self, noun: Noun, case: str, det: str | None = None, adj_p=0.3, singular=False
    ) -> Phrase:
        """A determiner, maybe an adjective, the noun; German agrees in gender and case."""
        mass = noun.en_pl is None
        if det is None:
            options = ["the"] * 5 + ["this", "poss", "name"] + (["bare"] if mass else ["a"] * 3)
            options += [] if mass else ["plural", "number"]
            det = self.pick(options)
        optional_plural = det in ("the", "this", "poss", "name") and not (mass or singular)
        plural = det in ("plural", "number") or (optional_plural and self.chance(0.25))
        slot = "pl" if plural else noun.gender
        en, de, ending = self.determiner(det, case, slot)
        adjective = self.adjective_for(noun) if self.chance(adj_p) else None
        en_noun = noun.en_pl if plural else noun.en
        de_noun = noun.german(plural, case)
        if adjective:
            en.append(adjective.en)
            de.append(inflect(adjective.de_stem, cell(ending, case, slot)))
        if en[:1] == ["a"] and (adjective.en if adjective else en_noun)[0] in "aeiou":
            en[0] = "an"
        person = 4 if plural else 2
        return Phrase([*en, en_noun], [*de, de_noun], person, "animal" in noun.kinds, noun, plural)

    def determiner(self, det: str, case: str, slot: str):
        """English tokens, German tokens, and the adjective ending table that follows."""
        if det == "the":
            return ["the"], [cell(DEFINITE, case, slot)], WEAK
        if det == "this":
            return ["these" if slot == "pl" else "this"], [cell(THIS, case, slot)], WEAK
        if det in ("a", "no"):
            stem = "ein" if det == "a" else "kein"
            return [det], [stem + cell(EIN_ENDINGS, case, slot).strip("-")], MIXED
        if det == "poss":
            en, stem = self.pick(POSSESSIVES)
            return [en], [stem + cell(EIN_ENDINGS, case, slot).strip("-")], MIXED
        if det == "name":
            # A name's genitive is no determiner: the adjective is strong ("Annas alter Hund").
            name = self.pick([n for n in NAMES if not n.endswith(("s", "x"))])  # not "Max'"
            return [name + "'s"], [name + "s"], STRONG
        if det == "number":
            en, de = self.pick(NUMBERS)
            return [en], [de], STRONG
        return [], [], STRONG  # bare plural or mass noun

    def subject(self, kinds: tuple[str, ...]) -> Phrase:
        roll = self.rng.random()
        if "person" in kinds and roll < 0.2:
            en, de, person = self.pick(PRONOUNS)
            return Phrase([en], [de], person)
        if "person" in kinds and roll < 0.3:
            name = self.pick(NAMES)
            return Phrase([name], [name], 2)
        return self.noun_phrase(self.noun_of(kinds), "nom")

    def place_phrase(self) -> Phrase:
        """Where something happens: "in the garden" = "im Garten", "at the station" = "am
        Bahnhof", or a spatial preposition with a landmark ("under the table")."""
        if self.chance(0.3):
            en_prep, de_prep = self.pick(SPATIAL)
            noun = self.noun_of(("landmark",))
        else:
            noun = self.pick(LEX_PLACES)
            en_prep, de_prep = noun.en_prep, noun.de_prep
        det = self.pick(["the"] * 6 + ["a", "this", "poss"])
        np_ = self.noun_phrase(noun, "dat", det, adj_p=0.2, singular=True)
        return Phrase([*en_prep.split(), *np_.en], contract(de_prep, np_.de))

    def destination(self) -> Phrase:
        """Where to: "to the park" = "in den Park", "to the station" = "zum Bahnhof"."""
        noun = self.pick(LEX_PLACES)
        det = self.pick(["the"] * 4 + ["a", "this", "poss"])
        de_prep, case = {"in": ("in", "acc"), "auf": ("auf", "acc"), "an": ("zu", "dat")}[
            noun.de_prep
        ]
        np_ = self.noun_phrase(noun, case, det, adj_p=0.2, singular=True)
        return Phrase(["to", *np_.en], contract(de_prep, np_.de))

    # ---------------------------------------------------------------- clauses

    def clause(self, neg_p: float = 0.15, place_p: float = 0.4) -> Clause:
        """A clause; sentences of two clauses pass a lower place_p, to stay short."""
        roll = self.rng.random()
        if roll < 0.12:
            return self.copula_clause(neg_p)
        if roll < 0.2:
            return self.motion_clause()
        if roll < 0.26:
            return self.giving_clause()
        verb = self.pick(LEX_VERBS)
        subj = self.subject(verb.subj)
        tense = self.tense(verb)
        # "must not" is "darf nicht", not "muss nicht": leave it out rather than mistranslate.
        c = Clause(subj, for_subject(verb, subj), tense, self.chance(neg_p) and tense != "must")
        if verb.obj:
            c.obj = self.object_phrase(verb, c.neg)
            c.neg_in_object = c.neg and c.obj.de[0].startswith("kein")
        if verb.en[0] == "live" or (not c.neg and self.chance(place_p * (1 if verb.obj else 1.5))):
            c.pp = self.place_phrase()
        self.add_time(c)
        return c

    def object_phrase(self, verb: Verb, negated: bool) -> Phrase:
        noun = self.noun_of(verb.obj)
        if not negated:
            return self.noun_phrase(noun, verb.case)
        # Negating "a ball" gives "keinen Ball" (not "nicht einen Ball").
        indefinite = verb.case == "acc" and noun.en_pl is not None
        det = self.pick(["the"] * 3 + ["this", "poss"] + (["no"] * 2 if indefinite else []))
        phrase = self.noun_phrase(noun, verb.case, det)
        if det == "no":
            phrase.en[0] = "an" if phrase.en[1][0] in "aeiou" else "a"
        return phrase

    def add_time(self, c: Clause) -> None:
        # "Yesterday" takes the English simple past; the present perfect takes no time.
        if c.tense == "perf" or not self.chance(0.2):
            return
        c.adverb = self.pick(PAST_TIMES if c.tense == "past" else PRESENT_TIMES)
        c.front = self.chance(0.5)

    def tense(self, verb: Verb) -> str:
        options = ["pres"] * 10 + ["perf"] * 4 + ["past"] * 2 + ["can", "want", "must"]
        return self.pick(options + ([] if verb.obj else ["like"]))

    def copula_clause(self, neg_p: float) -> Clause:
        subj = self.subject(("person", "animal", "thing", "place"))
        tense = "pres" if self.chance(0.8) else "was"
        c = Clause(subj, None, tense, self.chance(neg_p))
        noun = subj.noun
        if noun is not None and "place" not in noun.kinds and self.chance(0.35):
            c.pp = self.place_phrase()
            c.neg = False
        else:
            adjective = self.adjective_for(noun) if noun else None
            adjective = adjective or self.pick([a for a in LEX_ADJECTIVES if "person" in a.kinds])
            c.predicate = Phrase([adjective.en], [adjective.de_pred])
        return c

    def motion_clause(self) -> Clause:
        verb = self.pick(LEX_MOTION)
        tense = self.pick(["pres"] * 4 + ["perf", "past", "want"])
        c = Clause(self.subject(verb.subj), verb, tense, motion=True)
        c.pp = self.destination()
        self.add_time(c)
        return c

    def giving_clause(self) -> Clause:
        verb = self.pick(LEX_GIVING)
        c = Clause(self.subject(("person",)), verb, self.pick(["pres"] * 4 + ["perf", "past"]))
        c.recipient = self.noun_phrase(self.noun_of(("person", "animal")), "dat", adj_p=0.15)
        c.obj = self.noun_phrase(self.noun_of(("thing", "food")), "acc", adj_p=0.2)
        return c

    # ---------------------------------------------------------------- sentences

    def sentence(self) -> tuple[str, str]:
        """One detokenized pair; about half are single clauses, as in real text."""
        roll = self.rng.random()
        if roll < 0.42:
            en, de = self.clause().main()
        elif roll < 0.52:
            en, de = self.clause(neg_p=0.1).question()
        elif roll < 0.58:
            en, de = self.wh_question()
        elif roll < 0.68:
            en, de = self.reported()
        elif roll < 0.82:
            en, de = self.adverbial()
        elif roll < 0.9:
            en, de = self.coordinated()
        else:
            en, de = self.relative()
        return detokenize(en), detokenize(de)

    def reported(self):
        """ "Anna thinks that the dog sleeps." = "Anna glaubt, dass der Hund schläft." """
        en_verb, en_3sg, de_forms = self.pick(THINKING)
        subj = self.subject(("person",))
        en_v = en_3sg if subj.person == 2 else en_verb
        de_v = de_forms.split()[min(subj.person, 3)]
        en, de = self.clause(place_p=0.2).subordinate("dass")
        return [*subj.en, en_v, "that", *en, "."], [*subj.de, de_v, ",", *de, "."]

    def adverbial(self):
        """Main clause with "because/although/when/while"; German verb-final after the
        conjunction, and verb-first in the main clause when the subordinate comes first."""
        en_conj, de_conj = self.pick(CONJUNCTIONS)
        main, sub = self.clause(place_p=0.15), self.clause(place_p=0.15)
        sub_en, sub_de = sub.subordinate(de_conj)
        if en_conj in ("when", "although") and self.chance(0.5):
            main_en, main_de = main.inverted()
            return [en_conj, *sub_en, ",", *main_en, "."], [*sub_de, ",", *main_de, "."]
        main_en, main_de = main.declarative()
        return [*main_en, en_conj, *sub_en, "."], [*main_de, ",", *sub_de, "."]

    def coordinated(self):
        en_conj, de_conj = self.pick([("and", "und"), ("but", "aber")])
        first_en, first_de = self.clause(place_p=0.15).declarative()
        second_en, second_de = self.clause(place_p=0.15).declarative()
        comma = [","] if de_conj == "aber" else []
        en = [*first_en, *comma, en_conj, *second_en, "."]
        return en, [*first_de, *comma, de_conj, *second_de, "."]

    def relative(self):
        """A relative clause on the object, at the end: "... den Mann, der ein Buch liest"
        (subject relative) or "... den Ball, den der Hund sieht" (object relative)."""
        c = self.clause(neg_p=0.0)
        while c.obj is None:
            c = self.clause(neg_p=0.0)
        c.pp, c.adverb = None, None
        noun, plural = c.obj.noun, c.obj.plural
        slot = "pl" if plural else noun.gender
        doers = [v for v in LEX_VERBS if any(k in v.subj for k in noun.kinds)]
        if doers and self.chance(0.5):
            verb = self.pick(doers)
            subj = Phrase([], [], 4 if plural else 2, "animal" in noun.kinds)
            rel = Clause(subj, for_subject(verb, subj), "pres")
            if verb.obj:
                rel.obj = self.noun_phrase(self.noun_of(verb.obj), verb.case)
            pronoun = cell(DEFINITE, "nom", slot)
        else:
            verb = self.pick([v for v in LEX_VERBS if any(k in v.obj for k in noun.kinds)])
            subj = self.subject(verb.subj)
            rel = Clause(subj, for_subject(verb, subj), "pres")
            dative_plural = plural and verb.case == "dat"
            pronoun = "denen" if dative_plural else cell(DEFINITE, verb.case, slot)
        who = "who" if "person" in noun.kinds else "that"
        main_en, main_de = c.declarative()
        rel_en, rel_de = rel.subordinate(pronoun)
        return [*main_en, who, *rel_en, "."], [*main_de, ",", *rel_de, "."]

    def wh_question(self):
        """ "Where is the dog?", "What does the dog see?", "Why does the man laugh?" """
        c = self.clause(neg_p=0.0)
        c.adverb = None
        if c.verb is None:  # the copula
            if c.predicate is None:
                c.pp = None  # the place is what is asked for
                return c.question(("where", "wo"))
            return c.question(("why", "warum"))
        if c.obj is not None and c.recipient is None and c.verb.case == "acc" and self.chance(0.4):
            c.obj, c.pp = None, None
            return c.question(("what", "was"))
        c.pp = None
        # Motion asks "wohin", not "wo": leave "where" to clauses without a destination.
        options = [("why", "warum"), ("when", "wann")] + ([] if c.motion else [("where", "wo")])
        return c.question(self.pick(options))


@dataclass
class Clause:
    subj: Phrase
    verb: Verb | None  # None: the copula ("is", "ist")
    tense: str  # pres perf past can want must like | was (copula)
    neg: bool = False
    obj: Phrase | None = None
    recipient: Phrase | None = None
    pp: Phrase | None = None
    adverb: tuple[str, str] | None = None
    predicate: Phrase | None = None
    neg_in_object: bool = False  # "keinen Ball": German needs no "nicht"
    front: bool = False  # the time adverb comes first (German: then the verb, then subject)
    motion: bool = False

    # ------------------------------------------------------------ German

    def german_verbs(self) -> tuple[list[str], list[str]]:
        """(finite verb, the rest of the verb group that goes to the end)."""
        p = self.subj.person
        if self.verb is None:
            return [(WAR if self.tense == "was" else SEIN)[p]], []
        if self.tense in ("perf", "past"):
            aux = SEIN if self.verb.aux == "sein" else HABEN
            return [aux[p]], [self.verb.de_pp]
        if self.tense in MODALS:
            return [MODALS[self.tense][p]], [self.verb.infinitive]
        return [self.verb.finite(p)], []

    def middle(self, adverb: bool = True) -> list[str]:
        """The German middle field: time, (nicht) gern, objects, place, nicht."""
        nicht = ["nicht"] if self.neg and not self.neg_in_object else []
        words = [self.adverb[1]] if self.adverb and adverb else []
        if self.tense == "like":
            words += [*nicht, "gern"]
            nicht = []
        for part in (self.recipient, self.obj, self.predicate, self.pp):
            if part is not None:
                if part is self.predicate:
                    words += nicht
                    nicht = []
                words += part.de
        return words + nicht

    def de_main(self, front_adverb: bool) -> list[str]:
        fin, rest = self.german_verbs()
        if front_adverb and self.adverb:
            return [self.adverb[1], *fin, *self.subj.de, *self.middle(adverb=False), *rest]
        return [*self.subj.de, *fin, *self.middle(), *rest]

    # ------------------------------------------------------------ English

    def english_verbs(self, question: bool = False) -> tuple[list[str], list[str]]:
        """(auxiliary or finite verb, the rest); a question moves the first list forward."""
        third = self.subj.person == 2
        if self.verb is None:
            if self.tense == "was":
                be = "was" if self.subj.person in (0, 2) else "were"
            else:
                be = {0: "am", 2: "is"}.get(self.subj.person, "are")
            return [be], ["not"] if self.neg else []
        base, s_form, past, pp = self.verb.en
        do = "does" if third else "do"
        if self.tense == "perf":
            return ["has" if third else "have"], ["not", pp] if self.neg else [pp]
        if self.tense == "past":
            if self.neg or question:
                return ["did"], ["not", base] if self.neg else [base]
            return [past], []
        if self.tense in ("can", "must"):
            if self.neg and not question:
                return ["cannot"], [base]
            return [self.tense], ["not", base] if self.neg else [base]
        not_ = ["not"] if self.neg else []
        if self.tense in ("want", "like"):  # "wants to go", "does not like to swim"
            if self.neg or question:
                return [do], [*not_, self.tense, "to", base]
            return [self.tense + "s" if third else self.tense], ["to", base]
        if self.neg or question:
            return [do], [*not_, base]
        return [s_form if third else base], []

    def en_tail(self) -> list[str]:
        words = []
        for part in (self.recipient, self.obj, self.predicate, self.pp):
            if part is not None:
                words += part.en
        return words

    # ------------------------------------------------------------ sentence forms

    def declarative(self, front: bool | None = None) -> tuple[list[str], list[str]]:
        """Main-clause word order; a time adverb in front moves the German verb before
        the subject (verb second)."""
        front = self.adverb is not None and (self.front if front is None else front)
        head, rest = self.english_verbs()
        en = [*self.subj.en, *head, *rest, *self.en_tail()]
        if self.adverb:
            en = [self.adverb[0], *en] if front else [*en, self.adverb[0]]
        return en, self.de_main(front)

    def main(self):
        en, de = self.declarative()
        return [*en, "."], [*de, "."]

    def inverted(self):
        """Verb first, after a fronted subordinate clause: "..., spielt die Katze." """
        fin, rest = self.german_verbs()
        en, _ = self.declarative(front=False)
        return en, [*fin, *self.subj.de, *self.middle(), *rest]

    def subordinate(self, conjunction: str):
        """German verb-final order: "dass der Hund den Ball gesehen hat"."""
        fin, rest = self.german_verbs()
        en, _ = self.declarative(front=False)
        return en, [conjunction, *self.subj.de, *self.middle(), *rest, *fin]

    def question(self, wh: tuple[str, str] | None = None):
        head, rest = self.english_verbs(question=True)
        fin, de_rest = self.german_verbs()
        en = [*head, *self.subj.en, *rest, *self.en_tail()]
        de = [*fin, *self.subj.de, *self.middle(), *de_rest]
        if self.adverb:
            en.append(self.adverb[0])
        if wh:
            en, de = [wh[0], *en], [wh[1], *de]
        return [*en, "?"], [*de, "?"]


def for_subject(verb: Verb, subj: Phrase) -> Verb:
    """Animals do not "essen" but "fressen"."""
    if verb.en[0] == "eat" and subj.animal:
        return Verb(verb.en, FRESSEN.de, FRESSEN.de_pp, "haben", verb.subj, verb.obj)
    return verb


def inflect(stem: str, ending: str) -> str:
    """Adjective + ending: "klein" + "es"; "müde" + "en" is "müden", not "müdeen"."""
    ending = ending.strip("-")
    return stem[:-1] + ending if stem.endswith("e") and ending.startswith("e") else stem + ending


def contract(prep: str, np_de: list[str]) -> list[str]:
    """in dem -> im, zu der -> zur, ...: German contracts a preposition and "dem"/"der"/"das"."""
    if np_de and (prep, np_de[0]) in CONTRACT:
        return [CONTRACT[prep, np_de[0]], *np_de[1:]]
    return [prep, *np_de]


def detokenize(tokens: list[str]) -> str:
    text = " ".join(tokens)
    for mark in (" ,", " .", " ?"):
        text = text.replace(mark, mark[1:])
    return text[0].upper() + text[1:]


# --------------------------------------------------------------------------- corpus


def generate() -> dict[str, list[tuple[str, str]]]:
    """Unique pairs (by English side), split valid, test, train in that order."""
    grammar = Grammar(random.Random(SEED))
    seen: set[str] = set()
    splits: dict[str, list[tuple[str, str]]] = {}
    for split, size in SIZES.items():
        pairs = []
        while len(pairs) < size:
            en, de = grammar.sentence()
            if en not in seen:
                seen.add(en)
                pairs.append((en, de))
        splits[split] = pairs
    return splits


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path(__file__).parent
    out.mkdir(parents=True, exist_ok=True)
    for split, pairs in generate().items():
        for i, lang in enumerate(("en", "de")):
            text = "".join(pair[i] + "\n" for pair in pairs)
            (out / f"{split}.{lang}").write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
