"""Demand traces for the fleet simulator: real per-request traces and synthetic rate windows.

Pure Python + numpy (no Django), so the simulator, the benchmarks and the tests share it.

Per-request trace
    CSV with a header, one row per request: ``timestamp,input_tokens,output_tokens`` and an
    optional ``client`` column (default client ``"default"``). The Azure LLM inference trace's
    ``TIMESTAMP,ContextTokens,GeneratedTokens`` are recognised as the same three columns; column
    names are matched case-insensitively. A timestamp is either a number of seconds, kept as given,
    or an ISO datetime (``2023-11-16 18:15:46.6805900``, optionally with a time zone), turned into
    seconds after the first row's, so a datetime trace starts at 0. All rows of a file use the same
    kind. Timestamps must not go backwards (equal ones are fine); sizes are whole numbers ≥ 0.

Rate windows
    CSV ``window_start_s,rate_req_per_s`` with optional ``cv`` (coefficient of variation of the
    inter-arrival times, default 1), ``client`` (default ``"default"``) and ``window_end_s``
    columns; a blank optional value takes its default. Rows of different clients may interleave;
    each client's windows must start in increasing order. A window lasts until the next
    ``window_start_s`` of the same client, or until its ``window_end_s`` if given (which may leave
    a gap without requests, but must not overlap the next window). The last window of a client
    lasts until its ``window_end_s`` or, without one, as long as the previous window of that
    client; a client with a single window needs a ``window_end_s``.

    Arrivals form a renewal process whose inter-arrival times are gamma-distributed with shape
    ``1/cv²`` and mean ``1/rate`` (cv=1: Poisson; cv=0: evenly spaced; cv>1: bursty). They are
    drawn per (client, cv) as one unit-rate process in "operational time" (the integral of the
    rate over that client's windows with that cv) and mapped back window by window, so the process
    continues across window boundaries instead of restarting, and its first arrival is drawn from
    the stationary (forward-recurrence) distribution rather than at a window start. Each client
    draws from its own random stream (seeded by the seed and the client's name), so adding a
    client does not change the others' arrivals. Request sizes are (input, output) pairs drawn
    uniformly with replacement from a separate per-request trace (``sizes_path``, the CLI's
    ``--sizes``), keeping each pair's input and output together; that file's timestamp column is
    optional.

Scaling (``scale=K``, K > 0)
    Rate windows: every rate is multiplied by K. Per-request trace: each request appears
    ``floor(K)`` times, and one more time for a seeded random subset of exactly
    ``round(frac(K) · n)`` requests, so a trace of n requests becomes exactly ``round(K · n)``
    (K < 1 keeps a seeded subset of ``round(K · n)`` requests at their original times). The first
    appearance keeps the request's arrival time; each extra copy lands uniformly at random in
    ``[t, t + g)``, where g is the gap to the next request capped at the trace's mean
    inter-arrival time (0 for the last request), so copies neither pile up on the same instant nor
    spill into idle periods, and the trace's shape over time is kept. Copies keep the request's
    sizes and client.

Everything is deterministic under ``seed``. Errors are ``TraceError`` naming the file and line.
"""

from __future__ import annotations

import csv
import gc
import io
import math
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

DEFAULT_CLIENT = "default"
# A guard against a typo (a rate of 1e6 for a week) exhausting memory: ~100 bytes per request.
MAX_GENERATED_REQUESTS = 20_000_000

# Canonical column -> accepted spellings (compared lower-cased).
REQUEST_COLUMNS = {
    "timestamp": ("timestamp",),
    "input_tokens": ("input_tokens", "contexttokens"),
    "output_tokens": ("output_tokens", "generatedtokens"),
    "client": ("client",),
}
WINDOW_COLUMNS = {
    "window_start_s": ("window_start_s",),
    "rate_req_per_s": ("rate_req_per_s",),
    "cv": ("cv",),
    "client": ("client",),
    "window_end_s": ("window_end_s",),
}
_REQUEST_ACCEPTED = (
    "timestamp (or TIMESTAMP), input_tokens (or ContextTokens), "
    "output_tokens (or GeneratedTokens), optional client"
)
_WINDOW_ACCEPTED = "window_start_s, rate_req_per_s, optional cv, client, window_end_s"

_Floats = NDArray[np.float64]
_Ints = NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    client: str = DEFAULT_CLIENT


@dataclass(frozen=True)
class TraceSummary:
    requests: int
    duration_s: float  # last arrival - first arrival
    mean_rate_req_per_s: float  # requests / duration_s (0 when the duration is 0)
    peak_rate_req_per_s_1min: float  # requests in the busiest 60 s window, / 60
    mean_input_tokens: float
    mean_output_tokens: float
    clients: tuple[str, ...]  # sorted


class TraceError(ValueError):
    """A bad trace file or argument; the message names the file and, where it applies, the line."""

    def __init__(self, path: str | Path, line: int | None, message: str):
        self.path = str(path)
        self.line = line
        self.reason = message
        where = Path(path).name if line is None else f"{Path(path).name} line {line}"
        super().__init__(f"{where}: {message}")


# --- public API -------------------------------------------------------------------------------


def load_trace(
    path: str | Path,
    *,
    sizes_path: str | Path | None = None,
    scale: float = 1.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """Load a per-request trace or rate windows, telling them apart by the header."""
    _check_scale(path, scale)
    rows = _CsvRows(path)
    header = rows.header()
    if "window_start_s" in header or "rate_req_per_s" in header:
        return load_rate_windows(path, sizes_path=sizes_path, scale=scale, seed=seed)
    if any(name in header for spellings in REQUEST_COLUMNS.values() for name in spellings):
        if sizes_path is not None:
            raise TraceError(
                path,
                1,
                "a per-request trace carries its own request sizes; a sizes file applies only "
                "to rate windows",
            )
        return load_request_trace(path, scale=scale, seed=seed)
    raise TraceError(
        path,
        1,
        f"unrecognised header ({', '.join(header)}); a per-request trace has columns "
        f"{_REQUEST_ACCEPTED}; rate windows have {_WINDOW_ACCEPTED}",
    )


def load_request_trace(
    path: str | Path, *, scale: float = 1.0, seed: int = 0
) -> list[TraceRequest]:
    """Load a per-request trace, scaled by thinning/replication; sorted by arrival."""
    _check_scale(path, scale)
    parsed = _parse_request_trace(path, require_timestamp=True)
    arrivals, inputs, outputs, client_idx = _scale_requests(parsed, scale, seed)
    return _build(arrivals, inputs, outputs, client_idx, parsed.clients)


def load_rate_windows(
    path: str | Path,
    *,
    sizes_path: str | Path | None,
    scale: float = 1.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """Draw requests from rate windows, with sizes from the per-request trace at sizes_path."""
    _check_scale(path, scale)
    if sizes_path is None:
        raise TraceError(
            path,
            1,
            "rate windows need a per-request trace to draw request sizes from (sizes_path, "
            "--sizes)",
        )
    windows = _parse_windows(path)
    sizes = _parse_request_trace(sizes_path, require_timestamp=False)

    expected = sum(float(np.sum(w.rates * w.lengths)) for w in windows.values()) * scale
    if expected > MAX_GENERATED_REQUESTS:
        raise TraceError(
            path,
            None,
            f"the windows would generate about {expected:,.0f} requests at scale {scale:g} "
            f"(limit {MAX_GENERATED_REQUESTS:,})",
        )

    names = list(windows)
    parts_t, parts_in, parts_out, parts_client = [], [], [], []
    for index, name in enumerate(names):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        arrivals = _client_arrivals(windows[name], scale, rng)
        pick = rng.integers(0, len(sizes.inputs), size=len(arrivals))
        parts_t.append(arrivals)
        parts_in.append(sizes.inputs[pick])
        parts_out.append(sizes.outputs[pick])
        parts_client.append(np.full(len(arrivals), index, dtype=np.int64))

    arrivals = np.concatenate(parts_t) if parts_t else np.empty(0)
    order = np.argsort(arrivals, kind="stable")
    return _build(
        arrivals[order],
        np.concatenate(parts_in)[order],
        np.concatenate(parts_out)[order],
        np.concatenate(parts_client)[order],
        names,
    )


def summarise(requests: Iterable[TraceRequest]) -> TraceSummary:
    """Counts, rates and mean sizes of a list of requests (sorted or not)."""
    requests = list(requests)
    n = len(requests)
    if n == 0:
        return TraceSummary(0, 0.0, 0.0, 0.0, 0.0, 0.0, ())
    arrivals = np.sort(np.fromiter((r.arrival_s for r in requests), dtype=float, count=n))
    inputs = np.fromiter((r.input_tokens for r in requests), dtype=float, count=n)
    outputs = np.fromiter((r.output_tokens for r in requests), dtype=float, count=n)
    duration = float(arrivals[-1] - arrivals[0])
    # Busiest [t, t + 60 s) window: it starts at some arrival.
    in_window = np.searchsorted(arrivals, arrivals + 60.0, side="left") - np.arange(n)
    return TraceSummary(
        requests=n,
        duration_s=duration,
        mean_rate_req_per_s=n / duration if duration > 0 else 0.0,
        peak_rate_req_per_s_1min=float(in_window.max()) / 60.0,
        mean_input_tokens=float(inputs.mean()),
        mean_output_tokens=float(outputs.mean()),
        clients=tuple(sorted({r.client for r in requests})),
    )


def split_clients(
    requests: Iterable[TraceRequest], shares: Mapping[str, float], *, seed: int = 0
) -> list[TraceRequest]:
    """The requests dealt out to clients at random in the given shares (weights, normalised),
    each request keeping its time and sizes: a one-client trace such as Azure's becomes the
    demand of several customers with the same shape over time. Deterministic under `seed`."""
    names = list(shares)
    weights = np.asarray([shares[name] for name in names], dtype=float)
    if not names or (weights < 0).any() or not weights.sum() > 0:
        raise ValueError(f"shares must be non-negative with a positive sum, got {dict(shares)}")
    requests = list(requests)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(names), size=len(requests), p=weights / weights.sum())
    return [
        TraceRequest(r.arrival_s, r.input_tokens, r.output_tokens, names[pick])
        for r, pick in zip(requests, picks.tolist(), strict=True)
    ]


# --- CSV reading ------------------------------------------------------------------------------


class _CsvRows:
    """The header (lower-cased) and the non-blank data rows of a CSV file, with line numbers."""

    def __init__(self, path: str | Path):
        self.path = path
        try:
            with open(path, encoding="utf-8-sig", newline="") as handle:
                self.text = handle.read()
        except OSError as exc:
            raise TraceError(path, None, f"cannot read the file ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise TraceError(path, None, "not a UTF-8 text file") from None

    def header(self) -> list[str]:
        for _line, row in self._rows():
            return [cell.strip().lower() for cell in row]
        raise TraceError(self.path, 1, "empty file (expected a CSV header and rows)")

    def data(self) -> Iterator[tuple[int, list[str]]]:
        rows = self._rows()
        next(rows, None)
        return rows

    def _rows(self) -> Iterator[tuple[int, list[str]]]:
        reader = csv.reader(io.StringIO(self.text))
        try:
            for row in reader:
                if any(cell.strip() for cell in row):
                    yield reader.line_num, row
        except csv.Error as exc:
            raise TraceError(self.path, reader.line_num, f"malformed CSV ({exc})") from None


def _columns(
    path: str | Path,
    header: list[str],
    spec: Mapping[str, tuple[str, ...]],
    required: tuple[str, ...],
    accepted: str,
) -> dict[str, int]:
    """Map canonical column names to their positions; reject unknown, duplicate or missing ones."""
    lookup = {spelling: name for name, spellings in spec.items() for spelling in spellings}
    positions: dict[str, int] = {}
    for index, cell in enumerate(header):
        name = lookup.get(cell)
        if name is None:
            raise TraceError(
                path, 1, f"unknown column '{cell or '(blank)'}'; accepted columns: {accepted}"
            )
        if name in positions:
            raise TraceError(path, 1, f"column '{cell}' appears twice (as {name})")
        positions[name] = index
    missing = [name for name in required if name not in positions]
    if missing:
        raise TraceError(
            path, 1, f"missing column(s) {', '.join(missing)}; accepted columns: {accepted}"
        )
    return positions


def _fields(path: str | Path, line: int, row: list[str], width: int) -> list[str]:
    if len(row) != width:
        raise TraceError(path, line, f"expected {width} values, got {len(row)}")
    return [cell.strip() for cell in row]


def _number(path: str | Path, line: int, column: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(path, line, f"{column} '{text}' is not a number") from None
    if not math.isfinite(value):
        raise TraceError(path, line, f"{column} '{text}' is not a finite number")
    return value


def _tokens(path: str | Path, line: int, column: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        number = _number(path, line, column, text)
        if number != int(number):
            raise TraceError(path, line, f"{column} {text} is not a whole number") from None
        value = int(number)
    if value < 0:
        raise TraceError(path, line, f"{column} {text} is negative")
    return value


def _client(path: str | Path, line: int, text: str) -> str:
    if not text:
        raise TraceError(path, line, "client is blank")
    return text


# --- per-request traces -----------------------------------------------------------------------


@dataclass
class _Requests:
    arrivals: _Floats  # float seconds, non-decreasing
    inputs: _Ints
    outputs: _Ints
    client_idx: _Ints  # index into clients
    clients: list[str]


def _parse_request_trace(path: str | Path, *, require_timestamp: bool) -> _Requests:
    rows = _CsvRows(path)
    header = rows.header()
    required: tuple[str, ...] = ("input_tokens", "output_tokens")
    if require_timestamp:
        required = ("timestamp", *required)
    columns = _columns(path, header, REQUEST_COLUMNS, required, _REQUEST_ACCEPTED)
    width = len(header)
    ts_col = columns.get("timestamp")
    in_col, out_col = columns["input_tokens"], columns["output_tokens"]
    client_col = columns.get("client")
    ts_name = header[ts_col] if ts_col is not None else ""
    in_name, out_name = header[in_col], header[out_col]

    arrivals: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    client_idx: list[int] = []
    clients: dict[str, int] = {}
    kind = None  # "seconds" or "datetime", fixed by the first row
    first_dt: datetime | None = None
    previous_text = ""
    previous = -math.inf
    for line, row in rows.data():
        fields = _fields(path, line, row, width)
        if ts_col is not None:
            text = fields[ts_col]
            moment = None
            try:
                value = float(text)
                row_kind = "seconds"
            except ValueError:
                moment = _datetime(path, line, ts_name, text)
                row_kind = "datetime"
            if kind is None:
                kind = row_kind
            if row_kind != kind:
                raise TraceError(
                    path, line, f"{ts_name} '{text}' mixes {row_kind} with the {kind} above"
                )
            if moment is not None:
                if first_dt is None:
                    first_dt = moment
                if (moment.tzinfo is None) != (first_dt.tzinfo is None):
                    raise TraceError(
                        path, line, f"{ts_name} '{text}' mixes times with and without a time zone"
                    )
                value = (moment - first_dt).total_seconds()
            elif not math.isfinite(value):
                raise TraceError(path, line, f"{ts_name} '{text}' is not a finite number")
            if value < previous:
                raise TraceError(
                    path, line, f"timestamps go backwards ({text} after {previous_text})"
                )
            previous, previous_text = value, text
            arrivals.append(value)
        inputs.append(_tokens(path, line, in_name, fields[in_col]))
        outputs.append(_tokens(path, line, out_name, fields[out_col]))
        name = DEFAULT_CLIENT if client_col is None else _client(path, line, fields[client_col])
        client_idx.append(clients.setdefault(name, len(clients)))
    if not inputs:
        raise TraceError(path, 1, "the header has no rows under it")
    return _Requests(
        arrivals=np.asarray(arrivals, dtype=float),
        inputs=np.asarray(inputs, dtype=np.int64),
        outputs=np.asarray(outputs, dtype=np.int64),
        client_idx=np.asarray(client_idx, dtype=np.int64),
        clients=list(clients),
    )


def _datetime(path: str | Path, line: int, column: str, text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise TraceError(
            path, line, f"{column} '{text}' is neither seconds nor an ISO datetime"
        ) from None
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return moment


def _scale_requests(
    parsed: _Requests, scale: float, seed: int
) -> tuple[_Floats, _Ints, _Ints, _Ints]:
    arrivals, inputs, outputs, client_idx = (
        parsed.arrivals,
        parsed.inputs,
        parsed.outputs,
        parsed.client_idx,
    )
    if scale == 1.0:
        return arrivals, inputs, outputs, client_idx
    n = len(arrivals)
    rng = np.random.default_rng(seed)
    whole = math.floor(scale)
    copies = np.full(n, whole, dtype=np.int64)
    extra = round((scale - whole) * n)
    copies[rng.choice(n, size=extra, replace=False)] += 1
    index = np.repeat(np.arange(n), copies)
    # Rank of each appearance among its request's copies: 0 is the original arrival time.
    starts = np.cumsum(copies) - copies
    rank = np.arange(len(index)) - np.repeat(starts, copies)
    gaps = np.diff(arrivals, append=arrivals[-1])
    if n > 1:
        gaps = np.minimum(gaps, (arrivals[-1] - arrivals[0]) / (n - 1))
    jitter = rng.random(len(index)) * gaps[index]
    new_arrivals = arrivals[index] + np.where(rank > 0, jitter, 0.0)
    order = np.argsort(new_arrivals, kind="stable")
    index = index[order]
    return new_arrivals[order], inputs[index], outputs[index], client_idx[index]


# --- rate windows -----------------------------------------------------------------------------


@dataclass
class _Windows:
    starts: _Floats
    lengths: _Floats
    rates: _Floats
    cvs: _Floats


def _parse_windows(path: str | Path) -> dict[str, _Windows]:
    rows = _CsvRows(path)
    header = rows.header()
    columns = _columns(
        path, header, WINDOW_COLUMNS, ("window_start_s", "rate_req_per_s"), _WINDOW_ACCEPTED
    )
    width = len(header)
    # client -> list of (line, start, end or None, rate, cv), in file order
    per_client: dict[str, list[tuple[int, float, float | None, float, float]]] = {}
    for line, row in rows.data():
        fields = _fields(path, line, row, width)
        start = _number(path, line, "window_start_s", fields[columns["window_start_s"]])
        rate = _number(path, line, "rate_req_per_s", fields[columns["rate_req_per_s"]])
        if rate < 0:
            raise TraceError(path, line, f"rate_req_per_s {fields[columns['rate_req_per_s']]} < 0")
        cv = 1.0
        if "cv" in columns and fields[columns["cv"]]:
            cv = _number(path, line, "cv", fields[columns["cv"]])
            if cv < 0:
                raise TraceError(path, line, f"cv {fields[columns['cv']]} < 0")
        end = None
        if "window_end_s" in columns and fields[columns["window_end_s"]]:
            end = _number(path, line, "window_end_s", fields[columns["window_end_s"]])
            if end <= start:
                raise TraceError(
                    path, line, f"window_end_s {end:g} is not after window_start_s {start:g}"
                )
        client = DEFAULT_CLIENT
        if "client" in columns:
            client = _client(path, line, fields[columns["client"]])
        windows = per_client.setdefault(client, [])
        if windows:
            prev_line, prev_start, prev_end, _, _ = windows[-1]
            if start <= prev_start:
                raise TraceError(
                    path,
                    line,
                    f"windows out of order: client '{client}' window_start_s {start:g} is not "
                    f"after {prev_start:g} (line {prev_line})",
                )
            if prev_end is not None and prev_end > start:
                raise TraceError(
                    path,
                    prev_line,
                    f"window_end_s {prev_end:g} overlaps client '{client}''s next window, which "
                    f"starts at {start:g} (line {line})",
                )
        windows.append((line, start, end, rate, cv))
    if not per_client:
        raise TraceError(path, 1, "the header has no rows under it")

    result = {}
    for client, windows in per_client.items():
        lengths = []
        for i, (line, start, end, _, _) in enumerate(windows):
            if end is not None:
                lengths.append(end - start)
            elif i + 1 < len(windows):
                lengths.append(windows[i + 1][1] - start)
            elif i > 0:
                lengths.append(lengths[-1])
            else:
                raise TraceError(
                    path,
                    line,
                    f"client '{client}' has a single window and no window_end_s, so its length "
                    "is unknown",
                )
        result[client] = _Windows(
            starts=np.array([w[1] for w in windows]),
            lengths=np.array(lengths),
            rates=np.array([w[3] for w in windows]),
            cvs=np.array([w[4] for w in windows]),
        )
    return result


def _client_arrivals(windows: _Windows, scale: float, rng: np.random.Generator) -> _Floats:
    """Arrival times of one client: a renewal process per cv, mapped through the rate."""
    rates = windows.rates * scale
    parts = []
    for cv in np.unique(windows.cvs):
        mask = (windows.cvs == cv) & (rates > 0)
        if not mask.any():
            continue
        starts, lengths, group_rates = windows.starts[mask], windows.lengths[mask], rates[mask]
        op_lengths = group_rates * lengths
        op_ends = np.cumsum(op_lengths)
        points = _unit_renewal(rng, float(op_ends[-1]), float(cv))
        which = np.searchsorted(op_ends, points, side="right")
        which = np.minimum(which, len(op_ends) - 1)  # guards rounding at the very end
        offsets = points - (op_ends[which] - op_lengths[which])
        times = starts[which] + offsets / group_rates[which]
        parts.append(np.minimum(times, starts[which] + lengths[which]))
    if not parts:
        return np.empty(0)
    return np.sort(np.concatenate(parts))


def _unit_renewal(rng: np.random.Generator, total: float, cv: float) -> _Floats:
    """Points of a stationary unit-rate renewal process on [0, total); gamma gaps, shape 1/cv²."""
    if cv == 0.0:
        first = rng.random()
        return first + np.arange(max(0, math.ceil(total - first)), dtype=float)
    shape = 1.0 / (cv * cv)
    # Stationary start: the first gap is a uniform fraction of a length-biased gap.
    first = rng.random() * rng.gamma(shape + 1.0, 1.0 / shape)
    chunks = [np.array([first])]
    reached = first
    while reached < total:
        expected = total - reached
        size = int(expected + 6.0 * cv * math.sqrt(expected) + 64)
        gaps = rng.gamma(shape, 1.0 / shape, size=size)
        chunk = reached + np.cumsum(gaps)
        chunks.append(chunk)
        reached = float(chunk[-1])
    points = np.concatenate(chunks)
    return points[: np.searchsorted(points, total, side="left")]


# --- building the result ----------------------------------------------------------------------


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Building millions of small objects triggers many useless collections; pause them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _build(
    arrivals: _Floats, inputs: _Ints, outputs: _Ints, client_idx: _Ints, clients: list[str]
) -> list[TraceRequest]:
    if len(clients) == 1:
        client_list = [clients[0]] * len(arrivals)
    else:
        client_list = np.asarray(clients, dtype=object)[client_idx].tolist()
    with _gc_paused():
        return list(
            map(
                TraceRequest,
                np.asarray(arrivals, dtype=float).tolist(),
                np.asarray(inputs).tolist(),
                np.asarray(outputs).tolist(),
                client_list,
            )
        )


def _check_scale(path: str | Path, scale: float) -> None:
    try:
        valid = math.isfinite(float(scale)) and float(scale) > 0
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise TraceError(path, None, f"scale must be a finite number > 0, got {scale!r}")
