"""mkdocs hook: put the committed benchmark results on the benchmarks page.

`benchmarks/results/<device>/` holds what `python -m benchmarks` wrote on one device
(`results.md`, `results.json`, PNG plots). Every file there is added to the site under
the same path, and the marker line `<!-- benchmark-results -->` in `benchmarks.md`
becomes one section per device: its table, then its plots. Without results the page
says how to make them.
"""

import pathlib
import re

from mkdocs.structure.files import File


RESULTS = pathlib.Path("benchmarks/results")
MARKER = "<!-- benchmark-results -->"
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def _devices() -> list[pathlib.Path]:
    if not RESULTS.is_dir():
        return []
    return sorted(p for p in RESULTS.iterdir() if p.is_dir() and any(p.iterdir()))


def on_files(files, config):
    for device in _devices():
        for path in sorted(device.rglob("*")):
            if path.is_file() and path.suffix != ".md":  # tables go inline
                files.append(
                    File.generated(config, path.as_posix(), abs_src_path=str(path))
                )
    return files


def _rebase(markdown: str, prefix: str) -> str:
    """Make a results file's relative links relative to the benchmarks page."""

    def fix(match):
        target = match.group(2)
        if re.match(r"^([a-z]+:|/|#)", target):
            return match.group(0)
        return f"{match.group(1)}{prefix}/{target}{match.group(3)}"

    return _LINK.sub(fix, markdown)


def _demote(markdown: str) -> str:
    """Drop a results file's title and nest its headings under the device's."""
    markdown = re.sub(r"\A\s*# [^\n]*\n", "", markdown)
    return re.sub(r"^(#+) ", r"#\1 ", markdown, flags=re.MULTILINE)


def _section(device: pathlib.Path) -> str:
    parts = [f"## {device.name}\n"]
    table = device / "results.md"
    text = table.read_text() if table.is_file() else ""
    if text:
        parts.append(_demote(_rebase(text, device.as_posix())))
    for png in sorted(device.glob("*.png")):
        if png.name not in text:  # plots the table does not show already
            parts.append(f"![{png.stem}]({png.as_posix()})")
    data = device / "results.json"
    if data.is_file():
        parts.append(f"Raw data: [`{data.as_posix()}`]({data.as_posix()}).")
    return "\n\n".join(parts)


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    devices = _devices()
    if devices:
        body = "\n\n".join(_section(d) for d in devices)
    else:
        body = (
            '!!! note "No results yet"\n'
            "    No benchmark results are committed under `benchmarks/results/`. "
            "Run `python -m benchmarks --quick` and rebuild the docs."
        )
    return markdown.replace(MARKER, body)
