#!/usr/bin/env python3
"""tools/check_layering.py: the real tree passes, and a tree with each kind of break fails
naming the file and the rule (a checker that passes everything would fail here).

  python3 tests/tools/check_layering_test.py SOURCE_ROOT
"""
import pathlib
import subprocess
import shutil
import sys
import tempfile
import unittest

ROOT = pathlib.Path(sys.argv.pop(1) if len(sys.argv) > 1 else ".").resolve()
CHECKER = ROOT / "tools" / "check_layering.py"


def run(root):
    out = subprocess.run([sys.executable, str(CHECKER), str(root)], capture_output=True,
                         text=True)
    return out.returncode, out.stdout + out.stderr


class CheckLayeringTest(unittest.TestCase):
    def test_the_tree_keeps_its_layering(self):
        code, out = run(ROOT)
        self.assertEqual(code, 0, out)
        self.assertIn("0 problem(s)", out)

    def tree(self, files):
        # A minimal tree: one registered plugin plus the files under test.
        d = pathlib.Path(tempfile.mkdtemp(prefix="layering_"))
        self.addCleanup(shutil.rmtree, d, ignore_errors=True)
        base = {"plugins/freeze.cc": 'FULCRUM_REGISTER_PLUGIN(freeze, "help", (x));\n'}
        for name, text in {**base, **files}.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(text)
        return d

    def expect_problem(self, files, *needles):
        code, out = run(self.tree(files))
        self.assertEqual(code, 1, out)
        for needle in needles:
            self.assertIn(needle, out)

    def test_a_plugin_including_parallel_fails(self):
        self.expect_problem({"plugins/x.cc": '#include "parallel/communicator.h"\n'},
                            "plugins/x.cc:1", "may not include parallel/")

    def test_core_including_pipeline_fails(self):
        self.expect_problem({"core/y.h": '#include "pipeline/schedule.h"\n'},
                            "core/y.h:1", "may not include pipeline/")

    def test_a_public_header_including_internal_fails(self):
        self.expect_problem({"pipeline/p.h": '#include "pipeline/internal/q.h"\n'},
                            "pipeline/p.h:1", "public header includes")
        # ... but an internal header or a .cc may.
        code, out = run(self.tree({"pipeline/internal/a.h": '#include "pipeline/internal/b.h"\n',
                                   "pipeline/p.cc": '#include "pipeline/internal/q.h"\n'}))
        self.assertEqual(code, 0, out)

    def test_naming_a_plugin_outside_plugins_fails(self):
        self.expect_problem({"recipes/r.cc": 'if (name == "freeze") {}\n'},
                            "recipes/r.cc:1", "names the plugin 'freeze'")
        # A comment may name it.
        code, out = run(self.tree({"recipes/r.cc": '// the "freeze" plugin\n'}))
        self.assertEqual(code, 0, out)


if __name__ == "__main__":
    unittest.main()
