"""The engine's streamed text is the full decode of the output, delivered piece by piece: the
deltas of every step concatenate to `tokenizer.decode(output)` for text whose characters span
several tokens (multi-byte UTF-8, emoji, CJK) in the default model's byte-level tokenizer and in
a SentencePiece-style tokenizer with byte-fallback tokens; no delta carries half a character;
each step decodes a window of a few tokens, not the whole output; a request resumed with the
text another replica delivered goes on from it."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from protocol.clock import FakeClock
from protocol.replicas import Resume
from replica.config import EngineConfig
from replica.engine import Engine, text_decoder
from replica.model.fake import ScriptedFakeRunner
from replica.model.loader import default_model_dir
from replica.scheduling.request import Request

TEXT = "Grüße 🎉🙂 naïve café: 日本語, ✓ done.\n  «quoted» 👩‍💻 end"


class ScriptRunner(ScriptedFakeRunner):
    """Emits the given token ids in order, whatever the prompt: the test picks the output."""

    def __init__(self, tokenizer, script: list[int]) -> None:
        super().__init__(FakeClock(), vocab_size=len(tokenizer))
        self.tokenizer, self.script = tokenizer, script

    def sample(self, request: Request) -> int:
        return self.script[request.num_output_tokens]


class CountingTokenizer:
    """The real tokenizer, recording how many token ids each decode was given."""

    def __init__(self, tokenizer) -> None:
        self.inner, self.decoded = tokenizer, []

    def __len__(self) -> int:
        return len(self.inner)

    def decode(self, ids, **kwargs) -> str:
        self.decoded.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def streamed(tokenizer, script: list[int], resume: Resume | None = None) -> tuple[list[str], str]:
    """Every step's new text for a request whose output is `script`, and its final text."""
    engine = Engine(
        EngineConfig(policy="continuous", num_slots=1, max_seq_len=512), runner=ScriptRunner(tokenizer, script)
    )
    rid = engine.add_request([5, 6, 7], {"max_tokens": len(script), "ignore_eos": True}, resume=resume)
    request = engine.requests[rid]
    deltas = []
    while engine.has_unfinished:
        deltas += [out.new_text for out in engine.step().outputs]
    assert request.output_token_ids == script
    assert request.text == (resume.text if resume else "") + "".join(deltas)
    return deltas, "".join(deltas)


@pytest.fixture(scope="module")
def byte_level():
    return AutoTokenizer.from_pretrained(default_model_dir())


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-style tokenizer: SentencePiece pieces, every byte as a `<0xNN>` token for what the
    pieces lack, and Llama's decoder (spaces from U+2581, bytes fused into characters, one
    leading space stripped)."""
    pieces = ["▁", "▁G", "r", "ü", "ß", "e", "▁done", ".", "▁caf", "é", "▁na", "ï", "ve", ":", ","]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {p: 259 + i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def byte_fallback_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """`text` as pieces where the vocabulary has them, else its UTF-8 bytes as byte tokens."""
    vocab, ids, i = tokenizer.get_vocab(), [], 0
    text = "▁" + text.replace(" ", "▁")
    while i < len(text):
        piece = next((text[i:j] for j in range(len(text), i, -1) if text[i:j] in vocab), None)
        if piece is None:
            ids += [vocab[f"<0x{b:02X}>"] for b in text[i].encode()]
            i += 1
        else:
            ids.append(vocab[piece])
            i += len(piece)
    return ids


def test_deltas_concatenate_to_the_full_decode_of_multibyte_text(byte_level):
    """Byte-level BPE splits emoji and CJK characters over several tokens: the stream holds
    them back until they complete, and its deltas add up to the full decode."""
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 2  # many characters span tokens, so some steps must hold back
    deltas, text = streamed(byte_level, ids)
    assert text == byte_level.decode(ids, skip_special_tokens=True) == TEXT
    assert "" in deltas and not any("\ufffd" in d for d in deltas)


def test_deltas_concatenate_to_the_full_decode_with_byte_fallback_tokens():
    """Characters outside a SentencePiece vocabulary come as `<0xNN>` byte tokens, fused back
    into one character once its last byte arrives; the first piece's leading space is stripped
    as a full decode strips it, and later pieces keep theirs."""
    tokenizer = byte_fallback_tokenizer()
    ids = byte_fallback_ids(tokenizer, TEXT)
    assert sum(3 <= t < 259 for t in ids) > 20  # the emoji and CJK characters went to byte tokens
    deltas, text = streamed(tokenizer, ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert deltas[0] == "G" and not any("\ufffd" in d for d in deltas)


def test_each_step_decodes_a_window_not_the_whole_output(byte_level):
    """A long output costs the same per step at its end as at its start: every decode after the
    first is of a few tokens (those since the last emitted text and the one before)."""
    ids = byte_level.encode(TEXT * 6, add_special_tokens=False)
    counting = CountingTokenizer(byte_level)
    _, text = streamed(counting, ids)
    assert text == TEXT * 6 and len(ids) > 150
    assert max(counting.decoded) <= 6, counting.decoded


def test_a_resumed_request_streams_on_from_the_text_it_was_delivered(byte_level):
    """Moved mid-emoji: the text already delivered stops before the partial character; the
    new replica's first delta completes it and the whole is the full decode."""
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if byte_level.decode(ids[:i]).endswith("\ufffd"))
    delivered = byte_level.decode(ids[: cut - 1])
    assert not delivered.endswith("\ufffd")
    deltas, text = streamed(byte_level, ids, Resume(ids[:cut], delivered))
    assert delivered + text == TEXT and not any("\ufffd" in d for d in deltas)


def test_the_engine_decodes_through_the_fast_backend_only_where_it_gives_the_same_text(byte_level):
    """The default tokenizer cleans up no spaces, so the engine calls its Rust backend straight
    and gets `tokenizer.decode`'s text (special tokens skipped); one that cleans up spaces goes
    through `tokenizer.decode`, whose clean-up the backend does not do."""
    ids = byte_level.encode(TEXT + " , done .", add_special_tokens=False) + [byte_level.eos_token_id]
    assert not byte_level.clean_up_tokenization_spaces
    fast = text_decoder(byte_level)
    assert fast.func == byte_level.backend_tokenizer.decode
    assert fast(ids) == byte_level.decode(ids, skip_special_tokens=True)
    cleaning = byte_fallback_tokenizer()
    cleaning.clean_up_tokenization_spaces = True
    assert text_decoder(cleaning).func == cleaning.decode
    counting = CountingTokenizer(byte_level)  # no backend: its own decode
    assert text_decoder(counting).func == counting.decode
