"""Rules as the user writes them: `TARGET: SELECT … FROM SOURCE [WHERE …]` (pure, no Spark).

Like a Vitess Materialize rule, the part before the colon names the target table and the SELECT reads the
source table in its FROM. A TARGET with glob characters (`orders_*`, `*`) is a Match pattern over the
source tables instead: each match keeps its name, and the FROM names the pattern (in backquotes).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from ..errors import UsageError

_SELECT = re.compile(r"\s*SELECT\b", re.IGNORECASE)
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class RuleSpec:
    target: str  # target table name, or a glob over source table names
    select: str  # the Spark SQL SELECT

    @property
    def is_pattern(self) -> bool:
        return bool(_GLOB.search(self.target))

    def matches(self, schema: str, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.target) or fnmatch.fnmatchcase(f"{schema}.{name}", self.target)

    @property
    def label(self) -> str:
        """How messages name the rule: its target."""
        return repr(self.target)

    def to_text(self) -> str:
        return f"{self.target}: {self.select}"


def parse_rule(text: str) -> RuleSpec:
    target, colon, select = text.partition(":")
    target, select = target.strip(), select.strip()
    if not colon or not target or not select:
        raise UsageError(f"rule {text!r} is not 'TABLE: SELECT … FROM source_table [WHERE …]'")
    if not _SELECT.match(select):
        raise UsageError(f"rule {target!r}: a rule is one SELECT … FROM source_table [WHERE …], got {select[:40]!r}")
    return RuleSpec(target, select)


def parse_rules(texts: list[str]) -> list[RuleSpec]:
    specs = [parse_rule(t) for t in texts]
    seen: set[str] = set()
    for s in specs:
        if s.target in seen:
            raise UsageError(f"two rules for {s.target!r}: give each target table one rule")
        seen.add(s.target)
    return specs


def wrap_select(select: str, extra: list[str]) -> str:
    """The user's SELECT with hidden columns put first in its select list (they carry the source's own text)."""
    m = _SELECT.match(select)
    assert m is not None  # parse_rule checked it
    return f"{select[:m.end()]} {', '.join(extra)}, {select[m.end():].lstrip()}"


def load_rules_file(path: str) -> list[str]:
    """Rules from a YAML file: `rules:` a list of 'TARGET: SELECT …' strings or {target:, select:} maps."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"rules file {path}: {' '.join(str(exc).split())}") from None
    items = doc.get("rules") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items:
        raise UsageError(f"rules file {path}: expected a list of rules under `rules:`")
    texts = []
    for i, item in enumerate(items, 1):
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, dict) and set(item) == {"target", "select"}:
            texts.append(f"{item['target']}: {item['select']}")
        elif isinstance(item, dict) and len(item) == 1:  # `- items_eu: SELECT …` reads as a one-key map
            (target, select), = item.items()
            texts.append(f"{target}: {select}")
        else:
            raise UsageError(f"rules file {path}: rule {i} is neither 'TARGET: SELECT …' nor {{target:, select:}}")
    return texts
