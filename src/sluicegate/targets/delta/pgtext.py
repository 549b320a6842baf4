"""Parsers of PostgreSQL's text output forms (pure): arrays, composites, hstore, ranges and multiranges,
intervals, and dates and timestamps as the days and microseconds since 1970-01-01 they stand for.

The text is what the type's output function writes under Sluicegate's session settings (DateStyle ISO,
TimeZone UTC, IntervalStyle postgres: postgres/connect.py), which is what the copy reads and what pgoutput
sends (the walsender runs with the same options). Intervals are also read in the iso_8601 style.
A value these forms can hold but the Arrow type cannot raises `Unrepresentable`; malformed text ValueError.
"""

from __future__ import annotations

import re


class Unrepresentable(ValueError):
    """A well-formed value that the column's Arrow type cannot hold (NaN in a decimal, array bounds, ...)."""


INFINITY, NEG_INFINITY = "infinity", "-infinity"


# --- arrays -----------------------------------------------------------------------------------------------------

def parse_array(text: str, delim: str = ",") -> tuple[list, int]:
    """'{1,NULL,"a \\"b\\""}' -> (['1', None, 'a "b"'], 1): the elements' texts (None for NULL) nested as the
    array's dimensions, and the number of dimensions (0 for '{}'). Arrays whose lower bounds are not all 1
    ('[0:1]={1,2}') raise Unrepresentable: a list has no place for the bounds."""
    if text.startswith("["):
        raise Unrepresentable(f"array with explicit bounds {text.partition('=')[0]}")
    if not text.startswith("{"):
        raise ValueError(f"not an array: {text[:40]!r}")
    if '"' not in text and "\\" not in text and text.rfind("{") == 0 and text.find("}") == len(text) - 1:
        # one dimension, nothing quoted (the common case): a split ("NULL" unquoted is always NULL)
        if len(text) == 2:
            return [], 0
        return [None if v == "NULL" else v for v in text[1:-1].split(delim)], 1
    value, end, dims = _array_level(text, 0, delim)
    if end != len(text):
        raise ValueError(f"trailing text after array: {text[end:end + 20]!r}")
    return value, dims


def _array_level(text: str, i: int, delim: str) -> tuple[list, int, int]:
    """The array level starting at text[i] == '{': (items, index after its '}', dimensions)."""
    i += 1
    items: list = []
    dims = 1
    if text.startswith("}", i):
        return items, i + 1, 0
    while True:
        if text.startswith("{", i):
            sub, i, sub_dims = _array_level(text, i, delim)
            items.append(sub)
            dims = max(dims, sub_dims + 1)
        elif text.startswith('"', i):
            item, i = _quoted(text, i)
            items.append(item)
        else:
            j = i
            while j < len(text) and text[j] not in (delim, "}"):
                j += 1
            raw = text[i:j].strip()
            items.append(None if raw.upper() == "NULL" else raw)
            i = j
        if i >= len(text):
            raise ValueError("unterminated array")
        if text[i] == "}":
            return items, i + 1, dims
        if text[i] != delim:
            raise ValueError(f"unexpected {text[i]!r} in array at {i}")
        i += 1


_QUOTED = re.compile(r'"((?:[^"\\]|\\.|"")*)"', re.DOTALL)
_UNESCAPE = re.compile(r'\\(.)|""', re.DOTALL)


def _quoted(text: str, i: int) -> tuple[str, int]:
    """A double-quoted element at text[i]: backslash escapes the next character (array, hstore, range
    output), "" is one quote (composite and range output). Returns (text, index after the closing quote)."""
    m = _QUOTED.match(text, i)
    if m is None:
        raise ValueError("unterminated quoted value")
    body = m.group(1)
    if "\\" in body or '""' in body:
        body = _UNESCAPE.sub(lambda e: e.group(1) or '"', body)
    return body, m.end()


# --- composites -------------------------------------------------------------------------------------------------

def parse_composite(text: str) -> list[str | None]:
    """'(1,"a b",,"")' -> ['1', 'a b', None, '']: an unquoted empty field is NULL, "" the empty string."""
    if not (text.startswith("(") and text.endswith(")")):
        raise ValueError(f"not a composite value: {text[:40]!r}")
    if '"' not in text and "\\" not in text:  # nothing quoted: a split
        return [v or None for v in text[1:-1].split(",")]
    fields: list[str | None] = []
    i, end = 1, len(text) - 1
    while True:
        value, i = _field(text, i, end, ",")
        fields.append(value)
        if i >= end:
            return fields
        i += 1


# --- hstore -----------------------------------------------------------------------------------------------------

def parse_hstore(text: str) -> list[tuple[str, str | None]]:
    """'"a"=>"1", "b"=>NULL' -> [('a', '1'), ('b', None)], in the value's order."""
    pairs: list[tuple[str, str | None]] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in " ,":
            i += 1
        if i >= n:
            return pairs
        key, i = _hstore_token(text, i)
        if key is None:
            raise ValueError("hstore key is NULL")
        if not text.startswith("=>", i):
            raise ValueError(f"expected => in hstore at {i}")
        i += 2
        value, i = _hstore_token(text, i)
        pairs.append((key, value))


def _hstore_token(text: str, i: int) -> tuple[str | None, int]:
    if text.startswith('"', i):
        return _quoted(text, i)
    j = i
    while j < len(text) and text[j] not in ",=" and not text[j].isspace():
        j += 1
    raw = text[i:j]
    return (None if raw.upper() == "NULL" else raw), j


# --- ranges -----------------------------------------------------------------------------------------------------

def parse_range(text: str) -> tuple[str | None, str | None, bool, bool, bool]:
    """'[1,5)' -> ('1', '5', True, False, False); 'empty' -> (None, None, False, False, True); an omitted
    (infinite) bound is None. Returns (lower, upper, lower_inclusive, upper_inclusive, empty)."""
    value, end = _range_at(text, 0)
    if end != len(text):
        raise ValueError(f"trailing text after range: {text[end:end + 20]!r}")
    return value


def _range_at(text: str, i: int):
    if text.startswith("empty", i):
        return (None, None, False, False, True), i + 5
    if i >= len(text) or text[i] not in "[(":
        raise ValueError(f"not a range: {text[i:i + 40]!r}")
    lower_inc = text[i] == "["
    lower, i = _field(text, i + 1, len(text), ",)]")
    if i >= len(text) or text[i] != ",":
        raise ValueError("range without ','")
    upper, i = _field(text, i + 1, len(text), ",)]")
    if i >= len(text) or text[i] not in ")]":
        raise ValueError("unterminated range")
    return (lower, upper, lower_inc, text[i] == "]", False), i + 1


def _field(text: str, i: int, end: int, stops: str) -> tuple[str | None, int]:
    """A composite attribute or a range bound from text[i] up to one of `stops` (or `end`): quoted parts and
    backslash escapes read as PostgreSQL writes them; nothing at all (not even "") is NULL. (value, where it
    stopped)."""
    buf, quoted = [], False
    while i < end and text[i] not in stops:
        if text[i] == '"':
            part, i = _quoted(text, i)
            buf.append(part)
            quoted = True
        elif text[i] == "\\":
            buf.append(text[i + 1])
            i += 2
        else:
            buf.append(text[i])
            i += 1
    return ("".join(buf) if buf or quoted else None), i


def parse_multirange(text: str) -> list[tuple[str | None, str | None, bool, bool, bool]]:
    """'{[1,3),[5,7)}' -> the ranges in order; '{}' -> []."""
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"not a multirange: {text[:40]!r}")
    out = []
    i, end = 1, len(text) - 1
    while i < end:
        value, i = _range_at(text, i)
        out.append(value)
        while i < end and text[i] in ", ":
            i += 1
    return out


# --- intervals --------------------------------------------------------------------------------------------------

_UNITS = {"year": 12, "years": 12, "mon": 1, "mons": 1, "day": 0, "days": 0}
_TIME = re.compile(r"([+-]?)(\d+):(\d+):(\d+)(?:\.(\d+))?$")
_ISO = re.compile(r"P(?:(-?\d+)Y)?(?:(-?\d+)M)?(?:(-?\d+)D)?"
                  r"(?:T(?:(-?\d+)H)?(?:(-?\d+)M)?(?:(-?\d+(?:\.\d+)?)S)?)?$")
US = 1_000_000


def _fraction_micros(digits: str | None) -> int:
    return int(((digits or "") + "000000")[:6])


def _seconds_micros(text: str) -> int:
    sign = -1 if text.startswith("-") else 1
    whole, _, frac = text.lstrip("+-").partition(".")
    return sign * (int(whole) * US + _fraction_micros(frac))


def parse_interval(text: str) -> tuple[int, int, int]:
    """An interval's text in the postgres ('1 year 2 mons -3 days +04:05:06.5') or iso_8601
    ('P1Y2M-3DT4H5M6.5S') style -> (months, days, microseconds), PostgreSQL's own three fields."""
    if text.startswith("P"):
        m = _ISO.match(text)
        if m is None:
            raise ValueError(f"not an ISO 8601 interval: {text!r}")
        y, mo, d, h, mi, s = m.groups()
        months = int(y or 0) * 12 + int(mo or 0)
        micros = int(h or 0) * 3600 * US + int(mi or 0) * 60 * US + (_seconds_micros(s) if s else 0)
        return months, int(d or 0), micros
    months = days = micros = 0
    tokens = text.split()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        t = _TIME.match(tok)
        if t:
            sign = -1 if t.group(1) == "-" else 1
            micros += sign * ((int(t.group(2)) * 3600 + int(t.group(3)) * 60 + int(t.group(4))) * US
                              + _fraction_micros(t.group(5)))
            i += 1
            continue
        if i + 1 >= len(tokens) or tokens[i + 1] not in _UNITS:
            raise ValueError(f"not an interval in the postgres style: {text!r}")
        n, unit = int(tok), tokens[i + 1]
        if _UNITS[unit]:
            months += n * _UNITS[unit]
        else:
            days += n
        i += 2
    return months, days, micros


# --- dates and timestamps ---------------------------------------------------------------------------------------

def days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date, astronomical year numbering (year 0 = 1 BC),
    as PostgreSQL counts them."""
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    mp = (month + 9) % 12
    doy = (153 * mp + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


_DATE = re.compile(r"(\d+)-(\d\d)-(\d\d)")
_TS = re.compile(r"(\d+)-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d+))?"
                 r"(?:([+-])(\d\d)(?::?(\d\d))?(?::(\d\d))?)?( BC)?$")


def parse_date(text: str) -> int | str:
    """'2024-01-02', '0044-03-15 BC', '12000-01-01' -> days since 1970-01-01; 'infinity'/'-infinity' as such."""
    if text in (INFINITY, NEG_INFINITY):
        return text
    bc = text.endswith(" BC")
    m = _DATE.fullmatch(text[:-3] if bc else text)
    if m is None:
        raise ValueError(f"not an ISO date: {text!r}")
    year = int(m.group(1))
    return days_from_civil(1 - year if bc else year, int(m.group(2)), int(m.group(3)))


def parse_timestamp(text: str) -> int | str:
    """'2024-01-02 03:04:05.5', '…+00' (timestamptz), '… BC', years past 9999 -> microseconds since
    1970-01-01 00:00 UTC (a zone offset is applied); 'infinity'/'-infinity' as such."""
    if text in (INFINITY, NEG_INFINITY):
        return text
    m = _TS.match(text)
    if m is None:
        raise ValueError(f"not an ISO timestamp: {text!r}")
    year, mon, day, hh, mi, ss, frac, sign, oh, om, os_, bc = m.groups()
    year = int(year)
    days = days_from_civil(1 - year if bc else year, int(mon), int(day))
    micros = (days * 86400 + int(hh) * 3600 + int(mi) * 60 + int(ss)) * US + _fraction_micros(frac)
    if sign:
        offset = (int(oh) * 3600 + int(om or 0) * 60 + int(os_ or 0)) * US
        micros -= offset if sign == "+" else -offset
    return micros
