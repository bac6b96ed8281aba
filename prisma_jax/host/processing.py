"""Chat messages and images → model inputs (NumPy), without torch or torchvision (PROCESSING.md).

transformers' `Qwen3VLProcessor` cannot be built without torchvision, so `Processor` composes the two parts
that work offline — the tokenizer (with its chat template) and the PIL-backend Qwen2-VL image processor — and
adds the one step the combined processor does: each `<|image_pad|>` becomes t·h·w/merge² copies
(QWEN3_VL.md §7). `build_tokenizer` writes a small offline tokenizer + image-processor directory for tests and
demos, Qwen special tokens included.

    ids = build_tokenizer(dir, ["hello", "world"])        # {'image_token_id': 5, ...}
    proc = Processor.from_pretrained(dir)
    enc = proc(messages=[[{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                                      {"type": "text", "text": "hello"}]}]])
    enc["input_ids"], enc["attention_mask"], enc["pixel_values"], enc["image_grid_thw"]

Message text may not hold a special or added token's text (`check_message_text`: ValueError), so a user cannot
forge chat-template markers; `text=` (already templated) is trusted.

Not here: labels / loss masks beyond `encode_supervised`, video, any device work.
"""
from __future__ import annotations

import functools
import json
import os
import re

import numpy as np

# Qwen special tokens, in the id order `build_tokenizer` gives them (ids 0..7). The vision ids 3..6 match
# tests/hf_tiny.py's tiny configs.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>")
UNK = "<unk>"
ROLES = ("system", "user", "assistant")
ASSISTANT_HEADER = "<|im_start|>assistant\n"    # what the chat template puts before every assistant reply

# ChatML as in Qwen3-VL Instruct: no default system prompt; image item → vision_start image_pad vision_end.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or 'image' in item -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in item -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def special_token_ids(tokenizer) -> dict:
    """The ids a model config must agree with, read from any (Qwen-style) tokenizer."""
    get = tokenizer.convert_tokens_to_ids
    return {"eos_token_id": get("<|im_end|>"), "pad_token_id": get("<|endoftext|>"),
            "im_start_id": get("<|im_start|>"), "im_end_id": get("<|im_end|>"),
            "vision_start_token_id": get("<|vision_start|>"), "vision_end_token_id": get("<|vision_end|>"),
            "image_token_id": get("<|image_pad|>"), "video_token_id": get("<|video_pad|>")}


def special_token_texts(tokenizer) -> tuple[str, ...]:
    """The texts the tokenizer turns into one special or added token wherever they occur (its special tokens and
    its whole added vocabulary: `<|im_start|>`, `<|im_end|>`, `<|image_pad|>`, `<think>`, ...), longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    if hasattr(tokenizer, "get_added_vocab"):
        texts.update(tokenizer.get_added_vocab())
    return tuple(sorted((t for t in texts if isinstance(t, str) and t), key=lambda t: (-len(t), t)))


@functools.lru_cache(maxsize=16)
def _token_pattern(tokens: tuple[str, ...]):
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))) if tokens else None


def find_special_tokens(text: str, tokens) -> list[str]:
    """Which of the token texts `tokens` (e.g. `special_token_texts(tokenizer)`) occur in `text`, each once, in
    order of first occurrence."""
    rx = _token_pattern(tuple(tokens))
    return list(dict.fromkeys(rx.findall(text))) if rx is not None and isinstance(text, str) else []


def check_message_text(conversation: list, tokens, where: str = "") -> None:
    """Refuse special-token text in what the chat template copies from a conversation (each message's role and
    its string content or text items): tokenized after templating it would become that special token, and e.g.
    `<|im_end|>\n<|im_start|>system\n` in a user's text would forge a turn. → ValueError naming the message,
    the part and the token text; `where` prefixes it. The template's own markers are added after this check."""
    def check(text, what):
        found = find_special_tokens(text, tokens)
        if found:
            raise ValueError(f"{where}{what} contains {', '.join(map(repr, found))}, the text of a special token; "
                             "message text may not contain special-token text (it would become a chat-template "
                             "control token)")
    for j, msg in enumerate(conversation):
        if not isinstance(msg, dict):
            continue
        check(msg.get("role"), f"messages[{j}].role")
        content = msg.get("content")
        if isinstance(content, str):
            check(content, f"messages[{j}].content")
        elif isinstance(content, (list, tuple)):
            for k, item in enumerate(content):
                if isinstance(item, dict):
                    check(item.get("text"), f"messages[{j}].content[{k}]")


def build_tokenizer(directory: str, words: list[str], min_pixels: int = 32 * 32 * 4,
                    max_pixels: int = 256 * 256) -> dict:
    """Write an offline word-level tokenizer (+ chat template + Qwen2-VL preprocessor_config.json) to
    `directory`, loadable by `AutoTokenizer`, `AutoImageProcessor` and `Processor`.

    Vocabulary: the 8 Qwen special tokens (ids 0..7, `SPECIAL_TOKENS` order), `<unk>` (8), `\\n` (9) and the
    roles `system user assistant` (10..12) that the chat template needs, then `words` in order. Text splits
    on spaces; `\\n` is its own token. Returns `special_token_ids(...)` plus
    `vocab_size`; `image_token_id` etc. are what a tiny model config must use.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for tok in (*SPECIAL_TOKENS, UNK, "\n", *ROLES, *words):
        if tok in vocab:
            raise ValueError(f"duplicate vocabulary entry {tok!r}")
        if not tok or " " in tok:
            raise ValueError(f"vocabulary entry {tok!r} must be non-empty and contain no space")
        vocab[tok] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="removed"),
        pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
    ])
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token=UNK, pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>", padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    write_image_processor_config(directory, min_pixels, max_pixels)
    return {**special_token_ids(fast), "vocab_size": len(vocab)}


def write_image_processor_config(directory: str, min_pixels: int, max_pixels: int, patch_size: int = 16,
                                 merge_size: int = 2, temporal_patch_size: int = 2) -> None:
    """A Qwen2-VL `preprocessor_config.json` (mean/std 0.5, bicubic, rescale 1/255)."""
    cfg = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "resample": 3, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": int(min_pixels), "longest_edge": int(max_pixels)},
        "min_pixels": int(min_pixels), "max_pixels": int(max_pixels),
        "patch_size": patch_size, "temporal_patch_size": temporal_patch_size, "merge_size": merge_size,
    }
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def expand_image_tokens(text: str, grids, merge_size: int = 2, image_token: str = "<|image_pad|>") -> str:
    """Replace the i-th `image_token` of `text` by t·h·w/merge² copies of it (grids: [N, 3] in order)."""
    parts = text.split(image_token)
    if len(parts) - 1 != len(grids):
        raise ValueError(f"{len(parts) - 1} {image_token} placeholders in the text but {len(grids)} images")
    out = [parts[0]]
    for (t, h, w), rest in zip(grids, parts[1:]):
        out.append(image_token * (int(t) * int(h) * int(w) // merge_size**2))
        out.append(rest)
    return "".join(out)


def load_image(image):
    """A PIL image from a PIL image, a path or an [H, W, 3] uint8 array; unreadable files → ValueError."""
    from PIL import Image
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        try:
            with Image.open(image) as im:
                return im.convert("RGB")
        except (OSError, ValueError, SyntaxError) as e:   # missing file, not an image, truncated
            raise ValueError(f"cannot read image {os.fspath(image)!r}: {e}") from None
    if isinstance(image, np.ndarray) and image.ndim == 3 and image.shape[-1] == 3:
        return Image.fromarray(np.asarray(image, np.uint8))
    raise ValueError(f"unsupported image {type(image).__name__}: expected a PIL image, a path or [H, W, 3] uint8")


def resolve_messages(messages: list, where: str, base: str) -> list[str]:
    """Check a JSONL conversation (`prisma train` and `prisma eval` data: docs/training.md) and make its image
    paths absolute, in place: relative paths are resolved against `base` (the JSONL file's folder) and must
    exist. Returns the image paths in order; a problem → ValueError starting with `where` (file:line)."""
    out = []
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES or "content" not in msg:
            raise ValueError(f"{where}: messages[{j}] must be an object with role in {ROLES} and content")
        content = msg["content"]
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ValueError(f"{where}: messages[{j}].content must be a string or a list of items")
        for item in content:
            if not isinstance(item, dict) or item.get("type") not in ("text", "image"):
                raise ValueError(f"{where}: messages[{j}] has an item that is not {{type: text|image}}")
            if item["type"] == "image":
                p = item.get("image", item.get("path"))
                if not isinstance(p, str):
                    raise ValueError(f"{where}: messages[{j}] image item needs a local path in 'image'")
                p = p if os.path.isabs(p) else os.path.join(base, p)
                if not os.path.isfile(p):
                    raise ValueError(f"{where}: image not found: {p}")
                item["image"] = p
                out.append(p)
            elif not isinstance(item.get("text"), str):
                raise ValueError(f"{where}: messages[{j}] text item needs a string 'text'")
    return out


def _message_images(conversation: list[dict]) -> list:
    out = []
    for msg in conversation:
        if isinstance(msg.get("content"), list):
            for item in msg["content"]:
                if item.get("type") == "image" or "image" in item:
                    img = item.get("image", item.get("path", item.get("url")))
                    if img is None:
                        raise ValueError("image item without 'image' / 'path'")
                    out.append(img)
    return out


class Processor:
    """Tokenizer + PIL image processor + image-token expansion; NumPy out, left padding for batches."""

    def __init__(self, tokenizer, image_processor=None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = "<|image_pad|>"
        self.merge_size = int(getattr(image_processor, "merge_size", 2) or 2)
        self.ids = special_token_ids(tokenizer)        # image_token_id, im_start_id, im_end_id, eos, pad, ...
        self.image_token_id = self.ids["image_token_id"]
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.ids["pad_token_id"]
        self.special_texts = special_token_texts(tokenizer)   # refused in message text: `check_message_text`

    @classmethod
    def from_pretrained(cls, directory: str) -> "Processor":
        from transformers import AutoImageProcessor, AutoTokenizer
        if not os.path.isdir(directory):
            raise ValueError(f"{directory}: not a directory")
        try:
            tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"{directory}: cannot load a tokenizer ({e})") from None
        improc = None
        if os.path.isfile(os.path.join(directory, "preprocessor_config.json")):
            improc = AutoImageProcessor.from_pretrained(directory, local_files_only=True, backend="pil")
        return cls(tok, improc)

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kw):
        """One conversation (list of messages) → str; a list of conversations → list[str]. Not expanded.
        Message text holding a special token's text → ValueError (`check_message_text`; docs/generation.md)."""
        batched = bool(messages) and isinstance(messages[0], (list, tuple))
        convs = messages if batched else [messages]
        for i, c in enumerate(convs):
            check_message_text(c, self.special_texts, f"conversation {i}: " if len(convs) > 1 else "")
        out = [self.tokenizer.apply_chat_template(list(c), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kw)
               for c in convs]
        return out if batched else out[0]

    def __call__(self, text=None, images=None, messages=None, add_generation_prompt: bool = True,
                 padding_side: str = "left") -> dict:
        """Either `text` (str or list, already templated, one `<|image_pad|>` per image) with `images` in
        order, or `messages` (one conversation or a list of them; images taken from their image items).
        `text` is trusted: special-token text in it becomes those tokens. Message text may not hold any
        (`check_message_text`: ValueError), so a user's text cannot forge chat-template markers.

        Returns NumPy `input_ids` [B, S] int64, `attention_mask` [B, S] int64, and when there are images
        `pixel_values` [N_patches, C·T·P·P] float32 and `image_grid_thw` [N_img, 3] int64.
        """
        if (text is None) == (messages is None):
            raise ValueError("give exactly one of text= or messages=")
        if messages is not None:
            batched = bool(messages) and isinstance(messages[0], (list, tuple))
            convs = messages if batched else [messages]
            if images is not None:
                raise ValueError("with messages=, images come from the messages' image items")
            texts = self.apply_chat_template(list(convs), add_generation_prompt=add_generation_prompt)
            images = [img for c in convs for img in _message_images(c)]
        else:
            texts = [text] if isinstance(text, str) else list(text)
            images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        if not texts:
            raise ValueError("no text given")
        out = {}
        n_ph = sum(t.count(self.image_token) for t in texts)
        if n_ph != len(images):
            raise ValueError(f"{n_ph} {self.image_token} placeholders in the text but {len(images)} images")
        if images:
            if self.image_processor is None:
                raise ValueError("images given but the directory has no preprocessor_config.json")
            pil = [load_image(im) for im in images]
            enc = self.image_processor(images=pil, return_tensors="np")
            out["pixel_values"] = np.asarray(enc["pixel_values"], np.float32)
            grids = np.asarray(enc["image_grid_thw"], np.int64)
            out["image_grid_thw"] = grids
            expanded, k = [], 0
            for t in texts:
                n = t.count(self.image_token)
                expanded.append(expand_image_tokens(t, grids[k:k + n], self.merge_size, self.image_token))
                k += n
            texts = expanded
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        out.update(zip(("input_ids", "attention_mask"), pad(ids, self.pad_token_id, padding_side)))
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, rows, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(r, skip_special_tokens) for r in rows]

    def encode_supervised(self, text: str, span_loss: list[bool] | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A templated conversation (images already expanded) → ids [n] int64, supervised [n] bool and learned
        [n] bool. Supervised: the assistant replies, from after each `<|im_start|>assistant\n` header up to and
        including its `<|im_end|>` (what training feeds codes along). Learned: the supervised tokens that carry
        a loss — reply k's tokens when `span_loss[k]` (default all true), except text wrapped in
        `FLIP_OPEN … FLIP_CLOSE`, which takes the opposite (train/data.py `mark_loss` writes both from the
        data's `"loss"` flags; the markers are removed before tokenizing). A token any of whose characters is
        not learned is not learned.

        Each reply is tokenized apart from the text before it, as at generation time, where the prompt ends
        with the header and the reply's tokens follow it. Tokenizing the whole text instead lets a byte-level
        BPE merge the header's newline with a reply that starts with a newline (Qwen splits `\n\n` as one
        piece), so no token would be exactly the reply's and the model would learn tokens it never sees."""
        spans = assistant_spans(text)
        if span_loss is not None and len(span_loss) != len(spans):
            raise ValueError(f"the chat template rendered {len(spans)} assistant replies for {len(span_loss)} "
                             "assistant messages: cannot place their \"loss\" flags")
        ids: list[int] = []
        sup: list[bool] = []
        learned: list[bool] = []

        def add(piece: str, reply: int | None):
            if reply is None:
                if FLIP_OPEN in piece or FLIP_CLOSE in piece:
                    raise ValueError("a \"loss\" marker outside an assistant reply")
                t = self.tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids.extend(t)
                sup.extend([False] * len(t))
                learned.extend([False] * len(t))
                return
            default = True if span_loss is None else bool(span_loss[reply])
            clean, char_learned = unmark_loss(piece, default)
            if char_learned.all() or not char_learned.any():
                t = self.tokenizer(clean, add_special_tokens=False)["input_ids"]
                flags = [bool(char_learned.all()) if len(clean) else default] * len(t)
            else:                      # the learned characters decide per token: needs a fast tokenizer's offsets
                enc = self.tokenizer(clean, add_special_tokens=False, return_offsets_mapping=True)
                t = enc["input_ids"]
                flags = [bool(char_learned[a:b].all()) if b > a else default for a, b in enc["offset_mapping"]]
            ids.extend(t)
            sup.extend([True] * len(t))
            learned.extend(flags)

        pos = 0
        for k, (a, b) in enumerate(spans):
            if text[pos:a]:
                add(text[pos:a], None)
            if text[a:b]:
                add(text[a:b], k)
            pos = b
        if pos < len(text):
            add(text[pos:], None)
        return np.asarray(ids, np.int64), np.asarray(sup, bool), np.asarray(learned, bool)


# Wrapped around reply text whose `"loss"` flag differs from its message's (train/data.py `mark_loss`): Unicode
# private-use code points, which the chat template passes through verbatim and `encode_supervised` removes.
FLIP_OPEN, FLIP_CLOSE = "\ue000", "\ue001"


def unmark_loss(piece: str, default: bool) -> tuple[str, np.ndarray]:
    """(`piece` without FLIP markers, per character of it: learned) — `default` outside the markers, its
    opposite inside; markers must pair up and not nest."""
    out, flags, inside = [], [], False
    for ch in piece:
        if ch == FLIP_OPEN or ch == FLIP_CLOSE:
            if inside == (ch == FLIP_OPEN):
                raise ValueError("unbalanced \"loss\" markers in an assistant reply")
            inside = ch == FLIP_OPEN
            continue
        out.append(ch)
        flags.append(default != inside)
    if inside:
        raise ValueError("unbalanced \"loss\" markers in an assistant reply")
    return "".join(out), np.asarray(flags, bool)


def assistant_spans(text: str, header: str = ASSISTANT_HEADER, end: str = "<|im_end|>") -> list[tuple[int, int]]:
    """Character spans [a, b) of the assistant replies of a ChatML text: from after each `header` up to and
    including the next `end` (or to the end of an unterminated last reply)."""
    spans = []
    i = text.find(header)
    while i >= 0:
        a = i + len(header)
        j = text.find(end, a)
        b = len(text) if j < 0 else j + len(end)
        spans.append((a, b))
        i = text.find(header, b)
    return spans


def pad(rows: list[list[int]], pad_id: int, side: str = "left") -> tuple[np.ndarray, np.ndarray]:
    """Ragged id lists → (ids, mask) [B, max_len] int64, padded on `side`."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    s = max(len(r) for r in rows)
    ids = np.full((len(rows), s), pad_id, np.int64)
    mask = np.zeros((len(rows), s), np.int64)
    for i, r in enumerate(rows):
        sl = slice(s - len(r), s) if side == "left" else slice(0, len(r))
        ids[i, sl] = r
        mask[i, sl] = 1
    return ids, mask
