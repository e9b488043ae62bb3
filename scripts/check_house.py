#!/usr/bin/env python3
"""The house rules a newcomer relies on, checked on the sources (DEVELOPERS.md, "The house"):

- no import circle between the files of a crate: no file imports, directly or through others,
  a file that imports it (an import is a `use`, or a `crate::`/`super::` path in the code,
  resolved through re-exports to the file that defines the name; test modules aside);
- no Rust source file under `crates/*/src` or `src-tauri/src` past 800 lines;
- the engine reads no environment variable (the libraries' own aside: BLAS's thread count in
  `blas.rs`, the temporary folder MLX compiles its CPU kernels in, `kernel_cache.rs`).

    python3 scripts/check_house.py            # exits 1 and says what breaks a rule
    python3 scripts/check_house.py --graph    # also prints every file's imports

What is still to mend is listed in `scripts/house_known.txt` (a line per problem, its file
first): those are reported, not failed, so nothing new slips in meanwhile; a listed problem
that is gone must leave the list too.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 800
ENGINE_ENV_ALLOWED = {"crates/engine/src/blas.rs", "crates/engine/src/kernel_cache.rs"}

ITEM = re.compile(r"^(?:pub(?:\([^)]*\))?\s+)?(?:async\s+|unsafe\s+|const\s+(?=fn))*"
                  r"(?:fn|struct|enum|trait|type|const|static|union)\s+(\w+)", re.M)
MACRO = re.compile(r"^macro_rules!\s*(\w+)", re.M)
MOD = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", re.M)
USE = re.compile(r"^\s*(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", re.M)
PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+)")
TEST_MOD = re.compile(r"#\[cfg\((?:all\()?test\b[^\]]*\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")


def strip(text):
    """The code without comments, string literals and test modules."""
    text = re.sub(r'r(#+)"(.*?)"\1', '""', text, flags=re.S)
    text = re.sub(r'r"[^"]*"', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\])'", "' '", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    while (m := TEST_MOD.search(text)):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        text = text[: m.start()] + text[i:]
    return text


def expand(tree):
    """`a::{b, c::{d, e as f}}` → ['a::b', 'a::c::d', 'a::c::e@f'] (an alias after `@`)."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+", "@", tree))
    if "{" not in tree:
        return [tree]
    head, body = tree[: tree.index("{")], tree[tree.index("{") + 1 : tree.rindex("}")]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(body + ","):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            if body[start:i]:
                parts.append(body[start:i])
            start = i + 1
    return [p for part in parts for p in expand(head + part)]


class Module:
    def __init__(self, path, file):
        self.path, self.file = path, file  # path: tuple of names from the crate root
        self.code = strip(file.read_text())
        self.children = {}
        self.items = set(ITEM.findall(self.code)) | set(MACRO.findall(self.code))
        self.uses = [(bool(m.group(1)), p) for m in USE.finditer(self.code) for p in expand(m.group(2))]
        # Re-exports and imports by the name they bind here (an alias binds its alias).
        self.bound = {}
        for _, p in self.uses:
            name, _, alias = p.partition("@")
            segs = name.split("::")
            self.bound[alias or segs[-1]] = segs


def load_crate(src, root_name):
    modules = {}

    def visit(path, file):
        module = Module(path, file)
        modules[path] = module
        base = file.parent if file.name in ("mod.rs", "lib.rs", "main.rs") else file.parent / file.stem
        for name in MOD.findall(module.code):
            for cand in (base / f"{name}.rs", base / name / "mod.rs"):
                if cand.exists():
                    module.children[name] = visit(path + (name,), cand)
                    break
        return module

    visit((), src / root_name)
    return modules


def resolve(modules, here, segs, seen=()):
    """The file a path names from module `here` (None: outside the crate)."""
    if not segs:
        return None
    first, rest = segs[0], segs[1:]
    if first == "crate":
        module = modules[()]
    elif first == "super" and rest and rest[0] in here.items:
        return here.file  # from an inline module (`mod iokit { use super::… }`) to its file
    elif first == "super":
        module = modules[here.path[:-1]]
    elif first == "self":
        module = here
    elif first in here.children:
        module, rest = here.children[first], rest
        return walk(modules, module, rest, seen)
    elif first in here.bound and (here.path, first) not in seen:
        return resolve(modules, here, here.bound[first] + rest, seen + ((here.path, first),))
    else:
        return None  # another crate, std, or a local name
    while rest and rest[0] == "super":
        module, rest = modules[module.path[:-1]], rest[1:]
    return walk(modules, module, rest, seen)


def walk(modules, module, rest, seen):
    for i, seg in enumerate(rest):
        if seg in module.children:
            module = module.children[seg]
            continue
        if seg in module.items or seg == "*":
            return module.file
        if seg in module.bound and (module.path, seg) not in seen:
            target = resolve(modules, module, module.bound[seg] + rest[i + 1 :], seen + ((module.path, seg),))
            return target or module.file
        return module.file
    return module.file


def imports(modules):
    graph = {}
    for module in modules.values():
        targets = set()
        paths = [p.partition("@")[0].split("::") for _, p in module.uses]
        paths += [[m.group(1)] + m.group(2).split("::")[1:] for m in PATH.finditer(module.code)]
        for segs in paths:
            target = resolve(modules, module, segs)
            if target and target != module.file:
                targets.add(target)
        graph[module.file] = targets
    return graph


def circles(graph):
    """Strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            connect(v)
    return out


def crates():
    for src in sorted(ROOT.glob("crates/*/src")) + [ROOT / "src-tauri/src"]:
        for root_name in ("lib.rs", "main.rs"):
            if (src / root_name).exists():
                yield src, root_name


def main():
    rel = lambda p: str(p.relative_to(ROOT))
    problems = []
    for src, root_name in crates():
        graph = imports(load_crate(src, root_name))
        if "--graph" in sys.argv:
            for f, targets in sorted(graph.items()):
                print(rel(f), "->", ", ".join(sorted(rel(t) for t in targets)))
        for group in circles(graph):
            files = ", ".join(rel(f) for f in group)
            problems.append((f"import circle: {files}", f"import circle ({len(group)} files): {files}"))
    for src, _ in crates():
        for f in sorted(src.rglob("*.rs")):
            n = len(f.read_text().splitlines())
            if n > MAX_LINES:
                problems.append((f"{rel(f)}: too long", f"{rel(f)}: {n} lines (at most {MAX_LINES})"))
    for f in sorted((ROOT / "crates/engine/src").rglob("*.rs")):
        if rel(f) in ENGINE_ENV_ALLOWED:
            continue
        code = strip(f.read_text())
        for m in re.finditer(r"\b(?:std::)?env::(?:var|var_os|vars)\b", code):
            line = code[: m.start()].count("\n") + 1
            problems.append((f"{rel(f)}: reads the environment",
                             f"{rel(f)}: reads the environment (`{m.group(0)}`, near line {line}); the engine takes options"))
    known_file = ROOT / "scripts/house_known.txt"
    known = {l.strip() for l in known_file.read_text().splitlines() if l.strip() and not l.startswith("#")}
    failed = False
    for key, message in dict(problems).items():
        listed = key in known
        print(("known: " if listed else "") + message)
        failed |= not listed
    for k in sorted(known - {key for key, _ in problems}):
        print(f"mended, take it off {rel(known_file)}: {k}")
        failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
