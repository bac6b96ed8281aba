"""The demo's procedural dataset: deterministic, and every answer right by construction — re-derived here from
the scene description by an independent oracle, and the images checked against the scenes pixel by pixel."""
import hashlib
import os

import numpy as np
import pytest
from PIL import Image

from prisma_jax.apps.demo import dataset as D


def _oracle(scene, q):
    """Independent re-derivation: (kind, set of right answers) with explicit loops per question type."""
    t = q["type"]
    if t == "count_shape":
        return "answerable", {str(len([o for o in scene if o["shape"] == q["shape"]]))}
    if t == "count_color":
        return "answerable", {str(len([o for o in scene if o["color"] == q["color"]]))}
    if t == "what":
        here = [f'{o["color"]} {o["shape"]}' for o in scene if o["row"] == q["row"] and o["col"] == q["col"]]
        return "answerable", set(here) if here else {"nothing"}
    if t == "describe":
        words = []
        for row in (0, 1):
            for col in (0, 1):
                here = [f'{o["color"]} {o["shape"]}' for o in scene if (o["row"], o["col"]) == (row, col)]
                words.append(here[0] if here else "nothing")
        return "answerable", {" ".join(words)}
    if t == "color":
        found = {o["color"] for o in scene if o["shape"] == q["shape"]}
    elif t == "shape":
        found = {o["shape"] for o in scene if o["color"] == q["color"]}
    elif t == "where":
        names = {(0, 0): "top left", (0, 1): "top right", (1, 0): "bottom left", (1, 1): "bottom right"}
        found = {names[(o["row"], o["col"])] for o in scene if o["shape"] == q["shape"] and o["color"] == q["color"]}
    else:
        first = [o for o in scene if o["shape"] == q["shape"]]
        second = [o for o in scene if o["shape"] == q["other"]]
        if not first or not second:
            return "unanswerable", {"unknown"}
        key = "col" if t == "left_of" else "row"
        found = set()
        for a in first:
            for b in second:
                found.add("yes" if a[key] < b[key] else "no")
    if not found:
        return "unanswerable", {"unknown"}
    return ("answerable" if len(found) == 1 else "ambiguous"), found


def _shape_from_pixels(cell: np.ndarray, rgb) -> str:
    """Classify the object in a 32×32 cell by how much of its bounding box it fills."""
    mask = np.all(cell == np.array(rgb, np.uint8), axis=-1)
    ys, xs = np.nonzero(mask)
    fill = mask.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    return "square" if fill > 0.95 else "circle" if fill > 0.7 else "triangle"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    a = tmp_path_factory.mktemp("a")
    info = D.build_dataset(str(a), n_train_images=60, n_heldout_images=40, questions_per_image=3, seed=7)
    return a, info


def _digest(directory):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(directory)):
        for f in sorted(files):
            h.update(f.encode())
            with open(os.path.join(root, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def test_same_seed_gives_identical_files_and_other_seed_differs(built, tmp_path):
    a, _ = built
    D.build_dataset(str(tmp_path / "b"), n_train_images=60, n_heldout_images=40, questions_per_image=3, seed=7)
    D.build_dataset(str(tmp_path / "c"), n_train_images=60, n_heldout_images=40, questions_per_image=3, seed=8)
    assert _digest(a) == _digest(tmp_path / "b")
    assert _digest(a) != _digest(tmp_path / "c")


def test_answers_match_an_independent_oracle(built):
    a, info = built
    held = D.read_jsonl(info["heldout"])
    assert len(held) == 120
    for r in held:
        kind, right = _oracle(r["scene"], r)
        assert r["kind"] == kind, r
        assert set(r["answers"]) == right, r
        assert r["label"] in right
        assert r["question"] == D.question_text(r)
        assert r["messages"][1]["content"][0]["text"] == r["label"]


def test_training_file_holds_conversations_only_and_labels_are_right(built):
    a, info = built
    train = D.read_jsonl(info["train"])
    assert all(set(r) == {"messages"} for r in train)
    captions = sum(r["messages"][0]["content"][1]["text"] == "describe the image ?" for r in train)
    assert 0 < captions < 60 and len(train) == captions + 3 * (60 - captions)     # 60 images, 3 questions each
    for r in train:
        user, assistant = r["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert os.path.isfile(os.path.join(a, user["content"][0]["image"]))


def test_images_show_the_scene(built):
    a, info = built
    for r in D.read_jsonl(info["heldout"])[::3]:
        img = np.asarray(Image.open(os.path.join(a, r["image"])).convert("RGB"))
        assert img.shape == (D.IMAGE_SIZE, D.IMAGE_SIZE, 3)
        occupied = {(o["row"], o["col"]): o for o in r["scene"]}
        for row in range(D.GRID):
            for col in range(D.GRID):
                y, x = row * D.CELL + D.CELL // 2, col * D.CELL + D.CELL // 2
                cell = img[row * D.CELL:(row + 1) * D.CELL, col * D.CELL:(col + 1) * D.CELL]
                if (row, col) in occupied:
                    o = occupied[(row, col)]
                    assert tuple(img[y, x]) == D.COLORS[o["color"]]
                    assert _shape_from_pixels(cell, D.COLORS[o["color"]]) == o["shape"]
                else:
                    assert (cell == np.array(D.BACKGROUND, np.uint8)).all()


def test_every_kind_and_question_type_occurs(tmp_path):
    info = D.build_dataset(str(tmp_path), n_train_images=1, n_heldout_images=300, questions_per_image=2, seed=0)
    held = D.read_jsonl(info["heldout"])
    assert {r["kind"] for r in held} == set(D.KINDS)
    assert {r["type"] for r in held} == set(D.QUESTION_TYPES)
    assert sum(r["kind"] == "answerable" for r in held) > len(held) / 2


def test_captions_take_their_share_of_training_images_only(tmp_path):
    recs = D.make_split(str(tmp_path), "t", 400, 2, seed=5, caption_share=0.3)
    caps = [r for r in recs if r["type"] == D.CAPTION]
    assert 0.22 < len(caps) / 400 < 0.38                         # one caption per captioned image
    assert len(recs) == len(caps) + 2 * (400 - len(caps))
    assert all(r["messages"][1]["content"][0]["text"] == r["label"] for r in caps)


@pytest.mark.parametrize("t", (*D.PROBE_TYPES, D.CAPTION))
def test_extra_types_match_the_oracle(t):
    rng = np.random.default_rng(3)
    vocab = set(D.VOCABULARY) | set(D.PROBE_WORDS)
    for _ in range(50):
        scene = D.random_scene(rng)
        for q in D._candidates(t):
            kind, right = D.answers(scene, q)
            assert (kind, set(right)) == _oracle(scene, q)
            assert set(D.question_text(q).split()) <= vocab and set(right[0].split()) <= vocab


def test_vocabulary_covers_every_question_and_answer(built):
    _, info = built
    vocab = set(D.VOCABULARY)
    for r in D.read_jsonl(info["heldout"]):
        assert set(r["question"].split()) <= vocab
        for ans in r["answers"]:
            assert set(ans.split()) <= vocab
