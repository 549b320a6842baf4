"""What a captured statement is, read from its text with PostgreSQL's lexical rules (pure, no server).

`current_query()` is the whole query string the client sent, which may hold several statements ("ALTER …;
UPDATE …;" in one simple query), or a call that ran the DDL inside a function (a DO block, a migration
procedure). Replaying such a string would run the rest of it again. So a string is replayed only when it is
provably one statement and that statement is the captured command itself: split at top-level semicolons the
way PostgreSQL's lexer sees them (quotes, E'' escapes, quoted identifiers, dollar quotes, nested comments),
and its first words must be the command tag the trigger saw. Anything else is not replayed (Error under
`exec`), never guessed at. Splitting is all the lexer does; the target's parser reads the statement itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import pairwise

_DOLLAR = re.compile(r"\$([A-Za-z_\x80-\uffff][A-Za-z_0-9\x80-\uffff]*)?\$")
_WORD = re.compile(r"[A-Za-z_\x80-\uffff][A-Za-z_0-9$\x80-\uffff]*")


class Unreadable(ValueError):
    """The text ends inside a quote or comment: not something to replay."""


def tokens(text: str):
    """(kind, start, end) of each lexical token that matters here: 'word', 'quoted' (an identifier),
    'string', ';', ',', '(', ')', '.', 'other'. Comments and white space are skipped."""
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch.isspace():
            i += 1
        elif text.startswith("--", i):
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while depth:
                if j >= n:
                    raise Unreadable("a comment is not closed")
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            i = j
        elif ch in "'" or (ch in "eE" and text.startswith("'", i + 1)):
            escapes = ch != "'"
            j = i + (2 if escapes else 1)
            while True:
                if j >= n:
                    raise Unreadable("a string is not closed")
                if escapes and text[j] == "\\":
                    j += 2
                elif text[j] == "'":
                    if text.startswith("'", j + 1):
                        j += 2
                    else:
                        break
                else:
                    j += 1
            yield "string", i, j + 1
            i = j + 1
        elif ch == '"':
            j = i + 1
            while True:
                j = text.find('"', j)
                if j < 0:
                    raise Unreadable("a quoted identifier is not closed")
                if text.startswith('"', j + 1):
                    j += 2
                else:
                    break
            yield "quoted", i, j + 1
            i = j + 1
        elif ch == "$" and (m := _DOLLAR.match(text, i)):
            end = text.find(m.group(0), m.end())
            if end < 0:
                raise Unreadable("a dollar-quoted string is not closed")
            yield "string", i, end + len(m.group(0))
            i = end + len(m.group(0))
        elif m := _WORD.match(text, i):
            yield "word", i, m.end()
            i = m.end()
        elif ch in ";,().":
            yield ch, i, i + 1
            i += 1
        else:
            yield "other", i, i + 1
            i += 1


def statements(text: str) -> list[str]:
    """The statements of a query string (text between top-level semicolons that holds a token)."""
    out, start, seen = [], 0, False
    for kind, s, e in tokens(text):
        if kind == ";":
            if seen:
                out.append(text[start:s].strip())
            start, seen = e, False
        else:
            if not seen:
                start = s
            seen = True
    if seen:
        out.append(text[start:].strip())
    return out


def words(text: str, n: int | None = None) -> list[str]:
    """The statement's leading unquoted words, upper-cased, up to the first other token."""
    out = []
    for kind, s, e in tokens(text):
        if kind != "word" or (n is not None and len(out) >= n):
            break
        out.append(text[s:e].upper())
    return out


@dataclass(frozen=True)
class Statement:
    text: str  # the one statement, as the source ran it
    # 'alter table', 'create index', 'drop index', 'create table', 'drop table', '{create,alter,drop} type',
    # '{create,alter,drop} sequence' (what exec replays) or 'other'
    kind: str
    adds_columns_only: bool = False  # ALTER TABLE whose every action is ADD [COLUMN]: what follows anyway
    concurrently: bool = False  # CREATE/DROP INDEX CONCURRENTLY
    # ALTER TABLE … RENAME TO: the table's name before (as written, its schema if it was written) and after
    renames_table: tuple[str | None, str, str] | None = None
    cascade: bool = False  # DROP TABLE … CASCADE
    adds_value: bool = False  # ALTER TYPE … ADD VALUE


class NotReplayable(ValueError):
    """The captured text is not one statement that is the captured command."""


def read(query: str, tag: str) -> Statement:
    """The one statement of `query` that ran the command `tag`, classified; NotReplayable otherwise."""
    try:
        found = statements(query)
    except Unreadable as exc:
        raise NotReplayable(f"its text cannot be read ({exc})") from None
    if len(found) != 1:
        raise NotReplayable(f"the query string the client sent holds {len(found)} statements, and Sluicegate "
                            f"replays only a string that is one statement")
    text = found[0]
    head = words(text, 5)
    tag_words = tag.upper().split()
    # CREATE [UNIQUE] INDEX: the tag has no UNIQUE
    compared = [w for w in head if w != "UNIQUE"] if tag_words == ["CREATE", "INDEX"] else head
    if compared[:len(tag_words)] != tag_words:
        raise NotReplayable(f"the query string ({' '.join(head[:3]) or 'no command'} …) is not the {tag} "
                            f"statement itself (it ran the command inside a function or block)")
    if tag_words == ["ALTER", "TABLE"]:
        return Statement(text, "alter table", adds_columns_only=_adds_columns_only(text),
                         renames_table=_renames_table(text))
    if tag_words in (["CREATE", "TABLE"], ["DROP", "TABLE"]):
        last = [text[s:e].upper() for kind, s, e in tokens(text) if kind == "word"][-1:]
        return Statement(text, " ".join(tag_words).lower(), cascade=last == ["CASCADE"])
    if tag_words in (["CREATE", "INDEX"], ["DROP", "INDEX"]):
        return Statement(text, " ".join(tag_words).lower(), concurrently="CONCURRENTLY" in head)
    if tag_words[1:] in (["TYPE"], ["SEQUENCE"]) and tag_words[0] in ("CREATE", "ALTER", "DROP"):
        return Statement(text, " ".join(tag_words).lower(), adds_value=tag_words == ["ALTER", "TYPE"]
                         and _adds_value(text))
    return Statement(text, "other")


def _adds_value(text: str) -> bool:
    """ALTER TYPE name ADD VALUE …: a new enum label, which the transaction that adds it cannot use."""
    found = [text[s:e].upper() for kind, s, e in tokens(text) if kind == "word"]
    return any(a == "ADD" and b == "VALUE" for a, b in pairwise(found))


def _adds_columns_only(text: str) -> bool:
    """ALTER TABLE [IF EXISTS] [ONLY] name [*] ADD [COLUMN] …, ADD [COLUMN] …: every action adds a column.
    False when unsure."""
    for action in alter_actions(text):
        first = [w for w, _ in action[:2]]
        if not first or first[0] != "ADD":
            return False
        # ADD "Col" type: a column named by a quoted identifier (not a word, yet no constraint)
        if (first[1:] and first[1] in ("CONSTRAINT", "PRIMARY", "UNIQUE", "CHECK", "FOREIGN", "EXCLUDE", None)
                and action[1][1] != "quoted"):
            return False
    return True


def alter_actions(text: str) -> list[list[tuple[str | None, str]]]:
    """The actions of an ALTER TABLE statement (split at top-level commas, past the table's name), each as
    its tokens: (the word upper-cased, or None for any other token; the token's kind)."""
    toks = list(tokens(text))
    actions, depth, current = [], 0, []
    i = 2  # past ALTER TABLE
    word = lambda t: text[t[1]:t[2]].upper() if t[0] == "word" else None
    while i < len(toks) and word(toks[i]) in ("IF", "EXISTS", "ONLY"):
        i += 1
    # the name: identifiers separated by dots, then an optional *
    i += 1
    while i + 1 < len(toks) and toks[i][0] == ".":
        i += 2
    if i < len(toks) and text[toks[i][1]:toks[i][2]] == "*":
        i += 1
    for t in toks[i:]:
        if t[0] == "(":
            depth += 1
        elif t[0] == ")":
            depth -= 1
        if t[0] == "," and depth == 0:
            actions.append(current)
            current = []
        else:
            current.append((word(t), t[0]))
    actions.append(current)
    return actions


def _name(toks: list, text: str, i: int) -> tuple[list[str], int]:
    """The dotted name starting at token i: its parts (quoted identifiers unquoted, words folded to lower
    case, as PostgreSQL reads them) and the index past it."""
    parts = []
    while i < len(toks):
        kind, s, e = toks[i]
        if kind == "word":
            parts.append(text[s:e].lower())
        elif kind == "quoted":
            parts.append(text[s + 1:e - 1].replace('""', '"'))
        else:
            break
        i += 1
        if i < len(toks) and toks[i][0] == ".":
            i += 1
        else:
            break
    return parts, i


def _renames_table(text: str) -> tuple[str | None, str, str] | None:
    """ALTER TABLE [IF EXISTS] [ONLY] name [*] RENAME TO new: (schema or None, name, new); None for any other
    ALTER TABLE (RENAME COLUMN, RENAME CONSTRAINT included)."""
    toks = list(tokens(text))
    word = lambda j: text[toks[j][1]:toks[j][2]].upper() if j < len(toks) and toks[j][0] == "word" else None
    i = 2
    while word(i) in ("IF", "EXISTS", "ONLY"):
        i += 1
    old, i = _name(toks, text, i)
    if i < len(toks) and text[toks[i][1]:toks[i][2]] == "*":
        i += 1
    if not old or len(old) > 3 or word(i) != "RENAME" or word(i + 1) != "TO":
        return None
    new, end = _name(toks, text, i + 2)
    if len(new) != 1 or end != len(toks):
        return None
    return (old[-2] if len(old) >= 2 else None), old[-1], new[0]


def without_concurrently(text: str) -> str:
    """The statement with its CONCURRENTLY keyword removed (it leads the statement: CREATE [UNIQUE] INDEX
    CONCURRENTLY …, DROP INDEX CONCURRENTLY …)."""
    for kind, s, e in tokens(text):
        if kind != "word":
            break
        if text[s:e].upper() == "CONCURRENTLY":
            return text[:s] + text[e:].lstrip()
    return text
