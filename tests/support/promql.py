"""PromQL read as far as the config tests need: every metric selector an expression uses and
every label it names, each checked against what the project's exporters serve.

A tokenizer (strings, numbers, durations, comments and Grafana's `$variables` are tokens of their
own, so nothing inside them is mistaken for a name) under a small precedence-climbing parser of
PromQL's grammar: aggregations with `by`/`without` before or after their arguments, vector
matching (`on`/`ignoring`, `group_left`/`group_right`), ranges, subqueries, `offset` and `@`.
While parsing it tracks which labels the series of each sub-expression can carry, so the labels
of `sum by (partition) (x)` are checked against x's family, those of
`histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m])))` against the bucket series' (whose
`le` histogram_quantile then consumes), those of `a * on (k) group_left (l) b` against a and b.

Not a full PromQL implementation: value types (instant vs range vector) are not checked, which
Prometheus' own parser does (`promtool check rules`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import Metric

#: Labels Prometheus attaches to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})
#: Family type → the sample names it is exposed as (text format), by suffix.
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}

AGGREGATIONS = frozenset(
    {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
     "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
)  # fmt: skip
#: Aggregations with a parameter before the vector.
_PARAMETRIC = frozenset({"count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"})
#: Aggregations that return some of their input series unchanged, labels and all.
_SELECTING = frozenset({"bottomk", "topk", "limitk", "limit_ratio"})
FUNCTIONS = frozenset(
    {"abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh",
     "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh",
     "count_over_time", "day_of_month", "day_of_week", "day_of_year", "days_in_month", "deg",
     "delta", "deriv", "double_exponential_smoothing", "exp", "floor", "histogram_avg",
     "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev",
     "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate",
     "label_join", "label_replace", "last_over_time", "ln", "log10", "log2", "mad_over_time",
     "max_over_time", "min_over_time", "minute", "month", "pi", "predict_linear",
     "present_over_time", "quantile_over_time", "rad", "rate", "resets", "round", "scalar",
     "sgn", "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt",
     "stddev_over_time", "stdvar_over_time", "sum_over_time", "tan", "tanh", "time",
     "timestamp", "vector", "year"}
)  # fmt: skip
_SCALAR_FUNCTIONS = frozenset({"time", "pi", "scalar"})
#: Binary operators by precedence (PromQL's, lowest first); `^` is right-associative.
_PRECEDENCE = {
    "or": 1, "and": 2, "unless": 2,
    "==": 3, "!=": 3, "<": 3, "<=": 3, ">": 3, ">=": 3,
    "+": 4, "-": 4, "*": 5, "/": 5, "%": 5, "atan2": 5, "^": 6,
}  # fmt: skip
_WORD_OPERATORS = frozenset({"and", "or", "unless", "atan2"})
KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
    | _WORD_OPERATORS
)
_MATCH_OPERATORS = frozenset({"=", "!=", "=~", "!~"})

_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
    |(?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
    |(?P<var>\$\{[^}]+\}|\$\w+)
    |(?P<duration>(?:\d+(?:ms|[smhdwy]))+(?!\w))
    |(?P<number>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?!\w))
    |(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    |(?P<op>==|!=|<=|>=|=~|!~|[-+*/%^<>=@])
    |(?P<punct>[(){}\[\],])
    """,
    re.VERBOSE,
)


class PromQLSyntaxError(ValueError):
    pass


@dataclass(frozen=True)
class Token:
    kind: str  # string, var, duration, number, ident, op, punct, eof
    text: str
    pos: int


def tokenize(expr: str) -> list[Token]:
    tokens: list[Token] = []
    pos, brackets = 0, 0
    while pos < len(expr):
        if brackets and expr[pos] == ":":  # a subquery's `[range:step]`, not a name's colon
            tokens.append(Token("punct", ":", pos))
            pos += 1
            continue
        match = _TOKEN.match(expr, pos)
        if match is None or match.lastgroup is None:
            raise PromQLSyntaxError(f"unexpected {expr[pos]!r} at offset {pos}")
        if match.lastgroup != "space":
            tokens.append(Token(match.lastgroup, match.group(), pos))
            brackets += {"[": 1, "]": -1}.get(match.group(), 0)
        pos = match.end()
    tokens.append(Token("eof", "", len(expr)))
    return tokens


def _unquote(text: str) -> str:
    if text.startswith("`"):
        return text[1:-1]
    escapes = {"n": "\n", "t": "\t", "r": "\r"}
    return re.sub(r"\\(.)", lambda m: escapes.get(m[1], m[1]), text[1:-1])


@dataclass
class Report:
    """What one expression selects and uses, and what is wrong with it (empty: nothing)."""

    metrics: list[str] = field(default_factory=list)
    #: (aggregation, "by" | "without", labels) of every grouping clause.
    groupings: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)
    functions: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Value:
    kind: str  # "vector", "scalar" or "string"
    #: Labels its series can carry; None when unknown (its selector was already reported).
    labels: frozenset[str] | None = frozenset()
    metrics: tuple[str, ...] = ()  # the selectors behind it, for messages
    text: str = ""  # a string literal's value


_SCALAR = _Value("scalar")


def check(expr: str, served: Mapping[str, frozenset[str]]) -> Report:
    """Parse `expr` and check its selectors and labels against `served` (sample name → the
    labels its series carry, as `served_series` builds it)."""
    parser = _Parser(expr, served)
    try:
        parser.parse()
    except PromQLSyntaxError as exc:
        parser.report.problems.append(f"cannot parse: {exc}")
    return parser.report


def served_series(families: Iterable[Metric]) -> dict[str, frozenset[str]]:
    """Sample name → labels, of families as a collector's describe() or collect() gives them.

    Label names come from the samples and, for the `*MetricFamily` classes (which describe()
    returns without samples), from the names they were declared with (`_labelnames`: not
    public API, but the only place a sample-less family keeps them). Every series also carries
    the target's `job` and `instance`; buckets `le`, a summary's quantiles `quantile`.
    """
    series: dict[str, frozenset[str]] = {}
    for family in families:
        per_sample: dict[str, set[str]] = {}
        for sample in family.samples:
            per_sample.setdefault(sample.name, set()).update(sample.labels)
        declared = set(getattr(family, "_labelnames", ()))
        common = declared.union(*per_sample.values()) - {"le", "quantile"}
        names = {family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type]}
        for name in names | per_sample.keys():
            labels = common | per_sample.get(name, set()) | TARGET_LABELS
            if family.type in ("histogram", "gaugehistogram") and name.endswith("_bucket"):
                labels.add("le")
            if family.type == "summary" and name == family.name:
                labels.add("quantile")
            if name in series:
                raise ValueError(f"sample {name} is served by two families")
            series[name] = frozenset(labels)
    return series


class _Parser:
    def __init__(self, expr: str, served: Mapping[str, frozenset[str]]) -> None:
        self.expr = expr
        self.tokens: list[Token] = []
        self.i = 0
        self.served = served
        self.report = Report()

    # --- tokens ---

    def peek(self) -> Token:
        return self.tokens[self.i]

    def next(self) -> Token:
        token = self.tokens[self.i]
        self.i = min(self.i + 1, len(self.tokens) - 1)
        return token

    def at(self, *texts: str) -> bool:
        token = self.peek()
        return token.kind in ("op", "punct") and token.text in texts

    def at_word(self, *words: str) -> bool:
        token = self.peek()
        return token.kind == "ident" and token.text.lower() in words

    def error(self, what: str, token: Token | None = None) -> PromQLSyntaxError:
        token = token or self.peek()
        found = repr(token.text) if token.text else "the end"
        return PromQLSyntaxError(f"{what} expected at offset {token.pos}, found {found}")

    def expect(self, text: str) -> None:
        if not self.at(text):
            raise self.error(repr(text))
        self.next()

    # --- grammar ---

    def parse(self) -> _Value:
        self.tokens = tokenize(self.expr)
        value = self.expression(0)
        if self.peek().kind != "eof":
            raise self.error("an operator or the end")
        return value

    def expression(self, min_precedence: int) -> _Value:
        lhs = self.unary()
        while True:
            token = self.peek()
            op = token.text.lower() if token.kind == "ident" else token.text
            if token.kind not in ("op", "ident") or op not in _PRECEDENCE:
                return lhs
            if token.kind == "ident" and op not in _WORD_OPERATORS:
                return lhs
            precedence = _PRECEDENCE[op]
            if precedence < min_precedence:
                return lhs
            self.next()
            if self.at_word("bool"):
                self.next()
            matching = group = None
            if self.at_word("on", "ignoring"):
                matching = (self.next().text.lower(), self.label_list())
            if self.at_word("group_left", "group_right"):
                side = self.next().text.lower()
                group = (side, self.label_list() if self.at("(") else ())
            rhs = self.expression(precedence if op == "^" else precedence + 1)
            lhs = self.binary(lhs, op, matching, group, rhs)

    def unary(self) -> _Value:
        if self.at("+", "-"):
            self.next()
            return self.unary()
        return self.postfix(self.primary())

    def postfix(self, value: _Value) -> _Value:
        while True:
            if self.at("["):  # a range `[5m]` or a subquery `[1h:1m]`
                self.next()
                self.duration()
                if self.at(":"):
                    self.next()
                    if not self.at("]"):
                        self.duration()
                self.expect("]")
            elif self.at_word("offset"):
                self.next()
                if self.at("-"):
                    self.next()
                self.duration()
            elif self.at("@"):
                self.next()
                if self.at_word("start", "end"):
                    self.next()
                    self.expect("(")
                    self.expect(")")
                else:
                    if self.at("+", "-"):
                        self.next()
                    if self.next().kind != "number":
                        raise self.error("a unix time, start() or end()", self.tokens[self.i - 1])
            else:
                return value

    def duration(self) -> None:
        if self.peek().kind not in ("duration", "number", "var"):
            raise self.error("a duration")
        self.next()

    def primary(self) -> _Value:
        token = self.next()
        if token.kind == "number":
            return _SCALAR
        if token.kind == "string":
            return _Value("string", text=_unquote(token.text))
        if token.kind == "punct" and token.text == "(":
            value = self.expression(0)
            self.expect(")")
            return value
        if token.kind == "punct" and token.text == "{":
            return self.selector(None, self.matchers())
        if token.kind == "ident":
            word = token.text.lower()
            if word in ("inf", "nan"):
                return _SCALAR
            if word in AGGREGATIONS and (self.at("(") or self.at_word("by", "without")):
                return self.aggregation(word)
            if self.at("("):
                return self.call(token.text)
            if word in KEYWORDS:
                raise self.error("an expression", token)
            return self.selector(token.text, self.matchers() if self.at("{") else [])
        raise self.error("an expression", token)

    def matchers(self) -> list[tuple[str, str, str]]:
        """(label, operator, value) of a `{…}` block; `{` may be consumed already."""
        if self.at("{"):
            self.next()
        found = []
        while not self.at("}"):
            label = self.next()
            if label.kind not in ("ident", "string"):
                raise self.error("a label name", label)
            name = label.text if label.kind == "ident" else _unquote(label.text)
            if label.kind == "string" and self.at(",", "}"):  # Prometheus 3: {"metric.name"}
                found.append(("__name__", "=", name))
            else:
                op = self.next()
                if op.kind != "op" or op.text not in _MATCH_OPERATORS:
                    raise self.error("=, !=, =~ or !~", op)
                value = self.next()
                if value.kind != "string":
                    raise self.error("a quoted label value", value)
                found.append((name, op.text, _unquote(value.text)))
            if not self.at("}"):
                self.expect(",")
        self.next()
        return found

    def label_list(self) -> tuple[str, ...]:
        self.expect("(")
        labels = []
        while not self.at(")"):
            token = self.next()
            if token.kind not in ("ident", "string"):
                raise self.error("a label name", token)
            labels.append(token.text if token.kind == "ident" else _unquote(token.text))
            if not self.at(")"):
                self.expect(",")
        self.next()
        return tuple(labels)

    def arguments(self) -> list[_Value]:
        self.expect("(")
        values = []
        while not self.at(")"):
            values.append(self.expression(0))
            if not self.at(")"):
                self.expect(",")
        self.next()
        return values

    # --- meaning ---

    def problem(self, text: str) -> None:
        if text not in self.report.problems:
            self.report.problems.append(text)

    def require(self, labels: Iterable[str], value: _Value, where: str) -> None:
        """Each of `labels` must be one the series of `value` can carry."""
        if value.labels is None:
            return
        for label in labels:
            if label not in value.labels:
                source = ", ".join(dict.fromkeys(value.metrics)) or "an expression"
                carried = ", ".join(sorted(value.labels)) or "none"
                self.problem(
                    f"unknown label {label!r} in {where}: the series of {source} carry"
                    f" only these labels there: {carried}"
                )

    def selector(self, name: str | None, matchers: list[tuple[str, str, str]]) -> _Value:
        for label, op, text in matchers:
            if label != "__name__":
                continue
            if op != "=":
                self.problem(f"a {label}{op}{text!r} matcher cannot be checked: name the metric")
                return _Value("vector", None)
            if name is not None and name != text:
                raise PromQLSyntaxError(f"metric named twice: {name} and {text}")
            name = text
        if name is None:
            self.problem(f"selector {matchers} names no metric")
            return _Value("vector", None)
        self.report.metrics.append(name)
        labels = self.served.get(name)
        if labels is None:
            close = difflib.get_close_matches(name, list(self.served), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            self.problem(f"unknown metric {name!r}: no exporter serves it{hint}")
            return _Value("vector", None, (name,))
        value = _Value("vector", labels, (name,))
        self.require([m[0] for m in matchers if m[0] != "__name__"], value, f"{name}{{…}}")
        return value

    def aggregation(self, op: str) -> _Value:
        grouping = self.grouping() if self.at_word("by", "without") else None
        args = self.arguments()
        if grouping is None and self.at_word("by", "without"):
            grouping = self.grouping()
        if len(args) != (2 if op in _PARAMETRIC else 1):
            raise PromQLSyntaxError(f"{op}() takes {2 if op in _PARAMETRIC else 1} arguments")
        inner = args[-1]
        labels = inner.labels
        if grouping is not None:
            mode, names = grouping
            self.report.groupings.append((op, mode, names))
            self.require(names, inner, f"{op} {mode} ({', '.join(names)})")
            if labels is not None and op not in _SELECTING:
                labels = frozenset(names) & labels if mode == "by" else labels - set(names)
        elif labels is not None and op not in _SELECTING:
            labels = frozenset()
        if op == "count_values" and labels is not None:
            labels |= {args[0].text}
        return _Value("vector", labels, inner.metrics)

    def grouping(self) -> tuple[str, tuple[str, ...]]:
        return self.next().text.lower(), self.label_list()

    def call(self, name: str) -> _Value:
        args = self.arguments()
        self.report.functions.append(name)
        if name not in FUNCTIONS:
            self.problem(f"unknown function {name!r}")
        if name in _SCALAR_FUNCTIONS:
            return _SCALAR
        vectors = [a for a in args if a.kind == "vector"]
        metrics = tuple(m for a in vectors for m in a.metrics)
        if any(a.labels is None for a in vectors):
            return _Value("vector", None, metrics)
        labels = frozenset().union(*(a.labels or () for a in vectors))
        strings = [a.text for a in args if a.kind == "string"]
        if name == "histogram_quantile" and vectors:
            self.require(["le"], vectors[0], "histogram_quantile's buckets")
            labels -= {"le"}
        elif name in ("label_replace", "label_join") and vectors and strings:
            sources = strings[2:3] if name == "label_replace" else strings[2:]
            self.require([s for s in sources if s], vectors[0], f"{name}'s source labels")
            labels |= {strings[0]}
        elif name in ("sort_by_label", "sort_by_label_desc") and vectors:
            self.require(strings, vectors[0], f"{name}'s labels")
        return _Value("vector", labels, metrics)

    def binary(
        self,
        lhs: _Value,
        op: str,
        matching: tuple[str, tuple[str, ...]] | None,
        group: tuple[str, tuple[str, ...]] | None,
        rhs: _Value,
    ) -> _Value:
        if lhs.kind != "vector" and rhs.kind != "vector":
            return _SCALAR
        if lhs.kind != "vector" or rhs.kind != "vector":  # scalar with vector: the vector's
            return lhs if lhs.kind == "vector" else rhs
        both = _Value(
            "vector",
            None if lhs.labels is None or rhs.labels is None else lhs.labels | rhs.labels,
            lhs.metrics + rhs.metrics,
        )
        if matching is not None:
            mode, names = matching
            where = f"{op} {mode} ({', '.join(names)})"
            for operand in (lhs, rhs) if mode == "on" else (both,):
                self.require(names, operand, where)
        if group is not None:
            side, names = group
            one, many = (rhs, lhs) if side == "group_left" else (lhs, rhs)
            self.require(names, one, f"{op} {side} ({', '.join(names)})")
            labels = None if many.labels is None else many.labels | set(names)
            return _Value("vector", labels, both.metrics)
        if op == "or":
            return both
        return _Value("vector", lhs.labels, both.metrics)
