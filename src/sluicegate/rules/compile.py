"""Checking a rule against its source table with Spark's own analyzer, before anything starts.

Spark resolves the SELECT over an empty, typed view of the source table, so an unknown column, a type
error or a function that does not exist fails here with Spark's message (and its suggestions). Then the
analyzed plan must be a projection and a filter over that one table — the shape that can run the same in a
bulk copy and in a stream of single-row changes — deterministic, and keep the source's key unchanged
(renaming it is fine): the key is how a later update or delete finds its row on the target.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..errors import UsageError
from ..postgres.catalog import Column, Table
from ..sharding.keyrange import KeyRange
from . import types
from . import udfs as python_udfs
from .spec import RuleSpec, wrap_select

RAW = "__sg_raw_{}"  # the source's text of column i, beside the typed columns a rule reads
OUT = "__sg_out_{}"  # the same, first in a rule's output


@dataclass(frozen=True)
class CompiledRule:
    """A validated rule for one source table: what to run, and how its output lands in the target table."""

    rule: str  # the rule as written, for messages
    source: Table
    target: Table
    select: str  # the user's SELECT
    view: str  # the name its FROM uses: the typed source rows are registered under it
    outputs: tuple[tuple[str, object], ...]  # per target column: ("raw", source column index) | ("expr", name)
    needs: tuple[int, ...]  # source columns that computed columns or the filter read
    keyrange: tuple[int, str, str] | None = None  # a shard's rows only: (sharding column, lo, hi), see sharding/
    udfs: tuple[tuple[str, str], ...] = ()  # Python functions the rule may call (udfs.py)
    filtered: bool = True  # the rule has a WHERE

    @property
    def moves_only(self) -> bool:
        """Columns passed through (maybe renamed or dropped), no WHERE: nothing for Spark to compute per row
        (a key range, if any, is md5 of the sharding column's text: the same in Python)."""
        return not self.filtered and all(kind == "raw" for kind, _ in self.outputs)

    def with_keyrange(self, column: int, lo: str, hi: str) -> CompiledRule:
        return replace(self, keyrange=(column, lo, hi), needs=tuple(sorted({*self.needs, column})))

    def target_keyrange(self):
        """SQL for "this target row is in the rule's key range" (None without one): what one stream of
        several writing the same target table may clear as its own."""
        if self.keyrange is None:
            return None

        column, lo, hi = self.keyrange
        name = next(self.target.columns[j].name for j, o in enumerate(self.outputs) if o == ("raw", column))
        return KeyRange(lo, hi).pg_filter(name)

    @property
    def runtime_select(self) -> str:
        """The SELECT with the source's text of every column first (by position), then the rule's columns."""
        # aliased: a `SELECT *` in the rule brings the view's raw columns too, and names must stay unique
        return wrap_select(self.select, [f"{RAW.format(i)} AS {OUT.format(i)}" for i in range(len(self.source.columns))])

    def typed_view_sql(self, raw_view: str, extra: list[str] | tuple = (), in_range: bool = True) -> str:
        """The typed columns, the raw ones and `extra` over `raw_view`; only a shard's rows with `in_range`
        (replicate wants every change: it keeps the key range as a column, evaluate.transform_changes)."""
        cols = [f"{types.spark_expr(c, RAW.format(i))} AS {quote(c.name)}" for i, c in enumerate(self.source.columns)]
        raws = [RAW.format(i) for i in range(len(self.source.columns))]
        where = ""
        if self.keyrange is not None and in_range:  # on the source's text of the sharding column, as PostgreSQL would hash it
            column, lo, hi = self.keyrange
            where = f" WHERE {KeyRange(lo, hi).spark_filter(RAW.format(column))}"
        return f"SELECT {', '.join(cols + raws + list(extra))} FROM {quote(raw_view)}{where}"

    def to_json(self) -> dict:
        return {"rule": self.rule, "target": self.target.to_json(), "select": self.select, "view": self.view,
                "outputs": [list(o) for o in self.outputs], "needs": list(self.needs),
                "keyrange": list(self.keyrange) if self.keyrange else None, "udfs": [list(u) for u in self.udfs],
                "filtered": self.filtered}

    @classmethod
    def from_json(cls, d: dict, source: Table) -> CompiledRule:
        return cls(d["rule"], source, Table.from_json(d["target"]), d["select"], d["view"],
                   tuple((k, v) for k, v in d["outputs"]), tuple(d["needs"]),
                   tuple(d["keyrange"]) if d.get("keyrange") else None,
                   tuple((n, r) for n, r in d.get("udfs", [])), d.get("filtered", True))


def quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def raw_schema(source: Table):
    from pyspark.sql.types import StringType, StructField, StructType

    return StructType([StructField(RAW.format(i), StringType()) for i in range(len(source.columns))])


def rule_session(spark, udfs: dict | None = None):
    """A session of its own per rule: its view names cannot collide with another rule's; times in UTC."""
    session = spark.newSession()
    session.conf.set("spark.sql.session.timeZone", "UTC")
    python_udfs.register(session, udfs or {})
    return session


def from_name(spark, spec: RuleSpec) -> str:
    """The one table the rule's FROM names (unqualified)."""
    try:
        plan = spark._jsparkSession.sessionState().sqlParser().parsePlan(spec.select)
    except Exception as exc:  # noqa: BLE001 - py4j wraps Spark's ParseException
        raise UsageError(f"rule {spec.label}: {_first_line(exc)}") from None
    names = []
    for leaf in _seq(plan.collectLeaves()):
        if leaf.nodeName() == "UnresolvedRelation":
            names.append(list(_seq(leaf.multipartIdentifier())))
    if len(names) != 1:
        raise UsageError(f"rule {spec.label}: a rule reads exactly one source table in its FROM "
                         f"(found {len(names)})")
    return ".".join(names[0])


def compile_rule(spark, spec: RuleSpec, source: Table, view: str, target_schema: str, target_name: str,
                 udfs: dict | None = None) -> CompiledRule:
    session = rule_session(spark, udfs)
    empty = session.createDataFrame([], raw_schema(source))
    empty.createOrReplaceTempView("__sg_raw")
    # The view a rule reads: typed columns only (raw ones are added at run time), so `*` means the table.
    typed = [f"{types.spark_expr(c, RAW.format(i))} AS {quote(c.name)}" for i, c in enumerate(source.columns)]
    session.sql(f"SELECT {', '.join(typed)} FROM __sg_raw").createOrReplaceTempView(quote(view))
    try:
        df = session.sql(spec.select)
        plan = df._jdf.queryExecution().analyzed()
    except Exception as exc:  # noqa: BLE001 - Spark's AnalysisException, through py4j or PySpark
        raise UsageError(f"rule {spec.label}: {_first_line(exc)}") from None
    project, condition = _shape(spec, plan)
    outputs, needs, columns = [], set(), []
    names = [c.name for c in source.columns]
    fields = {f.name: f for f in df.schema.fields}
    seen: set[str] = set()
    for e in _seq(project.projectList()):
        out = e.name()
        if out in seen:
            raise UsageError(f"rule {spec.label}: two columns are named {out!r}: give each a distinct alias")
        if out.startswith("__sg_"):
            raise UsageError(f"rule {spec.label}: column names starting with __sg_ are Sluicegate's own: rename {out!r}")
        seen.add(out)
        ref = _plain_reference(e)
        if ref is not None and ref in names:
            i = names.index(ref)
            src_col = source.columns[i]
            outputs.append(("raw", i))
            columns.append(Column(out, src_col.type_sql, src_col.type_oid, src_col.not_null, src_col.collation))
            continue
        if not e.deterministic():
            raise UsageError(f"rule {spec.label}: column {out!r} is not deterministic ({_sql(e)}): the copy and "
                             f"the stream would compute different values; use a deterministic expression")
        _refuse_implicit_text_casts(spark, spec, out, e, source)
        spark_type = fields[out].dataType.simpleString()
        pg = types.pg_type(spark_type)
        if pg is None:
            raise UsageError(f"rule {spec.label}: column {out!r} has Spark type {spark_type}, which has no "
                             f"PostgreSQL column type here: CAST it (to STRING, say)")
        needs.update(names.index(r) for r in _references(e) if r in names)
        outputs.append(("expr", out))
        columns.append(Column(out, pg, 0, False, None))
    if condition is not None:
        if not condition.deterministic():
            raise UsageError(f"rule {spec.label}: its WHERE is not deterministic ({_sql(condition)}): the copy "
                             f"and the stream would keep different rows")
        needs.update(names.index(r) for r in _references(condition) if r in names)
    if source.keyless:
        raise UsageError(f"rule {spec.label}: source table {source.qualified} has no primary key (REPLICA IDENTITY "
                         f"FULL); a rule's target finds rows by the source's key: move the table without a rule, "
                         f"or add a primary key on the source")
    key = []
    for k in source.key:
        i = names.index(k)
        hits = [columns[j].name for j, o in enumerate(outputs) if o == ("raw", i)]
        if not hits:
            raise UsageError(f"rule {spec.label}: the SELECT must keep key column {k!r} of {source.qualified} "
                             f"unchanged (renaming it is fine): the target finds rows by it")
        key.append(hits[0])
    columns = [Column(c.name, c.type_sql, c.type_oid, c.not_null or c.name in key, c.collation) for c in columns]
    # the source's user types and extensions: a column passed through keeps its type on the target
    target = Table(target_schema, target_name, tuple(columns), tuple(key), source.enums, source.estimated_rows,
                   source.types, source.extensions, source.existing_types)
    return CompiledRule(spec.to_text(), source, target, spec.select, view, tuple(outputs), tuple(sorted(needs)),
                        udfs=tuple(sorted((udfs or {}).items())), filtered=condition is not None)


# -- the analyzed plan, through py4j ----------------------------------------------------------------------
_REFUSED = {
    "Aggregate": "aggregations (GROUP BY, count(), sum()…) are not supported in a streaming copy",
    "Distinct": "DISTINCT is not supported in a streaming copy", "Deduplicate": "DISTINCT is not supported in a streaming copy",
    "Window": "window functions are not supported in a streaming copy",
    "Sort": "ORDER BY has no meaning for a table copy: leave it out",
    "GlobalLimit": "LIMIT is not supported in a streaming copy", "LocalLimit": "LIMIT is not supported in a streaming copy",
    "Join": "a rule reads one table: joins are not supported",
    "Union": "a rule reads one table: UNION is not supported",
    "Generate": "explode() and other generators change the row count: not supported",
}


def _shape(spec: RuleSpec, plan):
    """(Project, filter condition or None) of `SELECT … FROM view [WHERE …]`, or a clear refusal."""
    node, project, condition = plan, None, None
    while True:
        name = node.nodeName()
        if name in _REFUSED:
            raise UsageError(f"rule {spec.label}: {_REFUSED[name]}")
        if name == "Project" and project is None and condition is None:
            project = node
        elif name == "Filter" and condition is None and project is not None:
            condition = node.condition()
            if _has_subquery(condition):
                raise UsageError(f"rule {spec.label}: subqueries in WHERE are not supported: a rule reads one table")
        elif name in ("SubqueryAlias", "View"):
            return project, condition
        else:
            raise UsageError(f"rule {spec.label}: only SELECT columns FROM table [WHERE condition] is supported "
                             f"(the plan has {name})")
        children = list(_seq(node.children()))
        if len(children) != 1:
            raise UsageError(f"rule {spec.label}: a rule reads one table")
        node = children[0]


def _refuse_implicit_text_casts(spark, spec: RuleSpec, out: str, e, source: Table) -> None:
    """A column computed from a source column that Spark holds as text (an unconstrained numeric, a text
    column), which Spark's type coercion casts to a number (`total * qty`: total to BIGINT) without the rule
    saying so: the cast fails at run time on the first value it cannot take ('12.50'). Refused at create,
    with the explicit CAST that holds the values (a CAST the rule writes is the user's decision)."""
    tag = spark._jvm.org.apache.spark.sql.catalyst.expressions.Cast.USER_SPECIFIED_CAST()
    by_name = {c.name: c for c in source.columns}
    for cast in _nodes(e, "Cast"):
        child = cast.child()
        if cast.getTagValue(tag).isDefined() or child.dataType().simpleString() != "string":
            continue
        to = cast.dataType().simpleString()
        if to == "string" or not _references(child):
            continue
        name = _references(child)[0]
        column = by_name.get(name)
        what = child.name() if child.getClass().getSimpleName() == "AttributeReference" else _sql(child)
        to = to.upper()
        if column is not None and column.type_sql == "numeric":
            origin = f"numeric column {name!r}, which Spark reads as text (no precision declared),"
            fix = (f"Write CAST({what} AS DECIMAL(38,10)) in the rule (a precision and scale that hold its "
                   f"values), or declare {name} numeric(p,s) on the source")
        else:
            origin = f"{what}, text in Spark,"
            fix = (f"Write CAST({what} AS {to}) in the rule if every value is one, or try_cast({what} AS {to}) "
                   f"for NULL where it is not")
        raise UsageError(f"rule {spec.label}: column {out!r} casts {origin} to {to} implicitly, which fails at "
                         f"run time on the first value it cannot hold (as '12.50' cannot be a {to}). {fix}")


def _nodes(e, kind: str):
    if e.getClass().getSimpleName() == kind:
        yield e
    for c in _seq(e.children()):
        yield from _nodes(c, kind)


def _has_subquery(e) -> bool:
    if "Subquery" in e.getClass().getSimpleName() or e.getClass().getSimpleName() in ("ListQuery", "Exists"):
        return True
    return any(_has_subquery(c) for c in _seq(e.children()))


def _plain_reference(e) -> str | None:
    """The source column an output passes through unchanged (`col` or `col AS other`), else None."""
    kind = e.getClass().getSimpleName()
    if kind == "AttributeReference":
        return e.name()
    if kind == "Alias" and e.child().getClass().getSimpleName() == "AttributeReference":
        return e.child().name()
    return None


def _references(e) -> list[str]:
    return [a.name() for a in _seq(e.references().toSeq())]


def _sql(e) -> str:
    try:
        return e.sql()
    except Exception:  # noqa: BLE001 - not every expression renders as SQL
        return e.toString()


def _seq(scala_seq):
    it = scala_seq.iterator()
    while it.hasNext():
        yield it.next()


def _first_line(exc: BaseException) -> str:
    text = getattr(exc, "getMessage", None)
    msg = text() if callable(text) else str(exc)
    lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()]
    return re.sub(r"\s*SQLSTATE: \w+;?.*$", "", lines[0]) if lines else type(exc).__name__


# -- a rule's WHERE as a column, for replicate ------------------------------------------------------------
_FROM_TAIL = re.compile(r"\bFROM\s*$", re.IGNORECASE)
_WHERE_HEAD = re.compile(r"^(?:\s|/\*.*?\*/|--[^\n]*(?:\n|$))*WHERE\b", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True)
class SplitRule:
    """A rule's SELECT taken apart at its WHERE, by the positions Spark's own parser gives (never by searching
    the text, which may hold the word in a string or a comment): replicate must also know the rows the rule
    drops, to delete them on the target, so it evaluates the condition as a column instead of filtering."""

    unfiltered: str  # the SELECT without its WHERE clause
    condition: str | None  # the WHERE's condition, None when the rule has no WHERE
    from_clause: str  # `FROM name [AS alias]`: what a query over the rule's rows must say for the condition

    def keep_sql(self, extra: str = "") -> str:
        """A query over the rule's view: every column, plus `__sg_keep` (the condition, NULL counting as false)."""
        cond = "true" if self.condition is None else f"coalesce((\n{self.condition}\n), false)"
        if extra:
            cond = f"({cond}) AND ({extra})"
        return f"SELECT *, {cond} AS __sg_keep {self.from_clause}"


def split_where(spark, select: str) -> SplitRule:
    plan = spark._jsparkSession.sessionState().sqlParser().parsePlan(select)
    node, condition = plan, None
    while node.nodeName() not in ("UnresolvedRelation", "SubqueryAlias"):
        if node.nodeName() == "Filter":
            condition = node.condition()
        children = list(_seq(node.children()))
        if len(children) != 1:  # compile_rule refused such plans already
            raise UsageError(f"rule SELECT {select[:40]!r}…: a rule reads one table")
        node = children[0]
    relation = node
    while relation.nodeName() == "SubqueryAlias":  # `FROM t AS a`: the alias' origin starts at t
        relation = next(_seq(relation.children()))
    rel_start = relation.origin().startIndex().get()
    rel_end = node.origin().stopIndex().get() + 1
    head = _FROM_TAIL.search(select[:rel_start])
    if head is None:
        raise UsageError(f"rule SELECT {select[:40]!r}…: only `FROM table [AS alias]` is supported here")
    from_clause = select[head.start():rel_end]
    if condition is None:
        return SplitRule(select, None, from_clause)
    # The parser's positions: the condition starts after the WHERE keyword; everything after the relation is
    # the WHERE clause (the shape check allows nothing after it), parentheses and trailing comment included.
    if not _WHERE_HEAD.match(select[rel_end:condition.origin().startIndex().get()]):
        raise UsageError(f"rule SELECT {select[:40]!r}…: only `FROM table [WHERE condition]` is supported here")
    text = _WHERE_HEAD.sub("", select[rel_end:], count=1).strip().rstrip(";")
    return SplitRule(select[:rel_end], text, from_clause)


def fit_existing_target(conn, rule: CompiledRule) -> CompiledRule:
    """A rule whose target table exists: each computed column's type against the table's column. A wider
    column takes the values as they are (int into bigint, decimal(10,2) into numeric): the rule writes the
    table's type. A narrower one would be a lossy cast, refused with the CAST (or the ALTER) that fixes it."""
    rows = conn.execute(
        """SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a
           WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped""",
        (rule.target.ident.as_string(conn),)).fetchall()
    existing = dict(rows)
    if not existing:
        return rule
    exprs = {name for kind, name in rule.outputs if kind == "expr"}
    columns = []
    for c in rule.target.columns:
        have = existing.get(c.name)
        if c.name not in exprs or have is None or have == c.type_sql:
            columns.append(c)
            continue
        spark_type = types.spark_type_of(c.type_sql)
        fit = types.fits(spark_type, have) if spark_type else None
        if fit is False:
            to = types.spark_cast_type(have)
            cast = f"CAST(... AS {to}) AS {quote(c.name)}" if to else f"a CAST to what {have} holds"
            raise UsageError(f"rule {rule.rule.split(':', 1)[0]}: column {c.name!r} is {spark_type.upper()} ("
                             f"{c.type_sql}), and target table {rule.target.qualified} has {c.name} {have}: a "
                             f"lossy cast. Write {cast} in the rule (rounding as you mean it), or ALTER TABLE "
                             f"{rule.target.qualified} ALTER COLUMN {c.name} TYPE {c.type_sql}")
        columns.append(replace(c, type_sql=have) if fit else c)
    return replace(rule, target=replace(rule.target, columns=tuple(columns)))
