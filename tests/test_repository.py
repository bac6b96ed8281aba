"""The repository stands alone: no tracked file points outside it."""
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
    assert not OUTSIDE.search("shared the 2 cores; prisma_jax/sharding.py")
