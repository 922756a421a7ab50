"""The reasoning parsers (`tandem.server.reasoning`, `tandem.server.harmony`) and a choice's
reader over the engine's deltas (`reasoning_format.ChoiceReader`): any split of a well-formed
output into chunks reads as the whole does, text that only spells a marker stays text, and a
partial marker is never shown before it is decided."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.serving import Mark, TextDelta
from tandem.server import harmony
from tandem.server.harmony import HarmonyParser
from tandem.server.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    Marker,
    Parsed,
    TextMarkers,
    ThinkParser,
    ToolCall,
    parse_all,
)
from tandem.server.reasoning_format import ChoiceReader

# text full of the markers' characters, and of whole marker strings (text, not markers)
SPELLED = ["<think>", "</think>", "<|channel|>", "<|end|>", "<|message|>", "<", "|", ">"]
TEXT = st.lists(st.sampled_from([*SPELLED, "a", "b", " ", "\n", "é", "思"]), max_size=12).map(
    "".join
)
PLAIN_TEXT = TEXT.filter(lambda t: "<" not in t)  # no marker written as text in it


def chunked(pieces, data) -> list[list]:
    """`pieces` with every text piece cut at drawn places, then grouped into drawn feeds."""
    flat = []
    for p in pieces:
        if isinstance(p, str) and p:
            cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(p) - 1)), max_size=3)))
            edges = [0, *[c for c in cuts if c < len(p)], len(p)]
            flat += [p[a:b] for a, b in zip(edges, edges[1:], strict=False)]
        elif not isinstance(p, str):
            flat.append(p)
    groups, i = [], 0
    while i < len(flat):
        k = data.draw(st.integers(1, 3))
        groups.append(flat[i : i + k])
        i += k
    return groups


def fed(parser, groups) -> Parsed:
    out = Parsed()
    for g in groups:
        out.add(parser.feed(g))
    return out.add(parser.finish())


def same(a: Parsed, b: Parsed) -> bool:
    return (a.reasoning, a.content, a.calls) == (b.reasoning, b.content, b.calls)


@settings(max_examples=200, deadline=None)
@given(before=TEXT, reasoning=TEXT, content=TEXT, inside=st.booleans(), data=st.data())
def test_think_any_split_reads_as_the_whole_and_spelled_markers_stay_text(
    before, reasoning, content, inside, data
):
    before = "" if inside else before
    pieces = [before, *([] if inside else [Marker(THINK_OPEN)]), reasoning, Marker(THINK_CLOSE)]
    pieces.append(content)
    whole = parse_all(ThinkParser(inside), pieces)
    assert whole.reasoning == reasoning.strip()
    assert whole.content == before + content.lstrip()
    assert same(fed(ThinkParser(inside), chunked(pieces, data)), whole)


@settings(max_examples=200, deadline=None)
@given(before=PLAIN_TEXT, reasoning=PLAIN_TEXT, content=PLAIN_TEXT, data=st.data())
def test_think_on_text_any_split_reads_as_the_whole(before, reasoning, content, data):
    text = f"{before}{THINK_OPEN}{reasoning}{THINK_CLOSE}{content}"
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=False)]
    splitter, parser, out = TextMarkers((THINK_OPEN, THINK_CLOSE)), ThinkParser(), Parsed()
    for c in chunks:
        step = parser.feed(splitter.split(c))
        assert not step.content.endswith("<") and not step.reasoning.endswith("<")
        out.add(step)
    out.add(parser.feed(splitter.flush())).add(parser.finish())
    assert (out.reasoning, out.content) == (reasoning.strip(), before + content.lstrip())


def test_text_that_may_start_a_marker_is_held_until_decided_and_given_up_at_the_end():
    splitter = TextMarkers((THINK_OPEN, THINK_CLOSE))
    assert splitter.split("answer <thi") == ["answer "]
    assert splitter.split("ng") == ["<thing"]
    assert splitter.split("x </") == ["x "]
    assert splitter.split("think>y") == [Marker(THINK_CLOSE), "y"]
    assert splitter.split("z <") == ["z "]
    assert splitter.flush() == ["<"]


def test_think_drops_the_framing_whitespace_and_keeps_the_rest():
    pieces = [Marker(THINK_OPEN), "\n", "a\n", "\n b", "  \n", Marker(THINK_CLOSE), "\n\n", "x \n"]
    assert parse_all(ThinkParser(), pieces) == Parsed("a\n\n b", "x \n")
    # output that starts inside (the template opened <think>) and is cut short in it
    assert parse_all(ThinkParser(inside=True), ["\nidea ", "more  "]) == Parsed("idea more")
    # a close outside and a second open inside are not content
    pieces = [Marker(THINK_CLOSE), "a", Marker(THINK_OPEN), "r", Marker(THINK_OPEN), "s"]
    assert parse_all(ThinkParser(), pieces) == Parsed("rs", "a")


S, E, M, C = (Marker(m) for m in (harmony.START, harmony.END, harmony.MESSAGE, harmony.CHANNEL))
K, RET, CALL = Marker(harmony.CONSTRAIN), Marker(harmony.RETURN), Marker(harmony.CALL)
ARGS = st.dictionaries(st.sampled_from(["city", "days", "q"]), st.integers() | TEXT, max_size=3)
MESSAGES = st.lists(
    st.one_of(
        st.tuples(st.just("analysis"), TEXT),
        st.tuples(st.just("final"), TEXT),
        st.tuples(st.just("commentary"), TEXT),  # a preamble: content
        st.tuples(st.sampled_from(["get_weather", "noop"]), ARGS.map(json.dumps)),
    ),
    min_size=1,
    max_size=4,
)


def harmony_output(messages, ending) -> tuple[list, Parsed]:
    """A harmony output after the prompt's `<|start|>assistant`, and what it holds."""
    pieces, expected = [], Parsed()
    for k, (kind, body) in enumerate(messages):
        if k:
            pieces += [S, "assistant"]
        call = kind not in ("analysis", "final", "commentary")
        if call:
            pieces += [C, f"commentary to=functions.{kind} ", K, "json", M, body]
            expected.calls.append(ToolCall(kind, json.dumps(json.loads(body))))
        else:
            pieces += [C, kind, M, body]
            if kind == "analysis":
                expected.reasoning += body
            else:
                expected.content += body
        if k < len(messages) - 1:
            pieces.append(CALL if call else E)
        elif ending is not None:  # the last one's end is usually a stop token, never seen
            pieces.append(ending)
    return pieces, expected


def primed() -> HarmonyParser:
    parser = HarmonyParser()
    parser.prime([S, "assistant"])
    return parser


@settings(max_examples=200, deadline=None)
@given(messages=MESSAGES, ending=st.sampled_from([None, RET, CALL, E]), data=st.data())
def test_harmony_any_split_reads_as_the_whole_and_spelled_markers_stay_text(messages, ending, data):
    pieces, expected = harmony_output(messages, ending)
    whole = parse_all(primed(), pieces)
    assert same(whole, expected)
    assert same(fed(primed(), chunked(pieces, data)), whole)


def test_harmony_reads_the_recipient_in_either_part_of_the_header_and_its_preambles():
    args = '{"city": "Oslo"}'
    in_role = [" to=functions.get_weather", C, "commentary json", M, args, CALL]
    assert parse_all(primed(), in_role).calls == [ToolCall("get_weather", args)]
    in_channel = [C, "commentary to=functions.get_weather", K, "json", M, args]
    assert parse_all(primed(), in_channel).calls == [ToolCall("get_weather", args)]
    # a call whose body is not a JSON object is not a call: its text goes where its channel's would
    assert parse_all(primed(), [C, "commentary to=functions.x", M, "oops", CALL]) == Parsed(
        "", "oops"
    )
    assert parse_all(primed(), [C, "analysis to=python", M, "print(1)", CALL]) == Parsed("print(1)")


def test_harmony_output_that_does_not_keep_the_format_is_content():
    assert parse_all(primed(), ["Hello there"]) == Parsed("", "Hello there")
    assert parse_all(HarmonyParser(), ["Hi", S, "assistant", C, "final", M, "ok"]) == Parsed(
        "", "Hiok"
    )
    # a header cut short says nothing
    assert parse_all(primed(), [C, "analy"]) == Parsed()


def deltas(pieces, data) -> tuple[list[TextDelta], str, list[Mark]]:
    """An output as the engine hands it out: the text with the markers kept out of it (each a
    `Mark` at its offset), cut into deltas at drawn places, each mark in the delta that shows the
    text before it, or in an empty delta of its own."""
    ids = {m: 900 + k for k, m in enumerate([THINK_OPEN, THINK_CLOSE, *harmony.MARKERS])}
    text, marks = "", []
    for p in pieces:
        if isinstance(p, str):
            text += p
        else:
            marks.append(Mark(len(text), ids[p.text]))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)) | {len(text)})
    out, at, pending = [], 0, list(marks)
    for cut in cuts:
        reached = [m for m in pending if m.offset <= cut]
        pending = pending[len(reached) :]
        at_cut = sum(m.offset == cut for m in reached)  # the last ones: some may come later
        later = data.draw(st.integers(0, at_cut))
        alone, with_text = reached[len(reached) - later :], reached[: len(reached) - later]
        out.append(TextDelta(text[at:cut], (), tuple(with_text)))
        if alone:
            out.append(TextDelta("", (), tuple(alone)))
        at = cut
    return out, text, marks


@settings(max_examples=200, deadline=None)
@given(messages=MESSAGES, data=st.data())
def test_a_choice_read_delta_by_delta_reads_as_the_finished_choice(messages, data):
    pieces, expected = harmony_output(messages, None)
    ids = {900 + k: m for k, m in enumerate([THINK_OPEN, THINK_CLOSE, *harmony.MARKERS])}
    stream, text, marks = deltas(pieces, data)
    reader = ChoiceReader(primed(), ids, None)
    out = Parsed()
    for d in stream:
        out.add(reader.read(d))
    out.add(reader.finish())
    assert same(out, expected)
    assert same(ChoiceReader(primed(), ids, None).whole(text, marks), expected)
