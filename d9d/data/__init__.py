"""Token data (``d9d.data``): byte-level text corpora, token files, packed resumable loaders."""

from ._corpus import BYTE_VOCAB_SIZE as BYTE_VOCAB_SIZE
from ._corpus import byte_corpus as byte_corpus
from ._corpus import stdlib_corpus as stdlib_corpus
from ._digest import tokens_digest as tokens_digest
from ._loader import TokenLoader as TokenLoader
from ._packing import epoch_permutation as epoch_permutation
from ._packing import num_windows as num_windows
from ._token_file import token_file as token_file

__all__ = [
    "BYTE_VOCAB_SIZE",
    "TokenLoader",
    "byte_corpus",
    "epoch_permutation",
    "num_windows",
    "stdlib_corpus",
    "token_file",
    "tokens_digest",
]
