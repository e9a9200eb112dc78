"""Extend tidal/data/train_prompts.json, the drafter's self-distillation prompts, with chat-style
prompts composed from templates and topics (seeded, so a rerun adds nothing new).

    python scripts/make_train_prompts.py [--count 1600]

Why: a head trained on the first 617 prompts (a few dozen templates) agreed with the target on
0.43 of first drafts for held-out prompts of the same kind but 0.29 on the shipped chat prompts
(fixed K=4, greedy): it had learnt the templates more than the target. These prompts copy the
chat set's variety of task (questions, explanations, how-tos, short writing, lists, comparisons,
advice, code) over other topics. A prompt of the benchmark sets (chat, rewrite) is never added.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "tidal" / "data"


def items(text: str) -> list[str]:
    """'a|b c|...' over several lines -> ['a', 'b c', ...]."""
    return [" ".join(x.split()) for x in text.split("|")]


THINGS = items("""an atom|a galaxy|a volcano|an earthquake|a tsunami|a glacier|a desert|a coral reef|a rainforest|a comet
|an eclipse|a hurricane|a tornado|a compiler|a database|an operating system|a web browser|a search engine|a firewall
|a spreadsheet|encryption|a blockchain|cloud computing|a router|a pixel|a semiconductor|a battery|a solar panel
|a wind turbine|a nuclear reactor|an enzyme|a protein|a cell membrane|an antibody|a gene|evolution|an ecosystem
|a food chain|erosion|a fossil|the ozone layer|a constellation|a nebula|a satellite|an exoplanet|the stock market
|a mortgage|a budget|compound interest|a startup|a monopoly|democracy|a constitution|a parliament|an election
|a treaty|philosophy|ethics|logic|a metaphor|a sonnet|an opera|a symphony|jazz|impressionism|a sculpture|architecture
|a bridge|a skyscraper|a canal|a lighthouse|a telescope|a microscope|a thermometer|a compass|a barometer|a vaccine trial
|an allergy|a migraine|sleep|nutrition|metabolism|a calorie|protein in food|fiber|hydration|meditation|mindfulness
|a habit|motivation|procrastination|teamwork|leadership|negotiation|a resume|a job interview|public speaking
|a podcast|a blog|social media|a smartphone|a drone|a robot vacuum|3D printing|virtual reality|augmented reality
|artificial intelligence|a chatbot|a sorting algorithm|binary search|a linked list|a stack|a queue|a binary tree
|a graph in computer science|big O notation|an integer overflow|a race condition|version control|unit testing
|a regular expression|JSON|HTML|CSS|SQL|an HTTP request|a cookie in a web browser|a password manager""")

CONCEPTS = items("""gravity on the moon|tides|magnetism|electricity|friction|momentum|inertia|sound waves|light refraction
|static electricity|the greenhouse effect|ocean currents|plate tectonics|the rock cycle|the nitrogen cycle|digestion
|the immune system|blood circulation|breathing|how muscles grow|memory|dreams|probability|fractions|percentages
|negative numbers|the number zero|algebra|geometry|statistics|averages|interest rates|taxes|trade|opportunity cost
|compound words|punctuation|the past tense|poetry meter|storytelling|perspective in drawing|color mixing|rhythm in music
|object-oriented programming|functions in programming|variables|loops|caching|multithreading|garbage collection
|public key cryptography|compression|machine translation|speech recognition|the scientific method|peer review
|renewable energy|recycling|composting|biodiversity|migration of birds|hibernation|camouflage in animals|pollination
""")

HOW_WORKS = items("""a microwave oven|a camera|a touchscreen|GPS|a car engine|an electric car|a bicycle gear|a lock and key
|a thermostat|a vacuum cleaner|a washing machine|a dishwasher|a printer|a speaker|a microphone|noise-cancelling
headphones|a credit card|a heat pump|a submarine|a helicopter|a rocket|a parachute|an elevator|a hydroelectric dam
|a water filter|soap|a fire extinguisher|a smoke detector|a traffic light|a barcode scanner|Wi-Fi|Bluetooth
|a QR code|an electric guitar|a piano|a violin|yeast in bread|a sourdough starter|a pressure cooker|an espresso machine
""")

TASKS = items("""change a flat bicycle tire|plant tomatoes|start running|write a cover letter|prepare for an exam
|clean a cast iron pan|make pancakes|bake bread|boil an egg|brew coffee with a French press|learn to juggle
|organize my closet|plan a birthday party|set up a home office|improve my handwriting|take better photos with a phone
|keep houseplants alive|train a puppy to sit|remove a coffee stain|fold a paper airplane|start a vegetable garden
|back up my computer|make a budget|stop procrastinating|fall asleep faster|remember names|stretch after a run
|pack a suitcase efficiently|learn to swim as an adult|write a good essay introduction|give a wedding toast
|choose a laptop|make a smoothie|sharpen a kitchen knife|read a map|build a campfire safely|meditate for beginners
""")

PYTHON = items("""read a file line by line|count words in a string|sort a dictionary by value|remove duplicates from a list
|check if a string is a palindrome|merge two dictionaries|find the largest number in a list|format a date
|make an HTTP request|parse JSON|write a CSV file|generate a random number|measure how long code takes
|reverse a string|flatten a nested list|check if a file exists|convert a string to an integer|use a list comprehension
|handle an exception|define a class|read command-line arguments|compute a factorial|split a string by commas
""")

FORMS = ["a haiku", "a short poem", "a limerick", "a two-line story", "a short story opening", "a riddle",
         "a tweet", "a product description", "a short song", "a diary entry", "a news headline and first sentence",
         "a fable with a moral", "an acrostic poem", "a motivational speech of three sentences", "a joke"]
SUBJECTS = items("""winter mornings|a lost umbrella|the first day of school|a lighthouse keeper|a dragon who is afraid of the
dark|a busy kitchen|a quiet library|the moon|an old bicycle|city traffic|a garden in spring|a lonely astronaut
|a mischievous dog|the smell of rain|a mountain village|a broken clock|a train journey|friendship|a storm at sea
|a talking tree|a new smartphone|a coffee shop|a snowman|the desert at night|a family picnic|a chess game
|a firefly|homework|a surprise party|the ocean floor|a forgotten letter|a marathon runner|a rainy Sunday
""")

PAIRS = items("""a frog and a toad|a crocodile and an alligator|a star and a planet|a comet and an asteroid|RAM and storage
|a compiler and an interpreter|Python and JavaScript|TCP and UDP|a list and a tuple in Python|a democracy and a
monarchy|a hurricane and a typhoon|baking soda and baking powder|a violin and a viola|a novel and a short story
|an ape and a monkey|a rabbit and a hare|a fruit and a vegetable|a simile and a metaphor|speed and velocity
|mass and weight|an epidemic and a pandemic|a debit card and a credit card|a loan and a grant|renting and buying
a home|a cold and the flu|a turtle and a tortoise|a cup and a mug|a river and a stream|a city and a town
|a mountain and a hill|an ocean and a sea|a moth and a butterfly""")

LISTS = items("""fruits that are high in vitamin C|famous scientists|musical instruments from Africa|European capitals
|ways to reduce plastic waste|board games for families|classic novels|mammals that live in the ocean|uses of
vinegar at home|birds that cannot fly|famous bridges|indoor hobbies|outdoor activities for kids|healthy breakfast
ideas|sources of renewable energy|programming languages for beginners|rivers in Asia|kinds of clouds|types of
triangles|dog breeds for apartments|ways to say hello in other languages|inventions of the twentieth century
|vegetables that grow quickly|questions to ask in a job interview|reasons to learn history""")

WHYS = items("""Why do leaves change color in autumn?|Why is the ocean salty?|Why do we yawn?|Why do cats purr?
|Why does bread rise?|Why does ice float?|Why does the moon have phases?|Why do onions make us cry?|Why do we get
goosebumps?|Why does metal feel cold?|Why do stars twinkle?|Why do we need sleep?|Why do birds migrate?|Why does
popcorn pop?|Why do planes leave white trails?|Why does my voice sound different on recordings?|Why is the sunset
red?|Why are bubbles round?|Why does rubber bounce?|Why do we have fingerprints?|Why do zebras have stripes?
""")

ADVICE = items("""studying for a math test|staying focused while working from home|making new friends in a new city
|eating more vegetables|running a first 5k|saving for a vacation|writing a short story|speaking confidently in
meetings|reducing screen time|learning to cook|keeping a journal|starting a small business|caring for a cat
|travelling on a budget|learning to draw|managing stress|getting up early|reading more books""")

BOOKS = items("""Hamlet|Macbeth|Pride and Prejudice|Moby-Dick|The Odyssey|Frankenstein|Dracula|Jane Eyre|Oliver Twist
|Treasure Island|Alice in Wonderland|The Little Prince|Don Quixote|Robinson Crusoe|The Wizard of Oz
|Gulliver's Travels|The Jungle Book|A Christmas Carol|Little Women|The Time Machine""")

SCENES = items("""a busy market in the morning|a forest after rain|a snowy street at night|a crowded train station
|a summer beach|an old castle|a thunderstorm|a quiet lake at dawn|a city skyline at night|a farm in autumn
|a school playground|a bakery at sunrise""")

PHRASES = ["thank you very much", "where is the train station", "I am hungry", "see you tomorrow",
           "happy birthday", "how much does this cost", "good night", "I love reading", "the weather is nice today"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]
NAMEABLE = ["a goldfish", "a coffee shop", "a robot", "a hiking club", "a sailboat", "a bakery",
            "a podcast about science", "a puppy", "a fantasy kingdom", "a team of developers"]
EMAILS = items("""asking a colleague for help with a report|thanking a teacher|inviting neighbours to a party|declining a
meeting politely|asking for a deadline extension|welcoming a new team member|complaining about a late delivery
|requesting a refund|congratulating a friend on a new job""")


def generated(rng: random.Random) -> list[str]:
    """Every composed prompt, shuffled."""
    out = [f"What is {t}?" for t in THINGS]
    out += [f"Explain {c}{a}." for c in CONCEPTS
            for a in rng.sample(["", " to a ten-year-old", " in two sentences", " in simple terms",
                                 " with an example", " briefly"], 2)]
    out += [f"How does {x} work?" for x in HOW_WORKS]
    out += [f"How do I {t}?" for t in TASKS]
    out += [f"How do I {t} in Python?" for t in PYTHON]
    out += [f"Write {f} about {s}." for f in FORMS for s in rng.sample(SUBJECTS, 6)]
    out += [f"What is the difference between {p}?" for p in PAIRS]
    out += [f"List {rng.choice(['three', 'four', 'five'])} {x}." for x in LISTS]
    out += WHYS
    out += [f"Give {rng.choice(['three', 'five'])} tips for {a}." for a in ADVICE]
    out += [f"Summarize the plot of {b} in three sentences." for b in BOOKS]
    out += [f"Describe {s}." for s in SCENES]
    out += [f"Translate '{p}' into {lang}." for p in PHRASES for lang in rng.sample(LANGUAGES, 2)]
    out += [f"Suggest five names for {n}." for n in NAMEABLE]
    out += [f"Write an email {e}." for e in EMAILS]
    out += [f"What is {a} times {b}? Show the steps." for a, b in ((rng.randint(11, 99), rng.randint(11, 99))
                                                                 for _ in range(20))]
    rng.shuffle(out)
    return out


def key(prompt: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", prompt.lower()).strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=1600, help="new prompts to add at most")
    args = ap.parse_args()
    path = DATA / "train_prompts.json"
    current = json.loads(path.read_text())
    held = {key(p) for name in ("chat_prompts.json", "rewrite_prompts.json") for p in json.loads((DATA / name).read_text())}
    seen = {key(p) for p in current} | held
    new = []
    for p in generated(random.Random(0)):
        if key(p) not in seen and len(new) < args.count:
            seen.add(key(p))
            new.append(p)
    path.write_text(json.dumps(current + new, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(current)} prompts + {len(new)} new = {len(current) + len(new)} in {path}")


if __name__ == "__main__":
    main()
