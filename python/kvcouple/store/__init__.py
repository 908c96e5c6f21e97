"""The trace store: layout (:mod:`~kvcouple.store.schema`), writing and reading."""

from kvcouple.store.dataset import open_trace_store
from kvcouple.store.schema import SCHEMA_VERSION, Record, variables
from kvcouple.store.writer import (
    RUN_KEYS,
    StoreLayout,
    TraceStoreWriter,
    VocabularyMismatchError,
    check_resume,
)

__all__ = [
    "RUN_KEYS",
    "SCHEMA_VERSION",
    "Record",
    "StoreLayout",
    "TraceStoreWriter",
    "VocabularyMismatchError",
    "check_resume",
    "open_trace_store",
    "variables",
]
