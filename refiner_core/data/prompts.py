"""The refiner's prompt: system instructions plus the agent's reasoning and raw tool output."""

from __future__ import annotations

import re
from dataclasses import dataclass

REFINER_SYSTEM_PROMPT = (
    "You are a research refiner. You receive a question, a search agent's reasoning and the raw output of a "
    "search tool. Write exactly one <answer>...</answer> block that answers the question. Wrap every factual "
    "claim as <snippet id=ID1,ID2>claim</snippet>, citing only snippet IDs that appear in the tool output. "
    "Do not add facts that the snippets do not support."
)


def refiner_messages(question: str, reasoning: str, tool_output: str) -> list[dict]:
    user = (
        f"Question:\n{question}\n\n"
        f"Agent reasoning:\n{reasoning}\n\n"
        f"Search tool output:\n{tool_output}\n\n"
        "Write the refined answer."
    )
    return [{"role": "system", "content": REFINER_SYSTEM_PROMPT}, {"role": "user", "content": user}]


class UnsafeTemplateError(ValueError):
    """The chat template rewrites message contents, so untrusted text cannot be told apart from its structure."""


# Private-use characters: never in real data, and survive any template that copies content verbatim.
_SLOT = "\ue000refiner-slot-{}\ue001"
_SLOT_RE = re.compile("\ue000refiner-slot-(\\d+)\ue001")


@dataclass
class RenderedChat:
    text: str  # exactly what apply_chat_template renders
    input_ids: list[int]
    offsets: list[tuple[int, int]]  # character span of each token in `text`
    content_spans: list[tuple[int, int]]  # where message contents (untrusted text) lie in `text`


def _special_pattern(tokenizer, special: bool = True) -> re.Pattern | None:
    """The tokenizer's added tokens marked special (or, special=False, those that are not: Qwen's <tool_call>,
    <tool_response>, <think>, which split_special_tokens does not keep text from matching)."""
    added = sorted(
        {t.content for t in tokenizer.added_tokens_decoder.values() if t.special is special}, key=len, reverse=True
    )  # longest first: leftmost-longest, as the tokenizer itself matches
    return re.compile("|".join(map(re.escape, added))) if added else None


def _layout(tokenizer, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[str, int | None]]]:
    """The rendering and its pieces as (text, index of the message whose content it is, or None for the template's
    structure). Renders once with a marker in place of each message's content to learn where the template puts
    contents, then checks that putting them back gives the real rendering (a template that strips or rewrites
    content fails the check)."""
    real = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    masked = [
        {**m, "content": _SLOT.format(i)} if isinstance(m.get("content"), str) else m for i, m in enumerate(messages)
    ]
    skeleton = tokenizer.apply_chat_template(masked, tokenize=False, add_generation_prompt=add_generation_prompt)
    pieces: list[tuple[str, int | None]] = []
    cursor = 0
    for match in _SLOT_RE.finditer(skeleton):
        pieces.append((skeleton[cursor : match.start()], None))
        pieces.append((messages[int(match.group(1))]["content"], int(match.group(1))))
        cursor = match.end()
    pieces.append((skeleton[cursor:], None))
    if "".join(text for text, _ in pieces) != real:
        raise UnsafeTemplateError(
            "chat template does not copy message contents verbatim; cannot keep untrusted text out of special tokens"
        )
    return real, pieces


def render_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, boundaries: tuple[int, ...] = ()
) -> RenderedChat:
    """Render a conversation and tokenize it so that only the template's own structure can become special
    tokens: message contents (questions, reasoning, tool output, responses: untrusted text from the web or the
    policy) are tokenized as plain text even where they spell '<|im_end|>' or '<|endoftext|>'.

    The rendering is cut at the special tokens found in the template's structure pieces; each chunk between
    them (structure text and content together, as the tokenizer itself would see it) is tokenized with
    split_special_tokens=True. For content without special-token strings this is exactly what
    tokenizer(text, add_special_tokens=False) gives, so benign prompts keep their token ids. `boundaries`:
    character offsets where the text is cut as well, so that no token crosses them (the text before one is
    tokenized as if the rendering ended there)."""
    pattern = _special_pattern(tokenizer)
    try:
        text, pieces = _layout(tokenizer, messages, add_generation_prompt)
    except UnsafeTemplateError:
        # A template that rewrites contents: still safe when no content spells a special token.
        if pattern is not None and any(
            isinstance(m.get("content"), str) and pattern.search(m["content"]) for m in messages
        ):
            raise
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        ids, offsets = [], []
        for start, end in _between(0, len(text), boundaries):
            enc = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True)
            ids.extend(enc["input_ids"])
            offsets.extend((start + a, start + b) for a, b in enc["offset_mapping"])
        return RenderedChat(text, ids, offsets, [])
    cuts: list[tuple[int, int]] = []  # [start, end) of each structure special token in `text`
    content_spans: list[tuple[int, int]] = []
    # Added tokens that are not special (a template's <tool_call>, <tool_response>) are matched in any text: in
    # what is not the assistant's own (tool results, questions) each is cut after its first character, so a tool
    # result that prints </tool_response> cannot end the template's block. An assistant's <tool_call> stays one
    # token, as it was sampled.
    forgeable = _special_pattern(tokenizer, special=False)
    pos = 0
    for piece, message in pieces:
        if message is not None:
            content_spans.append((pos, pos + len(piece)))
            if forgeable is not None and messages[message].get("role") != "assistant":
                boundaries = (*boundaries, *(pos + m.start() + 1 for m in forgeable.finditer(piece)))
        elif pattern is not None:
            cuts.extend((pos + m.start(), pos + m.end()) for m in pattern.finditer(piece))
        pos += len(piece)
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []

    def plain(start: int, end: int) -> None:
        for a, b in _between(start, end, boundaries):
            enc = tokenizer(text[a:b], add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
            ids.extend(enc["input_ids"])
            offsets.extend((a + x, a + y) for x, y in enc["offset_mapping"])

    cursor = 0
    for start, end in cuts:
        plain(cursor, start)
        ids.append(tokenizer.convert_tokens_to_ids(text[start:end]))
        offsets.append((start, end))
        cursor = end
    plain(cursor, len(text))
    return RenderedChat(text, ids, offsets, content_spans)


def _between(start: int, end: int, boundaries: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, end) cut at the boundaries inside it, empty pieces left out."""
    cuts = [start, *sorted(b for b in boundaries if start < b < end), end]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]


def render_prompt(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """The prompt text (with the generation prompt) and its token ids; message contents never become special
    tokens (see render_chat)."""
    rendered = render_chat(tokenizer, messages, add_generation_prompt=True)
    return rendered.text, rendered.input_ids


JUDGE_SYSTEM_PROMPT = (
    "You are a strict grader. Read the question, the response and one criterion. Decide how well the response "
    'meets the criterion: 0 = not at all, 1 = partially, 2 = fully. Reply with JSON only: {"score": 0}, '
    '{"score": 1} or {"score": 2}.'
)


def judge_messages(question: str, response: str, criterion: str) -> list[dict]:
    user = f"Question:\n{question}\n\nResponse:\n{response}\n\nCriterion:\n{criterion}\n\nJSON:"
    return [{"role": "system", "content": JUDGE_SYSTEM_PROMPT}, {"role": "user", "content": user}]


CLAIM_SUPPORT_SYSTEM_PROMPT = (
    "You are a strict fact checker. Read a claim and the source text it cites. Decide how well the sources "
    "support the claim: 0 = not at all (or off-topic), 1 = partially, 2 = fully. Reply with JSON only: "
    '{"score": 0}, {"score": 1} or {"score": 2}.'
)


def claim_support_messages(claim: str, sources: list[tuple[str, str]]) -> list[dict]:
    """The judge prompt rating one claim against the text of its cited snippets ((id, text) pairs)."""
    cited = "\n\n".join(f"[{sid}] {text}" for sid, text in sources)
    user = f"Sources:\n{cited}\n\nClaim:\n{claim}\n\nJSON:"
    return [{"role": "system", "content": CLAIM_SUPPORT_SYSTEM_PROMPT}, {"role": "user", "content": user}]
