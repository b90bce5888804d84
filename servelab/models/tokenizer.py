"""A small byte-level BPE tokenizer, trained locally, and the tokenizer loader.

:func:`build_tiny_tokenizer` trains a byte-level BPE on :data:`TINY_CORPUS`
(a few paragraphs embedded below, so nothing is ever downloaded) and saves it
in the Hugging Face layout (``tokenizer.json`` + ``tokenizer_config.json`` +
special tokens), so ``transformers.AutoTokenizer.from_pretrained(path)`` loads
it. Byte-level means every string is encodable (no unknown token) and every
id sequence decodes, which the detokenizer tests rely on.

:func:`load_tokenizer` loads the tokenizer of any checkpoint folder or
``.gguf`` file, and returns ``None`` (with a warning) for a folder that has
no tokenizer files.

Special tokens sit at fixed ids: ``<pad>`` = 0, ``<s>`` (BOS) = 1, ``</s>``
(EOS) = 2. Encoding prepends BOS, as Llama tokenizers do.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2

# Written for this project; varied topics and punctuation so merges cover
# common English fragments, digits and code-ish text.
TINY_CORPUS = """\
The serving engine reads a batch of requests, decides which tokens to compute
in this step, and hands the model a flat list of token ids with their positions.
Each request keeps its keys and values in fixed-size blocks of the cache; a block
table says where the blocks of a sequence live, and a slot mapping says where the
new keys of this step must be written.
Paged attention gathers the blocks of every sequence, masks the future, and
mixes the values with a softmax over the scores. A long prompt may be split into
chunks, so the first chunk is computed now and the rest in later steps, while short
requests keep decoding one token at a time.
When memory runs out, the scheduler preempts a request, frees its blocks and puts
it back in the waiting queue; prefix caching lets it find the blocks it had before.
Speculative decoding proposes a few draft tokens that the target model verifies in
one forward pass; accepted drafts are free tokens, rejected ones are rolled back.

On a quiet morning the baker opens the shop at six, lights the oven and sets out
bread, rolls and small cakes. Children stop on the way to school and count their
coins; the old man from the corner buys the same loaf every day and talks about the
weather: rain on Monday, wind on Tuesday, sun for the rest of the week.
The river runs under three bridges before it reaches the sea. Boats carry wood,
salt and grain; in summer the water is low and the boats wait for the tide.
A cat sleeps on the warm stones near the market, and the pigeons walk around her
as if she were a statue.

Numbers and code: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096.
for i in range(10): print(i * i)
def add(a, b): return a + b
x = [1, 2, 3]; y = {"key": "value", "n": 42}
if the cache is full then evict the least recently used block.
Questions? Answers! Lists: apples, pears, plums; colors: red, green, blue.
She said, "It is late." He asked, "Is it?" They laughed and walked home.
"""


def build_tiny_tokenizer(path: str | Path, vocab_size: int = 512, corpus: str | None = None) -> int:
    """Train a byte-level BPE and save it under ``path`` in the HF layout.

    Args:
        path: folder to write ``tokenizer.json``, ``tokenizer_config.json`` and
            ``special_tokens_map.json`` into (created if missing).
        vocab_size: target size (special tokens + 256 byte symbols + merges);
            at least 259. The trainer may stop short if the corpus runs out
            of pairs, so use the returned size.
        corpus: training text, default :data:`TINY_CORPUS`.

    Returns:
        The actual vocabulary size (``len(tokenizer)``, special tokens included).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 259:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= 259 (3 special tokens + 256 bytes)")
    text = TINY_CORPUS if corpus is None else corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One "document" per line keeps merges from spanning line breaks.
    tok.train_from_iterator(text.splitlines(), trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # ByteLevel offsets fix-up plus a BOS in front of every encoded sequence.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, bos_id)],
        ),
    ])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        model_max_length=1 << 20, clean_up_tokenization_spaces=False,
    )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # transformers 5 records its own backend class name; the generic fast
    # class name loads under both 4.x and 5.x.
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return len(fast)


# Files any of which means "this folder has a tokenizer" (fast, SentencePiece, BPE, WordPiece layouts).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "merges.txt")


def load_tokenizer(path: str | Path):
    """The tokenizer of a local checkpoint folder or ``.gguf`` file (never the network), or ``None``.

    A research checkpoint often ships weights and ``config.json`` only: when
    the folder holds none of :data:`TOKENIZER_FILES`, this warns and returns
    ``None`` — the model still runs on token-id prompts, and a pipeline built
    without a tokenizer says so if it is handed text. A tokenizer that is
    present but cannot be built raises ``ValueError`` naming the folder.
    """
    from transformers import AutoTokenizer

    from servelab.models.gguf import find_gguf_file, load_gguf_tokenizer

    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"tokenizer path {str(path)!r} does not exist")
    has_files = folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES)
    # A .gguf file, or a folder that is only a GGUF's home (same rule as load_model).
    if folder.is_file() or (not has_files and not (folder / "config.json").is_file() and any(folder.glob("*.gguf"))):
        return load_gguf_tokenizer(find_gguf_file(folder))
    if not has_files:
        warnings.warn(f"{str(folder)!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): loaded "
                      "without a tokenizer, so prompts must be token ids and outputs carry no text",
                      stacklevel=2)
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - missing backends, bad JSON...: say which folder
        raise ValueError(f"cannot load the tokenizer in {str(folder)!r}: {exc}") from exc
