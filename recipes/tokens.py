"""Token files: what `tidal data tokenize` writes and what a recipe trains on.

A token file is the token ids of every document, one after another, each document followed
by the end-of-sequence id, as raw little-endian integers (uint16 when the vocabulary fits,
else uint32), beside a JSON header `<file>.json`:

    {"format": "tidal-tokens/1", "dtype": "uint16", "tokens": 1234567, "documents": 42,
     "vocab_size": 257, "eos_id": 256, "tokenizer": {"kind": "bytes"}}

`PackedSequences` reads it memory-mapped (nothing is loaded up front, every worker of a node
shares the page cache) as packed sequences: sample i is the L + 1 tokens from position i·L
(the model reads the first L and predicts the last L), so every token but the last is
predicted once per pass and no sample is padded. Documents are not masked from each other
inside a sequence (the end-of-sequence id between them is what the model sees).

The tokenizer is a Hugging Face tokenizer from a local folder (`save_pretrained`'s output;
never downloaded), or, without one, the byte-level fallback: a token per UTF-8 byte (ids
0..255) and 256 for the end of a document. Writing needs numpy (and transformers for a
Hugging Face tokenizer), not torch: `tidal data tokenize` and the recipes' checks at
submit run on a login node (this module lives in `tidal.recipes`, whose package imports
nothing of torch; `tidal.train`'s does)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FORMAT = "tidal-tokens/1"
BYTE_VOCAB_SIZE = 257
BYTE_EOS_ID = 256
# Text is tokenized this many characters at a time (cut at a line's end), so that a file of
# any size is streamed.
CHUNK_CHARACTERS = 1 << 20


class TokenFileError(ValueError):
    """A token file (or its header) is missing, malformed or does not fit what reads it."""


@dataclasses.dataclass(frozen=True)
class TokenHeader:
    dtype: str
    tokens: int
    documents: int
    vocab_size: int
    eos_id: int
    tokenizer: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self)}


def header_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_header(path: str | os.PathLike[str]) -> TokenHeader:
    """The header of the token file at `path`, checked against the file's size."""
    path = Path(path)
    where = header_path(path)
    try:
        raw = json.loads(where.read_text())
    except FileNotFoundError:
        missing = "no such file" if not path.exists() else f"no header {where.name} beside it"
        raise TokenFileError(f"{path}: {missing} (write token files with `tidal data tokenize`)") from None
    except (OSError, ValueError) as error:
        raise TokenFileError(f"{where}: unreadable: {error}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise TokenFileError(f"{where}: not a {FORMAT} header")
    try:
        header = TokenHeader(dtype=str(raw["dtype"]), tokens=int(raw["tokens"]), documents=int(raw["documents"]),
                             vocab_size=int(raw["vocab_size"]), eos_id=int(raw["eos_id"]),
                             tokenizer=dict(raw.get("tokenizer") or {}))
    except (KeyError, TypeError, ValueError) as error:
        raise TokenFileError(f"{where}: malformed header: {error}") from None
    if header.dtype not in ("uint16", "uint32"):
        raise TokenFileError(f"{where}: dtype {header.dtype!r} is not uint16 or uint32")
    try:
        size = path.stat().st_size
    except OSError as error:
        raise TokenFileError(f"{path}: {error.strerror or error}") from None
    width = 2 if header.dtype == "uint16" else 4
    if size != header.tokens * width:
        raise TokenFileError(f"{path}: {size} bytes, but its header says {header.tokens} tokens of {width} bytes")
    return header


class PackedSequences:
    """Sample i: a LongTensor of the `sequence_length` + 1 tokens from position
    i·`sequence_length` of the token file at `path` (memory-mapped)."""

    def __init__(self, path: str | os.PathLike[str], sequence_length: int) -> None:
        import numpy

        if sequence_length < 1:
            raise TokenFileError(f"sequence_length must be positive, not {sequence_length}")
        self.path = Path(path)
        self.header = read_header(self.path)
        self.sequence_length = sequence_length
        self._length = (self.header.tokens - 1) // sequence_length
        if self._length < 1:
            raise TokenFileError(f"{self.path}: {self.header.tokens} tokens hold no sequence of "
                                 f"{sequence_length} + 1 tokens")
        self._tokens = numpy.memmap(self.path, dtype=numpy.dtype(self.header.dtype).newbyteorder("<"), mode="r")

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self._length:
            raise IndexError(f"sequence {index} of {self._length}")
        start = index * self.sequence_length
        window = self._tokens[start:start + self.sequence_length + 1]
        import torch

        return torch.from_numpy(window.astype("int64"))

    @property
    def tokens_per_sample(self) -> int:
        """Tokens a sample trains on (predicted): the sequence length."""
        return self.sequence_length


# Writing.

Encoder = Callable[[str], list[int]]


def byte_encoder(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def huggingface_tokenizer(folder: str | os.PathLike[str]) -> tuple[Encoder, int, int | None]:
    """(encode, vocabulary size, end-of-sequence id or None) of the tokenizer saved in
    `folder`; never downloads. A fast tokenizer (`tokenizer.json`) is read with the
    `tokenizers` library alone (no torch: seconds faster on a login node); any other with
    transformers' AutoTokenizer."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenFileError(f"--tokenizer {folder}: not a folder (a tokenizer saved with save_pretrained)")
    if (folder / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenFileError("a Hugging Face tokenizer needs the tokenizers package: pip install "
                                 "'tidal-elastic[recipes]' (or leave --tokenizer out for the byte-level "
                                 "tokenizer)") from None
        try:
            fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as error:  # the Rust library raises its own exception type
            raise TokenFileError(f"--tokenizer {folder}: tokenizer.json: {error}") from None
        eos_text = _eos_token(folder)

        def encode_fast(text: str) -> list[int]:
            ids: list[int] = fast.encode(text, add_special_tokens=False).ids
            return ids

        return encode_fast, fast.get_vocab_size(with_added_tokens=True), (
            fast.token_to_id(eos_text) if eos_text is not None else None)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenFileError("a Hugging Face tokenizer needs transformers: pip install 'tidal-elastic[recipes]' "
                             "(or leave --tokenizer out for the byte-level tokenizer)") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as error:
        raise TokenFileError(f"--tokenizer {folder}: {error}") from None

    def encode(text: str) -> list[int]:
        ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    return encode, len(tokenizer), tokenizer.eos_token_id


def _eos_token(folder: Path) -> str | None:
    """The end-of-sequence token's text, as save_pretrained records it."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            value = json.loads((folder / name).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


def documents(paths: Sequence[Path], field: str = "text") -> Iterator[Iterator[str]]:
    """Each document of `paths` as chunks of text: a `.jsonl` file holds one document a
    line (its `field`), any other file is one document of UTF-8 text."""
    for path in paths:
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as lines:
                for number, line in enumerate(lines, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                        text = record[field]
                    except (ValueError, KeyError, TypeError):
                        raise TokenFileError(f"{path}:{number}: not a JSON object with a {field!r} string") from None
                    if not isinstance(text, str):
                        raise TokenFileError(f"{path}:{number}: {field!r} is not a string")
                    yield iter((text,))
        else:
            yield _chunks(path)


def _chunks(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as text:
        pending: list[str] = []
        size = 0
        for line in text:
            pending.append(line)
            size += len(line)
            if size >= CHUNK_CHARACTERS:
                yield "".join(pending)
                pending, size = [], 0
        if pending:
            yield "".join(pending)


@dataclasses.dataclass(frozen=True)
class Tokenized:
    path: Path
    header: TokenHeader


def tokenize(inputs: Iterable[str | os.PathLike[str]], output: str | os.PathLike[str], *,
             tokenizer: str | os.PathLike[str] | None = None, eos_id: int | None = None,
             field: str = "text") -> Tokenized:
    """Write the token file `output` (and its header) from the text files `inputs`. The
    file is written beside its final name and renamed into place: a failed run leaves no
    half-written token file behind."""
    import numpy

    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise TokenFileError(f"{path}: no such file")
    encode: Encoder
    found_eos: int | None
    if tokenizer is None:
        encode, vocab_size, found_eos = byte_encoder, BYTE_VOCAB_SIZE, BYTE_EOS_ID
        description: dict[str, Any] = {"kind": "bytes"}
    else:
        encode, vocab_size, found_eos = huggingface_tokenizer(tokenizer)
        description = {"kind": "huggingface", "path": str(Path(tokenizer).absolute())}
    eos = eos_id if eos_id is not None else found_eos
    if eos is None:
        raise TokenFileError("the tokenizer has no end-of-sequence token: give --eos-id")
    if eos < 0:
        raise TokenFileError(f"--eos-id {eos} is negative")
    vocab_size = max(vocab_size, eos + 1)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    count = document_count = 0
    try:
        with partial.open("wb") as sink:
            for document in documents(paths, field):
                ids: list[int] = []
                for chunk in document:
                    ids += encode(chunk)
                ids.append(eos)
                if max(ids) >= vocab_size:
                    raise TokenFileError(f"the tokenizer gave id {max(ids)}, past its vocabulary of {vocab_size}")
                sink.write(numpy.asarray(ids, dtype=numpy.dtype(dtype).newbyteorder("<")).tobytes())
                count += len(ids)
                document_count += 1
        header = TokenHeader(dtype=dtype, tokens=count, documents=document_count, vocab_size=vocab_size,
                             eos_id=eos, tokenizer=description)
        header_partial = partial.with_name(partial.name + ".json")
        header_partial.write_text(json.dumps(header.as_json(), indent=1) + "\n")
        os.replace(partial, output)
        os.replace(header_partial, header_path(output))
    finally:
        partial.unlink(missing_ok=True)
        partial.with_name(partial.name + ".json").unlink(missing_ok=True)
    return Tokenized(path=output, header=header)
