"""A tiny, deterministic, locally built tokenizer for tests and the CPU demo (no downloads).

Design: character level. Every character is one token, except the three ChatML role names (``user``,
``assistant``, ``system``), which are single tokens so that a chat-templated prompt stays short for tiny models.
The model is a ``tokenizers`` WordLevel over a ``Split`` pre-tokenizer that isolates each role word or else each
single character, and the decoder is ``Fuse`` (plain concatenation). Because no normalizer or whitespace handling
is involved, ``decode(encode(s)) == s`` for every string made of vocabulary characters, spaces and newlines
included. Digits are single characters, so arithmetic answers are spelled digit by digit.

Fixed ids (independent of ``extra_texts``, which only appends tokens at the end):

======  =================  ==========================================
id      token              role
======  =================  ==========================================
0       ``<|endoftext|>``  pad token (``PAD_TOKEN_ID``)
1       ``<|im_start|>``   ChatML turn start
2       ``<|im_end|>``     eos token (``EOS_TOKEN_ID``): generation stops here
3       ``<unk>``          characters outside the vocabulary
4-6     ``user`` ``assistant`` ``system``
7-8     ``\\t`` ``\\n``
9-103   printable ASCII 0x20 (space) to 0x7E (``~``)
======  =================  ==========================================

Vocabulary size without extra texts: 104 (``BASE_VOCAB_SIZE``). There is no bos token; ``encode`` adds nothing.
The chat template is Qwen's ChatML without Qwen's default system message (kept out to keep prompts short)::

    <|im_start|>user\\n3+4=<|im_end|>\\n<|im_start|>assistant\\n

Optional, for tool-use tasks (both off by default, which leaves the files above byte for byte as they were):

* ``words``: multi-character strings that become single, ordinary tokens (e.g. ``<tool_call>`` or the fixed start
  of a call's JSON), so that a tiny model's tool call is a handful of tokens. They get ids after the extra texts'
  characters, sorted; the pre-tokenizer matches them (and the role words) longest first, before single characters.
  They are vocabulary tokens, not special ones, so ``decode(..., skip_special_tokens=True)`` keeps them, as Qwen's
  ``<tool_call>`` is kept.
* ``chat_template=TOOL_CHAT_TEMPLATE``: the same ChatML, with Qwen2.5's rendering of role ``tool``: a user turn whose
  content is wrapped in ``<tool_response>`` lines, consecutive tool messages sharing one user turn::

    <|im_start|>user\\n<tool_response>\\n7\\n</tool_response><|im_end|>\\n
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN, UNK_TOKEN)
ROLE_WORDS = ("user", "assistant", "system")
BASE_CHARS = ("\t", "\n") + tuple(chr(c) for c in range(0x20, 0x7F))

PAD_TOKEN_ID = 0
IM_START_TOKEN_ID = 1
EOS_TOKEN_ID = 2
UNK_TOKEN_ID = 3
BASE_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(ROLE_WORDS) + len(BASE_CHARS)

# Qwen2.5-style ChatML; any role is rendered the same way, the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# CHAT_TEMPLATE plus Qwen2.5's tool turns: each tool message is "\n<tool_response>\n" + content + "\n</tool_response>"
# inside one user turn per run of consecutive tool messages. Assistant messages render their content as it is (a
# rollout keeps the model's own call text there), and no tool list is rendered into a system message.
TOOL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _vocabulary(extra_texts: Iterable[str] | None, words: Sequence[str] = ()) -> dict[str, int]:
    tokens = list(SPECIAL_TOKENS) + list(ROLE_WORDS) + list(BASE_CHARS)
    known = set(tokens)
    # Sorted so that the ids do not depend on the order of the extra texts: the same inputs give the same file.
    # The characters of the words count as extra text, so every string the words are made of still round trips.
    texts = list(extra_texts or ()) + list(words)
    extra = sorted({ch for text in texts for ch in text} - known)
    return {tok: i for i, tok in enumerate(tokens + extra + _words(words))}


def _words(words: Sequence[str]) -> list[str]:
    """The multi-character words that are not already tokens, sorted (ids independent of the order given)."""
    if isinstance(words, str):
        raise TypeError("build_tiny_tokenizer: words must be a sequence of strings, not one string")
    bad = [w for w in words if not isinstance(w, str) or len(w) < 2 or w in SPECIAL_TOKENS]
    if bad:
        raise ValueError(f"build_tiny_tokenizer: words must be strings of 2+ characters, not special tokens: {bad}")
    return sorted(set(words) - set(ROLE_WORDS))


def _split_pattern(words: Sequence[str]) -> str:
    """The pre-tokenizer's alternation: role words (and words) longest first, then any single character."""
    if not words:  # the historical pattern, byte for byte
        return "|".join(ROLE_WORDS) + r"|[\s\S]"
    multi = sorted(set(ROLE_WORDS) | set(_words(words)), key=lambda w: (-len(w), w))
    return "|".join(re.escape(w) for w in multi) + r"|[\s\S]"


def build_tiny_tokenizer(
    save_dir: str | Path,
    extra_texts: Iterable[str] | None = None,
    words: Sequence[str] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> PreTrainedTokenizerFast:
    """Build the tiny character-level tokenizer, save it as an HF tokenizer directory and load it back.

    ``extra_texts``: characters of these strings that are not already in the vocabulary get their own tokens
    (appended after id 103, sorted), e.g. for non-ASCII test text. ``words``: multi-character strings that become
    single tokens (after those, sorted; see the module docstring). ``chat_template``: ``CHAT_TEMPLATE`` (default) or
    ``TOOL_CHAT_TEMPLATE`` (tool turns as Qwen2.5 renders them). The returned tokenizer is the one
    ``AutoTokenizer.from_pretrained(save_dir)`` gives, so callers test exactly what a trainer or vLLM loads.
    """
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    vocab = _vocabulary(extra_texts, words)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Role words (and words) first in the alternation, then any single character ([\s\S] also matches newlines).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(_split_pattern(words)), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=chat_template,
        # The default cleanup would turn " ," into "," and break the exact round trip.
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tokenizer.save_pretrained(str(save_dir))
    _write_compat_files(save_dir, chat_template)
    return AutoTokenizer.from_pretrained(str(save_dir))


def _write_compat_files(save_dir: Path, chat_template: str = CHAT_TEMPLATE) -> None:
    """Make the directory loadable by older transformers releases too (as vLLM builds may pin one).

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` and keeps the chat template only in
    ``chat_template.jinja``; older releases know neither, so name the class ``PreTrainedTokenizerFast`` (an alias
    in 5.x), inline the template and write the ``special_tokens_map.json`` they read.
    """
    config_path = save_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = chat_template
    config["bos_token"] = None
    config["add_bos_token"] = False
    config["add_eos_token"] = False
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN],
    }
    (save_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")
