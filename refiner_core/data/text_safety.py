"""Text from the data (model and tool output, SQL results, error messages quoting them) made safe to show.

On a terminal, control characters are commands: ESC starts sequences that set the window title, print hidden
hyperlinks or move the cursor, and a carriage return overwrites what was printed. In the Prefect UI, markdown
and raw HTML in a model's answer would be rendered: images fetched from anywhere, links, markup. The functions
here keep every character visible instead of dropping it, so nothing is lost silently.
"""

from __future__ import annotations

import re

# C0 but tab and newline, DEL, C1; and the bidirectional overrides and isolates, which reorder what follows them
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
# Characters with a meaning in markdown (CommonMark's ASCII punctuation that changes rendering; ':' and '@' end
# GitHub-flavoured bare links such as http://… and name@host)
_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_{}\[\]()#+\-.!|~>:@])")


# Not data: C0 controls but tab, newline and carriage return; DEL; C1 controls. NUL truncates text in C-based tools,
# and escape sequences or stray controls in a prompt or rubric are noise the policy (or the judge) would read.
DATA_CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# A UTF-16 surrogate left unpaired by a JSON escape ("\ud800"): valid JSON, but no UTF-8 text can hold it, so
# tokenizers, Parquet and terminals fail on it.
LONE_SURROGATES = re.compile(r"[\ud800-\udfff]")


def found_at(pattern: re.Pattern, text: str) -> str | None:
    """Where `pattern` first matches TEXT, "holds U+001B at offset 3", or None."""
    found = pattern.search(text)
    return f"holds U+{ord(found.group()):04X} at offset {found.start()}" if found else None


def unusable_character(text: str) -> str | None:
    """Why TEXT cannot be data, else None: "holds U+001B at offset 3 (a control character)", or a lone surrogate."""
    kinds = ((LONE_SURROGATES, "a lone UTF-16 surrogate"), (DATA_CONTROL_CHARACTERS, "a control character"))
    for pattern, what in kinds:
        found = found_at(pattern, text)
        if found:
            return f"{found} ({what})"
    return None


def visible(text: str) -> str:
    """TEXT with each control character but newline and tab written out as an escape (ESC as `\\x1b`, the
    right-to-left override as `\\u202e`), so printing it cannot drive the terminal."""
    return _CONTROL.sub(_escape_control, text)


def _escape_control(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def markdown_inline(text: str) -> str:
    """TEXT as literal markdown on one line: HTML characters as entities, markdown punctuation backslash-escaped,
    line breaks as spaces; no link, image, emphasis or HTML survives."""
    text = visible(" ".join(text.split())).replace("&", "&amp;").replace("<", "&lt;")
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", text)


def markdown_code_block(text: str) -> str:
    """TEXT verbatim in a fenced code block: markdown and HTML inside are shown, not rendered. The fence is longer
    than any run of backticks in TEXT, so TEXT cannot close it."""
    text = visible(text)
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"
