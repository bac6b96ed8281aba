"""processing.py: the offline tokenizer directory, image-token expansion on known grids, chat template, padding."""
import numpy as np
import pytest
from PIL import Image

from prisma_jax.host.processing import Processor, build_tokenizer, expand_image_tokens

WORDS = ["hello", "world", "describe", "this", "image."]


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    # Qwen3-VL's own min/max pixels (QWEN3_VL.md §7) so the documented examples apply
    ids = build_tokenizer(d, WORDS, min_pixels=65536, max_pixels=16777216)
    return d, ids


def test_special_ids_match_tiny_model_ids(proc_dir):
    _, ids = proc_dir
    # tests/hf_tiny.py uses VSTART, VEND, IMAGE, VIDEO = 3, 4, 5, 6
    assert (ids["vision_start_token_id"], ids["vision_end_token_id"], ids["image_token_id"],
            ids["video_token_id"]) == (3, 4, 5, 6)
    assert ids["im_start_id"] == 1 and ids["eos_token_id"] == ids["im_end_id"] == 2 and ids["pad_token_id"] == 0
    assert ids["vocab_size"] == 13 + len(WORDS)


def test_auto_classes_load_the_directory(proc_dir):
    from transformers import AutoImageProcessor, AutoTokenizer
    d, ids = proc_dir
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == ids["image_token_id"]
    ip = AutoImageProcessor.from_pretrained(d, backend="pil")
    enc = ip(images=[Image.new("RGB", (400, 300))], return_tensors="np")   # PROCESSING.md's numbers
    assert enc["pixel_values"].shape == (432, 1536)
    np.testing.assert_array_equal(enc["image_grid_thw"], [[1, 18, 24]])


@pytest.mark.parametrize("grids,counts", [([(1, 4, 6)], [6]), ([(1, 48, 64), (2, 4, 4)], [768, 8]),
                                          ([(1, 34, 60)], [510])])
def test_expand_image_tokens_known_grids(grids, counts):
    text = "a" + "".join(f"<|vision_start|><|image_pad|><|vision_end|>x{i}" for i in range(len(grids)))
    out = expand_image_tokens(text, grids, merge_size=2)
    pieces = out.split("<|vision_start|>")[1:]
    assert [p.split("<|vision_end|>")[0].count("<|image_pad|>") for p in pieces] == counts
    with pytest.raises(ValueError, match="placeholders"):
        expand_image_tokens(text, grids + [(1, 2, 2)])


def test_chat_template_and_image_expansion(proc_dir):
    d, ids = proc_dir
    p = Processor.from_pretrained(d)
    msgs = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (100, 100), "red")},
                                         {"type": "text", "text": "describe this image."}]}]
    assert p.apply_chat_template(msgs) == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                                           "describe this image.<|im_end|>\n<|im_start|>assistant\n")
    enc = p(messages=msgs)
    # 100×100 → 256×256 (smart_resize with min_pixels 256²) → grid 16×16 → 64 merged tokens
    np.testing.assert_array_equal(enc["image_grid_thw"], [[1, 16, 16]])
    assert enc["pixel_values"].shape == (256, 1536) and enc["pixel_values"].dtype == np.float32
    row = enc["input_ids"][0]
    assert (row == ids["image_token_id"]).sum() == 64
    start = int(np.flatnonzero(row == ids["vision_start_token_id"])[0])
    assert row[start + 65] == ids["vision_end_token_id"]
    # red pixels → (255/255 − 0.5)/0.5 = 1 on the R channel (first 512 columns of each patch row are R)
    np.testing.assert_allclose(enc["pixel_values"][:, :512], 1.0, atol=1e-6)


def test_batch_is_left_padded_and_images_split_per_row(proc_dir, tmp_path):
    d, ids = proc_dir
    p = Processor.from_pretrained(d)
    path = tmp_path / "im.png"
    Image.new("RGB", (64, 64), "blue").save(path)
    texts = ["hello <|vision_start|><|image_pad|><|vision_end|>", "world",
             "<|vision_start|><|image_pad|><|vision_end|> this"]
    enc = p(text=texts, images=[str(path), Image.new("RGB", (64, 128))])
    np.testing.assert_array_equal(enc["image_grid_thw"], [[1, 16, 16], [1, 24, 12]])  # h384×w192
    n = (enc["input_ids"] == ids["image_token_id"]).sum(1)
    np.testing.assert_array_equal(n, [64, 0, 72])
    m = enc["attention_mask"]
    assert m.shape == enc["input_ids"].shape and m[:, -1].all()
    assert m[1].sum() == 1 and (enc["input_ids"][1][m[1] == 0] == ids["pad_token_id"]).all()
    assert enc["input_ids"][1, -1] == p.tokenizer.convert_tokens_to_ids("world")


def test_assistant_mask_covers_assistant_turns_only(proc_dir):
    d, _ = proc_dir
    p = Processor.from_pretrained(d)
    text = p.apply_chat_template([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"},
                                  {"role": "user", "content": "this"}, {"role": "assistant", "content": "image."}],
                                 add_generation_prompt=False)
    ids, sup, _ = p.encode_supervised(text)
    np.testing.assert_array_equal(ids, p(text=[text])["input_ids"][0])    # word-level: nothing can merge
    toks = p.tokenizer.convert_ids_to_tokens(ids.tolist())
    got = [t for t, m in zip(toks, sup) if m]
    assert got == ["world", "<|im_end|>", "image.", "<|im_end|>"]


# ------------------------------------------------------------------ a byte-level BPE with Qwen's pre-tokenizer

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
REPLIES = [" Hello there.", "\nHello", "\n\nA list:\n- one\n- two", ".", "!? yes", "  \n indented", "...and so on",
           "\tTabbed", "\n", "Plain words, then a newline\n"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """Qwen2's tokenizer recipe in small: its split regex, byte-level BPE (trained here on ~4 kB of chat-like
    text, newlines and punctuation runs included), the Qwen special tokens and the Qwen chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from prisma_jax.host.processing import CHAT_TEMPLATE, SPECIAL_TOKENS
    rng = np.random.default_rng(0)
    words = ["hello", "there", "list", "one", "two", "yes", "indented", "and", "so", "on", "plain", "words", "then",
             "a", "newline", "user", "assistant", "system", "tabbed", "what", "is", "this", "question"]
    seps = [" ", "\n", "\n\n", ". ", "...", "!? ", ":\n- ", "  \n ", "\t", ", "]
    corpus = ["<|im_start|>assistant\n\n" + "".join(str(rng.choice(words)) + str(rng.choice(seps)) for _ in range(12))
              for _ in range(60)]
    assert 3000 < sum(map(len, corpus)) < 12000
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIAL_TOKENS),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    d = str(tmp_path_factory.mktemp("bpe"))
    fast.save_pretrained(d)
    return d


def expected_encoding(p, conv):
    """Independent of `encode_supervised`: the template rendered message by message. Prompt text up to each
    generation prompt, then the reply text with its end token, each tokenized alone — what a model generating
    that reply after that prompt would produce."""
    tok = lambda t: p.tokenizer(t, add_special_tokens=False)["input_ids"]   # noqa: E731
    ids, sup, done = [], [], ""
    for k, msg in enumerate(conv):
        if msg["role"] != "assistant":
            continue
        prompt = p.apply_chat_template(conv[:k], add_generation_prompt=True)
        assert prompt.startswith(done)
        ids += tok(prompt[len(done):])
        sup += [False] * (len(ids) - len(sup))
        ids += tok(msg["content"]) + [p.ids["im_end_id"]]
        sup += [True] * (len(ids) - len(sup))
        done = prompt + msg["content"] + "<|im_end|>"
    full = p.apply_chat_template(conv, add_generation_prompt=False)
    assert full.startswith(done)
    ids += tok(full[len(done):])
    sup += [False] * (len(ids) - len(sup))
    return full, np.array(ids), np.array(sup)


@pytest.mark.parametrize("reply", REPLIES)
def test_supervised_tokens_are_exactly_the_reply_with_a_bpe_tokenizer(bpe_dir, reply):
    p = Processor.from_pretrained(bpe_dir)
    conv = [{"role": "user", "content": "what is this question"}, {"role": "assistant", "content": reply},
            {"role": "user", "content": "hello"}, {"role": "assistant", "content": reply + " yes"}]
    text, want_ids, want_sup = expected_encoding(p, conv)
    ids, sup, _ = p.encode_supervised(text)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(sup, want_sup)
    # the supervised tokens decode to the replies and their end tokens, nothing of the headers
    got = [p.tokenizer.decode(ids[a:b].tolist()) for a, b in _runs(sup)]
    assert got == [reply + "<|im_end|>", reply + " yes<|im_end|>"]
    # the prompt tokens are those of the generation prompt
    gen = p(messages=conv[:1])["input_ids"][0]
    np.testing.assert_array_equal(ids[:len(gen)], gen)
    assert not sup[:len(gen)].any() and sup[len(gen)]
    if reply.startswith("\n"):      # the case that needs the split: the whole text merges header and reply
        whole = p.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert whole[:len(gen)] != gen.tolist()


@pytest.mark.parametrize("msg_loss,item_loss,want", [
    (True, (False, True), [" there.<|im_end|>"]),           # the answer not learned, the rest learned
    (False, (None, True), [" there."]),                     # only the item that asks for it: no end token
    (True, (True, True), ["\nhello there.<|im_end|>"]),       # flags equal to the default change nothing
    (True, (False, False), ["<|im_end|>"]),
])
def test_loss_flags_select_the_learned_tokens(bpe_dir, msg_loss, item_loss, want):
    """`"loss"` flags (train/data.py `mark_loss`) → the learned tokens of `encode_supervised`: the ids and the
    supervised mask are those of the unflagged reply, the learned tokens decode to the learned text."""
    from train.data import mark_loss
    p = Processor.from_pretrained(bpe_dir)
    items = [{"type": "text", "text": t} for t in ("\nhello", " there.")]
    flagged = [it if f is None else {**it, "loss": f} for it, f in zip(items, item_loss)]
    conv = [{"role": "user", "content": "what is this question"},
            {"role": "assistant", "content": flagged, **({} if msg_loss else {"loss": False})}]
    marked, spans = mark_loss(conv, "here")
    assert spans == [msg_loss]
    ids, sup, learned = p.encode_supervised(p.apply_chat_template(marked, add_generation_prompt=False), spans)
    plain_ids, plain_sup, plain_learned = p.encode_supervised(
        p.apply_chat_template(conv[:1] + [{"role": "assistant", "content": items}], add_generation_prompt=False))
    np.testing.assert_array_equal(ids, plain_ids)
    np.testing.assert_array_equal(sup, plain_sup)
    np.testing.assert_array_equal(plain_learned, plain_sup)
    assert not (learned & ~sup).any()
    assert [p.tokenizer.decode(ids[a:b].tolist()) for a, b in _runs(learned)] == want


def test_loss_flag_on_part_of_a_token_unlearns_the_token(bpe_dir):
    """A token that holds any character of not-learned text is not learned."""
    from train.data import mark_loss
    p = Processor.from_pretrained(bpe_dir)
    conv = [{"role": "user", "content": "what"},
            {"role": "assistant", "content": [{"type": "text", "text": "hel", "loss": False},
                                              {"type": "text", "text": "lo there"}]}]
    ids, sup, learned = p.encode_supervised(p.apply_chat_template(mark_loss(conv, "here")[0], False), [True])
    toks = [p.tokenizer.decode([i]) for i in ids[sup]]
    assert toks[:2] == ["hello", " there"]            # one token across the flag's boundary
    assert learned[sup].tolist() == [False, True, True]


def test_loss_flags_bad_input():
    from train.data import mark_loss
    text = {"type": "text", "text": "x"}
    for conv, match in [
        ([{"role": "user", "content": "q", "loss": False}], "user message: 'loss' applies to assistant"),
        ([{"role": "user", "content": [{**text, "loss": False}]}], "applies to assistant messages"),
        ([{"role": "assistant", "content": "a", "loss": 0}], "'loss' must be true or false, got 0"),
        ([{"role": "assistant", "content": [{**text, "loss": "no"}]}], "item 'loss' must be true or false"),
        ([{"role": "assistant", "content": [{"type": "image", "image": "a.png", "loss": False}]}], "text items only"),
        ([{"role": "assistant", "content": "a\ue000"}], "reserved character"),
        ([{"role": "user", "content": "q\ue001"}, {"role": "assistant", "content": "a"}],
         r"f.jsonl:3: messages\[0\] text holds a reserved character"),
        ([{"role": "system", "content": [{**text, "text": "\ue000"}]}], r"messages\[0\] text holds a reserved"),
    ]:
        with pytest.raises(ValueError, match=match):
            mark_loss(conv, "f.jsonl:3")


def _runs(mask):
    """[a, b) index runs where mask is True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_bad_inputs(proc_dir, tmp_path):
    d, _ = proc_dir
    p = Processor.from_pretrained(d)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(ValueError, match="cannot read image"):
        p(text=["<|image_pad|>"], images=[str(bad)])
    with pytest.raises(ValueError, match="cannot read image"):
        p(text=["<|image_pad|>"], images=[str(tmp_path / "missing.png")])
    with pytest.raises(ValueError, match="placeholders"):
        p(text=["hello"], images=[Image.new("RGB", (64, 64))])
    with pytest.raises(ValueError, match="not a directory"):
        Processor.from_pretrained(str(tmp_path / "nope"))
