"""The report as one list of blocks (headings, paragraphs, tables, code, images), rendered to Markdown and to
HTML: the same content in both."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass

from launcher.tables import markdown_table


@dataclass(frozen=True)
class Block:
    """A heading (level > 0), a paragraph (`text`), a table (`header` + `rows`), code (`code`) or an image
    (`image`: a file beside the report)."""

    text: str = ""
    level: int = 0
    header: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    code: str | None = None
    image: str | None = None


def to_markdown(blocks: Sequence[Block]) -> str:
    """The blocks as Markdown."""
    out = []
    cell = lambda s: s.replace("|", "\\|").replace("\n", "<br>")  # noqa: E731
    for b in blocks:
        if b.level:
            out.append("#" * b.level + " " + b.text)
        elif b.header:
            out.append(
                "\n".join(
                    markdown_table([cell(h) for h in b.header], [[cell(c) for c in row] for row in b.rows])
                )
            )
        elif b.code is not None:
            out.append((f"{b.text}\n\n" if b.text else "") + "```bash\n" + b.code.rstrip("\n") + "\n```")
        elif b.image is not None:
            out.append(f"![{b.text}]({b.image})")
        else:
            out.append(b.text)
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def to_html(blocks: Sequence[Block], title: str) -> str:
    """The blocks as one HTML page (inline style; images by file name, beside it)."""
    body = []
    for b in blocks:
        if b.level:
            body.append(f"<h{b.level}>{_inline(b.text)}</h{b.level}>")
        elif b.header:
            head = "".join(f"<th>{_inline(h)}</th>" for h in b.header)
            rows = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in b.rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif b.code is not None:
            body.append((f"<p>{_inline(b.text)}</p>" if b.text else "") + f"<pre>{html.escape(b.code)}</pre>")
        elif b.image is not None:
            body.append(
                f'<figure><img src="{html.escape(b.image)}" alt="{html.escape(b.text)}">'
                f"<figcaption>{_inline(b.text)}</figcaption></figure>"
            )
        else:
            body.append(f"<p>{_inline(b.text)}</p>")
    style = (
        "body{font-family:sans-serif;max-width:1200px;margin:2em auto;line-height:1.4}table{border-collapse:"
        "collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #bbb;padding:3px 7px;text-align:right}"
        "th{background:#eee}td:first-child{text-align:left}img{max-width:100%}pre{background:#f3f3f3;padding:"
        "8px;white-space:pre-wrap;word-break:break-all}code{background:#f3f3f3;padding:0 3px}"
    )
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
