"""The repository stands alone: no tracked file points outside it, and every link of its docs resolves."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a parent-relative or absolute path to a "shared" folder beside the clone (spelt in pieces so that
# this file does not match itself)
OUTSIDE = re.compile(r"\.\./" + "shared" + r"\b|/work/" + "shared" + r"\b")


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f]


def test_no_tracked_file_names_a_path_outside_the_repository():
    offenders = []
    for rel in tracked_files():
        path = os.path.join(ROOT, rel)
        if os.path.islink(path):
            if not os.path.realpath(path).startswith(ROOT + os.sep):
                offenders.append(f"{rel} (a link out of the repository)")
            continue
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
        offenders += [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}" for m in OUTSIDE.finditer(text)]
    assert not offenders, f"files that point outside the repository: {offenders}"


def test_the_check_finds_an_outside_path():
    assert OUTSIDE.search("see ../" + "shared/INTROSPECTION.md")
    assert not OUTSIDE.search("shared the 2 cores; prisma_jax/core/partitioning.py")


# Markdown links of the README and docs/: [text](target), outside code blocks; targets with a scheme are external.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, only word characters, hyphens and spaces kept, spaces → hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose_lines(path: str):
    """(line number, line) of a Markdown file outside its ``` code blocks."""
    in_code = False
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.startswith("```"):
                in_code = not in_code
            elif not in_code:
                yield i, line


def anchors(path: str) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated heading's n-th repeat gets "-n"."""
    out, count = set(), {}
    for _, line in prose_lines(path):
        m = re.match(r"#+ (.*)", line)
        if m:
            s = slug(m.group(1))
            n = count[s] = count.get(s, -1) + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(rel: str, root: str = ROOT) -> list[str]:
    """Links of `rel` (relative to `root`) to a file that does not exist, or to a heading its page lacks."""
    bad = []
    for i, line in prose_lines(os.path.join(root, rel)):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(root, os.path.dirname(rel), path)) if path else os.path.join(root, rel)
            if not os.path.exists(full):
                bad.append(f"{rel}:{i}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                bad.append(f"{rel}:{i}: {target} (no such heading)")
    return bad


def test_every_link_of_the_readme_and_docs_resolves():
    pages = ["README.md"] + [f for f in tracked_files() if f.startswith("docs/") and f.endswith(".md")]
    assert len(pages) > 10
    bad = [b for rel in pages for b in broken_links(rel)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Top\n## The `x` option (v2)\n## Top\n```\n[no](nowhere.md)\n```\n")
    (tmp_path / "README.md").write_text("[ok](docs/a.md#the-x-option-v2) [ok](docs/a.md#top-1) [bad](docs/b.md)\n"
                                        "[bad](docs/a.md#nothing) [ext](https://example.com/x#y)\n")
    assert broken_links("README.md", str(tmp_path)) == ["README.md:1: docs/b.md (no such file)",
                                         "README.md:2: docs/a.md#nothing (no such heading)"]
    assert broken_links("docs/a.md", str(tmp_path)) == []
