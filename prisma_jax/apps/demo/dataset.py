"""The demo's procedural visual QA task: scenes of coloured shapes on a 2×2 grid, rendered with PIL, and
questions whose answers are computed from the scene description (correct by construction).

A scene is a list of objects `{"shape", "color", "row", "col"}` (one per grid cell at most). Questions ask
for a colour, a shape, a count, an absolute position or a relative position. Each question has a `kind`:

* `answerable`   — the scene determines one answer;
* `unanswerable` — the question names an object that is absent: the answer is "unknown";
* `ambiguous`    — several objects fit (e.g. two circles of different colours): every fitting answer is
  right, and the recorded label is one of them drawn at random — in training as in the held-out set, so a
  calibrated model says it with confidence 1/k and is right with probability 1/k.

Everything is a function of the seed: the same seed gives byte-identical images and JSONL. The 64×64 images
are 2×2 cells of 32 px, which with 16-px patches and 2×2 merging is one vision token per cell.
Not here: tokenization (prisma_jax.host.processing), training, generation, metrics.
"""
from __future__ import annotations

import json
import os

import numpy as np

GRID = 2
CELL = 32
IMAGE_SIZE = GRID * CELL
# mid-grey: 0 after the Qwen image normalisation (mean = std = 0.5), so background pixels feed the
# from-scratch vision tower nothing. On a light-grey background every patch is a large constant input, and
# the tower learned no colour at any learning rate that was stable (docs/demo.md).
BACKGROUND = (128, 128, 128)
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 40)}
SHAPES = ("circle", "square", "triangle")
PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles"}
ROWS = ("top", "bottom")
COLS = ("left", "right")
UNKNOWN = "unknown"
KINDS = ("answerable", "unanswerable", "ambiguous")
QUESTION_TYPES = ("color", "shape", "count_shape", "count_color", "where", "left_of", "above")
# A caption, asked in training only: "describe the image ?" → the four cells in reading order, e.g. "red circle
# nothing nothing blue square". It supervises the colour and shape of every cell at fixed answer positions, which
# the questions alone do too weakly for the tower to learn shapes within the demo's budget (docs/demo.md).
CAPTION = "describe"
CAPTION_SHARE = 0.5                                 # share of training images asked for a caption
# The demo's data sizes (`prisma demo` and benchmarks/demo_probe.py default to them).
TRAIN_IMAGES, HELDOUT_IMAGES, QUESTIONS_PER_IMAGE = 20000, 400, 1
NOTHING = "nothing"
# A diagnostic type that `prisma demo` does not ask (benchmarks/demo_probe.py --types what): "what is at the top
# left ?" → "red circle" or "nothing". Its word "at" is outside VOCABULARY, so the demo's tokenizer stays as it is.
PROBE_TYPES = ("what",)
PROBE_WORDS = ("at",)

# The self-labelled confidence experiment (benchmarks/introspection.py, prisma_jax/apps/demo/selflabel.py) appends one
# of these after the model's own answer: "sure" when that answer was right, "unsure" when it was wrong.
SURE, UNSURE = "sure", "unsure"

# Every word the task can produce (questions and answers), in a fixed order: the tokenizer built from it
# (prisma_jax.host.processing.build_tokenizer adds the special tokens and chat roles) never changes.
VOCABULARY = (
    "what", "color", "shape", "is", "the", "object", "objects", "how", "many", "are", "there", "where", "left", "of",
    "above", "?",
    *COLORS, *SHAPES, *PLURAL.values(), *ROWS, "right", "yes", "no", UNKNOWN,
    *[str(n) for n in range(GRID * GRID + 1)], CAPTION, "image", NOTHING, SURE, UNSURE,
)


# ------------------------------------------------------------------------------------------------ scenes


def random_scene(rng: np.random.Generator) -> list[dict]:
    """1 to GRID² objects in distinct cells, shape and colour uniform."""
    n = int(rng.integers(1, GRID * GRID + 1))
    cells = rng.permutation(GRID * GRID)[:n]
    colors = list(COLORS)
    return [{"shape": SHAPES[int(rng.integers(len(SHAPES)))], "color": colors[int(rng.integers(len(colors)))],
             "row": int(c) // GRID, "col": int(c) % GRID} for c in sorted(cells)]


def render(scene: list[dict], rng: np.random.Generator):
    """A 64×64 RGB PIL image: each object drawn inside its cell with a jittered size and centre. The cell's
    centre pixel always lies inside the object (tests check the image against the scene this way)."""
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for obj in scene:
        r = int(rng.integers(9, 13))                       # half-size
        cx = obj["col"] * CELL + CELL // 2 + int(rng.integers(-2, 3))
        cy = obj["row"] * CELL + CELL // 2 + int(rng.integers(-2, 3))
        fill = COLORS[obj["color"]]
        if obj["shape"] == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif obj["shape"] == "square":
            s = r - 1
            draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return img


def position_words(obj: dict) -> str:
    return f"{ROWS[obj['row']]} {COLS[obj['col']]}"


# ---------------------------------------------------------------------------------------------- questions


def question_text(q: dict) -> str:
    t = q["type"]
    if t == "color":
        return f"what color is the {q['shape']} ?"
    if t == "shape":
        return f"what shape is the {q['color']} object ?"
    if t == "count_shape":
        return f"how many {PLURAL[q['shape']]} are there ?"
    if t == "count_color":
        return f"how many {q['color']} objects are there ?"
    if t == "where":
        return f"where is the {q['color']} {q['shape']} ?"
    if t == "left_of":
        return f"is the {q['shape']} left of the {q['other']} ?"
    if t == "above":
        return f"is the {q['shape']} above the {q['other']} ?"
    if t == "what":
        return f"what is at the {ROWS[q['row']]} {COLS[q['col']]} ?"
    if t == CAPTION:
        return "describe the image ?"
    raise ValueError(f"unknown question type {t!r}")


def answers(scene: list[dict], q: dict) -> tuple[str, list[str]]:
    """(kind, sorted list of right answers) of question `q` about `scene`."""
    t = q["type"]
    if t in ("count_shape", "count_color"):
        key = "shape" if t == "count_shape" else "color"
        return "answerable", [str(sum(o[key] == q[key] for o in scene))]
    if t in ("color", "shape", "where"):
        fits = [o for o in scene if all(o[k] == q[k] for k in ("shape", "color") if k in q)]
        if t == "where":
            values = {position_words(o) for o in fits}
        else:
            values = {o["color" if t == "color" else "shape"] for o in fits}
        if not values:
            return "unanswerable", [UNKNOWN]
        return ("answerable" if len(values) == 1 else "ambiguous"), sorted(values)
    if t == "what":
        here = [f"{o['color']} {o['shape']}" for o in scene if (o["row"], o["col"]) == (q["row"], q["col"])]
        return "answerable", here or [NOTHING]
    if t == CAPTION:
        cells = {(o["row"], o["col"]): f"{o['color']} {o['shape']}" for o in scene}
        return "answerable", [" ".join(cells.get((r, c), NOTHING) for r in range(GRID) for c in range(GRID))]
    if t in ("left_of", "above"):
        a = [o for o in scene if o["shape"] == q["shape"]]
        b = [o for o in scene if o["shape"] == q["other"]]
        if not a or not b:
            return "unanswerable", [UNKNOWN]
        axis = "col" if t == "left_of" else "row"
        values = {"yes" if oa[axis] < ob[axis] else "no" for oa in a for ob in b}
        return ("answerable" if len(values) == 1 else "ambiguous"), sorted(values)
    raise ValueError(f"unknown question type {t!r}")


def _candidates(t: str) -> list[dict]:
    if t in ("color", "count_shape"):
        return [{"type": t, "shape": s} for s in SHAPES]
    if t in ("shape", "count_color"):
        return [{"type": t, "color": c} for c in COLORS]
    if t == "where":
        return [{"type": t, "color": c, "shape": s} for c in COLORS for s in SHAPES]
    if t == "what":
        return [{"type": t, "row": r, "col": c} for r in range(GRID) for c in range(GRID)]
    if t == CAPTION:
        return [{"type": t}]
    return [{"type": t, "shape": s, "other": o} for s in SHAPES for o in SHAPES if s != o]


def caption_question(scene: list[dict]) -> dict:
    """The caption as a question record (one right answer: the label)."""
    q = {"type": CAPTION}
    kind, right = answers(scene, q)
    return {**q, "kind": kind, "answers": right, "label": right[0], "question": question_text(q)}


def sample_question(scene: list[dict], rng: np.random.Generator, kind_weights=(0.7, 0.15, 0.15)) -> dict:
    """A question type uniformly, then a kind among those the type allows for this scene (by `kind_weights`,
    renormalised), then a question of that kind uniformly; the label is one right answer drawn at random."""
    t = QUESTION_TYPES[int(rng.integers(len(QUESTION_TYPES)))]
    by_kind: dict[str, list] = {}
    for q in _candidates(t):
        kind, right = answers(scene, q)
        by_kind.setdefault(kind, []).append((q, right))
    kinds = [k for k in KINDS if k in by_kind]
    w = np.array([kind_weights[KINDS.index(k)] for k in kinds], float)
    kind = kinds[int(rng.choice(len(kinds), p=w / w.sum()))]
    q, right = by_kind[kind][int(rng.integers(len(by_kind[kind])))]
    label = right[int(rng.integers(len(right)))]
    return {**q, "kind": kind, "answers": right, "label": label, "question": question_text(q)}


# ---------------------------------------------------------------------------------------------- writing


def conversation(image_path: str, question: str, answer: str | None = None) -> list[dict]:
    """Chat messages in the transformers / `prisma train` format; without `answer`, the prompt only."""
    msgs = [{"role": "user", "content": [{"type": "image", "image": image_path},
                                          {"type": "text", "text": question}]}]
    if answer is not None:
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return msgs


def eval_item(record: dict) -> dict:
    """A held-out question as a `prisma eval` item (docs/eval.md): the prompt, the label as the reference,
    unanswerable questions expecting the abstention text "unknown", the kind as the group; the question, its type
    and every right answer ride along (the eval answer row's `meta`)."""
    return {"id": record["id"], "messages": conversation(record["image"], record["question"]),
            "answer": record["label"], "answerable": record["kind"] != "unanswerable", "group": record["kind"],
            "question": record["question"], "type": record["type"], "answers": record["answers"]}


def make_split(directory: str, name: str, n_images: int, questions_per_image: int, seed: int,
               kind_weights=(0.7, 0.15, 0.15), caption_share: float = 0.0) -> list[dict]:
    """Render `n_images` scenes to `directory/images/` and return one record per question — for a share
    `caption_share` of the images, the caption instead of the questions: `messages`
    (image paths relative to `directory`, as `prisma train` resolves them against the JSONL's folder), plus
    `id`, `image`, `scene`, `type`, `kind`, `answers`, `label`, `question`."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(directory, "images"), exist_ok=True)
    records = []
    for i in range(n_images):
        scene = random_scene(rng)
        path = f"images/{name}_{i:05d}.png"
        render(scene, rng).save(os.path.join(directory, path), optimize=False)
        captioned = caption_share > 0 and rng.random() < caption_share
        for j in range(1 if captioned else questions_per_image):
            q = caption_question(scene) if captioned else sample_question(scene, rng, kind_weights)
            records.append({"id": f"{name}_{i:05d}_{j}", "image": path, "scene": scene, **q,
                            "messages": conversation(path, q["question"], q["label"])})
    return records


def write_jsonl(path: str, records: list[dict], keys=None) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r if keys is None else {k: r[k] for k in keys}, sort_keys=True) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def build_dataset(directory: str, n_train_images: int = TRAIN_IMAGES, n_heldout_images: int = HELDOUT_IMAGES,
                  questions_per_image: int = QUESTIONS_PER_IMAGE, seed: int = 0,
                  caption_share: float = CAPTION_SHARE) -> dict:
    """`directory/train.jsonl` (conversations only: what `prisma train` reads; captions for `caption_share` of
    the images), `directory/heldout.jsonl` (questions only, full records with scenes, kinds and labels) and
    `directory/images/`. Train and held-out scenes come from different seeds. Returns the paths and counts."""
    os.makedirs(directory, exist_ok=True)
    train = make_split(directory, "train", n_train_images, questions_per_image, seed, caption_share=caption_share)
    held = make_split(directory, "heldout", n_heldout_images, questions_per_image, seed + 1_000_003)
    paths = {"train": os.path.join(directory, "train.jsonl"), "heldout": os.path.join(directory, "heldout.jsonl")}
    write_jsonl(paths["train"], train, keys=("messages",))
    write_jsonl(paths["heldout"], held)
    counts = {k: sum(r["kind"] == k for r in held) for k in KINDS}
    return {**paths, "n_train": len(train), "n_heldout": len(held), "heldout_kinds": counts}
