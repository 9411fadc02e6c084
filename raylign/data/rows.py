"""Row validation helpers and the read-validate-count loop shared by every dataset kind.

A dataset kind (SFT, preference pairs, KTO, PRM) is a function ``make_sample(row, where)`` that
validates one row with the helpers here and returns a sample. :func:`collect_samples` reads
the file, calls it for each row and either stops at the first bad row or, with
``skip_bad_rows``, skips it and counts it by reason. Every row error names the file, the
row number and the key, in the same words for every dataset kind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, ItemsView
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from raylign.config.data import DataConfig, DatasetSpec
from raylign.data.errors import RowDropped, RowError, RowRef
from raylign.data.mixing import mix_datasets, split_holdout
from raylign.data.readers import read_rows

MAX_SKIP_EXAMPLES = 5


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def require_key(row: dict[str, Any], key: str, where: RowRef) -> Any:
    if key not in row:
        present = ", ".join(repr(k) for k in row) or "none"
        raise where.error(key, f"missing key (keys present: {present})", "missing_key")
    if row[key] is None:  # JSON null, an empty cell of a parquet file
        raise where.error(key, "null value", "null_value")
    return row[key]


def read_from_csv(where: RowRef) -> bool:
    """Whether the row comes from a CSV file, whose cells are all text (no booleans or numbers)."""
    return where.source.lower().endswith(".csv")


def check_text(value: Any, key: str, where: RowRef) -> str:
    """``value`` must be a string with something other than whitespace in it, encodable as UTF-8."""
    if not isinstance(value, str):
        raise where.error(key, f"expected a string, got {_type_name(value)}: {value!r:.80}", "wrong_type")
    if not value.strip():
        raise where.error(key, "empty text", "empty_text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate, e.g. from a "\ud800" escape in JSON
        bad = f"U+{ord(value[err.start]):04X}"
        raise where.error(
            key, f"not valid Unicode text: lone surrogate {bad} at character {err.start}", "bad_unicode"
        ) from None
    return value


def require_text(row: dict[str, Any], key: str, where: RowRef) -> str:
    return check_text(require_key(row, key, where), key, where)


def optional_text(row: dict[str, Any], key: str, where: RowRef) -> str | None:
    """The text under ``key``, or None when the key is absent or null (an empty string is an error, except
    in a CSV file, which has no other way to leave an optional cell out)."""
    if row.get(key) is None or (read_from_csv(where) and row[key] == ""):
        return None
    return check_text(row[key], key, where)


def refuse_system_beside_conversation(row: dict[str, Any], key: str, conversation_key: str, where: RowRef) -> None:
    """A system prompt under ``key`` beside a conversation under ``conversation_key``, which carries its own
    (or none): it would be dropped without a word. Refused naming the key."""
    if row.get(key) is not None:
        raise where.error(
            key,
            f"a system prompt beside the conversation in {conversation_key!r}, which would drop it: put it in the "
            "conversation as its first message (role 'system'), or remove the key",
            "unread_key",
        )


def require_list(row: dict[str, Any], key: str, where: RowRef) -> list[Any]:
    value = require_key(row, key, where)
    if not isinstance(value, list):
        raise where.error(key, f"expected a list, got {_type_name(value)}: {value!r:.80}", "wrong_type")
    if not value:
        raise where.error(key, "empty list", "empty_text")
    return value


@dataclass
class DataStats:
    """What happened to the rows: for the trainer to log."""

    rows_read: int = 0
    rows_kept: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    skip_examples: list[str] = field(default_factory=list)
    truncated: int = 0
    tokens: int = 0
    target_tokens: int = 0

    def record_skip(self, err: RowError) -> None:
        self.skipped[err.reason] += 1
        if len(self.skip_examples) < MAX_SKIP_EXAMPLES:
            self.skip_examples.append(str(err))

    def record_kept(self, sample: CountedSample) -> None:
        self.rows_kept += 1
        self.truncated += int(sample.truncated)
        self.tokens += sample.num_tokens
        self.target_tokens += sample.num_target_tokens

    def merge(self, other: DataStats) -> None:
        self.rows_read += other.rows_read
        self.rows_kept += other.rows_kept
        self.skipped.update(other.skipped)
        room = MAX_SKIP_EXAMPLES - len(self.skip_examples)
        self.skip_examples.extend(other.skip_examples[: max(room, 0)])
        self.truncated += other.truncated
        self.tokens += other.tokens
        self.target_tokens += other.target_tokens

    def as_dict(self) -> dict[str, int]:
        """Flat counters for a metrics logger (``skipped/<reason>`` per reason)."""
        flat = {
            "rows_read": self.rows_read,
            "rows_kept": self.rows_kept,
            "rows_skipped": sum(self.skipped.values()),
            "rows_truncated": self.truncated,
            "tokens": self.tokens,
            "target_tokens": self.target_tokens,
        }
        flat.update({f"skipped/{reason}": n for reason, n in sorted(self.skipped.items())})
        return flat

    def items(self) -> ItemsView[str, int]:
        """The counters of :meth:`as_dict`, so the stats can be handed to a logger like a mapping."""
        return self.as_dict().items()


class CountedSample(Protocol):
    """What :class:`DataStats` needs from a sample of any dataset kind."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_target_tokens(self) -> int: ...

    @property
    def truncated(self) -> bool: ...


S = TypeVar("S", bound=CountedSample)


def collect_samples(
    spec: DatasetSpec,
    cfg: DataConfig,
    make_sample: Callable[[dict[str, Any], RowRef], S],
    stats: DataStats,
) -> list[S]:
    """Read ``spec.path`` and turn each row into a sample with ``make_sample``.

    ``make_sample`` raises :class:`RowError` for a bad row, which stops the run unless
    ``cfg.skip_bad_rows`` (then it is counted in ``stats`` by reason), and
    :class:`RowDropped` for a valid row that a policy leaves out (always counted, never fatal).
    Rows count as read whether or not they are kept; ``max_samples`` counts kept rows.
    """

    def skip(err: RowError) -> None:
        stats.rows_read += 1
        stats.record_skip(err)

    samples: list[S] = []
    on_bad_row = skip if cfg.skip_bad_rows else None
    for row_number, row in read_rows(spec.path, split=spec.split, on_bad_row=on_bad_row):
        where = RowRef(spec.path, row_number)
        try:
            sample = make_sample(row, where)
        except RowError as err:
            if not (cfg.skip_bad_rows or isinstance(err, RowDropped)):
                raise
            skip(err)
            continue
        stats.rows_read += 1
        stats.record_kept(sample)
        samples.append(sample)
        if spec.max_samples is not None and len(samples) >= spec.max_samples:
            break
    return samples


def build_splits(
    cfg: DataConfig, load_samples: Callable[[DatasetSpec, DataStats], list[Any]]
) -> tuple[list[Any], list[Any], DataStats]:
    """Read every dataset with ``load_samples(spec, stats)``; mix the train sets by weight; set eval aside.

    Eval samples come from ``cfg.eval`` (concatenated, unweighted) or, when that is empty, from
    holding out ``cfg.eval_fraction`` of each train dataset before mixing, so no eval sample is
    ever trained on. See :mod:`raylign.data.mixing` for the mixing semantics.
    """
    stats = DataStats()
    per_dataset: list[list[Any]] = []
    eval_samples: list[Any] = []
    for number, spec in enumerate(cfg.train):
        file_stats = DataStats()
        samples = load_samples(spec, file_stats)
        stats.merge(file_stats)
        train_idx, eval_idx = split_holdout(len(samples), cfg.eval_fraction, seed=cfg.seed + number)
        per_dataset.append([samples[i] for i in train_idx])
        eval_samples.extend(samples[i] for i in eval_idx)
    for spec in cfg.eval:
        file_stats = DataStats()
        eval_samples.extend(load_samples(spec, file_stats))
        stats.merge(file_stats)
    weights = None if cfg.train[0].weight is None else [spec.weight for spec in cfg.train]
    mixture = mix_datasets([len(s) for s in per_dataset], weights, seed=cfg.seed)
    return [per_dataset[d][i] for d, i in mixture], eval_samples, stats
