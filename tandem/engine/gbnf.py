"""GBNF, llama.cpp's grammar format, read and checked, then written as the Lark grammar llguidance
runs (`GrammarSpec("gbnf")` in `tandem.engine.grammar`).

    root   ::= answer " " [0-9]+ | "none"     a rule: name ::= alternatives (`|`) of sequences
    answer ::= ("yes" | "no")? [^"\\\n]*      grouping, `*` `+` `?` `{m}` `{m,}` `{m,n}`,
    word   ::= [a-zA-Z_-]+ .                  classes (ranges, `^` negation), `.` any character
    # a comment runs to the end of the line

Names are `[a-zA-Z0-9_-]+`; literals and classes take the escapes `\\n \\r \\t \\\\ \\" \\[ \\] \\-
\\xHH \\uHHHH \\UHHHHHHHH`. A sequence ends at a line's end outside parentheses (as llama.cpp reads
it); a line starting with `|` goes on with the rule's alternatives.

Refused, as a `GbnfError` naming the offset, line and column: what does not parse; a rule
defined twice; a reference to no rule; no `root`; a rule that can match nothing. A rule matches
something when one of its alternatives does: a sequence when each item does, a repetition when
its minimum is 0 or its item does, a literal and `.` always, a class when it holds a character or
is negated, a reference when its rule does (the least fixed point over the rules: a rule that
only ever reaches itself, `a ::= "x" a`, has no finite string).

Lark: a rule whose references all reach rules without recursion is regular and becomes one
terminal (`G<i>_NAME`), which llguidance lexes as one regular expression, its language exact;
the others stay rules (`g<i>_name`) whose literals and classes are lexemes. `root` is `start`.
Only the rules `root` reaches are written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tandem.engine.grammar import GrammarError

NAME = re.compile(r"[a-zA-Z0-9_-]+")
ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
MAX_REPEAT = 10_000  # `{m,n}` bounds above this are refused (llguidance unrolls them)


class GbnfError(GrammarError):
    """A GBNF grammar that does not parse or can match nothing; `offset`, `line`, `column` say
    where (line and column from 1)."""

    def __init__(self, text: str, offset: int, why: str) -> None:
        self.offset = offset
        self.line = text.count("\n", 0, offset) + 1
        self.column = offset - (text.rfind("\n", 0, offset) + 1) + 1
        super().__init__(f"GBNF: {why} at line {self.line}, column {self.column}")


@dataclass(frozen=True)
class Lit:
    text: str


@dataclass(frozen=True)
class Cls:
    ranges: tuple[tuple[str, str], ...]
    negated: bool


@dataclass(frozen=True)
class AnyChar:
    pass


@dataclass(frozen=True)
class Ref:
    name: str
    offset: int


@dataclass(frozen=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True)
class Rep:
    item: Node
    low: int
    high: int | None  # None: no bound


Node = Lit | Cls | AnyChar | Ref | Seq | Alt | Rep


@dataclass(frozen=True)
class Rule:
    name: str
    body: Node
    offset: int


def parse(text: str) -> dict[str, Rule]:
    """The rules of GBNF `text` by name, checked (see the module's docstring)."""
    rules = _Reader(text).grammar()
    if "root" not in rules:
        raise GbnfError(text, len(text), "no `root` rule")
    for rule in rules.values():
        for ref in _refs(rule.body):
            if ref.name not in rules:
                raise GbnfError(text, ref.offset, f"no rule named `{ref.name}`")
    live = _productive(rules)
    dead = [rule for rule in rules.values() if rule.name not in live]
    if dead:
        # name the rule that fails by itself (every other rule granted), else the first
        names = set(rules)
        own = [r for r in dead if not _matches(r.body, names - {r.name})]
        rule = (own or dead)[0]
        raise GbnfError(text, rule.offset, f"rule `{rule.name}` can match nothing")
    return rules


def to_lark(text: str) -> str:
    """GBNF `text` as a Lark grammar for llguidance (`GbnfError` where it is refused)."""
    rules = parse(text)
    reached = _reached(rules)
    regular = _regular(rules)
    order = [name for name in rules if name in reached]
    names = {
        name: (
            f"G{i}_{_ident(name).upper()}" if name in regular else f"g{i}_{_ident(name).lower()}"
        )
        for i, name in enumerate(order)
    }
    lines = [f"start: {names['root']}"]
    lines += [f"{names[n]}: {_lark(rules[n].body, names)}" for n in order]
    return "\n".join(lines) + "\n"


class _Reader:
    """A recursive-descent reader of GBNF (llama.cpp's `grammar-parser`), positions kept."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, why: str, offset: int | None = None) -> GbnfError:
        return GbnfError(self.text, self.pos if offset is None else offset, why)

    def peek(self, n: int = 1) -> str:
        return self.text[self.pos : self.pos + n]

    def space(self, newlines: bool) -> None:
        """Skip blanks and comments, and line ends where `newlines`."""
        t = self.text
        while self.pos < len(t):
            c = t[self.pos]
            if c in " \t" or (newlines and c in "\r\n"):
                self.pos += 1
            elif c == "#":
                while self.pos < len(t) and t[self.pos] not in "\r\n":
                    self.pos += 1
            else:
                return

    def grammar(self) -> dict[str, Rule]:
        rules: dict[str, Rule] = {}
        self.space(True)
        while self.pos < len(self.text):
            start = self.pos
            name = self.name()
            self.space(False)
            if self.peek(3) != "::=":
                raise self.fail("expected `::=`")
            self.pos += 3
            self.space(True)
            body = self.alternatives(nested=False)
            if self.pos < len(self.text) and self.peek() not in "\r\n":
                raise self.fail(f"unexpected {self.peek()!r}")
            if name in rules:
                raise self.fail(f"rule `{name}` is defined twice", start)
            rules[name] = Rule(name, body, start)
            self.space(True)
        return rules

    def name(self) -> str:
        m = NAME.match(self.text, self.pos)
        if not m:
            raise self.fail("expected a rule name")
        self.pos = m.end()
        return m.group()

    def alternatives(self, nested: bool) -> Node:
        options = [self.sequence(nested)]
        while True:
            if not nested:  # a line starting with `|` goes on with this rule
                back = self.pos
                self.space(True)
                if self.peek() != "|":
                    self.pos = back
                    break
            elif self.peek() != "|":
                break
            self.pos += 1
            self.space(True)
            options.append(self.sequence(nested))
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self, nested: bool) -> Node:
        items: list[Node] = []
        while self.pos < len(self.text):
            c = self.peek()
            at = self.pos
            if c == '"':
                items.append(self.literal())
            elif c == "[":
                items.append(self.char_class())
            elif c == ".":
                self.pos += 1
                items.append(AnyChar())
            elif c == "(":
                self.pos += 1
                self.space(True)
                inner = self.alternatives(nested=True)
                self.space(True)
                if self.peek() != ")":
                    raise self.fail("expected `)`")
                self.pos += 1
                items.append(inner)
            elif NAME.match(c):
                items.append(Ref(self.name(), at))
            elif c in "*+?{":
                if not items:
                    raise self.fail(f"`{c}` follows nothing")
                items[-1] = self.repeat(items[-1])
            else:
                break
            self.space(nested)
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def repeat(self, item: Node) -> Rep:
        c = self.peek()
        self.pos += 1
        if c != "{":
            return Rep(item, 1 if c == "+" else 0, 1 if c == "?" else None)
        self.space(False)
        low = self.count()
        high: int | None = low
        self.space(False)
        if self.peek() == ",":
            self.pos += 1
            self.space(False)
            high = self.count() if self.peek().isdigit() else None
            self.space(False)
        if self.peek() != "}":
            raise self.fail("expected `}`")
        if high is not None and high < low:
            raise self.fail(f"`{{{low},{high}}}`: the maximum is below the minimum")
        self.pos += 1
        return Rep(item, low, high)

    def count(self) -> int:
        m = re.compile(r"[0-9]+").match(self.text, self.pos)
        if not m:
            raise self.fail("expected a number")
        if int(m.group()) > MAX_REPEAT:
            raise self.fail(f"a repetition count above {MAX_REPEAT}")
        self.pos = m.end()
        return int(m.group())

    def literal(self) -> Lit:
        start = self.pos
        self.pos += 1
        chars = []
        while self.peek() != '"':
            if self.pos >= len(self.text):
                raise self.fail("a string literal is not closed", start)
            chars.append(self.char())
        self.pos += 1
        return Lit("".join(chars))

    def char_class(self) -> Cls:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        self.pos += negated
        ranges = []
        while self.peek() != "]":
            if self.pos >= len(self.text):
                raise self.fail("a character class is not closed", start)
            low = self.char()
            high = low
            if self.peek() == "-" and self.peek(2) != "-]":
                self.pos += 1
                at = self.pos
                high = self.char()
                if high < low:
                    raise self.fail(f"the range {low!r}-{high!r} is empty", at)
            ranges.append((low, high))
        self.pos += 1
        return Cls(tuple(ranges), negated)

    def char(self) -> str:
        """One character of a literal or class, its escape read."""
        c = self.peek()
        if c in "\r\n" or not c:
            raise self.fail("a line ends inside a literal or class")
        if c != "\\":
            self.pos += 1
            return c
        e = self.text[self.pos + 1 : self.pos + 2]
        if e in ESCAPES:
            self.pos += 2
            return ESCAPES[e]
        if e in HEX_ESCAPES:
            digits = self.text[self.pos + 2 : self.pos + 2 + HEX_ESCAPES[e]]
            if len(digits) != HEX_ESCAPES[e] or not all(
                d in "0123456789abcdefABCDEF" for d in digits
            ):
                raise self.fail(f"`\\{e}` needs {HEX_ESCAPES[e]} hex digits")
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise self.fail(f"`\\{e}{digits}` is not a character")
            self.pos += 2 + len(digits)
            return chr(code)
        raise self.fail(f"unknown escape `\\{e}`")


def _refs(node: Node) -> list[Ref]:
    if isinstance(node, Ref):
        return [node]
    if isinstance(node, Seq):
        return [r for i in node.items for r in _refs(i)]
    if isinstance(node, Alt):
        return [r for i in node.options for r in _refs(i)]
    if isinstance(node, Rep):
        return _refs(node.item)
    return []


def _matches(node: Node, live: set[str]) -> bool:
    """Whether `node` has a finite string, the rules in `live` known to."""
    if isinstance(node, Ref):
        return node.name in live
    if isinstance(node, Seq):
        return all(_matches(i, live) for i in node.items)
    if isinstance(node, Alt):
        return any(_matches(i, live) for i in node.options)
    if isinstance(node, Rep):
        return node.low == 0 or _matches(node.item, live)
    if isinstance(node, Cls):
        return bool(node.ranges) or node.negated
    return True


def _least_fixed_point(rules: dict[str, Rule], holds) -> set[str]:
    """The least set of rule names closed under `holds(rule, set so far)`: a rule joins once
    `holds` is true of it given the rules already in, until none joins."""
    done: set[str] = set()
    grew = True
    while grew:
        grew = False
        for rule in rules.values():
            if rule.name not in done and holds(rule, done):
                done.add(rule.name)
                grew = True
    return done


def _productive(rules: dict[str, Rule]) -> set[str]:
    """The rules with a finite string: the least fixed point of `_matches`."""
    return _least_fixed_point(rules, lambda rule, live: _matches(rule.body, live))


def _regular(rules: dict[str, Rule]) -> set[str]:
    """The rules that reach no recursion: those whose references are all such rules."""
    return _least_fixed_point(
        rules, lambda rule, done: all(r.name in done for r in _refs(rule.body))
    )


def _reached(rules: dict[str, Rule]) -> set[str]:
    seen, todo = {"root"}, ["root"]
    while todo:
        for ref in _refs(rules[todo.pop()].body):
            if ref.name not in seen:
                seen.add(ref.name)
                todo.append(ref.name)
    return seen


def _ident(name: str) -> str:
    return name.replace("-", "_")


def _lark(node: Node, names: dict[str, str]) -> str:
    """`node` as a Lark expression (bracketed where a postfix or sequence needs it)."""
    if isinstance(node, Lit):
        if node.text.isprintable():  # as a string ("" too); else as a regex, each char by code
            return json.dumps(node.text, ensure_ascii=False)
        return "/" + "".join(_rx(c) for c in node.text) + "/"
    if isinstance(node, AnyChar):
        return "/(?s:.)/"
    if isinstance(node, Cls):
        inside = "".join(_rx(lo) if lo == hi else f"{_rx(lo)}-{_rx(hi)}" for lo, hi in node.ranges)
        if not inside:  # `[^]`: any character (`[]` matches nothing and never gets here)
            return "/(?s:.)/"
        return f"/[{'^' if node.negated else ''}{inside}]/"
    if isinstance(node, Ref):
        return names[node.name]
    if isinstance(node, Seq):
        return " ".join(_lark(i, names) for i in node.items) if node.items else '""'
    if isinstance(node, Alt):
        return "(" + " | ".join(_lark(o, names) for o in node.options) + ")"
    inner = f"({_lark(node.item, names)})"
    if (node.low, node.high) == (0, None):
        return f"{inner}*"
    if (node.low, node.high) == (1, None):
        return f"{inner}+"
    if (node.low, node.high) == (0, 1):
        return f"{inner}?"
    return f"{inner}{{{node.low},{'' if node.high is None else node.high}}}"


def _rx(c: str) -> str:
    """One character in a regex (or its class): letters and digits as they are, others by code."""
    return c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}"
