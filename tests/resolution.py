"""Which names of a function's body resolve through its caller's
search_path: what a function that runs as another role (SECURITY DEFINER,
or PL/pgSQL a definer calls, whose compiled copy a session reuses) must not
leave to it when it pins no search_path. Read from the body the server
keeps (pg_proc.prosrc), not from the source files.

A body passes when every type (in DECLARE, a cast, CAST ... AS), every
operator and every function it names is qualified (OPERATOR(pg_catalog.=),
pg_catalog.now()), or is one the grammar itself binds to pg_catalog
(integer, COALESCE, EXTRACT). What only looks like an operator is refused
too: LIKE, BETWEEN, IN, IS DISTINCT FROM, NULLIF and CASE x WHEN find =
or ~~ through the search_path as an operator does. EXECUTE of any text is
refused: it is parsed as the function runs, under the caller's path."""

import re

# Types the grammar names itself (SystemTypeName): they never resolve
# through the search_path. (json becomes one only in PostgreSQL 16.)
KEYWORD_TYPES = {
    "int", "integer", "smallint", "bigint", "real", "float", "double", "precision", "decimal", "dec",
    "numeric", "boolean", "char", "character", "varchar", "varying", "nchar", "national", "bit",
    "interval", "timestamp", "time", "with", "without", "zone",
}
# Constructs the grammar binds (functions it names in pg_catalog, or no
# function at all), or PL/pgSQL's own, that are written like calls.
KEYWORD_CALLS = {
    "coalesce", "greatest", "least", "exists", "array", "row", "values", "cast", "extract", "position",
    "substring", "overlay", "trim", "any", "all", "some", "if", "elsif", "while", "when", "and", "or", "not",
    "over", "filter", "lateral", "from", "in", "select", "return", "returns", "using", "into", "on", "as",
    "where", "then", "else", "exception", "raise", "perform", "with", "by", "grouping", "current_date",
    "current_time", "current_timestamp", "localtime", "localtimestamp", "current_user", "session_user",
    "current_role", "user", "table", "materialized", "recursive", "rows", "join", "case", "end", "is",
    "distinct", "null", "true", "false", "limit", "offset", "order", "group", "having", "union", "intersect",
    "except", "set", "update", "insert", "delete", "conflict", "do", "nothing", "returning", "for", "loop",
    "begin", "declare", "constant", "default", "strict", "of", "only", "each", "query", "execute", "format",
    "diagnostics", "get", "found", "level", "operator", "errcode", "hint", "detail", "message", "sqlstate", "sqlerrm",
}
# Operators that are syntax, not operators: PL/pgSQL's assignment, a named
# argument, a qualified name, a cast, a list, a statement's end, brackets.
SYNTAX = {":=", "=>", ".", "::", ",", ";", "(", ")", "[", "]"}
# RAISE ... USING option = value: syntax.
RAISE_OPTIONS = {"errcode", "hint", "detail", "message", "column", "constraint", "datatype", "table", "schema"}
# Keywords that are operators found through the search_path.
OPERATOR_WORDS = {"like", "ilike", "similar", "between", "nullif"}

TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>--[^\n]*|/\*.*?\*/)
  | (?P<dollar>\$(?P<tag>[A-Za-z_]*)\$.*?\$(?P=tag)\$)
  | (?P<string>[EeXxBbUu]?'(?:[^']|'')*')
  | (?P<quoted>"(?:[^"]|"")*")
  | (?P<number>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)
  | (?P<param>\$\d+)
  | (?P<word>[A-Za-z_][A-Za-z_0-9$]*)
  | (?P<syntax>::|:=|=>|[.,;()\[\]])
  | (?P<operator>[-+*/<>=~!@\#%^&|`?]+)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)


def tokens(body):
    """(kind, text) of `body`, without its spaces and comments; a string
    keeps its kind, its text left out."""
    found = []
    for m in TOKEN.finditer(body):
        kind = m.lastgroup if m.lastgroup != "tag" else "dollar"
        if kind in ("space", "comment"):
            continue
        found.append((kind, m.group(0).lower() if kind == "word" else m.group(0)))
    return found


def qualified_name(toks, i):
    """Whether the name starting at toks[i] is schema-qualified."""
    return i + 2 < len(toks) and toks[i + 1][1] == "."


def type_at(toks, i):
    """The fault of the type named at toks[i], or None."""
    kind, text = toks[i]
    if kind == "word" and text in KEYWORD_TYPES:
        return None
    if kind in ("word", "quoted") and qualified_name(toks, i):
        return None
    return f"type {text} unqualified"


def faults(body, language):
    """What in `body` resolves through the caller's search_path."""
    toks = tokens(body)
    found = []
    words = [t for k, t in toks if k == "word"]
    if "execute" in words and language == "plpgsql":
        found.append("EXECUTE: text parsed under the caller's search_path")
    # DECLARE: name [CONSTANT] type ..., up to the body's first BEGIN.
    if language == "plpgsql" and words[:1] == ["declare"]:
        i = 1
        while i < len(toks) and toks[i][1] != "begin":
            start = i
            i += 1  # the variable's name
            if i < len(toks) and toks[i][1] == "constant":
                i += 1
            fault = type_at(toks, i) if i < len(toks) else None
            if fault:
                found.append(f"DECLARE {toks[start][1]}: {fault}")
            while i < len(toks) and toks[i][1] != ";":
                i += 1
            i += 1
    depth_case = []
    # Names of the body's CTEs: relations it defines itself.
    ctes = {toks[i][1] for i in range(len(toks) - 2)
            if toks[i + 1][1] == "as" and toks[i + 2][1] in ("(", "materialized", "not")}
    for i, (kind, text) in enumerate(toks):
        before = toks[i - 1] if i else ("", "")
        after = toks[i + 1] if i + 1 < len(toks) else ("", "")
        if kind == "syntax" and text == "::":
            fault = type_at(toks, i + 1)
            if fault:
                found.append(f"cast: {fault}")
        elif kind == "word" and text == "as" and depth_case and depth_case[-1] == "cast":
            fault = type_at(toks, i + 1)
            if fault:
                found.append(f"CAST AS: {fault}")
            depth_case.pop()
        elif kind == "word" and text == "cast" and after[1] == "(":
            depth_case.append("cast")
        elif kind == "operator":
            inside = (i >= 4 and toks[i - 1][1] == "." and toks[i - 2][1] == "pg_catalog"
                      and toks[i - 3][1] == "(" and toks[i - 4][1] == "operator")
            negative = text == "-" and after[0] == "number"
            star = text == "*" and (before[1] in ("(", ".", "select", ",") )
            assigned = text == "=" and (_in_set_list(toks, i) or before[1] in RAISE_OPTIONS
                                        or (i >= 2 and toks[i - 2][1] == "diagnostics"))
            if not (inside or negative or star or assigned):
                found.append(f"operator {text} unqualified")
        elif kind == "word" and text in OPERATOR_WORDS:
            found.append(f"{text.upper()}: an operator found through the search_path")
        elif kind == "word" and text == "distinct" and before[1] in ("is", "not"):
            found.append("IS DISTINCT FROM: = found through the search_path")
        elif kind == "word" and text == "in" and after[1] == "(" and before[1] not in ("for",):
            found.append("IN (...): = found through the search_path")
        elif kind == "word" and text == "case" and after[1] != "when":
            found.append("CASE x WHEN: = found through the search_path")
        elif (kind in ("word", "quoted") and before[1] in ("from", "join") and after[1] not in ("(", ".")
              and text not in ctes and text != "lateral" and toks[i - 2][1] != "distinct"
              and _call_around(toks, i) not in ("extract", "substring", "trim", "position", "overlay")):
            found.append(f"relation {text} unqualified (pg_temp comes first for relations)")
        elif kind in ("word", "quoted") and after[1] == "(" and before[1] != "." and text not in KEYWORD_CALLS:
            if not (kind == "word" and qualified_name(toks, i)):
                found.append(f"function {text}() unqualified")
    return found


def _in_set_list(toks, i):
    """Whether the = at toks[i] assigns a column (UPDATE ... SET a = b,
    INSERT ... ON CONFLICT DO UPDATE SET): the nearest SET before it comes
    after the nearest WHERE, FROM and RETURNING."""
    for j in range(i - 1, -1, -1):
        word = toks[j][1]
        if word == "set":
            return True
        if word in ("where", "from", "returning", "select", "if", "when", ";"):
            return False
    return False


def _call_around(toks, i):
    """The word before the innermost parenthesis open around toks[i]."""
    depth = 0
    for j in range(i - 1, 0, -1):
        if toks[j][1] == ")":
            depth += 1
        elif toks[j][1] == "(":
            if depth == 0:
                return toks[j - 1][1]
            depth -= 1
    return None
