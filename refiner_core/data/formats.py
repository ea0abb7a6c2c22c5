"""The refiner output format: one <answer> block, claims wrapped as <snippet id=ID1,ID2>claim</snippet>."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Accept id=a,b / id="a,b" / id='a, b'; IDs are split on commas so a multi-ID citation keeps every ID.
# An ID list holds no "<": `<snippet id=FAKE,<>` in a snippet's text is a broken tag, not a list of two IDs.
_SNIPPET_OPEN_RE = re.compile(r"<snippet\s+id\s*=\s*[\"']?([^\"'<>]*?)[\"']?\s*>")
_SNIPPET_CLOSE = "</snippet>"
# Where a snippet tag in any spelling starts, closed or not: each must begin a tag exactly the format's.
_SNIPPET_TAG_START_RE = re.compile(r"<\s*/?\s*snippet\b", re.IGNORECASE)
_ANY_TAG_RE = re.compile(r"</?snippet\b[^>]*>")
# Markup that only looks like the format's: an answer tag with attributes, spaces or capitals anywhere, and inside
# the block any tag but a snippet's (`<b>`, `<cite id=x>`, `</p>`; not "a < b" or "a<b and c>d").
_ANSWER_LIKE_RE = re.compile(r"<\s*/?\s*answer\b[^<>]*>", re.IGNORECASE)
# A tag in any script or look-alike: a name of letters of any alphabet (Cyrillic "ѕ" for "s"), with invisible
# format characters or a namespace colon in it, in "<>" or their full-width or quotation look-alikes. Only the
# format's own spelling is a citation; the judge reads the others as one.
_OPENS, _CLOSES, _INVISIBLE = "<\uff1c\u2039", ">\uff1e\u203a", "\u00ad\u200b-\u200f\u2060-\u2064\ufeff"
_TAG_RE = re.compile(
    rf"[{_OPENS}]/?((?:[^\W\d_]|[{_INVISIBLE}])(?:[\w:-]|[{_INVISIBLE}])*)"
    rf"(?:\s+[\w-]+\s*=[^<>{_OPENS}{_CLOSES}]*)?\s*/?[{_CLOSES}]"
)
# A snippet tag in any spelling (`<Snippet id=D1>`, `< snippet id=D1>`, `</SNIPPET >`): every one must be exactly
# the format's, or a citation the judge reads would count as none.
SNIPPET_LIKE_RE = re.compile(r"<\s*/?\s*snippet\b[^<>]*>", re.IGNORECASE)


@dataclass(frozen=True)
class Citation:
    ids: tuple[str, ...]
    claim: str


@dataclass(frozen=True)
class ParsedAnswer:
    has_answer: bool  # exactly one well-delimited <answer>...</answer>
    answer_text: str  # inside the block ('' when absent)
    citations: tuple[Citation, ...] = ()
    well_formed: bool = False  # tags balanced, not nested, no empty id lists or claims
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def cited_ids(self) -> list[str]:
        return [i for c in self.citations for i in c.ids]


def split_ids(raw: str) -> tuple[str, ...]:
    """The IDs of an id list, each once, in order of first mention: `id=P1,P1,X` cites P1 and X (a repeated ID is
    markup that says nothing more, and counted again it would water down an invented one)."""
    return tuple(dict.fromkeys(part.strip() for part in raw.split(",") if part.strip()))


SNIPPET_FIELDS = (("title", "Title"), ("url", "URL"), ("text", "Text"))
_PLAIN_ID_RE = re.compile(r"[^\s,\"'<>]+")


def render_snippets(snippets: list) -> str:
    """Tool output given as a list of snippet objects {id, text, title?, url?}, in the text form the prompts and
    the citation checks read: one <snippet id=ID>Title: ...\nURL: ...\nText: ...</snippet> block per snippet.
    Raises ValueError naming the first snippet that cannot be rendered faithfully."""
    blocks, texts = [], {}
    for i, snippet in enumerate(snippets):
        if not isinstance(snippet, dict):
            raise ValueError(
                f"snippet {i}: expected an object {{id, text, title?, url?}}, got {type(snippet).__name__}"
            )
        unknown = set(snippet) - {"id", *(key for key, _ in SNIPPET_FIELDS)}
        if unknown:
            raise ValueError(f"snippet {i}: unknown keys {sorted(unknown)}; expected id, text, title, url")
        sid = snippet.get("id")
        sid = str(sid) if isinstance(sid, int) and not isinstance(sid, bool) else sid
        if not isinstance(sid, str) or not _PLAIN_ID_RE.fullmatch(sid):
            raise ValueError(
                f"snippet {i}: 'id' must be a non-empty ID without spaces, commas, quotes or angle "
                f"brackets, got {sid!r}"
            )
        wrong = [key for key, _ in SNIPPET_FIELDS if not isinstance(snippet.get(key), (str, type(None)))]
        if wrong:
            raise ValueError(f"snippet {i} ({sid}): {wrong[0]!r} must be a string")
        if not (snippet.get("text") or "").strip():
            raise ValueError(f"snippet {i} ({sid}): 'text' is empty")
        body = "\n".join(f"{label}: {snippet[key]}" for key, label in SNIPPET_FIELDS if snippet.get(key))
        if _SNIPPET_TAG_START_RE.search(body):  # `<snippet id=X` without its ">": the block's own close ends it
            raise ValueError(f"snippet {i} ({sid}): its text holds snippet tags")
        if texts.setdefault(sid, body) != body:
            raise ValueError(f"snippet {i} ({sid}): an earlier snippet has this ID and another text")
        blocks.append(f"<snippet id={sid}>{body}</snippet>")
    return "\n".join(blocks)


def has_empty_id(raw: str) -> bool:
    """An ID list with an empty entry ('a, ,b', 'a,', ',a'): a citation that lost an ID, not a shorter one."""
    return any(not part.strip() for part in raw.split(","))


def tool_output_problem(tool_output: str) -> str | None:
    """Why tool output given as text is not a sequence of whole <snippet id=...>...</snippet> blocks (text between
    them is free), or None. The same rules as a rendered list: plain IDs, no snippet tag inside a snippet's text,
    one text per ID (a snippet given twice is given with the same text)."""
    return read_tool_output(tool_output)[1]


def tool_snippet_ids(tool_output: str) -> list[str]:
    """IDs of the snippets in raw search-tool output, in order of appearance, without duplicates: those of the
    well-formed blocks before any problem tool_output_problem names."""
    return list(read_tool_output(tool_output)[0])


def read_tool_output(tool_output: str) -> tuple[dict[str, str], str | None]:
    """(snippet ID -> its text, stripped; the first problem or None). IDs come only from whole blocks of the
    format's own markup: a tag in a snippet's text, or one cut off (`<snippet id=FAKE, then`), is a problem and
    never an ID."""
    texts: dict[str, str] = {}
    opened = None  # the open snippet's tag
    for tag in _SNIPPET_TAG_START_RE.finditer(tool_output):
        at = tag.start()
        opening = _SNIPPET_OPEN_RE.match(tool_output, at)
        if opening is None and not tool_output.startswith(_SNIPPET_CLOSE, at):
            shown = re.match(r"[^<>]*>?", tool_output[at + 1 : at + 80]).group(0)
            return texts, f"malformed snippet tag {'<' + shown!r} at offset {at}"
        if (opening is not None) == (opened is not None):
            what = "a snippet tag inside a snippet's text" if opened else "a closing tag with no snippet open"
            return texts, f"{what} at offset {at}"
        if opening is not None:
            raw = opening.group(1)
            if any(not _PLAIN_ID_RE.fullmatch(i.strip()) for i in raw.split(",")):
                return texts, f"snippet id list {raw!r} at offset {at} holds an empty ID or one with spaces"
            opened = opening
            continue
        text = tool_output[opened.end() : at].strip()
        for sid in split_ids(opened.group(1)):
            if texts.setdefault(sid, text) != text:
                return texts, f"snippet ID {sid!r} at offset {opened.start()} was given before with another text"
        opened = None
    return texts, ("an unclosed snippet at the end" if opened is not None else None)


def parse_answer(text: str) -> ParsedAnswer:
    problems: list[str] = []
    blocks = _ANSWER_RE.findall(text)
    if text.count(ANSWER_OPEN) != 1 or text.count(ANSWER_CLOSE) != 1 or len(blocks) != 1:
        return ParsedAnswer(False, "", problems=("expected exactly one <answer>...</answer> block",))
    body = blocks[0]
    citations = []
    spans, nested = snippet_spans(body)
    if nested:
        problems.append("nested snippet tags")
    for raw, claim in spans:
        if raw is None:
            continue
        ids, claim = split_ids(raw), claim.strip()
        if not ids:
            problems.append("snippet tag with no id")
        elif has_empty_id(raw):
            problems.append(f"empty id in snippet id list {raw!r}")
        spaced = [i for i in ids if not _PLAIN_ID_RE.fullmatch(i)]
        if spaced:
            problems.append(f"id {spaced[0]!r} is not one ID: IDs are separated by commas")
        if not has_words(claim):
            problems.append("snippet with empty claim")
        citations.append(Citation(ids, claim))
    stray = [t for t in _ANSWER_LIKE_RE.findall(text) if t not in (ANSWER_OPEN, ANSWER_CLOSE)]
    if stray:
        problems.append(f"stray or malformed answer tag {stray[0]!r}")
    odd = [t for t in SNIPPET_LIKE_RE.findall(body) if t != _SNIPPET_CLOSE and not _SNIPPET_OPEN_RE.fullmatch(t)]
    if odd:
        problems.append(f"malformed snippet tag {odd[0]!r}")
    other = [m.group(0) for m in _TAG_RE.finditer(body) if not _plain_tag(m, ("snippet", "answer"))]
    if other:
        problems.append(f"tag {other[0]!r} in the answer: only <snippet id=...> tags belong there")
    opens = len(_SNIPPET_OPEN_RE.findall(body))
    closes = body.count(_SNIPPET_CLOSE)
    if opens != closes or len(_ANY_TAG_RE.findall(body)) != opens + closes:
        problems.append(f"unbalanced or malformed snippet tags ({opens} open, {closes} close)")
    if not body.strip():
        problems.append("empty answer")
    return ParsedAnswer(True, body.strip(), tuple(citations), not problems, tuple(problems))


def snippet_spans(body: str) -> tuple[list[tuple[str | None, str]], bool]:
    """The answer body cut at every snippet tag in any spelling: (the opening tag's raw ID list, the text up to the
    next tag) after a tag of the format's own spelling, (None, text) for the rest; and whether a citation opened
    inside another. Well-formed markup reads as the format says; in nested or unclosed markup every cited ID still
    has its own span, never hidden in another citation's claim, and a closing tag in any spelling ends a claim."""
    spans: list[tuple[str | None, str]] = []
    raw, cursor, depth, nested = None, 0, 0, False
    for tag in SNIPPET_LIKE_RE.finditer(body):
        spans.append((raw, body[cursor : tag.start()]))
        opening = _SNIPPET_OPEN_RE.fullmatch(tag.group(0))
        closing = tag.group(0).lstrip("<").lstrip().startswith("/")
        nested |= opening is not None and depth > 0
        depth = depth + 1 if opening is not None else max(depth - 1, 0) if closing else depth
        raw = opening.group(1) if opening is not None else None
        cursor = tag.end()
    spans.append((raw, body[cursor:]))
    return spans, nested


def has_words(text: str) -> bool:
    """Text holding a letter or digit of any script: not blank, punctuation or invisible characters only."""
    return any(ch.isalnum() for ch in text)


def _plain_tag(match: re.Match, names: tuple[str, ...]) -> bool:
    """A tag of these names in ASCII brackets (its spelling and attributes are checked apart)."""
    text = match.group(0)
    return text[0] == "<" and text[-1] == ">" and match.group(1).lower() in names


@dataclass(frozen=True)
class CitationCheck:
    n_citations: int
    n_invalid: int
    invalid_ids: tuple[str, ...]

    @property
    def score(self) -> float:
        """Fraction of cited IDs present in the tool output; 0 when nothing is cited."""
        return 0.0 if self.n_citations == 0 else (self.n_citations - self.n_invalid) / self.n_citations


def check_citations(parsed: ParsedAnswer, valid_ids: list[str] | set[str]) -> CitationCheck:
    valid = set(valid_ids)
    cited = parsed.cited_ids
    invalid = tuple(i for i in cited if i not in valid)
    return CitationCheck(len(cited), len(invalid), invalid)
