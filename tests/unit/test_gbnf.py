"""GBNF grammars (`tandem.engine.gbnf`, the `grammar` request field) over the one-token-per-ASCII-
character vocabulary: on random regular grammars, written both as GBNF and (by this test, from
the same tree) as a Python regular expression, every step's mask allows exactly the characters
that keep the text a prefix of a match (the `regex` module's partial matching) and EOS exactly
when the text matches, so it never allows nothing before the grammar is complete and what it
lets out is in the language; recursive grammars against hand-written recognizers; each refusal
with its line and column; and the field through the API (llama.cpp's `grammar`, vLLM's
`guided_grammar` and `structured_outputs.grammar`), a bad grammar a 400 naming the field."""

import numpy as np
import pytest
import regex
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_grammar_mask import EOS, VOCAB, _chat, client  # noqa: F401  (client: a fixture)

from tandem.engine.gbnf import GbnfError, to_lark
from tandem.engine.grammar import GrammarSpec

MODEL = "tiny-test"


def mask_of(text):
    return VOCAB.mask(GrammarSpec("lark", text=to_lark(text)))


def steps(mask):
    """The characters the mask allows next, and whether it allows EOS."""
    ids = np.flatnonzero(mask.allowed())
    return {chr(i) for i in ids if i != EOS}, EOS in ids


# ---- random regular grammars: GBNF and a Python regex from one tree ------------------------------

ALPHABET = 'ab-\\"] \n\x01\x7f'


def _esc(c):
    escapes = {
        "\\": "\\\\",
        '"': '\\"',
        "\n": "\\n",
        "]": "\\]",
        "-": "\\-",
        "\x01": "\\x01",
        "\x7f": "\\x7f",
    }
    return escapes.get(c, c)


def _lit(text):
    return ("lit", text)


def _cls(chars, negated):
    return ("cls", tuple(sorted(set(chars))), negated)


LEAVES = st.one_of(
    st.text(ALPHABET, max_size=3).map(_lit),
    st.builds(_cls, st.text(ALPHABET + "xyz", min_size=1, max_size=4), st.booleans()),
    st.just(("range",)),  # [x-z]
    st.just(("any",)),
)


def _composite(children):
    return st.one_of(
        st.tuples(st.just("seq"), st.lists(children, min_size=2, max_size=3).map(tuple)),
        st.tuples(st.just("alt"), st.lists(children, min_size=2, max_size=3).map(tuple)),
        st.tuples(st.just("rep"), children, st.sampled_from(["*", "+", "?", "{2}", "{1,2}"])),
        st.tuples(st.just("rule"), children),  # the child as a rule of its own
    )


TREES = st.recursive(LEAVES, _composite, max_leaves=6)


def gbnf(tree, rules):
    """`tree` as a GBNF expression; `rules` collects the named rules it refers to."""
    kind = tree[0]
    if kind == "lit":
        return '"' + "".join(_esc(c) for c in tree[1]) + '"'
    if kind == "cls":
        return "[" + ("^" if tree[2] else "") + "".join(_esc(c) for c in tree[1]) + "]"
    if kind == "range":
        return "[x-z]"
    if kind == "any":
        return "."
    if kind == "seq":
        return " ".join(gbnf(t, rules) for t in tree[1])
    if kind == "alt":
        return "(" + " | ".join(gbnf(t, rules) for t in tree[1]) + ")"
    if kind == "rep":
        return f"({gbnf(tree[1], rules)}){tree[2]}"
    name = f"r-{len(rules)}"
    rules.append(None)
    rules[int(name[2:])] = f"{name} ::= {gbnf(tree[1], rules)}"
    return name


def python_regex(tree):
    kind = tree[0]
    if kind == "lit":
        return regex.escape(tree[1])
    if kind == "cls":
        chars = "[" + "".join(regex.escape(c) for c in tree[1]) + "]"
        # a negated class as "not one of them, then any character": the regex module (2026.11.19)
        # matches neither "a" nor "b" with (?:[^a]|[^b]), where re matches both
        return f"(?:(?!{chars})(?s:.))" if tree[2] else chars
    if kind == "range":
        return "[x-z]"
    if kind == "any":
        return "(?s:.)"
    if kind == "seq":
        return "".join(f"(?:{python_regex(t)})" for t in tree[1])
    if kind == "alt":
        return "(?:" + "|".join(python_regex(t) for t in tree[1]) + ")"
    if kind == "rep":
        return f"(?:{python_regex(tree[1])}){tree[2]}"
    return python_regex(tree[1])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=TREES, seed=st.integers(0, 2**32 - 1))
@example(tree=("alt", (_cls("\\", True), _cls("-", True))), seed=0)  # two negated classes
def test_on_random_regular_grammars_the_mask_allows_exactly_the_language_s_next_characters(
    tree, seed
):
    rules: list = []
    text = "\n".join([f"root ::= {gbnf(tree, rules)}  # the root", *rules])
    pattern = regex.compile(python_regex(tree))
    mask, out, rng = mask_of(text), "", np.random.default_rng(seed)
    for _ in range(12):
        chars, eos = steps(mask)
        assert chars or eos, (text, out)  # never nothing before the grammar is complete
        want = {chr(i) for i in range(1, 128) if pattern.fullmatch(out + chr(i), partial=True)}
        assert chars == want, (text, out)
        assert eos == bool(pattern.fullmatch(out)), (text, out)
        if eos and (not chars or rng.random() < 0.3):
            mask.advance(EOS)
            return
        c = str(rng.choice(sorted(chars)))
        mask.advance(ord(c))
        out += c


# ---- recursive grammars against recognizers written here -----------------------------------------

PARENS = """
root ::= group+
group ::= "(" ws group* ")" ws   # nested
ws ::= [ ]?
"""


def balanced(text):
    return regex.fullmatch(r"(?<g>\( ?(?&g)*\) ?)+", text) is not None


ARITH = r"""
root  ::= expr
expr  ::= term (("+" | "-") term)*
term  ::= num | "(" expr ")"
num   ::= "-"? [1-9] [0-9]{0,2}
"""


def arithmetic(text):
    return regex.fullmatch(r"(?<e>(?<t>-?[1-9][0-9]{0,2}|\((?&e)\))([+-](?&t))*)", text) is not None


OVERLAP = 'root ::= "(" root? [a-z]+ "x" ")"'  # lexemes that overlap ("x" ends [a-z]+ or not)


def overlap(text):
    return regex.fullmatch(r"(?<r>\((?&r)?[a-z]+x\))", text) is not None


@pytest.mark.parametrize(
    "grammar,accepts", [(PARENS, balanced), (ARITH, arithmetic), (OVERLAP, overlap)]
)
@pytest.mark.parametrize("seed", range(8))
def test_recursive_grammars_let_out_only_what_their_recognizer_accepts(grammar, accepts, seed):
    mask, out, rng = mask_of(grammar), "", np.random.default_rng(seed)
    for _ in range(200):
        chars, eos = steps(mask)
        assert chars or eos, out
        if eos and (not chars or rng.random() < 0.2):
            mask.advance(EOS)
            assert accepts(out), out
            return
        closing = sorted(chars & set(")0123456789x"))
        c = str(rng.choice(closing if closing and rng.random() < 0.6 else sorted(chars)))
        mask.advance(ord(c))
        out += c
    pytest.fail(f"the walk did not end: {out!r}")


def test_the_parser_reads_llama_cpp_s_forms():
    """Escapes, comments, a `|` opening a line, newlines inside parentheses, `{m,}`, `[^...]`."""
    text = r"""# a comment line
root ::= greeting ( "," [ \t]* name
                  )? "\x21"{1,}
       | [^a-z\n\u00e9] "\"" # another comment
greeting ::= "hi" | "hello"
name ::= [A-Z] [a-z-]*
"""
    mask = mask_of(text)
    for c in "hello, Ann-e!!":
        assert c in steps(mask)[0], c
        mask.advance(ord(c))
    assert steps(mask) == ({"!"}, True)
    other = mask_of(text)
    assert "a" not in steps(other)[0] and {"Q", "h", "\\"} <= steps(other)[0]


@pytest.mark.parametrize(
    "text,line,column,why",
    [
        ('root ::= "a" other', 1, 14, "no rule named `other`"),
        ('main ::= "a"', 1, 13, "no `root` rule"),
        ('root ::= "x" root', 1, 1, "`root` can match nothing"),
        ('root ::= a\na ::= "(" a ")"', 2, 1, "`a` can match nothing"),
        ("root ::= []", 1, 1, "can match nothing"),
        ('root ::= "a"\nroot ::= "b"', 2, 1, "defined twice"),
        ('root ::= "abc', 1, 10, "not closed"),
        ('root ::= ("a" | "b"', 1, 20, "expected `)`"),
        ("root ::= [b-a]", 1, 13, "is empty"),
        ('root ::= * "a"', 1, 10, "follows nothing"),
        ('root = "a"', 1, 6, "expected `::=`"),
        ('root ::= "\\q"', 1, 11, "unknown escape"),
        ('root ::= "a"{3,1}', 1, 17, "below the minimum"),
        ('root ::= "a" ; "b"', 1, 14, "unexpected ';'"),
        ('root ::= "\\x4"', 1, 11, "needs 2 hex digits"),
    ],
)
def test_a_grammar_the_parser_refuses_says_where(text, line, column, why):
    with pytest.raises(GbnfError, match=regex.escape(why)) as e:
        to_lark(text)
    assert (e.value.line, e.value.column) == (line, column), str(e.value)


# ---- through the API ------------------------------------------------------------------------------

YES_NO = 'root ::= ("yes" | "no") " " [0-9]{1,3}'


@pytest.mark.parametrize(
    "field",
    [{"grammar": YES_NO}, {"guided_grammar": YES_NO}, {"structured_outputs": {"grammar": YES_NO}}],
)
def test_the_grammar_fields_hold_chat_and_completions_output_to_the_grammar(client, field):  # noqa: F811
    r = _chat(client, temperature=1.0, seed=5, n=2, **field).json()
    for choice in r["choices"]:
        assert regex.fullmatch(r"(yes|no) [0-9]{1,3}", choice["message"]["content"]), choice
        assert choice["finish_reason"] == "stop"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 20, **field}
    r = client.post("/v1/completions", json=body).json()
    assert regex.fullmatch(r"(yes|no) [0-9]{1,3}", r["choices"][0]["text"]), r


@pytest.mark.parametrize(
    "field,param,where",
    [
        ({"grammar": 'root ::= "a" b'}, "grammar", "line 1, column 14"),
        ({"guided_grammar": "root ::= x\nx ::= x"}, "guided_grammar", "line 2, column 1"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", ""),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex", ""),
        ({"grammar": YES_NO, "response_format": {"type": "json_object"}}, "grammar", ""),
        ({"grammar": 3}, "grammar", ""),
    ],
)
def test_a_grammar_field_refused_is_a_400_naming_it_and_where(client, field, param, where):  # noqa: F811
    r = _chat(client, **field)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and where in err["message"], err


def test_a_gbnf_grammar_holds_the_answer_after_free_reasoning():
    """For a reasoning model (`<think>` read on the text here) the grammar holds the answer only."""
    from test_grammar_mask import AsciiTokenizer

    from tandem.server.reasoning_format import choose
    from tandem.server.reasoning_grammar import hold_answer
    from tandem.server.structured import gbnf_spec

    fmt = choose(AsciiTokenizer(), "think")
    spec = hold_answer(fmt, gbnf_spec(YES_NO, "grammar"), [])
    for text, complete in [
        ("<think>maybe 7?</think>\n\nno 7", True),
        ("yes 12", True),
        ("<think>yes 1", False),
    ]:
        mask = VOCAB.mask(spec)
        for c in text:
            assert c in steps(mask)[0], (text, c)
            mask.advance(ord(c))
        assert steps(mask)[1] == complete, text
    assert steps(VOCAB.mask(spec))[0] == {"<", "y", "n"}  # outside the reasoning, the grammar


def test_control_characters_in_literals_and_classes():
    mask = mask_of(r'root ::= "\x01\x7f" [\x00-\x08] "\"\\" "\n"')
    for want in ["\x01", "\x7f", set(map(chr, range(1, 9))), '"', "\\", "\n"]:
        chars, _ = steps(mask)
        assert chars == (want if isinstance(want, set) else {want})
        mask.advance(ord(min(chars)))
    assert steps(mask) == (set(), True)
