"""The input pipeline (grain): conversations or synthetic tokens → fixed-shape `TrainBatch`es.

    JSONL line → index pass (parse, check images exist, chat template, tokenize, assistant mask, length policy)
               → [data.packing: first-fit into rows] → grain MapDataset: per-host shard → shuffle(seed, reshuffled every epoch) → repeat
               → map: load + resize images, image processor → to_iter_dataset (threads) → batch(collate)

Shapes are fixed so the jitted step compiles once:
* **padding**: one conversation per row, right-padded to `train.seq_len`. Longer samples are
  truncated (never inside an image: the cut moves to before that image) or dropped, per `data.overlong`;
  both are counted and reported.
* **packing** (`data.packing: true`): after the index pass, `pack` places the conversations, in order, into
  rows by greedy first-fit (`train.seq_len` tokens and `data.max_images` images a row); the rows, not the
  records, are then sharded over hosts and shuffled. A row's `attention_mask` holds int32 segment ids 1, 2, ...
  (0 = padding): attention stays within a segment, M-RoPE positions and the prompt-rule codes restart in each,
  no target and no introspection code crosses from one segment into the next (docs/training.md "Packing").
* **images**: every image is resized to `data.image_size`², so each has the same grid; each row holds
  `data.max_images` image slots of its own (`pixel_values [A, b, slots·patches, ·]`) — its real images first
  (a packed row's: its conversations' images in row order), zero pixels after. The zero slots' features are
  computed and never read; the vision geometry is that of one row's slots, one constant for every row and host,
  so a host's pixel rows shard with its token rows.

Text is tokenized once, in the index pass at start (cheap, and malformed lines or missing images fail before
step 1, naming file and line); image decoding is lazy, in grain's read threads. Supervised tokens are the
assistant replies, each tokenized on its own as at generation time (`Processor.encode_supervised`):
`targets[i] = ids[i+1]` where token i+1 is supervised, `NO_LOSS` instead where that token is not learned
(`"loss": false` on the assistant message or one of its text items: `mark_loss`), `IGNORE` elsewhere.
The order is a pure function of `train.seed`; the iterator state (grain's, a small dict) goes into every
checkpoint. `synthetic` draws tokens from a generator seeded by (seed, record index): no files at all.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading

import grain
import jax
import numpy as np

from prisma_jax.host.inputs import prepare
from prisma_jax.host.processing import resolve_messages
from prisma_jax.nn.vision import VisionGeometry, vision_geometry

from train.config import Config
from train.step import IGNORE, NO_LOSS, TrainBatch


@dataclasses.dataclass
class Record:
    ids: np.ndarray        # [n] int32, n ≤ seq_len
    supervised: np.ndarray  # [n] bool: assistant tokens
    images: list[str]      # absolute paths, in order, one per image run kept
    learned: np.ndarray | None = None   # [n] bool: supervised tokens with a loss (None: all supervised ones)
    file: str = ""         # the JSONL file and line it came from (errors and skip records name them)
    line: int = 0


@dataclasses.dataclass
class DataInfo:
    records: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    skipped_malformed: int = 0
    skipped_at_load: int = 0   # records found bad when read (images): masked out, counted by `Collate`, in this process
    rows: int = 0              # data.packing: rows the records were packed into
    fill: float = 0.0          # data.packing: real tokens / (rows · seq_len)

    def line(self) -> str:
        out = (f"{self.records} records ({self.truncated} truncated, {self.dropped_overlong} dropped as too "
               f"long, {self.skipped_malformed} malformed skipped)")
        return out + (f", packed into {self.rows} rows ({self.fill:.0%} filled)" if self.rows else "")


# ---------------------------------------------------------------------------------------------- sources

class SyntheticSource:
    """Random tokens, every position supervised; record i is a pure function of (seed, i)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def __len__(self):
        return 2**31 - 1

    def __getitem__(self, i):
        m, s = self.cfg.model, self.cfg.train.seq_len
        ids = np.random.default_rng([self.cfg.train.seed, int(i)]).integers(0, m.text.vocab_size, s, dtype=np.int64)
        banned = {m.image_token_id, m.video_token_id}
        ok = next(t for t in range(m.text.vocab_size) if t not in banned)
        ids[np.isin(ids, list(banned))] = ok
        return Record(ids.astype(np.int32), np.ones(s, bool), [])


def log_skip(log: str | None, file: str, line: int, why: str) -> None:
    """Append one `{"file", "line", "why"}` JSON line to the skip log `log` (None: no log). One `os.write` on an
    O_APPEND descriptor, opened and closed each time: safe from grain's read threads and worker processes."""
    if not log:
        return
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    data = (json.dumps({"file": file, "line": line, "why": why}) + "\n").encode()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def skip_log_path(log: str | None, host: int, hosts: int) -> str | None:
    """The skip log of one host: `log` itself on one host, `skipped.process_<host>.jsonl` beside it on several."""
    if not log or hosts <= 1:
        return log
    return os.path.join(os.path.dirname(log), f"skipped.process_{host}.jsonl")


def _fail(policy: str, info: DataInfo, file: str, line: int, why: str, log: str | None = None):
    """A malformed record: `data.on_malformed: error` → ValueError naming file:line; `skip` → counted and logged."""
    if policy == "error":
        raise ValueError(f"{file}:{line}: {why}")
    info.skipped_malformed += 1
    log_skip(log, file, line, why)


def mark_loss(messages: list, where: str) -> tuple[list, list[bool]]:
    """The `"loss"` flags of a conversation: (a copy of `messages` in which every text item whose own flag
    differs from its message's is wrapped in `FLIP_OPEN … FLIP_CLOSE`, each assistant message's flag in order).

    `"loss": false` on an assistant message: none of its reply is learned, its end token included; on a text
    item of an assistant message: that text is not learned (`"loss": true` on an item of a `"loss": false`
    message: only that text is). Not learned = target NO_LOSS: no loss, no gradient, but the code of the
    distribution it is drawn from still feeds the next position (docs/introspection-contract.md §4)."""
    from prisma_jax.host.processing import FLIP_CLOSE, FLIP_OPEN

    def flag(obj, what, default=True):
        v = obj.get("loss", default)
        if not isinstance(v, bool):
            raise ValueError(f"{where}: {what} 'loss' must be true or false, got {v!r}")
        return v

    out, spans = [], []
    for j, msg in enumerate(messages):
        texts = ([msg["content"]] if isinstance(msg["content"], str) else
                 [it["text"] for it in msg["content"] if it.get("type") == "text"])
        if any(FLIP_OPEN in t or FLIP_CLOSE in t for t in texts):      # any role: they mark the flags' spans
            raise ValueError(f"{where}: messages[{j}] text holds a reserved character U+E000/U+E001")
        if msg.get("role") != "assistant":
            if "loss" in msg or (isinstance(msg["content"], list) and any("loss" in it for it in msg["content"])):
                raise ValueError(f"{where}: messages[{j}] is a {msg.get('role')} message: 'loss' applies to "
                                 "assistant messages and their text items only")
            out.append(msg)
            continue
        default = flag(msg, f"messages[{j}]")
        spans.append(default)
        content = msg["content"]
        if isinstance(content, list):
            items = []
            for item in content:
                own = flag(item, f"messages[{j}] item", default)
                if "loss" in item and item["type"] != "text":
                    raise ValueError(f"{where}: messages[{j}] has 'loss' on a {item['type']} item: text items only")
                if own != default and item["type"] == "text":
                    item = {**item, "text": FLIP_OPEN + item["text"] + FLIP_CLOSE}
                items.append(item)
            content = items
        out.append({**msg, "content": content})
    return out, spans


def _tokens_per_image(cfg: Config) -> int:
    g = cfg.data.image_size // cfg.model.vision.patch_size
    return g * g // cfg.model.vision.spatial_merge_size**2


def _cut(cfg: Config, ids: np.ndarray, limit: int) -> int:
    """Largest cut ≤ limit that does not split an image's vision_start … vision_end span."""
    m = cfg.model
    cut = limit
    opens = np.flatnonzero(ids[:limit] == m.vision_start_token_id)
    for o in opens[::-1]:
        closes = np.flatnonzero(ids[o:] == m.vision_end_token_id)
        if not len(closes) or o + closes[0] >= limit:
            cut = o
        else:
            break
    return cut


def index_jsonl(cfg: Config, path: str, processor, skip_log: str | None = None) -> tuple[list[Record], DataInfo]:
    """Parse, validate and tokenize every line; apply the length policy. Errors name file and line. Message text
    holding a special token's text (`<|im_end|>`, ...: `Processor.apply_chat_template` refuses it) is malformed,
    as is a line that is not valid UTF-8 (the file is read as bytes, each line decoded on its own). With
    `data.on_malformed: skip` each skipped line is appended to `skip_log` (when given): `log_skip`."""
    from prisma_jax.host.processing import expand_image_tokens

    d, s = cfg.data, cfg.train.seq_len
    info = DataInfo()
    base = os.path.dirname(os.path.abspath(path))
    grid = [1, d.image_size // cfg.model.vision.patch_size, d.image_size // cfg.model.vision.patch_size]
    records = []
    if not os.path.isfile(path):
        raise ValueError(f"data.path {path}: no such file")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                _fail(d.on_malformed, info, path, lineno,
                      f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)", skip_log)
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                _fail(d.on_malformed, info, path, lineno, f"malformed JSON ({e.msg} at column {e.colno})", skip_log)
                continue
            try:
                if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list) or not rec["messages"]:
                    raise ValueError(f"{where}: expected an object with a non-empty 'messages' list")
                images = resolve_messages(rec["messages"], where, base)
                if not any(m.get("role") == "assistant" for m in rec["messages"]):
                    raise ValueError(f"{where}: no assistant message (nothing to supervise)")
                if len(images) > d.max_images:
                    raise ValueError(f"{where}: {len(images)} images, more than data.max_images = {d.max_images}")
                messages, span_loss = mark_loss(rec["messages"], where)
                text = processor.apply_chat_template(messages, add_generation_prompt=False)
                text = expand_image_tokens(text, [grid] * len(images), cfg.model.vision.spatial_merge_size)
                ids, sup, learned = processor.encode_supervised(text, span_loss)
            except ValueError as e:
                why = str(e)
                _fail(d.on_malformed, info, path, lineno,
                      why[len(where) + 2:] if why.startswith(where + ": ") else why, skip_log)
                continue
            if ids.size and (ids.min() < 0 or ids.max() >= cfg.model.text.vocab_size):
                raise ValueError(f"{where}: token id {int(ids.max())} outside the model vocabulary "
                                 f"{cfg.model.text.vocab_size} (processor and model disagree)")
            if len(ids) > s:
                if d.overlong == "drop":
                    info.dropped_overlong += 1
                    continue
                cut = _cut(cfg, ids, s)
                info.truncated += 1
                ids, sup, learned = ids[:cut], sup[:cut], learned[:cut]
                images = images[:int(np.sum(ids == cfg.model.image_token_id)) // _tokens_per_image(cfg)]
            records.append(Record(ids.astype(np.int32), sup.astype(bool), images, learned.astype(bool),
                                  file=path, line=lineno))
    info.records = len(records)
    if not records:
        raise ValueError(f"{path}: no usable records ({info.line()})")
    return records, info


# ---------------------------------------------------------------------------------------------- per record

class PixelCache:
    """Least-recently-used processed pixels, keyed by a record's image paths, up to `budget` bytes (shared by
    grain's read threads; a pickled copy starts empty). A dataset read over several epochs decodes and processes
    each record's images once while they fit: the demo's 20,000 images (1,875 MiB of float32 pixels) are read 13
    times each over its 8,000 steps."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.items: collections.OrderedDict[tuple, np.ndarray] = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: tuple, make) -> np.ndarray:
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        value = make()
        value.setflags(write=False)
        with self.lock:
            if key not in self.items and value.nbytes <= self.budget:
                self.items[key] = value
                self.used += value.nbytes
                while self.used > self.budget:
                    self.used -= self.items.popitem(last=False)[1].nbytes
        return value

    def __getstate__(self):
        return {"budget": self.budget}

    def __setstate__(self, state):
        self.__init__(state["budget"])


class _GeometryError(ValueError):
    """A configuration error (data.image_size vs the image processor), not a bad record: never skipped."""


class LoadImages:
    """grain map: a `Record` — or, with `data.packing`, a packed row's list of them — → dict of fixed-length
    arrays plus the row's pixel rows (its conversations' images, in order). `mask` is bool for one conversation,
    int32 segment ids 1, 2, ... (0 = padding) for a packed row. `data.image_cache_mb` > 0: each record's
    processed pixels are kept in a `PixelCache` of that many MiB.

    A record whose images cannot be read (missing, truncated, not an image, a PIL decompression bomb) is bad only
    now: `data.on_malformed: error` → ValueError naming its file:line and the reason; `skip` → the record is left
    out of its row (a row of one conversation becomes all padding: no attention, no target, zero loss weight),
    so the batch keeps its shape; `"skipped"` in the result counts it and it is appended to `skip_log` (once per
    process), from whichever thread or grain worker process read it."""

    def __init__(self, cfg: Config, image_processor, skip_log: str | None = None):
        self.cfg, self.improc, self.skip_log = cfg, image_processor, skip_log
        g = cfg.data.image_size // cfg.model.vision.patch_size
        self.grid = np.array([1, g, g])
        mb = cfg.data.image_cache_mb
        self.cache = PixelCache(mb << 20) if mb else None
        self.logged: set = set()                 # (file, line) already in the skip log, this process

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "logged"}

    def __setstate__(self, state):
        self.__dict__.update(state, logged=set())

    def __call__(self, item) -> dict:
        recs = item if isinstance(item, (list, tuple)) else [item]
        s = self.cfg.train.seq_len
        n = sum(len(r.ids) for r in recs)
        if n > s:
            raise ValueError(f"a row of {n} tokens does not fit train.seq_len = {s}")
        ids, seg = np.zeros(s, np.int32), np.zeros(s, np.int32)
        sup, learned = np.zeros(s, bool), np.zeros(s, bool)
        pixels, at, k, skipped = [], 0, 0, 0
        for rec in recs:
            px = None
            if rec.images:
                px = self._read(rec)
                if px is None:
                    skipped += 1
                    continue
                pixels.append(px)
            k += 1
            span = slice(at, at + len(rec.ids))
            ids[span], seg[span], sup[span] = rec.ids, k, rec.supervised
            learned[span] = rec.supervised if rec.learned is None else rec.supervised & rec.learned
            at = span.stop
        mask = seg if isinstance(item, (list, tuple)) else seg > 0
        return {"ids": ids, "mask": mask, "supervised": sup, "learned": learned,
                "pixels": np.concatenate(pixels) if pixels else None, "skipped": skipped}

    def _read(self, rec: Record) -> np.ndarray | None:
        """The record's processed pixels; None for a skipped bad record (`data.on_malformed: skip`)."""
        try:
            return (self._pixels(rec) if self.cache is None else
                    self.cache.get(tuple(rec.images), lambda: self._pixels(rec)))
        except _GeometryError:
            raise
        except Exception as e:         # unreadable/truncated/unidentifiable image, DecompressionBombError, ...
            why = str(e) if isinstance(e, ValueError) else f"cannot read image: {type(e).__name__}: {e}"
        where = f"{rec.file}:{rec.line}" if rec.file else f"record with images {rec.images}"
        if self.cfg.data.on_malformed == "error":
            raise ValueError(f"{where}: {why}") from None
        if (rec.file, rec.line) not in self.logged:
            self.logged.add((rec.file, rec.line))
            log_skip(self.skip_log, rec.file, rec.line, why)
        return None

    def _pixels(self, rec: Record) -> np.ndarray:
        from PIL import Image

        from prisma_jax.host.processing import load_image
        def read(p):
            try:
                return load_image(p)
            except ValueError:
                raise
            except Exception as e:        # PIL's DecompressionBombError, ... (load_image lets them through)
                raise ValueError(f"cannot read image {p!r}: {type(e).__name__}: {e}") from None
        size = self.cfg.data.image_size
        pil = [read(p).resize((size, size), Image.BICUBIC) for p in rec.images]
        enc = self.improc(images=pil, return_tensors="np")
        grids = np.asarray(enc["image_grid_thw"])
        if not (grids == self.grid).all():
            raise _GeometryError(f"the image processor resized {size}×{size} images to grid {grids[0].tolist()}, "
                             f"not {self.grid.tolist()}: make data.image_size² fit its min/max_pixels")
        return np.asarray(enc["pixel_values"], np.float32)


# ---------------------------------------------------------------------------------------------- packing

def pack(records: list[Record], seq_len: int, max_images: int) -> list[list[int]]:
    """Greedy first-fit, in record order: each record goes into the first row (in order of creation) with room
    for its tokens and its images (a row holds at most `seq_len` tokens and `max_images` images), else opens a
    new row. Returns the rows as lists of record indices. Deterministic: a pure function of the records' lengths
    and image counts.

    Leftmost-fit is one descent of a max segment tree over the rows' free tokens, one tree per number of free
    image slots a record needs (a row without k free slots shows −1 in tree k): O(n · (max_images + 2) · log n).
    Unopened rows show the full `seq_len` and slots, so the leftmost fit opens a new row when no open one fits."""
    n = len(records)
    size = 1 << max(n - 1, 0).bit_length()
    trees = [[seq_len] * (2 * size) for _ in range(max_images + 1)]
    free_tok, free_img = [seq_len] * size, [max_images] * size
    rows: list[list[int]] = []
    for i, rec in enumerate(records):
        need, imgs = len(rec.ids), len(rec.images)
        if need > seq_len or imgs > max_images:
            raise ValueError(f"record {i}: {need} tokens and {imgs} images do not fit a row of train.seq_len = "
                             f"{seq_len} and data.max_images = {max_images}")
        tree, node = trees[imgs], 1
        while node < size:
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        row = node - size
        if row == len(rows):
            rows.append([])
        rows[row].append(i)
        free_tok[row] -= need
        free_img[row] -= imgs
        for k, t in enumerate(trees):
            j = row + size
            t[j] = free_tok[row] if free_img[row] >= k else -1
            j //= 2
            while j:
                t[j] = max(t[2 * j], t[2 * j + 1])
                j //= 2
    return rows


def row_geometry(cfg: Config) -> VisionGeometry | None:
    """The vision geometry of one row's image slots (`data.max_images` images of `data.image_size`²), None
    without slots: `TrainBatch.geometry`, the same for every row, micro-batch and host."""
    v, slots = cfg.model.vision, cfg.data.max_images
    g = cfg.data.image_size // v.patch_size
    return vision_geometry(v, np.array([[1, g, g]] * slots)) if slots else None


class Collate:
    """Samples of one per-host batch → `TrainBatch` (NumPy) with a leading grad_accum axis. The records that
    `LoadImages` left out as bad (`"skipped"`) are added up in `info.skipped_at_load` when `info` is given."""

    def __init__(self, cfg: Config, per_host_batch: int, info: DataInfo | None = None):
        self.cfg, self.info = cfg, info
        self.a = cfg.train.grad_accum
        self.b = per_host_batch // self.a
        g = cfg.data.image_size // cfg.model.vision.patch_size
        self.grid = [1, g, g]
        self.patches = g * g                                     # pixel rows per image
        self.slots = cfg.data.max_images                         # image slots per row
        self.geometry = row_geometry(cfg)

    def _row_pixels(self, r: dict, i: int) -> np.ndarray | None:
        """A sample's pixel rows, checked to fit its slots and to match its image tokens."""
        px = r["pixels"]
        n_img = 0 if px is None else len(px) // self.patches
        if px is not None and (len(px) % self.patches or n_img > self.slots):
            raise ValueError(f"row {i}: {len(px)} pixel rows, not at most data.max_images = {self.slots} images "
                             f"of {self.patches} patches")
        tokens = int(np.sum(r["ids"] == self.cfg.model.image_token_id))
        if tokens != n_img * _tokens_per_image(self.cfg):
            raise ValueError(f"row {i}: {tokens} image tokens for {n_img} images of "
                             f"{_tokens_per_image(self.cfg)} tokens")
        return px

    def __call__(self, samples: list[dict]) -> TrainBatch:
        m = self.cfg.model
        if self.info is not None:
            self.info.skipped_at_load += sum(int(r.get("skipped", 0)) for r in samples)
        cols = {k: [] for k in TrainBatch._fields if k not in ("geometry", "pixel_values")}
        pixels = (np.zeros((self.a, self.b, self.slots * self.patches, m.vision.patch_dim), np.float32)
                  if self.slots else None)
        for a in range(self.a):
            rows = samples[a * self.b:(a + 1) * self.b]
            ids = np.stack([r["ids"] for r in rows])
            mask = np.stack([r["mask"] for r in rows])
            sup = np.stack([r["supervised"] for r in rows])
            learned = np.stack([r.get("learned", r["supervised"]) for r in rows])
            packed = []                                           # each row's images first in its slots
            for j, r in enumerate(rows):
                px = self._row_pixels(r, a * self.b + j)
                if px is not None:
                    pixels[a, j, :len(px)] = px
                    packed.append(px)
            pv = np.concatenate(packed) if packed else None
            grids = None if pv is None else np.array([self.grid] * (len(pv) // self.patches))
            # validation, positions and prompt-rule codes (per segment of a packed row)
            b = prepare(m, ids, mask, pv, grids, segments=self.cfg.data.packing)
            nxt = lambda x: np.pad(x[:, 1:], ((0, 0), (0, 1)))       # noqa: E731  (token i+1's value at i)
            seg = mask.astype(np.int32)
            inside = nxt(seg) == seg                                 # no target crosses into the next segment
            targets = np.where(nxt(sup) & inside, np.where(nxt(learned), nxt(ids), NO_LOSS), IGNORE)
            cols["input_ids"].append(b.input_ids)
            cols["attention_mask"].append(b.attention_mask)
            cols["codes"].append(b.codes)
            cols["positions"].append(b.positions)
            cols["targets"].append(targets.astype(np.int32))
        out = {k: np.stack(v) for k, v in cols.items()}
        return TrainBatch(**out, pixel_values=pixels, geometry=self.geometry)


# ---------------------------------------------------------------------------------------------- the pipeline

def build(cfg: Config, workdir: str, host: int | None = None, hosts: int | None = None,
          skip_log: str | None = None, workers: int | None = None):
    """(grain IterDataset of TrainBatch, DataInfo). Per host: records `host::hosts` (default this process's
    `process_index::process_count`).

    `skip_log` (e.g. WORKDIR/skipped.jsonl): every record skipped under `data.on_malformed: skip` gets a JSON line
    {"file", "line", "why"} there — those of the index pass from host 0 only (every host indexes the same file),
    those found bad when read from the host (thread or worker process) that read them; with several hosts each
    writes `skipped.process_<i>.jsonl` beside it. `workers` (default `data.workers` when the config has it, else
    0): grain worker processes for reading and decoding (`mp_prefetch`); batches are collated in this process,
    so `info.skipped_at_load` counts every record skipped while reading."""
    d, t = cfg.data, cfg.train
    hosts = jax.process_count() if hosts is None else hosts
    host = jax.process_index() if host is None else host
    workers = getattr(d, "workers", 0) if workers is None else workers
    log = skip_log_path(skip_log, host, hosts)
    if t.batch_size % (hosts * t.grad_accum):
        raise ValueError(f"train.batch_size {t.batch_size} must divide into {hosts} hosts × "
                         f"{t.grad_accum} micro-batches")
    per_host = t.batch_size // hosts
    if d.source == "synthetic":
        ds, info, improc = grain.MapDataset.source(SyntheticSource(cfg)), DataInfo(records=-1), None
    else:
        from prisma_jax.host.processing import Processor
        path, proc_dir = d.path, d.processor
        if d.source == "tiny_sft":
            from train.tiny_sft import generate
            path, proc_dir = generate(os.path.join(workdir, "tiny_sft_data"))
        processor = Processor.from_pretrained(proc_dir)
        records, info = index_jsonl(cfg, path, processor, log if host == 0 else None)
        improc = processor.image_processor
        if d.max_images and improc is None:
            raise ValueError(f"{proc_dir}: no preprocessor_config.json but data.max_images = {d.max_images}")
        items = records
        if d.packing:
            items = [[records[i] for i in row] for row in pack(records, t.seq_len, d.max_images)]
            info.rows = len(items)
            info.fill = sum(len(r.ids) for r in records) / (len(items) * t.seq_len)
        ds = grain.MapDataset.source(items)
        if len(items) < hosts:
            raise ValueError(f"{len(items)} {'packed rows' if d.packing else 'records'} cannot be sharded over "
                             f"{hosts} hosts")
    ds = ds[host::hosts]
    if d.shuffle and d.source != "synthetic":
        ds = ds.shuffle(seed=t.seed)
    ds = ds.repeat(None).map(LoadImages(cfg, improc, log))
    opts = grain.ReadOptions(num_threads=d.num_threads, prefetch_buffer_size=max(2 * per_host, 1))
    it = ds.to_iter_dataset(opts)
    if workers:
        from absl import flags
        if not flags.FLAGS.is_parsed():       # grain's worker processes read absl flags; no absl main parsed them
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=per_host))
    it = it.batch(per_host, drop_remainder=True, batch_fn=Collate(cfg, per_host, info))
    return it, info
