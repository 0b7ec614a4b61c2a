"""Write data/train_prompts.txt: the prompts `spec-edge train-draft` asks the target to answer.

Templates x topics, deterministic (no randomness, no download), with the held-out evaluation
prompts' topics (data/eval_prompts.jsonl) left out so measurements stay held out:

    .venv/bin/python scripts/make_train_prompts.py            # rewrites data/train_prompts.txt
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TOPICS = """the immune system; nuclear energy; electric cars; submarines; time zones; democracy; solar panels;
the periodic table; 3D printing; machine learning; the stock market; climate change; composting; black holes;
public speaking; packing for a trip; smartphones; inflation; rainbows; the water cycle; robots in warehouses;
clouds; penguins; GPS navigation; ocean tides; the Roman Empire; volcanoes; earthquakes; photosynthesis; vaccines;
the internet; bicycles; coffee; chess; the moon; Mars; the human heart; sleep; exercise; recycling; bees;
dinosaurs; the printing press; trains; bridges; wind turbines; batteries; lasers; magnets; gravity;
the speed of light; DNA; bacteria; viruses; antibiotics; the brain; memory; habits; budgeting; saving money;
cooking pasta; baking bread; growing tomatoes; houseplants; dogs; horses; whales; sharks; elephants; owls;
the Amazon rainforest; deserts; glaciers; hurricanes; lightning; snow; the seasons; the solar system;
comets; telescopes; satellites; rockets; the International Space Station; airports; traffic lights;
self-driving cars; drones; robot arms; lidar sensors; cameras; microphones; loudspeakers; radio; television;
video games; board games; football; basketball; swimming; running a marathon; yoga; meditation; music;
the piano; the guitar; painting; photography; movies; libraries; museums; ancient Egypt; the pyramids;
the Great Wall of China; the Olympic Games; the French Revolution; the Industrial Revolution; the Renaissance;
Shakespeare; poetry; learning a language; writing an essay; job interviews; teamwork; leadership;
time management; email etiquette; passwords; encryption; cloud computing; databases; open source software;
the Linux operating system; programming; version control; unit testing; debugging; spreadsheets;
electric motors; gears; hydraulics; welding; plumbing; solar eclipses; the northern lights; coral reefs;
rivers; mountains; forests; soil; farming; irrigation; fishing; plastic pollution; air quality; noise;
first aid; fire safety; earthquakes preparedness; hand washing; healthy eating; vitamins; water filtration;
cities; public transport; electricity grids; nuclear fusion; hydrogen fuel; carbon capture; ocean currents;
the human eye; hearing; taste; smell; touch sensors; balance; walking robots; robot grippers; warehouses;
delivery robots; lawn mowing robots; agricultural robots; surgical robots; underwater robots; space probes;
factory automation; conveyor belts; barcodes; QR codes; credit cards; banks; taxes; voting; newspapers;
social media; online shopping; customer service; restaurants; hotels; camping; hiking; maps; compasses;
clocks; calendars; the metric system; fractions; prime numbers; probability; statistics; geometry;
algebra; calculus; the Pythagorean theorem; infinity; zero; encryption keys; blockchains; chemistry labs;
acids and bases; salt; sugar; chocolate; ice cream; tea ceremonies in Japan; spices; vegetables; fruit;
bread yeast; fermentation; cheese; milk; eggs; wool; cotton; silk; glass; steel; concrete; wood; paper;
ink; pencils; keyboards; computer mice; screens; headphones; smart homes; thermostats; door locks;
security cameras; elevators; escalators; cranes; tunnels; canals; ships; sailing; lighthouses; kites;
hot air balloons; helicopters; jet engines; parachutes; weather forecasts; thermometers; barometers""".replace("\n", " ")

FREE_FORM = [
    "Explain {t} in simple terms.", "Write a short paragraph about {t}.", "Give me a brief summary of {t}.",
    "List the main points someone should know about {t}.", "What are three interesting facts about {t}?",
    "How would you explain {t} to a child?", "Why is {t} important?", "Write a short poem about {t}.",
    "Describe the history of {t} in a few sentences.", "What are the pros and cons of {t}?",
    "Write a short story that involves {t}.", "What questions do people often ask about {t}? Answer two of them.",
]

SENTENCES = """the robot is late again because the map was wrong; the battery ran out before it reached the dock;
we need to check the motors every week or they break; the camera on the left side is dirty and the images are blurry;
the delivery robot dropped the package near the door; my computer keeps crashing when i open too many tabs;
the meeting was moved to thursday but nobody told the team; the warehouse is full and we cant store more boxes;
the gripper did not close fully so the cup fell; the wifi signal in the lab is weak and keeps dropping;
the arm moves too fast near people and that is dangerous; we finished the inspection of the pipes and found two leaks;
the new software update made the robot slower; the customer wants the report by friday morning;
the lawn mower robot got stuck under the bench; the lidar sees the glass wall as empty space;
the temperature in the server room is too high; the drone landed on the roof instead of the pad;
the cleaning robot skipped the kitchen again; our team won the robotics competition last year""".replace("\n", " ")

EDIT = [
    "Rewrite this sentence more formally: {s}.", "Fix the grammar and spelling: {s}.", "Rewrite in the past tense: {s}.",
    "Summarize in five words: {s}.", "Translate into simple English for a child: {s}.",
    "Repeat this text exactly, then add one sentence: {s}.", "Turn this into a polite request: {s}.",
    "Rewrite this as a bulleted list of facts: {s}.",
]

ROBOT = """go to the kitchen and bring me a glass of water; move the red box from the table to the shelf;
stop and wait for me at the door; find my keys in the living room; check the battery and report the level;
patrol the hallway twice and report anything unusual; open the garage door and turn on the lights;
take a photo of the front yard; follow me to the office; clean the spill near the sink;
pick up the blue cup and put it in the dishwasher; return to the charging dock; inspect the pipes in the basement;
deliver this package to room 204; count the chairs in the meeting room""".replace("\n", " ")

ROBOT_TEMPLATES = [
    "Convert this instruction into a JSON command with fields action, object and location: {c}.",
    "You are a home robot. The user says: '{c}'. List the steps you will take.",
    "Write a one-line status message a robot would send after it was asked to {c}.",
]

CODE = """reverse a string; check if a number is prime; compute the factorial of n; find the largest number in a list;
count the words in a sentence; read a CSV file and print the first row; merge two sorted lists; remove duplicates from a list;
compute the average of a list of numbers; check if a string is a palindrome; convert Celsius to Fahrenheit;
compute Fibonacci numbers; sort a list of dictionaries by a key; compute the distance between two points;
convert a robot's wheel encoder ticks to meters; parse a time string like 12:30 into minutes; flatten a nested list;
count how often each letter appears in a text; clamp a value between a minimum and a maximum;
compute a moving average over a list""".replace("\n", " ")

CODE_TEMPLATES = ["Write a Python function to {c}.", "Explain how to {c} in Python, with a short example."]


def held_out_words() -> set[str]:
    words: set[str] = set()
    for line in (ROOT / "data/eval_prompts.jsonl").read_text().splitlines():
        if line.strip():
            prompt = json.loads(line)["prompt"].lower()
            words.update(w.strip(".,?!:'") for w in prompt.split() if len(w) > 6)
    return words


def split(text: str) -> list[str]:
    return [part.strip() for part in text.split(";") if part.strip()]


def prompts() -> list[str]:
    banned = held_out_words() - {"explain", "summary", "interesting", "paragraph", "someone", "rewrite", "sentence"}
    topics = [t for t in dict.fromkeys(split(TOPICS)) if not any(w in banned for w in t.lower().split())]
    out = [template.format(t=topic) for topic, template in itertools.product(topics, FREE_FORM)]
    out += [template.format(s=s) for s, template in itertools.product(split(SENTENCES), EDIT)]
    out += [template.format(c=c) for c, template in itertools.product(split(ROBOT), ROBOT_TEMPLATES)]
    out += [template.format(c=c) for c, template in itertools.product(split(CODE), CODE_TEMPLATES)]
    # interleave kinds deterministically so --max-prompts N takes a mix
    return [out[(i * 7919) % len(out)] for i in range(len(out))] if len(out) % 7919 else out


def main() -> int:
    lines = prompts()
    path = ROOT / "data/train_prompts.txt"
    path.write_text("# Training prompts for `spec-edge train-draft` (one per line), written by "
                    "scripts/make_train_prompts.py;\n# held-out eval prompts: data/eval_prompts.jsonl\n"
                    + "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
