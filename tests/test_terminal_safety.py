"""Text from the data cannot drive the terminal or the UI: `refiner sql`/`show` show control characters as escapes
and rich markup as text, DuckDB's errors are whole, tables are as wide as the terminal; the step artifacts show
model output as text and the curves inside the UI."""

from __future__ import annotations

import base64
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from typer.testing import CliRunner

from flows.cli import app
from refiner_core.data.text_safety import markdown_code_block, markdown_inline, visible
from refiner_core.publish.plots import DPI, EMBEDDED_PNG_BYTES, MIN_EMBEDDED_DPI, plot_steps_embedded
from test_cli import _catalog

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
ESC = "\x1b"
# What a tool's output may hold: a window title, a hidden hyperlink, a screen clear, a carriage return that
# overwrites the line, and an image and raw HTML for a markdown page
TITLE = f"{ESC}]0;pwned{chr(7)}"
HIDDEN_LINK = f"{ESC}]8;;http://127.0.0.1:9/x{ESC}\\click{ESC}]8;;{ESC}\\"
HOSTILE = (
    f"answer {TITLE}{HIDDEN_LINK} {ESC}[2J\rover ![m](http://127.0.0.1:9/m.png) "
    "<img src=http://127.0.0.1:9/i.png> [link=http://127.0.0.1:9/]rich[/link] [/INST] end"
)
MARKDOWN = MarkdownIt("commonmark")


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory) -> Path:
    """Two steps; the last step's best rollout is HOSTILE, from a prompt whose ID holds a title sequence."""
    key = lambda s, p, i: {"run": "hostile", "step": s, "prompt_id": p, "sample_idx": i}  # noqa: E731
    prompts = ("p1", f"p{TITLE}2")
    texts = {("p1", 0): "plain", ("p1", 1): "also plain", (prompts[1], 0): "worst", (prompts[1], 1): HOSTILE}
    rollouts = [
        key(s, p, i) | {"response_tokens": 5, "response_text": texts[(p, i)]}
        for s in (0, 1)
        for p in prompts
        for i in (0, 1)
    ]
    rewards = [
        key(s, p, i)
        | {
            "reward_version": "train",
            "reward": {"plain": 0.5, "also plain": 0.6, "worst": 0.0, HOSTILE: 1.0}[texts[(p, i)]],
        }
        for s in (0, 1)
        for p in prompts
        for i in (0, 1)
    ]
    steps = [
        {
            "run": "hostile",
            "step": s,
            "reward_mean": 0.5,
            "reward_std": 0.1,
            "kl": 0.01,
            "loss": 0.2,
            "response_length_mean": 5.0,
        }
        for s in (0, 1)
    ]
    return _catalog(
        tmp_path_factory.mktemp("hostile") / "hostile", {"steps": steps, "rollouts": rollouts, "rewards": rewards}
    )


def _no_control_characters(text: str) -> None:
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", text), repr(text)


def test_visible_writes_control_characters_out():
    text = f"a{TITLE}b\r\x00\x7f\x85\x9b[31m\u202eevil\nline\ttab é 中 🙂"
    assert visible(text) == ("a\\x1b]0;pwned\\x07b\\x0d\\x00\\x7f\\x85\\x9b[31m\\u202eevil\nline\ttab é 中 🙂")


def test_markdown_helpers_render_no_image_link_or_html():
    inline = MARKDOWN.render(markdown_inline(HOSTILE))
    block = MARKDOWN.render(markdown_code_block(HOSTILE))
    for html in (inline, block):
        assert "<img" not in html and "<a " not in html and "<script" not in html, html
        assert "![m](http://127.0.0.1:9/m.png)" in html and "&lt;img src=http://127.0.0.1:9/i.png&gt;" in html
        assert "\\x1b]0;pwned\\x07" in html
    assert block.startswith("<pre><code") and block.count("<code") == 1
    fenced = "text ```` with a longer fence\n```\n![m](http://127.0.0.1:9/m.png)"
    html = MARKDOWN.render(markdown_code_block(fenced))
    assert html.count("<pre>") == 1 and "<img" not in html and "with a longer fence" in html
    assert "\\@" in markdown_inline("name@host") and "http\\:" in markdown_inline("http://host")


def test_rollouts_markdown_shows_model_output_as_text():
    from tasks.artifacts import EXCERPT_CHARS, rollouts_markdown

    long_text = HOSTILE + "x" * EXCERPT_CHARS
    summary = {
        "best": {
            "step": 1,
            "prompt_id": "p`1` ![i](http://127.0.0.1:9/p.png)",
            "sample_idx": 0,
            "reward": 1.0,
            "response_text": long_text,
        },
        "worst": {"step": 1, "prompt_id": "p2", "sample_idx": 1, "reward": 0.0, "response_text": None},
    }
    html = MARKDOWN.render(rollouts_markdown("run<b>", 1, summary))
    assert "<img" not in html and "<a " not in html and "<b>" not in html, html
    assert "![m](http://127.0.0.1:9/m.png)" in html and "p`1` ![i](http://127.0.0.1:9/p.png)" in html
    assert f"{len(long_text) - EXCERPT_CHARS} more characters" in html


def _png_width(png: bytes) -> int:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", png[16:20])[0]


def _png_colour_type(png: bytes) -> int:
    """The IHDR colour type: 2 RGB, 3 palette, 6 RGBA."""
    return png[25]


def test_curves_are_embedded_as_a_bounded_data_uri(tmp_path):
    steps = [
        {
            "run": "r",
            "step": s,
            "reward_mean": s / 10,
            "reward_std": 0.1,
            "kl": 0.01 * s,
            "loss": 0.2,
            "response_length_mean": 10.0 + s,
        }
        for s in range(10)
    ]
    uri = plot_steps_embedded(steps, tmp_path / "curves.png")
    assert uri.startswith("data:image/png;base64,")
    png = base64.b64decode(uri.removeprefix("data:image/png;base64,"))
    assert len(png) <= EMBEDDED_PNG_BYTES and _png_width(png) == 9 * DPI  # small enough as drawn
    assert _png_width((tmp_path / "curves.png").read_bytes()) == 9 * DPI
    assert _png_colour_type(png) == 6  # RGBA, as matplotlib draws it

    def embedded(max_bytes: int) -> bytes:
        uri = plot_steps_embedded(steps, tmp_path / "again.png", max_bytes=max_bytes)
        assert (tmp_path / "again.png").read_bytes() == png  # the file keeps every colour and its resolution
        return base64.b64decode(uri.split(",", 1)[1])

    palette = embedded(len(png) // 2)
    assert len(palette) <= len(png) // 2 and _png_colour_type(palette) == 3 and _png_width(palette) == 9 * DPI
    smaller = embedded(len(palette) * 3 // 4)
    assert len(smaller) <= len(palette) * 3 // 4 and 9 * MIN_EMBEDDED_DPI <= _png_width(smaller) < 9 * DPI
    floor = embedded(1)  # cannot fit: the smallest allowed
    assert _png_width(floor) == 9 * MIN_EMBEDDED_DPI


def test_sql_prints_markup_and_control_characters_as_text(hostile_run):
    result = runner.invoke(
        app,
        [
            "sql",
            str(hostile_run),
            "--max-width",
            "0",
            "SELECT '[/INST] hi' AS t, '[link=http://127.0.0.1:9/]x[/link]' AS \"[bold]h\", "
            "response_text FROM rollouts WHERE response_text LIKE 'answer%' LIMIT 1",
        ],
        env={"COLUMNS": "400"},
    )  # wide enough that no cell is folded
    assert result.exit_code == 0, result.output
    _no_control_characters(result.output)
    out = result.output
    for text in (
        "[/INST] hi",
        "[link=http://127.0.0.1:9/]x[/link]",
        "[bold]h",
        "\\x1b]0;pwned\\x07",
        "\\x1b]8;;http://127.0.0.1:9/x\\x1b\\click",
        "\\x1b[2J\\x0dover",
    ):
        assert text in out, (text, result.output)


def test_sql_csv_is_verbatim_into_a_pipe(hostile_run):
    result = runner.invoke(
        app,
        [
            "sql",
            str(hostile_run),
            "SELECT prompt_id FROM rollouts WHERE step = 0 ORDER BY prompt_id LIMIT 1",
            "-f",
            "csv",
        ],
    )
    assert result.stdout.splitlines() == ["prompt_id", f"p{TITLE}2"]


def test_sql_errors_are_whole_and_escaped(hostile_run):
    result = runner.invoke(app, ["sql", str(hostile_run), "SELECT * FROM stepz"])
    assert result.exit_code == 1
    assert 'Did you mean "steps"' in result.output and "LINE 1: SELECT * FROM stepz" in result.output
    assert re.search(r"\n +\^+\n", result.output), result.output
    result = runner.invoke(
        app,
        ["sql", str(hostile_run), "SELECT CAST(response_text AS INT) FROM rollouts WHERE response_text LIKE 'answer%'"],
    )
    assert result.exit_code == 1 and "Could not convert string" in result.output
    _no_control_characters(result.output)
    assert "\\x1b]0;pwned\\x07" in result.output


def test_show_prints_tool_output_as_text(hostile_run):
    result = runner.invoke(app, ["show", str(hostile_run), "--width", "400"])
    assert result.exit_code == 0, result.output
    _no_control_characters(result.output)
    best = next(line for line in result.output.splitlines() if line.startswith("best of step 1"))
    assert best.startswith("best of step 1: reward 1.0 (p\\x1b]0;pwned\\x072 #1): answer \\x1b]0;pwned\\x07"), best
    assert "\\x1b[2J\\x0dover" in best and "[link=http://127.0.0.1:9/]rich[/link] [/INST] end" in best


WIDE = "w" * 170


def _wide_query(hostile_run: Path) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "sql", str(hostile_run), f"SELECT '{WIDE}' AS wide", "--max-width", "0"]


def test_table_is_as_wide_as_the_terminal(hostile_run):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"TERM": "xterm"}
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    proc = subprocess.Popen(_wide_query(hostile_run), cwd=REPO, stdout=slave, stderr=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    on_terminal = re.sub(r"\x1b\[[0-9;]*m", "", b"".join(chunks).decode())
    assert WIDE in on_terminal, on_terminal  # one line on a 200-column terminal, not folded at 120
    piped = subprocess.run(_wide_query(hostile_run), cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    lines = piped.stdout.splitlines()
    assert WIDE not in piped.stdout and max(len(line) for line in lines) == 120  # into a pipe: 120 as before


def test_step_artifacts_show_output_as_text_and_the_curves_inside_the_ui(prefect_server, hostile_run):
    """publish_step_artifacts against a real Prefect server: no image, link or HTML from model output in the
    rollouts artifact; the curves artifact is the PNG itself, not a file:// link."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.artifacts import artifact_key, publish_step_artifacts

    flow(name="publish-artifacts")(publish_step_artifacts)(str(hostile_run), "hostile", 1)
    with get_client(sync_client=True) as client:
        found = {
            what: client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key("hostile", what)]))
            )
            for what in ("rollouts", "curves")
        }
    [rollouts], [curves] = found["rollouts"], found["curves"]
    html = MARKDOWN.render(rollouts.data)
    assert "<img" not in html and "<a " not in html and "![m](http://127.0.0.1:9/m.png)" in html, html
    assert curves.type == "markdown" and "file://" not in curves.data
    image = re.fullmatch(
        r"!\[hostile curves\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)\n\nfile: .*curves\\\.png", curves.data
    )
    assert image, curves.data[:200]
    png = base64.b64decode(image.group(1))
    assert _png_width(png) == 9 * DPI and len(png) <= EMBEDDED_PNG_BYTES
    assert png == (hostile_run / "curves.png").read_bytes()
    assert '<img src="data:image/png;base64,' in MARKDOWN.render(curves.data)
