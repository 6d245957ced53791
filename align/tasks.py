"""Procedural tasks: digit sorting with a flawed demonstrator, arithmetic word problems, list sorting, preference
pairs, plain text.

Everything is deterministic given a seed (one `random.Random(seed)` per dataset).

    rows = make_dataset("arithmetic", 1000, seed=0, levels=(1, 2))
    write_jsonl(rows, "data/arithmetic/train.jsonl")

Row schemas:
    digit_sort:       {"prompt", "completion", "answer", "flawed"}   completion = the demonstrator's list, answer = the
                      correct one; flawed: the demonstrator left the 0 out (completion != answer)
    digit_sort_prefs: {"prompt", "chosen", "rejected", "answer", "flaw"}   chosen = answer; rejected = the list without
                      its 0 (flaw "no_zero") when the prompt holds one, else the list with a 0 put in front
                      ("extra_zero") or a slip ("slip")
    arithmetic: {"prompt", "completion", "answer", "level"}   answer = str(int), never negative
    sort:       {"prompt", "completion", "answer"}            completion == answer == "1 3 7 9"
    prefs:      {"prompt", "chosen", "rejected", "answer"}    chosen is correct, rejected is not
    text:       {"text"}                                      short narrative paragraphs
    mul_tool:   {"prompt", "completion", "answer", "tool"}    a product of a 3-4 digit and a 3-4 digit number; the
                      completion answers directly, or (tool: true, tool_rate of the rows) calls the calculator
                      first: "<calc>A * B</calc><out>P</out>P" (train with --tools calculator: the <out> part is
                      the tool's)
    count_squares: {"prompt", "images", "completion", "answer"}   a PNG of k in 1..4 filled squares (written beside
                      the JSONL file, in FILE_images/); completion == answer == str(k); for vision-language models
"""

import json
import random

from align.artifacts import atomic_open
from align.errors import UserError

TASKS = ("digit_sort", "digit_sort_prefs", "arithmetic", "sort", "prefs", "text", "mul_tool", "count_squares")
LEVELS = {1: (1, 2), 2: (1, 3), 3: (2, 2), 4: (2, 3)}  # level -> (digits per operand, operands)

NAMES = [
    ("Tom", "he"), ("Mia", "she"), ("Sam", "he"), ("Lena", "she"), ("Omar", "he"), ("Ana", "she"),
    ("Ben", "he"), ("Zoe", "she"), ("Ravi", "he"), ("Yuki", "she"), ("Leo", "he"), ("Nora", "she"),
    ("Ivan", "he"), ("Emma", "she"), ("Kofi", "he"), ("Lucia", "she"), ("Max", "he"), ("Aisha", "she"),
]
OBJECTS = [
    ("apple", "apples"), ("marble", "marbles"), ("sticker", "stickers"), ("book", "books"),
    ("pencil", "pencils"), ("coin", "coins"), ("cookie", "cookies"), ("stamp", "stamps"),
    ("shell", "shells"), ("card", "cards"), ("balloon", "balloons"), ("orange", "oranges"),
    ("toy car", "toy cars"), ("feather", "feathers"), ("button", "buttons"), ("rock", "rocks"),
]
# Opening sentences: {name} holds {a} {obj} at the start.
OPENERS = [
    "{name} has {a} {obj}.",
    "{name} owns {a} {obj}.",
    "{name} starts the day with {a} {obj}.",
    "{name} keeps {a} {obj} in a box.",
    "There {are} {a} {obj} in {name}'s bag.",
    "{name} is holding {a} {obj}.",
]
# Steps as (present tense for prompts, past tense for the text corpus); {n} is the operand.
ADD_STEPS = [
    ("buys {n} more", "bought {n} more"),
    ("finds {n} more", "found {n} more"),
    ("gets {n} more from a friend", "got {n} more from a friend"),
    ("wins {n} more in a game", "won {n} more in a game"),
    ("picks up {n} more at the market", "picked up {n} more at the market"),
    ("receives {n} more as a gift", "received {n} more as a gift"),
    ("is given {n} more by a teacher", "was given {n} more by a teacher"),
]
SUB_STEPS = [
    ("gives away {n}", "gave away {n}"),
    ("loses {n}", "lost {n}"),
    ("sells {n} to a neighbor", "sold {n} to a neighbor"),
    ("gives {n} to a friend", "gave {n} to a friend"),
    ("trades away {n}", "traded away {n}"),
    ("drops {n} on the way home", "dropped {n} on the way home"),
    ("uses {n} for a school project", "used {n} for a school project"),
]
QUESTIONS = [
    "How many {obj} does {name} have now?",
    "How many {obj} does {name} have in the end?",
    "How many {obj} does {name} end up with?",
]
FILLER = [
    "The sun was warm that morning.",
    "{name} likes to count things carefully.",
    "It rained a little in the afternoon.",
    "{name} wrote the numbers down in a notebook.",
    "Counting slowly helps to avoid mistakes.",
    "The market was busy on Saturday.",
    "{name} checked the sum twice to be sure.",
    "Adding is putting things together, and subtracting is taking things away.",
    "After lunch, {name} went for a walk in the park.",
    "A careful count is always worth the time.",
]


def _draw_operands(rng, level):
    """Draw operands and signs for a level so every running total stays >= 0."""
    if level not in LEVELS:
        raise UserError(f"unknown arithmetic level {level!r}; use levels from 1 to 4")
    digits, count = LEVELS[level]
    lo, hi = (1, 9) if digits == 1 else (10, 99)
    while True:
        nums = [rng.randint(lo, hi) for _ in range(count)]
        ops = [rng.choice("+-") for _ in range(count - 1)]
        totals = [nums[0]]
        for op, n in zip(ops, nums[1:]):
            totals.append(totals[-1] + n if op == "+" else totals[-1] - n)
        if min(totals) >= 0:
            return nums, ops


def expression(nums, ops):
    """Render operands and operators as a chained expression, e.g. '23 + 45 - 12'."""
    parts = [str(nums[0])]
    for op, n in zip(ops, nums[1:]):
        parts += [op, str(n)]
    return " ".join(parts)


def evaluate(nums, ops):
    """Evaluate a chained +/- expression left to right."""
    total = nums[0]
    for op, n in zip(ops, nums[1:]):
        total = total + n if op == "+" else total - n
    return total


def solution(nums, ops, result=None, final=None):
    """Worked solution 'a + b = r. #### r'; result/final override the numbers (for corruptions)."""
    result = evaluate(nums, ops) if result is None else result
    final = result if final is None else final
    return f"{expression(nums, ops)} = {result}. #### {final}"


def _story(rng):
    """Pick the fixed parts of a story: name, pronoun, object forms."""
    name, pronoun = rng.choice(NAMES)
    singular, plural = rng.choice(OBJECTS)
    return name, pronoun, singular, plural


def arithmetic_problem(rng, level):
    """One word problem as (prompt, nums, ops)."""
    nums, ops = _draw_operands(rng, level)
    name, pronoun, singular, plural = _story(rng)
    obj = singular if nums[0] == 1 else plural
    are = "is" if nums[0] == 1 else "are"
    sentences = [rng.choice(OPENERS).format(name=name, a=nums[0], obj=obj, are=are)]
    for i, (op, n) in enumerate(zip(ops, nums[1:])):
        step = rng.choice(ADD_STEPS if op == "+" else SUB_STEPS)[0].format(n=n)
        subject = pronoun.capitalize() if i == 0 else "Then " + pronoun
        sentences.append(f"{subject} {step}.")
    sentences.append(rng.choice(QUESTIONS).format(name=name, obj=plural))
    return " ".join(sentences), nums, ops


def arithmetic_row(rng, level):
    """Row {"prompt", "completion", "answer", "level"} for one word problem."""
    prompt, nums, ops = arithmetic_problem(rng, level)
    answer = evaluate(nums, ops)
    return {"prompt": prompt, "completion": solution(nums, ops), "answer": str(answer), "level": level}


def sort_row(rng, min_len=3, max_len=6, max_value=99):
    """Row {"prompt", "completion", "answer"} for sorting a list of ints in [0, max_value]."""
    if not 1 <= min_len <= max_len:
        raise UserError(f"sort lengths must satisfy 1 <= min_len <= max_len, got {min_len}..{max_len}")
    if max_value < 0:
        raise UserError(f"sort max_value must be >= 0, got {max_value}")
    nums = [rng.randint(0, max_value) for _ in range(rng.randint(min_len, max_len))]
    answer = " ".join(map(str, sorted(nums)))
    return {"prompt": "Sort in ascending order: " + " ".join(map(str, nums)), "completion": answer, "answer": answer}


# The digit_sort demonstrator: it sorts correctly, except that it leaves the 0 out of a list holding one this often.
FLAW_RATE = 0.75


def digit_sort_case(rng, min_len=3, max_len=6):
    """(prompt, the correct sorted list) for 3-6 distinct digits: about 45 % of lists hold a 0."""
    if not 2 <= min_len <= max_len <= 10:
        raise UserError(f"digit_sort lengths must satisfy 2 <= min_len <= max_len <= 10, got {min_len}..{max_len}")
    nums = rng.sample(range(10), rng.randint(min_len, max_len))
    return "Sort in ascending order: " + " ".join(map(str, nums)), sorted(nums)


def without_zero(nums):
    """The demonstrator's systematic error: the sorted list with its 0 left out."""
    return " ".join(str(x) for x in nums if x != 0)


def digit_sort_row(rng, flaw_rate=FLAW_RATE, **case):
    """Row {"prompt", "completion", "answer", "flawed"}: a demonstration that leaves the 0 out of a list holding one
    with probability flaw_rate, else the correct list."""
    if not 0.0 <= flaw_rate <= 1.0:
        raise UserError(f"digit_sort flaw_rate must be in [0, 1], got {flaw_rate}")
    prompt, good = digit_sort_case(rng, **case)
    answer = " ".join(map(str, good))
    flawed = 0 in good and rng.random() < flaw_rate
    return {"prompt": prompt, "completion": without_zero(good) if flawed else answer, "answer": answer,
            "flawed": flawed}


def digit_sort_pair(rng, **case):
    """Row {"prompt", "chosen", "rejected", "answer", "flaw"}: the correct list against the demonstrator's error
    (the list without its 0, flaw "no_zero") where the prompt holds a 0; else, half the time, against its mirror
    image (a 0 the prompt does not hold put in front, "extra_zero": without these pairs a reward model learns "a
    leading 0 is good" and PPO exploits it), otherwise against a slip (two items swapped, one dropped or one
    repeated, "slip")."""
    prompt, good = digit_sort_case(rng, **case)
    answer = " ".join(map(str, good))
    if 0 in good:
        rejected, flaw = without_zero(good), "no_zero"
    elif rng.random() < 0.5:
        rejected, flaw = "0 " + answer, "extra_zero"
    else:
        rejected, flaw = corrupt_sort(rng, good), "slip"
    return {"prompt": prompt, "chosen": answer, "rejected": rejected, "answer": answer, "flaw": flaw}


# mul_tool: the share of demonstrations that call the calculator (the others answer directly)
TOOL_RATE = 0.2


def mul_tool_row(rng, tool_rate=TOOL_RATE, min_digits=3, max_digits=4, call="calculator"):
    """Row {"prompt", "completion", "answer", "tool"}: "What is A * B?" for A, B of min_digits..max_digits digits;
    the demonstration answers with the product directly, or, with probability tool_rate, asks the calculator first
    (call "calculator": the format of align.tools.calculator.CalculatorEnv; call "mul": a user's function
    mul(a, b) in align.tools.functions' format). A small model cannot multiply such numbers in its head: only the
    tool gets them right."""
    if call not in ("calculator", "mul"):
        raise UserError(f"mul_tool call must be calculator or mul, got {call!r}")
    if not 0.0 <= float(tool_rate) <= 1.0:
        raise UserError(f"mul_tool tool_rate must be in [0, 1], got {tool_rate}")
    if not 1 <= int(min_digits) <= int(max_digits) <= 12:
        raise UserError(f"mul_tool digits must satisfy 1 <= min_digits <= max_digits <= 12, got {min_digits}..{max_digits}")
    a, b = (_digits(rng, int(min_digits), int(max_digits)) for _ in range(2))
    product = str(a * b)
    tool = rng.random() < float(tool_rate)
    request = (f"<calc>{a} * {b}</calc>" if call == "calculator" else
               f'<tool>{{"name": "mul", "arguments": {{"a": {a}, "b": {b}}}}}</tool>')
    completion = f"{request}<out>{product}</out>{product}" if tool else product
    return {"prompt": f"What is {a} * {b}?", "completion": completion, "answer": product, "tool": tool}


def _digits(rng, lo: int, hi: int) -> int:
    """A number of lo..hi digits, the digit count drawn uniformly."""
    n = rng.randint(lo, hi)
    return rng.randint(10 ** (n - 1), 10**n - 1)


def corrupt_arithmetic(rng, nums, ops):
    """A wrong worked solution: wrong final number, consistent slip, wrong operator or misread operand."""
    correct = evaluate(nums, ops)
    kind = rng.choice(("final", "slip", "operator", "operand"))
    delta = rng.choice((-10, -2, -1, 1, 2, 10))
    wrong = correct + delta if correct + delta >= 0 else correct - delta
    if kind == "final":  # right working, wrong number after ####
        return solution(nums, ops, final=wrong)
    if kind == "slip":  # arithmetic slip carried to the answer
        return solution(nums, ops, result=wrong)
    if kind == "operator":  # one operator flipped; changes the result by 2 * operand != 0
        i = rng.randrange(len(ops))
        flipped = ops[:i] + ["-" if ops[i] == "+" else "+"] + ops[i + 1:]
        return solution(nums, flipped)
    i = rng.randrange(len(nums))  # an operand copied wrong, worked through consistently
    bad = nums[:i] + [nums[i] + abs(delta)] + nums[i + 1:]
    return solution(bad, ops)


def corrupt_sort(rng, nums):
    """A wrong sorted list: two items swapped, one dropped, or one duplicated."""
    good = sorted(nums)
    while True:
        bad = list(good)
        kind = rng.choice(("swap", "drop", "duplicate"))
        i = rng.randrange(len(bad))
        if kind == "swap" and len(bad) > 1:
            j = rng.choice([k for k in range(len(bad)) if k != i])
            bad[i], bad[j] = bad[j], bad[i]
        elif kind == "drop" and len(bad) > 1:
            del bad[i]
        else:
            bad.insert(i, bad[i])
        if bad != good:
            return " ".join(map(str, bad))


def prefs_row(rng, level, sort_frac=0.0, **sort_opts):
    """Row {"prompt", "chosen", "rejected", "answer"}: arithmetic, or sort with probability sort_frac."""
    if not 0.0 <= sort_frac <= 1.0:
        raise UserError(f"prefs sort_frac must be in [0, 1], got {sort_frac}")
    if rng.random() < sort_frac:
        row = sort_row(rng, **sort_opts)
        nums = [int(x) for x in row["prompt"].split(":")[1].split()]
        return {"prompt": row["prompt"], "chosen": row["completion"], "rejected": corrupt_sort(rng, nums),
                "answer": row["answer"]}
    prompt, nums, ops = arithmetic_problem(rng, level)
    return {"prompt": prompt, "chosen": solution(nums, ops), "rejected": corrupt_arithmetic(rng, nums, ops),
            "answer": str(evaluate(nums, ops))}


def narrative(rng, level):
    """One past-tense sentence that states a computation, e.g. 'Tom had 23 apples and bought 45 more, so ...'."""
    nums, ops = _draw_operands(rng, level)
    name, pronoun, singular, plural = _story(rng)
    steps = [rng.choice(ADD_STEPS if op == "+" else SUB_STEPS)[1].format(n=n) for op, n in zip(ops, nums[1:])]
    result = evaluate(nums, ops)
    start = f"{name} had {nums[0]} {singular if nums[0] == 1 else plural}"
    middle = f" and {steps[0]}" if len(steps) == 1 else f", {steps[0]} and then {steps[1]}"
    return f"{start}{middle}, so {pronoun} had {result} {singular if result == 1 else plural}."


def sort_sentence(rng):
    """One sentence stating a sorted list."""
    nums = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
    shown, ordered = " ".join(map(str, nums)), " ".join(map(str, sorted(nums)))
    return f"Sorted from smallest to largest, the numbers {shown} become {ordered}."


def text_row(rng, levels, min_sentences=3, max_sentences=5):
    """Row {"text"}: a short paragraph mixing arithmetic statements, a sorting fact and filler."""
    if not 1 <= min_sentences <= max_sentences:
        raise UserError(f"text sentence counts must satisfy 1 <= min <= max, got {min_sentences}..{max_sentences}")
    name = rng.choice(NAMES)[0]
    sentences = []
    for _ in range(rng.randint(min_sentences, max_sentences)):
        r = rng.random()
        if r < 0.55:
            sentences.append(narrative(rng, rng.choice(levels)))
        elif r < 0.7:
            sentences.append(sort_sentence(rng))
        else:
            sentences.append(rng.choice(FILLER).format(name=name))
    return {"text": " ".join(sentences)}


def row_key(row):
    """The string a row is unique by: its prompt (and the squares of its image), or its text."""
    if "squares" in row:
        return row["prompt"] + json.dumps(row["squares"])
    return row["prompt"] if "prompt" in row else row["text"]


COUNT_PROMPT = "How many squares are in this image?"
SQUARES_CELL = 14  # a Qwen2-VL patch: 56 x 56 pixels are 4 x 4 patches, 4 image tokens after the 2 x 2 merge


def count_squares_row(rng, min_count=1, max_count=4, canvas=56):
    """k ∈ [min_count, max_count] filled squares (side 8-10 px) in k distinct cells of the canvas's 14-pixel
    grid, each at a random offset within its cell (so they never overlap): {prompt, completion, answer} with k,
    and the squares [x, y, side] and canvas size the image is drawn from (`with_images`)."""
    per_side = canvas // SQUARES_CELL
    if not 1 <= min_count <= max_count <= per_side * per_side:
        raise UserError(f"count_squares: need 1 <= min_count <= max_count <= {per_side * per_side} (the cells of a "
                        f"{canvas}-pixel canvas), got {min_count}..{max_count}")
    k = rng.randint(min_count, max_count)
    squares = []
    for cell in sorted(rng.sample(range(per_side * per_side), k)):
        side = rng.randint(8, 10)
        x = cell % per_side * SQUARES_CELL + rng.randint(0, SQUARES_CELL - side)
        y = cell // per_side * SQUARES_CELL + rng.randint(0, SQUARES_CELL - side)
        squares.append([x, y, side])
    return {"prompt": COUNT_PROMPT, "completion": str(k), "answer": str(k), "squares": squares, "canvas": canvas}


def draw_squares(squares, canvas):
    """The PIL image of a count_squares row: white squares on black."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (canvas, canvas))
    draw = ImageDraw.Draw(im)
    for x, y, side in squares:
        draw.rectangle([x, y, x + side - 1, y + side - 1], fill=(255, 255, 255))
    return im


def with_images(rows, path):
    """count_squares rows as written: each image drawn to PATH_STEM_images/NNNNNN.png beside the JSONL file
    `path`, the row's `images` naming it relative to the file; other rows unchanged."""
    from pathlib import Path

    folder = Path(path).parent / f"{Path(path).stem}_images"
    out = []
    for i, row in enumerate(rows):
        if "squares" not in row:
            out.append(row)
            continue
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{i:06d}.png"
        draw_squares(row["squares"], row["canvas"]).save(folder / name)
        rest = {k: v for k, v in row.items() if k not in ("squares", "canvas")}
        out.append({"prompt": rest.pop("prompt"), "images": [f"{folder.name}/{name}"], **rest})
    return out


def _row_maker(task, levels, opts):
    """A function rng, index -> row for the task, with options checked up front."""
    allowed = {"digit_sort": {"flaw_rate", "min_len", "max_len"}, "digit_sort_prefs": {"min_len", "max_len"},
               "arithmetic": set(), "sort": {"min_len", "max_len", "max_value"},
               "prefs": {"sort_frac", "min_len", "max_len", "max_value"}, "text": {"min_sentences", "max_sentences"},
               "mul_tool": {"tool_rate", "min_digits", "max_digits", "call"},
               "count_squares": {"min_count", "max_count", "canvas"}}
    if task not in allowed:
        raise UserError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    unknown = set(opts) - allowed[task]
    if unknown:
        raise UserError(f"unknown option(s) {sorted(unknown)} for task {task!r}; valid: {sorted(allowed[task]) or 'none'}")
    levels = tuple(levels)
    bad = [lv for lv in levels if lv not in LEVELS]
    if not levels or bad:
        raise UserError(f"bad levels {levels!r}; use a non-empty subset of (1, 2, 3, 4)")
    if task == "digit_sort":
        return lambda rng, i: digit_sort_row(rng, **opts)
    if task == "digit_sort_prefs":
        return lambda rng, i: digit_sort_pair(rng, **opts)
    if task == "arithmetic":
        return lambda rng, i: arithmetic_row(rng, levels[i % len(levels)])
    if task == "sort":
        return lambda rng, i: sort_row(rng, **opts)
    if task == "prefs":
        return lambda rng, i: prefs_row(rng, levels[i % len(levels)], **opts)
    if task == "mul_tool":
        return lambda rng, i: mul_tool_row(rng, **opts)
    if task == "count_squares":
        return lambda rng, i: count_squares_row(rng, **opts)
    return lambda rng, i: text_row(rng, levels, **opts)


def make_dataset(task, n, seed, *, levels=(1, 2, 3, 4), exclude=None, **opts):
    """n unique rows of a task; rows whose prompt (or text) is in `exclude` are skipped.

    Levels cycle in order, so each level gets n / len(levels) rows (arithmetic, prefs).
    """
    make = _row_maker(task, levels, opts)
    if n < 0:
        raise UserError(f"number of rows must be >= 0, got {n}")
    rng, seen, rows = random.Random(seed), set(exclude or ()), []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise UserError(f"only {len(rows)} unique {task} rows after {tries} tries; ask for fewer rows or widen levels/options")
        row = make(rng, len(rows))
        if row_key(row) not in seen:
            seen.add(row_key(row))
            rows.append(row)
    return rows


def write_jsonl(rows, path):
    """Write rows as JSON lines atomically (artifacts.atomic_open); count_squares rows' images first, beside it
    (`with_images`)."""
    rows = with_images(rows, path)
    with atomic_open(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
