#!/usr/bin/env python3
"""Checks the include graph against the layering DESIGN.md draws (issue 22's doors).

  python3 tools/check_layering.py [SOURCE_ROOT]

Rules, each printed with every offending line when broken (exit 1; 0 when all hold):
  1. A folder includes only the folders below it (ALLOWED): core knows no communicators,
     no pipeline, no plugin; plugins reach the layout through core's doors, never parallel/.
  2. No header outside an internal/ folder includes an internal/ header (a public header
     must not drag implementation details into its users).
  3. Outside plugins/ (and tools/, tests/, which exercise them by name), no code names a
     registered plugin as a string literal: plugins are found through the registry.
"""
import pathlib
import re
import sys

# Which top-level folders each folder's files may include (besides absl, gflags, third party).
ALLOWED = {
    "core": {"core"},
    "parallel": {"core", "parallel"},
    "pipeline": {"core", "parallel", "pipeline"},
    "moe": {"core", "parallel", "moe"},
    "dynamic": {"core", "pipeline", "dynamic"},
    "plugins": {"core", "moe", "plugins"},
}
PROJECT_FOLDERS = {"core", "parallel", "pipeline", "moe", "dynamic", "plugins", "recipes",
                   "tools", "tests"}
NO_PLUGIN_NAMES = ["core", "parallel", "pipeline", "moe", "dynamic", "recipes"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
REGISTER = re.compile(r"FULCRUM_REGISTER_PLUGIN\(\s*([a-z_0-9]+)")


def sources(root, folder):
    for path in sorted((root / folder).rglob("*")):
        if path.suffix in (".h", ".cc") and path.is_file():
            yield path


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    problems = []
    for folder, allowed in ALLOWED.items():
        for path in sources(root, folder):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                top = m.group(1).split("/")[0]
                if top in PROJECT_FOLDERS and top not in allowed:
                    problems.append(f"{path.relative_to(root)}:{n}: {folder}/ may not include "
                                    f"{top}/ ({m.group(1)}); allowed: {', '.join(sorted(allowed))}")
    for folder in PROJECT_FOLDERS:
        for path in sources(root, folder):
            if path.suffix != ".h" or "internal" in path.parts:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                m = INCLUDE.match(line)
                if m and "/internal/" in m.group(1):
                    problems.append(f"{path.relative_to(root)}:{n}: public header includes "
                                    f"{m.group(1)}")
    names = set()
    for path in sources(root, "plugins"):
        if path.suffix == ".cc":
            names.update(REGISTER.findall(path.read_text()))
    for folder in NO_PLUGIN_NAMES:
        for path in sources(root, folder):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("//")[0]
                for name in names:
                    # The moe/ library may say its own name ("moe" as a key prefix).
                    if name != folder and f'"{name}"' in code:
                        problems.append(f"{path.relative_to(root)}:{n}: names the plugin "
                                        f"'{name}' outside plugins/")
    if not names:
        problems.append("no plugin registrations found under plugins/ (wrong SOURCE_ROOT?)")
    for p in problems:
        print(p)
    print(f"check_layering: {len(problems)} problem(s); {len(names)} plugins known")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
