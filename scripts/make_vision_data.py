"""Synthetic images with questions and answers, drawn with Pillow, for the embedded default model's vision tower.

Three kinds of picture on a light background: one shape (a colour and a shape), several shapes of one colour and
shape (a count), and a rendered word. Each example is (image, question, answer); the answer is what the model must
write. Train and held-out splits share the label sets (8 colours, 4 shapes, counts 1-5, 24 words) but draw their
pictures from disjoint seeds, and the held-out split may use question phrasings the train split never does
(`heldout_phrasing=True`).

    python scripts/make_vision_data.py --n 6 --out /tmp/vision-samples   # writes PNGs and prints their Q/A
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220), "yellow": (240, 210, 20),
    "orange": (245, 130, 20), "purple": (130, 40, 170), "black": (20, 20, 20), "pink": (245, 120, 190),
}
SHAPES = ("circle", "square", "triangle", "star")
WORDS = ("cat", "dog", "sun", "tree", "book", "fish", "bird", "car", "home", "milk", "star", "moon", "rain", "cake",
         "door", "ship", "frog", "king", "lamp", "ring", "boat", "hat", "cup", "key")
NUMBER_WORDS = ("one", "two", "three", "four", "five")
MAX_COUNT = 5

QUESTIONS: dict[str, tuple[str, ...]] = {
    "colour": ("What colour is the shape?", "What color is it?", "Which colour is this shape?",
               "What is the colour of the shape?", "What color are the shapes?"),
    "shape": ("What shape is this?", "What shape do you see?", "Which shape is in the picture?", "What is the shape?"),
    "count": ("How many shapes are there?", "How many shapes do you see?", "Count the shapes.",
              "How many are there?"),
    "word": ("What word is written?", "What does the text say?", "Read the word in the image.",
             "What is written here?"),
    "describe": ("What is in this image?", "Describe the image.", "What do you see?", ""),
}
# More phrasings for training only (`extra_phrasings=True`), so that the model learns the picture rather than a few
# questions' wording; none is a held-out phrasing, and the default question set (what the evaluation asks) is as before.
EXTRA_QUESTIONS: dict[str, tuple[str, ...]] = {
    "colour": ("Which color is the shape in the picture?", "What colour do you see?", "Colour?",
               "What is the color of this?", "Can you tell me its colour?", "What colour are they?"),
    "shape": ("Which shape is it?", "What kind of shape is shown?", "Shape?", "What shape is drawn here?",
              "Can you tell me the shape?"),
    "count": ("How many shapes are in the image?", "Count them.", "How many?", "What is the number of shapes?",
              "How many shapes can you see?"),
    "word": ("Read this.", "What word is it?", "What is the word?", "What does it say?", "Read the text."),
    "describe": ("What is this?", "What is shown here?", "Describe this picture.", "What is in the picture?"),
}
HELDOUT_QUESTIONS: dict[str, tuple[str, ...]] = {
    "colour": ("Tell me the colour of the shape.",),
    "shape": ("Name the shape in this picture.",),
    "count": ("How many objects are in the picture?",),
    "word": ("Which word does the image show?",),
    "describe": ("What does this picture show?",),
}


@dataclass(frozen=True)
class VisionExample:
    image: Image.Image
    question: str
    """The user's text ("" for an image sent alone)."""
    answer: str
    kind: str
    """The question kind (a key of QUESTIONS): what the accuracy is reported by."""
    label: str
    """The fact the answer must state: a colour, a shape, a count, a word, or "colour shape" for a description."""
    caption: str
    """What the picture shows, whatever the question ("a red circle", "3 red circles", 'the word "cat"'): the
    training's auxiliary target for the first image tokens."""


def _plural(shape: str) -> str:
    return shape + "s"


def _background(rng: random.Random) -> tuple[int, int, int]:
    if rng.random() < 0.6:
        return (255, 255, 255)
    return tuple(rng.randint(215, 255) for _ in range(3))  # type: ignore[return-value]


def _jitter(colour: tuple[int, int, int], rng: random.Random) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + rng.randint(-18, 18))) for c in colour)  # type: ignore[return-value]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float,
                fill: tuple[int, int, int], rng: random.Random) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        a = r * 0.9
        draw.rectangle((cx - a, cy - a, cx + a, cy + a), fill=fill)
    elif shape == "triangle":
        turn = rng.uniform(-0.2, 0.2)
        pts = [(cx + r * math.sin(turn + k * 2 * math.pi / 3), cy - r * math.cos(turn + k * 2 * math.pi / 3))
               for k in range(3)]
        draw.polygon(pts, fill=fill)
    else:  # a five-pointed star
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.45
            ang = k * math.pi / 5
            pts.append((cx + rad * math.sin(ang), cy - rad * math.cos(ang)))
        draw.polygon(pts, fill=fill)


def _canvas(rng: random.Random) -> Image.Image:
    w, h = rng.randint(84, 256), rng.randint(84, 256)  # at least 6 x 6 patches: 9 image tokens
    if max(w, h) > 2.2 * min(w, h):  # keep aspect ratios within about 2:1
        w = h = min(w, h) * 2
    return Image.new("RGB", (w, h), _background(rng))


def _place(rng: random.Random, w: int, h: int, r: float, taken: list[tuple[float, float, float]]
           ) -> tuple[float, float] | None:
    for _ in range(60):
        cx, cy = rng.uniform(r + 1, w - r - 1), rng.uniform(r + 1, h - r - 1)
        if all(math.hypot(cx - x, cy - y) > r + q + 3 for x, y, q in taken):
            return cx, cy
    return None


def shapes_image(rng: random.Random, count: int) -> tuple[Image.Image, str, str]:
    """`count` shapes of one colour and kind, not overlapping: (image, colour, shape)."""
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    while True:
        image = _canvas(rng)
        w, h = image.size
        side = min(w, h)
        r = rng.uniform(0.22, 0.42) * side if count == 1 else rng.uniform(0.09, 0.16) * side
        r = max(r, 7.0)
        draw = ImageDraw.Draw(image)
        taken: list[tuple[float, float, float]] = []
        for _ in range(count):
            spot = _place(rng, w, h, r, taken)
            if spot is None:
                break
            taken.append((*spot, r))
        if len(taken) == count:
            for cx, cy, _ in taken:
                _draw_shape(draw, shape, cx, cy, r, _jitter(COLOURS[colour], rng), rng)
            return image, colour, shape


def word_image(rng: random.Random) -> tuple[Image.Image, str]:
    """A word in dark ink at a random size and place: (image, word)."""
    word = rng.choice(WORDS)
    while True:
        image = _canvas(rng)
        w, h = image.size
        font = ImageFont.load_default(size=rng.randint(18, 34))
        draw = ImageDraw.Draw(image)
        left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
        tw, th = right - left, bottom - top
        if tw + 4 > w or th + 4 > h:
            continue
        x, y = rng.uniform(2, w - tw - 2) - left, rng.uniform(2, h - th - 2) - top
        ink = tuple(rng.randint(0, 60) for _ in range(3))
        draw.text((x, y), word, fill=ink, font=font)
        return image, word


def make_example(rng: random.Random, heldout_phrasing: bool = False, extra_phrasings: bool = False) -> VisionExample:
    """One picture and one question about it (with `extra_phrasings`, drawn from the training-only phrasings too)."""
    questions = HELDOUT_QUESTIONS if heldout_phrasing else QUESTIONS
    if extra_phrasings:
        questions = {kind: QUESTIONS[kind] + EXTRA_QUESTIONS[kind] for kind in QUESTIONS}
    roll = rng.random()
    if roll < 0.25:
        image, word = word_image(rng)
        kind = rng.choice(("word", "word", "describe"))
        answer = f'It says "{word}".' if kind == "word" else f'The word "{word}".'
        return VisionExample(image, rng.choice(questions[kind]), answer, kind, word, f'the word "{word}"')
    count = 1 if roll < 0.6 else rng.randint(2, MAX_COUNT)
    image, colour, shape = shapes_image(rng, count)
    kinds = ("colour", "shape", "describe", "count") if count == 1 else ("count", "count", "colour", "describe")
    kind = rng.choice(kinds)
    if kind == "colour":
        answer, label = (f"It is {colour}." if count == 1 else f"They are {colour}."), colour
    elif kind == "shape":
        answer, label = f"It is a {shape}.", shape
    elif kind == "count":
        noun = shape if count == 1 else _plural(shape)
        answer = f"There is 1 {noun}." if count == 1 else f"There are {count} {noun}."
        label = str(count)
    else:
        label = f"{colour} {shape}"
        answer = f"A {colour} {shape}." if count == 1 else \
            f"{NUMBER_WORDS[count - 1].capitalize()} {colour} {_plural(shape)}."
    caption = f"a {colour} {shape}" if count == 1 else f"{count} {colour} {_plural(shape)}"
    return VisionExample(image, rng.choice(questions[kind]), answer, kind, label, caption)


def split_rng(split: str, seed: int) -> random.Random:
    """The generator of a split: train and held-out pictures come from disjoint seeds."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return random.Random(f"{split}/{seed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--split", default="heldout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/vision-samples"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = split_rng(args.split, args.seed)
    for i in range(args.n):
        ex = make_example(rng)
        ex.image.save(args.out / f"{i}.png")
        print(f"{i}.png {ex.image.size} Q: {ex.question!r} A: {ex.answer!r}")


if __name__ == "__main__":
    main()
