"""Generate the picture at the top of docs/DESIGN.md from the code, and check the concept map.

Two facts are read from the code, never written by hand:

- **Package arrows**: which `prime_rl.<package>` each package imports (AST of `packages/*/src`), with the
  number of modules that do.
- **Process arrows**: the channels between the processes `rl` starts, found by resolving a run the way
  users do (`rl --dry-run`) and matching the ports each component's resolved config names: two components
  that name one port talk over it, and the edge is labelled with both keys.
- **Control arrows**: who sends inference's control port which requests. The weight loads come from the
  transports' lifecycle table (`prime_rl.common.weight_transports.TRANSPORTS`: `loads` names the sender,
  `setup` + `update` the requests), so the push transports' trainer -> inference edge is there although the
  default (filesystem) run resolved above names no port for it; the colocated runs' sleep / wake requests
  (`prime_rl.common.wire.COLOCATED_MESSAGE_TYPES`) from the packages whose code constructs them (AST).

The concept map (the table between the `concept-map` markers) is hand-written; `check_concepts` verifies
that every owner in its owner column (`<package>.<module>.<Symbol>`, short for `prime_rl.<package>...`, or a
whole module) is defined at the top of that module, so a rename or a move fails a test instead of leaving
the map stale.

    python scripts/design_map.py            # print the picture
    python scripts/design_map.py --write    # rewrite it in docs/DESIGN.md
    python scripts/design_map.py --check    # exit 1 if docs/DESIGN.md is stale or the map names a missing owner
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter, defaultdict
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"
PICTURE_BEGIN, PICTURE_END = (
    "<!-- design-map:begin (generated: python scripts/design_map.py --write) -->",
    ("<!-- design-map:end -->"),
)
CONCEPTS_BEGIN, CONCEPTS_END = "<!-- concept-map:begin -->", "<!-- concept-map:end -->"
PROCESSES = ("inference", "orchestrator", "trainer")  # the components `rl` writes a config for
_OWNER = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)*)\.([A-Za-z_][A-Za-z_0-9]*)`")
OWNER_COLUMN = 1  # | concept | owner | arrows |


# --------------------------------------------------------------------------- packages


def packages() -> list[str]:
    return sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "src" / "prime_rl").is_dir())


def package_imports() -> Counter[tuple[str, str]]:
    """(importer, imported) -> number of the importer's modules that import the other package."""
    names = set(packages())
    edges: Counter[tuple[str, str]] = Counter()
    for package in names:
        for path in (ROOT / "packages" / package / "src").rglob("*.py"):
            seen = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    parts = module.split(".")
                    if parts[0] == "prime_rl" and len(parts) > 1 and parts[1] in names and parts[1] != package:
                        seen.add(parts[1])
            for other in seen:
                edges[package, other] += 1
    return edges


# --------------------------------------------------------------------------- processes


def _ports(node: object, key: str = "") -> list[tuple[str, int]]:
    """Every (dotted key, port) a resolved config names: `*port` integers and URLs with a port."""
    found: list[tuple[str, int]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            found += _ports(v, f"{key}.{k}" if key else k)
    elif isinstance(node, list):
        for v in node:
            found += _ports(v, key)
    elif isinstance(node, int) and not isinstance(node, bool) and key.rsplit(".", 1)[-1].endswith("port"):
        found.append((key, node))
    elif isinstance(node, str) and "://" in node:
        try:
            port = urlsplit(node).port
        except ValueError:
            port = None
        if port is not None:
            found.append((key, port))
    return found


def _inference_control_ports(config: dict) -> list[tuple[str, int]]:
    # The control port defaults to the API port + 100 (ServerConfig.resolved_control_port): the
    # resolved file keeps the default (None), so the rule is applied through the config class itself.
    from prime_rl.common.config.inference import ServerConfig

    server = ServerConfig.model_validate({k: v for k, v in config["server"].items() if v != "None"})
    return [("server.control_port", server.resolved_control_port)]


def resolved_configs(model_dir: Path, out: Path) -> dict[str, dict]:
    """Resolve the arithmetic example with `rl --dry-run` (the user's path) and read each process's config."""
    rl = Path(sys.executable).parent / "rl"
    cmd = [str(rl), "@", str(ROOT / "examples/arithmetic/rl.toml"), "--model.name", str(model_dir)]
    cmd += ["--output-dir", str(out), "--dry-run"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=out)
    configs = {p: tomllib.loads(next(out.rglob(f"configs/{p}.toml")).read_text()) for p in PROCESSES}
    return configs


def channels(configs: dict[str, dict]) -> list[tuple[str, str, str]]:
    """(process, process, label) for every port two processes' configs share."""
    by_port: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for process, config in configs.items():
        named = _ports(config) + (_inference_control_ports(config) if process == "inference" else [])
        for key, port in named:
            by_port[port].append((process, key))
    edges = []
    for users in by_port.values():
        processes = sorted({p for p, _ in users})
        if len(processes) != 2:
            continue
        label = " = ".join(sorted(f"{p}.{k}" for p, k in users))
        edges.append((processes[0], processes[1], label))
    return sorted(edges)


# --------------------------------------------------------------------------- control requests


def constructed_names(package: str, names: set[str]) -> set[str]:
    """Which of ``names`` the package's code calls (constructs), read from its AST."""
    found = set()
    for path in (ROOT / "packages" / package / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
                found.add(node.func.id)
    return found


def control_edges(transports: dict, colocated: dict[str, list[str]]) -> list[tuple[str, str, str]]:
    """(sender, "inference", label) for every process that sends inference control requests.

    ``transports``: ``TRANSPORTS`` (name -> row with ``loads``, ``setup``, ``update``): one edge per loader,
    labelled with its transports and their requests in order. ``colocated``: process -> the sleep / wake
    requests its code constructs."""
    by_loader: dict[str, list] = defaultdict(list)
    for row in transports.values():
        by_loader[row.loads].append(row)
    edges = []
    for loader, rows in sorted(by_loader.items()):
        requests = dict.fromkeys(m.__name__ for row in rows for m in (*row.setup, *row.update))
        label = f"{', '.join(row.name for row in rows)} weights: {', '.join(requests)}"
        edges.append((loader, "inference", label))
    for process, names in sorted(colocated.items()):
        if names:
            edges.append((process, "inference", f"colocated: {', '.join(names)}"))
    return edges


def code_control_edges() -> list[tuple[str, str, str]]:
    from prime_rl.common.weight_transports import TRANSPORTS
    from prime_rl.common.wire import COLOCATED_MESSAGE_TYPES

    names = [m.__name__ for m in COLOCATED_MESSAGE_TYPES]
    colocated = {p: [n for n in names if n in constructed_names(p, set(names))] for p in PROCESSES}
    return control_edges(TRANSPORTS, colocated)


# --------------------------------------------------------------------------- picture


def picture(
    edges: Counter[tuple[str, str]], chans: list[tuple[str, str, str]], control: list[tuple[str, str, str]]
) -> str:
    lines = ["```mermaid", "flowchart LR"]
    lines.append('  subgraph packages["packages: arrow = imports"]')
    for a, b in sorted(edges):  # edges only: module counts would go stale with every refactor
        lines.append(f"    pkg_{a}[{a}] --> pkg_{b}[{b}]")
    lines.append("  end")
    title = "processes of one rl run: edge = a port both configs name (rl --dry-run); control arrow = requests sent"
    lines.append(f'  subgraph processes["{title}"]')
    lines.append("    launcher([rl launcher]) -.starts.-> inference & orchestrator & trainer")
    for a, b, label in chans:
        lines.append(f'    {a}(({a})) ---|"{label}"| {b}(({b}))')
    for a, b, label in control:
        lines.append(f'    {a}(({a})) -->|"control: {label}"| {b}(({b}))')
    lines.append("  end")
    lines.append("```")
    return "\n".join(lines)


def generate() -> str:
    from prime_rl.common.testing import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="design-map-") as tmp:
        model = make_tiny_model(Path(tmp) / "tiny")
        configs = resolved_configs(model, Path(tmp))
    return picture(package_imports(), channels(configs), code_control_edges())


def _between(text: str, begin: str, end: str) -> str:
    if begin not in text or end not in text:
        raise SystemExit(f"{DESIGN}: markers {begin!r} / {end!r} not found; put them back around the section")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


# --------------------------------------------------------------------------- concept map


def module_path(module: str) -> Path | None:
    """`<package>.a.b` -> packages/<package>/src/prime_rl/<package>/a/b.py (or its __init__.py)."""
    base = ROOT / "packages" / module.split(".")[0] / "src" / "prime_rl" / Path(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def check_concepts(text: str) -> list[str]:
    """Each owner the concept map names that does not exist, as one line each (empty: all exist)."""
    table = _between(text, CONCEPTS_BEGIN, CONCEPTS_END)
    problems, owners = [], 0
    for row in table.splitlines()[2:]:  # below the header and its rule
        cells = row.strip().strip("|").split("|")
        if len(cells) != 3:
            problems.append(f"concept map row {row!r} has {len(cells)} cells; write | concept | owner | arrows |")
            continue
        owner = cells[OWNER_COLUMN]
        if owner.count("`") != 2 * len(_OWNER.findall(owner)):
            problems.append(f"concept map owner cell {owner.strip()!r}: write each owner `<package>.<module>.<Symbol>`")
        for module, symbol in _OWNER.findall(owner):
            owners += 1
            path = module_path(module)
            if module_path(f"{module}.{symbol}") is not None:
                continue  # the owner is a whole module
            if path is None:
                problems.append(f"concept map names {module}.{symbol}: no module {module} under packages/")
            elif symbol not in _top_level_names(path):
                problems.append(f"concept map names {module}.{symbol}: {path.relative_to(ROOT)} defines no {symbol}")
    if owners == 0:
        problems.append("concept map names no owner (`<package>.<module>.<Symbol>`)")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the picture in docs/DESIGN.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/DESIGN.md is stale")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    new = generate()
    text = DESIGN.read_text()
    if args.write:
        _between(text, PICTURE_BEGIN, PICTURE_END)  # both markers are there
        head, rest = text.split(PICTURE_BEGIN, 1)
        DESIGN.write_text(f"{head}{PICTURE_BEGIN}\n{new}\n{PICTURE_END}{rest.split(PICTURE_END, 1)[1]}")
        return 0
    if args.check:
        problems = check_concepts(text)
        if _between(text, PICTURE_BEGIN, PICTURE_END) != new:
            problems.append("docs/DESIGN.md's picture is stale: run `python scripts/design_map.py --write`")
        print(json.dumps({"ok": not problems, "problems": problems}))
        return 1 if problems else 0
    print(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
