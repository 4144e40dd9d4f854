"""Ctrl+C while the CLI is still importing torch and its commands (the first second or two of
any command) ends in one line and status 130, not a traceback (found by a review)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)


def test_ctrl_c_during_the_clis_imports_is_one_line():
    interrupted_import = textwrap.dedent("""
        import sys

        class CtrlCAtImport:  # as if Ctrl+C came while this module's imports ran
            def find_spec(self, name, path=None, target=None):
                if name == "groundswell.peer.cli":
                    raise KeyboardInterrupt
                return None

        sys.meta_path.insert(0, CtrlCAtImport())
        from groundswell.peer.entry import main
        main()
    """)
    done = subprocess.run([sys.executable, "-c", interrupted_import], capture_output=True, text=True, timeout=100)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "interrupted" and "Traceback" not in done.stderr


def test_the_entry_point_runs_the_cli():
    done = subprocess.run([sys.executable, "-c", "from groundswell.peer.entry import main; main()", "--help"],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0 and "keygen" in done.stdout and "simulate" in done.stdout, done.stderr
