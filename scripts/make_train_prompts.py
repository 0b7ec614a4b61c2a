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

# Second set (session 7), appended after the first so the first 3,425 prompts (and the cached
# answers and the held-out split of train-draft) stay as they were: many more topics, each asked
# in seven of sixteen templates (topic variety is what the head lacked on held-out prompts).
TOPICS_2 = """how microwaves heat food; washing machines; dishwashers; vacuum cleaners; air conditioners; heat pumps;
light bulbs; LED lights; smoke detectors; water heaters; sewing machines; bicycles gears; car engines; car brakes;
tires; seat belts; airbags; electric scooters; motorcycles; buses; subways; ferries; cargo ships; container ports;
the postal service; package delivery; supermarkets; farmers markets; vending machines; cash registers; coins;
paper money; interest rates; loans; insurance; retirement savings; renting an apartment; buying a house;
moving to a new city; making friends; keeping a journal; reading books; writing letters; birthdays; weddings;
holidays; gardening; pruning trees; planting flowers; lawns; bird feeders; butterflies; ants; spiders; frogs;
turtles; dolphins; jellyfish; crabs; salmon; eagles; parrots; crows; bats; wolves; bears; foxes; rabbits;
squirrels; giraffes; lions; tigers; zebras; camels; kangaroos; koalas; pandas; gorillas; chimpanzees;
hamsters; goldfish; guinea pigs; taking care of a puppy; training a dog; feeding birds in winter;
the rain; fog; thunder; tornadoes; droughts; floods; wildfires; the sun; stars; galaxies; the Milky Way;
planets; Jupiter; Saturn's rings; Venus; asteroids; meteor showers; astronauts; spacesuits; the Big Bang;
atoms; molecules; electrons; protons; energy; heat; sound waves; light waves; colors; mirrors; lenses;
microscopes; magnifying glasses; prisms; shadows; friction; pressure; buoyancy; why ships float; levers;
pulleys; wheels and axles; springs; pendulums; simple machines; engines; steam power; windmills; water mills;
dams; hydroelectric power; geothermal energy; oil and gas; coal; biofuels; energy saving at home;
insulation; double glazed windows; roofs; foundations of a house; bricks; skyscrapers; castles; cathedrals;
ancient Greece; ancient Rome's roads; the Vikings; the Middle Ages; knights; the Silk Road; the Aztecs;
the Maya; the Inca; the Ottoman Empire; the Mongol Empire; the moon landing; the invention of the telephone;
the invention of the light bulb; the Wright brothers; Marie Curie; Isaac Newton; Albert Einstein;
Leonardo da Vinci; Ada Lovelace; Alan Turing; Charles Darwin; evolution; fossils; rocks and minerals;
crystals; caves; islands; lakes; waterfalls; beaches; sand dunes; the Arctic; Antarctica; the Sahara;
the Himalayas; the Nile; the Mississippi River; rain gauges; soil erosion; wetlands; mangroves; savannas;
grasslands; tundra; jungles; biodiversity; endangered species; national parks; zoos; aquariums;
botanical gardens; wildlife photography; bird watching; stargazing; fishing rods; tents; sleeping bags;
campfires; knots; map reading; orienteering; rock climbing; skiing; snowboarding; ice skating; surfing;
kayaking; tennis; golf; baseball; cricket; rugby; volleyball; table tennis; cycling races; gymnastics;
martial arts; boxing; dancing; ballet; singing; choirs; orchestras; drums; violins; jazz; rock music;
hip hop; opera; theater; circus; magic tricks; puzzles; crosswords; sudoku; riddles; jokes; comics;
cartoons; animation; podcasts; audiobooks; e-readers; tablets; laptops; printers; routers; Bluetooth;
USB cables; chargers; power banks; memory cards; hard drives; SSDs; computer memory; processors; GPUs;
operating systems; web browsers; search engines; websites; HTML; JavaScript; Python programming;
APIs; software bugs; software updates; computer viruses; phishing emails; two-factor authentication;
backups; privacy online; data centers; artificial intelligence; chatbots; speech recognition;
face recognition; robot vacuum cleaners; robot lawn mowers; robot dogs; humanoid robots; robot hands;
robot sensors; robot batteries; robot navigation; obstacle avoidance; path planning; SLAM mapping;
robot safety; teleoperation; exoskeletons; prosthetic limbs; hearing aids; wheelchairs; guide dogs;
hospitals; doctors; nurses; dentists; brushing teeth; eyeglasses; contact lenses; allergies; colds and flu;
fever; headaches; broken bones; muscles; the skeleton; the lungs; the stomach; the liver; the kidneys;
blood; the skin; hair; fingernails; growing up; teenagers; grandparents; families; neighbors; friendship;
kindness; patience; honesty; gratitude; curiosity; creativity; motivation; stress; happiness; boredom;
homework; exams; schools; teachers; universities; scholarships; online courses; studying tips;
note taking; mind maps; presentations; slides; meetings; deadlines; to-do lists; working from home;
offices; startups; small businesses; marketing; advertising; brands; logos; prices; discounts;
recycling plastic; glass recycling; electronic waste; reusable bags; water saving; rainwater harvesting;
solar water heaters; electric buses; bike lanes; pedestrian crossings; road signs; parking; car sharing;
traffic jams; highways; gas stations; charging stations for cars; maps on phones; weather apps;
alarm clocks; watches; sundials; hourglasses; leap years; time travel stories; science fiction;
fairy tales; myths; dragons; unicorns; pirates; treasure maps; detectives; mysteries; superheroes;
pizza; sandwiches; soup; rice; noodles; sushi; tacos; salads; pancakes; cookies; cakes; honey; jam;
apples; bananas; oranges; strawberries; potatoes; carrots; onions; garlic; beans; nuts; olive oil;
coffee beans; breakfast; lunch boxes; picnics; kitchen knives; frying pans; ovens; toasters; kettles""".replace("\n", " ")

FREE_FORM_2 = FREE_FORM + [
    "How does {t} work?", "Tell me something surprising about {t}.",
    "What would a beginner need to know about {t}?", "Write a short dialogue between two friends about {t}.",
]
TEMPLATES_PER_TOPIC_2 = 7

SITUATIONS = """a child runs in front of it; its battery is almost empty far from the dock; the floor is wet;
it hears a smoke alarm; a door it needs is locked; two people give it different orders; it drops a glass;
it loses its map; a pet follows it everywhere; it cannot see because of bright sunlight; someone asks it for
medicine; it finds a window open at night; its arm gets stuck; the elevator is out of service;
it is asked to carry something too heavy; a stranger rings the doorbell; the wifi goes down;
it sees water leaking under a sink; someone falls down; it is asked to go outside in the rain""".replace("\n", " ")

HELPED = """a nurse in a hospital; a farmer; a teacher in a classroom; a shop owner; a firefighter; a cook in a
restaurant; a student doing homework; a family with a new baby; a person who cannot see well; a gardener""".replace("\n", " ")

SITUATION_TEMPLATES = ["What should a robot do if {s}?", "How should a home robot react when {s}?"]
HELPED_TEMPLATE = "Describe how a robot could help {h}."

# Third set (session 8), appended after the second for the same reason: more topics again (each in
# seven of twenty-four templates), how-to tasks and comparisons, forms the first two sets lack.
TOPICS_3 = """how a toilet flushes; how a zipper works; how a lock and key work; how a compass works; how a camera lens focuses;
how a thermostat works; how a pressure cooker works; how noise cancelling headphones work; how touch screens work;
how a battery stores energy; how solar cells make electricity; how a radio receives signals; how wifi works;
how email travels; how a search engine ranks pages; how credit card payments work; how a bank loan works;
how a bill becomes a law; how elections are counted; how courts work; how juries decide; how a city council works;
how water gets to your tap; how sewage is treated; how garbage is collected; how paper is made; how glass is made;
how steel is made; how chocolate is made; how cheese is made; how bread rises; how popcorn pops; how soap cleans;
how a vaccine is tested; how a pill is made; how x-rays work; how MRI scanners work; how a pacemaker works;
how hearts pump blood; how lungs breathe; how muscles grow; how bones heal; how the ear hears; how the nose smells;
how plants drink water; how seeds grow; how trees grow rings; how flowers attract bees; how birds migrate;
how fish breathe; how bats find food; how chameleons change color; how snakes move; how cats purr;
how dogs sense smells; how spiders spin webs; how ants find food; how salmon swim upstream; how whales sing;
how mountains form; how islands form; how caves form; how deltas form; how rivers carve valleys;
how tsunamis form; how snowflakes form; how hail forms; how fog forms; how a rainbow forms after rain;
how stars are born; how the sun makes light; how planets orbit; how tides follow the moon; how comets get tails;
how rockets reach orbit; how satellites stay up; how astronauts sleep in space; how a space telescope sees far;
the Apollo program; the Hubble telescope; the James Webb telescope; the Mars rovers; the Voyager probes;
the first computers; the history of the internet; the history of video games; the history of cars;
the history of flight; the history of medicine; the history of money; the history of writing;
the history of the bicycle; the history of cameras; the history of music recording; the history of maps;
the history of clocks; the history of bridges; the history of robots; the history of the telephone;
the Stone Age; the Bronze Age; the Iron Age; the age of exploration; the Great Depression; the space race;
the Cold War; the invention of paper; the invention of the wheel; the invention of the steam engine;
the invention of the radio; the invention of the transistor; the invention of the microscope;
Nikola Tesla; Thomas Edison; Galileo Galilei; Johannes Gutenberg; Florence Nightingale; Louis Pasteur;
Grace Hopper; Katherine Johnson; Mahatma Gandhi; Nelson Mandela; Martin Luther King; Cleopatra;
Julius Caesar; Alexander the Great; Napoleon; Queen Victoria; Abraham Lincoln; George Washington;
Wolfgang Amadeus Mozart; Ludwig van Beethoven; Vincent van Gogh; Pablo Picasso; Frida Kahlo; Jane Austen;
Mark Twain; Charles Dickens; Homer's Odyssey; the Iliad; Greek gods; Norse gods; Egyptian gods;
the Trojan horse; King Arthur; Robin Hood; Sherlock Holmes; Alice in Wonderland; Don Quixote;
machine vision; reinforcement learning; large language models; computer chips; quantum computers;
virtual reality; augmented reality; smart watches; fitness trackers; electric bikes; e-scooter sharing;
autonomous tractors; vertical farming; hydroponics; aquaponics; greenhouses; beekeeping; chicken farming;
dairy farms; vineyards; orchards; rice paddies; wheat fields; tractors; combine harvesters; fertilizer;
pesticides; organic food; food labels; food waste; food banks; school lunches; vegetarian diets;
drinking enough water; sugar in drinks; sleep schedules; screen time; posture at a desk; stretching;
walking every day; running shoes; swimming lessons; learning to ride a bike; learning to swim;
learning to cook; learning to drive; learning to code; learning to draw; learning an instrument;
learning to type; public libraries; community gardens; volunteering; charity; recycling centers;
fire stations; police stations; post offices; city parks; playgrounds; skate parks; swimming pools;
train stations; bus stops; harbors; airports security; passports; visas; currency exchange; souvenirs;
travel insurance; jet lag; road trips; cruise ships; backpacking; youth hostels; camping stoves;
water bottles; sunscreen; sunglasses; umbrellas; raincoats; winter coats; boots; socks; sewing buttons;
ironing clothes; laundry; folding clothes; cleaning windows; mopping floors; dusting shelves;
organizing a closet; decluttering; moving boxes; furniture assembly; painting a wall; hanging a picture;
fixing a leaky tap; changing a light bulb; resetting a router; cleaning a keyboard; updating a phone;
charging an electric car; checking tire pressure; jump starting a car; changing a bike tire;
caring for a cactus; repotting a plant; watering a garden; composting kitchen scraps; raising chickens;
keeping an aquarium; walking a dog; grooming a horse; feeding a rabbit; adopting a pet;
warehouse inventory; forklifts; pallets; shipping containers; supply chains; just in time delivery;
quality control; assembly lines; car factories; semiconductor factories; clean rooms; industrial robots;
collaborative robots; robot programming; robot simulation; robot competitions; robot ethics;
robots in hospitals; robots in schools; robots in restaurants; robots in hotels; robots in farming;
robots in space; robots in the ocean; robots in mines; robots in disaster zones; robots at airports;
robot cleaners in offices; robot guides in museums; robot bartenders; robot toys; robot pets;
motors and encoders; servo motors; stepper motors; wheels and tracks; legs versus wheels; robot balance;
infrared sensors; ultrasonic sensors; bump sensors; force sensors; temperature sensors; cameras for robots;
depth cameras; microphones for robots; speakers for robots; robot voices; robot faces; robot lights;
charging docks; wireless charging; battery safety; robot maintenance; robot software updates;
emergency stop buttons; safety zones around robots; robot speed limits; robot logs; robot maps;
indoor navigation; outdoor navigation; GPS errors; following a line; following a person; avoiding stairs;
opening doors; pressing elevator buttons; carrying trays; sorting packages; picking fruit; folding laundry;
mountain goats; polar bears; penguin chicks; sea turtles; seahorses; starfish; squid;
sea otters; beavers; hedgehogs; moles; owls hunting; hummingbirds; peacocks; flamingos; ostriches;
woodpeckers; pigeons; ravens; swans; ducks; geese; hawks; vultures; snails; worms; ladybugs; dragonflies;
fireflies; mosquitoes; termites; crickets; grasshoppers; moths; caterpillars; tadpoles; lizards;
crocodiles; alligators; iguanas; cheetahs; leopards; hippos; rhinos; moose; deer; reindeer; bison;
llamas; yaks; donkeys; goats; sheep; cows; pigs; chickens; pet fish; parakeets""".replace("\n", " ")

FREE_FORM_3 = FREE_FORM_2 + [
    "Give me five tips about {t}.", "Explain {t} in three sentences.", "Write a short blog post about {t}.",
    "What are common mistakes people make about {t}?", "Write a short news report about {t}.",
    "What is the future of {t}?", "Summarize {t} for a busy reader.", "Teach me about {t} step by step.",
]

HOW_TO = """boil an egg; make a cup of tea; clean a frying pan; sharpen a pencil; tie a tie; plant a tree;
make a paper airplane; wrap a present; set a table for dinner; write a thank you note; make a budget;
plan a birthday party; study for a test; prepare for a job interview; give a short speech; start a podcast;
take better photos with a phone; make a strong password; spot a phishing email;
clean a laptop screen; speed up a slow computer; set up a home network; connect a printer; write a resume;
save energy in winter; keep a room cool in summer; stay safe in a thunderstorm; prepare for a power outage;
pack a first aid kit; treat a small cut; help someone who is choking; stay calm before an exam;
fall asleep faster; wake up early; build a habit; read faster; remember names; learn new words;
make a smoothie; cook rice; bake cookies; make a salad; make pancakes; store vegetables; freeze bread;
wash a car; check the oil in a car; park a car; ride a bike safely in traffic; read a bus timetable;
find your way with a paper map; build a campfire safely; set up a tent; pack a backpack for a hike;
teach a dog to sit; litter train a kitten; clean a fish tank; care for a sick pet; choose a pet;
program a simple robot; calibrate a robot camera; charge a robot vacuum; clean robot wheels;
plan a robot's path around furniture; test a robot's emergency stop; replace a robot's battery;
write a bug report; review code; name variables well; write a good commit message; learn a new programming language""".replace("\n", " ")

HOW_TO_TEMPLATES = ["How do I {h}?", "Give step-by-step instructions to {h}.", "What is the easiest way to {h}?"]

PAIRS = """a lake and a sea; weather and climate; a virus and a bacterium; a star and a planet;
a frog and a toad; a crocodile and an alligator; a moth and a butterfly; a turtle and a tortoise;
a hurricane and a tornado; speed and velocity; mass and weight; heat and temperature; AC and DC current;
a laptop and a tablet; RAM and storage; hardware and software; a browser and a search engine;
a robot and a machine; a sensor and an actuator; a motor and an engine; a map and a globe;
a city and a village; a museum and a gallery; a novel and a short story; a poem and a song;
baking and frying; a fruit and a vegetable; butter and margarine; tea and coffee; walking and running;
a bus and a train; a plane and a helicopter; a boat and a ship; a bike and a motorcycle;
renting and buying; saving and investing; a debit card and a credit card; a need and a want;
a lidar and a camera; wheels and legs for robots; a drone and a plane; teleoperation and autonomy""".replace("\n", " ")

PAIR_TEMPLATES = ["What is the difference between {p}?", "Compare {p} in a few sentences."]


def held_out_words() -> set[str]:
    words: set[str] = set()
    for line in (ROOT / "data/eval_prompts.jsonl").read_text().splitlines():
        if line.strip():
            prompt = json.loads(line)["prompt"].lower()
            words.update(w.strip(".,?!:'") for w in prompt.split() if len(w) > 6)
    return words


def split(text: str) -> list[str]:
    return [part.strip() for part in text.split(";") if part.strip()]


def kept(text: str, banned: set[str]) -> list[str]:
    """The ;-separated items of text, first occurrences only, without those that use a held-out word."""
    return [item for item in dict.fromkeys(split(text)) if not any(w in banned for w in item.lower().split())]


def prompts() -> list[str]:
    banned = held_out_words() - {"explain", "summary", "interesting", "paragraph", "someone", "rewrite", "sentence"}
    out = [template.format(t=topic) for topic, template in itertools.product(kept(TOPICS, banned), FREE_FORM)]
    out += [template.format(s=s) for s, template in itertools.product(split(SENTENCES), EDIT)]
    out += [template.format(c=c) for c, template in itertools.product(split(ROBOT), ROBOT_TEMPLATES)]
    out += [template.format(c=c) for c, template in itertools.product(split(CODE), CODE_TEMPLATES)]
    # interleave kinds deterministically so --max-prompts N takes a mix
    first = [out[(i * 7919) % len(out)] for i in range(len(out))] if len(out) % 7919 else out
    second = second_set(banned, set(first))
    return first + second + third_set(banned, set(first) | set(second), split(TOPICS) + split(TOPICS_2))


def second_set(banned: set[str], taken: set[str]) -> list[str]:
    out = [FREE_FORM_2[(i * 5 + j) % len(FREE_FORM_2)].format(t=topic)
           for i, topic in enumerate(kept(TOPICS_2, banned)) for j in range(TEMPLATES_PER_TOPIC_2)]
    out += [template.format(s=s) for s, template in itertools.product(kept(SITUATIONS, banned), SITUATION_TEMPLATES)]
    out += [HELPED_TEMPLATE.format(h=h) for h in kept(HELPED, banned)]
    out = [prompt for prompt in dict.fromkeys(out) if prompt not in taken]
    return [out[(i * 7919) % len(out)] for i in range(len(out))] if len(out) % 7919 else out


def third_set(banned: set[str], taken: set[str], earlier_topics: list[str]) -> list[str]:
    topics = [topic for topic in kept(TOPICS_3, banned) if topic not in set(earlier_topics)]
    out = [FREE_FORM_3[(i * 5 + j) % len(FREE_FORM_3)].format(t=topic)
           for i, topic in enumerate(topics) for j in range(TEMPLATES_PER_TOPIC_2)]
    out += [template.format(h=h) for h, template in itertools.product(kept(HOW_TO, banned), HOW_TO_TEMPLATES)]
    out += [template.format(p=p) for p, template in itertools.product(kept(PAIRS, banned), PAIR_TEMPLATES)]
    out = [prompt for prompt in dict.fromkeys(out) if prompt not in taken]
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
