"""Reading back what the bench scripts' runs print (imported by bench-loop.sh and
bench-q4km.sh, which run from the repository root with `scripts` on the path)."""


def rows(path):
    """The data rows of `quantmesh-engine-bench --memory-table`'s table in `path`, each a
    list of its 12 cells (the header and the separator left out)."""
    got = []
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 12 and cells[0] != "configuration" \
                and not cells[0].startswith("---"):
            got.append(cells)
    return got


def cpu():
    """This machine's CPU model name, as /proc/cpuinfo gives it."""
    return next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                 if l.startswith("model name")), "?")
